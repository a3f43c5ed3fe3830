"""Normalisation layers (RMSNorm in every casting style, LayerNorm, GroupNorm, FusedAddRMSNorm, PolyNorm)
that keep for backward only the input in its own dtype plus per-row statistics, and compute a weight's or
bias's gradient only when it is requested.

Why each reference wastes, and what is kept instead:

* ``torch.rms_norm`` on CPU is a decomposition (the fused kernel runs on CUDA/XPU/MPS only), and the
  Hugging Face RMSNorms are written in Python. Autograd then keeps the fp32 upcast of x (reduced
  precision), rstd, and the normalised ``x·rstd`` (whenever the weight trains): up to 3x the input. We keep
  x (its own dtype) and rstd (fp32) and rebuild the rest in backward, which is cheap element-wise work.
* ``native_layer_norm`` / ``native_group_norm`` keep x, mean and rstd even when only the bias trains,
  though ``dB = Σ dy`` reads none of them.

RMSNorm backward replays, op for op, what autograd runs on the reference's forward graph (same ops, same
dtypes, same reduction shapes), so outputs and gradients are bitwise equal to each reference. LayerNorm and
GroupNorm call stock's own forward and backward kernels with stock's ``output_mask``.

Kernels (:mod:`slimgrad.kernels`): on CUDA the Triton kernels of :mod:`slimgrad.kernels.triton.rms_norm` and
``layer_norm`` run where the registry chooses them (families ``rms_norm`` for the torch style, ``rms_norm_hf``,
``fused_add_rms_norm``, ``layer_norm``); they keep the same tensors (x in its own dtype, fp32 per-row stats),
compute only the requested gradients, and agree with the torch code within the dtype's rounding. The torch code
here is the ``torch`` implementation of each family and the fallback wherever no kernel fits.

Compiled core (:mod:`slimgrad.csrc`, ``csrc/norms.cpp``): eager CPU calls of ``rms_norm``, ``rms_norm_hf``,
``fused_add_rms_norm``, ``layer_norm``, ``group_norm`` and of the modules run one C++ autograd Function instead of
the Functions below, because a Python Function's per-call cost was most of the time on small tensors. It takes the
same decisions of what to keep and runs the same aten ops in the same order (so the same bits, gradient layouts and
saved bytes, tested in tests/test_core_norms.py and test_core_fused_add_rmsnorm.py); RMSNorm's element-wise
steps on contiguous fp32/bf16/fp16 inputs run as one pass each around aten's own reductions, where the Python
sequence (and stock's) takes a pass and an fp32 temporary per op. The core declines (returns None, and the
Functions below run) under autocast, torch.compile, torch.func, for tensor subclasses, non-CPU tensors, a preferred
Triton kernel, and anything the checks below would reject.

One Python Function per family, in functorch's ``forward``/``setup_context`` form, serves eager calls, torch.compile
and torch.func alike (:mod:`slimgrad.functional._transforms`): ``forward`` returns, besides the output, what backward
may read that is neither an input nor the output (per-row statistics, RMSNorm's normalised input, group norm's
layout copy), and ``setup_context`` keeps of it what ``needs_input_grad`` asks for. The caller chooses the fast
kernel and passes it in (``impl``), since ``forward`` sees no ctx to record it on; under torch.func the torch code
runs (vmap batches it). Each Function's ``stock`` is stock's computation, run under transforms it does not serve.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._prims_common import suggest_memory_format as _prims_suggest_memory_format
from torch.overrides import handle_torch_function, has_torch_function_variadic

from slimgrad import csrc
from slimgrad.functional import _common, _layout
from slimgrad.kernels import registry as _registry

__all__ = [
    "RMSNormFunction",
    "LayerNormFunction",
    "GroupNormFunction",
    "FusedAddRMSNormFunction",
    "PolyNormFunction",
    "rms_norm",
    "rms_norm_hf",
    "layer_norm",
    "group_norm",
    "fused_add_rms_norm",
    "poly_norm",
    "RMS_STYLES",
]

_aten = torch.ops.aten

#: Casting styles of RMSNorm, each the exact arithmetic of a reference implementation:
#: ``torch``: ``torch.rms_norm``'s CPU decomposition (stats in opmath, i.e. fp32 for half types and fp64 for
#: fp64; ``x·rstd·w`` in opmath, cast to x's dtype at the end);
#: ``llama``: LlamaRMSNorm and its 100+ copies (stats in fp32 whatever the input, ``w · (x·rstd).to(dtype)``);
#: ``olmo2``: Olmo2RMSNorm (``(w · x·rstd).to(dtype)``, product in fp32);
#: ``gemma``: Gemma/Gemma2/Gemma3RMSNorm (all fp32, ``x̂·(1 + w)``, cast at the end);
#: ``t5``: T5LayerNorm (``x · rstd`` promoted, cast to w's dtype only when w is half precision).
RMS_STYLES = ("torch", "llama", "olmo2", "gemma", "t5")
_FUSED_RMS_DEVICES = ("cuda", "xpu", "mps")

for _family in ("rms_norm", "rms_norm_hf", "fused_add_rms_norm", "layer_norm"):
    _common.register_torch_kernel(_family)


_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_is_compiling = torch.compiler.is_compiling
#: RMS_STYLES' codes in the compiled core (``norms_rms``'s ``style``).
_STYLE_CODE = {style: i for i, style in enumerate(RMS_STYLES)}


def _core(input):
    """The compiled core for an eager call on ``input``, or None (see the module docstring): the core must be on,
    built and fit ``input`` (``csrc.for_eager``), no Triton kernel be preferred (the Triton tests run under the
    interpreter on CPU tensors, through the Python Function) and no TorchFunctionMode be active."""
    if _is_compiling():
        return None  # before for_eager, which would load (build) the core inside the trace on a first call
    core = csrc.for_eager(input)
    if core is None or _registry.get_preference() == _registry.TRITON or _torch_function_mode_enabled():
        return None  # a TorchFunctionMode sees the functional forms' calls (handle_torch_function): theirs to run
    return core


def _note():
    """What the core calls with the input when it keeps it (the producer/consumer rule), None when no producer
    is waiting to hear (the common case: one length check)."""
    return _common.note_input_kept if _common._PRODUCERS else None


def _numel(shape) -> int:
    n = 1
    for s in shape:  # a plain loop: dynamo cannot trace math.prod over a generator
        n *= s
    return n


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _WeightShape(NamedTuple):
    """What the weight's gradient reads of the weight where only dW is requested: its shape and dtype. A one-element
    tensor standing in for it would be an allocation stock's step does not make (stock's product reads the
    parameter itself): a few bytes above stock's peak where that peak falls in dW's reduction."""
    shape: torch.Size
    dtype: torch.dtype


def _variance_row_factor(d_rstd, rstd, n):
    """The per-row factor of the gradient reaching ``up`` through ``rsqrt(mean(up²) + eps)``, as autograd computes
    it: rsqrt's ``-0.5·g·r³``, then mean's ``g/n`` (on the per-row tensor; the expand autograd does first changes no
    value)."""
    return ((d_rstd * -0.5) * rstd.pow(3)) / n


def _variance_path_grad(c, up):
    """That gradient: the row factor ``c`` times pow's ``2·up``; in one x-sized temporary where it may be written in
    place (stock's pow backward holds three at once: ``up.pow(1)``, twice it, the product)."""
    t = up.pow(1)
    if t.dtype == torch.promote_types(t.dtype, c.dtype) and _in_place_ok(t):
        return t.mul_(2.0).mul_(c)
    two_up = 2.0 * t
    del t
    return c * two_up


def keeps_fp32_copy(style: str, x: torch.Tensor, rstd: torch.Tensor) -> bool:
    """Whether backward keeps x's fp32 copy instead of x: the Llama, OLMo2 and Gemma styles compute in fp32 whatever
    the input, so an fp64 x's fp32 copy is what backward reads, and half its size (stock's norms keep that copy)."""
    return style in ("llama", "olmo2", "gemma") and x.element_size() > rstd.element_size()


def save_rms(ctx, input, weight, rstd, normed, need_x, style, fused):
    """What ``RMSNormFunction``'s torch code keeps for backward (x and rstd, or only the normalised input), in eager
    and under torch.func; ``normed``: the normalised input when it was computed, else None."""
    ctx.w_meta = None if weight is None else (weight.shape, weight.dtype)
    # The weight is a parameter (not an activation): keeping it costs nothing.
    narrow = keeps_fp32_copy(style, input, rstd)
    if not need_x and normed is not None and (narrow or _normed_no_bigger(normed, input, narrow, rstd)):
        # Only dW: the normalised input is all it reads; kept when no bigger than x plus rstd (x's dtype
        # in Llama/T5 style, or fp32 input in the fp32 styles). This is also what stock keeps there. The
        # weight's shape and dtype are all dW reads of it: a plain-tensor weight is not kept (stock's
        # product keeps only the normalised input when x needs no grad). ``narrow`` (an fp64 x): kept too, though
        # Llama's (fp64) is twice x's fp32 copy: rebuilding it would hold the copy, fp32 x·rstd and the fp64
        # normalised input at once, above stock's peak (which holds it and the product).
        ctx.save_for_backward(None, None, None, normed)
    else:
        kept = input.to(rstd.dtype) if narrow else _kept_input(input, rstd, fused)
        if kept is input:
            _common.note_input_kept(input)
        ctx.save_for_backward(kept, rstd, weight if (need_x or fused) else None, None)


def _kept_input(input, rstd, fused):
    """x as backward keeps it: a compact copy where a reduced-precision x views a wider storage (q split from a
    fused qkv projection) and stock keeps its fp32 copy of x's own size (not its fused kernel, which keeps x):
    the view would pin the whole base, 1.5x stock's bytes for a third of a bf16 qkv."""
    if fused or input.element_size() >= rstd.element_size():
        return input
    return _common.compact(input)


def _normed_no_bigger(normed, input, narrow, rstd) -> bool:
    """Whether keeping the normalised input costs no more than keeping x (or, ``narrow``, its fp32 copy) and rstd
    (:func:`save_rms`). Asked only where only dW is requested: reading x's storage size costs ~1 µs a call."""
    kept_bytes = input.numel() * (rstd.element_size() if narrow else input.element_size())
    storage = None if narrow else _common.storage_bytes(input)
    if storage is not None:
        # a view of a wider tensor (one head of a fused projection) pins its whole storage when kept
        kept_bytes = max(kept_bytes, storage)
    return normed.numel() * normed.element_size() <= kept_bytes + rstd.numel() * rstd.element_size()


def _rms_impl(input, weight, style, n):
    """The fast kernel (Triton) RMSNorm's Function runs on ``input``, or None for its torch code: none is
    preferred or fits, torch.compile traces (fast_kernel), a torch.func transform is active (the Function then
    runs plain torch ops, which vmap batches: :meth:`RMSNormFunction.under_transform` drops it), or autocast is on
    in the torch style (it may run stock's rms_norm in fp32, CUDA's fp32 list: the torch code mirrors it)."""
    if type(input) is not torch.Tensor and (sim := _CoreRmsSimulation.of(input, weight, style, n)) is not None:
        return sim
    impl = _common.fast_kernel("rms_norm" if style == "torch" else "rms_norm_hf", input)
    if impl is None or (style == "torch" and _common.autocast_enabled(input.device.type)):
        return None
    return impl if impl.supports(input, weight, n) else None


def _plain_contiguous(t: torch.Tensor) -> bool:
    """csrc/norms.cpp's plain_contiguous: exactly the row-major strides, size-1 dimensions included."""
    expected = 1
    for d in range(t.dim() - 1, -1, -1):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _rms_fast_ok(x, weight, style) -> bool:
    """csrc/norms.cpp's rms_fast_ok: where the core's RMSNorm runs its one-pass kernels."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.numel() == 0 or not _plain_contiguous(x):
        return False
    if weight is None:
        return style == "torch"
    return weight.dtype == x.dtype and weight.is_contiguous()


class _CoreRmsSimulation:
    """What the compiled core's one-pass RMSNorm allocates (csrc/norms.cpp: rms_forward_fast, rms_backward_fast), in
    its order and without data, as a fast kernel of :class:`RMSNormFunction`, for fake tensors whose real ones the core
    would serve (``slimgrad.estimate`` on CPU). The core reads data in C++ and cannot run on fakes; the torch code
    that stood in allocates a temporary per op: a tiny nn.RMSNorm step was estimated 65920 B high. Where the core
    runs aten's ops (rms_forward / rms_backward), the torch code does the same and stands in."""

    name = "core-simulation"

    def __init__(self, dims, style):
        self.dims, self.style = dims, style

    @classmethod
    def of(cls, input, weight, style, n):
        """The simulation for ``input`` where the core's one-pass path would serve its real tensor, else None."""
        from slimgrad.functional.dropout import is_simulated_core

        if (not is_simulated_core(input) or _registry.get_preference() == _registry.TRITON
                or _torch_function_mode_enabled() or _common.autocast_enabled("cpu")
                or (weight is not None and weight.device != input.device) or not _rms_fast_ok(input, weight, style)):
            return None
        if style != "torch":
            ndim = 1
        elif weight is not None:
            ndim = weight.dim()
        else:  # the trailing dims holding n elements (extra size-1 dims change no size the core allocates)
            ndim, k = 0, 1
            while k != n and ndim < input.dim():
                ndim += 1
                k *= input.shape[-ndim]
        return cls(tuple(range(input.dim() - ndim, input.dim())), style)

    def supports(self, input, weight, n) -> bool:
        return True

    @staticmethod
    def normed_dtype(x_dtype, weight, style):
        """rms_normed_dtype: the dtype of the normalised input as the weight multiplies it."""
        if style == "torch":
            return _opmath(x_dtype)
        if style == "llama":
            return x_dtype
        if style == "t5":
            return weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else \
                torch.promote_types(x_dtype, torch.float32)
        return torch.float32

    def forward(self, input, weight, eps, style, n, normed=None):
        sq = torch.empty(input.shape, dtype=torch.float32, device=input.device)
        if style == "torch":
            rstd = torch.rsqrt(sq.mean(self.dims, keepdim=True).add_(eps))
        else:  # C++ temporaries live to the end of the full expression: the mean's while rsqrt allocates
            mean = sq.mean(-1, keepdim=True)
            shifted = mean + eps
            rstd = torch.rsqrt(shifted)
            del mean, shifted
        del sq  # (before the output and the normalised input are made)
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        h = None if normed is None else torch.empty(input.shape, dtype=normed, device=input.device)
        return (out, rstd) if h is None else (out, rstd, h)

    def backward(self, grad_out, x, rstd, weight, style, n, need_x, need_w, stand_in=True, split=False):
        if stand_in and weight is not None and not need_x:  # the core keeps the weight only for dX: its shape and
            # dtype, no tensor
            weight = _WeightShape(weight.shape, weight.dtype)
        fast = (grad_out.dtype == x.dtype and _plain_contiguous(grad_out) and grad_out.shape == x.shape
                and _rms_fast_ok(x, None, "torch")
                and (weight.dtype == x.dtype and (not need_x or weight.is_contiguous()) if weight is not None
                     else style == "torch"))
        if not fast:  # the core's aten ops, the torch code's
            return _rms_backward(grad_out, x, rstd, weight, self.dims, style, need_x, need_w, x.dtype, split=split)
        p = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        q = torch.empty(x.shape, dtype=x.dtype if style in ("llama", "t5") else torch.float32,
                        device=x.device) if need_w else None
        dw = q.sum_to_size(weight.shape).to(weight.dtype) if need_w else None
        if not need_x:
            return None, dw
        del q
        d_rstd = p.sum(self.dims if style == "torch" else -1, keepdim=True)
        del p
        scaled, cubed = d_rstd * -0.5, rstd.pow(3)
        product = scaled * cubed
        c = product / n
        del scaled, cubed, product
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx2 = torch.empty(x.shape, dtype=x.dtype, device=x.device) if split else None
        del c, d_rstd
        return ((dx, dx2) if split else dx), dw

    def weight_grad_from_normed(self, grad_out, normed, n, w_shape, w_dtype):
        weight = _WeightShape(w_shape, w_dtype)
        return _weight_grad(_upstream_of_product(grad_out, self.style, weight, normed.dtype), normed, weight)


def _core_declines_fp64_sum(input, residual, weight, style) -> bool:
    """csrc/norms.cpp fused_add_rms declines an fp64 sum in the styles that compute in fp32 (the Python Function
    keeps its fp32 copy)."""
    return (style != "t5" and torch.promote_types(input.dtype, residual.dtype) == torch.float64
            and torch.is_grad_enabled() and (input.requires_grad or residual.requires_grad or weight.requires_grad))


class _CoreFusedAddSimulation(_CoreRmsSimulation):
    """What the compiled core's FusedAddRMSNorm allocates (csrc/norms.cpp FusedAddRMSNormFn: the sum, then RMSNorm's
    one-pass kernels where they apply to it, else its aten ops), as a fast kernel of
    :class:`FusedAddRMSNormFunction`, for fake tensors whose real ones the core would serve (``slimgrad.estimate`` on
    CPU). The torch code that stood in made a temporary per op: a step whose peak was the norm's was estimated 40 %
    high (fp32) to 116 % (bf16)."""

    @classmethod
    def of(cls, input, residual, weight, style):
        from slimgrad.functional.dropout import is_simulated_core

        if (not is_simulated_core(input) or _registry.get_preference() == _registry.TRITON
                or _torch_function_mode_enabled() or _common.autocast_enabled("cpu") or style not in _STYLE_CODE
                or style == "torch" or weight is None or weight.device != input.device
                or residual.device != input.device or _core_declines_fp64_sum(input, residual, weight, style)):
            return None
        return cls((input.dim() - 1,), style)

    def forward(self, input, weight, eps, style, n, residual=None):
        s = input + residual
        if _rms_fast_ok(s, weight, style):
            out, rstd = super().forward(s, weight, eps, style, n)
        else:  # the core's aten ops, the torch code's
            out, rstd = _rms_forward(s, weight, eps, self.dims, style)
        return out, rstd, s

    def backward(self, grad_out, s, rstd, weight, style, n, need_s, need_w, ds=None):
        # (the core keeps the weight: no stand-in for it); then the norm's dS plus the incoming one, as the core adds
        d, dw = super().backward(grad_out, s, rstd, weight, style, n, need_s, need_w, stand_in=False)
        if ds is not None:
            d = ds if d is None else d + ds
        return d, dw


def _fused_rms(input, weight, style) -> bool:
    """Whether the torch style runs stock's fused kernel (CUDA/XPU/MPS), which keeps x and rstd itself."""
    return (style == "torch" and input.device.type in _FUSED_RMS_DEVICES
            and (weight is None or weight.dtype == input.dtype))


def _first(out):
    """The user-visible output of a Function returning extra outputs: ``out[0]``, or ``out`` itself where its
    stock computation ran (under a transform it does not serve), which returns only that."""
    return out[0] if type(out) is tuple else out


class RMSNormFunction(_common.Function):
    """RMSNorm in one of :data:`RMS_STYLES`; keeps x and the per-row rstd, nothing else (or, where only the
    weight trains, only the normalised input when that is no bigger).

    ``dims``: the normalised dimensions (the caller's, so that forward and setup_context need not work them out
    twice); ``impl``: the fast kernel chosen by the caller (:func:`_rms_impl`), None for the torch code; ``again``:
    x once more where stock's graph gives x two gradients (:func:`stock_hands_two`): the square's goes there, the
    product's to x itself, so that autograd adds them in stock's order (a decoder layer's residual reads x too).
    Returns ``(out, rstd[, normed])``: the statistics and normalised input are what backward may read."""

    @staticmethod
    def forward(input, weight, eps, dims, style, impl, again=None):
        if impl is not None:
            n = _numel(input.shape[dims[0]:])
            if weight is not None and weight.requires_grad and not input.requires_grad:
                # Only dW (requires_grad is what needs_input_grad says): stock keeps the normalised input as the
                # weight multiplies it; x plus one fp32 rstd per row is more at small hidden sizes. Write the
                # normalised input in the forward's pass where it is no bigger than x (compact) plus rstd, as the
                # torch code decides, and keep only it.
                h_dtype = impl.normed_dtype(input.dtype, weight, style)
                if h_dtype.itemsize * n <= input.element_size() * n + 4:
                    return impl.forward(input, weight, eps, style, n, normed=h_dtype)
            return impl.forward(input, weight, eps, style, n)
        if style == "torch" and input.device.type in _FUSED_RMS_DEVICES and (weight is None
                                                                      or weight.dtype == input.dtype):
            return torch._fused_rms_norm(input, list(input.shape[dims[0]:]), weight, eps)
        # (the output's final cast, if its style has one, is the caller's: _finish_output)
        out, rstd, normed = _rms_forward(input, weight, eps, dims, style, keep_normed=True, cast=False)
        # The normalised input is what dW reads when dX is not requested; without a weight there is no dW.
        return (out, rstd, normed) if weight is not None else (out, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, eps, dims, style, impl = inputs[:6]
        ctx.split = len(inputs) > 6 and inputs[6] is not None
        ctx.extras = len(inputs) - 2
        rstd = output[1]
        normed = output[2] if len(output) > 2 else None
        ctx.mark_non_differentiable(*output[1:])
        if not _is_compiling():  # None for the extras' gradients, not zeros allocated each backward
            ctx._materialize_non_diff_grads = False
        need_x, need_w = ctx.needs_input_grad[:2]
        need_w = need_w and weight is not None
        ctx.mask = (need_x, need_w)
        ctx.impl = impl
        if impl is not None:
            ctx.style, ctx.n = style, _numel(input.shape[dims[0]:])
            if normed is not None:  # only dW, the normalised input written by the forward pass
                ctx.w_meta = (weight.shape, weight.dtype)
                ctx.save_for_backward(None, None, None, normed)
            elif need_x or need_w:
                # only dW: stock keeps the normalised input, compact; a view's base would be more
                kept = _kept_input(input, rstd, _fused_rms(input, weight, style)) if need_x else _common.compact(input)
                if kept is input:
                    _common.note_input_kept(input)
                ctx.save_for_backward(kept, rstd, weight, None)
            return
        # the fused kernel's output has no normalised input (with a weight, the torch code's has)
        fused = style == "torch" and (len(output) == 2 if weight is not None else _fused_rms(input, weight, style))
        ctx.dims, ctx.style, ctx.fused, ctx.x_dtype = dims, style, fused, input.dtype
        if need_x or need_w:
            save_rms(ctx, input, weight, rstd, normed, need_x, style, fused)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_extras):
        need_x, need_w = ctx.mask
        tail = (None,) * ctx.extras  # eps, dims, style, impl (and x again, or None in its place)
        if not (need_x or need_w):
            return None, None, *tail
        x, rstd, weight, normed = ctx.saved_tensors
        if ctx.impl is not None:
            if normed is not None:
                return None, ctx.impl.weight_grad_from_normed(grad_out, normed, ctx.n, *ctx.w_meta), *tail
            if ctx.split:  # the core's simulation (slimgrad.estimate): the core's two terms
                dx, dw = ctx.impl.backward(grad_out, x, rstd, weight, ctx.style, ctx.n, need_x, need_w, split=True)
                return dx[0], dw, None, None, None, None, dx[1]
            dx, dw = ctx.impl.backward(grad_out, x, rstd, weight, ctx.style, ctx.n, need_x, need_w)
            return dx, dw, *tail
        if weight is None and ctx.w_meta is not None:  # only dW: the weight's shape and dtype are all it reads
            weight = _WeightShape(*ctx.w_meta)
        if normed is not None:
            g = _upstream_of_product(grad_out, ctx.style, weight, normed.dtype)
            return None, _weight_grad(g, normed, weight), *tail
        if ctx.fused:
            dx, dw = _aten._fused_rms_norm_backward(grad_out, x, list(x.shape[x.dim() - len(ctx.dims):]), rstd,
                                                    weight, [need_x, need_w])
        else:
            dx, dw = _rms_backward(grad_out, x, rstd, weight, ctx.dims, ctx.style, need_x, need_w, ctx.x_dtype,
                                   split=ctx.split)
            if ctx.split:  # (need_x)
                return dx[0], (dw if need_w else None), None, None, None, None, dx[1]
        return (dx if need_x else None), (dw if need_w else None), *tail

    @staticmethod
    def stock(input, weight, eps, dims, style, impl=None, again=None):
        """Stock's computation: ``F.rms_norm`` for the torch style, the reference formula otherwise."""
        if style == "torch":
            return torch.nn.functional.rms_norm(input, tuple(input.shape[dims[0]:]), weight, eps)
        return _rms_forward(input, weight, eps, dims, style)[0]

    @classmethod
    def under_transform(cls, input, weight, eps, dims, style, impl, again=None):
        if _fused_rms(input, weight, style):
            # Stock's fused kernel keeps x and rstd, as the Function does there: nothing to save.
            return cls.stock(input, weight, eps, dims, style, None)
        return _common._AUTOGRAD_APPLY(cls, input, weight, eps, dims, style, None, again)


def _rms_forward(x, weight, eps, dims, style, keep_normed=False, cast=True):
    """The reference forward of ``style``; returns (output, rstd), plus, with ``keep_normed``, the tensor the
    weight's gradient reads (the normalised input, in the dtype the weight multiplies it in). ``cast=False``: the
    output before the final cast of the styles that end in one (:func:`_finish_output` makes it)."""
    out, rstd, normed = _rms_forward_impl(x, weight, eps, dims, style, cast)
    return (out, rstd, normed) if keep_normed else (out, rstd)


CAST_LAST = ("torch", "olmo2", "gemma")
"""The styles whose output is the product cast to x's dtype (torch: and made contiguous)."""


def _finish_output(out, x, style):
    """The final cast of a :data:`CAST_LAST` style's output (a no-op on a finished output). RMSNormFunction's
    torch code leaves it to stock's ops after the Function, as stock's graph has it: the cast's node turns dY into
    the product's dtype and frees it before the Function's backward runs. Done inside, the Function would hold dY
    and its cast at once (an fp64 or half x: +1 dY at the backward's peak, above stock's)."""
    out = out.type_as(x)
    if style == "torch" and not _layout.channels_last_like(x):
        # Stock's composite makes its result contiguous unless x is channels-last (the same values; code that
        # views the output relies on it). Cast first: the copy is then in x's dtype, not fp32.
        out = out.contiguous()
    return out


def _rms_forward_impl(x, weight, eps, dims, style, cast=True):
    if style == "torch":
        up = x.to(_opmath(x.dtype))
        rstd = torch.rsqrt(up.pow(2).mean(dims, keepdim=True).add_(eps))
        h = up * rstd
        del up  # (x's upcast copy, freed before the output is made; csrc/norms.cpp's rms_forward frees it there too)
        out = h * weight if weight is not None else h
        return (_finish_output(out, x, style) if cast else out), rstd, h
    if style == "t5":
        rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
        h = x * rstd
        if weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(weight.dtype)
        return weight * h, rstd, h
    up = x.to(torch.float32)
    rstd = torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)
    h = up * rstd
    del up
    if style == "llama":
        normed = h.to(x.dtype)
        del h
        return weight * normed, rstd, normed
    out = weight * h if style == "olmo2" else h * (1.0 + weight.float())  # (gemma)
    return (_finish_output(out, x, style) if cast else out), rstd, h


