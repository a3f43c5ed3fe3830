"""Dropout that keeps, for backward, one bit per element (``bits``) or an 8-byte seed (``seed``) instead of
stock's float mask.

Stock dropout on CPU computes ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`` from the default
generator and returns ``x * noise``; autograd keeps ``noise``, as large as the input. The *policy* says
what slimgrad keeps instead:

* ``"bits"``: the mask is drawn exactly as stock draws it (``bernoulli_(1 - p)`` from the default
  generator into ``empty_like(x, dtype=uint8)``, which consumes the generator as stock's float draw does),
  so on CPU the mask, the output and the gradient are **bitwise stock's** for the same seed; it is kept
  packed, 1/32 of stock's fp32 noise, and backward draws nothing. Made and read by the ``dropout_bits``
  kernel family (:mod:`slimgrad.kernels.dropout`).
* ``"seed"``: an 8-byte seed from the default generator; the mask is regenerated in backward
  (``dropout_seed`` family: Philox on the element index, Triton's ``tl.rand`` stream, made by Triton's kernel on
  CUDA, the core's on CPU, torch's integer ops elsewhere: the same mask for a seed on every backend and device).
  Keeps nothing input-sized, pays a second draw; the mask is not stock's.
* ``"auto"`` (default): ``bits`` on CPU (a second ``bernoulli_`` is the slow part of CPU dropout: measured
  in ``docs/benchmarks.md``), ``seed`` elsewhere.

Set it per model (``convert(model, dropout="bits")``), per call (``dropout(x, p, policy="seed")``), or for
the process (:func:`set_dropout_policy`, ``with dropout_policy("seed"):``; what ``enabled()`` and LoRA use).

Either way ``torch.manual_seed`` makes runs reproducible, successive calls differ, and activation
checkpointing (which restores the default generators' state before recomputing) rebuilds the same mask.
The mask is the same whether or not a gradient is requested (reentrant checkpointing runs the forward
without grad and recomputes it with grad). Feature dropout (``dropout1d/2d/3d``) is stock's own: it keeps
one value per (sample, channel), nothing worth saving.

Under ``torch.compile`` the mask is drawn from the default generator (Inductor's RNG) and kept packed, one
bit per element (``_bitmask.pack_planar``, the layout Inductor fuses into the dropout kernel).

Eager CPU calls with the "bits" policy (the default there) run the compiled core (:mod:`slimgrad.csrc`,
``csrc/dropout.cpp``): after a few checks, one call into a C++ autograd Function that draws the mask with the
same aten call as the Python Function (so the generator ends in stock's state), applies and packs it in one
parallel pass, and keeps the same packed bits; the scale is computed once per ``(p, dtype)``. The Python
Function stays for torch.compile, torch.func, the "seed" policy, other devices and a core that is off
(``SLIMGRAD_CORE=0``) or unbuilt; it is the reference the core is tested against bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from slimgrad import csrc
from slimgrad.functional import _common, _layout
from slimgrad.functional._common import check_tensor
from slimgrad.kernels import bitmask as _bitmask
from slimgrad.kernels import dropout as kernels
from slimgrad.kernels import registry

__all__ = ["dropout", "dropout1d", "dropout2d", "dropout3d", "POLICIES", "set_dropout_policy",
           "get_dropout_policy", "dropout_policy", "resolve_policy"]

_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."

POLICIES = ("auto", "bits", "seed")
_POLICY = "auto"

# What backward was left: packed bits, the seed, planar-packed bits (under torch.compile), or nothing (p == 1).
_BITS, _SEED, _MASK, _ZERO = "bits", "seed", "mask", "zero"


def check_policy(value, *, source: str) -> str:
    if value not in POLICIES:
        raise ValueError(f"slimgrad: {source} must be one of {', '.join(map(repr, POLICIES))}, got {value!r}")
    return value


#: The attribute ``convert(model, dropout=...)`` sets on each converted module (dropout and LoRA layers).
POLICY_ATTRIBUTE = "_slimgrad_dropout_policy"


def module_policy(module) -> str | None:
    """The policy ``convert(dropout=...)`` gave ``module``, or None (then the process-wide one applies)."""
    return module.__dict__.get(POLICY_ATTRIBUTE)  # no nn.Module.__getattr__ miss


def set_dropout_policy(value: str) -> None:
    """The process-wide dropout policy ("auto", "bits", "seed"), used where no module or call sets one."""
    global _POLICY
    _POLICY = check_policy(value, source="set_dropout_policy's argument 'value'")


def get_dropout_policy() -> str:
    return _POLICY


@contextlib.contextmanager
def dropout_policy(value: str):
    """Temporarily set the process-wide dropout policy."""
    old = _POLICY
    set_dropout_policy(value)
    try:
        yield
    finally:
        set_dropout_policy(old)


def resolve_policy(policy, device: torch.device) -> str:
    """"bits" or "seed" for a call on ``device`` (``policy`` None: the process-wide one)."""
    policy = _POLICY if policy is None else policy
    if policy == "auto":
        return "bits" if device.type in ("cpu", "meta") else "seed"
    return policy


def _draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed from ``device``'s default generator, as an int64 scalar tensor on that device."""
    return torch.empty((), dtype=torch.int64, device=device).random_()


