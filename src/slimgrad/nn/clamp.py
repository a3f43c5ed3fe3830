"""Drop-in ReLU6, Hardtanh, Threshold and Hardsigmoid keeping a 1-bit mask (or nothing extra when a
consumer keeps the output; see :mod:`slimgrad.functional.clamp`). Hardswish is not here: its gradient
reads the input itself."""

from __future__ import annotations

from torch import nn

from slimgrad._registry import register
from slimgrad.functional.clamp import HARDSIGMOID, HARDTANH, THRESHOLD, module_forward

__all__ = ["Hardsigmoid", "Hardtanh", "ReLU6", "Threshold"]


@register(nn.Hardtanh)
class Hardtanh(nn.Hardtanh):
    def forward(self, input):
        return module_forward(self, input, HARDTANH, float(self.min_val), float(self.max_val))


@register(nn.ReLU6)
class ReLU6(nn.ReLU6):
    def forward(self, input):
        return module_forward(self, input, HARDTANH, float(self.min_val), float(self.max_val))


@register(nn.Threshold)
class Threshold(nn.Threshold):
    def forward(self, input):
        return module_forward(self, input, THRESHOLD, float(self.threshold), value=float(self.value))


@register(nn.Hardsigmoid)
class Hardsigmoid(nn.Hardsigmoid):
    def forward(self, input):
        return module_forward(self, input, HARDSIGMOID, -3.0, 3.0)
