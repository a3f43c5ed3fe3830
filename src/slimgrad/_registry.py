"""The converter's registry: exact stock module type -> slimgrad replacement class.

Each replacement subclasses the stock class and overrides ``forward`` only, so converting a module is a
class swap (``module.__class__ = Replacement``): parameters, buffers, hooks and attributes stay where they
are, ``isinstance`` still holds, and reverting swaps the class back.

A replacement's ``forward`` also keeps the stock forward's signature (:func:`_keep_signature`): code that
reads it, such as ``transformers.Trainer`` dropping the dataset columns ``model.forward`` does not name,
must see the same parameters after conversion as before.
"""

from __future__ import annotations

import copyreg
import inspect
import sys
import types
from collections.abc import Callable

import torch
import torch.fx._symbolic_trace
from torch import nn

#: stock type -> slimgrad type
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {}


class _Originals(dict):
    """slimgrad type -> stock type; a class derived from a slimgrad type by a wrapper that re-classes the module it
    wraps (FSDP2's ``fully_shard`` makes ``FSDP<cls>``, a subclass of the module's class) answers as that slimgrad
    type, so converted forwards that look their stock class up (``ORIGINALS[type(self)]``) keep working, and convert
    and revert know the module as converted. Exact keys are plain dictionary hits (the forwards' case)."""

    def __init__(self):
        super().__init__()
        self._derived = {}  # derived class -> its slimgrad base's stock type, or None (a cache)

    def _via_base(self, cls):
        if cls in self._derived:
            return self._derived[cls]
        found = next((dict.__getitem__(self, base) for base in getattr(cls, "__mro__", ())[1:]
                      if dict.__contains__(self, base)), None)
        self._derived[cls] = found
        return found

    def __missing__(self, cls):
        stock = self._via_base(cls)
        if stock is None:
            raise KeyError(cls)
        return stock

    def get(self, cls, default=None):
        if dict.__contains__(self, cls):
            return dict.__getitem__(self, cls)
        stock = self._via_base(cls)
        return default if stock is None else stock

    def __contains__(self, cls):
        return dict.__contains__(self, cls) or self._via_base(cls) is not None

    def __setitem__(self, cls, stock):
        self._derived.clear()  # (a new key may be the base of a class cached as unknown)
        dict.__setitem__(self, cls, stock)


#: slimgrad type -> stock type (and classes derived from a slimgrad type by wrappers: _Originals)
ORIGINALS: dict[type[nn.Module], type[nn.Module]] = _Originals()


def replacement_base(cls: type) -> type | None:
    """The slimgrad type ``cls`` is or derives from (a wrapper's class such as FSDP2's ``FSDP<cls>``), or None."""
    return next((base for base in getattr(cls, "__mro__", ()) if dict.__contains__(ORIGINALS, base)), None)


_REBASED: dict = {}  # (wrapper class, old base, new base) -> the rebuilt class


def rebased(cls: type, old: type, new: type) -> type:
    """A wrapper's class derived from ``old`` (FSDP2's ``FSDP<cls>``: bases ``(FSDPModule, cls)``), rebuilt on
    ``new`` instead: what reverting (slimgrad -> stock) a module that a wrapper re-classed after convert gives it, so
    that it stays wrapped. One class per (class, old, new), shared by its modules."""
    key = (cls, old, new)
    if key not in _REBASED:
        namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        _REBASED[key] = type(cls.__name__, tuple(new if b is old else b for b in cls.__bases__), namespace)
    return _REBASED[key]


def wrapped_stock(cls: type) -> type | None:
    """The class FSDP2's ``fully_shard`` wrapped, where ``cls`` is the one it re-classed a sharded module as
    (``FSDP<cls>(FSDPModule, cls)``); else None."""
    bases = cls.__bases__
    if len(bases) != 2 or bases[0].__name__ != "FSDPModule":
        return None
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return bases[1] if fsdp is not None and bases[0] is getattr(fsdp, "FSDPModule", None) else None


#: stock type -> name of the ``convert`` option that must be True for it to be replaced
OPTIONS: dict[type[nn.Module], str] = {}


def reports_only(replacement: type) -> bool:
    """Whether a replacement runs stock's ops and keeps stock's bytes, only telling the layer before it what it keeps
    (nn.Linear's, slimgrad/nn/linear.py): counted as stock in reports, and it claims no family."""
    return getattr(replacement, "reports_only", False)


def changes_what_is_kept(kind: type) -> bool:
    """Whether ``kind`` is a slimgrad replacement that keeps other tensors than stock's (every one but those that
    only report); what reports count as slimgrad modules."""
    return kind in ORIGINALS and not reports_only(kind)


