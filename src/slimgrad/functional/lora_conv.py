"""LoRA adapters on a convolution (peft's ``lora.Conv1d/2d/3d``), keeping what their own gradients read.

peft computes ``base(x) + B(A(dropout(x'))) * scaling`` (x' = x cast to the adapters' dtype, A a conv with
the base's kernel, stride and padding, B a 1x1 conv with the base's groups). Autograd then keeps, per
adapter, the cast copy x' (an fp32 copy of a bf16 x in mixed-precision training) or, with dropout, the
dropout noise *and* the dropped input, on top of x if the base keeps it. What the gradients read:

* dA: dropout(x') — rebuilt in backward from x (kept once, in its own dtype) and the dropout mask, kept
  as bits or regenerated from an 8-byte seed (slimgrad's dropout policy, see
  :mod:`slimgrad.functional.dropout`);
* dB: ``t = A(dropout(x'))`` (r channels, small), kept when B trains;
* dx through the adapters: A, B and the noise. No activation.

The base convolution is not part of this Function: the caller runs it (as a slimgrad convolution, which
keeps nothing when its weight is frozen) and passes its output in, so the sum runs in peft's order.
Without dropout and without a cast peft's own ops already keep only x and t, and the caller runs them.

Exactness: the forward runs peft's ops in peft's order. Backward calls ``aten.convolution_backward`` with
the operands and output mask autograd gives it for peft's graph (bitwise the same gradients) where the
weight's gradient is requested, and the transposed convolution slimgrad's conv uses for an input-only
gradient (bitwise equal too, see :mod:`slimgrad.functional.conv`). Several adapters' input gradients are
summed in autograd's order (last adapter first). Dropout follows slimgrad's dropout policy: ``bits``
(the CPU default) draws peft's very mask from the default generator and keeps it packed; ``seed`` keeps
an 8-byte seed (the same distribution as peft's, not the same mask) and draws with the registry's ``dropout_seed``
kernel: Triton's counter-based kernel on CUDA (x'·noise in one pass, in x's memory order, no ``torch.Generator``
and no ``.item()`` host sync per adapter, as LoRA linear's), the torch reference elsewhere; under ``torch.compile``
a bool mask.

Eager CPU calls (no autocast, dropout policy "bits" or no dropout) run the compiled core instead
(``csrc/lora_conv.cpp``): one C++ autograd Function per call, this Function's forward and backward op for op (the
same aten convolutions, casts and sums, so the same bits), saving exactly what this Function saves, without its
per-call Python cost. This Function stays for torch.compile, torch.func, the "seed" policy, CUDA and a core that is
off or unbuilt, and is the reference the core is tested against (tests/test_core_lora_conv.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from slimgrad import csrc
from slimgrad.functional import _common, _layout
from slimgrad.functional.conv import _format  # (torch's suggest_memory_format, without its ~25 µs of guards)
from slimgrad.functional.dropout import (
    _SIMULATED,
    _canonical,
    _dense,
    _inverse,
    _memory_order,
    bits_backward,
    bits_forward,
    check_policy,
    core_draw_simulated,
    is_simulated_core,
    resolve_policy,
)
from slimgrad.functional.lora import adapters_apart
from slimgrad.kernels import dropout as dropout_kernels
from slimgrad.kernels.dropout import noise_scale, traced_seed_apply

__all__ = ["ConvOptions", "LoraConvAdapter", "LoraConvFunction", "lora_conv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class ConvOptions(NamedTuple):
    """A convolution's non-tensor options (zeros padding, numeric)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1


class LoraConvAdapter(NamedTuple):
    """One adapter: ``conv(conv(dropout(x'), A, a), B, b, bias) * scaling``."""

    A: torch.Tensor
    B: torch.Tensor
    a: ConvOptions
    b: ConvOptions
    scaling: float = 1.0
    dropout: float = 0.0
    bias: torch.Tensor | None = None


def _conv(x, w, bias, o: ConvOptions):
    return _CONV[w.dim() - 2](x, w, bias, o.stride, o.padding, o.dilation, o.groups)


