"""peft's ``lora.Conv1d/2d/3d`` through :func:`slimgrad.functional.lora_conv.lora_conv`, and what
``lora.Embedding`` needs (nothing).

The base convolution runs as its own (converted) module: with its weight frozen a slimgrad convolution
keeps nothing (stock keeps x). With dropout or a dtype cast (fp32 adapters on a bf16/fp16 model, as
diffusers' mixed-precision LoRA scripts set up) the adapters run in one Function that keeps x once in its
own dtype, the dropout mask as bits (or a seed) and ``A(x)``, instead of the cast copy, the noise and the
dropped copy. Without dropout
and cast peft's own forward already keeps only what the adapters' gradients read (x for dA, ``A(x)`` for
dB), so it runs unchanged; so do merged or disabled adapters, ``adapter_names=``, LoRA variants (DoRA),
hooks, string paddings, autocast regions and adapters of mixed dtypes.

``lora.Embedding`` is not replaced: measured, peft's forward keeps only the int64 indices (for dA) and
``A[ids]`` (for dB), the frozen base embedding nothing, which is already the minimum (tests check it).

As for ``lora.Linear`` (:mod:`slimgrad.integrations.peft_lora`), the adapters' branch re-implements peft's
``_ConvNd.forward``: each class is registered only when its forward and ``_cast_input_dtype`` are versions
slimgrad has read (:data:`KNOWN`), re-checked at every convert, and otherwise left to peft and recorded as
a gap (family "LoRA layer").
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Conv1d as LoraConv1d
from peft.tuners.lora.layer import Conv2d as LoraConv2d
from peft.tuners.lora.layer import Conv3d as LoraConv3d
from torch import nn

from slimgrad import csrc
from slimgrad._registry import register_forward
from slimgrad.functional._common import autocast_enabled, foreign_input, note_input_kept
from slimgrad.functional.dropout import POLICY_ATTRIBUTE, module_policy, resolve_policy
from slimgrad.functional.lora import adapters_apart
from slimgrad.functional.lora_conv import ConvOptions, LoraConvAdapter, lora_conv
from slimgrad.integrations._fingerprint import Verified
from slimgrad.integrations._hooks import global_module_hooks
from slimgrad.integrations.peft_lora import (
    _FLOATS,
    _PLAIN,
    _active_plain_adapters,
    _dropout_p,
    _has_hooks,
    _hooked,
    _peft_keeps_as_little,
    _stock_type,
)

__all__ = ["KNOWN"]

_STOCK = {LoraConv1d: nn.Conv1d, LoraConv2d: nn.Conv2d, LoraConv3d: nn.Conv3d}

#: function -> {fingerprint: versions it was read in}; peft 0.17 differs from 0.18 only in the LoRA-variant
#: branch, which runs peft's own forward here.
KNOWN = {
    "lora._ConvNd.forward": {"95801dd94603e71b": "peft 0.17.0-0.17.1", "ff4151947623f646": "peft 0.18.0-0.21.2"},
    "BaseTunerLayer._cast_input_dtype": {"205581c1e8c84685": "peft 0.17.0-0.21.2"},
}
_CHECKS = {cls: Verified({"lora._ConvNd.forward": (cls, "forward"),
                          "BaseTunerLayer._cast_input_dtype": (cls, "_cast_input_dtype")},
                         KNOWN, classes=(cls,), library="peft", family="LoRA layer") for cls in _STOCK}


def _lora_class(module: nn.Module) -> type:
    return next(c for c in _STOCK if isinstance(module, c))


def _unsupported(module) -> str | None:
    return _CHECKS[_lora_class(module)].reason() or _unsupported_layer(module)


def _unsupported_layer(module) -> str | None:
    base, conv = module.base_layer, _STOCK[_lora_class(module)]
    if _stock_type(base) is not conv:
        return f"base layer is {type(base).__name__}, not {conv.__name__}"
    if module.lora_variant:
        names = ", ".join(f"{k}: {type(v).__name__}" for k, v in module.lora_variant.items())
        return f"LoRA variant adapters ({names}) run PEFT's own forward"
    return None


def _options(conv: nn.Module) -> ConvOptions | None:
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return None
    return ConvOptions(tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups)


def _adapters(self, x: torch.Tensor):
    """The active adapters, or None where peft's forward must run (or already keeps the minimum)."""
    adapters, worth_it = [], False
    for name in self.active_adapters:
        if name not in self.lora_A.keys():
            continue
        if name in self.lora_variant:
            return None
        lora_a, lora_b, drop = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        conv = _STOCK[_lora_class(self)]
        if _stock_type(lora_a) is not conv or _stock_type(lora_b) is not conv or lora_a.bias is not None:
            return None
        if _has_hooks(lora_a) or _has_hooks(lora_b) or _has_hooks(drop):
            return None
        p, a, b = _dropout_p(drop), _options(lora_a), _options(lora_b)
        if p is None or a is None or b is None:
            return None
        worth_it = worth_it or p > 0 or (getattr(self, "cast_input_dtype_enabled", True)
                                         and x.dtype != lora_a.weight.dtype)
        adapters.append(LoraConvAdapter(lora_a.weight, lora_b.weight, a, b, self.scaling[name], p, lora_b.bias))
    if not adapters or not worth_it or len({t.dtype for ad in adapters for t in (ad.A, ad.B)}) > 1:
        return None
    return adapters