def register(stock: type[nn.Module], *, option: str | None = None):
    """Class decorator: make ``cls`` the replacement for modules whose type is exactly ``stock``.

    ``cls`` must subclass ``stock`` and add no state of its own. It may define a classmethod
    ``unsupported_reason(module) -> str | None``; a non-None reason makes the converter leave that module
    alone and report why. With ``option="name"``, only ``convert(..., name=True)`` swaps it in (for
    replacements that change a documented contract, such as returning the loss without logits).
    """

    def decorate(cls):
        if not issubclass(cls, stock):
            raise TypeError(f"{cls.__name__} must subclass {stock.__name__} to replace it")
        if stock in REPLACEMENTS:
            raise ValueError(f"{stock.__name__} already has a replacement: {REPLACEMENTS[stock].__name__}")
        _keep_signature(cls, stock)
        _stock_when_traced(cls, stock)
        _stock_facade(cls, stock)
        # stock's name, as torch.nn's replacements have it (``type(m).__name__`` is how tools find classes:
        # accelerate's get_module_class_from_name for FSDP's wrap policy found LlamaRMSNorm before convert and nothing
        # after); the qualified name stays the class's own (``Slim<Stock>``), the one pickling looks up
        cls.__name__ = stock.__name__
        REPLACEMENTS[stock] = cls
        ORIGINALS[cls] = stock
        if option is not None:
            OPTIONS[stock] = option
        return cls

    return decorate


#: members :func:`_stock_facade` adds to every replacement class besides its ``forward``
FACADE = ("_get_name", "__prepare_scriptable__", "_slow_forward")


def _stock_facade(cls, stock) -> None:
    """What a replacement shows the outside besides its forward: stock's name in reprs, and clear errors
    from TorchScript.

    ``print(model)`` names every module by ``_get_name()``: a converted peft layer printed ``lora.SlimLinear``
    where users and tools (peft's own tests) read ``lora.Linear``, so a replacement reports the stock name.
    ``torch.jit.script`` and ``torch.jit.trace`` cannot run slimgrad's forwards (custom autograd Functions,
    eager-only bookkeeping) and failed deep inside TorchScript; both now stop at the first converted module
    with an error naming slimgrad and ``slimgrad.revert``. Script calls ``__prepare_scriptable__`` on every
    module first; trace sends every module call through ``_slow_forward`` (``nn.Module`` only does that
    while tracing), so neither costs an eager call anything.
    """
    if "_get_name" not in cls.__dict__ and stock._get_name is nn.Module._get_name:
        name = stock.__name__
        cls._get_name = lambda self: name
    what = f"{stock.__module__}.{stock.__qualname__}"

    def refuse(verb: str, name: str):
        def method(self, *args, **kwargs):
            raise RuntimeError(
                f"slimgrad: torch.jit.{verb} cannot run slimgrad's replacement for {what} (custom autograd "
                f"Functions and eager-only code); call slimgrad.revert(model) first (same parameters, stock "
                f"classes), {verb} the reverted model, and slimgrad.convert it again to train (torch.compile "
                f"runs converted models)")
        method.__name__ = name
        return method

    if "__prepare_scriptable__" not in cls.__dict__:
        cls.__prepare_scriptable__ = refuse("script", "__prepare_scriptable__")
    if "_slow_forward" not in cls.__dict__:
        cls._slow_forward = refuse("trace", "_slow_forward")