def _fill_noise(noise: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """``noise`` filled with the seeded noise (:func:`slimgrad.kernels.dropout.philox_noise`), element by element in
    logical (row-major) order whatever ``noise``'s layout.

    Why that order: LoRA draws its forward noise like x (``empty_like``: a transposed or channels-last x gives a
    permuted tensor) and backward rebuilds it for a contiguous gradient; the mask must be the same function of the
    logical index in both (drawn in memory order, the two masks differed for such an x)."""
    # (on fakes too: the estimate sees its allocations)
    if noise.is_contiguous():
        return kernels.philox_noise(noise, p, seed, out=noise)
    return noise.copy_(kernels.philox_noise(noise, p, seed))


def _apply_noise(input, noise, inplace):
    return input.mul_(noise) if inplace else input * noise


def _memory_order(t: torch.Tensor):
    """The permutation that makes the dense tensor ``t`` contiguous (channels_last and the like)."""
    if t.is_contiguous():
        return None
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def _inverse(perm):
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return inverse


def _canonical(t: torch.Tensor, perm):
    """``t`` in the kernels' contiguous layout: permuted (a view when ``t`` is laid out like the mask)."""
    v = t if perm is None else t.permute(perm)
    return v if v.is_contiguous() else v.contiguous()


def _finish(input, out, perm, inplace):
    """Map the kernel's contiguous result back to ``input``'s shape (and into ``input`` when in place)."""
    if inplace:
        view = input if perm is None else input.permute(perm)
        same = torch._C._is_alias_of(out, view) and out.storage_offset() == view.storage_offset()
        if not same or out.stride() != view.stride():  # not data_ptr(): fake tensors (slimgrad.estimate) have none
            view.copy_(out)  # the kernel worked on a contiguous copy of a non-dense input
        return input
    return out if perm is None else _common.not_a_view(out.permute(_inverse(perm)))


def bits_forward(input: torch.Tensor, p: float, inplace: bool):
    """Draw stock's mask, apply it through the ``dropout_bits`` family; returns (out, packed, perm, scale)."""
    # simulating the core's own draw (slimgrad.estimate, core_draw_simulated): in x's dtype, as csrc/dropout.cpp's
    # draw_and_apply draws it, so the simulated mask has its bytes
    keep = torch.empty_like(input, dtype=None if _SIMULATED["core_draw"] else torch.uint8).bernoulli_(1 - p)
    perm = _memory_order(keep)
    keep = _canonical(keep, perm)
    scale = kernels.noise_scale(p, input.dtype)
    xc = _canonical(input, perm)
    out, packed = _bits_impl(xc).forward(xc, keep, scale, inplace)
    return _finish(input, out, perm, inplace), packed, perm, scale


def bits_layout(input: torch.Tensor, p: float, dtype: torch.dtype):
    """The ``(perm, scale)`` :func:`bits_forward` used on ``input`` (or on a cast ``input.to(dtype)``, which
    has ``input``'s layout), without its tensors: the mask's memory order and the noise value."""
    if input.is_contiguous():
        perm = None
    else:  # the layout empty_like(input) gives the mask: input's own where dense, else the suggested one
        perm = _memory_order(torch.empty_like(input, dtype=torch.uint8, device="meta"))
    return perm, kernels.noise_scale(p, dtype)


def bits_backward(grad: torch.Tensor, packed: torch.Tensor, perm, scale: float, *, inplace: bool = False):
    """``grad * noise`` from the packed mask; ``inplace``: written into ``grad`` (a fresh tensor of the
    caller's) when its layout allows, which saves a gradient-sized temporary."""
    g = _canonical(grad, perm)
    out = g if inplace and torch._C._is_alias_of(g, grad) else None  # a view of grad, not a copy (no data_ptr:
                                                                      # fake tensors have none)
    gi = _bits_impl(g).backward(g, packed, scale, out)
    return gi if perm is None else gi.permute(_inverse(perm))


# --- slimgrad.estimate on CPU: what the compiled core allocates, on fake tensors ---------------------------------
#
# The core reads data in C++ and cannot run on fake tensors, so the simulated step runs the Python path, whose torch
# reference allocates other transients than the core (a one-byte mask, float noise, packing temporaries): a plain
# nn.Dropout's estimate was 8 KiB high at its backward peak. Where a real tensor's call would run the core, the
# fake one now allocates what the core allocates, in its order: the mask drawn in x's dtype (the core's own draw,
# _SIMULATED["core_draw"], set by the callers that stand in for its Functions), then the kernels' outputs.

_SIMULATED = {"core_draw": False}


def is_simulated_core(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake CPU tensor (``slimgrad.estimate``'s simulated step) whose real counterpart's eager
    call would reach the compiled core: the core on and built, no compile trace or torch.func transform."""
    if type(t) is torch.Tensor or t.device.type != "cpu":
        return False
    from torch._subclasses.fake_tensor import is_fake

    if not is_fake(t) or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return csrc.enabled() and csrc.core() is not None


def _bits_impl(t: torch.Tensor):
    """The ``dropout_bits`` kernel for ``t``; for a fake tensor whose real one would get the core's kernel, its
    allocations' simulation."""
    if type(t) is not torch.Tensor and registry.simulates_core(kernels.BITS, t):
        return _CORE_SIM
    return kernels.choose_bits(t)


class _CoreBitsSimulation:
    """The ``dropout_bits`` contract with the compiled core's allocations and no data (csrc/dropout.cpp): forward
    makes its output (unless in place) then the packed bits, backward its gradient unless given ``out``."""

    name = "core-simulation"

    @staticmethod
    def forward(x, keep, scale, inplace):
        out = x if inplace else torch.empty_like(x)
        return out, torch.empty(_bitmask.packed_numel(x.numel()), dtype=torch.uint8, device=x.device)

    @staticmethod
    def backward(grad, packed, scale, out=None):
        return torch.empty_like(grad) if out is None else out


_CORE_SIM = _CoreBitsSimulation()


@contextlib.contextmanager
def core_draw_simulated():
    """Inside, :func:`bits_forward` draws its mask as the core's Functions draw it (in x's dtype): for the fake
    branches that stand in for those Functions (dropout's here, LoRA's)."""
    old = _SIMULATED["core_draw"]
    _SIMULATED["core_draw"] = True
    try:
        yield
    finally:
        _SIMULATED["core_draw"] = old


# An eager in-place call hands ``kept`` to setup_context through ``_common.EAGER_HANDOFF`` instead of as a second
# output (MobileNetV2's in-place classifier dropout works on the pooled view; the compiled core, a C++ Function,
# returns one tensor).
_PENDING = _common.EAGER_HANDOFF


class _DropoutFunction(_common.Function):
    """Element-wise dropout for 0 < p <= 1 in training mode: ``apply`` returns ``(out, kept)``, ``kept`` the
    packed mask, the seed or None (p == 1), an output so that the same Function serves eager and torch.compile
    (functorch's form, :mod:`slimgrad.functional._transforms`). Under a transform stock's dropout runs
    (``stock``): vmap's randomness rules are stock's draw."""

    @staticmethod
    def forward(input, p, inplace, policy):
        if p == 1:
            # stock multiplies by a zero scalar, drawing nothing
            out = _apply_noise(input, torch.zeros((), dtype=input.dtype, device=input.device), inplace)
            kept = None
        elif torch.compiler.is_compiling():
            # Compiled stock's own op (nn.Dropout traces to it), so the step draws compiled stock's mask: Inductor
            # decomposes it (rand_like(x) > p, mask * x * scale), or with torch._inductor.config.fallback_random
            # runs eager's kernel, as for stock (where a rand_like written here drew another mask). The eager
            # formula, empty_like(x).bernoulli_(1 - p), gave NaN outputs once Inductor compiled it inside a
            # diffusers UNet with peft LoRA dropout (aot_eager was finite).
            out, keep = torch.ops.aten.native_dropout(input, p, True)
            kept = _bitmask.pack_planar(keep, _bitmask.planar_layout(input))
            if inplace:
                out = input.copy_(out)
        elif policy == "bits":
            out, kept, _, _ = bits_forward(input, p, inplace)
        else:
            kept = _draw_seed(input.device)
            perm = _memory_order(input) if _dense(input) else None
            xc = _canonical(input, perm)
            # backward regenerates the mask with this same kernel (_PENDING.seed_impl, kept by setup_context)
            impl = _PENDING.seed_impl = kernels.choose_seed(xc)
            out = _finish(input, impl.forward(xc, p, kept, inplace), perm, inplace)
        # In place: ``input`` itself (torch.compile checks that a dirty tensor is returned as the same object).
        if inplace and not torch.compiler.is_compiling():
            _PENDING.kept = kept
            return input
        return input if inplace else out, kept

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, p, inplace, policy = inputs
        if type(output) is tuple:
            kept = output[1]
            if kept is not None:
                ctx.mark_non_differentiable(kept)
        else:  # an eager in-place call: see _PENDING
            kept, _PENDING.kept = _PENDING.kept, None
        if inplace:
            ctx.mark_dirty(input)
        ctx.p = p
        if kept is None:
            ctx.mode = _ZERO
            return
        if torch.compiler.is_compiling():
            ctx.mode = _MASK
            ctx.shape, ctx.order = tuple(input.shape), _bitmask.planar_layout(input)
        elif policy == "bits":
            ctx.mode = _BITS
            ctx.perm, ctx.scale = bits_layout(input, p, input.dtype)
        else:
            ctx.mode = _SEED
            ctx.perm = _memory_order(input) if _dense(input) else None
            ctx.seed_impl, _PENDING.seed_impl = _PENDING.seed_impl, None
        if ctx.mode != _MASK:
            ctx.noise_strides = _layout.like_strides(input)  # stock's noise is empty_like(input)
            # ``kept`` never receives a gradient: no zero-filled one for backward (out's is always defined there)
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(kept)

    @staticmethod
    def backward(ctx, grad, *_grad_kept):
        if grad is None:  # undefined (not materialized: see setup_context), e.g. gradcheck's undefined-grad check
            return None, None, None, None
        if ctx.mode == _ZERO:
            return grad * torch.zeros((), dtype=grad.dtype, device=grad.device), None, None, None
        (saved,) = ctx.saved_tensors
        if ctx.mode == _MASK:  # as native_dropout_backward's decomposition
            mask = _bitmask.unpack_planar(saved, ctx.shape, ctx.order)
            return grad * (mask.to(grad.dtype) * (1.0 / (1.0 - ctx.p))), None, None, None
        if ctx.mode == _BITS:
            if grad.requires_grad:  # double backward: stay differentiable in grad
                g = _canonical(grad, ctx.perm)
                noise = _bitmask.unpack(saved, g.shape).to(grad.dtype).mul_(ctx.scale)
                gi = g * noise
                gi = gi if ctx.perm is None else gi.permute(_inverse(ctx.perm))
            else:
                gi = bits_backward(grad, saved, ctx.perm, ctx.scale)
        else:
            g = _canonical(grad, ctx.perm)
            if torch.compiler.is_compiling() or grad.requires_grad:
                # compiled autograd over an eager forward: the forward's kernel by name, through an opaque op (the
                # registry answers the torch reference while tracing: another generator, another mask); double
                # backward: the op is differentiable in grad, a Triton kernel's result was not (no graph, silently)
                gi = kernels.traced_seed_apply(g, ctx.p, saved, ctx.seed_impl.name)
            else:
                gi = ctx.seed_impl.backward(g, ctx.p, saved)
            gi = gi if ctx.perm is None else gi.permute(_inverse(ctx.perm))
        # Stock's gradient is ``grad * noise``: TensorIterator lays it out after grad first, then noise.
        gi = _layout.conform(gi, _layout.binary_strides(tuple(grad.shape), grad.stride(), ctx.noise_strides))
        return gi, None, None, None

    @staticmethod
    def stock(input, p, inplace, policy):
        # apply's structure: the output first (nothing kept of slimgrad's)
        return F.dropout(input, p, True, inplace), None

    @classmethod
    def under_transform(cls, *args):
        # vmap's randomness rules ("different", "same", "error") are implemented by stock's dropout.
        return cls.stock(*args)


def _dense(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return True
    perm = _memory_order(t)
    return t.permute(perm).is_contiguous()


def _dropout_impl(input, p, training, inplace, policy=None):
    """Stock's ``_dropout_impl`` with slimgrad's mask keeping: identity for p == 0, eval mode or empty
    input."""
    if p == 0 or not training or input.numel() == 0:
        return input  # stock returns the input itself here
    if policy is not None:
        check_policy(policy, source="dropout's argument 'policy'")
    if (not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()) or \
            _common.foreign_input(input):
        # Under torch.func dropout is stock's op, with or without a gradient (vmap and jvp hand their wrapped
        # tensors here with requires_grad False): the kernels cannot read a wrapped tensor's data, and vmap's
        # randomness rules are stock's draw. So for a tensor subclass (DTensor, NestedTensor, ...): stock's op.
        return torch.dropout_(input, p, training) if inplace else torch.dropout(input, p, training)
    policy = resolve_policy(policy, input.device)
    if policy == "seed" and input.numel() * (input.element_size() if input.is_cpu else 1) < 8:
        # The seed's 8 bytes would be more than stock's mask (a float noise value an element on CPU, a bool on CUDA;
        # a 1-element fp32 tensor: 4 B; the degenerate-shapes sweep): the bits policy, under 8 B by construction.
        policy = "bits"
    if torch.is_grad_enabled() and input.requires_grad:
        if inplace and input.is_leaf:
            raise RuntimeError(_LEAF_INPLACE)
        if inplace and _common.traced_inplace_on_view(input):
            # out of place, then copied into the view (the same values; the copy's backward is identity)
            return input.copy_(_DropoutFunction.apply(input, float(p), False, policy)[0])
        if torch.compiler.is_compiling():
            out = _DropoutFunction.apply(input, float(p), bool(inplace), policy)
            return out if type(out) is not tuple else out[0]
        # Eager: _common.Function.apply's eager branch called directly (torch's C apply, the input unwrapped as its
        # unwrap_dead_wrappers does), without its generic argument handling (the Python path is CUDA's).
        out = _C_APPLY(_DropoutFunction, _unwrap_if_dead(input), float(p), bool(inplace), policy)
        return out if type(out) is not tuple else out[0]
    # No gradient: the same mask all the same (checkpoint recomputes this call with grad).
    if p == 1:
        return _apply_noise(input, torch.zeros((), dtype=input.dtype, device=input.device), inplace)
    if torch.compiler.is_compiling():
        # Nothing is kept without a gradient: stock's op, traced as compiled stock traces it (its draw). The
        # noise formula of eager (empty_like(x).bernoulli_) gave NaN outputs once compiled inside a diffusers
        # UNet with peft LoRA dropout (Inductor; aot_eager was finite), where stock's op did not.
        return torch.dropout_(input, p, True) if inplace else torch.dropout(input, p, True)
    if policy == "bits" and input.is_cpu:
        # nothing kept, so stock's op: on CPU its draw is the "bits" policy's (a reentrant checkpoint recomputing
        # this call with grad draws the same mask); bits_forward's packed mask beside the draw set a peak above
        # stock's. (Elsewhere stock's fused kernel draws otherwise: bits_forward, so the recomputation matches.)
        return torch.dropout_(input, p, True) if inplace else torch.dropout(input, p, True)
    if policy == "bits":
        return bits_forward(input, p, inplace)[0]
    seed = _draw_seed(input.device)
    perm = _memory_order(input) if _dense(input) else None
    xc = _canonical(input, perm)
    return _finish(input, kernels.choose_seed(xc).forward(xc, p, seed, inplace), perm, inplace)


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead
_CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CORE_POLICIES = ("auto", "bits")  # on the CPU both are "bits"


def _core(input, p, policy):
    """The compiled core when this call may run it (eager CPU, "bits", 0 < p <= 1, a non-empty float input)."""
    if type(input) is not torch.Tensor or (_POLICY if policy is None else policy) not in _CORE_POLICIES:
        return None
    core = csrc.for_eager(input)
    if core is None or not (type(p) is float and 0.0 < p <= 1.0) or input.dtype not in _CORE_DTYPES:
        return None
    return core if input.numel() else None


def _core_simulated(input, p, policy) -> bool:
    """:func:`_core`'s answer for the real tensor a fake ``input`` stands for (slimgrad.estimate)."""
    return ((_POLICY if policy is None else policy) in _CORE_POLICIES and type(p) is float and 0.0 < p <= 1.0
            and input.dtype in _CORE_DTYPES and input.numel() > 0 and is_simulated_core(input))


def _check(input, p, fn):
    check_tensor(input, "input", fn=fn)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, policy: str | None = None
) -> torch.Tensor:
    """``F.dropout`` keeping 1 bit per element (policy "bits", bitwise stock's mask on CPU) or an 8-byte
    seed ("seed") for backward instead of an input-sized float mask; ``policy=None``: the process-wide
    one (default "auto": bits on CPU and meta, seed elsewhere)."""
    if type(training) is not bool:  # ("no" was read as True; stock's F.dropout only tests inplace's truth)
        training = _common.check_flag(training, "training", fn="dropout")
    if training and (core := _core(input, p, policy)) is not None:
        return core.dropout_apply(input, p, inplace)
    _check(input, p, "dropout")
    if training and _core_simulated(input, p, policy):
        with core_draw_simulated():  # the C++ Function's allocations (slimgrad.estimate's fake tensors)
            return _dropout_impl(input, p, training, inplace, policy=policy)
    return _dropout_impl(input, p, training, inplace, policy=policy)


def dropout1d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout1d`` itself: stock keeps one noise value per (sample, channel), nothing to save."""
    return F.dropout1d(input, p, training, inplace)


def dropout2d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout2d`` itself: stock keeps one noise value per (sample, channel), nothing to save."""
    return F.dropout2d(input, p, training, inplace)


def dropout3d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout3d`` itself: stock keeps one noise value per (sample, channel), nothing to save."""
    return F.dropout3d(input, p, training, inplace)