def _upstream_of_product(dy, style, weight, h_dtype):
    """The gradient reaching the ``weight × normalised`` product: dY itself where the product is the output
    (Llama, T5), dY cast to the product's dtype where a cast follows it (torch, Olmo2: promoted; Gemma: fp32).
    ``h_dtype``: the normalised input's dtype."""
    if style in ("llama", "t5"):
        return dy
    if style == "gemma":
        return dy.to(torch.float32)
    return dy.to(torch.promote_types(weight.dtype, h_dtype))


def _in_place_ok(t) -> bool:
    """Whether this backward may overwrite ``t``, a temporary it made, with an element-wise product (the same values
    and, ``t`` being plain contiguous, the same layout as the out-of-place product, whose layout fixes the reduction's
    order after it): not under torch.compile (Inductor plans that memory) nor a torch.func transform (vmap cannot
    write a batched operand into an unbatched tensor). csrc/norms.cpp's rms_backward decides alike."""
    return not _is_compiling() and not torch._C._are_functorch_transforms_active() and _plain_contiguous(t)


def _normalised(x, hd, rstd):
    """``x.to(hd) * rstd``, into x's copy where the cast made one (one x-sized temporary, not two)."""
    up = x.to(hd)
    return up.mul_(rstd) if up is not x and _in_place_ok(up) else up * rstd


