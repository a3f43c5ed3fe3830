"""bitsandbytes' quantized linear layers (and peft's LoRA wrappers around them) through
:mod:`slimgrad.functional.quantized`.

``Linear4bit`` (and its ``LinearFP4``/``LinearNF4`` subclasses, which only change ``__init__``) and
``Linear8bitLt`` with int8 weights run the same prelude as bitsandbytes' forward (quant-state repair,
compute dtype, the bias cast bitsandbytes applies to the parameter itself, the int8 state hand-over) and
then one Function that keeps only references to the packed weight and its state. Whatever that Function
would not reproduce goes through bitsandbytes' own forward: no gradient wanted, the CPU inference
repacking, weights not yet quantized, empty inputs.

peft's ``lora.bnb.Linear4bit`` / ``Linear8bitLt`` call their (converted) base layer as a module, then each
plain adapter through slimgrad's LoRA Function with no base term (the compiled core's on eager CPU calls, as
``lora_linear`` routes them), in peft's order (base, then each adapter's output cast to the base result's dtype
and added). That needs ``LoraLinearFunction`` to accept
``weight=None``; with a ``lora.py`` that does not, the wrappers are not registered and run peft's forward
(over a converted base layer, which already keeps no input).

All of this re-implements upstream code (the layers' forwards, the helpers they call, the autograd
Functions :mod:`slimgrad.functional.quantized` mirrors, peft's forwards), so each class is registered only
when every one of those functions is a version slimgrad has read (:data:`KNOWN`, compared by
:mod:`slimgrad.integrations._fingerprint`), and re-checked at every convert. A helper renamed upstream, a
new parameter on a forward, any edit: the class is left to bitsandbytes (or peft), recorded as a gap
(family "bitsandbytes linear" or "LoRA layer") that ``convert`` warns about, and this module still imports.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from slimgrad._registry import ORIGINALS, register, register_forward
from slimgrad.functional._common import autocast_enabled, foreign_input, note_exactly_narrower
from slimgrad.functional.dropout import POLICY_ATTRIBUTE, core_draw_simulated, module_policy
from slimgrad.functional.lora import LoraLinearFunction, _core_apply, _core_simulated
from slimgrad.functional.quantized import linear_4bit, linear_8bit
from slimgrad.integrations._fingerprint import Verified
from slimgrad.integrations._hooks import global_module_hooks


def _module(name: str):
    """``name`` imported, or None where this bitsandbytes (or peft) has no such module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_modules = _module("bitsandbytes.nn.modules")
_functions = _module("bitsandbytes.autograd._functions")
Linear4bit = getattr(_modules, "Linear4bit", None)
LinearFP4 = getattr(_modules, "LinearFP4", None)
LinearNF4 = getattr(_modules, "LinearNF4", None)
Linear8bitLt = getattr(_modules, "Linear8bitLt", None)

__all__ = ["KNOWN"]