def _input_grad(grad, w, o: ConvOptions, in_shape, in_format):
    """dX of a convolution without its input: the transposed convolution slimgrad's conv uses."""
    nd = w.dim() - 2
    if in_format != torch.contiguous_format:
        w = w.contiguous(memory_format=in_format)  # stock's backend sees X in this layout
    k, out = w.shape[2:], grad.shape[2:]
    extra = tuple(in_shape[2 + i] - ((out[i] - 1) * o.stride[i] - 2 * o.padding[i] + o.dilation[i] * (k[i] - 1) + 1)
                  for i in range(nd))
    return _CONV_T[nd](grad, w, None, o.stride, o.padding, extra, o.groups, o.dilation)


def _backward(grad, x, w, o: ConvOptions, need_x, need_w, need_b, in_shape, in_format):
    """(dX, dW, dB) of ``conv(x, w, b, o)`` as autograd computes them; ``x`` may be None when dW is not
    requested."""
    if need_w:
        return torch.ops.aten.convolution_backward(
            grad, x, w, [w.shape[0]] if need_b else None, list(o.stride), list(o.padding), list(o.dilation),
            False, [0] * (w.dim() - 2), o.groups, [need_x, True, need_b])
    dx = _input_grad(grad, w, o, in_shape, in_format) if need_x else None
    db = grad.sum([0] + list(range(2, grad.dim()))) if need_b else None
    return dx, None, db


def _bits(x, xa_dtype, meta, policy) -> dict:
    """Adapter -> (layout permutation, scale) of the packed dropout mask ``bits_forward`` drew for it (policy
    "bits"), as it found them: the layout of a uint8 ``empty_like`` of x' (read off a meta tensor: x' is x or
    its ``.to``, which keeps x's layout) and stock's noise value in x's dtype."""
    if (torch.compiler.is_compiling() or not any(0 < m[3] < 1 for m in meta)
            or resolve_policy(policy, x.device) != "bits"):
        return {}
    perm = _memory_order(torch.empty_like(x, dtype=torch.uint8, device="meta"))
    return {i: (perm, noise_scale(m[3], xa_dtype)) for i, m in enumerate(meta) if 0 < m[3] < 1}


def _seed_order(t: torch.Tensor):
    """The memory order a counter-based seed kernel runs in on ``t`` (or on its cast, which keeps its layout):
    x's own where dense (a channels-last x is read as it lies, no copy), else row-major."""
    return _memory_order(t) if _dense(t) else None


def _seeded(impl, t, p, seed, perm):
    """``t * noise`` by the ``dropout_seed`` kernel ``impl`` run in the memory order ``perm`` (the forward's input's,
    :func:`_seed_order`: the same mask element for element in forward and backward), in ``t``'s shape. Traced by
    compiled autograd: through the opaque op that runs that kernel by name when the graph runs (while tracing, the
    registry would answer the torch reference, another mask)."""
    tc = _canonical(t, perm)
    if torch.compiler.is_compiling():
        out = traced_seed_apply(tc, p, seed, impl.name)
    else:
        out = impl.backward(tc, p, seed)  # (the contract's backward is its forward out of place: t * noise)
    return out if perm is None else out.permute(_inverse(perm))


#: LoraConvFunction's argument index of A_0 (x, base_out, cast, meta, policy first)
_ADAPTERS_AT = 5


