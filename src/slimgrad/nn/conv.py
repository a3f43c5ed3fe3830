"""Drop-in convolution modules: the stock classes with a forward that keeps only what the requested
gradients need (see :mod:`slimgrad.functional.conv`). Constructor, parameters and state are stock's.

Eager CPU and CUDA calls go to the compiled core in one call: the core's options object (``conv_Cfg``) is made once per
module and kept in the module's ``__dict__`` (with the option objects it was made from, so that a changed
``stride``/``padding``/... is noticed), and a call checks the input's kind, autocast and grad mode before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad import csrc
from slimgrad._registry import register
from slimgrad.functional import _common
from slimgrad.functional.conv import (
    _PLAIN,
    asymmetric_same,
    conv_nd,
    core_cfg,
    core_conv,
    options,
    stock_keeps_weight_for_free,
)

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


def _stock_keeps_what_we_keep(self, input, weight) -> bool:
    """Whether this call would keep exactly what stock keeps: the weight trains (both keep X; stock also
    keeps the weight, free unless autocast made a copy of it that we would not keep) and no explicit
    padding is applied (stock would keep the padded X as
    well). Then stock's own forward runs, with no autograd Function around it."""
    return (weight.requires_grad and self.padding_mode == "zeros" and torch.is_grad_enabled()
            and isinstance(input, torch.Tensor) and stock_keeps_weight_for_free(input, weight)
            and (self.padding != "same" or not asymmetric_same(self.padding, weight, self.dilation)))


# Each forward reads ``self.weight`` and ``self.bias`` once, as stock's does: under a parametrization
# (spectral_norm, weight_norm) every read runs it, and spectral_norm's power iteration advances per run.

def _dropped():
    return None


class _CoreCache:
    """The module's cached core options: (option objects it was made from, the core, its ``conv_Cfg``). Copies
    and pickles of the module drop it (the core's objects neither copy nor pickle); the next call remakes it."""

    __slots__ = ("key", "cfg")

    def __init__(self, key, cfg):
        self.key, self.cfg = key, cfg

    def __reduce__(self):
        return (_dropped, ())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return None


def _core_cfg(self, core, weight, nd: int, transposed: bool):
    """The module's cached ``conv_Cfg`` (None: the core does not serve its options), remade when an option
    attribute was replaced since."""
    d = self.__dict__
    c = d.get("_slimgrad_conv_core")
    if c is not None:
        k = c.key
        if (k[0] is self.stride and k[1] is self.padding and k[2] is self.dilation and k[3] is self.groups
                and k[4] is self.padding_mode and k[5] is self.output_padding and k[6] is core
                and k[7] is self._reversed_padding_repeated_twice
                and (k[8] is None or k[8] == weight.shape[2:])):
            return c.cfg
    # As stock's forward: with a padding mode, F.pad with the module's reversed padding, then padding 0.
    padding = self.padding if self.padding_mode == "zeros" else self._reversed_padding_repeated_twice
    cfg = core_cfg(core, nd, transposed, self.stride, padding, self.dilation, self.groups, self.output_padding,
                   self.padding_mode, weight, type(self).__name__)
    # padding='same' is worked out from the kernel's size: a weight of another size (surgery, load_state_dict with
    # assign=True) must remake it (the old padding ran: 8x8 -> 6x6; the state-change sweep)
    kernel = tuple(weight.shape[2:]) if isinstance(self.padding, str) else None
    # A list option (`conv.padding = [1, 1]`, which stock's forward passes on) is keyed by a copy, so the identity
    # check above never matches it and the options are read again each call: changed in place, the module's own list
    # matched itself and the old options ran (9x9 where stock gave 7x9; the cached-decisions sweep)
    # (stock's own _reversed_padding_repeated_twice is a list for padding='same': kept as it is, read by identity)
    options = tuple(list(v) if isinstance(v, list) else v for v in (self.stride, self.padding, self.dilation))
    key = (*options, self.groups, self.padding_mode,
           list(self.output_padding) if isinstance(self.output_padding, list) else self.output_padding, core,
           self._reversed_padding_repeated_twice, kernel)
    d["_slimgrad_conv_core"] = _CoreCache(key, cfg)
    return cfg


def _autocast_on(input) -> bool:
    """``torch.is_autocast_enabled(input.device.type)``, asked only where some autocast is on: reading
    ``input.device`` costs about 1 us a call (a third of the core route's Python overhead, measured)."""
    return torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(input.device.type)


def _core_call(self, input, weight, bias, nd: int, transposed: bool):
    """The core's convolution where it serves this call (else None).

    Under autocast with zeros padding, the tensors are cast as autocast casts a convolution's inputs (its cached cast
    of a trainable weight, ``_common.autocast_lower_precision``, as the Python path does) and the core runs on them:
    the cast copies are what the Python Function receives there too, and autocast leaves a convolution of bf16/fp16
    tensors as it is. The Python Function there cost 1.4-2.1x stock's step on input-only loops under CPU bf16
    autocast (the input-only sweep of 2026-11-28). A padding mode stays with the Python Function (stock pads in
    autocast's fp32 first)."""
    core = csrc.for_eager(input, cuda=True)
    if (core is None or input.dim() != nd + 2 or type(weight) not in _PLAIN
            or (bias is not None and type(bias) not in _PLAIN)):
        return None
    if _autocast_on(input):
        if self.padding_mode != "zeros" or not input.is_floating_point():
            return None
        input, weight, bias = _common.autocast_lower_precision(input, weight, bias)
        if type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
            return None
    cfg = _core_cfg(self, core, weight, nd, transposed)
    if cfg is None:
        return None
    # (core_conv's stock route reads the module's own options, as stock's forward; never taken with a pad)
    return core_conv(core, input, weight, bias, cfg, nd, transposed, self.stride, self.padding,
                     self.output_padding, self.groups, self.dilation)


