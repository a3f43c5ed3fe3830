"""Hugging Face mixture-of-experts layers: their gated product through slimgrad's gated activation.

transformers 5 stores a MoE layer's experts as 3-D weights in one module, decorated with
``@use_experts_implementation``, and runs them through the implementation ``config._experts_implementation``
names ("grouped_mm" by default, "batched_mm", "deepgemm"). Those implementations call the class's
``_apply_gate(gate_up_out)``, which is transformers' ``_default_apply_gate`` for Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2/3, GLM-4-MoE, Granite-MoE, Jamba and some fifty other families: ``act_fn(gate) * up`` on the two halves
of the experts' first projection. Stock autograd then keeps that projection's output (both halves) and
``act_fn(gate)``: three intermediate-sized values per routed token. The replacement's ``_apply_gate`` computes the
same product with :func:`slimgrad.functional.gated.gated_activation`, which keeps gate and up (the two halves of
one storage) and recomputes the activation in backward: two, with outputs and gradients bitwise stock's. With
LoRA on the attention (peft's default for these families) the experts are frozen and this is most of what a MoE
layer keeps.

Only classes whose ``_apply_gate`` is transformers' default, with that function's source as read here
(fingerprint), are registered, and GPT-OSS's, whose own ``_apply_gate`` (a clamped SwiGLU on interleaved columns,
read here too) runs :func:`slimgrad.functional.clamped_swiglu.clamped_swiglu`: it keeps the projection's output
only, where stock keeps four more intermediate-sized tensors. Other gates of their own are left as they are. A
module with the default gate is converted only where its product runs through ``_apply_gate``: gated, concatenated
[gate; up] weights, an activation slimgrad reproduces exactly, and an implementation that calls ``_apply_gate``
("eager" runs the class's own loop, which writes the product inline: convert leaves such a module alone and says
so). GPT-OSS's eager loop calls its ``_apply_gate`` as well.
"""

from __future__ import annotations

import importlib

from torch import nn

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register
from slimgrad.functional.clamped_swiglu import clamped_swiglu
from slimgrad.integrations._fingerprint import fingerprint, source_fingerprint
from slimgrad.integrations._hf_classes import loaded_transformers_classes
from slimgrad.integrations._hooks import module_hooks
from slimgrad.integrations.hf_mlp import _gated, _runtime_kind, activation_kind

__all__ = ["register_loaded"]

#: the implementations of ``transformers.integrations.moe`` that call ``_apply_gate`` (read in their source here)
GATE_CALLERS = ("grouped_mm", "batched_mm", "deepgemm")

_DEFAULT_GATE = source_fingerprint(
    "def _default_apply_gate(self, gate_up_out):\n"
    "    gate, up = gate_up_out.chunk(2, dim=-1)\n"
    "    return self.act_fn(gate) * up\n")

try:  # transformers 5; 4.x runs each expert as its own MLP module (hf_mlp's gated MLPs where they match)
    _default_apply_gate = getattr(importlib.import_module("transformers.integrations.moe"), "_default_apply_gate", None)
except ImportError:
    _default_apply_gate = None
#: whether transformers' default gate is the function read above (else no class is registered)
_GATE_KNOWN = _default_apply_gate is not None and fingerprint(_default_apply_gate) == _DEFAULT_GATE

#: GPT-OSS's own gate (transformers 5.x GptOssExperts._apply_gate)
_CLAMPED_SWIGLU_GATE = source_fingerprint(
    "def _apply_gate(self, gate_up):\n"
    "    gate, up = gate_up[..., ::2], gate_up[..., 1::2]\n"
    "    gate = gate.clamp(min=None, max=self.limit)\n"
    "    up = up.clamp(min=-self.limit, max=self.limit)\n"
    "    glu = gate * torch.sigmoid(gate * self.alpha)\n"
    "    gated_output = (up + 1) * glu\n"
    "    return gated_output\n")

_REJECTED: set[type] = set()
#: registered stock class -> its ``_apply_gate`` as verified (a later monkey-patch makes the class unsupported)
_VERIFIED: dict[type, object] = {}


