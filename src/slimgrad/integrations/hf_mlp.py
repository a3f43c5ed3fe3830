"""Hugging Face gated MLPs and Python-formula activations, converted to slimgrad's drop-ins.

Well over a hundred transformers MLP classes share one forward, ``down(act(gate(x)) * up(x))`` (Llama,
Mistral, Qwen2/3, Gemma 1-3, Olmo2, ...), or its fused form ``gate, up = gate_up(x).chunk(2, -1)``
(Phi3, GLM). Their replacement computes the gated product with
:func:`slimgrad.functional.gated.gated_activation`, which keeps ``gate`` and ``up`` but not
``act(gate)``, and calls the projections as modules, so peft LoRA layers, hooks and other converted
modules on them keep working.

A class is registered only when the *source* of its forward (and of its activation's forward) is one of
the known shapes below, compared by fingerprint (:mod:`slimgrad.integrations._fingerprint`: annotations,
comments, layout, argument names and an expression split over two statements do not matter), so a model
family whose MLP does anything else (a clamp, a dropout, a scale) is never converted; a class named like
an MLP whose forward reads gate projections but matches no known shape is recorded as a gap (family
"gated MLP"), so ``convert`` says it is left to transformers. Registration happens when this module is imported (the
common families are imported for that) and for every transformers modeling module loaded at that time;
:func:`register_loaded` rescans for modeling modules imported later.
"""

from __future__ import annotations

import functools
import importlib
import textwrap

from torch import nn

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register, register_forward
from slimgrad.functional.gated import gated_activation
from slimgrad.functional.hf_activations import fused_activation, gelu_new, gelu_python, quick_gelu
from slimgrad.integrations._fingerprint import fingerprint, names_read, source_fingerprint
from slimgrad.integrations._hf_classes import import_modeling, loaded_transformers_classes
from slimgrad.integrations._hooks import global_module_hooks, module_hooks

__all__ = ["activation_kind", "register_loaded"]

#: Modeling modules imported eagerly so their MLPs are registered even when loaded after this module.
CORE_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2", "phi3")


def _canonical(fn) -> str | None:
    """``fn``'s fingerprint (:mod:`slimgrad.integrations._fingerprint`: annotations, comments, layout, the
    argument's name and single-use temporaries aside); None when its source cannot be read."""
    return fingerprint(fn) if fn is not None else None


def _template(body: str) -> str:
    """The fingerprint of a forward body written with argument ``x`` (see :func:`_canonical`)."""
    return source_fingerprint("def forward(self, x):\n" + textwrap.indent(body, "    "))


_SPLIT = ("gate_proj", "up_proj", "down_proj")
_FUSED = ("gate_up_proj", "down_proj")
#: forward fingerprint -> (layout, activation attribute, projection attributes). "split": gate, up, down
#: projections; "fused": one gate_up projection and down.
_MLP_FORWARDS = {
    _template("down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\nreturn down_proj"):
        ("split", "act_fn", _SPLIT),
    _template("return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"): ("split", "act_fn", _SPLIT),
    _template("down_proj = self.activation_fn(self.gate_proj(x)) * self.up_proj(x)\nreturn self.down_proj(down_proj)"):
        ("split", "activation_fn", _SPLIT),
    _template("up_states = self.gate_up_proj(x)\ngate, up_states = up_states.chunk(2, dim=-1)\n"
              "up_states = up_states * self.activation_fn(gate)\nreturn self.down_proj(up_states)"):
        ("fused", "activation_fn", _FUSED),
    # transformers 4.x Mixtral's per-expert MLP (MixtralBlockSparseTop2MLP): w1 the gate, w3 up, w2 down
    _template("current_hidden_states = self.act_fn(self.w1(x)) * self.w3(x)\n"
              "current_hidden_states = self.w2(current_hidden_states)\nreturn current_hidden_states"):
        ("split", "act_fn", ("w1", "w3", "w2")),
}
#: the projection attributes every known forward reads last (a cheap first test, see _register_mlp)
_DOWN_NAMES = frozenset(layout[2][-1] for layout in _MLP_FORWARDS.values())

_TANH_PY = "return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))"
#: activation class name -> {method name: canonical source} that must all hold for the class to be trusted.
_ACT_SOURCES = {
    "SiLUActivation": {"forward": _template("return nn.functional.silu(x)")},
    "GELUActivation": {"forward": _template("return self.act(x)"),
                       "_gelu_python": _template("return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))")},
    "GELUTanh": {"forward": _template("return self.act(x)"), "_gelu_tanh_python": _template(_TANH_PY)},
    "NewGELUActivation": {"forward": _template(
        "return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))")},
    "QuickGELUActivation": {"forward": _template("return x * torch.sigmoid(1.702 * x)")},
}