def _core_options(conv: nn.Module, nd: int):
    """``conv``'s options as the core takes them (stride, padding, dilation, groups: one flat tuple), read from its
    ``__dict__``; None where :func:`_options` would refuse them or they are not spelled out per dim."""
    d = conv.__dict__
    padding = d["padding"]
    if isinstance(padding, str) or d["padding_mode"] != "zeros":
        return None
    stride, dilation = d["stride"], d["dilation"]
    if not len(stride) == len(padding) == len(dilation) == nd:
        return None
    return (*stride, *padding, *dilation, d["groups"])


def _fast_forward(self, x: torch.Tensor):
    """An eager CPU call that the compiled core serves (csrc/lora_conv.cpp), after the checks of the path below,
    read straight from the module's ``__dict__`` and its submodules' ``_modules``/``_parameters``; None where
    anything is unusual or the core does not serve the call (the checked path decides then). Why: the checked path's
    attribute lookups and per-call tuples cost ~25 us a call, a tenth of a small LoRA conv's forward and backward.
    Whether the layer is supported is cached in its ``__dict__`` per base layer type."""
    core = csrc.for_eager(x)  # (None under torch.compile and torch.func transforms, for non-CPU tensors)
    if core is None or x.dtype not in _FLOATS or autocast_enabled("cpu"):
        return None
    d = self.__dict__
    if d.get("_disable_adapters") or d.get("merged_adapters") or d.get("lora_variant"):
        return None
    cls = _lora_class(self)
    if d.get("_active_adapter") is None or not _CHECKS[cls].still_known():
        return None
    modules = d["_modules"]
    base = modules["base_layer"]
    plan = d.get("_slimgrad_core_plan")
    if plan is None or plan[0] is not type(base):
        plan = d["_slimgrad_core_plan"] = (type(base), _unsupported_layer(self) is None, _STOCK[cls])
    nd = x.dim() - 2
    weight = base._parameters.get("weight")  # (None: parametrized after convert; the checked path decides)
    if not plan[1] or _hooked(base) or type(weight) not in _PLAIN or nd != weight.dim() - 2:
        return None
    found = _active_plain_adapters(d, plan[2])
    if found is None:
        return None
    tensors, scalings, ps, opts = [x, None], [], [], []
    dtype, device, worth_it = found[0][2].dtype if found else None, x.device, False
    cast = d.get("cast_input_dtype_enabled", True)
    for a, b, A, B, bb, s, p in found:
        oa, ob = _core_options(a, nd), _core_options(b, nd)
        if oa is None or ob is None or dtype not in _FLOATS or A.device != device or B.device != device:
            return None
        if bb is not None and (type(bb) not in _PLAIN or bb.device != device or bb.dtype not in _FLOATS):
            return None
        worth_it = worth_it or p > 0 or (cast and x.dtype != dtype)
        tensors += [A, B, bb]
        scalings.append(s)
        ps.append(p)
        opts += [oa, ob]
    if not worth_it or (any(0 < p < 1 for p in ps) and resolve_policy(d.get(POLICY_ATTRIBUTE), device) != "bits"):
        return None  # (peft's own ops keep the minimum; the "seed" policy is the Python Function's)
    if len(ps) > 1 and adapters_apart(x, len(ps), ps, cast, dtype, d.get(POLICY_ATTRIBUTE)):
        return None  # one Function per adapter, as lora_conv runs them (functional/lora.py's adapters_apart)
    tensors[1] = base_out = base(x)
    if type(base_out) is not torch.Tensor or base_out.device != device or base_out.dtype not in _FLOATS:
        return None  # (the checked path runs the base layer again: a plain module, the same result)
    out, x_kept = core.lora_conv_apply(tensors, bool(cast), scalings, ps, opts)
    if x_kept:
        note_input_kept(x)
    return out


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``_ConvNd.forward``, with the adapters in one Function where that keeps less (peft's own wherever a
    global module hook would miss the submodules the Function does not call: integrations/_hooks.py)."""
    if global_module_hooks() or foreign_input(x):  # (a DTensor or NestedTensor input: peft's forward, subclass44)
        return _lora_class(self).forward(self, x, *args, **kwargs)
    if (not args and not kwargs and isinstance(x, torch.Tensor) and not x.requires_grad
            and _peft_keeps_as_little(self, x)):
        return _lora_class(self).forward(self, x)  # x frozen and read alone: peft keeps no more (peft_lora.py)
    if not args and not kwargs and type(x) is torch.Tensor and x.dim() >= 3 and (out := _fast_forward(self, x)) \
            is not None:
        return out
    cls = _lora_class(self)
    stock = cls.forward
    if (args or kwargs or self.disable_adapters or self.merged or not isinstance(x, torch.Tensor)
            or x.dim() != self.base_layer.weight.dim() or autocast_enabled(x.device.type)
            or _has_hooks(self.base_layer) or not _CHECKS[cls].still_known() or _unsupported_layer(self) is not None):
        return stock(self, x, *args, **kwargs)
    adapters = _adapters(self, x)
    if adapters is None:
        return stock(self, x, *args, **kwargs)
    return lora_conv(x, self.base_layer(x), adapters, cast_input=getattr(self, "cast_input_dtype_enabled", True),
                     dropout_policy=module_policy(self))


for _cls in _STOCK:
    if _CHECKS[_cls].reason() is None:  # otherwise left to peft, recorded as a gap by the check
        __all__.append(
            register_forward(_cls, _forward, module=__name__, unsupported_reason=_unsupported).__qualname__)


def refresh() -> None:
    """Re-check peft's functions on every convert (see :func:`slimgrad.integrations.peft_lora.refresh`)."""
    for check in _CHECKS.values():
        check.reason()