def _options(self, weight, nd: int, name: str):
    """``conv_nd``'s normalised options for this module (``functional.conv.options``, ~3 us a call), kept in its
    ``__dict__`` with the option objects they were made from: remade where an attribute was replaced since (they are
    immutable tuples and strings; a list, which could change in place, is never cached). None while traced (dynamo
    would guard on the cache) or where the options are invalid: ``conv_nd`` then works them out, raising its errors
    in its order."""
    if torch.compiler.is_compiling():
        return None
    stride, padding, dilation, mode = self.stride, self.padding, self.dilation, self.padding_mode
    # As stock's forward: with a padding mode, F.pad with the module's reversed padding, then padding 0.
    pad_arg = padding if mode == "zeros" else self._reversed_padding_repeated_twice
    try:
        kernel = tuple(weight.shape[2:]) if type(padding) is str else None
        d = self.__dict__
        c = d.get("_slimgrad_conv_options")
        if (c is not None and c[0] is stride and c[1] is pad_arg and c[2] is dilation and c[3] is mode
                and c[4] == kernel):
            return c[5]
        normalised = options(nd, False, stride, pad_arg, dilation, 0, mode, tuple(weight.shape[2:]), name)
    except Exception:  # noqa: BLE001 - conv_nd raises it, after the checks it makes first
        return None
    if all(type(v) in (tuple, str) for v in (stride, pad_arg, dilation, mode)):
        d["_slimgrad_conv_options"] = (stride, pad_arg, dilation, mode, kernel, normalised)
    return normalised


def _conv_forward(self, input, nd: int):
    name = type(self).__name__
    weight, bias = self.weight, self.bias
    out = _core_call(self, input, weight, bias, nd, False)
    if out is not None:
        return out
    if _stock_keeps_what_we_keep(self, input, weight):
        if input.requires_grad:  # only an output that requires grad can have a producer to tell
            _common.note_input_kept(input)
        return self._conv_forward(input, weight, bias)
    normalised = _options(self, weight, nd, name)
    if self.padding_mode != "zeros":
        # As stock _conv_forward: F.pad with the module's reversed padding, then a conv with padding 0.
        return conv_nd(
            input,
            weight,
            bias,
            self.stride,
            self._reversed_padding_repeated_twice,
            self.dilation,
            self.groups,
            nd=nd,
            padding_mode=self.padding_mode,
            fn=name,
            normalised=normalised,
        )
    return conv_nd(input, weight, bias, self.stride, self.padding, self.dilation, self.groups, nd=nd, fn=name,
                   normalised=normalised)


def _conv_transpose_forward(self, input, output_size, nd: int):
    if self.padding_mode != "zeros":
        raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
    weight, bias = self.weight, self.bias
    if output_size is None:
        out = _core_call(self, input, weight, bias, nd, True)
        if out is not None:
            return out
    output_padding = self._output_padding(
        input, output_size, self.stride, self.padding, self.kernel_size, nd, self.dilation
    )
    if _stock_keeps_what_we_keep(self, input, weight):
        if input.requires_grad:
            _common.note_input_kept(input)
        # what stock's forward calls, with the weight read once
        return _STOCK_TRANSPOSE[nd](input, weight, bias, self.stride, self.padding, output_padding, self.groups,
                                    self.dilation)
    return conv_nd(
        input,
        weight,
        bias,
        self.stride,
        self.padding,
        self.dilation,
        self.groups,
        nd=nd,
        transposed=True,
        output_padding=output_padding,
        fn=type(self).__name__,
    )


_STOCK_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@register(nn.Conv1d)
class Conv1d(nn.Conv1d):
    def forward(self, input):
        return _conv_forward(self, input, 1)


@register(nn.Conv2d)
class Conv2d(nn.Conv2d):
    def forward(self, input):
        return _conv_forward(self, input, 2)


@register(nn.Conv3d)
class Conv3d(nn.Conv3d):
    def forward(self, input):
        return _conv_forward(self, input, 3)


@register(nn.ConvTranspose1d)
class ConvTranspose1d(nn.ConvTranspose1d):
    def forward(self, input, output_size=None):
        return _conv_transpose_forward(self, input, output_size, 1)


@register(nn.ConvTranspose2d)
class ConvTranspose2d(nn.ConvTranspose2d):
    def forward(self, input, output_size=None):
        return _conv_transpose_forward(self, input, output_size, 2)


@register(nn.ConvTranspose3d)
class ConvTranspose3d(nn.ConvTranspose3d):
    def forward(self, input, output_size=None):
        return _conv_transpose_forward(self, input, output_size, 3)