def _weight_grad(g, h, weight, h_is_temporary=False):
    """``Σ_rows g·h`` as autograd reduces a broadcast product's gradient (sum_to, then cast). ``h_is_temporary``:
    h was made by this backward and may hold the product (where it has the product's dtype and g's layout), so
    that only-dW holds no more x-sized tensors at once than stock's node, which reads a kept h."""
    if (h_is_temporary and h.shape == g.shape and h.dtype == torch.promote_types(g.dtype, h.dtype)
            and h.stride() == g.stride() and _in_place_ok(h)):
        product = h.mul_(g)
        del h
        reduced = product.sum_to_size(weight.shape)
        del product  # (before the cast allocates, as the engine frees stock's product after its reduction)
        return reduced.to(weight.dtype)
    return (g * h).sum_to_size(weight.shape).to(weight.dtype)


def stock_hands_two(x_dtype, style) -> bool:
    """Whether stock's graph gives x two gradients (the product ``x·rstd``'s, then the square's) rather than one:
    where x itself feeds both, i.e. T5 style always, and the other styles where x is already in the statistics'
    dtype (no cast node between). The engine adds each to x's buffer in turn, after the gradients of readers of x
    created later (a decoder layer's residual); handing over their sum instead rounds (a + b) + c as a + (b + c)."""
    return style == "t5" or x_dtype == (_opmath(x_dtype) if style == "torch" else torch.float32)