#: stock class -> its forward as verified (a later monkey-patch makes the class unsupported)
_VERIFIED: dict[type, object] = {}
#: activation name in transformers.activations -> the verified class
_ACT_CLASSES: dict[str, type] = {}
#: stock MLP class -> (layout, activation attribute, projection attributes)
_MLP_LAYOUT: dict[type, tuple[str, str, tuple[str, ...]]] = {}


def _act_class(act: nn.Module, name: str) -> bool:
    cls = _ACT_CLASSES.get(name)
    return cls is not None and ORIGINALS.get(type(act), type(act)) is cls and _VERIFIED.get(cls) is cls.forward


def activation_kind(act) -> str | None:
    """The :data:`~slimgrad.functional.gated.ACTIVATIONS` name that reproduces module ``act`` exactly, or
    None when slimgrad cannot (unknown type, a changed forward)."""
    kind = ORIGINALS.get(type(act), type(act))
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}.get(act.approximate)
    if _act_class(act, "SiLUActivation"):
        return "silu"
    if _act_class(act, "NewGELUActivation"):
        return "gelu_new"
    if _act_class(act, "QuickGELUActivation"):
        return "quick_gelu"
    inner = act.__dict__.get("act")
    if _act_class(act, "GELUActivation"):
        if inner is nn.functional.gelu:
            return "gelu"
        if getattr(inner, "__func__", None) is _ACT_CLASSES["GELUActivation"]._gelu_python:
            return "gelu_python"
    if _act_class(act, "GELUTanh"):
        if (isinstance(inner, functools.partial) and inner.func is nn.functional.gelu and not inner.args
                and inner.keywords == {"approximate": "tanh"}):
            return "gelu_pytorch_tanh"
        if getattr(inner, "__func__", None) is _ACT_CLASSES["GELUTanh"]._gelu_tanh_python:
            return "gelu_new"
    return None


def _mlp_reason(module: nn.Module) -> str | None:
    stock = type(module)
    if _VERIFIED.get(stock) is not stock.forward:
        return f"{stock.__name__}.forward was changed after slimgrad verified its source; left as stock"
    act = getattr(module, _MLP_LAYOUT[stock][1], None)
    if activation_kind(act) is None:
        return (f"activation {type(act).__module__}.{type(act).__name__} is not one slimgrad reproduces "
                f"exactly (nn.SiLU, nn.GELU, SiLUActivation, GELUActivation, GELUTanh, NewGELUActivation, "
                f"QuickGELUActivation)")
    if module_hooks(act):
        return f"activation {type(act).__name__} has hooks, which the fused gated product would skip"
    return None


def _mlp_kept_children(module: nn.Module) -> list[nn.Module]:
    """Where convert leaves a verified gated MLP as stock for its activation (one slimgrad cannot fuse exactly, or a
    hooked one), stock's ``act(gate) * up`` keeps the activation's output for up's gradient: the activation module
    stays stock too (converted, a ReLU would keep its 1-bit mask on top of that output, and the stock product never
    reports keeping it)."""
    stock = type(module)
    if _VERIFIED.get(stock) is not stock.forward:
        return []
    act = getattr(module, _MLP_LAYOUT[stock][1], None)
    return [act] if isinstance(act, nn.Module) else []


def _runtime_kind(self, act_attr: str) -> str | None:
    act = getattr(self, act_attr)
    if module_hooks(act) or global_module_hooks():
        return None
    return activation_kind(act)


def _gated(self, gate, up, act_attr, kind):
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return getattr(self, act_attr)(gate) * up  # stock's expression, for projections of mixed types
    return gated_activation(gate, up, kind)


def _split_forward(self, x):
    _, act_attr, (gate, up, down) = _MLP_LAYOUT[ORIGINALS[type(self)]]
    kind = _runtime_kind(self, act_attr)
    if kind is None:  # activation swapped or hooked since conversion: run stock's forward
        return _VERIFIED[ORIGINALS[type(self)]](self, x)
    return getattr(self, down)(_gated(self, getattr(self, gate)(x), getattr(self, up)(x), act_attr, kind))


def _fused_forward(self, x):
    _, act_attr, (gate_up, down) = _MLP_LAYOUT[ORIGINALS[type(self)]]
    kind = _runtime_kind(self, act_attr)
    if kind is None:
        return _VERIFIED[ORIGINALS[type(self)]](self, x)
    gate, up = getattr(self, gate_up)(x).chunk(2, dim=-1)
    return getattr(self, down)(_gated(self, gate, up, act_attr, kind))


