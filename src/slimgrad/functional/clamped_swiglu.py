"""GPT-OSS's clamped SwiGLU on interleaved [gate, up] columns, keeping only its input.

``gate, up = x[..., ::2], x[..., 1::2]``; ``gate = gate.clamp(max=limit)``; ``up = up.clamp(-limit, limit)``;
``out = (up + 1) * (gate * sigmoid(gate * alpha))``: transformers' ``GptOssExperts._apply_gate``, applied to every
routed token's first projection. Stock autograd keeps x plus the clamped gate, the sigmoid, ``up + 1`` and the GLU
(three times the input's bytes besides the input); all of them are element-wise functions of x. This Function runs
the same ops forward (bitwise the same output), keeps x, and in backward recomputes them and applies autograd's
per-op derivatives in autograd's order (``clamp_backward``'s ``where``, ``sigmoid_backward``, the products), then
puts the gate's and up's gradients into their columns as the two slices' backward do (zeros plus the values, so a
-0.0 comes out +0.0 as there): outputs and gradients bitwise stock's.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from slimgrad.functional import _common

__all__ = ["ClampedSwiGLUFunction", "clamped_swiglu"]

_aten = torch.ops.aten


def _forward(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GptOssExperts._apply_gate's ops, in its order."""
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


class ClampedSwiGLUFunction(_common.Function):
    """:func:`clamped_swiglu`, keeping its input only (when it needs a gradient). Double backward is refused
    (``once_differentiable``)."""

    @staticmethod
    def forward(x, limit, alpha):
        return _forward(x, limit, alpha)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, limit, alpha = inputs
        ctx.limit, ctx.alpha = limit, alpha
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        g, u = x[..., ::2], x[..., 1::2]
        gc = g.clamp(min=None, max=limit)
        uc = u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(gc * alpha)
        # out = a * glu, a = uc + 1, glu = gc * s: autograd runs the node made last first
        d_a = grad * (gc * s)
        d_glu = grad * (uc + 1)
        del uc
        d_gc = d_glu * s  # glu = gc * s: gc's first gradient; s's below
        d_t = _aten.sigmoid_backward(d_glu * gc, s)
        del s, d_glu
        d_gc = d_gc + d_t * alpha  # t = gc * alpha: gc's second gradient, added as autograd's buffer adds it
        del d_t
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
        d_g = torch.where(g <= limit, d_gc, zero)  # clamp_backward (max only)
        del d_gc
        d_u = torch.where((u >= -limit).logical_and_(u <= limit), d_a, zero)  # clamp_backward (min and max)
        del d_a
        dx = torch.empty(x.shape, dtype=grad.dtype, device=grad.device)
        # the two slices' backward: zeros with the values in their columns, summed (0 + v: -0.0 becomes +0.0)
        torch.add(d_g, 0.0, out=dx[..., ::2])
        torch.add(d_u, 0.0, out=dx[..., 1::2])
        return dx, None, None

    @staticmethod
    def stock(x, limit, alpha):
        return _forward(x, limit, alpha)


def clamped_swiglu(input: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate on interleaved [gate, up] columns (see the module docstring): stock's output and gradient,
    keeping only ``input``."""
    if has_torch_function_unary(input):
        return handle_torch_function(clamped_swiglu, (input,), input, limit, alpha)
    _common.check_tensor(input, "input", fn="clamped_swiglu")
    if not input.is_floating_point() or input.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu: 'input' must be a floating-point tensor with an even last dimension "
                         f"(interleaved gate and up columns), got {input.dtype} of shape {tuple(input.shape)}")
    if not (torch.is_grad_enabled() and input.requires_grad):
        return _forward(input, limit, alpha)
    return ClampedSwiGLUFunction.apply(input, float(limit), float(alpha))