_BNB_050 = "bitsandbytes 0.50.0-0.50.2"
_PEFT_017, _PEFT_018 = "peft 0.17.0-0.17.1", "peft 0.18.0-0.21.2"
#: function -> {fingerprint: versions it was read in}. bitsandbytes 0.45-0.49 differ in the 4-bit prelude, the
#: int8 Functions or the 4-bit matmul dispatch: slimgrad reproduces (and tests) 0.50 only.
KNOWN = {
    "Linear4bit.forward": {"a3b23774264b2005": _BNB_050},
    "Linear4bit.set_compute_type": {"cf17dda6d0c9a273": _BNB_050},
    "fix_4bit_weight_quant_state_from_module": {"8e18f78f3322c557": _BNB_050},
    "matmul_4bit": {"a4706aefcddc4064": _BNB_050},
    "MatMul4Bit.forward": {"e0c65ea12c035e4f": _BNB_050},
    "MatMul4Bit.backward": {"ac3c9b7c460f1b89": _BNB_050},
    "Linear8bitLt.forward": {"e2036fe36408f3de": "bitsandbytes 0.45.0-0.50.2"},
    "Linear8bitLt.init_8bit_state": {"014d8756b59140d0": "bitsandbytes 0.45.0-0.50.2"},
    "matmul": {"b94a79660fe4fa2b": "bitsandbytes 0.48.2-0.50.2"},
    "MatMul8bitLt.forward": {"72870703e8402fd7": _BNB_050},
    "MatMul8bitLt.backward": {"5d1eaac0a16409b9": "bitsandbytes 0.49.2-0.50.2"},
    "MatMul8bitFp.forward": {"5472b599b1e0a64e": "bitsandbytes 0.48.2-0.50.2"},
    "MatMul8bitFp.backward": {"cc9ace20627e3733": "bitsandbytes 0.47.0-0.50.2"},
    # peft 0.17 differs from 0.18 only in the LoRA-variant and adapter_names branches (peft's forward here)
    "lora.bnb.Linear4bit.forward": {"c5b1701f232c2721": _PEFT_017, "34154b70abc91c77": _PEFT_018},
    "lora.bnb.Linear8bitLt.forward": {"9693bc4022de0f34": _PEFT_017, "54c13d91d3f7f15b": _PEFT_018},
    "BaseTunerLayer._cast_input_dtype": {"205581c1e8c84685": "peft 0.17.0-0.21.2"},
}
_MATMUL_4BIT = {"fix_4bit_weight_quant_state_from_module": (_modules, "fix_4bit_weight_quant_state_from_module"),
                "matmul_4bit": (_functions, "matmul_4bit"),
                "MatMul4Bit.forward": (getattr(_functions, "MatMul4Bit", None), "forward"),
                "MatMul4Bit.backward": (getattr(_functions, "MatMul4Bit", None), "backward")}
_MATMUL_8BIT = {"matmul": (_functions, "matmul"),
                "MatMul8bitLt.forward": (getattr(_functions, "MatMul8bitLt", None), "forward"),
                "MatMul8bitLt.backward": (getattr(_functions, "MatMul8bitLt", None), "backward"),
                "MatMul8bitFp.forward": (getattr(_functions, "MatMul8bitFp", None), "forward"),
                "MatMul8bitFp.backward": (getattr(_functions, "MatMul8bitFp", None), "backward")}


def _check_4bit(cls: type) -> Verified:
    return Verified({"Linear4bit.forward": (cls, "forward"), "Linear4bit.set_compute_type": (cls, "set_compute_type"),
                     **_MATMUL_4BIT}, KNOWN, classes=(cls,), library="bitsandbytes", family="bitsandbytes linear")


_CHECKS: dict[type, Verified] = {cls: _check_4bit(cls) for cls in (Linear4bit, LinearFP4, LinearNF4) if cls is not None}
if Linear8bitLt is not None:
    _CHECKS[Linear8bitLt] = Verified({"Linear8bitLt.forward": (Linear8bitLt, "forward"),
                                      "Linear8bitLt.init_8bit_state": (Linear8bitLt, "init_8bit_state"),
                                      **_MATMUL_8BIT}, KNOWN, classes=(Linear8bitLt,), library="bitsandbytes",
                                     family="bitsandbytes linear")


def _known_now(self) -> bool:
    """Whether the upstream functions this module's forward reproduces are still the ones checked."""
    check = _CHECKS.get(ORIGINALS.get(type(self), type(self)))
    return check is not None and check.still_known()