def _rms_backward(dy, x, rstd, weight, dims, style, need_x, need_w, x_dtype, split=False):
    """Autograd's backward of ``_rms_forward(style)``, replayed op for op (so bitwise), computing only the
    requested gradients; ``split`` (:func:`stock_hands_two`): dX as its two terms, unsummed.

    Each temporary is dropped after its last use and made no earlier than needed (the normalised input only for
    dW, x's fp32 copy only when read), so that the peak stays at or below stock's, whose engine frees each node's
    tensors as it goes (csrc/norms.cpp's rms_backward allocates and frees in this same order, which the estimate
    relies on)."""
    n = 1
    for d in dims:  # a plain loop: dynamo cannot trace math.prod over a generator
        n *= x.shape[d]
    dx = dw = None
    if style == "t5":
        hd = torch.promote_types(x.dtype, rstd.dtype)  # x · rstd's dtype
        ht_dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else hd
        if need_w:
            # (x · rstd as x's copy scaled in place: the mixed-dtype product would make that copy and another)
            dw = _weight_grad(dy, _normalised(x, hd, rstd).to(ht_dtype), weight, h_is_temporary=True)
        if not need_x:
            return None, dw
        dh = (dy * weight).to(ht_dtype).to(hd)
        # the row sum's product before dX's first term, so that the two x-sized temporaries never live together
        # (stock frees dY before it makes them; this backward holds it throughout)
        c = _variance_row_factor((dh * x).sum(-1, keepdim=True).to(rstd.dtype), rstd, n)
        dx1 = (dh * rstd).to(x.dtype)
        del dh
        dx2 = _variance_path_grad(c, x.to(torch.float32)).to(x.dtype)
        if split:
            return (dx1, dx2), dw
        return dx1.add_(dx2), dw  # in place, as autograd accumulates: the layout of the first to arrive
    hd = rstd.dtype  # the normalised input's: up (x in rstd's dtype) times rstd
    g_h = None
    if weight is None:  # torch style without affine
        g_h = dy.to(hd)
    elif style == "llama":
        if need_w:
            dw = _weight_grad(dy, _normalised(x, hd, rstd).to(x_dtype), weight, h_is_temporary=True)
        if need_x:
            g_h = (dy * weight).to(x_dtype).to(hd)
    else:
        g = _upstream_of_product(dy, style, weight, hd)
        if need_w:
            dw = _weight_grad(g, _normalised(x, hd, rstd), weight, h_is_temporary=True)
        if need_x:
            g_h = (g * weight).to(hd) if style != "gemma" else g * (1.0 + weight.float())
        del g
    if need_x:
        up = x.to(hd)  # x may already be that copy (fp64 input, fp32 styles)
        c = _variance_row_factor((g_h * up).sum(dims, keepdim=True), rstd, n)
        dx = g_h * rstd
        del g_h
        if split:  # (up is x)
            return (dx, _variance_path_grad(c, up)), dw
        # x's two gradients are summed as autograd's engine sums them: in place into the first to arrive
        # (the product's, whose node runs first), which keeps its layout (an out-of-place sum can restride
        # size-1 dimensions).
        dx = dx.add_(_variance_path_grad(c, up))
        del up
        dx = dx.to(x_dtype)
    return dx, dw


