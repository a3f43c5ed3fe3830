"""Drop-in pooling modules: stock classes whose forward keeps only what backward needs.

Max pooling keeps the argmax's position inside its window (one byte per output for windows up to 256
elements) instead of the input plus int64 indices; average pooling keeps nothing. Each class only swaps
``forward`` for its slimgrad functional counterpart, so converting a module is a class swap.

A pooling module's eager CPU call that wants a gradient goes straight to the compiled core (one C++ autograd
Function call, :mod:`slimgrad.functional.pooling`): its options are checked once and the result cached in the
module's ``__dict__`` (re-checked only when an option attribute changes); every other call takes the functional
path.
"""

from __future__ import annotations

import torch
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


class _CoreOptions:
    """A module's checked core options and the option values they were checked for. Copies and pickles start
    empty (the options object belongs to this process's core), and the next call checks again."""

    __slots__ = ("key", "options")

    def __init__(self, key=None, options=None):
        self.key, self.options = key, options

    def __reduce__(self):
        return (_CoreOptions, ())


def _max_forward(fn, nd):
    def forward(self, input: Tensor):
        if type(input) is Tensor and input.requires_grad and not torch.compiler.is_compiling():
            key = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, self.return_indices)
            state = self.__dict__
            cached = state.get("_slimgrad_core_pool")
            if cached is None or cached.key != key:
                options = P.core_options(nd, *key)
                if options is None:  # the core is off or cannot take these options: nothing cached
                    return fn(input, *key[:4], ceil_mode=key[4], return_indices=key[5])
                cached = state["_slimgrad_core_pool"] = _CoreOptions(_unshared(key), options)
            if (out := P.core_max_pool(nd, input, cached.options)) is not None:
                return out
        return fn(input, self.kernel_size, self.stride, self.padding, self.dilation,
                  ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    forward.__doc__ = f"Like the stock forward, through slimgrad's ``{fn.__name__}``."
    return forward


@register(nn.MaxPool1d)
class MaxPool1d(nn.MaxPool1d):
    forward = _max_forward(P.max_pool1d, 1)


@register(nn.MaxPool2d)
class MaxPool2d(nn.MaxPool2d):
    forward = _max_forward(P.max_pool2d, 2)


@register(nn.MaxPool3d)
class MaxPool3d(nn.MaxPool3d):
    forward = _max_forward(P.max_pool3d, 3)


def _core_avg(module, input, nd, adaptive, key):
    """The compiled core's output for this eager call, or None (then the functional path runs)."""
    state = module.__dict__
    cached = state.get("_slimgrad_core_pool")
    if cached is None or cached.key != key:
        options = P.core_avg_options(nd, adaptive, key)
        if options is None:
            return None
        cached = state["_slimgrad_core_pool"] = _CoreOptions(_unshared(key), options)
    return P.core_avg_pool(nd, input, cached.options)


def _unshared(key: tuple) -> tuple:
    """The options as the cache keeps them: a list option (``MaxPool2d([2, 2])``) copied, so that changing the
    module's list in place changes the key (the cache held the module's own list, equal to itself after any change:
    the old size kept being used; the state-change sweep)."""
    return tuple(list(v) if isinstance(v, list) else v for v in key)


def _eager_grad(input) -> bool:
    return type(input) is Tensor and input.requires_grad and not torch.compiler.is_compiling()


@register(nn.AvgPool1d)
class AvgPool1d(nn.AvgPool1d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 1, False, (
                self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                None))) is not None:
            return out
        return P.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad)


@register(nn.AvgPool2d)
class AvgPool2d(nn.AvgPool2d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 2, False, (
                self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                self.divisor_override))) is not None:
            return out
        return P.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


@register(nn.AvgPool3d)
class AvgPool3d(nn.AvgPool3d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 3, False, (
                self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                self.divisor_override))) is not None:
            return out
        return P.avg_pool3d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


@register(nn.AdaptiveAvgPool1d)
class AdaptiveAvgPool1d(nn.AdaptiveAvgPool1d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 1, True, (self.output_size,))) is not None:
            return out
        return P.adaptive_avg_pool1d(input, self.output_size)


@register(nn.AdaptiveAvgPool2d)
class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 2, True, (self.output_size,))) is not None:
            return out
        return P.adaptive_avg_pool2d(input, self.output_size)


@register(nn.AdaptiveAvgPool3d)
class AdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    def forward(self, input: Tensor) -> Tensor:
        if _eager_grad(input) and (out := _core_avg(self, input, 3, True, (self.output_size,))) is not None:
            return out
        return P.adaptive_avg_pool3d(input, self.output_size)
