"""The analytical minimum a layer must keep for the gradients requested of it.

These are the rules slimgrad's layers are built to meet, written independently of them from the maths
of each backward, so the audit can show how far stock PyTorch (and slimgrad) is from the floor. Inputs:
the module (its type, mode and parameters' ``requires_grad``), its input tensors and its output.

A rule returns what must be kept: the input/output tensors themselves (so that a tensor several layers
need, like the x that q, k and v projections share, is counted once in a model total) and a number of
extra bytes for what is derived (masks, statistics, positions, seeds); or None when the layer kind has no
rule (then the audit shows no minimum).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["minimum_bytes", "minimum_parts"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _needs(p) -> bool:
    return isinstance(p, torch.Tensor) and p.requires_grad


def _conv(m, x, y, x_grad):
    # dW needs X; dX needs W (a parameter: free); dB needs nothing.
    return ([x], 0) if _needs(m.weight) else ([], 0)


def _batch_norm(m, x, y, x_grad):
    channels = x.shape[1] if x.dim() > 1 else x.shape[0]
    stats = 2 * channels * 4  # fp32 mean and invstd per channel
    batch_stats = m.training or not m.track_running_stats
    w_grad = _needs(m.weight)
    if batch_stats:
        return ([x], stats) if (x_grad or w_grad) else ([], 0)
    return ([x], 0) if w_grad else ([], 0)  # eval: dX = dy·w·invstd_running


def _relu_like(m, x, y, x_grad):
    return [], (math.ceil(x.numel() / 8) if x_grad else 0)  # one bit per element


def _dropout(m, x, y, x_grad):
    return [], (8 if (x_grad and m.training and m.p > 0) else 0)  # a seed


def _max_pool(m, x, y, x_grad):
    if not x_grad:
        return [], 0
    out = y[0] if isinstance(y, tuple) else y
    window = math.prod(_tuple(m.kernel_size, x.dim() - 2 if x.dim() > 2 else 1))
    itemsize = 1 if window <= 256 else 2 if window <= 2**15 else 4
    return [], out.numel() * itemsize


def _tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _nothing(m, x, y, x_grad):
    return [], 0


def _linear(m, x, y, x_grad):
    return ([x], 0) if _needs(m.weight) else ([], 0)


_RULES = {
    **{t: _conv for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                          nn.ConvTranspose3d)},
    **{t: _batch_norm for t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)},
    nn.ReLU: _relu_like,
    nn.LeakyReLU: _relu_like,
    **{t: _dropout for t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)},
    **{t: _max_pool for t in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)},
    **{t: _nothing for t in (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
                             nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.Identity, nn.Flatten)},
    nn.Linear: _linear,
}


def minimum_parts(module: nn.Module, inputs: tuple, output) -> tuple[list[torch.Tensor], int] | None:
    """(tensors to keep, extra bytes) that the gradients requested of ``module`` need, or None for an
    unknown layer kind. Matching walks the class hierarchy so that slimgrad's replacements (subclasses)
    use the stock rule."""
    rule = next((_RULES[t] for t in type(module).__mro__ if t in _RULES), None)
    x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
    if rule is None or x is None:
        return None
    return rule(module, x, output, x.requires_grad)


def minimum_bytes(module: nn.Module, inputs: tuple, output) -> int | None:
    """Bytes the gradients requested of ``module`` need kept, in isolation, or None for an unknown kind."""
    parts = minimum_parts(module, inputs, output)
    if parts is None:
        return None
    tensors, extra = parts
    return sum(_nbytes(t) for t in tensors) + extra
