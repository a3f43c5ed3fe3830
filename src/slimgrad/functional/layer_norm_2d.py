"""LayerNorm over the channels of an NCHW tensor, as ConvNeXt-style models write it.

``ConvNextLayerNorm(data_format="channels_first")`` and the ``LayerNorm2d`` pattern permute the input to
NHWC, run LayerNorm over the last dimension and permute back. The same ops run here, with slimgrad's
:func:`~slimgrad.functional.norms.layer_norm` in the middle: the same kernels as stock (bitwise equal
outputs and gradients), keeping x (the permuted view shares x's storage: nothing is copied) and the
per-pixel statistics only when x's or the weight's gradient is requested, nothing when only the bias
trains, and never computing a frozen weight's gradient. Where x's or the weight's gradient is requested that is
what stock keeps, so on CPU stock's ops run there directly (no autograd node of slimgrad's around them).

:func:`layer_norm_2d_formula` is the other way models write it: the mean and variance spelled out in
Python (``VitDetLayerNorm``, SAM's and detectron2's ``LayerNorm2d``), where stock autograd keeps 2-3x the
input; it keeps x alone and differentiates a recomputation in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimgrad.functional import _common
from slimgrad.functional.norms import layer_norm

__all__ = ["LayerNorm2dFormulaFunction", "layer_norm_2d", "layer_norm_2d_formula"]


def layer_norm_2d(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(input.permute(0, 2, 3, 1), ...).permute(0, 3, 1, 2)``: LayerNorm over dim 1 of an
    ``(N, C, H, W)`` tensor; ``normalized_shape`` is ``(C,)``."""
    _common.check_tensor(input, "input", fn="layer_norm_2d")
    if input.dim() != 4:
        raise ValueError(f"layer_norm_2d: argument 'input' must be 4-D (N, C, H, W), got shape {tuple(input.shape)}")
    if _stock_keeps_what_we_keep(input, weight):
        _common.note_input_kept(input)
        return F.layer_norm(input.permute(0, 2, 3, 1), normalized_shape, weight, bias, eps).permute(0, 3, 1, 2)
    return layer_norm(input.permute(0, 2, 3, 1), normalized_shape, weight, bias, eps).permute(0, 3, 1, 2)


def _stock_keeps_what_we_keep(input, weight) -> bool:
    """Where x or the weight needs a gradient, slimgrad's LayerNorm keeps x, mean and rstd, as stock's does (and
    stock's backward, too, skips a frozen weight's gradient): then stock's op runs directly, without the extra
    autograd node (5-8 us a call on ConvNeXt's shapes, measured). Only a bias-only call keeps less. Eager CPU only:
    elsewhere the Function may run a faster kernel than stock's (Triton on CUDA) or cast under autocast."""
    return (input.is_cpu and torch.is_grad_enabled()
            and (input.requires_grad or (weight is not None and weight.requires_grad))
            and not torch._C._is_any_autocast_enabled() and not torch.compiler.is_compiling())


def _formula(x, weight, bias, eps):
    """The LayerNorm2d formula as ConvNeXt's, SAM's and VitDet's code write it, op for op."""
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / torch.sqrt(s + eps)
    return weight[:, None, None] * x + bias[:, None, None]


class LayerNorm2dFormulaFunction(_common.Function):
    """:func:`_formula` keeping x only (stock autograd keeps ``x - u`` twice, ``sqrt(s + eps)`` and, when
    the weight trains, the normalised x: 2-3x the input). Backward re-runs the formula from x under
    autograd and differentiates it: the same ops and the same graph as stock's, so bitwise stock's
    gradients; the recomputed intermediates live only during this backward. Only the bias training:
    nothing kept at all. Double backward is refused. In functorch's split form; under torch.func its ``stock``
    (the formula's own ops) runs instead."""

    @staticmethod
    def forward(x, weight, bias, eps):
        return _formula(x, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps = inputs
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.eps, ctx.mask = eps, (need_x, need_w, need_b)
        ctx.autocast = (x.device.type, _common.autocast_dtype(x.device.type))
        keep = need_x or need_w
        if keep:
            _common.note_input_kept(x)
        ctx.save_for_backward(x if keep else None, weight, bias)

    @staticmethod
    def stock(x, weight, bias, eps):
        return _formula(x, weight, bias, eps)

    @classmethod
    def under_transform(cls, *args):
        # Stock's ops under torch.func as well: backward differentiates a recomputation with torch.autograd.grad,
        # which functorch's levels do not run inside a custom Function's backward.
        return cls.stock(*args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.mask
        device_type, autocast_dtype = ctx.autocast
        amp = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
               else _common.autocast_off(device_type))
        with torch.enable_grad(), amp:
            w = weight.detach().requires_grad_(need_w)
            b = bias.detach().requires_grad_(need_b)
            if x is None:  # only the bias: the add's gradient, reduced to the bias' shape as stock reduces it
                y = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape) + b[:, None, None]
                (db,) = torch.autograd.grad(y, (b,), grad)
                return None, None, db, None
            xr = x.detach().requires_grad_(need_x)
            y = _formula(xr, w, b, ctx.eps)
            wanted = [t for t, n in ((xr, need_x), (w, need_w), (b, need_b)) if n]
            got = iter(torch.autograd.grad(y, wanted, grad))
        return tuple(next(got) if n else None for n in (need_x, need_w, need_b)) + (None,)


def layer_norm_2d_formula(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    """``weight[:, None, None] * (x - u) / sqrt(var + eps) + bias[:, None, None]`` over dim 1 of an NCHW
    tensor, written out in Python as ``VitDetLayerNorm`` and SAM's ``LayerNorm2d`` write it: their output
    and gradients bit for bit, keeping only x (see :class:`LayerNorm2dFormulaFunction`)."""
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        _common.check_tensor(t, name, fn="layer_norm_2d_formula")
    if input.dim() != 4 or weight.shape != (input.shape[1],) or bias.shape != (input.shape[1],):
        raise ValueError(f"layer_norm_2d_formula: expected 'input' (N, C, H, W) and 'weight', 'bias' of shape (C,), "
                         f"got {tuple(input.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    if torch.compiler.is_compiling():
        # The compiler decides what to keep by itself (and cannot trace autograd.grad inside a backward):
        # give it the formula's own ops.
        return _formula(input, weight, bias, eps)
    return LayerNorm2dFormulaFunction.apply(input, weight, bias, float(eps))