def _check_trailing_shape(fn, input, normalized_shape, params):
    """layer_norm's and rms_norm's shape checks, raising stock's exception type (RuntimeError): x must end in
    ``normalized_shape`` (a module's), each parameter must have that shape."""
    k = len(normalized_shape)
    if input.dim() < k or tuple(input.shape[input.dim() - k:]) != tuple(normalized_shape):
        raise RuntimeError(f"slimgrad: {fn}: argument 'input' must end in normalized_shape "
                           f"{list(normalized_shape)} (a module's normalized_shape), got shape {tuple(input.shape)}")
    for name, p in params:
        if p is not None and tuple(p.shape) != tuple(normalized_shape):
            raise RuntimeError(f"slimgrad: {fn}: argument '{name}' must have normalized_shape "
                               f"{list(normalized_shape)}, got {list(p.shape)}")


def _check_rms(fn, input, weight, eps, ndim=1):
    _common.check_tensor(input, "input", fn=fn)
    if weight is not None:
        _common.check_tensor(weight, "weight", fn=fn)
    if not input.is_floating_point():
        # (NotImplementedError, a RuntimeError, as stock's kernel raises for an integer input)
        raise NotImplementedError(f"{fn}: argument 'input' must be a floating-point tensor, got {input.dtype}")
    if input.dim() < ndim:
        raise ValueError(f"{fn}: argument 'input' must have at least {ndim} dim(s), got shape {tuple(input.shape)}")
    if eps is not None and (not isinstance(eps, (int, float)) or eps < 0):
        raise ValueError(f"{fn}: argument 'eps' must be a non-negative number, got {eps!r}")


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.rms_norm``: same output and gradients, keeping x and rstd only."""
    if has_torch_function_variadic(input, weight):
        return handle_torch_function(rms_norm, (input, weight), input, normalized_shape, weight=weight, eps=eps)
    core = _core(input)
    if core is not None:
        out = core.norms_rms(input, weight, eps, normalized_shape, 0, _note())
        if out is not None:
            return out
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    _check_rms("rms_norm", input, weight, eps, len(normalized_shape))
    _check_trailing_shape("rms_norm", input, normalized_shape, (("weight", weight),))
    if eps is None:
        eps = torch.finfo(_opmath(input.dtype)).eps
    impl = _rms_impl(input, weight, "torch", _numel(normalized_shape))
    out = _apply_rms(input, weight, eps, tuple(range(input.dim() - len(normalized_shape), input.dim())), "torch", impl)
    return out[0] if type(out) is tuple else out  # (out, rstd[, normed]), or stock's output under torch.func


def rms_norm_hf(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, style: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim with the casting of a Hugging Face reference (see :data:`RMS_STYLES`);
    ``style="gemma"`` scales by ``1 + weight``."""
    if has_torch_function_variadic(input, weight):
        return handle_torch_function(rms_norm_hf, (input, weight), input, weight, eps=eps, style=style)
    core = _core(input)
    if core is not None and style in _STYLE_CODE and style != "torch":
        out = core.norms_rms(input, weight, eps, None, _STYLE_CODE[style], _note())
        if out is not None:
            return out
    if style not in RMS_STYLES or style == "torch":
        raise ValueError(f"rms_norm_hf: argument 'style' must be one of {RMS_STYLES[1:]}, got {style!r}")
    _check_rms("rms_norm_hf", input, weight, eps)
    if weight is None or weight.dim() != 1:
        got = None if weight is None else list(weight.shape)
        raise ValueError(f"slimgrad: rms_norm_hf: argument 'weight' must be a vector (the hidden size), got {got}")
    if weight.shape[0] != input.shape[-1]:
        # the reference's ``weight * x`` raises a RuntimeError here
        raise RuntimeError(f"slimgrad: rms_norm_hf: argument 'input' must have the weight's size "
                           f"{weight.shape[0]} (the module's hidden size) as its last dim, got shape "
                           f"{tuple(input.shape)}")
    out = _apply_rms(input, weight, float(eps), (input.dim() - 1,), style, _rms_impl(input, weight, style,
                                                                                  input.shape[-1]))
    return out[0] if type(out) is tuple else out


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead


