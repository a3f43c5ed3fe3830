"""A linear layer plus LoRA adapters in one autograd Function that keeps only what the requested
gradients read.

Stock PEFT computes ``base(x) + B(A(dropout(x.to(A.dtype)))) * scaling`` with separate autograd nodes, and
in a bf16 model whose adapters were upcast to fp32 (PEFT's default) every adapted layer keeps its own fp32
copy of x for dA, although the q/k/v projections all read the same bf16 x. With dropout it keeps, per
adapter, the float noise *and* the dropped input. What the gradients actually read:

* dX: W, A, B (parameters) and the dropout masks. No activation.
* dW (only when the user unfroze the base weight): x.
* dA: dropout(x) in the adapter dtype, rebuilt in backward from x (kept once, in its own dtype) and the
  mask, regenerated from an 8-byte seed.
* dB: ``xa = A(dropout(x))``, r columns per row; kept because it is small and costly to rebuild.
* biases: nothing.

Eager CPU calls (no autocast) run the compiled core instead (:mod:`slimgrad.csrc`, ``csrc/lora.cpp``): one C++
autograd Function per call, this Function's forward and backward op for op through aten (same matmuls, casts and
sums, so the same bits), the adapters' dropout under the "bits" policy (the default there) drawn by stock's call
and applied and packed in one pass (``csrc/dropout.cpp``), under "seed" the same seeds this Function draws and the
same Philox mask regenerated in one pass (``csrc/dropout_seed.cpp``), saving exactly what this Function saves.
Eager CUDA calls whose adapters do not drop (p 0, eval, or 1) run it too: there it is aten's ops alone,
dispatched to CUDA, without the Python Function's per-call host cost (``SLIMGRAD_CORE_CUDA=0`` turns that off).
The Python Function stays for torch.compile, torch.func, autocast, dropping adapters on CUDA (the "seed" policy
with Triton's kernel), other devices and a core that is off or unbuilt, and is the reference the core is tested
against.

The forward runs PEFT's own ops in PEFT's order (``F.linear`` / ``addmm``, the same casts, the same
left-to-right sum), so outputs are bitwise PEFT's. Backward runs the matrix products autograd runs for
those ops (``mm`` with the same operand layouts), so gradients are bitwise too on CPU, x's included: its
gradients are handed over in peft's order (the base layer's apart, and with several dropping adapters on an uncast
x one Function per adapter: ``adapters_apart``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from slimgrad import csrc
from slimgrad.functional import _common
from slimgrad.functional.dropout import (
    _SIMULATED,
    _fill_noise,
    bits_backward,
    bits_forward,
    bits_layout,
    check_policy,
    core_draw_simulated,
    is_simulated_core,
    resolve_policy,
)
from slimgrad.kernels import bitmask as _bitmask
from slimgrad.kernels import dropout as dropout_kernels

__all__ = ["LoraAdapter", "LoraLinearFunction", "lora_linear"]


class LoraAdapter(NamedTuple):
    """One adapter: ``B(A(dropout(x))) * scaling`` with A [r, in], B [out, r], optional B bias [out]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float = 1.0
    dropout: float = 0.0
    bias: torch.Tensor | None = None


def _base_forward(x, weight, bias, fan_in_fan_out):
    if not fan_in_fan_out:
        return F.linear(x, weight, bias)
    # transformers' Conv1D.forward (GPT-2): weight is [in, out]
    out = torch.addmm(bias, x.view(-1, x.size(-1)), weight) if bias is not None else x.view(-1, x.size(-1)).mm(weight)
    return out.view(x.size()[:-1] + (weight.size(1),))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


#: LoraLinearFunction's argument index of A_0 (x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy first)
_ADAPTERS_AT = 8