def _stock_when_traced(cls, stock) -> None:
    """Make ``cls.forward`` run the stock forward under ``torch.export``, and answer ``torch.fx.symbolic_trace``.

    An exported graph is the model to run elsewhere (inference, a quantizer), where what slimgrad keeps for backward
    is beside the point; and export failed on slimgrad's forwards: strict export traced the autograd Functions without
    their backward (the exported module gave no gradients, silently), non-strict export put the ReLU masks' packing
    into the inference graph (2.1x stock's time). Symbolic tracing (Proxies for tensors) stopped at the first branch
    on ``requires_grad`` with fx's "symbolically traced variables cannot be used as inputs to control flow": where
    the stock class is one fx traces into (a transformers norm or MLP: transformers' own fx tracer), the stock forward
    gives stock's graph; a torch.nn layer is a leaf to fx, which a replacement cannot be (fx goes by the class's
    module), so that raises an error naming slimgrad and ``revert``.

    Eager forward-mode AD (``torch.autograd.forward_ad.dual_level``: JVP penalties, consistency models) runs the stock
    forward as well: slimgrad's Functions define no ``jvp`` (their forwards are stock's ops; a dual input raised
    "jvp is not implemented" where stock ran), and inside a dual level the stock forward is what gives stock's
    tangents. The check is three flag reads an eager call (~0.1 us); torch.compile, torch.func and make_fx keep
    slimgrad's forward.
    """
    own = cls.__dict__.get("forward")
    stock_forward = getattr(stock, "forward", None)
    if not inspect.isfunction(own) or not callable(stock_forward):
        return
    exporting, fx, forward_ad = torch.compiler.is_exporting, torch.fx._symbolic_trace, torch.autograd.forward_ad
    leaf_to_fx = stock.__module__.startswith(("torch.nn.", "torch.ao.nn."))
    what = f"{stock.__module__}.{stock.__qualname__}"

    def forward(self, *args, **kwargs):
        if fx._is_fx_tracing_flag or exporting() or forward_ad._current_level >= 0:
            if exporting() or forward_ad._current_level >= 0:
                return stock_forward(self, *args, **kwargs)
            if any(isinstance(a, torch.fx.Proxy) for a in (*args, *kwargs.values())):
                if leaf_to_fx:
                    raise RuntimeError(
                        f"slimgrad: torch.fx.symbolic_trace cannot trace slimgrad's replacement for {what}: fx "
                        f"keeps torch.nn's layers as leaves by their class, which a converted layer no longer has; "
                        f"call slimgrad.revert(model) first (same parameters, stock classes), trace the reverted "
                        f"model, and slimgrad.convert the traced GraphModule to train (torch.compile and "
                        f"torch.export run converted models)")
                return stock_forward(self, *args, **kwargs)
        return own(self, *args, **kwargs)

    forward.__name__, forward.__qualname__ = own.__name__, own.__qualname__
    forward.__module__, forward.__doc__ = own.__module__, own.__doc__
    forward.__signature__ = inspect.signature(own)
    forward.__dict__.update(own.__dict__)
    type.__setattr__(cls, "forward", forward)


