"""What each slimgrad Function computes, written with stock's differentiable ops: run instead of the
Function while a ``torch.func`` transform (grad, vmap, jacrev, jvp, ...) is active.

slimgrad's Functions decide what to keep inside ``forward`` (masks, positions, seeds, the choice between x
and a normalised copy), which functorch's ``setup_context`` protocol can only express with those values as
extra outputs of every Function. Until then, under a transform each Function runs these stock ops: the same
numbers as stock (the same kernels, or the reference formulas the Functions replay bitwise), and stock's
memory, nothing saved. Outside transforms (plain eager, torch.compile) nothing changes.

Each entry takes exactly the arguments of its Function's ``apply``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["STOCK"]


def _conv(x, weight, bias, cfg, xc=None):
    from slimgrad.functional.conv import conv_forward

    return conv_forward(x, weight, bias, cfg)


def _max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
    fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    default = stride is None or (not isinstance(stride, int) and len(stride) == 0)
    return fn(x, kernel_size, None if default else stride, padding, dilation, ceil_mode=ceil_mode,
              return_indices=return_indices)


def _avg_pool(x, nd, adaptive, *options):
    if adaptive:
        return (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[nd - 1](x, *options)
    if nd == 1:
        return F.avg_pool1d(x, *options[:5])
    return (F.avg_pool2d, F.avg_pool3d)[nd - 2](x, *options)


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _relu(input, negative_slope, inplace, keep_output, use):
    if negative_slope is None:
        return F.relu(input, inplace=inplace)
    return F.leaky_relu(input, negative_slope, inplace=inplace)


def _range_mask(input, kind, lo, hi, value, inplace, keep_output, use):
    from slimgrad.functional.clamp import _stock

    return _stock(input, kind, lo, hi, value, inplace)


def _dropout(input, p, inplace, policy):
    return F.dropout(input, p, True, inplace)


def _rms_norm(input, weight, eps, ndim, style):
    if style == "torch":
        return F.rms_norm(input, tuple(input.shape[input.dim() - ndim:]), weight, eps)
    from slimgrad.functional.norms import _rms_forward

    return _rms_forward(input, weight, eps, tuple(range(input.dim() - ndim, input.dim())), style)[0]


def _layer_norm(input, normalized_shape, weight, bias, eps):
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def _group_norm(input, weight, bias, num_groups, eps):
    return F.group_norm(input, num_groups, weight, bias, eps)


def _fused_add_rms_norm(input, residual, weight, eps, style):
    from slimgrad.functional.norms import _rms_forward

    s = input + residual
    return _rms_forward(s, weight, eps, (s.dim() - 1,), style)[0], s


def _poly_norm(input, weight, bias, eps):
    from slimgrad.functional.norms import poly_norm_forward

    return poly_norm_forward(input, weight, bias, eps)[0].to(input.dtype)


def _gated(gate, up, kind):
    from slimgrad.functional.gated import activation_forward

    return activation_forward(kind, gate) * up


def _formula(input, kind):
    from slimgrad.functional.gated import activation_forward

    return activation_forward(kind, input)


def _lora_linear(x, weight, bias, fan_in_fan_out, cast, scalings, ps, policy, *adapters):
    from slimgrad.functional.lora import _base_forward

    result = _base_forward(x, weight, bias, fan_in_fan_out) if weight is not None else None
    base_dtype = result.dtype if result is not None else x.dtype
    xa = x.to(adapters[0].dtype) if scalings and cast and x.dtype != adapters[0].dtype else x
    for i, (scaling, p) in enumerate(zip(scalings, ps)):
        A, B, b_bias = adapters[3 * i: 3 * i + 3]
        dropped = F.dropout(xa, p, True) if p > 0 else xa
        u = F.linear(F.linear(dropped, A), B, b_bias)
        result = u * scaling if result is None else result + u * scaling
    return result.to(base_dtype) if scalings else result


def _lora_conv(x, base_out, cast, meta, policy, *adapters):
    from slimgrad.functional.lora_conv import _conv as conv

    xa = x.to(adapters[0].dtype) if cast and x.dtype != adapters[0].dtype else x
    result = base_out
    for i, (a, b, scaling, p) in enumerate(meta):
        A, B, bias = adapters[3 * i: 3 * i + 3]
        dropped = F.dropout(xa, p, True) if p > 0 else xa
        result = result + conv(conv(dropped, A, None, a), B, bias, b) * scaling
    return result.to(base_out.dtype)


def _layer_norm_2d(x, weight, bias, eps):
    from slimgrad.functional.layer_norm_2d import _formula

    return _formula(x, weight, bias, eps)


def _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size,
                          softcap):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


#: Function class name -> its stock computation.
STOCK = {
    "_ConvFunction": _conv,
    "MaxPoolFunction": _max_pool,
    "AvgPoolFunction": _avg_pool,
    "BatchNormFunction": _batch_norm,
    "_ReLUFunction": _relu,
    "_DropoutFunction": _dropout,
    "RangeMaskFunction": _range_mask,
    "LoraConvFunction": _lora_conv,
    "LayerNorm2dFormulaFunction": _layer_norm_2d,
    "RMSNormFunction": _rms_norm,
    "LayerNormFunction": _layer_norm,
    "GroupNormFunction": _group_norm,
    "FusedAddRMSNormFunction": _fused_add_rms_norm,
    "PolyNormFunction": _poly_norm,
    "GatedFunction": _gated,
    "FormulaActivationFunction": _formula,
    "LoraLinearFunction": _lora_linear,
    "FusedLinearCrossEntropyFunction": _linear_cross_entropy,
}
