"""convert / revert: swap stock modules for slimgrad's drop-in replacements and back.

Converting is a class swap on the module instance (``module.__class__ = Replacement``). The replacement
subclasses the stock class and only overrides ``forward``, so parameters, buffers, hooks, train/eval
state, ``requires_grad`` flags, ``state_dict`` keys, dtype, device and memory format all stay exactly as
they were. Matching is on the exact type: a subclass of ``nn.Conv2d`` may have its own forward, so it is left
alone and reported, never silently replaced; except a subclass that adds only set-up (``__init__``,
``reset_parameters``, ``extra_repr``), which computes what its base computes and gets a twin of the base's
replacement (``_registry.subclass_twin``).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import logging
import sys
import types
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ._copied import note_copy
from ._forward_chain import reaches, rewrapped
from ._gaps import CHUNKED_LOSS, claimed_family, family_gap, model_gap, module_gap, remember_converted
from ._notices import Gap, notify_all
from ._registry import (
    OPTIONS,
    ORIGINALS,
    REPLACEMENTS,
    defined_beyond_init,
    delegating_stock,
    init_only_stock,
    rebased,
    replacement_base,
    reports_only,
    subclass_twin,
    wrapped_stock,
)
from .functional.dropout import POLICY_ATTRIBUTE
from .integrations import load_available

__all__ = ["ConversionReport", "convert", "qualified_name", "revert"]

log = logging.getLogger("slimgrad")

#: Attributes a replacement may set on a module at run time (what it learned, the compiled core's per-module
#: caches: every name starts with this prefix); revert removes them.
_RUNTIME_PREFIX = "_slimgrad_"
assert POLICY_ATTRIBUTE.startswith(_RUNTIME_PREFIX)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A module of a family slimgrad knows that was left as it was, and why."""

    path: str
    type_name: str
    reason: str


def qualified_name(kind: type) -> str:
    """``Conv2d`` for torch.nn's own classes, ``module.Class`` for everyone else's: peft's ``lora.Linear``
    reads ``peft.tuners.lora.layer.Linear``, not a bare ``Linear``."""
    if kind.__module__.startswith("torch.nn.") or kind.__module__.startswith("slimgrad.nn."):
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


_CHUNKED_ON_NOTHING = ("convert(chunked_loss=True) engaged on nothing: this model holds no causal-LM head slimgrad "
                       "recognises (a transformers *ForCausalLM / *LMHeadModel with a linear lm_head), so its loss is "
                       "computed as stock computes it, from the logits its head makes")

#: containers whose forward only calls their children: nothing of their own runs as stock
_PURE_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterDict, nn.ParameterList)
#: types slimgrad leaves alone because stock already keeps only what their gradients read (see
#: slimgrad.minimum's rules): reported as such, not as unknown
_STOCK_IS_MINIMAL = (nn.Linear, nn.Embedding, nn.Identity, nn.Flatten, nn.Unflatten, nn.SiLU, nn.GELU, nn.Mish,
                     nn.Hardswish, nn.Tanh, nn.Sigmoid, nn.Softmax)
_STOCK_IS_MINIMAL_NAMES = ("transformers.activations.SiLUActivation", "transformers.pytorch_utils.Conv1D",
                           "peft.tuners.lora.layer.Embedding",
                           # a projection then F.gelu, which keeps only its input (integrations/diffusers.py)
                           "diffusers.models.activations.GELU")


