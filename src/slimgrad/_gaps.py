"""Which modules of a family slimgrad claims a conversion left as stock: the gaps ``convert`` warns about.

Why this exists: when an upstream release edits a forward slimgrad recognised (or an integration fails to
import), the replacement simply stops engaging. The module then runs as stock: the same numbers and more
memory, which nobody notices. ``convert`` therefore looks, in the model it converts, for modules of the
families the README claims (RMSNorms, gated MLPs, peft LoRA layers, bitsandbytes linears, diffusers
activations) that stay stock, and for the gaps the integrations recorded (:mod:`slimgrad._notices`), and
says so once per (class, reason).

Families are recognised by what any release would keep (a class name ending in ``RMSNorm``, a module with
``gate_proj``/``up_proj``/``down_proj`` children, an instance of peft's ``LoraLayer``), never by importing a
library the user did not import: the library classes are read from ``sys.modules`` only.
"""

from __future__ import annotations

import functools
import sys
import weakref

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from ._notices import Gap, class_gap, integration_gaps, library_version, notify
from ._registry import ORIGINALS

__all__ = ["CHUNKED_LOSS", "claimed_family", "family_gap", "library_of", "libraries_used", "model_gap", "module_gap",
           "remember_converted"]

#: the family name integrations record chunked-loss head gaps under; such a gap concerns only
#: ``convert(chunked_loss=True)``
CHUNKED_LOSS = "chunked_loss"

# (w1 gate, w3 up, w2 down: Meta's reference FeedForward, torchtune's, transformers 4.x Mixtral's experts)
_GATED_CHILDREN = ({"gate_proj", "up_proj", "down_proj"}, {"gate_up_proj", "down_proj"}, {"w1", "w2", "w3"})
#: classes of a claimed library that stock already runs minimally (not a gap when left as stock)
_NOT_GAPS = ("peft.tuners.lora.layer.Embedding",)


def _classes(module_name: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module_name`` if that module is already imported (never imports it)."""
    module = sys.modules.get(module_name)
    found = (getattr(module, n, None) for n in names) if module is not None else ()
    return tuple(c for c in found if isinstance(c, type))


def claimed_family(module: nn.Module) -> str | None:
    """The family slimgrad claims ``module`` belongs to ("RMSNorm", "gated MLP", "LoRA layer", ...), or None."""
    kind = type(module)
    if f"{kind.__module__}.{kind.__qualname__}" in _NOT_GAPS:
        return None
    lora = _classes("peft.tuners.lora.layer", "LoraLayer")
    if lora and isinstance(module, lora):
        return "LoRA layer"
    name = kind.__name__
    if name.endswith("RMSNorm") or name == "T5LayerNorm":
        return "RMSNorm"
    children = module._modules.keys()
    if any(names <= children for names in _GATED_CHILDREN):
        return "gated MLP"
    bnb = _classes("bitsandbytes.nn.modules", "Linear4bit", "Linear8bitLt")
    if bnb and isinstance(module, bnb):
        return "bitsandbytes linear"
    diffusers = _classes("diffusers.models.activations", "GEGLU", "SwiGLU", "ApproximateGELU")
    if diffusers and isinstance(module, diffusers):
        return "diffusers activation"
    return None


def library_of(kind: type) -> tuple[str, str]:
    """(top-level package, installed version) of the code defining ``kind``; "local code" for a class of a
    script or of a package that is not installed (``__main__``, transformers' remote code)."""
    library = kind.__module__.split(".")[0]
    return library, _version(library)


@functools.cache
def _version(library: str) -> str:
    """Cached: reading installed metadata costs milliseconds, and a model holds dozens of modules of a class."""
    version = library_version(library)
    return "local code" if version == "not installed" else version


def libraries_used(model: nn.Module) -> set[str]:
    """The top-level packages whose module classes occur in ``model``."""
    return {type(m).__module__.split(".")[0] for m in model.modules()}


def family_gap(kind: type, family: str, reason: str) -> Gap:
    """A :class:`Gap` for class ``kind`` of ``family``, with its library and version."""
    library, version = library_of(kind)
    return Gap(library, version, f"{kind.__module__}.{kind.__qualname__}", family, reason)


def module_gap(module: nn.Module, *, chunked_loss: bool, disabled: set[str]) -> Gap | None:
    """Why ``module`` (of a type slimgrad has no replacement for) is a gap, or None when it is not one.

    A class an integration recorded a gap for is one (chunked-loss heads only when ``chunked_loss``); so is
    a module of a claimed family, unless the integration of its library is disabled (``disabled``: that
    library's integration gap already explains it).
    """
    kind = type(module)
    recorded = class_gap(kind)
    if recorded is not None:
        return recorded if chunked_loss or recorded.family != CHUNKED_LOSS else None
    family = claimed_family(module)
    if family is None or library_of(kind)[0] in disabled:
        return None
    return family_gap(kind, family, "slimgrad has no replacement registered for this class (no integration "
                                    "recognised its forward), so it runs as stock and keeps what stock keeps")


def model_gap(model: nn.Module) -> tuple[list[Gap], set[str]]:
    """The integration gaps of libraries ``model`` uses, and the set of those libraries."""
    used = libraries_used(model)
    gaps = [g for g in integration_gaps() if g.library in used]
    return gaps, {g.library for g in gaps}


# -- LoRA layers added to a model after it was converted ------------------------------------------------------

#: modules of models ``convert`` returned (only while peft is imported): peft injecting a LoRA layer into one
#: of them means the user converted before ``get_peft_model``
_CONVERTED: weakref.WeakSet = weakref.WeakSet()
_HOOK = None
_LATE_LORA = ("added by peft after slimgrad.convert (get_peft_model, add_adapter or load_adapter on a converted "
              "model): LoRA layers added later run as stock; call slimgrad.convert(model, inplace=True) again after "
              "adding them (SlimgradCallback converts at train begin)")


def remember_converted(model: nn.Module) -> None:
    """Watch ``model``'s modules for LoRA layers peft adds later, if peft is imported (else nothing to do).

    torch's global module-registration hook sees every ``parent.child = module`` in the process, so it is
    installed once, only with peft imported, and does one string test for modules that are not peft's.
    """
    global _HOOK
    if "peft" not in sys.modules:
        return
    for module in model.modules():
        _CONVERTED.add(module)
    if _HOOK is None:
        _HOOK = register_module_module_registration_hook(_on_registration)


def _on_registration(parent: nn.Module, name: str, child):
    if child is None or not type(child).__module__.startswith("peft."):
        return None
    lora = _classes("peft.tuners.lora.layer", "LoraLayer")
    if lora and isinstance(child, lora) and type(child) not in ORIGINALS and parent in _CONVERTED:
        notify(family_gap(type(child), "LoRA layer", _LATE_LORA), stacklevel=4)
    return None