def _adapters_read(adapters, need_x: bool, need_a) -> list:
    """The adapters' tensors as backward keeps them: A where dX reads it (``dt @ A``), B where dX or its A's gradient
    does (``dt = g_u @ B``), each else an empty stand-in of its dtype and device (backward reads those). A parameter
    costs nothing to keep and is kept as it is; under autocast A and B are casts that only this graph would keep
    alive: an input needing no gradient kept A's bf16 copy, which stock's matmul does not (the cached-decisions
    sweep)."""
    out = []
    for i in range(0, len(adapters), 3):
        A, B, b_bias = adapters[i: i + 3]
        read_a, read_b = need_x, need_x or need_a[i // 3]
        out += [A if read_a or isinstance(A, torch.nn.Parameter) else A.new_empty(0),
                B if read_b or isinstance(B, torch.nn.Parameter) else B.new_empty(0), b_bias]
    return out


class LoraLinearFunction(_common.Function):
    """``base(x) + sum_i B_i(A_i(drop_i(x'))) * s_i`` cast back to the base result's dtype, x' = x cast to
    the adapters' dtype (when ``cast``).

    ``adapters`` is the flat tuple ``(A_0, B_0, bias_0, A_1, ...)``; ``scalings`` and ``ps`` hold each
    adapter's scaling and (effective) dropout probability; ``policy`` is the dropout policy ("auto", "bits",
    "seed"; None: the process-wide one), the converted module's ``convert(dropout=)``. Double backward is
    refused: stock's would need the very tensors this Function exists not to keep.

    ``apply`` returns ``(result, seeds, *t, *masks)``: what backward may read besides the inputs is an output
    (functorch's form, one Function for eager, torch.compile and torch.func: :mod:`slimgrad.functional.
    _transforms`), each adapter's ``t = A(dropout(x'))`` and dropout mask (packed bits; a bool mask under
    torch.compile; None without dropout or with the "seed" policy) and the "seed" policy's seeds (else None);
    ``setup_context`` keeps of them only what the requested gradients read. Under torch.func with dropout,
    stock's computation runs (vmap's randomness rules are stock's dropout's).
    """

    @staticmethod
    def forward(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters):
        n = len(scalings)
        adapters = adapters[:3 * n]  # (then x again, for the base layer's gradient: see backward)
        # weight=None: adapters only (the caller adds its own base, e.g. a quantized one), cast to x's dtype.
        result = _base_forward(x, weight, bias, fan_in_fan_out) if weight is not None else None
        base_dtype = result.dtype if result is not None else x.dtype
        # The module's dropout policy, else the process-wide one (set_dropout_policy), as dropout's.
        policy = resolve_policy(policy, x.device)
        compiling = torch.compiler.is_compiling()
        xa = x
        fuse = False
        if n and cast and x.dtype != adapters[0].dtype:
            # simulating the core (slimgrad.estimate, _core_simulated): where its dropout fuses the cast, x is cast
            # only for an adapter that does not drop
            fuse = _SIMULATED["core_draw"] and _fuses_cast(x, adapters[0].dtype)
            xa = None if fuse else x.to(adapters[0].dtype)
        seeds = None
        if not compiling and policy == "seed" and any(0 < p < 1 for p in ps):
            # One seed per dropping adapter from the default generator: reproducible under manual_seed, and
            # checkpointing (which restores the generator) regenerates the same masks.
            seeds = torch.empty(sum(1 for p in ps if 0 < p < 1), dtype=torch.int64, device=x.device).random_()
        kept_t, masks = [], []
        j = 0
        seed_impl = None  # the "seed" policy's kernel, asked of the registry once per call, handed to backward
        for i in range(n):
            A, B, b_bias = adapters[3 * i: 3 * i + 3]
            p = ps[i]
            # no gradient reads this adapter's mask (x and its A frozen; eager, "bits"): stock's op itself (peft's
            # nn.Dropout, after the cast), nothing packed, as the core (lora.cpp): a packed mask beside the draw put
            # the step's peak a mask above peft's
            unread = (0 < p < 1 and policy == "bits" and not compiling and not x.requires_grad
                      and not A.requires_grad)
            if fuse and xa is None and (unread or not 0 < p < 1):
                xa = x.to(adapters[0].dtype)
            dropped, mask = xa, None
            if p == 1:
                dropped = xa * torch.zeros((), dtype=xa.dtype, device=xa.device)
            elif unread:
                dropped = F.dropout(xa, p, True)
            elif p > 0:
                if compiling:
                    # compiled stock's op (peft's nn.Dropout traces to it): Inductor's rand_like draw, or with
                    # fallback_random eager's own (functional/dropout.py)
                    dropped, keep = torch.ops.aten.native_dropout(xa, p, True)
                    # kept as 1 bit an element, packed in the planes Inductor fuses into the draw (as dropout's)
                    mask = _bitmask.pack_planar(keep, _bitmask.planar_layout(xa))
                    del keep
                    noise = None
                elif policy == "bits":
                    # stock's draw (PEFT's nn.Dropout), kept as bits: the adapter sees PEFT's very mask
                    dropped, mask, _, _ = _draw_to_simulated(x, p, A.dtype) if fuse else bits_forward(xa, p, False)
                    noise = None
                else:
                    if seed_impl is None:
                        seed_impl = dropout_kernels.choose_seed(xa)
                    if seed_impl is dropout_kernels.SEED_TORCH:
                        noise = _fill_noise(torch.empty_like(xa), p, seeds[j])
                    else:  # a counter-based kernel (Triton on CUDA): x·noise in one pass, no host sync
                        noise = None
                        dropped = seed_impl.forward(xa.contiguous(), p, seeds[j], False)
                j += 1
                if noise is not None:
                    dropped = xa * noise
            t = F.linear(dropped, A)
            del dropped  # not kept: freed now, as stock frees what it does not save
            u = F.linear(t, B, b_bias)
            u = u * scalings[i]  # the unscaled u is freed here, as in stock's expression
            result = u if result is None else result + u
            del u
            kept_t.append(t)
            masks.append(mask)
        if n:
            result = result.to(base_dtype)
        if seeds is not None:  # (seeds: eager only) for setup_context, which keeps it for backward
            _common.EAGER_HANDOFF.lora_seed_kernel = seed_impl
        return (result, seeds, *kept_t, *masks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, fan_in_fan_out, cast, scalings, ps = inputs[:7]
        n = len(scalings)
        adapters = inputs[_ADAPTERS_AT:_ADAPTERS_AT + 3 * n]
        result, seeds = output[0], output[1]
        kept_t, masks = output[2: 2 + n], output[2 + n:]
        ctx.mark_non_differentiable(*[t for t in output[1:] if t is not None])
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # The extras never receive a gradient: no zero-filled ones for backward (the only differentiable
            # output's gradient is always defined when backward runs).
            ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad
        need_x, need_w = need[0], need[1]
        need_a, need_b = need[_ADAPTERS_AT:_ADAPTERS_AT + 3 * n:3], need[_ADAPTERS_AT + 1:_ADAPTERS_AT + 3 * n:3]
        base_dtype = result.dtype
        # Each adapter's u = B(t) has t's dtype; the forward summed in the base result's dtype promoted with
        # those (the adapters' alone without a base).
        u_dtypes = tuple([t.dtype for t in kept_t])
        sum_dtype = base_dtype if weight is not None or not n else u_dtypes[0]
        for dt in u_dtypes:
            if dt != sum_dtype:
                sum_dtype = torch.promote_types(sum_dtype, dt)
        bits = {}  # adapter -> (perm, scale) of its packed mask (in eager, a mask is the "bits" policy's)
        if compiling:  # each mask packed in planes (_bitmask.pack_planar), unpacked in backward in x's layout
            ctx.planar = _bitmask.planar_layout(x)
        else:
            for i in range(n):
                if masks[i] is not None:
                    # the mask's layout is x's (x.to(dtype) keeps it), its scale that of the adapters' dtype
                    bits[i] = bits_layout(x, ps[i], adapters[0].dtype if cast else x.dtype)
            if _SIMULATED["core_draw"]:
                ctx.core_simulated = True  # backward allocates as the core's (slimgrad.estimate)
        keep_x = need_w or any(need_a)
        if keep_x:
            # stock's base layer keeps x itself only when its weight trains; the adapters' read a cast copy
            kept_x = x if need_w else _compact(x, compiling)
            if kept_x is x:
                _common.note_input_kept(x)
        else:
            kept_x = None
        keep_seeds = seeds is not None and (need_x or any(a for a, p in zip(need_a, ps) if 0 < p < 1))
        # The kernel that drew the seeded masks (forward's one lookup), for backward to regenerate them with, for
        # every adapter, without asking the registry again.
        seed_impl = None
        if seeds is not None:
            seed_impl = _common.EAGER_HANDOFF.lora_seed_kernel
            _common.EAGER_HANDOFF.lora_seed_kernel = None
            if not keep_seeds:
                seed_impl = None
        ctx.meta = (fan_in_fan_out, cast, scalings, ps, base_dtype, sum_dtype, u_dtypes, tuple(x.shape), x.dtype,
                    n, bits, seed_impl)
        # weight is a parameter (not counted); it is only read when dX is requested.
        ctx.save_for_backward(kept_x, weight if need_x else None, seeds if keep_seeds else None,
                              *[t if nb else None for t, nb in zip(kept_t, need_b)],
                              *[m if (need_x or na) else None for m, na in zip(masks, need_a)],
                              *_adapters_read(adapters, need_x, need_a))

    @staticmethod
    def stock(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters):
        """PEFT's ops, as autograd records them (stock's memory); apply's structure, the result first."""
        adapters = adapters[:3 * len(scalings)]
        result = _base_forward(x, weight, bias, fan_in_fan_out) if weight is not None else None
        base_dtype = result.dtype if result is not None else x.dtype
        xa = x.to(adapters[0].dtype) if scalings and cast and x.dtype != adapters[0].dtype else x
        for i, (scaling, p) in enumerate(zip(scalings, ps)):
            A, B, b_bias = adapters[3 * i: 3 * i + 3]
            dropped = F.dropout(xa, p, True) if p > 0 else xa
            u = F.linear(F.linear(dropped, A), B, b_bias)
            result = u * scaling if result is None else result + u * scaling
        return (result.to(base_dtype) if scalings else result,)

    @classmethod
    def under_transform(cls, *args):
        if any(p > 0 for p in args[6]):
            # Dropout under vmap follows vmap's randomness rules, which stock's dropout implements.
            return cls.stock(*args)
        return _common._AUTOGRAD_APPLY(cls, *args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_grad_kept):
        if grad is None:  # undefined (not materialized: see setup_context)
            return (None,) * len(ctx.needs_input_grad)
        fan_in_fan_out, cast, scalings, ps, base_dtype, sum_dtype, u_dtypes, x_shape, x_dtype, n, bits, seed_impl = \
            ctx.meta
        saved = ctx.saved_tensors
        x, weight, seeds = saved[:3]
        kept_t = saved[3: 3 + n]
        masks = saved[3 + n: 3 + 2 * n]
        adapters = saved[3 + 2 * n:]
        need = ctx.needs_input_grad
        need_x, need_w, need_bias = need[0], need[1], need[2]
        grads = [None] * len(need)
        # x again after the adapters: the base layer's part of dX goes there, the adapters' to x itself
        split = len(need) > _ADAPTERS_AT + 3 * n

        g = grad.to(sum_dtype)
        # the base's gradient: not made for adapters alone (weight None: no dW, no bias, no base term in dX)
        g_base = _rows(g.to(base_dtype)) if (need_x and weight is not None) or need_w or need_bias else None
        # Temporaries are dropped as soon as they are used (del / None), and the base layer's gradients
        # come after the adapters' (the order stock's engine runs them in), so that the peak over backward
        # stays at or below stock's, whose engine frees each intermediate gradient after its last use.

        last_g = -1  # the first adapter needing g (a loop: dynamo cannot trace min() over a generator)
        for i in range(n):
            if need_x or any(need[_ADAPTERS_AT + 3 * i: _ADAPTERS_AT + 3 + 3 * i]):
                last_g = i
                break
        xa = None
        dxa = None
        seed_index = [0] * n
        j = 0
        for i in range(n):
            if 0 < ps[i] < 1:
                seed_index[i] = j
                j += 1
        # Autograd runs the adapters' nodes last-created first, so their input gradients add up in reverse.
        for i in reversed(range(n)):
            A, B, _ = adapters[3 * i: 3 * i + 3]
            need_a, need_b, need_bb = need[_ADAPTERS_AT + 3 * i: _ADAPTERS_AT + 3 + 3 * i]
            if not (need_x or need_a or need_b or need_bb):
                continue
            g_u = _rows(g.to(u_dtypes[i]) * scalings[i])
            if i == last_g:
                g = None
                if getattr(ctx, "core_simulated", False):
                    # the core frees dY here (csrc/lora.cpp: the engine's handle reset after its last reader)
                    from slimgrad.estimate import released_by_the_core

                    released_by_the_core(grad)
            if need_bb:
                grads[_ADAPTERS_AT + 2 + 3 * i] = g_u.sum(0)
            if need_b:
                grads[_ADAPTERS_AT + 1 + 3 * i] = g_u.t().mm(_rows(kept_t[i]))
            if not (need_x or need_a):
                continue
            p = ps[i]
            noise = seeded = None
            if p == 1:
                noise = torch.zeros((), dtype=A.dtype, device=A.device)
            elif p > 0 and i in bits:
                noise = bits[i]  # (perm, scale): applied through the dropout_bits kernels below
            elif p > 0:
                if masks[i] is not None:  # compiled: as native_dropout_backward's decomposition reads its mask
                    keep = _bitmask.unpack_planar(masks[i], x_shape, ctx.planar)
                    noise = keep.to(A.dtype).div_(1 - p)
                    del keep
                elif torch.compiler.is_compiling():  # compiled autograd over an eager forward: choose_seed would
                    # answer the torch reference (another mask than a Triton forward's); the op asks when it runs
                    seeded = (dropout_kernels.TRACED_SEED, seeds[seed_index[i]])
                elif seed_impl is not dropout_kernels.SEED_TORCH:
                    seeded = (seed_impl, seeds[seed_index[i]])  # the forward's kernel regenerates the mask
                else:
                    noise = _fill_noise(torch.empty(x_shape, dtype=A.dtype, device=A.device), p,
                                        seeds[seed_index[i]])
            dt = g_u.mm(B)
            del g_u
            if need_a:
                fused = (i in bits and cast and x.dtype != A.dtype and bits[i][0] is None
                         and getattr(ctx, "core_simulated", False) and _fuses_cast(x, A.dtype))
                if xa is None and not fused:
                    xa = x
                    if cast and x.dtype != A.dtype:
                        # Under torch.compile, a cast of a view: a node CSE cannot merge with forward's cast,
                        # which the partitioner would then save (in the adapters' dtype: fp32 copies of x).
                        xa = _rows(x).to(A.dtype).view(x.shape) if torch.compiler.is_compiling() else x.to(A.dtype)
                if fused:  # simulated: the core's cast and dropout in one pass (apply_packed_to), no cast of x
                    dropped = torch.empty_like(x, dtype=A.dtype)
                elif seeded is not None:
                    dropped = seeded[0].forward(xa.contiguous(), p, seeded[1], False)
                elif noise is None:
                    dropped = xa
                elif i in bits:
                    dropped = bits_backward(xa, masks[i], *noise)  # xa * noise, as in forward
                else:
                    dropped = xa * noise
                grads[_ADAPTERS_AT + 3 * i] = dt.t().mm(_rows(dropped))
                del dropped
            if need_x:
                dd = dt.mm(A)
                if i in bits:
                    dd = bits_backward(dd.view(x_shape[:-1] + (dd.shape[-1],)), masks[i], *noise, inplace=True)
                    dd = _rows(dd)
                elif seeded is not None:
                    dd = seeded[0].backward(dd, p, seeded[1])  # dd: (rows, in), x's elements in order
                elif noise is not None:
                    dd.mul_(_rows(noise) if noise.dim() else noise)  # a fresh mm result: in place, same bits
                dxa = dd if dxa is None else dxa.add_(dd)  # a fresh tensor of ours: in place, same bits
                del dd
            noise = dt = None  # dt dies with the iteration, as in the core's loop (lora.cpp)
        xa = None
        dx = None
        if need_x and weight is not None:
            dx = g_base.mm(weight.t() if fan_in_fan_out else weight)
        if need_w:
            x2d = _rows(x)
            grads[1] = x2d.t().mm(g_base) if fan_in_fan_out else g_base.t().mm(x2d)
        if need_bias:
            grads[2] = g_base.sum(0)
        del g_base
        if need_x:
            if dxa is not None:
                dxa = dxa.to(x_dtype)
            if split:
                # Two gradients for x, as peft's graph hands it two (the adapters' path's, then the base layer's
                # node, which autograd runs after the adapters'): autograd adds them to x's other readers' one
                # at a time, in stock's order, where one pre-summed gradient was the same terms in another order
                # (q, k and v reading one x: ~1e-7 relative in fp32, 1 ulp in bf16)
                grads[0], grads[-1] = _as_x(dxa, x_shape), _as_x(dx, x_shape)
            else:
                if dxa is not None:
                    dx = dxa if dx is None else dx.add_(dxa)  # dx is a fresh mm result: in place, same bits
                grads[0] = _as_x(dx, x_shape)
            del dxa
        return tuple(grads)


def _as_x(dx: torch.Tensor | None, x_shape) -> torch.Tensor | None:
    """A gradient for x in x's shape: not a view in eager (as the core's: lora.cpp says why, autograd can then
    add into it in place)."""
    if dx is None:
        return None
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return dx.view(x_shape)
    return _UNSAFE_VIEW(dx, x_shape)


def _compact(x: torch.Tensor, compiling: bool) -> torch.Tensor:
    """``_common.compact(x)``, its storage read without its device read and compile check (~1 us a call less on
    the Python path, CUDA's with dropout): x, or a compact copy where x views a larger storage."""
    if compiling or x.is_meta or torch._C._are_functorch_transforms_active():
        return x  # (no storage to read: what _common.storage_bytes answers None for)
    if type(x) is not torch.Tensor and not _is_fake(x):
        return x  # a subclass; a fake tensor (slimgrad.estimate) has its storage's size, and the real step copies
    if x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.preserve_format)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _fuses_cast(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """csrc/dropout.cpp's fuses_cast: where the core casts x to the adapters' dtype inside the dropout's pass."""
    return dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous()


def _draw_to_simulated(x: torch.Tensor, p: float, dtype: torch.dtype):
    """What the core's draw_and_apply_to allocates (slimgrad.estimate, fake tensors): the mask drawn in ``dtype``,
    the dropped cast of x, the packed bits; as bits_forward's result."""
    keep = torch.empty_like(x, dtype=dtype)
    out = torch.empty_like(keep)
    packed = torch.empty(_bitmask.packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    del keep
    return out, packed, None, None


def _core_simulated(x, tensors, ps, policy) -> bool:
    """:func:`_core_apply`'s answer for the real tensors the fake ones stand for (slimgrad.estimate on CPU)."""
    if not is_simulated_core(x) or torch.is_autocast_enabled(x.device.type):
        return False
    if any(0 < p < 1 for p in ps) and resolve_policy(policy, x.device) != "bits":
        return False
    return all(t is None or (t.device == x.device and t.dtype in _CORE_DTYPES) for t in tensors)


def _check(x, weight, bias, adapters):
    fn = "lora_linear"
    _common.check_tensor(x, "x", fn=fn)
    _common.check_tensor(weight, "weight", fn=fn)
    if bias is not None:
        _common.check_tensor(bias, "bias", fn=fn)
    if weight.dim() != 2:
        raise ValueError(f"{fn}: 'weight' must be 2-D, got shape {tuple(weight.shape)}")
    if _common.own_matmul_subclass(weight):
        raise TypeError(f"{fn}: 'weight' is a {type(weight).__name__}, a tensor subclass with matmuls of its own "
                        f"(a quantized weight), which slimgrad's LoRA backward cannot multiply by; run the base layer "
                        f"yourself (F.linear(x, weight, bias)) and add lora_linear's adapters-only term")
    if not isinstance(adapters, Sequence):
        raise TypeError(f"{fn}: 'adapters' must be a sequence of LoraAdapter, got {type(adapters).__name__}")
    for k, a in enumerate(adapters):
        if not isinstance(a, LoraAdapter):
            raise TypeError(f"{fn}: 'adapters[{k}]' must be a LoraAdapter, got {type(a).__name__}")
        _common.check_tensor(a.A, f"adapters[{k}].A", fn=fn)
        _common.check_tensor(a.B, f"adapters[{k}].B", fn=fn)
        if a.A.dim() != 2 or a.B.dim() != 2 or a.B.size(1) != a.A.size(0):
            raise ValueError(f"{fn}: 'adapters[{k}]' needs A [r, in] and B [out, r], got A "
                             f"{tuple(a.A.shape)} and B {tuple(a.B.shape)}")
        if a.A.dtype != adapters[0].A.dtype or a.B.dtype != a.A.dtype:
            raise ValueError(f"{fn}: every adapter's A and B must share one dtype, got "
                             f"{a.A.dtype}/{a.B.dtype} for 'adapters[{k}]' and {adapters[0].A.dtype} for adapters[0]")
        if not 0.0 <= float(a.dropout) <= 1.0:
            raise ValueError(f"{fn}: 'adapters[{k}].dropout' must be between 0 and 1, got {a.dropout}")


def _stock_keeps_what_we_keep(x, adapters, training, cast_input) -> bool:
    """No adapter drops (p == 0 or eval), none needs x cast to its dtype, autocast off: then stock keeps
    exactly what we keep."""
    if _common.autocast_enabled(x.device.type):
        return False
    if training and any(float(a.dropout) > 0 for a in adapters):
        return False
    return not (cast_input and adapters and x.dtype != adapters[0].A.dtype)


def _autocast_casts_x_per_op(x: torch.Tensor) -> bool:
    """Whether stock, under autocast, casts x once per linear op (the base layer's and each adapter's A)
    rather than once: autocast caches only the cast of an fp32 leaf that requires grad (a parameter), and x
    in a model is no leaf. Each cast's gradient then comes back in x's dtype, and autograd adds the base's
    and the adapters' input gradients there (fp32). One shared cast would add them in the lower precision
    first: one more rounding, 1 bf16 ulp on about half of x's gradient."""
    dtype = _common.autocast_dtype(x.device.type)
    if dtype is None or not (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
        return False  # compiled: Inductor's own roundings (README, Exactness); left as it was
    if not x.is_floating_point() or x.dtype in (dtype, torch.float64):
        return False  # autocast casts nothing
    cached = x.dtype == torch.float32 and x.is_leaf and not x._is_view() and torch.is_autocast_cache_enabled()
    return not cached


_PLAIN = _common.PLAIN_TYPES
_CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


#: ``SLIMGRAD_CORE_CUDA_SEED=1`` at start-up (off by default): CUDA calls whose adapters drop under the "seed" policy
#: run the core's C++ Function with its CUDA Philox kernel (csrc/dropout_seed_cuda.cu) where the core carries its CUDA
#: kernels, instead of the Python Function with Triton's. Off until a GPU run has checked it (tests/test_cuda_core.py
#: with the switch on) and timed it: the switch lets that run happen without a code change.
_CUDA_SEED = os.environ.get("SLIMGRAD_CORE_CUDA_SEED", "0").strip().lower() in ("1", "on", "true", "yes")


def core_seeded(x, ps, policy) -> bool | None:
    """How the compiled core would drop this call's adapters: False (none drops, or the "bits" policy: stock's draw
    kept packed), True (the "seed" policy: Philox regenerated in backward, the same mask as the Python Function's
    kernels), None where it cannot: dropping adapters on CUDA (the bits policy's kernels are CPU loops; CUDA's default
    policy, "seed", is the Python Function's with Triton's kernel, unless ``SLIMGRAD_CORE_CUDA_SEED=1``)."""
    if not any(0 < p < 1 for p in ps):
        return False
    if not x.is_cpu:
        if _CUDA_SEED and x.is_cuda and resolve_policy(policy, x.device) == "seed":
            if (core := csrc.core()) is not None and core.cuda_kernels():
                return True
            from slimgrad import _notices  # a switch that cannot engage says so (once a process)

            _notices.notify("slimgrad: SLIMGRAD_CORE_CUDA_SEED=1 is set, but the compiled core carries no CUDA kernels "
                            "here (python -m slimgrad kernels says why): LoRA's seeded dropout on CUDA runs the Python "
                            "Function and Triton's kernel, the same mask", stacklevel=5)
        return None
    return resolve_policy(policy, x.device) == "seed"


def _core_apply(x, tensors, fan_in_fan_out: bool, cast: bool, scalings, ps, policy):
    """One call through the compiled core where it may run (eager, plain tensors of float dtypes on x's device, no
    autocast, the adapters' dropout, if any, one :func:`core_seeded` allows): the output, x noted as kept where the
    core kept it; None where it may not (the caller runs the Python Function)."""
    core = csrc.for_eager(x, cuda=True)
    if core is None or torch.is_autocast_enabled(x.device.type):
        return None
    seeded = core_seeded(x, ps, policy)
    if seeded is None:
        return None
    device = x.device
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.device != device or t.dtype not in _CORE_DTYPES):
            return None
    out, x_kept = core.lora_linear_apply(tensors, fan_in_fan_out, cast, scalings, ps, seeded)
    if x_kept:
        _common.note_input_kept(x)
    return out


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                adapters: Sequence[LoraAdapter] = (), *, fan_in_fan_out: bool = False, training: bool = True,
                cast_input: bool = True, dropout_policy: str | None = None) -> torch.Tensor:
    """PEFT's ``lora.Linear`` forward, keeping x once in its own dtype (only when dW or some dA is
    requested), each adapter's ``A(dropout(x))`` only when its B trains, and dropout seeds, not masks.

    ``weight`` is ``[out, in]`` (``nn.Linear``) or ``[in, out]`` with ``fan_in_fan_out=True`` (GPT-2's
    ``Conv1D``). ``training=False`` turns the adapters' dropout off, as ``model.eval()`` does. With
    ``cast_input`` x is cast to the adapters' dtype before them, as PEFT does; the sum is cast back to
    the base result's dtype. Under autocast the tensors are cast as autocast casts ``F.linear``'s.
    ``dropout_policy``: how the adapters' dropout masks are kept ("auto", "bits", "seed", see
    :func:`slimgrad.functional.dropout.set_dropout_policy`; None: the process-wide policy).
    """
    _check(x, weight, bias, adapters)
    if dropout_policy is not None:
        check_policy(dropout_policy, source="lora_linear's argument 'dropout_policy'")
    if _stock_keeps_what_we_keep(x, adapters, training, cast_input):
        # No dropout, no cast: PEFT's autograd graph keeps x (once, shared) and each A(x), as we would.
        # Run PEFT's ops directly: no Function, PEFT's peak and bits by construction.
        if torch.is_grad_enabled() and (weight.requires_grad or any(a.A.requires_grad for a in adapters)):
            _common.note_input_kept(x)
        result = _base_forward(x, weight, bias, fan_in_fan_out)
        for a in adapters:
            result = result + F.linear(F.linear(x, a.A), a.B, a.bias) * a.scaling
        return result
    scalings = tuple(float(a.scaling) for a in adapters)
    ps = tuple(float(a.dropout) if training else 0.0 for a in adapters)
    if adapters and adapters_apart(x, len(adapters), ps, cast_input, adapters[0].A.dtype, dropout_policy):
        # As peft's graph: the base layer's op, then each adapter's term added left to right, one Function per
        # adapter (adapters only, weight None), each handing x its own gradient (see adapters_apart).
        if torch.is_grad_enabled() and weight.requires_grad:
            _common.note_input_kept(x)
        result = _base_forward(x, weight, bias, fan_in_fan_out)
        for a, scaling, p in zip(adapters, scalings, ps):
            result = result + _apply(x, None, None, [a.A, a.B, a.bias], fan_in_fan_out, cast_input, (scaling,),
                                     (p,), dropout_policy)
        return result
    return _apply(x, weight, bias, [t for a in adapters for t in (a.A, a.B, a.bias)], fan_in_fan_out, cast_input,
                  scalings, ps, dropout_policy)


class _Read:
    """One LoRA layer's call reading x (see :func:`read_alone_last_time`)."""

    __slots__ = ("owner", "version", "shared", "x")

    def __init__(self, owner: int, x: torch.Tensor | None):
        self.owner, self.shared = owner, False
        self.version, self.x = (-1, _no_input) if x is None else (x._version, weakref.ref(x))

    def __reduce__(self):
        # pickled with its layer (torch.save(model), a spawned process): what it learned, not the input it read
        return _unpickled_read, (self.shared,)


def _no_input():
    return None


def _unpickled_read(shared: bool) -> _Read:
    read = _Read(0, None)
    read.shared = shared
    return read


# x -> the first LoRA call that read it (this forward's q of q/k/v, which all read one normed x)
_READERS: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: a LoRA layer's ``__dict__`` keys: its last call's _Read, which later readers of the same x mark shared; and
#: whether it was seen called again while its last input lived (several calls a forward)
READ_KEY = "_slimgrad_lora_read"
SEVERAL_KEY = "_slimgrad_lora_several_calls"


def read_alone_last_time(state: dict, x: torch.Tensor) -> bool:
    """Whether, in this layer's previous call, no other LoRA layer read the same x (unchanged) in that forward; True
    at a first call. Registers this call, whose answer the layers after it give (they mark it shared).

    Why: with x frozen, the base frozen and one dropping adapter, peft's graph keeps only the dropped x (its dropout
    of a tensor needing no gradient keeps no mask), where the Function keeps x and a 1-bit mask, rebuilding the
    dropped x in backward: 1 bit an element more, which only pays where other LoRA layers read the same x with their
    own dropout (q, k, v: peft keeps three dropped copies, the Function x once and three masks). A layer that read
    x alone runs peft's own forward (:func:`peft_graph_keeps_as_little`); the first call does too, so that no step
    keeps more than stock. (A read by the same layer again, the same input tensor fed each step, is not sharing.)
    A layer called again while its previous input still lives (twice a forward, its calls reading shared and
    unshared inputs in turn) cannot learn one call from the one before: it runs peft's forward from then on."""
    read = _Read(id(state), x)
    previous = state.get(READ_KEY)
    state[READ_KEY] = read
    if previous is not None and (last_input := previous.x()) is not None and last_input is not x:
        state[SEVERAL_KEY] = True
    if state.get(SEVERAL_KEY):
        return True  # (unregistered: it keeps no x that others could share)
    first = _READERS.get(x)
    if first is not None and first.owner != read.owner and first.version == read.version:
        first.shared = read.shared = True
    else:
        _READERS[x] = read
    return previous is None or not previous.shared


def peft_graph_keeps_as_little(state: dict, x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, p: float,
                               cast_input: bool) -> bool:
    """Whether peft's own forward of a one-adapter LoRA layer keeps no more than the Function would for this call:
    eager, x needing no gradient, the base weight frozen, A trained, the adapter dropping, no cast of x, and x read
    by this layer alone last time (:func:`read_alone_last_time`, which this call registers with); always inside a
    non-reentrant checkpoint's region."""
    if (not 0 < p < 1 or x.requires_grad or weight.requires_grad or not A.requires_grad
            or not torch.is_grad_enabled() or (cast_input and x.dtype != A.dtype)):
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if _common.in_checkpointed_forward():
        # peft's forward, the same in a non-reentrant checkpoint's forward and in its recomputation (which must
        # save what the forward saved), whatever the reads in between taught
        return True
    return read_alone_last_time(state, x)


def adapters_apart(x: torch.Tensor, n: int, ps, cast_input: bool, a_dtype: torch.dtype, policy) -> bool:
    """Whether each adapter runs as a Function of its own: several adapters, some dropping, all reading x itself
    (no cast to their dtype). peft's graph then hands x one gradient per adapter (from its dropout, or its A where
    it drops nothing), last adapter first, then the base layer's; where other layers read x too (q, k, v), autograd
    adds their gradients to x's between these. One Function for all hands the adapters' gradients over pre-summed,
    the same terms in another order (fp32 gradients upstream ~1e-6 relative off); one Function per adapter hands
    them over one at a time, in peft's order: bitwise. Each keeps what its part of the one Function keeps (x once,
    the same tensor; its mask; its t). Not with a cast (peft's adapters then read one cast copy, whose gradient is
    the one pre-summed one), nor where x views a larger storage (each Function would keep its own compact copy),
    nor in eager without a gradient for x (the order is then moot: one call is cheaper), nor compiled or under
    torch.func (their sums are theirs; dynamo also refuses one tensor passed twice), nor under autocast (its own
    per-op path, in ``_apply``), nor under the "seed" dropout policy (its masks are not peft's, so no gradient is
    peft's bit for bit; one Function asks the kernel registry once a call). peft's converted layers ask it too
    (integrations/peft_lora.py's and peft_lora_conv.py's fast paths)."""
    if (n < 2 or not any(p > 0 for p in ps) or not x.requires_grad or not torch.is_grad_enabled()
            or (cast_input and x.dtype != a_dtype) or type(x) is not torch.Tensor):
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if _common.autocast_enabled(x.device.type) or x.is_meta or resolve_policy(policy, x.device) != "bits":
        return False
    return x.untyped_storage().nbytes() <= x.numel() * x.element_size()


def _apply(x, weight, bias, flat, fan_in_fan_out, cast_input, scalings, ps, dropout_policy):
    """One LoRA call: the core, else the Python Function; ``flat`` holds (A, B, bias) per adapter; ``weight`` None
    for adapters alone (their sum in x's dtype; the caller adds its base)."""
    tensors = [x, weight, bias, *flat]
    if (out := _core_apply(x, tensors, bool(fan_in_fan_out), bool(cast_input), scalings, ps,
                           dropout_policy)) is not None:
        return out
    # x again after the adapters, for the base layer's part of dX (see LoraLinearFunction.backward); none without a
    # base (as the core), and not under torch.compile: dynamo refuses one tensor passed twice, and compiled
    # stock's sums are Inductor's anyway
    again = weight is not None and not torch.compiler.is_compiling()
    if _core_simulated(x, tensors, ps, dropout_policy):
        with core_draw_simulated(), _common.autocast_off(x.device.type):  # the C++ Function's allocations
            return LoraLinearFunction.apply(*tensors[:3], bool(fan_in_fan_out), bool(cast_input), scalings, ps,
                                            dropout_policy, *tensors[3:], *((x,) if again else ()))[0]
    n = len(scalings)
    if n and _autocast_casts_x_per_op(x):
        # As stock: the base layer's op on its own cast of x, then per adapter our Function on its own cast,
        # added left to right; autograd adds the casts' gradients in x's dtype, in stock's order.
        result = _base_forward(x, weight, bias, fan_in_fan_out)
        for k, (scaling, p) in enumerate(zip(scalings, ps)):
            xa, A, B, b_bias = _common.autocast_lower_precision(x, *flat[3 * k: 3 * k + 3])
            with _common.autocast_off(x.device.type):
                u = LoraLinearFunction.apply(xa, None, None, bool(fan_in_fan_out), bool(cast_input), (scaling,),
                                             (p,), dropout_policy, A, B, b_bias)[0]
            result = result + u
        return result
    tensors = list(_common.autocast_lower_precision(*tensors))
    if (type(x) is not torch.Tensor or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or _common.autocast_enabled(x.device.type)):
        with _common.autocast_off(x.device.type):
            return LoraLinearFunction.apply(tensors[0], tensors[1], tensors[2], bool(fan_in_fan_out),
                                            bool(cast_input), scalings, ps, dropout_policy, *tensors[3:],
                                            *((tensors[0],) if again else ()))[0]
    # Eager, autocast off: _common.Function.apply's eager branch called directly (torch's C apply, tensors unwrapped
    # as its unwrap_dead_wrappers does), without its generic argument handling (~2 us a call for LoRA's arguments).
    x = _unwrap_if_dead(tensors[0])
    return _C_APPLY(LoraLinearFunction, x, *[t if t is None else _unwrap_if_dead(t) for t in tensors[1:3]],
                    bool(fan_in_fan_out), bool(cast_input), scalings, ps, dropout_policy,
                    *[t if t is None else _unwrap_if_dead(t) for t in tensors[3:]], *((x,) if again else ()))[0]


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