@dataclasses.dataclass
class ConversionReport:
    """What ``convert`` did: the converted modules, the modules of known families it left alone (with
    reasons), and, by count, the module types it has no replacement for (they run as stock)."""

    converted: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    #: qualified type name -> count, converted modules
    converted_types: dict[str, int] = dataclasses.field(default_factory=dict)
    #: qualified type name -> count, modules of types slimgrad has no replacement for (pure containers left out)
    unknown: dict[str, int] = dataclasses.field(default_factory=dict)
    #: qualified type name -> count, modules left as stock because stock already keeps the minimum (Linear)
    stock_minimal: dict[str, int] = dataclasses.field(default_factory=dict)
    #: what the user asked for that did not engage: modules of a family slimgrad claims left as stock, an
    #: option that converted nothing, a disabled integration of a library the model uses (each warned about)
    gaps: list[Gap] = dataclasses.field(default_factory=list)
    #: the memory plan installed by ``convert(budget=..., example=...)`` (a :class:`slimgrad.plan.MemoryPlan`)
    plan: object = None
    #: gap subject -> module paths it concerns
    gap_paths: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def add_gap(self, gap: Gap, path: str) -> None:
        if gap not in self.gaps:
            self.gaps.append(gap)
        self.gap_paths.setdefault(gap.subject, []).append(path)

    def __str__(self) -> str:
        lines = [f"slimgrad: converted {len(self.converted)} module(s), left {len(self.skipped)} alone, "
                 f"{sum(self.unknown.values())} of types it does not know"
                 + (f", {len(self.gaps)} gap(s) in what it claims" if self.gaps else "")]
        if self.converted_types:
            lines.append("  converted: " + _by_count(self.converted_types))
        for s in self.skipped:
            lines.append(f"  left alone: {s.path or '<root>'} ({s.type_name}): {s.reason}")
        if self.stock_minimal:
            lines.append("  left as stock, already minimal: " + _by_count(self.stock_minimal))
        if self.unknown:
            lines.append("  not known (run as stock): " + _by_count(self.unknown))
        for gap in self.gaps:
            paths = self.gap_paths.get(gap.subject, [])
            more = ", ..." if len(paths) > 1 else ""
            where = f" [{len(paths)} module(s): {paths[0] or '<root>'}{more}]" if paths else ""
            lines.append(f"  gap: {gap.message()}{where}")
        return "\n".join(lines)


def _by_count(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


class _Selector:
    """Which module paths a user asked for: glob patterns on dotted paths, or module types.

    A pattern selects a module when it matches the module's path or the path of one of its ancestors, so
    ``include=["layer1"]`` selects everything inside ``layer1``.
    """

    def __init__(self, argument: str, spec, paths: list[str]):
        self.argument = argument
        self.patterns: list[str] = []
        self.types: tuple[type, ...] = ()
        if spec is None:
            return
        if isinstance(spec, (str, type)):
            spec = [spec]
        if not isinstance(spec, Iterable):
            raise TypeError(f"convert: '{argument}' must be a module path pattern, a module type or a list "
                            f"of them, got {type(spec).__name__}")
        types = []
        for item in spec:
            if isinstance(item, str):
                self.patterns.append(item)
            elif isinstance(item, type) and issubclass(item, nn.Module):
                if item not in REPLACEMENTS:
                    known = ", ".join(sorted(t.__name__ for t in REPLACEMENTS))
                    raise ValueError(f"convert: '{argument}' names type {item.__name__}, which slimgrad does "
                                     f"not convert; convertible types: {known}")
                types.append(item)
            else:
                raise TypeError(f"convert: '{argument}' entries must be path patterns (str) or nn.Module "
                                f"types, got {item!r}")
        self.types = tuple(types)
        if argument == "include" and not self.patterns and not self.types:
            # (an include list that selected nothing converted every module: the "no filter" of None)
            raise ValueError("convert: 'include' is empty, which selects no module; pass include=None (the default) "
                             "to convert every module")
        for pattern in self.patterns:
            if not any(self._matches(pattern, p) for p in paths):
                sample = ", ".join(repr(p) for p in paths if p)[:200]
                raise ValueError(f"convert: '{argument}' pattern {pattern!r} matches no module; module paths "
                                 f"look like: {sample}")

    @staticmethod
    def _matches(pattern: str, path: str) -> bool:
        parts = path.split(".") if path else [""]
        return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))

    @property
    def empty(self) -> bool:
        return not self.patterns and not self.types

    def selects(self, path: str, module: nn.Module) -> bool:
        kind = type(module)
        # a type also selects its subclasses that add only set-up (converted as it is: _registry.subclass_twin)
        return (kind in self.types
                or (bool(self.types) and (init_only_stock(kind) or delegating_stock(kind)) in self.types)
                or any(self._matches(p, path) for p in self.patterns))


