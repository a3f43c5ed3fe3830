"""Drop-in pooling modules: stock classes whose forward keeps only what backward needs.

Max pooling keeps the argmax's position inside its window (one byte per output for windows up to 256
elements) instead of the input plus int64 indices; average pooling keeps nothing. Each class only swaps
``forward`` for the slimgrad functional twin, so converting a module is a class swap.
"""

from __future__ import annotations

from torch import Tensor, nn

from slimgrad._registry import register
from slimgrad.functional import pooling as P

__all__ = [
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
]


def _max_forward(fn):
    def forward(self, input: Tensor):
        return fn(input, self.kernel_size, self.stride, self.padding, self.dilation,
                  ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    forward.__doc__ = f"Like the stock forward, through slimgrad's ``{fn.__name__}``."
    return forward


@register(nn.MaxPool1d)
class MaxPool1d(nn.MaxPool1d):
    forward = _max_forward(P.max_pool1d)


@register(nn.MaxPool2d)
class MaxPool2d(nn.MaxPool2d):
    forward = _max_forward(P.max_pool2d)


@register(nn.MaxPool3d)
class MaxPool3d(nn.MaxPool3d):
    forward = _max_forward(P.max_pool3d)


@register(nn.AvgPool1d)
class AvgPool1d(nn.AvgPool1d):
    def forward(self, input: Tensor) -> Tensor:
        return P.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad)


@register(nn.AvgPool2d)
class AvgPool2d(nn.AvgPool2d):
    def forward(self, input: Tensor) -> Tensor:
        return P.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


@register(nn.AvgPool3d)
class AvgPool3d(nn.AvgPool3d):
    def forward(self, input: Tensor) -> Tensor:
        return P.avg_pool3d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


@register(nn.AdaptiveAvgPool1d)
class AdaptiveAvgPool1d(nn.AdaptiveAvgPool1d):
    def forward(self, input: Tensor) -> Tensor:
        return P.adaptive_avg_pool1d(input, self.output_size)


@register(nn.AdaptiveAvgPool2d)
class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    def forward(self, input: Tensor) -> Tensor:
        return P.adaptive_avg_pool2d(input, self.output_size)


@register(nn.AdaptiveAvgPool3d)
class AdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    def forward(self, input: Tensor) -> Tensor:
        return P.adaptive_avg_pool3d(input, self.output_size)