class LoraConvFunction(_common.Function):
    """``base_out + sum_i conv(conv(drop_i(x'), A_i), B_i, bias_i) * s_i`` cast to base_out's dtype.

    ``adapters`` is the flat tuple ``(A_0, B_0, bias_0, A_1, ...)``; ``meta`` holds per adapter
    ``(a options, b options, scaling, effective dropout p)``. Double backward is refused.

    In functorch's split form (one Function for eager and torch.compile); ``apply`` returns the sum followed
    by the extras forward made for backward, which :func:`lora_conv` drops. Under torch.func its ``stock``
    (peft's ops) runs instead.
    """

    @staticmethod
    def forward(x, base_out, cast, meta, policy, *adapters):
        n = len(meta)
        xa = x.to(adapters[0].dtype) if cast and x.dtype != adapters[0].dtype else x
        n_drop = sum(1 for m in meta if 0 < m[3] < 1)
        compiling = torch.compiler.is_compiling()
        policy = resolve_policy(policy, x.device)  # the module's dropout policy, else the process-wide one
        seeds = None
        if n_drop and not compiling and policy == "seed":
            seeds = torch.empty(n_drop, dtype=torch.int64, device=x.device).random_()
        result, ts, masks, j = base_out, [], [], 0
        for i in range(n):
            A, B, bias = adapters[3 * i: 3 * i + 3]
            a, b, s, p = meta[i]
            dropped, mask = xa, None
            if p == 1:
                dropped = xa * torch.zeros((), dtype=xa.dtype, device=xa.device)
            elif p > 0 and compiling:
                # A private generator would break the graph: the compiled form keeps a bool mask, drawn by compiled
                # stock's op (functional/dropout.py)
                dropped, mask = torch.ops.aten.native_dropout(xa, p, True)
            elif p > 0 and policy == "bits" and not (x.requires_grad or A.requires_grad):
                # no gradient reads this adapter's mask (x and its A frozen): stock's op itself (peft's nn.Dropout),
                # nothing packed, as the core (lora_conv.cpp): a packed mask beside the draw put the step's peak a
                # mask above peft's
                dropped = F.dropout(xa, p, True)
            elif p > 0 and policy == "bits":
                # stock's draw (peft's nn.Dropout), kept packed: the adapter sees peft's very mask (setup_context
                # finds its layout and scale again: _bits)
                dropped, mask, _, _ = bits_forward(xa, p, False)
            elif p > 0:
                # the "seed" policy's kernel (Triton on CUDA, the core's on CPU, else the torch reference: one Philox
                # mask for all), in x's memory order: x'·noise in one pass, no generator, no host sync
                dropped = _seeded(dropout_kernels.choose_seed(xa), xa, p, seeds[j], _seed_order(xa))
                j += 1
            t = _conv(dropped, A, None, a)
            del dropped  # temporaries go as soon as they are read: the step's peak stays at peft's
            if i == n - 1:
                del xa
            u = _conv(t, B, bias, b)
            result = result + u.mul_(s)  # u * s, in place on a tensor of our own (same bits)
            del u
            ts.append(t)
            masks.append(mask)
        # What backward may read besides the inputs, as extra outputs (setup_context keeps what the requested
        # gradients read): the seeds, each A(dropout(x')) and each dropout mask. The caller drops them.
        return (result.to(base_out.dtype), seeds, *ts, *masks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, base_out, cast, meta, policy, *adapters = inputs
        _, seeds, *rest = output
        n = len(meta)
        ts, masks = rest[:n], rest[n:]
        ctx.mark_non_differentiable(*[t for t in (seeds, *rest) if t is not None])
        ctx.set_materialize_grads(False)  # (else backward gets a zero gradient of each extra's size)
        ctx.core_simulated = _SIMULATED["core_draw"]  # backward allocates (and frees) as the core's (slimgrad.estimate)
        need = ctx.needs_input_grad
        need_x = need[0]
        need_a = [need[_ADAPTERS_AT + 3 * i] for i in range(n)]
        need_b = [need[_ADAPTERS_AT + 1 + 3 * i] for i in range(n)]
        a_dtype = adapters[0].dtype
        xa_dtype = a_dtype if cast and x.dtype != a_dtype else x.dtype
        x_format = _format(x)  # (x' = x.to(...) keeps it)
        sum_dtype = base_out.dtype  # the sum's dtype: base_out's promoted with each adapter's
        shapes = []
        for t in ts:
            sum_dtype = torch.promote_types(sum_dtype, t.dtype)
            shapes.append((t.dtype, tuple(t.shape), _format(t)))
        bits = _bits(x, xa_dtype, meta, policy)
        keep_x = any(need_a)
        if keep_x:
            _common.note_input_kept(x)
        keep_seeds = seeds is not None and (need_x or keep_x)
        seeded = None
        if keep_seeds:
            # the kernel forward drew with (the registry's choice for x's device and dtype, asked again: the same
            # answer) and the memory order it ran in
            seeded = (dropout_kernels.choose_seed(adapters[0] if xa_dtype == a_dtype else x), _seed_order(x))
        # stock's noise is empty_like(x'), in x's layout: with a non-contiguous x, the input gradient is handed on in
        # the layout of stock's `dd * noise` (backward), not the mask's memory order it is made in
        noise_strides = None
        if not x.is_contiguous() and not torch.compiler.is_compiling() and any(0 < m[3] < 1 for m in meta):
            noise_strides = torch.empty_like(x, dtype=torch.uint8, device="meta").stride()
        ctx.meta = (cast, meta, sum_dtype, base_out.dtype, tuple(shapes), tuple(x.shape), x_format, x.dtype, bits,
                    seeded, noise_strides)
        ctx.save_for_backward(x if keep_x else None, seeds if keep_seeds else None,
                              *[t if nb else None for t, nb in zip(ts, need_b)],
                              *[m if (need_x or na) else None for m, na in zip(masks, need_a)], *adapters)

    @staticmethod
    def stock(x, base_out, cast, meta, policy, *adapters):
        xa = x.to(adapters[0].dtype) if cast and x.dtype != adapters[0].dtype else x
        result = base_out
        for i, (a, b, scaling, p) in enumerate(meta):
            A, B, bias = adapters[3 * i: 3 * i + 3]
            dropped = F.dropout(xa, p, True) if p > 0 else xa
            result = result + _conv(_conv(dropped, A, None, a), B, bias, b) * scaling
        return result.to(base_out.dtype)

    @classmethod
    def under_transform(cls, *args):
        # Stock's computation under torch.func as well: the adapters' dropout follows vmap's randomness rules
        # there, and backward reads its masks through the dropout_bits kernels, which cannot read a batched tensor.
        return cls.stock(*args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_grad_extras):
        if grad is None:  # (an undefined output gradient, as gradcheck passes: grads are not materialized)
            return (None,) * len(ctx.needs_input_grad)
        cast, meta, sum_dtype, base_dtype, shapes, x_shape, x_format, x_dtype, bits, seeded, noise_strides = ctx.meta
        n = len(meta)
        saved = ctx.saved_tensors
        x, seeds = saved[:2]
        kept_t = saved[2: 2 + n]
        masks = saved[2 + n: 2 + 2 * n]
        adapters = saved[2 + 2 * n:]
        need = ctx.needs_input_grad
        need_x = need[0]
        grads = [None] * (_ADAPTERS_AT + 3 * n)
        g = grad.to(sum_dtype)
        if need[1]:
            # grad.to(sum_dtype).to(base_dtype), as autograd computes it, is grad itself: the sum's dtype is
            # the promotion of the base's, which holds every value of it exactly. No copy.
            grads[1] = grad if grad.dtype == base_dtype else g.to(base_dtype)
        # The last adapter to run may scale g itself when g is a fresh tensor of ours (same bits as g * s).
        g_own = g is not grad  # .to returns grad itself when the dtype is already right
        last = None  # the adapter the reversed loop below processes last
        for i in range(n - 1, -1, -1):
            if need_x or any(need[_ADAPTERS_AT + 3 * i: _ADAPTERS_AT + 3 + 3 * i]):
                last = i
        seed_index, j = [0] * n, 0
        for i in range(n):
            if 0 < meta[i][3] < 1:
                seed_index[i], j = j, j + 1
        dxa = None
        for i in reversed(range(n)):  # autograd runs the last-created adapter's nodes first
            A, B, bias = adapters[3 * i: 3 * i + 3]
            a, b, s, p = meta[i]
            u_dtype, t_shape, t_format = shapes[i]
            need_a, need_b, need_bb = need[_ADAPTERS_AT + 3 * i: _ADAPTERS_AT + 3 + 3 * i]
            if not (need_x or need_a or need_b or need_bb):
                continue
            if i == last and g_own and g.dtype == u_dtype:
                g_u = g.mul_(s)
            else:
                g_u = g.to(u_dtype) * s
            if i == last:
                del g
                if getattr(ctx, "core_simulated", False) and grads[1] is not grad:
                    # the core frees dY here (csrc/lora_conv.cpp: the engine's handle reset after its last reader;
                    # the base's gradient, when requested, is dY itself and keeps it)
                    from slimgrad.estimate import released_by_the_core

                    released_by_the_core(grad)
            need_t = need_x or need_a
            dt, grads[_ADAPTERS_AT + 1 + 3 * i], grads[_ADAPTERS_AT + 2 + 3 * i] = _backward(
                g_u, kept_t[i], B, b, need_t, need_b, need_bb and bias is not None, t_shape, t_format)
            del g_u
            if not need_t:
                continue
            noise = None
            # the forward's seed kernel regenerates its mask, in the order it ran in
            kernel = seeded is not None and 0 < p < 1 and masks[i] is None and i not in bits
            if p == 1:
                noise = torch.zeros((), dtype=A.dtype, device=A.device)
            elif kernel:
                pass  # applied through _seeded below
            elif p > 0 and i in bits:
                pass  # applied through the dropout_bits kernels below
            elif p > 0:  # (a seeded adapter is `kernel`: its seeds are kept wherever dX or dA reads them)
                noise = masks[i].to(A.dtype).div_(1 - p)
            if need_a:
                # dA first, with the rebuilt input freed before dX allocates (two calls, as slimgrad's conv
                # makes them: bitwise the combined call's results)
                xa = x.to(A.dtype) if cast and x.dtype != A.dtype else x
                if i in bits:
                    dropped = bits_backward(xa, masks[i], *bits[i])  # xa * noise, as in forward
                elif kernel:
                    dropped = _seeded(seeded[0], xa, p, seeds[seed_index[i]], seeded[1])  # xa * noise, as in forward
                else:
                    dropped = xa if noise is None else xa * noise
                del xa
                _, grads[_ADAPTERS_AT + 3 * i], _ = _backward(dt, dropped, A, a, False, True, False, x_shape, x_format)
                del dropped
            if need_x:
                dd = _input_grad(dt, A, a, x_shape, x_format)
                layout = (_layout.binary_strides(tuple(dd.shape), dd.stride(), noise_strides)
                          if noise_strides is not None and (i in bits or kernel) else None)
                if i in bits:
                    dd = bits_backward(dd, masks[i], *bits[i], inplace=True)
                elif kernel:
                    dd = _seeded(seeded[0], dd, p, seeds[seed_index[i]], seeded[1])
                if layout is not None:  # (as csrc/lora_conv.cpp: stock's `dd * noise` layout)
                    dd = _layout.conform(dd, layout)
                elif noise is not None:
                    dd = dd.mul_(noise)
                dxa = dd if dxa is None else dxa.add_(dd)
                del dd
        if need_x and dxa is not None:
            grads[0] = dxa.to(x_dtype)
            del dxa
        return tuple(grads)


_PLAIN = _common.PLAIN_TYPES
_CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _core_fits(x, base_out, flat, meta, policy) -> bool:
    """What the C++ Function (csrc/lora_conv.cpp) serves besides eagerness: plain float tensors on x's device,
    1-3 spatial dims with every option spelled out per dim, no autocast, and dropout (if any) kept as bits."""
    nd = x.dim() - 2
    if not 1 <= nd <= 3 or torch.is_autocast_enabled(x.device.type):
        return False
    if any(0 < m[3] < 1 for m in meta) and resolve_policy(policy, x.device) != "bits":
        return False
    for a, b, _, _ in meta:
        for o in (a, b):
            if not (len(o.stride) == len(o.padding) == len(o.dilation) == nd):
                return False
    device = x.device
    for t in (x, base_out, *flat):
        if t is not None and (t.device != device or t.dtype not in _CORE_DTYPES):
            return False
    return True


def _core(x, base_out, flat, meta, policy):
    """The compiled core when this call may run it: eager CPU (``csrc.for_eager``) and :func:`_core_fits`. CUDA
    calls run the Python Function (its seed dropout is Triton's kernel there)."""
    core = csrc.for_eager(x)
    if core is None or not _core_fits(x, base_out, flat, meta, policy):
        return None
    if any(t is not None and type(t) not in _PLAIN for t in (base_out, *flat)):
        return None
    return core


def _core_simulated(x, base_out, flat, meta, policy) -> bool:
    """:func:`_core`'s answer for the real tensors the fake ones stand for (slimgrad.estimate on CPU): those run
    the Python Function with the core's dropout draw (in x's dtype, not uint8)."""
    return is_simulated_core(x) and _core_fits(x, base_out, flat, meta, policy)


def _check(x, base_out, adapters):
    fn = "lora_conv"
    _common.check_tensor(x, "x", fn=fn)
    _common.check_tensor(base_out, "base_out", fn=fn)
    if not isinstance(adapters, Sequence) or not adapters:
        raise TypeError(f"{fn}: 'adapters' must be a non-empty sequence of LoraConvAdapter, got {adapters!r}")
    for k, ad in enumerate(adapters):
        if not isinstance(ad, LoraConvAdapter):
            raise TypeError(f"{fn}: 'adapters[{k}]' must be a LoraConvAdapter, got {type(ad).__name__}")
        if ad.A.dim() != x.dim() or ad.B.dim() != x.dim():
            raise ValueError(f"{fn}: 'adapters[{k}]' A and B must be {x.dim()}-D conv weights like x's layout, got "
                             f"{tuple(ad.A.shape)} and {tuple(ad.B.shape)}")
        if ad.A.dtype != adapters[0].A.dtype or ad.B.dtype != ad.A.dtype:
            raise ValueError(f"{fn}: every adapter's A and B must share one dtype, got {ad.A.dtype}/{ad.B.dtype} for "
                             f"'adapters[{k}]' and {adapters[0].A.dtype} for adapters[0]")
        if not 0.0 <= float(ad.dropout) <= 1.0:
            raise ValueError(f"{fn}: 'adapters[{k}].dropout' must be between 0 and 1, got {ad.dropout}")


def lora_conv(x: torch.Tensor, base_out: torch.Tensor, adapters: Sequence[LoraConvAdapter], *,
              training: bool = True, cast_input: bool = True, dropout_policy: str | None = None) -> torch.Tensor:
    """peft's LoRA-on-convolution sum ``base_out + Σ B(A(dropout(x'))) * scaling``, cast to base_out's dtype,
    keeping x once in its own dtype (only when some A trains), each ``A(dropout(x'))`` only when its B
    trains, and dropout seeds instead of masks. ``x`` is batched (N, C, *spatial); ``base_out`` is the base
    convolution's output, computed by the caller. Not for autocast regions (peft's forward handles those).
    ``dropout_policy``: how the adapters' dropout masks are kept ("auto", "bits", "seed"; None: the
    process-wide policy, :func:`slimgrad.functional.dropout.set_dropout_policy`).
    """
    _check(x, base_out, adapters)
    if dropout_policy is not None:
        check_policy(dropout_policy, source="lora_conv's argument 'dropout_policy'")
    if x.dim() < 3:
        raise ValueError(f"lora_conv: argument 'x' must be batched (N, C, ...), got shape {tuple(x.shape)}")
    meta = tuple((ad.a, ad.b, float(ad.scaling), float(ad.dropout) if training else 0.0) for ad in adapters)
    flat = []
    for ad in adapters:
        flat += [ad.A, ad.B, ad.bias]
    if adapters_apart(x, len(adapters), [m[3] for m in meta], cast_input, adapters[0].A.dtype, dropout_policy):
        # As peft's graph: each adapter's term added to the sum so far by a Function of its own, each handing x its
        # own gradient in peft's order (functional/lora.py's adapters_apart says why)
        out = base_out
        for k in range(len(adapters)):
            out = _apply(x, out, flat[3 * k: 3 * k + 3], meta[k: k + 1], cast_input, dropout_policy)
        return out
    return _apply(x, base_out, flat, meta, cast_input, dropout_policy)


def _apply(x, base_out, flat, meta, cast_input, dropout_policy):
    """One call: the core, else the Python Function; ``flat`` holds (A, B, bias) per adapter of ``meta``."""
    if (core := _core(x, base_out, flat, meta, dropout_policy)) is not None:
        opts = []
        for a, b, _, _ in meta:
            opts += [(*a.stride, *a.padding, *a.dilation, a.groups), (*b.stride, *b.padding, *b.dilation, b.groups)]
        out, x_kept = core.lora_conv_apply([x, base_out, *flat], bool(cast_input), [m[2] for m in meta],
                                           [m[3] for m in meta], opts)
        if x_kept:
            _common.note_input_kept(x)
        return out
    if _core_simulated(x, base_out, flat, meta, dropout_policy):
        with core_draw_simulated():  # what the C++ Function allocates: its dropout draws the mask in x's dtype
            return LoraConvFunction.apply(x, base_out, bool(cast_input), meta, dropout_policy, *flat)[0]
    out = LoraConvFunction.apply(x, base_out, bool(cast_input), meta, dropout_policy, *flat)
    return out[0] if type(out) is tuple else out  # (eager: the extra outputs dropped here)