def _unique_register(stock: type, forward, reason) -> type:
    """``register_forward``, except that two stock classes of one name in different model packages get
    distinct replacement names, so each can be found (and pickled) under its own name."""
    name = f"Slim{stock.__name__}"
    existing = globals().get(name)
    if existing is None or ORIGINALS.get(existing) is stock:
        return register_forward(stock, forward, module=__name__, unsupported_reason=reason)
    package = stock.__module__.rsplit(".", 2)[-2]
    name = f"{name}_{package}"
    cls = type(name, (stock,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                 "__doc__": f"slimgrad's drop-in for {stock.__module__}.{stock.__name__}.",
                                 "unsupported_reason": classmethod(lambda c, m: reason(m))})
    register(stock)(cls)
    globals()[name] = cls
    return cls


_REJECTED: set[type] = set()  # classes whose forward source was already read and matched no known MLP


def _looks_gated(cls: type, names: frozenset[str]) -> bool:
    """Named like an MLP and reading a gate projection (``names``: what its forward's code reads): a class
    of the family slimgrad claims."""
    return "MLP" in cls.__name__ and bool(names & {"gate_proj", "gate_up_proj"})


def _register_mlp(cls: type) -> bool:
    if cls in REPLACEMENTS or cls in _REJECTED or not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return False
    if "forward" not in cls.__dict__:
        return False
    # every known forward reads its down projection (self.down_proj, self.w2): a cheap test (the names the code
    # object reads) spares fingerprinting the hundreds of other classes of the modeling modules
    names = names_read(cls.forward)
    fp = _canonical(cls.forward) if names & _DOWN_NAMES else None
    layout = _MLP_FORWARDS.get(fp)
    if layout is None:
        _REJECTED.add(cls)
        if _looks_gated(cls, names):
            fp = fp or _canonical(cls.forward)
            _notices.record_class_gap(cls, library="transformers", family="gated MLP", reason=(
                f"{cls.__name__}.forward (fingerprint {fp}) is not a gated-MLP forward slimgrad reproduces "
                f"(down(act(gate(x)) * up(x)), or gate, up = gate_up(x).chunk(2))"))
        return False
    _VERIFIED[cls] = cls.forward
    _MLP_LAYOUT[cls] = layout
    replacement = _unique_register(cls, _split_forward if layout[0] == "split" else _fused_forward, _mlp_reason)
    replacement.kept_children = staticmethod(_mlp_kept_children)
    return True


def _act_reason(module: nn.Module) -> str | None:
    stock = type(module)
    if _VERIFIED.get(stock) is not stock.forward:
        return f"{stock.__name__}.forward was changed after slimgrad verified its source; left as stock"
    return None


def _new_gelu_forward(self, input):
    return gelu_new(input)


def _quick_gelu_forward(self, input):
    return quick_gelu(input)


def _gelu_tanh_forward(self, input):
    kind = activation_kind(self)
    if kind == "gelu_new":  # use_gelu_tanh_python=True: the Python formula
        return gelu_new(input)
    if kind == "gelu_pytorch_tanh":  # stock's op, or its input kept narrower in QLoRA (fused_activation)
        return fused_activation(input, kind)
    return self.act(input)


def _gelu_forward(self, input):
    kind = activation_kind(self)
    if kind == "gelu_python":
        return gelu_python(input)
    if kind == "gelu":
        return fused_activation(input, kind)
    return self.act(input)


_ACT_FORWARDS = {"NewGELUActivation": _new_gelu_forward, "QuickGELUActivation": _quick_gelu_forward,
                 "GELUTanh": _gelu_tanh_forward, "GELUActivation": _gelu_forward}


def _register_activations() -> None:
    acts = importlib.import_module("transformers.activations")
    for name, sources in _ACT_SOURCES.items():
        cls = getattr(acts, name, None)
        if cls is None or name in _ACT_CLASSES:
            continue
        if all(_canonical(getattr(cls, meth, None)) == src for meth, src in sources.items()):
            _ACT_CLASSES[name] = cls
            _VERIFIED[cls] = cls.forward
            # SiLUActivation is F.silu already: stock keeps only the input, nothing to gain by converting.
            if name in _ACT_FORWARDS:
                _unique_register(cls, _ACT_FORWARDS[name], _act_reason)


def register_loaded() -> list[str]:
    """Register every MLP class with a known forward in the transformers modeling modules imported so
    far; returns the names of those newly registered."""
    added = []
    for _, cls in loaded_transformers_classes():
        if _register_mlp(cls):
            added.append(cls.__name__)
    return added


refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert


def _load() -> None:
    _register_activations()
    import_modeling(CORE_MODELS)
    register_loaded()


_load()