def _plain(signature: inspect.Signature) -> list[tuple]:
    """A signature's parameters without annotations: what calls can bind to."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def _renames(cls, stock, have: inspect.Signature, want: inspect.Signature) -> dict[str, str]:
    """{stock parameter name: replacement parameter name} for keyword calls written against the stock
    forward; raises when the replacement could not accept every call the stock forward accepts."""
    plain_have, plain_want = _plain(have), _plain(want)
    variadic = [k for _, k, _ in plain_have[1:]] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    if plain_have == plain_want or variadic:  # same parameters, or one that takes anything and binds itself
        return {}
    same_shape = len(plain_have) == len(plain_want) and all(
        (h[1], h[2]) == (w[1], w[2]) for h, w in zip(plain_have, plain_want))
    if not same_shape:
        raise TypeError(f"slimgrad: {cls.__name__}.forward{have} cannot replace {stock.__module__}."
                        f"{stock.__name__}.forward{want}: a replacement's forward must take the stock "
                        f"forward's parameters (same kinds and defaults, in the same order)")
    return {w[0]: h[0] for h, w in zip(plain_have, plain_want) if h[0] != w[0]}


def _keep_signature(cls, stock) -> None:
    """Give ``cls.forward`` exactly the stock forward's signature (``inspect.signature`` equal).

    The replacement's function is copied (it may be shared by many classes) and gets the stock signature
    as ``__signature__``; where only parameter names differ (a shared forward written as ``hidden_states``
    replacing a stock ``forward(self, x)``), keyword arguments are renamed on the way in, so ``norm(x=t)``
    works as it did on the stock module. Positional calls pass straight through.
    """
    forward = cls.__dict__.get("forward")
    if not inspect.isfunction(forward):
        return  # inherits the stock forward (or something exotic we leave alone)
    try:
        want = inspect.signature(stock.forward)
        have = inspect.signature(forward)
    except (TypeError, ValueError):
        return
    if have == want:
        return
    renames = _renames(cls, stock, have, want)
    if renames:
        own_names = set(renames.values()) - set(want.parameters)  # names only the replacement would take

        def adopted(self, *args, **kwargs):
            if kwargs:
                wrong = own_names.intersection(kwargs)
                if wrong:
                    raise TypeError(f"{stock.__name__}.forward() got an unexpected keyword argument "
                                    f"{sorted(wrong)[0]!r} (slimgrad's replacement takes the stock parameters)")
                kwargs = {renames.get(k, k): v for k, v in kwargs.items()}
            return forward(self, *args, **kwargs)
    else:
        adopted = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__,
                                     forward.__closure__)
        adopted.__kwdefaults__ = forward.__kwdefaults__
        adopted.__dict__.update(forward.__dict__)
    adopted.__name__, adopted.__qualname__ = "forward", f"{cls.__qualname__}.forward"
    adopted.__module__, adopted.__doc__ = forward.__module__, forward.__doc__
    adopted.__signature__ = want
    type.__setattr__(cls, "forward", adopted)


def register_forward(stock: type[nn.Module], forward: Callable, *, module: str,
                     unsupported_reason: Callable | None = None, option: str | None = None) -> type[nn.Module]:
    """Build and register a replacement for ``stock`` whose only change is ``forward``.

    For families with many stock classes that share one forward (every Hugging Face RMSNorm, say). The
    class's qualified name is ``Slim<Stock>`` (its ``__name__`` is stock's: :func:`register`), published in
    ``module``'s namespace under it so pickling finds it.
    ``unsupported_reason(module) -> str | None`` as for :func:`register`. Registering a stock class twice
    returns the existing replacement.
    """
    if stock in REPLACEMENTS:
        return REPLACEMENTS[stock]
    attrs = {"forward": forward, "__module__": module, "__qualname__": f"Slim{stock.__name__}",
             "__doc__": f"slimgrad's drop-in for {stock.__module__}.{stock.__name__} (forward only)."}
    if unsupported_reason is not None:
        attrs["unsupported_reason"] = classmethod(lambda cls, m: unsupported_reason(m))
    attrs["__reduce_ex__"] = _reduce_by_stock
    cls = type(f"Slim{stock.__name__}", (stock,), attrs)
    register(stock, option=option)(cls)
    setattr(sys.modules[module], cls.__qualname__, cls)
    return cls


def _reduce_by_stock(self, protocol):
    """Pickle a module of a built replacement by its stock class. The ``Slim<Stock>`` classes exist only once their
    integration has seen the stock class's modeling module: a process that had already converted (or loaded)
    something else, or a layer saved on its own, could not load a converted Hugging Face norm or MLP ("Can't get
    attribute 'SlimQwen2RMSNorm'"), where the stock model loads. The stock class imports its own module, and
    :func:`_rebuild_converted` finds the replacement then."""
    reduced = super(type(self), self).__reduce_ex__(protocol)
    stock = ORIGINALS.get(type(self))
    if (stock is None or not isinstance(reduced, tuple) or len(reduced) < 2 or reduced[0] is not copyreg.__newobj__
            or reduced[1][0] is not type(self)):
        return reduced  # (a class rebuilt on this one, FSDP2's, or protocol 0/1: pickled as torch pickles it)
    return (_rebuild_converted, (stock, *reduced[1][1:]), *reduced[2:])


def _rebuild_converted(stock: type, *args):
    """Unpickling: an instance of ``stock``'s replacement (registered now if its integration had not yet seen
    ``stock``); stock's class where no integration converts it here (a newer transformers edited it)."""
    from .integrations import load_available

    if stock not in REPLACEMENTS:
        load_available()
    kind = REPLACEMENTS.get(stock, stock)
    return kind.__new__(kind, *args)


# -- subclasses that change nothing a call computes -----------------------------------------------------------
#
# Matching is on the exact type, because a subclass may compute something else. Some subclasses provably do not:
# they add an ``__init__`` (and perhaps ``reset_parameters`` or ``extra_repr``) and nothing else, so every call
# runs the stock class's forward on the stock class's attributes (transformers' EfficientNetDepthwiseConv2d and
# AlignVisionDepthwiseConv2d, a Conv2d built with depthwise arguments; PoolFormerGroupNorm; a user's
# ``class MyConv(nn.Conv2d)`` that only sets up its weights). Such a subclass gets a twin: a class deriving from
# slimgrad's replacement and from the subclass (``isinstance`` holds for both, its ``print`` name is the
# subclass's), registered as the subclass's replacement, and reverted to the subclass.

#: what a class may define and still change nothing a call computes (set-up, printing, class bookkeeping)
_INIT_ONLY = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
                        "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__",
                        "__init__", "reset_parameters", "extra_repr", "__constants__",
                        "__abstractmethods__", "_abc_impl"})  # (abc's bookkeeping: peft's torchao LoRA layer)
_TWIN_PREFIX = "SubclassTwin_S"


def defined_beyond_init(kind: type, stock: type) -> list[str]:
    """The members that ``kind``'s classes between it and ``stock`` define besides set-up and printing."""
    own = [c for c in kind.__mro__ if c not in stock.__mro__]
    return sorted({name for c in own for name in c.__dict__ if name not in _INIT_ONLY})


