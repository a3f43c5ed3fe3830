"""Drop-in ReLU and LeakyReLU keeping a 1-bit mask, or nothing extra when a consumer keeps the output."""

from __future__ import annotations

from torch import nn

from slimgrad._registry import register
from slimgrad.functional.activation import _module_forward

__all__ = ["ReLU", "LeakyReLU"]


@register(nn.ReLU)
class ReLU(nn.ReLU):
    def forward(self, input):
        return _module_forward(self, input, None)


@register(nn.LeakyReLU)
class LeakyReLU(nn.LeakyReLU):
    def forward(self, input):
        return _module_forward(self, input, float(self.negative_slope))