def _lazy_reason(module: nn.Module) -> str:
    """Why a lazy module (LazyConv2d, LazyLinear, ...) is left alone before its first forward: its parameters do not
    exist yet, and at that forward it turns itself into its plain class, which convert never saw (it was reported as
    a subclass that "may compute something else", or a type slimgrad does not know: the wrappers sweep)."""
    becomes = getattr(type(module), "cls_to_become", None)
    what = f"a {becomes.__name__}" if becomes is not None else "its plain class"
    return (f"a lazy module whose parameters are not initialised yet (it becomes {what} at its first forward); run "
            f"one forward (an example batch), then convert")


def _why_not_exact(module: nn.Module) -> str | None:
    """A reason for a module that is an instance of a convertible family but not of an exact type."""
    # (a replacement that only reports claims no family: its subclasses are not left out of anything)
    stock = next((t for t, r in REPLACEMENTS.items() if isinstance(module, t) and not reports_only(r)), None)
    if stock is None:
        return None
    if wrapped_stock(type(module)) is not None:
        # Its parameters are DTensor shards now, which the integrations' checks cannot run on; converted first, the
        # module keeps its replacement under fully_shard (ORIGINALS answers for FSDP<cls>) and revert keeps it sharded
        return (f"sharded by FSDP2's fully_shard before convert (its class is {type(module).__name__}); convert "
                f"first, then fully_shard, as the README's order says")
    if getattr(module, "parametrizations", None) is not None and type(module).__name__.startswith("Parametrized"):
        return (f"has parametrizations (torch.nn.utils.parametrize) on {stock.__name__}; its weight is "
                f"computed on access, left as stock")
    own = defined_beyond_init(type(module), stock)
    if not own:
        return (f"subclass of {stock.__module__}.{stock.__name__}; for this family only exact types are converted")
    return (f"subclass of {stock.__module__}.{stock.__name__} that defines {', '.join(own[:4])}"
            f"{' ...' if len(own) > 4 else ''} (it may compute something else); converted are exact types, "
            f"subclasses that add only __init__, reset_parameters or extra_repr, and direct subclasses whose forward "
            f"calls super().forward")


def _deepcopy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for models holding computed (non-leaf) tensors as plain attributes.

    The old ``torch.nn.utils.weight_norm`` and ``spectral_norm`` hooks store the weight they compute as such
    an attribute, which ``deepcopy`` refuses ("Only Tensors created explicitly by the user (graph leaves)
    support the deepcopy protocol"). Their forward pre-hook recomputes that attribute from the copied
    parameters before every forward, so the copy gets a detached clone of its current value in its place;
    the original model is not touched.
    """
    memo = {}
    for module in model.modules():
        for value in module.__dict__.values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value.detach().clone()
    copied = copy.deepcopy(model, memo)
    # Each module's train/eval flag as the model's: a class whose copy protocol rebuilds it (torchvision's
    # create_feature_extractor gives a DualGraphModule, whose deepcopy comes back in train mode) would otherwise
    # turn an eval model's batch norm to batch statistics, silently
    training = {name: module.training for name, module in model.named_modules(remove_duplicate=False)}
    for name, module in copied.named_modules(remove_duplicate=False):
        if name in training and module.training != training[name]:
            module.training = training[name]
    return copied


def _not_copyable(model: nn.Module) -> str | None:
    """Why ``convert``'s deep copy of ``model`` would be broken, naming the module, or None. FSDP2 refuses to copy a
    module ``fully_shard`` sharded; diffusers' hooks (``enable_layerwise_casting``, ``enable_group_offload``, ...) are
    closures over the hooked modules, which a deep copy shares: the copy would run the original's layers (or, with
    group offload, fail to copy at all)."""
    for path, module in model.named_modules():
        where = f"'{path or '(the model itself)'}'"
        if wrapped_stock(type(module)) is not None:
            return (f"{where} is sharded by FSDP2's fully_shard, which cannot be deep-copied, and convert works on a "
                    f"deep copy unless told otherwise: convert the model before fully_shard (the README's order), or "
                    f"pass inplace=True")
        if "_diffusers_hook" in module.__dict__:
            return (f"{where} carries diffusers hooks (enable_layerwise_casting, enable_group_offload, ...), which a "
                    f"deep copy does not separate from the original model (the copy's hooked forwards would run the "
                    f"original's layers), and convert works on a deep copy unless told otherwise: convert the model "
                    f"before enabling those hooks, or pass inplace=True to convert it in place")
    return None


def _bound_forwards(module: nn.Module, forward) -> list[tuple[object, str]]:
    """Where a wrapper installed on the instance keeps ``module``'s class forward ``forward``, bound to it:
    (holder, attribute) pairs. A class swap does not reach them (a bound method keeps its function), so the
    wrapper would go on running that forward. Looked for in the instance's own attributes (``forward`` itself;
    accelerate's ``_old_forward``) and in diffusers' hook registry's function references."""
    found = []

    def bound_here(value) -> bool:
        return (isinstance(value, types.MethodType) and value.__self__ is module
                and getattr(value, "__func__", None) is forward)

    for name, value in module.__dict__.items():
        if bound_here(value):
            found.append((module, name))
    registry = module.__dict__.get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", None) or ():
        for name in ("forward", "original_forward"):
            if bound_here(getattr(ref, name, None)):
                found.append((ref, name))
    return found


