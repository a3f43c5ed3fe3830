"""bitsandbytes' quantized linear layers (and peft's LoRA wrappers around them) through
:mod:`slimgrad.functional.quantized`.

``Linear4bit`` (and its ``LinearFP4``/``LinearNF4`` subclasses, which only change ``__init__``) and
``Linear8bitLt`` with int8 weights run the same prelude as bitsandbytes' forward (quant-state repair,
compute dtype, the bias cast bitsandbytes applies to the parameter itself, the int8 state hand-over) and
then one Function that keeps only references to the packed weight and its state. Whatever that Function
would not reproduce goes through bitsandbytes' own forward: no gradient wanted, the CPU inference
repacking, weights not yet quantized, empty inputs.

peft's ``lora.bnb.Linear4bit`` / ``Linear8bitLt`` call their (converted) base layer as a module, then each
plain adapter through slimgrad's LoRA Function with no base term, in peft's order (base, then each adapter's
output cast to the base result's dtype and added). That needs ``LoraLinearFunction`` to accept
``weight=None``; with a ``lora.py`` that does not, the wrappers are not registered and run peft's forward
(over a converted base layer, which already keeps no input).
"""

from __future__ import annotations

import torch
from bitsandbytes.nn.modules import Linear4bit, Linear8bitLt, LinearFP4, LinearNF4
from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module as _fix_quant_state

from slimgrad._registry import register, register_forward
from slimgrad.functional.dropout import module_policy
from slimgrad.functional.lora import LoraLinearFunction
from slimgrad.functional.quantized import linear_4bit, linear_8bit

__all__ = ["SlimLinear4bit", "SlimLinear8bitLt", "SlimLinearFP4", "SlimLinearNF4"]


def _forward_4bit(self: Linear4bit, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Linear4bit.forward`` with the matmul in a Function that keeps no input."""
    stock = Linear4bit.forward
    if not isinstance(x, torch.Tensor) or not getattr(self.weight, "bnb_quantized", False):
        return stock(self, x)
    _fix_quant_state(self)
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
    return linear_4bit(x, self.weight, qs, bias).to(inp_dtype)


def _forward_8bit(self: Linear8bitLt, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' ``Linear8bitLt.forward`` with the matmul in a Function that keeps no input."""
    stock = Linear8bitLt.forward
    state = self.state
    if not isinstance(x, torch.Tensor) or state.has_fp16_weights or x.numel() == 0:
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


def _unsupported_8bit(module: Linear8bitLt) -> str | None:
    if module.state.has_fp16_weights:
        return "has_fp16_weights=True: the weight trains in fp16 and is requantized every step"
    return None


SlimLinear4bit = register_forward(Linear4bit, _forward_4bit, module=__name__)
SlimLinearFP4 = register_forward(LinearFP4, _forward_4bit, module=__name__)
SlimLinearNF4 = register_forward(LinearNF4, _forward_4bit, module=__name__)
SlimLinear8bitLt = register_forward(Linear8bitLt, _forward_8bit, module=__name__, unsupported_reason=_unsupported_8bit)


def _adapters_only_supported() -> bool:
    """Whether slimgrad's LoRA Function can run adapters without a base term (``weight=None``)."""
    z = torch.zeros(1, 1)
    try:
        with torch.no_grad():
            out = LoraLinearFunction.apply(z, None, None, False, True, (1.0,), (0.0,), None, z, z, None)
    except (TypeError, AttributeError, RuntimeError):
        return False
    return isinstance(out, torch.Tensor) and out.shape == (1, 1)


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's bnb LoRA forward: the base layer as a module, then each adapter through slimgrad's LoRA
    Function without a base term, added in peft's order; peft's own forward wherever that is not plain
    LoRA (see :mod:`slimgrad.integrations.peft_lora`) or under autocast (peft then skips its casts)."""
    from slimgrad.integrations.peft_lora import _adapters, _stock_type

    stock = _stock_type(self).forward
    adapters = None
    if (not args and not kwargs and not self.disable_adapters and not self.merged and isinstance(x, torch.Tensor)
            and not self.lora_variant and not torch.is_autocast_enabled()):
        adapters = _adapters(self, x)
    if adapters is None:
        return stock(self, x, *args, **kwargs)
    result = self.base_layer(x)
    cast = bool(getattr(self, "cast_input_dtype_enabled", True))
    for a in adapters:
        out = LoraLinearFunction.apply(x, None, None, False, cast, (float(a.scaling),), (float(a.dropout),),
                                       module_policy(self), a.A, a.B, a.bias)
        result = result + out.to(result.dtype)
    return result


try:
    from peft.tuners.lora import bnb as _peft_bnb
except ImportError:  # peft not installed: only bitsandbytes' own layers
    _peft_bnb = None

if _peft_bnb is not None and _adapters_only_supported():
    # Declared, not built by register_forward: peft's classes share bitsandbytes' names (Linear4bit), and the
    # generated "SlimLinear4bit" would shadow bitsandbytes' replacement in this module (breaking pickling).

    @register(_peft_bnb.Linear4bit)
    class SlimLoraLinear4bit(_peft_bnb.Linear4bit):
        """slimgrad's drop-in for peft.tuners.lora.bnb.Linear4bit (forward only)."""

        forward = _lora_forward

    @register(_peft_bnb.Linear8bitLt)
    class SlimLoraLinear8bitLt(_peft_bnb.Linear8bitLt):
        """slimgrad's drop-in for peft.tuners.lora.bnb.Linear8bitLt (forward only)."""

        forward = _lora_forward

    __all__ += ["SlimLoraLinear4bit", "SlimLoraLinear8bitLt"]
