"""Drop-in RMSNorm, LayerNorm and GroupNorm (class swap, forward only), plus FusedAddRMSNorm and PolyNorm,
which have no stock counterpart.

The stock modules' forwards are one functional call each; ours call slimgrad's twin with the same
arguments, so every constructor option (``elementwise_affine=False``, ``bias=False``, ``eps=None``,
multi-dim ``normalized_shape``, ``affine=False``) is honoured by construction.

Eager CPU calls go straight to the compiled core (:mod:`slimgrad.csrc`, one C++ autograd Function running the
Python Function's aten sequence, so the same bits and bytes) with the module's own attributes, read from the
instance dict (a parameter replaced by a plain attribute is looked up as the module itself, which the core
refuses); the core returns None for anything it does not take (autocast, wrong shapes, other devices), and
the functional form then runs as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimgrad._registry import register
from slimgrad.functional.norms import (
    RMS_STYLES,
    _core,
    _note,
    fused_add_rms_norm,
    group_norm,
    layer_norm,
    poly_norm,
    rms_norm,
)

__all__ = ["FusedAddRMSNorm", "GroupNorm", "LayerNorm", "PolyNorm", "RMSNorm"]


@register(nn.RMSNorm)
class RMSNorm(nn.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        core = _core(x)
        if core is not None:
            out = core.norms_rms(x, self._parameters.get("weight", self), self.eps, self.normalized_shape, 0, _note())
            if out is not None:
                return out
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


@register(nn.LayerNorm)
class LayerNorm(nn.LayerNorm):
    def forward(self, input: Tensor) -> Tensor:
        core = _core(input)
        if core is not None:
            params = self._parameters
            w, b = params.get("weight", self), params.get("bias", self)
            out = core.norms_layer(input, self.normalized_shape, w, b, self.eps, _note())
            if out is not None:
                return out
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


@register(nn.GroupNorm)
class GroupNorm(nn.GroupNorm):
    def forward(self, input: Tensor) -> Tensor:
        core = _core(input)
        if core is not None:
            params = self._parameters
            w, b = params.get("weight", self), params.get("bias", self)
            out = core.norms_group(input, self.num_groups, w, b, self.eps, _note())
            if out is not None:
                return out
        if self.affine and isinstance(input, Tensor) and input.dim() >= 2 and input.shape[1] != self.num_channels:
            # Stock raises a RuntimeError here too, but blames the weight; the input is what is wrong.
            raise RuntimeError(f"slimgrad: {type(self).__name__}: argument 'input' must have num_channels="
                               f"{self.num_channels} channels (dim 1), got shape {tuple(input.shape)}")
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class FusedAddRMSNorm(nn.Module):
    """Residual add fused with RMSNorm: ``forward(x, residual) -> (rms_norm(x + residual), x + residual)``.

    The pre-norm transformer pattern ``h = h + sublayer(h); y = norm(h)`` written as one layer, keeping only
    the sum and one fp32 statistic per row. ``style`` picks the casting (``"llama"``, ``"gemma"``
    for ``x̂·(1+w)``, ...; see :data:`slimgrad.functional.norms.RMS_STYLES`); the weight starts at the
    style's identity (ones, or zeros for ``"gemma"``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, style: str = "llama", device=None, dtype=None):
        super().__init__()
        if style not in RMS_STYLES or style == "torch":
            raise ValueError(f"FusedAddRMSNorm: argument 'style' must be one of {RMS_STYLES[1:]}, got {style!r}")
        init = torch.zeros if style == "gemma" else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.style = style

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.style)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, style={self.style!r}"


class PolyNorm(nn.Module):
    """PolyNorm (``w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b``), keeping x and three fp32 stats per row.

    Weights start at 1/3 and the bias at 0, as in the models that use it.
    """

    def __init__(self, eps: float = 1e-6, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return poly_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, bias={self.bias is not None}"