def _apply_rms(input, weight, eps, dims, style, impl):
    """``RMSNormFunction.apply``; in eager its eager branch called directly (torch's C apply, the tensors unwrapped
    as its ``unwrap_dead_wrappers`` does): the generic argument handling cost ~2 µs a call on the Python path,
    which is CUDA's (the core serves CPU tensors). x goes in twice where stock hands x two gradients, except under
    torch.compile (dynamo refuses one tensor passed twice; compiled stock's sums are Inductor's anyway), with a
    Triton kernel (one fused dX, within rounding) and where stock's fused kernel runs (one gradient)."""
    if (style in ("llama", "olmo2") and input.dtype == torch.float64 and input.requires_grad
            and not (weight is not None and weight.requires_grad) and torch.is_grad_enabled()):
        # Only dX of an fp64 x in Llama/Olmo2 style: stock keeps x's fp32 copy and rstd, as the Function would;
        # nothing to save, and the Function would hold dY through its backward where stock frees it after the
        # weight's product (a few bytes above stock's peak). Stock's ops run (csrc/norms.cpp's rms() declines).
        # (Gemma's stock also keeps 1 + w in fp32: the Function keeps less there, at no more peak.)
        return RMSNormFunction.stock(input, weight, eps, dims, style)
    out = _apply_rms_function(input, weight, eps, dims, style, impl)
    if impl is None and style in CAST_LAST and not _fused_rms(input, weight, style):
        # the torch code's output before its style's final cast: stock's ops make it, as in stock's graph. The
        # statistics returned beside it are dropped first (stock frees rstd before its cast where it keeps none)
        first = out[0] if type(out) is tuple else out
        del out
        return _finish_output(first, input, style)
    return out


def _apply_rms_function(input, weight, eps, dims, style, impl):
    if _is_compiling():
        return RMSNormFunction.apply(input, weight, eps, dims, style, impl, None)
    split = (input.requires_grad and (impl is None or type(impl) is _CoreRmsSimulation)
             and stock_hands_two(input.dtype, style) and not _fused_rms(input, weight, style))
    if torch._C._are_functorch_transforms_active():
        return RMSNormFunction.apply(input, weight, eps, dims, style, impl, input if split else None)
    input = _unwrap_if_dead(input)
    return _C_APPLY(RMSNormFunction, input, _unwrap(weight), eps, dims, style, impl, input if split else None)


def _unwrap(t):
    return t if t is None else _unwrap_if_dead(t)


# ---------------------------------------------------------------------------------------------------------
# LayerNorm / GroupNorm: stock kernels, stock output_mask, nothing input-sized when only the bias trains.


def _layer_norm_impl(input, weight, bias, n):
    """The fast kernel (Triton) LayerNorm's Function runs on ``input``, or None for stock's kernels (see
    :func:`_rms_impl`; autocast runs stock's layer norm in fp32 on CUDA, which the aten call mirrors)."""
    impl = _common.fast_kernel("layer_norm", input)
    if impl is None or _common.autocast_enabled(input.device.type):
        return None
    return impl if impl.supports(input, weight, bias, n) else None


def _stock_keeps_the_same(input, weight) -> bool:
    """Layer and group norm keep x, mean and rstd whenever x or the weight needs a gradient, as stock does: under
    torch.func the Function would pay functorch's per-call cost of a custom Function (~0.35 ms under grad, ~0.7 ms
    under vmap(grad), measured) for nothing there. ``requires_grad`` at the call is what ``needs_input_grad`` will
    say at the innermost grad level."""
    return input.requires_grad or (weight is not None and weight.requires_grad)


class LayerNormFunction(_common.Function):
    """``native_layer_norm``; keeps x, mean and rstd only when dX or dW is requested. Returns ``(out, mean,
    rstd)``.

    For a bias-only backward the kernel is handed dY itself in x's place: with only dB requested it never
    reads x's values, and dY is contiguous (the kernel makes it so anyway), so nothing is copied."""

    @staticmethod
    def forward(input, normalized_shape, weight, bias, eps, impl):
        if impl is not None:
            return impl.forward(input, weight, bias, eps, _numel(normalized_shape))
        return torch.native_layer_norm(input, normalized_shape, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, normalized_shape, weight, bias, eps, impl = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        if not _is_compiling():  # None for the extras' gradients, not zeros allocated each backward
            ctx._materialize_non_diff_grads = False
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        ctx.mask, ctx.impl = (need_x, need_w, need_b), impl
        keep = need_x or need_w
        if keep:
            _common.note_input_kept(input)
        if impl is not None:
            ctx.n = _numel(normalized_shape)
            ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
            if keep:
                ctx.save_for_backward(input, mean, rstd, weight)
            return
        ctx.normalized_shape = normalized_shape
        ctx.stat_shape, ctx.stat_dtype = mean.shape, mean.dtype
        if keep or need_b:
            ctx.save_for_backward(input if keep else None, mean if keep else None, rstd if keep else None,
                                  weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_stats):
        need_x, need_w, need_b = ctx.mask
        if not (need_x or need_w or need_b):
            return (None,) * 6
        if ctx.impl is not None:
            x, mean, rstd, weight = ctx.saved_tensors if (need_x or need_w) else (None,) * 4
            dx, dw, db = ctx.impl.backward(grad_out, x, mean, rstd, weight, ctx.n, need_x, need_w, need_b,
                                           bias_dtype=ctx.bias_meta[1] if need_b else None)
            db = db.view(ctx.bias_meta[0]) if need_b else None
            return dx, None, dw, db, None, None
        x, mean, rstd, weight, bias = ctx.saved_tensors
        if x is None:
            grad_out = grad_out.contiguous()
            x = grad_out
            mean = rstd = grad_out.new_zeros(ctx.stat_shape, dtype=ctx.stat_dtype)
        dx, dw, db = _aten.native_layer_norm_backward(grad_out, x, ctx.normalized_shape, mean, rstd, weight, bias,
                                                      [need_x, need_w, need_b])
        return (dx if need_x else None), None, (dw if need_w else None), (db if need_b else None), None, None

    @staticmethod
    def stock(input, normalized_shape, weight, bias, eps, impl=None):
        return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)

    @classmethod
    def under_transform(cls, input, normalized_shape, weight, bias, eps, impl):
        if _stock_keeps_the_same(input, weight):
            return cls.stock(input, normalized_shape, weight, bias, eps)
        return _common._AUTOGRAD_APPLY(cls, input, normalized_shape, weight, bias, eps, None)