def _forward_4bit(self: Linear4bit, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Linear4bit.forward`` with the matmul in a Function that keeps no input."""
    stock = ORIGINALS[type(self)].forward
    if not isinstance(x, torch.Tensor) or not getattr(self.weight, "bnb_quantized", False) or not _known_now(self):
        return stock(self, x)
    _modules.fix_4bit_weight_quant_state_from_module(self)
    qs = self.weight.quant_state
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
    if not wants_grad or qs is None or getattr(qs, "packing_format_for_cpu", False) or x.numel() == 0:
        return stock(self, x)  # no Function involved (or an empty input): nothing is kept either way
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    if bias is not None:
        if bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)  # as bitsandbytes does, on the parameter itself
        bias = bias.to(self.compute_dtype)
    out = linear_4bit(x, self.weight, qs, bias)
    wide = out.to(inp_dtype)
    if wide is not out:  # bf16 results cast up to fp32: a consumer may keep them in bf16 (_common, "narrower")
        note_exactly_narrower(wide, out.dtype)
    return wide


def _forward_8bit(self: Linear8bitLt, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Linear8bitLt.forward`` with the matmul in a Function that keeps no input."""
    stock = ORIGINALS[type(self)].forward
    state = self.state
    if not isinstance(x, torch.Tensor) or state.has_fp16_weights or x.numel() == 0 or not _known_now(self):
        return stock(self, x)
    state.is_training = self.training
    if self.weight.CB is not None:
        self.init_8bit_state()
    if state.CB is None or state.SCB is None:
        return stock(self, x)
    if self.bias is not None and self.bias.dtype != x.dtype:
        self.bias.data = self.bias.data.to(x.dtype)
    # bnb.matmul: the dequantize-then-F.linear kernel when training on CPU/XPU, the int8 kernel otherwise.
    training = state.is_training and x.device.type in ("cpu", "xpu")
    out = linear_8bit(x, state.CB, state.SCB, self.bias, threshold=state.threshold, training=training, state=state)
    self.weight.data = state.CB
    return out


def _unsupported_4bit(module) -> str | None:
    return _CHECKS[ORIGINALS.get(type(module), type(module))].reason()


def _unsupported_8bit(module) -> str | None:
    reason = _CHECKS[ORIGINALS.get(type(module), type(module))].reason()
    if reason is None and module.state.has_fp16_weights:
        return "has_fp16_weights=True: the weight trains in fp16 and is requantized every step"
    return reason


for _cls, _fwd, _why in ((Linear4bit, _forward_4bit, _unsupported_4bit), (LinearFP4, _forward_4bit, _unsupported_4bit),
                         (LinearNF4, _forward_4bit, _unsupported_4bit),
                         (Linear8bitLt, _forward_8bit, _unsupported_8bit)):
    if _cls is not None and _CHECKS[_cls].reason() is None:  # otherwise a gap, recorded by the check
        __all__.append(register_forward(_cls, _fwd, module=__name__, unsupported_reason=_why).__qualname__)


def _adapters_only_supported() -> bool:
    """Whether slimgrad's LoRA Function can run adapters without a base term (``weight=None``)."""
    z = torch.zeros(1, 1)
    try:
        with torch.no_grad():
            out = LoraLinearFunction.apply(z, None, None, False, True, (1.0,), (0.0,), None, z, z, None)[0]
    except (TypeError, AttributeError, RuntimeError):
        return False
    return isinstance(out, torch.Tensor) and out.shape == (1, 1)


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's bnb LoRA forward: the base layer as a module, then each adapter through slimgrad's LoRA
    Function without a base term, added in peft's order; peft's own forward wherever that is not plain
    LoRA (see :mod:`slimgrad.integrations.peft_lora`) or under autocast (peft then skips its casts)."""
    from slimgrad.integrations.peft_lora import _adapters, _peft_keeps_as_little, _stock_type

    stock = _stock_type(self).forward
    if global_module_hooks() or foreign_input(x):  # the submodules the Function does not call would miss the hook
        return stock(self, x, *args, **kwargs)  # (integrations/_hooks.py); a DTensor / NestedTensor input: peft's
    if (not args and not kwargs and isinstance(x, torch.Tensor) and not x.requires_grad
            and _peft_keeps_as_little(self, x)):
        return stock(self, x)  # x frozen and read alone: peft keeps no more (peft_lora.py)
    if not args and not kwargs and type(x) is torch.Tensor and (out := _fast_lora_forward(self, x)) is not None:
        return out
    adapters = None
    if (not args and not kwargs and not self.disable_adapters and not self.merged and isinstance(x, torch.Tensor)
            and not self.lora_variant and not torch.is_autocast_enabled(x.device.type) and _known_now(self)):
        adapters = _adapters(self, x)
    if adapters is None:
        return stock(self, x, *args, **kwargs)
    result = self.base_layer(x)
    cast = bool(getattr(self, "cast_input_dtype_enabled", True))
    policy = module_policy(self)
    for a in adapters:
        out = _adapter_forward(x, cast, float(a.scaling), float(a.dropout), policy, a.A, a.B, a.bias)
        result = result + out.to(result.dtype)
    return result


def _fast_lora_forward(self, x: torch.Tensor):
    """:func:`_lora_forward`'s plain-LoRA branch after the same checks, read straight from the module's ``__dict__``
    and its submodules' ``_modules``/``_parameters`` (``_adapters`` through peft's properties and
    nn.Module.__getattr__ cost ~10 us a layer more), or None where anything is unusual (the checked path decides
    then)."""
    from slimgrad.integrations.peft_lora import _active_plain_adapters

    d = self.__dict__
    # (the device's autocast: torch.is_autocast_enabled() alone asks CUDA's, and under CPU autocast the LoRA branch
    # ran where peft skips its casts: backward raised "expected m1 and m2 to have the same dtype"; review sweep)
    if (d.get("_disable_adapters") or d.get("merged_adapters") or d.get("lora_variant")
            or torch.is_autocast_enabled(x.device.type) or not _known_now(self)):
        return None
    found = _active_plain_adapters(d, nn.Linear)
    if found is None or (autocast_enabled(x.device.type) and any(p > 0 for *_, p in found)):
        return None
    modules = d["_modules"]
    result = modules["base_layer"](x)
    cast = bool(d.get("cast_input_dtype_enabled", True))
    policy = d.get(POLICY_ATTRIBUTE)
    for _, _, A, B, bias, s, p in found:
        out = _adapter_forward(x, cast, s, p, policy, A, B, bias)
        result = result + out.to(result.dtype)
    return result


def _adapter_forward(x, cast, scaling, p, policy, A, B, bias):
    """One adapter without a base term, as ``lora_linear`` routes a call: the compiled core (one C++ autograd
    Function) where it may run (an eager CPU call, bits dropout), which costs ~0.1 ms less a layer than the
    Python Function's Python forward and backward (QLoRA's 4-bit layers are small: that was +4 % of a step);
    the Python Function elsewhere, under ``slimgrad.estimate`` allocating as the core would."""
    tensors = [x, None, None, A, B, bias]
    scalings, ps = (scaling,), (p,)
    if (out := _core_apply(x, tensors, False, bool(cast), scalings, ps, policy)) is not None:
        return out
    if _core_simulated(x, tensors, ps, policy):
        with core_draw_simulated():  # the C++ Function's allocations
            return LoraLinearFunction.apply(x, None, None, False, cast, scalings, ps, policy, A, B, bias)[0]
    return LoraLinearFunction.apply(x, None, None, False, cast, scalings, ps, policy, A, B, bias)[0]


try:
    from peft.tuners.lora import bnb as _peft_bnb
except ImportError:  # peft not installed: only bitsandbytes' own layers
    _peft_bnb = None


def _peft_check(cls: type, label: str) -> Verified:
    return Verified({label: (cls, "forward"), "BaseTunerLayer._cast_input_dtype": (cls, "_cast_input_dtype")},
                    KNOWN, classes=(cls,), library="peft", family="LoRA layer")


def _unsupported_lora(module) -> str | None:
    from slimgrad.integrations.peft_lora import variant_reason

    # (DoRA and the other variants: the forward runs peft's own, so the report says so, as over nn.Linear)
    return _CHECKS[ORIGINALS.get(type(module), type(module))].reason() or variant_reason(module)


_PEFT_CLASSES = {name: getattr(_peft_bnb, name, None) for name in ("Linear4bit", "Linear8bitLt")}
for _name, _cls in _PEFT_CLASSES.items():
    if _cls is not None:
        _CHECKS[_cls] = _peft_check(_cls, f"lora.bnb.{_name}.forward")

if _peft_bnb is not None and _adapters_only_supported():
    # Declared, not built by register_forward: peft's classes share bitsandbytes' names (Linear4bit), and the
    # generated "SlimLinear4bit" would shadow bitsandbytes' replacement in this module (breaking pickling).
    for _name, _cls in _PEFT_CLASSES.items():
        if _cls is None or _CHECKS[_cls].reason() is not None:
            continue
        _slim_name = f"SlimLora{_name}"
        _slim = type(_slim_name, (_cls,), {
            "__module__": __name__, "__qualname__": _slim_name,
            "__doc__": f"slimgrad's drop-in for peft.tuners.lora.bnb.{_name} (forward only).",
            "forward": _lora_forward, "unsupported_reason": classmethod(lambda cls, m: _unsupported_lora(m))})
        globals()[_slim_name] = register(_cls)(_slim)
        __all__.append(_slim_name)


def refresh() -> None:
    """Re-check the upstream functions on every convert (called by
    :func:`slimgrad.integrations.load_available`): one patched since import makes its class a gap."""
    for check in _CHECKS.values():
        check.reason()
