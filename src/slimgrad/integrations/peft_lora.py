"""peft's ``lora.Linear`` routed through :func:`slimgrad.functional.lora.lora_linear`.

The replacement reads the base layer's and the adapters' parameters and calls one autograd Function,
instead of calling ``base_layer``, ``lora_dropout``, ``lora_A`` and ``lora_B`` as modules. Everything PEFT
does differently from plain LoRA goes through PEFT's own forward, unchanged: merged or disabled adapters
(base only, and PEFT's unmerge side effect), the ``adapter_names=`` mixed batch, extra forward arguments,
and anything the Function would not reproduce bit for bit (hooks on the submodules, which a direct
parameter read would skip; adapters of mixed dtypes; dropout under autocast, where PEFT drops in the
adapters' dtype before autocast rounds). LoRA variants (DoRA and the others) and base layers other than
``nn.Linear`` / GPT-2's ``Conv1D`` are left unconverted and reported.

The replacement re-implements the plain-LoRA branch of peft's ``Linear.forward`` (and, for GPT-2's
``Conv1D`` base, that layer's forward), so it is registered only when those functions are versions slimgrad
has read (:data:`KNOWN`, by :mod:`slimgrad.integrations._fingerprint`), and re-checked at every convert:
an unknown version leaves every LoRA layer to peft, recorded as a gap (family "LoRA layer") that
``convert`` warns about; different numbers are never an outcome.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from transformers.pytorch_utils import Conv1D

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, register_forward
from slimgrad.functional._common import autocast_enabled
from slimgrad.functional.dropout import module_policy
from slimgrad.functional.lora import LoraAdapter, lora_linear
from slimgrad.integrations._fingerprint import Verified, unknown_reason

__all__ = ["KNOWN", "SlimLinear"]

#: function -> {fingerprint: versions it was read in}; peft 0.17 differs from 0.18 only in the LoRA-variant
#: and ``adapter_names`` branches, which run peft's own forward here.
KNOWN = {
    "lora.Linear.forward": {"4c9996dfc57f4775": "peft 0.17.0-0.17.1", "039d4360386e2022": "peft 0.18.0-0.21.2"},
    "BaseTunerLayer._cast_input_dtype": {"205581c1e8c84685": "peft 0.17.0-0.21.2"},
    "Conv1D.forward": {"0570fe82cfe0b593": "transformers 5.23.0-5.24.0"},
}
_CHECK = Verified({"lora.Linear.forward": (LoraLinear, "forward"),
                   "BaseTunerLayer._cast_input_dtype": (LoraLinear, "_cast_input_dtype")},
                  KNOWN, classes=(LoraLinear,), library="peft", family="LoRA layer")


def _conv1d_reason() -> str | None:
    """Why LoRA over GPT-2's ``Conv1D`` is left to peft (its forward, read as a weight, is not known)."""
    return unknown_reason({"Conv1D.forward": Conv1D.forward}, KNOWN)


_CONV1D_REASON = _conv1d_reason()
if _CONV1D_REASON is not None:
    _notices.record_class_gap(Conv1D, library="transformers", family="LoRA layer",
                              reason=_CONV1D_REASON + "; LoRA layers over it are left to peft")


def _stock_type(module: nn.Module) -> type:
    return ORIGINALS.get(type(module), type(module))


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None)


def _unsupported(module: LoraLinear) -> str | None:
    return _CHECK.reason() or _unsupported_layer(module)


def _unsupported_layer(module: LoraLinear) -> str | None:
    base = module.base_layer
    if _stock_type(base) not in (nn.Linear, Conv1D):
        return f"base layer is {type(base).__name__}, not nn.Linear or transformers' Conv1D"
    if _stock_type(base) is Conv1D and _CONV1D_REASON is not None:
        return _CONV1D_REASON
    if (_stock_type(base) is Conv1D) != bool(module.fan_in_fan_out):
        return "fan_in_fan_out does not match the base layer's weight layout"
    if module.lora_variant:
        names = ", ".join(f"{k}: {type(v).__name__}" for k, v in module.lora_variant.items())
        return f"LoRA variant adapters ({names}) run PEFT's own forward"
    return None


def _dropout_p(module: nn.Module) -> float | None:
    """The dropout probability PEFT's dropout module would apply now, or None for a module we don't know."""
    kind = _stock_type(module)
    if kind is nn.Identity:
        return 0.0
    if kind is nn.Dropout and not module.inplace:
        return module.p if module.training else 0.0
    return None


def _adapters(self: LoraLinear, x: torch.Tensor):
    """The active adapters as LoraAdapter tuples, or None where PEFT's forward must run instead."""
    adapters = []
    for name in self.active_adapters:
        if name not in self.lora_A.keys():
            continue
        if name in self.lora_variant:
            return None
        lora_a, lora_b, drop = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if _stock_type(lora_a) is not nn.Linear or _stock_type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return None
        if _has_hooks(lora_a) or _has_hooks(lora_b) or _has_hooks(drop):
            return None
        p = _dropout_p(drop)
        if p is None or (p > 0 and autocast_enabled(x.device.type)):
            return None
        adapters.append(LoraAdapter(lora_a.weight, lora_b.weight, self.scaling[name], p, lora_b.bias))
    dtypes = {t.dtype for a in adapters for t in (a.A, a.B)}
    if len(dtypes) > 1:
        return None
    return adapters


def _forward(self: LoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's ``Linear.forward`` in one Function where it is plain LoRA; PEFT's own forward elsewhere."""
    base = self.base_layer
    adapters = None
    if (not args and not kwargs and not self.disable_adapters and not self.merged and isinstance(x, torch.Tensor)
            and not _has_hooks(base) and _CHECK.still_known() and _unsupported_layer(self) is None):
        adapters = _adapters(self, x)
    if adapters is None:
        return LoraLinear.forward(self, x, *args, **kwargs)
    return lora_linear(x, base.weight, base.bias, adapters, fan_in_fan_out=_stock_type(base) is Conv1D,
                       cast_input=getattr(self, "cast_input_dtype_enabled", True),
                       dropout_policy=module_policy(self))


if _CHECK.reason() is None:
    SlimLinear = register_forward(LoraLinear, _forward, module=__name__, unsupported_reason=_unsupported)
else:  # left to peft, recorded as a gap by the check
    __all__ = ["KNOWN"]


def refresh() -> None:
    """Re-check peft's functions (called by :func:`slimgrad.integrations.load_available` on every convert):
    one patched since import makes its layers gaps, left to peft."""
    _CHECK.reason()
