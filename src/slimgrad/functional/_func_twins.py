"""slimgrad's Functions in the ``setup_context`` form: what runs instead of them under ``torch.func``.

functorch (``grad``, ``vmap``, ``jacrev``, ``functional_call`` under them) only accepts autograd Functions
whose ``forward`` takes no ``ctx`` and whose ``setup_context(ctx, inputs, output)`` decides what to save.
The eager Functions decide inside ``forward`` (from ``ctx.needs_input_grad``), which is cheaper per call
(binding arguments for the split protocol costs ~18 µs a call), so they stay as they are, and under a
transform :meth:`slimgrad.functional._common.Function.apply` calls the twin here instead. Each twin:

* ``forward`` computes the output with the eager Function's ops, plus whatever backward may read that is
  neither an input nor the output (ReLU's bit-packed mask, max pooling's window positions, batch and layer
  norm statistics, a LoRA adapter's ``A(x)``) as extra outputs marked non-differentiable;
* ``setup_context`` saves, from ``ctx.needs_input_grad``, exactly what the eager Function saves for the same
  combination, and sets the same ctx attributes, so that
* ``backward`` is the eager Function's own backward (same formulas, same kernels: the same numbers) wherever
  that backward is plain torch code; ReLU's and the clamp family's eager backwards read their masks through
  numba/Triton kernels, so their twins unpack the masks with torch ops. In-place calls of those run out of
  place and copy into the input outside the twin (vmap's generated rule cannot return a dirtied input).

Everything here is plain torch (no numpy, no ``.item()``, no ``data_ptr``), so ``generate_vmap_rule`` vmaps
forward, ``setup_context`` and backward: under ``vmap(grad(f))`` the whole batch runs through one call.
Under a ``vmap`` the saved tensors are the whole batch's (``save_for_backward`` unwraps the batched
tensors), so per-sample gradients keep what the eager Function keeps for the same batch.

Twins exist for conv, ReLU/LeakyReLU, the clamp family (ReLU6, Hardtanh, Threshold, Hardsigmoid), max and
average pooling, batch norm, RMSNorm, LayerNorm/GroupNorm (bias-only: elsewhere stock keeps the same), the
gated and formula activations and LoRA linear. They cost time: functorch runs a custom Function through
Python machinery that builds classes per call (~0.35 ms under ``grad``, ~0.7 ms under ``vmap(grad)``,
measured), so :func:`set_func_policy` can choose stock's computation instead.

Where no twin fits, the stock computation of :mod:`slimgrad.functional._func_stock` runs (stock's numbers,
stock's memory): dropout (vmap's randomness rules), LoRA with dropout, every Function without a twin, and any
transform stack a twin cannot serve: forward-mode levels (``jvp``, ``jacfwd``, ``hessian``: the twins define
no ``jvp``, which torch.compile's dynamo refuses) and nested ``grad`` levels (the eager backwards are
``once_differentiable``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimgrad.functional import _common

__all__ = ["TWINS", "func_policy", "get_func_policy", "run_under_transform", "set_func_policy"]

from slimgrad.functional._transforms import _POLICY, func_policy, get_func_policy, set_func_policy  # noqa: F401

# The layout the eager backwards give gradients (they follow the input's memory format in eager, as stock does):
# contiguous under torch.func, whatever the input's layout. Stock's gradients come out contiguous there
# (measured: a channels-last conv input's gradient under grad), a per-sample view under vmap has
# no memory format of its own (vmap answers ``is_contiguous`` only for the contiguous format), and vmap's
# batching rules refuse the channels-last ``out=`` buffers the eager backwards would pass. Bitwise stock's for
# channels-last batches under grad and vmap(grad) (tests/test_func_bytes.py).
_LAYOUT = torch.contiguous_format


class _Twin(torch.autograd.Function):
    generate_vmap_rule = True


# ------------------------------------------------------------------------------------------------- conv


class ConvTwin(_Twin):
    """``_ConvFunction``: keeps x only when the weight needs grad, the weight only when x does."""

    @staticmethod
    def forward(x, weight, bias, cfg):
        from slimgrad.functional.conv import conv_forward

        return conv_forward(x, weight, bias, cfg)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, cfg = inputs
        pad_mode, pad = cfg[7], cfg[8]
        need_x, need_w = ctx.needs_input_grad[:2]
        if need_w:
            _common.note_input_kept(x)
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.cfg = cfg
        ctx.x_dtype = x.dtype
        ctx.xp_format = _LAYOUT
        if pad is None:
            ctx.xp_shape = tuple(x.shape)
        else:  # the padded input's shape, from a data-less copy of the pad
            ctx.xp_shape = tuple(F.pad(torch.empty(x.shape, dtype=x.dtype, device="meta"), pad, mode=pad_mode).shape)
        ctx.w_shape = tuple(weight.shape)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad):
        from slimgrad.functional.conv import _ConvFunction

        return _ConvFunction.backward(ctx, grad)


def _conv(x, weight, bias, cfg, xc=None):
    # xc (the Function's copy of X, same values) is not needed: the twin keeps x itself
    return ConvTwin.apply(x, weight, bias, cfg)


# ------------------------------------------------------------------------------------------------- relu

_PACK_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """``_bitmask``'s format (element i in bit i % 8 of byte i // 8, row-major) with ops vmap batches: the
    mask padded to a multiple of 8, each byte the sum of its bits times their weights."""
    flat = mask.reshape(-1).to(torch.uint8)
    extra = (-flat.shape[0]) % 8
    if extra:
        flat = F.pad(flat, (0, extra))
    weights = torch.tensor(_PACK_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, shape) -> torch.Tensor:
    weights = torch.tensor(_PACK_WEIGHTS, dtype=torch.uint8, device=packed.device)
    numel = 1
    for s in shape:
        numel *= s
    return (packed.unsqueeze(-1) & weights).ne(0).reshape(-1)[:numel].view(shape)


class ReLUTwin(_Twin):
    """``_ReLUFunction``, out of place: keeps a bit-packed mask (1 bit per element), or the output where the
    module learned that a consumer keeps it anyway (``keep_output``, the producer/consumer rule of
    ``_common``). In-place calls copy the result into the input outside the Function (vmap's generated rule
    cannot return a dirtied input), so the float result is freed and only the mask stays."""

    @staticmethod
    def forward(input, negative_slope, keep_output):
        if negative_slope is None:
            out = torch.relu(input)
            # stock: result <= 0 ? 0 : grad, so NaN passes
            mask = None if keep_output else out.le(0).logical_not_()
        else:
            out = torch._C._nn.leaky_relu(input, negative_slope)
            mask = None if keep_output else input > 0  # stock: input > 0 ? grad : grad * slope (NaN: slope)
        packed = torch.empty(0, dtype=torch.uint8, device=input.device) if mask is None else _pack(mask)
        return out, packed

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, negative_slope, keep_output = inputs
        out, packed = output
        ctx.mark_non_differentiable(packed)
        ctx.negative_slope, ctx.shape, ctx.keep_output = negative_slope, tuple(input.shape), keep_output
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(out if keep_output else packed)

    @staticmethod
    def backward(ctx, grad, _grad_packed):
        (saved,) = ctx.saved_tensors
        slope = ctx.negative_slope
        if ctx.keep_output:
            if slope is None:
                return torch.ops.aten.threshold_backward(grad, saved, 0), None, None
            return torch.ops.aten.leaky_relu_backward(grad, saved, slope, True), None, None
        mask = _unpack(saved, ctx.shape)
        gi = torch.where(mask, grad, 0) if slope is None else torch.where(mask, grad, grad * slope)
        return gi, None, None


class _LearnHook:
    """Node pre-hook standing for the eager backward's ``learn_from_use``: whether a consumer kept this call's
    output decides, for the next call, between keeping a mask and keeping the output."""

    __slots__ = ("use",)

    def __init__(self, use):
        self.use = use

    def __call__(self, grad_outputs):
        _common.learn_from_use(*self.use)


def _relu(input, negative_slope, inplace, keep_output, use):
    keep_output = keep_output and (negative_slope is None or negative_slope >= 0)
    if inplace and (keep_output or (negative_slope is not None and negative_slope < 0)):
        # Stock's in-place op keeps its result, the input's own memory, which is what keep_output keeps (and
        # a negative slope in place is refused by stock's backward, as by the eager Function).
        from slimgrad.functional._func_stock import STOCK

        return STOCK["_ReLUFunction"](input, negative_slope, inplace, keep_output, use)
    return _finish_activation(input, ReLUTwin.apply(input, negative_slope, keep_output)[0], inplace, use)


def _finish_activation(input, out, inplace, use):
    """After an activation twin: the producer/consumer hook on the output (``use``: (module, UseCell)), and
    the in-place form written back into ``input``."""
    if use is not None and out.grad_fn is not None:
        out.grad_fn.register_prehook(_LearnHook(use))
    if inplace:
        return input.copy_(out)
    return out


class RangeMaskTwin(_Twin):
    """``RangeMaskFunction`` (hardtanh/ReLU6, threshold, hardsigmoid), out of place: keeps the bit-packed pass
    mask, or the output where the module learned that a consumer keeps it (and the output can stand in)."""

    @staticmethod
    def forward(input, kind, lo, hi, value, keep_output):
        from slimgrad.functional.clamp import _bounds, _rule, _stock
        from slimgrad.kernels.range_mask import mask_torch

        out = _stock(input, kind, lo, hi, value, False)
        if keep_output:
            return out, torch.empty(0, dtype=torch.uint8, device=input.device)
        return out, _pack(mask_torch(input, _rule(kind), *_bounds(kind, lo, hi, input.dtype)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, kind, lo, hi, value, keep_output = inputs
        out, packed = output
        ctx.mark_non_differentiable(packed)
        ctx.kind, ctx.lo, ctx.hi, ctx.keep_output, ctx.shape = kind, lo, hi, keep_output, tuple(input.shape)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(out if keep_output else packed)

    @staticmethod
    def backward(ctx, grad, _grad_packed):
        from slimgrad.functional.clamp import HARDSIGMOID, THRESHOLD, _bounds, _rule
        from slimgrad.kernels.range_mask import mask_torch

        (saved,) = ctx.saved_tensors
        if ctx.keep_output and ctx.kind == THRESHOLD:
            return torch.ops.aten.threshold_backward(grad, saved, ctx.lo), None, None, None, None, None
        if ctx.kind == HARDSIGMOID:
            # stock's kernel applies its factor (a zero stand-in lies inside the pass region everywhere)
            zero = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
            grad = torch.ops.aten.hardsigmoid_backward(grad, zero)
        if ctx.keep_output:
            mask = mask_torch(saved, _rule(ctx.kind), *_bounds(ctx.kind, ctx.lo, ctx.hi, saved.dtype))
        else:
            mask = _unpack(saved, ctx.shape)
        return torch.where(mask, grad, 0), None, None, None, None, None


def _range_mask(input, kind, lo, hi, value, inplace, keep_output, use):
    if inplace and keep_output:
        # Stock's in-place op keeps its result, the input's own memory, which is what keep_output keeps.
        from slimgrad.functional._func_stock import STOCK

        return STOCK["RangeMaskFunction"](input, kind, lo, hi, value, inplace, keep_output, use)
    return _finish_activation(input, RangeMaskTwin.apply(input, kind, lo, hi, value, keep_output)[0], inplace, use)


# -------------------------------------------------------------------------------------------- pooling


class MaxPoolTwin(_Twin):
    """``MaxPoolFunction``: keeps the winner's position inside its window (uint8 up to 256 window elements)
    instead of stock's input and int64 indices; backward rebuilds the indices for stock's kernel."""

    @staticmethod
    def forward(x, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
        from slimgrad.functional import pooling as P

        out, indices = P._MAX_FORWARD[nd](x, kernel_size, stride, padding, dilation, ceil_mode)
        fn = f"max_pool{nd}d"
        kernel = P._tuple(kernel_size, nd, "kernel_size", fn)
        stride_t = kernel if P._is_default(stride) else P._tuple(stride, nd, "stride", fn)
        dtype = P.position_dtype(_prod(kernel))
        pos = P._positions_from_indices(indices, tuple(x.shape[-nd:]), kernel, stride_t,
                                        P._tuple(padding, nd, "padding", fn), P._tuple(dilation, nd, "dilation", fn),
                                        dtype, in_place=False, vmappable=True)
        return out, indices, pos

    @staticmethod
    def setup_context(ctx, inputs, output):
        from slimgrad.functional import pooling as P

        x, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices = inputs
        _, indices, pos = output
        ctx.mark_non_differentiable(indices, pos)
        fn = f"max_pool{nd}d"
        kernel = P._tuple(kernel_size, nd, "kernel_size", fn)
        stride_t = kernel if P._is_default(stride) else P._tuple(stride, nd, "stride", fn)
        ctx.geometry = (nd, tuple(x.shape), kernel, stride_t, P._tuple(padding, nd, "padding", fn),
                        P._tuple(dilation, nd, "dilation", fn), bool(ceil_mode))
        ctx.grad_format = _LAYOUT
        ctx.family = ctx.kept_indices = False
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(pos)

    @staticmethod
    def backward(ctx, grad_out, *_grad_indices):
        from slimgrad.functional.pooling import MaxPoolFunction

        return MaxPoolFunction.backward(ctx, grad_out)


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
    out, indices, _ = MaxPoolTwin.apply(x, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    return (out, indices) if return_indices else out


class AvgPoolTwin(_Twin):
    """``AvgPoolFunction``: keeps nothing (backward reads only shapes)."""

    @staticmethod
    def forward(x, nd, adaptive, *options):
        from slimgrad.functional import pooling as P

        if adaptive:
            return P._ADAPTIVE_FORWARD[nd](x, *options)
        if nd == 1:
            return P._AVG_FORWARD[1](x, *options[:5])
        return P._AVG_FORWARD[nd](x, *options)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from slimgrad.functional import pooling as P

        x, nd, adaptive, *options = inputs
        ctx.adaptive, ctx.nd, ctx.shape = adaptive, nd, tuple(x.shape)
        ctx.grad_format = _LAYOUT
        if not adaptive:
            fn = f"avg_pool{nd}d"
            kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override = options
            kernel = P._tuple(kernel_size, nd, "kernel_size", fn)
            stride_t = kernel if P._is_default(stride) else P._tuple(stride, nd, "stride", fn)
            ctx.options = (kernel, stride_t, P._tuple(padding, nd, "padding", fn), bool(ceil_mode),
                           bool(count_include_pad), divisor_override)

    @staticmethod
    def backward(ctx, grad_out):
        from slimgrad.functional.pooling import AvgPoolFunction

        return AvgPoolFunction.backward(ctx, grad_out)


def _avg_pool(x, nd, adaptive, *options):
    return AvgPoolTwin.apply(x, nd, adaptive, *options)


# ----------------------------------------------------------------------------------------- batch norm


class BatchNormTwin(_Twin):
    """``BatchNormFunction`` (reached with a frozen or absent weight): in evaluation keeps nothing but
    parameters and buffers; in training x and the batch statistics only when x needs grad."""

    @staticmethod
    def forward(input, weight, bias, running_mean, running_var, training, momentum, eps):
        return torch.ops.aten.native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
                                                eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from slimgrad.functional.batch_norm import _dense

        input, weight, bias, running_mean, running_var, training, momentum, eps = inputs
        _, save_mean, save_invstd = output
        ctx.mark_non_differentiable(save_mean, save_invstd)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        ctx.mask = (need_x, need_w, need_b)
        ctx.training, ctx.eps = training, eps
        ctx.x_shape, ctx.x_stride, ctx.x_dense = input.shape, input.stride(), _dense(input)
        ctx.x_format = None  # the contiguous _LAYOUT
        ctx.stat_dtype = save_mean.dtype
        if not (need_x or need_w or need_b):
            return
        keep_x = need_w or (training and need_x)
        if keep_x:
            _common.note_input_kept(input)
        ctx.save_for_backward(
            input if keep_x else None,
            weight,
            bias if training and not keep_x else None,
            running_mean if not training else None,
            running_var if not training else None,
            save_mean if training and keep_x else None,
            save_invstd if training and keep_x else None,
        )

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_invstd):
        from slimgrad.functional.batch_norm import BatchNormFunction

        return BatchNormFunction.backward(ctx, grad_out)


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return BatchNormTwin.apply(input, weight, bias, running_mean, running_var, training, momentum, eps)[0]


# ---------------------------------------------------------------------------------------------- norms


class RMSNormTwin(_Twin):
    """``RMSNormFunction`` (torch code, unfused): keeps x (fp32 for fp64 input in the fp32 styles) and the
    per-row rstd, or only the normalised input where only the weight trains and that is no bigger."""

    @staticmethod
    def forward(input, weight, eps, ndim, style):
        from slimgrad.functional.norms import _rms_forward

        dims = tuple(range(input.dim() - ndim, input.dim()))
        out, rstd, normed = _rms_forward(input, weight, eps, dims, style, keep_normed=True)
        # The normalised input is what dW reads when dX is not requested; without a weight there is no dW.
        return (out, rstd, normed) if weight is not None else (out, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, eps, ndim, style = inputs
        out, rstd, *rest = output
        normed = rest[0] if rest else None
        ctx.mark_non_differentiable(rstd, *rest)
        need_x, need_w = ctx.needs_input_grad[:2]
        need_w = need_w and weight is not None
        ctx.impl, ctx.fused = None, False
        ctx.mask = (need_x, need_w)
        ctx.dims = tuple(range(input.dim() - ndim, input.dim()))
        ctx.style, ctx.x_dtype = style, input.dtype
        if not (need_x or need_w):
            return
        from slimgrad.functional.norms import save_rms

        save_rms(ctx, input, weight, rstd, normed, need_x, style, fused=False)

    @staticmethod
    def backward(ctx, grad_out, *_grad_stats):
        from slimgrad.functional.norms import RMSNormFunction

        return RMSNormFunction.backward(ctx, grad_out)


def _rms_norm(input, weight, eps, ndim, style):
    from slimgrad.functional.norms import _FUSED_RMS_DEVICES

    if style == "torch" and input.device.type in _FUSED_RMS_DEVICES and (weight is None or weight.dtype == input.dtype):
        # Stock's fused kernel keeps x and rstd, as the eager Function does there: nothing to save.
        from slimgrad.functional._func_stock import STOCK

        return STOCK["RMSNormFunction"](input, weight, eps, ndim, style)
    return RMSNormTwin.apply(input, weight, eps, ndim, style)[0]


class LayerNormTwin(_Twin):
    """``LayerNormFunction``: keeps x, mean and rstd only when dX or dW is requested (stock's choice
    otherwise; a bias-only backward keeps nothing)."""

    @staticmethod
    def forward(input, normalized_shape, weight, bias, eps):
        return torch.ops.aten.native_layer_norm(input, normalized_shape, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, normalized_shape, weight, bias, eps = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        ctx.mask, ctx.impl = (need_x, need_w, need_b), None
        ctx.normalized_shape = normalized_shape
        ctx.stat_shape, ctx.stat_dtype = mean.shape, mean.dtype
        keep = need_x or need_w
        if keep:
            _common.note_input_kept(input)
        if keep or need_b:
            ctx.save_for_backward(input if keep else None, mean if keep else None, rstd if keep else None,
                                  weight, bias)

    @staticmethod
    def backward(ctx, grad_out, *_grad_stats):
        from slimgrad.functional.norms import LayerNormFunction

        return LayerNormFunction.backward(ctx, grad_out)


def _stock_keeps_the_same(input, weight) -> bool:
    """Layer and group norm keep x, mean and rstd whenever x or the weight needs a gradient, as stock does:
    the twin pays functorch's per-call cost of a custom Function (~0.35 ms under grad, ~0.7 ms under
    vmap(grad), measured) for nothing there. ``requires_grad`` at the call is what ``needs_input_grad`` will
    say at the innermost grad level."""
    return input.requires_grad or (weight is not None and weight.requires_grad)


def _layer_norm(input, normalized_shape, weight, bias, eps):
    if _stock_keeps_the_same(input, weight):
        from slimgrad.functional._func_stock import STOCK

        return STOCK["LayerNormFunction"](input, normalized_shape, weight, bias, eps)
    return LayerNormTwin.apply(input, normalized_shape, weight, bias, eps)[0]


class GroupNormTwin(_Twin):
    """``GroupNormFunction`` on a contiguous input: keeps x, mean and rstd only when dX or dW is requested."""

    @staticmethod
    def forward(input, weight, bias, num_groups, eps):
        n, c = input.shape[0], input.shape[1]
        hxw = input.numel() // (n * c) if n * c else 1
        return torch.ops.aten.native_group_norm(input, weight, bias, n, c, hxw, num_groups, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, num_groups, eps = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        n, c = input.shape[0], input.shape[1]
        ctx.mask = (need_x, need_w, need_b)
        ctx.dims = (n, c, input.numel() // (n * c) if n * c else 1, num_groups)
        ctx.fmt = torch.contiguous_format
        ctx.stat_shape, ctx.stat_dtype = mean.shape, mean.dtype
        keep = need_x or need_w
        if keep:
            _common.note_input_kept(input)
        if keep or need_b:
            ctx.save_for_backward(input if keep else None, mean if keep else None, rstd if keep else None, weight)

    @staticmethod
    def backward(ctx, grad_out, *_grad_stats):
        from slimgrad.functional.norms import GroupNormFunction

        return GroupNormFunction.backward(ctx, grad_out)


def _group_norm(input, weight, bias, num_groups, eps):
    if not input.is_contiguous() or _stock_keeps_the_same(input, weight):
        # (Non-contiguous: the eager Function runs stock's kernels on a channels-last copy there.)
        from slimgrad.functional._func_stock import STOCK

        return STOCK["GroupNormFunction"](input, weight, bias, num_groups, eps)
    return GroupNormTwin.apply(input, weight, bias, num_groups, eps)[0]


# ---------------------------------------------------------------------------------------- activations


class GatedTwin(_Twin):
    """``GatedFunction`` (torch code): keeps gate (and up when gate needs grad), recomputing act(gate)."""

    @staticmethod
    def forward(gate, up, kind):
        from slimgrad.functional.gated import activation_forward

        return activation_forward(kind, gate) * up

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate, up, kind = inputs
        need_gate, need_up = ctx.needs_input_grad[:2]
        ctx.kind, ctx.mask, ctx.impl = kind, (need_gate, need_up), None
        if need_gate or need_up:
            _common.note_input_kept(gate)
        if need_gate:
            _common.note_input_kept(up)
        ctx.save_for_backward(gate if (need_gate or need_up) else None, up if need_gate else None)

    @staticmethod
    def backward(ctx, grad_out):
        from slimgrad.functional.gated import GatedFunction

        return GatedFunction.backward(ctx, grad_out)


def _gated(gate, up, kind):
    return GatedTwin.apply(gate, up, kind)


class FormulaTwin(_Twin):
    """``FormulaActivationFunction``: keeps the input only (stock keeps every intermediate of the formula)."""

    @staticmethod
    def forward(input, kind):
        from slimgrad.functional.gated import activation_forward

        return activation_forward(kind, input)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, kind = inputs
        ctx.kind = kind
        if ctx.needs_input_grad[0]:
            _common.note_input_kept(input)
            ctx.save_for_backward(input)

    @staticmethod
    def backward(ctx, grad_out):
        from slimgrad.functional.hf_activations import FormulaActivationFunction

        return FormulaActivationFunction.backward(ctx, grad_out)


def _formula(input, kind):
    return FormulaTwin.apply(input, kind)


# ----------------------------------------------------------------------------------------------- lora


class LoraTwin(_Twin):
    """``LoraLinearFunction`` without dropout: keeps x once in its own dtype (only when dW or some dA is
    requested) and each adapter's ``A(x)`` only when its B trains."""

    @staticmethod
    def forward(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters):
        from slimgrad.functional.lora import _base_forward

        n = len(scalings)
        result = _base_forward(x, weight, bias, fan_in_fan_out) if weight is not None else None
        base_dtype = result.dtype if result is not None else x.dtype
        xa = x.to(adapters[0].dtype) if n and cast and x.dtype != adapters[0].dtype else x
        kept_t = []
        for i in range(n):
            A, B, b_bias = adapters[3 * i: 3 * i + 3]
            t = F.linear(xa, A)
            u = F.linear(t, B, b_bias) * scalings[i]
            result = u if result is None else result + u
            kept_t.append(t)
        if n:
            result = result.to(base_dtype)
        return (result, *kept_t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from slimgrad.functional.lora import _ADAPTERS_AT

        x, weight, bias, fan_in_fan_out, cast, scalings, ps, _policy, *adapters = inputs
        result, *kept_t = output
        ctx.mark_non_differentiable(*kept_t)
        n = len(scalings)
        need = ctx.needs_input_grad
        need_x, need_w = need[0], need[1]
        need_a = [need[_ADAPTERS_AT + 3 * i] for i in range(n)]
        need_b = [need[_ADAPTERS_AT + 1 + 3 * i] for i in range(n)]
        base_dtype = result.dtype
        # The dtype the eager forward summed in: the base result's, promoted with each adapter's.
        u_dtypes = tuple(t.dtype for t in kept_t)
        sum_dtype = base_dtype if weight is not None or not n else u_dtypes[0]
        for dt in u_dtypes:
            sum_dtype = torch.promote_types(sum_dtype, dt)
        keep_x = need_w or any(need_a)
        if keep_x:
            _common.note_input_kept(x)
        ctx.meta = (fan_in_fan_out, cast, tuple(scalings), tuple(ps), base_dtype, sum_dtype, u_dtypes,
                    tuple(x.shape), x.dtype, n, {})
        ctx.save_for_backward(x if keep_x else None, weight if need_x else None, None,
                              *[t if nb else None for t, nb in zip(kept_t, need_b)], *([None] * n), *adapters)

    @staticmethod
    def backward(ctx, grad, *_grad_kept):
        from slimgrad.functional.lora import LoraLinearFunction

        return LoraLinearFunction.backward(ctx, grad)


def _lora_linear(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters):
    if any(p > 0 for p in ps):
        # Dropout under vmap follows vmap's randomness rules, which stock's dropout implements.
        from slimgrad.functional._func_stock import STOCK

        return STOCK["LoraLinearFunction"](x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters)
    return LoraTwin.apply(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters)[0]


#: Function class name -> its twin, taking exactly the arguments of the Function's ``apply`` and returning
#: what the Function returns.
TWINS = {
    "_ConvFunction": _conv,
    "_ReLUFunction": _relu,
    "RangeMaskFunction": _range_mask,
    "MaxPoolFunction": _max_pool,
    "AvgPoolFunction": _avg_pool,
    "BatchNormFunction": _batch_norm,
    "RMSNormFunction": _rms_norm,
    "LayerNormFunction": _layer_norm,
    "GroupNormFunction": _group_norm,
    "GatedFunction": _gated,
    "FormulaActivationFunction": _formula,
    "LoraLinearFunction": _lora_linear,
}


def _twins_serve_this_stack() -> bool:
    """Whether the active transforms are ones the twins support: any number of vmap levels and at most one
    reverse-mode (grad/vjp/jacrev) level, no forward-mode (jvp) or functionalize level."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    grads = 0
    for interpreter in retrieve_all_functorch_interpreters():
        key = interpreter.key()
        if key == TransformType.Grad:
            grads += 1
        elif key != TransformType.Vmap:
            return False
    return grads <= 1


def run_under_transform(cls, args, kwargs):
    """What ``cls.apply(*args, **kwargs)`` runs under a torch.func transform: the twin where one serves,
    else the stock computation, else a clear refusal."""
    twin = TWINS.get(cls.__name__) if _POLICY[0] == "save" else None
    if twin is not None and _twins_serve_this_stack():
        return twin(*args, **kwargs)
    from slimgrad.functional._func_stock import STOCK

    stock = STOCK.get(cls.__name__)
    if stock is None:
        raise RuntimeError(
            f"slimgrad: {cls.__name__} does not support torch.func transforms (grad, vmap, jacrev, "
            f"functional_call under a transform, ...). Run this part with stock layers "
            f"(slimgrad.revert(model), or outside `with slimgrad.enabled():`)."
        )
    return stock(*args, **kwargs)