def layer_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.layer_norm`` (bitwise: stock's kernels)."""
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(layer_norm, (input, weight, bias), input, normalized_shape, weight=weight,
                                     bias=bias, eps=eps)
    core = _core(input)
    if core is not None:
        out = core.norms_layer(input, normalized_shape, weight, bias, eps, _note())
        if out is not None:
            return out
    _common.check_tensor(input, "input", fn="layer_norm")
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = list(normalized_shape)
    _check_trailing_shape("layer_norm", input, normalized_shape, (("weight", weight), ("bias", bias)))
    impl = _layer_norm_impl(input, weight, bias, _numel(normalized_shape))
    if _is_compiling() or torch._C._are_functorch_transforms_active():
        return _first(LayerNormFunction.apply(input, normalized_shape, weight, bias, eps, impl))
    # eager: apply's eager branch called directly, as _apply_rms does
    return _first(_C_APPLY(LayerNormFunction, _unwrap_if_dead(input), normalized_shape, _unwrap(weight),
                           _unwrap(bias), eps, impl))


def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """The layout stock's group norm runs in (``Tensor::suggest_memory_format``, whose stride-order rule
    ``torch._prims_common`` mirrors; only asked where t is not plain contiguous). ``is_contiguous(channels_last)``
    is not that rule: it ignores size-1 dimensions, so a batch-1 map whose batch stride is not the largest
    (diffusers' attention output, strides (32, 1, 256, 32)) passed it, and ``native_group_norm``, which checks
    the stride rule, refused the tensor."""
    if t.dim() not in (4, 5) or t.is_contiguous():
        return torch.contiguous_format
    return _prims_suggest_memory_format(t)


class GroupNormFunction(_common.Function):
    """``native_group_norm``; keeps x, mean and rstd only when dX or dW is requested (dY stands in for x
    when only dB is: the kernel folds x only into the per-channel ``Σ dy·x``, which dB does not read).
    ``dims``: (N, C, H*W, groups), native_group_norm's arguments, worked out once by the caller. Returns
    ``(out, mean, rstd[, x])``, x being the copy of the input in the layout the kernels ran in, where that is not
    the input itself."""

    @staticmethod
    def forward(input, weight, bias, dims, eps):
        if input.is_contiguous():
            return torch.native_group_norm(input, weight, bias, *dims, eps)
        input_c = input.contiguous(memory_format=_suggest_memory_format(input))
        out = torch.native_group_norm(input_c, weight, bias, *dims, eps)
        return out if input_c is input else (*out, input_c)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, dims, eps = inputs
        _, mean, rstd, *copy = output
        ctx.mark_non_differentiable(mean, rstd, *copy)
        if not _is_compiling():  # None for the extras' gradients, not zeros allocated each backward
            ctx._materialize_non_diff_grads = False
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        ctx.mask = (need_x, need_w, need_b)
        ctx.dims = dims
        ctx.fmt = torch.contiguous_format if input.is_contiguous() else _suggest_memory_format(input)
        ctx.stat_shape, ctx.stat_dtype = mean.shape, mean.dtype
        keep = need_x or need_w
        if keep:
            _common.note_input_kept(input)
        if keep or need_b:
            ctx.save_for_backward((copy[0] if copy else input) if keep else None, mean if keep else None,
                                  rstd if keep else None, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_extras):
        need_x, need_w, need_b = ctx.mask
        if not (need_x or need_w or need_b):
            return (None,) * 5
        x, mean, rstd, weight = ctx.saved_tensors
        fmt = ctx.fmt
        if not need_x and fmt != torch.contiguous_format:
            # torch 2.13's channels-last CPU kernel writes dX unconditionally and segfaults when dX is not
            # requested (stock GroupNorm crashes there); use the contiguous kernel for dW/dB instead.
            fmt = torch.contiguous_format
            x = None if x is None else x.contiguous()
        grad_out = grad_out.contiguous(memory_format=fmt)
        if x is None:
            x = grad_out
            mean = rstd = grad_out.new_zeros(ctx.stat_shape, dtype=ctx.stat_dtype)
        dx, dw, db = _aten.native_group_norm_backward(grad_out, x, mean, rstd, weight, *ctx.dims,
                                                      [need_x, need_w, need_b])
        return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None, None

    @staticmethod
    def stock(input, weight, bias, dims, eps):
        return torch.nn.functional.group_norm(input, dims[3], weight, bias, eps)

    @classmethod
    def under_transform(cls, input, weight, bias, dims, eps):
        if not input.is_contiguous() or _stock_keeps_the_same(input, weight):
            # (Non-contiguous: the Function would run stock's kernels on a contiguous or channels-last copy.)
            return cls.stock(input, weight, bias, dims, eps)
        return _common._AUTOGRAD_APPLY(cls, input, weight, bias, dims, eps)


def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.group_norm`` (bitwise: stock's kernels)."""
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(group_norm, (input, weight, bias), input, num_groups, weight=weight,
                                     bias=bias, eps=eps)
    core = _core(input)
    if core is not None:
        out = core.norms_group(input, num_groups, weight, bias, eps, _note())
        if out is not None:
            return out
    _common.check_tensor(input, "input", fn="group_norm")
    if input.dim() < 2:
        raise RuntimeError(f"slimgrad: group_norm: argument 'input' must have at least 2 dims (N, C, ...), got "
                           f"shape {tuple(input.shape)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"slimgrad: group_norm: argument 'num_groups' must be an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise ValueError(f"slimgrad: group_norm: argument 'num_groups' must be positive, got {num_groups}")
    c = input.shape[1]
    if c % num_groups:
        raise RuntimeError(f"slimgrad: group_norm: argument 'input' has {c} channels (dim 1 of shape "
                           f"{tuple(input.shape)}), not divisible by num_groups={num_groups}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.dim() != 1:
            raise RuntimeError(f"slimgrad: group_norm: argument '{name}' must be a vector (one entry per channel), "
                               f"got shape {list(p.shape)}")
        if p.shape[0] != c:
            raise RuntimeError(f"slimgrad: group_norm: argument 'input' has {c} channels (dim 1 of shape "
                               f"{tuple(input.shape)}) but argument '{name}' has {p.shape[0]} (a GroupNorm's "
                               f"num_channels): they must match")
    n = input.shape[0]
    # (N, C, H*W, groups): native_group_norm's arguments, worked out once for forward and setup_context
    dims = (n, c, input.numel() // (n * c) if n * c else 1, num_groups)
    if _is_compiling() or torch._C._are_functorch_transforms_active():
        out = GroupNormFunction.apply(input, weight, bias, dims, eps)
    else:  # eager: apply's eager branch called directly, as _apply_rms does
        out = _C_APPLY(GroupNormFunction, _unwrap_if_dead(input), _unwrap(weight), _unwrap(bias), dims, eps)
    return out[0] if type(out) is tuple else out


# ---------------------------------------------------------------------------------------------------------
# FusedAddRMSNorm and PolyNorm: no stock counterpart; references are the formulas in plain PyTorch.


def _fused_add_impl(input, residual, weight, n):
    """The fast kernel (Triton) FusedAddRMSNorm's Function runs on ``input``, or None for the torch code (see
    :func:`_rms_impl`)."""
    impl = _common.fast_kernel("fused_add_rms_norm", input)
    return impl if (impl is not None and residual.dtype == input.dtype and impl.supports(input, weight, n)) else None


class FusedAddRMSNormFunction(_common.Function):
    """``s = x + r``; returns ``(rms_norm(s), s, rstd)``. Keeps s and rstd; ``dx = dr = dRMSNorm + ds_out``."""

    @staticmethod
    def forward(input, residual, weight, eps, style, impl):
        if impl is not None:
            out, rstd, s = impl.forward(input, weight, eps, style, input.shape[-1], residual=residual)
        else:
            s = input + residual
            out, rstd = _rms_forward(s, weight, eps, (s.dim() - 1,), style)
        return out, s, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, residual, weight, eps, style, impl = inputs
        _, s, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient must stay None (no dW from zeros)
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        ctx.impl = impl
        ctx.mask = (need_x, need_r, need_w)
        ctx.style = style
        ctx.in_dtypes = (input.dtype, residual.dtype)
        ctx.s_dtype = s.dtype
        if need_x or need_r or need_w:
            # An fp64 s in the styles that compute in fp32: its fp32 copy, all backward reads of it and half its
            # bytes (stock's norm keeps that copy). The torch code only: no Triton kernel takes fp64.
            narrow = impl is None and keeps_fp32_copy(style, s, rstd)
            ctx.save_for_backward(s.to(rstd.dtype) if narrow else s, rstd, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_s, _grad_rstd):
        need_x, need_r, need_w = ctx.mask
        if not (need_x or need_r or need_w):
            return (None,) * 6
        s, rstd, weight = ctx.saved_tensors
        need_s = need_x or need_r
        ds = dw = None
        if ctx.impl is not None:
            if grad_out is not None:
                # grad_s joins dX inside the kernel, and only when s's gradient exists (an unused s gives None).
                ds, dw = ctx.impl.backward(grad_out, s, rstd, weight, ctx.style, s.shape[-1], need_s, need_w,
                                           ds=grad_s if need_s else None)
            elif need_s:
                ds = grad_s
        elif grad_out is not None:
            ds, dw = _rms_backward(grad_out, s, rstd, weight, (s.dim() - 1,), ctx.style, need_s, need_w, ctx.s_dtype)
        if ctx.impl is None and need_s and grad_s is not None:
            ds = grad_s if ds is None else ds + grad_s
        if need_s and ds is None:
            ds = torch.zeros_like(s, dtype=ctx.s_dtype)
        dx = ds.to(ctx.in_dtypes[0]) if need_x else None
        dr = ds.to(ctx.in_dtypes[1]) if need_r else None
        return dx, dr, (dw if need_w else None), None, None, None

    @staticmethod
    def stock(input, residual, weight, eps, style, impl=None):
        """The reference formula, differentiated by autograd: ``(rms_norm(s), s)`` for ``s = input + residual``."""
        s = input + residual
        return _rms_forward(s, weight, eps, (s.dim() - 1,), style)[0], s

    @classmethod
    def under_transform(cls, input, residual, weight, eps, style, impl):
        return _common._AUTOGRAD_APPLY(cls, input, residual, weight, eps, style, None)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       style: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``s = input + residual``; returns ``(RMSNorm(s), s)`` with ``style``'s casting (Llama by default),
    keeping s and one fp32 stat per row."""
    only_dw = (torch.is_grad_enabled() and isinstance(input, torch.Tensor) and isinstance(residual, torch.Tensor)
               and isinstance(weight, torch.Tensor) and weight.requires_grad
               and not (input.requires_grad or residual.requires_grad))
    core = None if only_dw else _core(input)
    if core is not None and style in _STYLE_CODE and style != "torch":
        # one C++ Function (csrc/norms.cpp), the Function below op for op; None where it declines (then the
        # checks below give the error, or the Python Function runs)
        out = core.norms_fused_add_rms(input, residual, weight, eps, _STYLE_CODE[style])
        if out is not None:
            return out
    _common.check_tensor(residual, "residual", fn="fused_add_rms_norm")
    if style not in RMS_STYLES or style == "torch":
        raise ValueError(f"fused_add_rms_norm: argument 'style' must be one of {RMS_STYLES[1:]}, got {style!r}")
    _check_rms("fused_add_rms_norm", input, weight, eps)
    if residual.shape != input.shape:
        raise ValueError(f"fused_add_rms_norm: argument 'residual' must have input's shape {tuple(input.shape)}, "
                         f"got {tuple(residual.shape)}")
    if weight is None or weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(f"fused_add_rms_norm: argument 'weight' must have shape [{input.shape[-1]}]")
    if only_dw:
        # s needs no gradient: RMSNorm of it keeps what its only dW reads (the normalised input, where stock's norm
        # keeps that), where the Function kept s and rstd (one more fp32 per row; fp64: s in fp64)
        s = input + residual
        return rms_norm_hf(s, weight, eps, style), s
    impl = _fused_add_impl(input, residual, weight, input.shape[-1])
    if impl is None:  # a fake tensor whose real one the core would serve: what the core allocates
        impl = _CoreFusedAddSimulation.of(input, residual, weight, style)
    out = FusedAddRMSNormFunction.apply(input, residual, weight, float(eps), style, impl)
    return out[0], out[1]


def poly_norm_forward(input, weight, bias, eps):
    """PolyNorm's output in opmath (fp32, fp64 for fp64; not yet cast to x's dtype) and its three per-row rstds;
    shared by the Function and its stock computation under torch.func."""
    xf = input.to(_opmath(input.dtype))
    r3, r2, r1 = (torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) for u in (xf.pow(3), xf.pow(2), xf))
    w = weight.to(xf.dtype)
    out = w[0] * (xf.pow(3) * r3) + w[1] * (xf.pow(2) * r2) + w[2] * (xf * r1)
    if bias is not None:
        out = out + bias.to(xf.dtype)
    return out, (r3, r2, r1)


class PolyNormFunction(_common.Function):
    """``y = w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b`` with ``norm(u) = u·rsqrt(mean(u²)+eps)`` over the
    last dim, computed in fp32 (fp64 for fp64) and cast to x's dtype. Keeps x and the three per-row rstds (fp32).
    Returns ``(y, rstds)``."""

    @staticmethod
    def forward(input, weight, bias, eps):
        out, rstds = poly_norm_forward(input, weight, bias, eps)
        return out.to(input.dtype), torch.cat(rstds, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, eps = inputs
        _, rstds = output
        ctx.mark_non_differentiable(rstds)
        if not _is_compiling():  # None for the extras' gradients, not zeros allocated each backward
            ctx._materialize_non_diff_grads = False
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.mask = (need_x, need_w, need_b and bias is not None)
        ctx.bias_dtype = None if bias is None else bias.dtype
        if need_x or need_w:
            _common.note_input_kept(input)
            ctx.save_for_backward(input, rstds, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_rstds):
        need_x, need_w, need_b = ctx.mask
        g = grad_out.to(_opmath(grad_out.dtype))
        db = g.sum_to_size((1,)).to(ctx.bias_dtype) if need_b else None
        if not (need_x or need_w):
            return None, None, db, None
        x, rstds, weight = ctx.saved_tensors
        xf = x.to(g.dtype)
        n = x.shape[-1]
        powers = (xf.pow(3), xf.pow(2), xf)
        dw = [] if need_w else None
        dx = torch.zeros_like(xf) if need_x else None
        for i, u in enumerate(powers):
            r = rstds[..., i:i + 1]
            u_hat = u * r
            if need_w:
                dw.append((g * u_hat).sum())
            if need_x:
                m = g * weight[i].to(g.dtype)
                # d norm(u)/du applied to m: r·m − r³/n·Σ(m·u)·u, then chain rule through u = x^(3-i).
                du = r * m - (r.pow(3) / n) * (m * u).sum(-1, keepdim=True) * u
                if i == 0:
                    du = du * (3 * xf * xf)
                elif i == 1:
                    du = du * (2 * xf)
                dx.add_(du)
        # dW stacked rather than written element by element: the same values, and vmap batches a stack
        return (dx.to(x.dtype) if need_x else None), (torch.stack(dw).to(weight.dtype) if need_w else None), db, None

    @staticmethod
    def stock(input, weight, bias, eps):
        """The formula, differentiated by autograd."""
        return poly_norm_forward(input, weight, bias, eps)[0].to(input.dtype)


def poly_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              eps: float = 1e-6) -> torch.Tensor:
    """PolyNorm (BRIEF §5): ``weight`` has 3 elements (for x³, x², x), ``bias`` 1."""
    _check_rms("poly_norm", input, weight, eps)
    if weight is None or weight.shape != (3,):
        raise ValueError(f"poly_norm: argument 'weight' must have shape [3], got "
                         f"{None if weight is None else list(weight.shape)}")
    if bias is not None:
        _common.check_tensor(bias, "bias", fn="poly_norm")
        if bias.shape != (1,):
            raise ValueError(f"poly_norm: argument 'bias' must have shape [1], got {list(bias.shape)}")
    return _first(PolyNormFunction.apply(input, weight, bias, float(eps)))