def _torch_family(stock: type) -> bool:
    """Whether slimgrad replaces ``stock`` with one of the torch.nn families (slimgrad/nn/)."""
    return stock in REPLACEMENTS and REPLACEMENTS[stock].__module__.startswith("slimgrad.nn.")


def init_only_stock(kind: type) -> type | None:
    """The stock type ``kind`` subclasses adding only set-up, where slimgrad's replacement of it is one of the
    torch families (whose forwards read the module's attributes only, never its exact type); else None."""
    if type(kind) is not type:  # a metaclass can change how attributes resolve
        return None
    stock = next((b for b in kind.__mro__[1:] if _torch_family(b)), None)
    if stock is None or stock in OPTIONS:
        return None
    return None if defined_beyond_init(kind, stock) else stock


def delegating_stock(kind: type) -> type | None:
    """The stock type ``kind`` subclasses directly with a ``forward`` of its own (and set-up), where slimgrad replaces
    that stock type with one of the torch families; else None.

    Such a forward may pad, chunk or concatenate around the computation, but whatever it hands ``super().forward``
    is computed by the base's forward, which a twin placed between ``kind`` and the stock type makes slimgrad's (the
    video VAEs' causal Conv3d: Wan, QwenImage, Cosmos, EasyAnimate; CogVideoX's chunking Conv3d; streaming audio
    encoders' causal Conv1d). Anything else the forward calls (``self._conv_forward``, ``F.conv3d``) stays stock's:
    numbers and bytes as stock's there. A class between ``kind`` and the stock type would be a forward slimgrad has
    not seen: only direct subclasses qualify."""
    if type(kind) is not type or len(kind.__bases__) != 1:
        return None
    stock = kind.__bases__[0]
    if not _torch_family(stock) or stock in OPTIONS or reports_only(REPLACEMENTS[stock]):
        return None  # (nn.Linear's replacement keeps stock's bytes: nothing to gain, and not reported)
    if defined_beyond_init(kind, stock) != ["forward"]:
        return None
    names = _names_read(getattr(kind.forward, "__code__", None))
    return stock if "super" in names and "forward" in names else None  # (it reaches the base's forward at all)


def _names_read(code) -> set[str]:
    """The global and attribute names a code object and the functions nested in it read."""
    if code is None:
        return set()
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_read(const)
    return names


def _twin_name(kind: type) -> str:
    """A name pickle can find the twin by (in this module, see ``__getattr__``): the subclass's module and
    qualified name, with ``_`` written ``_U`` and ``.`` written ``_D``, joined by ``_S``."""
    def enc(s: str) -> str:
        return s.replace("_", "_U").replace(".", "_D")

    return f"{_TWIN_PREFIX}{enc(kind.__module__)}_S{enc(kind.__qualname__)}"


def subclass_twin(kind: type) -> type | None:
    """The replacement for ``kind`` when it is a subclass that adds only set-up to a stock type slimgrad
    replaces (built and registered on first use); None otherwise."""
    twin = REPLACEMENTS.get(kind)
    if twin is not None:
        return twin
    name = _twin_name(kind)
    stock = init_only_stock(kind)
    if stock is not None:
        twin = type(kind.__name__, (REPLACEMENTS[stock], kind), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"slimgrad's drop-in for {kind.__module__}.{kind.__qualname__}, which adds only set-up to "
                       f"{stock.__module__}.{stock.__name__}: {REPLACEMENTS[stock].__name__}'s forward."})
    elif (stock := delegating_stock(kind)) is not None:
        # kind's forward first; its super().forward reaches slimgrad's replacement, then the stock class
        twin = type(kind.__name__, (kind, REPLACEMENTS[stock]), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"slimgrad's drop-in for {kind.__module__}.{kind.__qualname__}: its own forward, whose "
                       f"super().forward is {REPLACEMENTS[stock].__name__}'s."})
    else:
        return None
    register(kind)(twin)
    globals()[name] = twin
    return twin


def __getattr__(name: str):
    """Unpickling a converted model in a new process: rebuild the twin its name stands for."""
    if not name.startswith(_TWIN_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import re

    def dec(s: str) -> str:  # (_twin_name's encoding: every "_" there is followed by U, D or the separator's S)
        return re.sub("_([UD])", lambda m: "_" if m[1] == "U" else ".", s)

    module_part, _, qual_part = name[len(_TWIN_PREFIX):].partition("_S")
    kind = importlib.import_module(dec(module_part))
    for part in dec(qual_part).split("."):
        kind = getattr(kind, part)
    twin = subclass_twin(kind)
    if twin is None:
        raise AttributeError(f"slimgrad: {name!r} names {kind!r}, which is no longer a subclass slimgrad converts")
    return twin