def _instance_forward_reason(module: nn.Module, kind: type) -> str | None:
    """Why ``module`` stays stock although its family converts: its ``forward`` is replaced on the instance by a
    wrapper that does not call the class's forward through a reference convert can re-point."""
    own = module.__dict__.get("forward")
    if own is None or _bound_forwards(module, kind.forward) or reaches(own, kind.forward):
        return None
    target = getattr(own, "func", own)  # (a functools.partial: accelerate's and diffusers' wrappers)
    what = getattr(target, "__qualname__", type(own).__name__)
    return (f"its forward is replaced on the instance ({what}), which would not run the converted forward; "
            f"left as stock (convert before installing the wrapper)")


def _repoint(module: nn.Module, old_forward, new_forward) -> None:
    """Re-point the wrappers that call ``old_forward`` bound to ``module`` (``_bound_forwards``) to ``new_forward``,
    and rebuild an instance ``forward`` whose wrapper chain captured ``old_forward`` (accelerate's mixed precision:
    ``_forward_chain``)."""
    for holder, name in _bound_forwards(module, old_forward):
        setattr(holder, name, types.MethodType(new_forward, module))
    own = module.__dict__.get("forward")
    if own is not None and (rebuilt := rewrapped(own, old_forward, new_forward)) is not None:
        module.forward = rebuilt


def _chunked_engaged(model: nn.Module, swaps) -> bool:
    """Whether a chunked-loss head runs in ``model`` once ``swaps`` are applied (converted now or before)."""
    if any(OPTIONS.get(ORIGINALS[r]) == CHUNKED_LOSS for _, r in swaps):  # (r's stock: also for FSDP2's classes)
        return True
    return any(OPTIONS.get(ORIGINALS[type(m)]) == CHUNKED_LOSS for m in model.modules() if type(m) in ORIGINALS)