def _implementation(module: nn.Module) -> str | None:
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _apply_gate(self, gate_up_out):
    """transformers' ``_default_apply_gate`` (``act_fn(gate) * up`` on the halves), keeping gate and up only."""
    kind = _runtime_kind(self, "act_fn")
    if kind is None:  # activation swapped or hooked since conversion: stock's product
        return _default_apply_gate(self, gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return _gated(self, gate, up, "act_fn", kind)  # (halves of another shape: stock's expression)


def _clamped_swiglu_gate(self, gate_up):
    """GPT-OSS's ``_apply_gate``, keeping ``gate_up`` only."""
    return clamped_swiglu(gate_up, self.limit, self.alpha)


def _unsupported_clamped(module: nn.Module) -> str | None:
    stock = ORIGINALS.get(type(module), type(module))
    if stock.__dict__.get("_apply_gate") is not _VERIFIED.get(stock):
        return f"{stock.__name__}._apply_gate was changed after slimgrad registered the class; left as stock"
    if not all(isinstance(getattr(module, a, None), (int, float)) for a in ("limit", "alpha")):
        return "its gate's limit and alpha are not numbers"
    return None


def _unsupported(module: nn.Module) -> str | None:
    stock = ORIGINALS.get(type(module), type(module))
    if stock.__dict__.get("_apply_gate") is not _default_apply_gate:
        return f"{stock.__name__}._apply_gate was changed after slimgrad registered the class; left as stock"
    if not getattr(module, "has_gate", True):
        return "its experts have no gate (up -> activation -> down): stock's activation keeps only its input"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up weights are interleaved, not the [gate; up] halves _apply_gate splits"
    if activation_kind(getattr(module, "act_fn", None)) is None:
        act = getattr(module, "act_fn", None)
        return (f"activation {type(act).__module__}.{type(act).__name__} is not one slimgrad reproduces exactly "
                f"(nn.SiLU, nn.GELU, SiLUActivation, GELUActivation, GELUTanh, NewGELUActivation, QuickGELUActivation)")
    if module_hooks(module.act_fn):
        return f"activation {type(module.act_fn).__name__} has hooks, which the fused gated product would skip"
    impl = _implementation(module)
    if impl not in GATE_CALLERS:
        return (f"experts implementation {impl!r} computes act_fn(gate) * up itself (slimgrad's product engages "
                f"through _apply_gate, which {', '.join(GATE_CALLERS)} call; transformers' default is grouped_mm)")
    return None


def _register_experts(cls: type) -> bool:
    if cls in REPLACEMENTS or cls in _REJECTED or _default_apply_gate is None:
        return False
    gate = cls.__dict__.get("_apply_gate")  # set by use_experts_implementation where the class has none
    if gate is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        _REJECTED.add(cls)
        return False
    if gate is _default_apply_gate and _GATE_KNOWN:
        ours, reason, what = _apply_gate, _unsupported, "its gated product keeps gate and up only"
    elif gate is not _default_apply_gate and fingerprint(gate) == _CLAMPED_SWIGLU_GATE:
        ours, reason, what = _clamped_swiglu_gate, _unsupported_clamped, "its clamped SwiGLU keeps its input only"
    else:  # an experts class of the family slimgrad claims, with a gate it does not reproduce: say so
        _REJECTED.add(cls)
        _notices.record_class_gap(cls, library="transformers", family="MoE experts", reason=(
            f"{cls.__name__}._apply_gate (fingerprint {fingerprint(gate)}) is neither transformers' default "
            f"act_fn(gate) * up as slimgrad read it nor GPT-OSS's clamped SwiGLU"))
        return False
    _VERIFIED[cls] = gate
    name = f"Slim{cls.__name__}"
    if name in globals():  # two classes of one name in different model packages
        name = f"{name}_{cls.__module__.rsplit('.', 2)[-2]}"
    replacement = type(name, (cls,), {
        "_apply_gate": ours, "__module__": __name__, "__qualname__": name,
        "__doc__": f"slimgrad's drop-in for {cls.__module__}.{cls.__name__}: {what}.",
        "unsupported_reason": classmethod(lambda c, m, reason=reason: reason(m))})
    register(cls)(replacement)
    globals()[name] = replacement
    return True


def register_loaded() -> list[str]:
    """Register every experts class with transformers' default gate in the modeling modules imported so far;
    returns the names of those newly registered."""
    return [cls.__name__ for _, cls in loaded_transformers_classes() if _register_experts(cls)]


refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert


# No modeling module is imported here (six MoE families took 1-3 s a process): the classes of those the user's
# model code imported are registered now and at every convert (refresh).
register_loaded()
