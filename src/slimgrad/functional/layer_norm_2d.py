"""LayerNorm over the channels of an NCHW tensor, as ConvNeXt-style models write it.

``ConvNextLayerNorm(data_format="channels_first")`` and the ``LayerNorm2d`` pattern permute the input to
NHWC, run LayerNorm over the last dimension and permute back. The same ops run here, with slimgrad's
:func:`~slimgrad.functional.norms.layer_norm` in the middle: the same kernels as stock (bitwise equal
outputs and gradients), keeping x (the permuted view shares x's storage: nothing is copied) and the
per-pixel statistics only when x's or the weight's gradient is requested, nothing when only the bias
trains, and never computing a frozen weight's gradient.
"""

from __future__ import annotations

import torch

from slimgrad.functional import _common
from slimgrad.functional.norms import layer_norm

__all__ = ["layer_norm_2d"]


def layer_norm_2d(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(input.permute(0, 2, 3, 1), ...).permute(0, 3, 1, 2)``: LayerNorm over dim 1 of an
    ``(N, C, H, W)`` tensor; ``normalized_shape`` is ``(C,)``."""
    _common.check_tensor(input, "input", fn="layer_norm_2d")
    if input.dim() != 4:
        raise ValueError(f"layer_norm_2d: argument 'input' must be 4-D (N, C, H, W), got shape {tuple(input.shape)}")
    return layer_norm(input.permute(0, 2, 3, 1), normalized_shape, weight, bias, eps).permute(0, 3, 1, 2)