def _inside_hf_model(target: nn.Module, path: str) -> str | None:
    """The class name of a Hugging Face model (a ``PreTrainedModel``) that ``target``'s module at ``path`` sits
    inside, or None. Such a composite (BLIP-2's language model, an encoder-decoder's decoder) calls its causal-LM
    head without labels and computes the loss from the logits itself: the head's chunked loss would not engage.
    peft's wrappers are not models of transformers, so a LoRA-wrapped head engages as the head alone does."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not path:
        return None
    parts = path.split(".")
    for depth in range(len(parts)):
        parent = target.get_submodule(".".join(parts[:depth]))
        if isinstance(parent, modeling.PreTrainedModel):
            return type(parent).__name__
    return None


def _nested_head_reason(outer: str) -> str:
    return f"it sits inside {outer}, which calls it without labels and computes the loss from the logits itself"


def _plan_with_chunked_loss(target: nn.Module, chosen, budget, example, **plan_options):
    """The plan with the loss computed in chunks, where a causal-LM head takes it and it fits with less
    recomputation (or fits at all); otherwise ``chosen``, with the heads left as they were."""
    from .plan import plan

    swapped = []
    for path, module in target.named_modules():
        kind = type(module)
        replacement = REPLACEMENTS.get(kind)
        if OPTIONS.get(kind) != CHUNKED_LOSS or replacement is None or _inside_hf_model(target, path):
            continue
        reason_fn = getattr(replacement, "unsupported_reason", None)
        if reason_fn is not None and reason_fn(module) is not None:
            continue
        module.__class__ = replacement
        swapped.append((module, kind))
    if not swapped:
        return chosen
    alternative = plan(target, budget, example, **plan_options)
    if alternative.fits and (not chosen.fits or alternative.extra_seconds < chosen.extra_seconds):
        alternative.notes.append("chunked loss is on (it fits with less recomputation): a training forward with "
                                 "labels returns the loss and logits=None; pass chunked_loss=False to keep logits")
        return alternative
    for module, kind in swapped:
        module.__class__ = kind
    return chosen


def convert(model: nn.Module, *, inplace: bool = False, include=None, exclude=None, report: bool = False,
            chunked_loss: bool | None = None, dropout: str | None = None, strict: bool = False, budget=None,
            example=None, optimizer=None, loss_fn=None, hold_output: bool = False):
    """Return ``model`` with every convertible module replaced by its slimgrad twin.

    ``inplace=False`` (default) converts a deep copy: parameters and buffers are copied (with their
    ``requires_grad`` flags), which costs one more copy of the model's memory while both exist.
    ``inplace=True`` swaps classes on ``model`` itself and shares every parameter (no copy).

    ``include`` / ``exclude``: module path glob patterns (``"layer1"``, ``"layer*.0.conv?"``; a pattern
    covers a module and everything inside it) or convertible module types (``nn.BatchNorm2d``). With
    ``include``, only selected modules are converted; ``exclude`` wins over ``include``.

    Modules of a known family that are left alone (subclasses, parametrized modules, unsupported options)
    are logged on the ``slimgrad`` logger; ``report=True`` also returns a :class:`ConversionReport`:
    ``model, rep = convert(model, report=True)``. Converting an already converted model changes nothing.

    ``dropout``: the dropout policy of the converted modules ("auto", "bits", "seed"; None: the
    process-wide one, see :func:`slimgrad.functional.dropout.set_dropout_policy`): "bits" keeps 1 bit per
    element and draws stock's mask (bitwise stock on CPU), "seed" keeps 8 bytes and redraws in backward,
    "auto" is bits on CPU (and on meta, which counts what CPU keeps) and seed elsewhere.

    Gaps are never silent. A module of a family slimgrad claims (RMSNorms, gated MLPs, peft LoRA layers,
    bitsandbytes linears, diffusers activations) that stays stock because no integration recognised its
    class, a ``chunked_loss=True`` that engages on nothing (or on a head it must decline), and a disabled
    integration of a library the model uses: each is a :class:`slimgrad.SlimgradWarning` and a
    WARNING on the ``slimgrad`` logger, once per (class, reason), naming the class, the library version and
    the reason, also with ``report=True`` (the report lists them as ``gaps``). ``strict=True`` raises
    :class:`slimgrad.SlimgradGapError` instead, before anything is swapped. Modules left out by
    ``include`` / ``exclude`` are never gaps.

    ``budget`` (bytes, or ``"12GiB"``) with ``example`` (one batch: a dict of keyword inputs, a tensor, or a
    tuple of positional inputs): after converting, fit one training step into the budget with
    :func:`slimgrad.plan` (checkpointing, or on CUDA offloading, only the blocks that must) and install the
    plan; ``optimizer``, ``loss_fn`` and ``hold_output`` (a loop that holds the model's output through backward,
    where the Hugging Face ``Trainer`` frees it) are as in :func:`slimgrad.estimate`. With a budget and
    ``chunked_loss`` left at None, the plan turns chunked loss on where a causal-LM head takes it and that
    fits with less recomputation (or fits at all); ``chunked_loss=False`` keeps the logits whatever it costs.
    The plan is printed on the ``slimgrad`` logger and, with ``report=True``, is the report's ``plan``. A
    budget no plan meets raises ``ValueError`` naming by how much and the smallest budget that can be met.
    """
    if budget is None and example is not None:
        raise ValueError("convert: 'example' is used with 'budget' (a memory budget to plan for); give both")
    if budget is None:
        for name, given in (("optimizer", optimizer is not None), ("loss_fn", loss_fn is not None),
                            ("hold_output", hold_output is not False)):
            if given:  # (they change only the plan: without a budget they were ignored, silently)
                raise ValueError(f"convert: '{name}' is used with 'budget' and 'example' (the step to plan for); "
                                 f"without a budget there is no plan for it to change")
    if budget is not None and example is None:
        raise ValueError("convert: 'budget' needs 'example', one batch of the training step to plan for (a dict "
                         "of keyword inputs, a tensor, or a tuple of positional inputs)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    for name, flag in (("inplace", inplace), ("report", report), ("strict", strict), ("hold_output", hold_output)):
        if not isinstance(flag, bool):
            raise TypeError(f"convert: '{name}' must be True or False, got {flag!r}")
    if chunked_loss is not None and not isinstance(chunked_loss, bool):
        raise TypeError(f"convert: 'chunked_loss' must be True, False or None, got {chunked_loss!r}")
    chunked_auto = chunked_loss is None and budget is not None  # the plan may turn it on where it helps
    chunked_loss = bool(chunked_loss)
    if dropout is not None:
        from .functional.dropout import check_policy

        check_policy(dropout, source="convert's argument 'dropout'")
    load_available()
    options = {"chunked_loss": chunked_loss}
    paths = [name for name, _ in model.named_modules()]
    included = _Selector("include", include, paths)
    excluded = _Selector("exclude", exclude, paths)

    if not inplace and (why := _not_copyable(model)) is not None:
        raise ValueError(f"convert: {why}")
    target = model if inplace else _deepcopy(model)
    result = ConversionReport()
    gaps, disabled = model_gap(target)
    swaps = []  # (module, replacement): applied only once strict has found no gap
    # modules a parent left as stock keeps the outputs of in its own forward (kept_children below): converted, they
    # would keep a mask on top of what the stock parent keeps
    kept_by_stock_parent: set[int] = set()
    for path, module in target.named_modules():
        kind = type(module)
        if kind in ORIGINALS:  # already converted (shared module seen twice, or converting twice)
            continue
        name = qualified_name(kind)
        if (not included.empty and not included.selects(path, module)) or excluded.selects(path, module):
            continue  # the user's choice: not a gap
        if id(module) in kept_by_stock_parent:
            result.stock_minimal[name] = result.stock_minimal.get(name, 0) + 1
            continue
        replacement = REPLACEMENTS.get(kind) or subclass_twin(kind)
        # (a module FSDP2 sharded before convert answers by the class it wraps: an option not asked for skips it too)
        option = OPTIONS.get(kind) or OPTIONS.get(wrapped_stock(kind))
        if option is not None and not options.get(option, False):
            continue
        if replacement is None:
            if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
                result.skipped.append(Skipped(path, name, _lazy_reason(module)))
                continue
            gap = module_gap(module, chunked_loss=chunked_loss, disabled=disabled)
            reason = _why_not_exact(module)
            if gap is not None and reason is None:
                result.add_gap(gap, path)
            elif reason is not None:
                result.skipped.append(Skipped(path, name, reason))
                if option is not None:  # an option asked for that does not engage here (a sharded LM head): a gap
                    result.add_gap(family_gap(wrapped_stock(kind) or kind, option, reason), path)
                elif (family := claimed_family(module)) is not None:
                    # a family the docs claim left as stock (peft's TorchaoLoraLinear, a LoRA subclass): a gap, as
                    # below for a replacement that refuses the module
                    result.add_gap(family_gap(kind, family, reason), path)
            elif kind in _STOCK_IS_MINIMAL or name in _STOCK_IS_MINIMAL_NAMES:
                result.stock_minimal[name] = result.stock_minimal.get(name, 0) + 1
            elif kind not in _PURE_CONTAINERS:
                result.unknown[name] = result.unknown.get(name, 0) + 1
            continue
        reason = None
        if option == CHUNKED_LOSS and (outer := _inside_hf_model(target, path)) is not None:
            reason = _nested_head_reason(outer)
        reason_fn = getattr(replacement, "unsupported_reason", None)
        if reason is None and reason_fn is not None:
            reason = reason_fn(module)
        if reason is None and "forward" in module.__dict__:
            reason = _instance_forward_reason(module, kind)
        if reason is not None:
            result.skipped.append(Skipped(path, name, reason))
            # an option the user asked for, or a family the docs claim, that does not engage here: a gap
            family = OPTIONS.get(kind) or claimed_family(module)
            if family is not None:
                result.add_gap(family_gap(kind, family, reason), path)
            kept_children = getattr(replacement, "kept_children", None)
            if kept_children is not None:
                kept_by_stock_parent.update(id(child) for child in kept_children(module))
            continue
        swaps.append((module, replacement))
        if reports_only(replacement):  # stock's ops and bytes: counted as stock
            result.stock_minimal[name] = result.stock_minimal.get(name, 0) + 1
            continue
        result.converted.append((path, kind.__name__))
        result.converted_types[name] = result.converted_types.get(name, 0) + 1
    if chunked_loss and not _chunked_engaged(target, swaps) and not any(g.family == CHUNKED_LOSS for g in result.gaps):
        result.add_gap(family_gap(type(target), CHUNKED_LOSS, _CHUNKED_ON_NOTHING), "")
    result.gaps[:0] = [g for g in gaps if g not in result.gaps]
    notify_all(result.gaps, strict=strict)  # before any swap: strict leaves an inplace model untouched

    for module, replacement in swaps:
        stock_forward = type(module).forward
        module.__class__ = replacement
        _repoint(module, stock_forward, replacement.forward)  # wrappers installed on the instance (accelerate, ...)
        if dropout is not None:
            setattr(module, POLICY_ATTRIBUTE, dropout)  # read by the dropout and LoRA forwards (module_policy)
    remember_converted(target)
    if budget is not None:
        from .plan import apply_plan, plan

        plan_options = {"optimizer": optimizer, "loss_fn": loss_fn, "hold_output": hold_output}
        chosen = plan(target, budget, example, **plan_options)
        if chunked_auto and (not chosen.fits or chosen.actions):
            chosen = _plan_with_chunked_loss(target, chosen, budget, example, **plan_options)
        if not chosen.fits:
            if inplace:  # leave the user's model as it came: the conversion was for the plan
                for module, _ in swaps:
                    _restore_stock(module, ORIGINALS[type(module)])
            raise ValueError(f"convert: {chosen}")
        apply_plan(target, chosen.actions)
        result.plan = chosen
        if chosen.actions:  # a plan that recomputes or copies changes the step's time: say so
            log.warning("%s", chosen)
        else:
            log.info("%s", chosen)
    if not inplace:
        note_copy(model)  # an optimizer or a Module.compile() made on the original does not follow the copy
    if result.skipped and not report:  # with report=True the caller has the report: no warning on top
        log.warning("%s", result)
    elif result.skipped:
        log.info("%s", result)
    else:
        log.info("slimgrad: converted %d module(s)", len(result.converted))
    return (target, result) if report else target


def revert(model: nn.Module) -> nn.Module:
    """Swap every slimgrad module in ``model`` back to its stock class, in place; returns ``model``.

    Parameters, buffers, hooks and flags are untouched, so the reverted model is the stock model with
    whatever training happened meanwhile.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    from .plan import remove_plan

    remove_plan(model)
    for module in model.modules():
        stock = ORIGINALS.get(type(module))
        if stock is not None:
            _restore_stock(module, stock)
    return model


def _restore_stock(module: nn.Module, stock: type) -> None:
    """Give ``module`` its stock class back and drop what slimgrad's layers learned at run time. A module a wrapper
    re-classed after converting (FSDP2's ``fully_shard``: ``FSDP<cls>``) gets that class rebuilt on the stock one, so
    it stays wrapped (set to the stock class, it was no longer an FSDP module)."""
    kind = type(module)
    converted_forward = kind.forward
    base = replacement_base(kind)
    module.__class__ = stock if base is kind or base is None else rebased(kind, base, stock)
    _repoint(module, converted_forward, stock.forward)
    for attr in [a for a in module.__dict__ if a.startswith(_RUNTIME_PREFIX)]:
        del module.__dict__[attr]
