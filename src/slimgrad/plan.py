"""``slimgrad.plan``: fit a training step into a memory budget, block by block.

slimgrad's layers already keep the least each gradient needs. When that alone does not fit, a plan picks,
per block (a transformer layer, a ResNet stage, a UNet block; :func:`slimgrad.estimate.blocks_of`), one of:

* ``keep``: slimgrad's minimal saving alone (no extra time);
* ``checkpoint``: non-reentrant activation checkpointing of the block (``torch.utils.checkpoint``, which
  restores the RNG state, so dropout draws the same masks and the numbers stay those of the run without it);
  costs one more forward of the block in backward;
* ``offload``: the block's kept tensors go to pinned host memory during forward and come back in backward
  (pinned, asynchronous copies that keep each tensor's strides: ``_to_host``); CUDA only (on CPU, host memory
  *is* the device memory); costs two copies of the kept bytes over the host link.

A block's composite parts (a transformer layer's attention and MLP, a UNet block's resnets and attentions:
:func:`parts_of`) are candidates too: where a budget needs only a little, recomputing two MLPs costs less than
one whole layer (QLoRA Llama, 4 layers, batch 8 at half of stock's peak: two MLPs, +5.8 ms planned, against one
layer's +8.8 ms). A unit is the block or one of its parts, never both: taking a block takes over its parts.

Every candidate plan is judged by :func:`slimgrad.estimate` (the step simulated on fake tensors), not by a
model of it, so what the plan promises is what the allocator replay says. Units are taken in order of bytes
freed per second of extra time (what a unit keeps less the inputs its checkpoint keeps instead); the fewest
that meet the budget are chosen by bisection, over blocks alone, over blocks and parts together and over parts
before blocks, and the cheapest fitting plan wins. Recompute costs come from a timed forward of each unit on
the example (under ``no_grad``: a few blocks' activations at most, cached per model and example shapes);
offload costs from a timed host copy.

Where keeping less already fits, nothing is checkpointed. Where the peak is a transient no plan lowers (one
layer's backward, the loss's logits), the plan says so and gives the smallest budget it can meet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ._notices import SlimgradWarning
from ._registry import changes_what_is_kept
from .estimate import (
    MemoryEstimate,
    _gib,
    _is_block,
    block_list,
    blocks_of,
    estimate,
    parse_bytes,
    split_example,
    unwrap,
)

__all__ = ["BlockChoice", "MemoryPlan", "apply_plan", "parts_of", "plan", "remove_plan"]

_ACTIONS = ("keep", "checkpoint", "offload")
_PLANNED = "_slimgrad_planned"  # the instance attribute holding a block's planned forward
_USE_CACHE = "_slimgrad_planned_use_cache"  # a config whose use_cache the plan turned off (restored on removal)


@dataclasses.dataclass
class BlockChoice:
    path: str
    action: str
    kept_bytes: int  # kept for backward by this block without the plan
    forward_seconds: float  # one forward of the block on the example (the cost of recomputing it)
    extra_seconds: float  # what the action adds to a step


@dataclasses.dataclass
class MemoryPlan:
    """What :func:`plan` chose and what it expects: peaks in bytes on ``device``, times in seconds."""

    budget: int
    device: str
    peak_before: int  # the model as given (converted or not), no plan
    peak_after: int  # with the plan
    # where no plan fits, the lowest peak a plan reaches (what the refusal names); where one fits, the lowest peak of
    # the plans the search tried (every block or every part checkpointed or offloaded among them), which may be above
    smallest_feasible: int
    fits: bool
    blocks: list[BlockChoice]
    extra_seconds: float
    notes: list[str]
    #: whether slimgrad had converted the model planned: ``peak_before`` is then slimgrad's saving alone, not stock's
    converted: bool = False
    estimate_before: MemoryEstimate = dataclasses.field(repr=False, default=None)
    estimate_after: MemoryEstimate = dataclasses.field(repr=False, default=None)

    @property
    def actions(self) -> dict[str, str]:
        return {b.path: b.action for b in self.blocks if b.action != "keep"}

    def __str__(self) -> str:
        verdict = ("fits" if self.fits else f"does NOT fit: {_amount(self.peak_after - self.budget)} over; the "
                   f"smallest budget any plan meets is {_gib(self.smallest_feasible)} ({self.smallest_feasible} bytes)")
        given = "converted by slimgrad" if self.converted else "as given"
        lines = [f"slimgrad.plan: budget {_gib(self.budget)} on {self.device}: peak {_gib(self.peak_before)} -> "
                 f"{_gib(self.peak_after)}, {verdict}; about +{self.extra_seconds * 1e3:.1f} ms per step "
                 f"(before: the model {given}, no plan)"]
        changed = [b for b in self.blocks if b.action != "keep"]
        if changed:
            w = max(len(b.path) for b in self.blocks)
            lines.append(f"  {'block':<{w}}  {'action':<10}  {'kept':>10}  {'+ms/step':>9}")
            for b in self.blocks:
                lines.append(f"  {b.path:<{w}}  {b.action:<10}  {_gib(b.kept_bytes):>10}  "
                             f"{b.extra_seconds * 1e3:>9.2f}")
        else:
            lines.append("  every block keeps slimgrad's minimal saving alone (nothing checkpointed or offloaded)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Kept bytes per block before and after, and the simulated memory over the step (PNG at ``path``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("MemoryPlan.plot needs matplotlib: pip install matplotlib") from None
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        names = [b.path for b in self.blocks]
        before = [b.kept_bytes / 2**20 for b in self.blocks]
        after_rows = {r.path: r.kept_bytes for r in (self.estimate_after.blocks if self.estimate_after else [])}
        after = [after_rows.get(n, 0) / 2**20 for n in names]
        xs = range(len(names))
        ax1.bar([x - 0.2 for x in xs], before, 0.4, label="without plan")
        ax1.bar([x + 0.2 for x in xs], after, 0.4, label="with plan")
        ax1.set_xticks(list(xs), names, rotation=90, fontsize=6)
        ax1.set_ylabel("MiB kept for backward")
        ax1.legend()
        for est, label in ((self.estimate_before, "without plan"), (self.estimate_after, "with plan")):
            if est is not None and est.timeline:
                ax2.plot([t[0] for t in est.timeline], [t[2] / 2**20 for t in est.timeline], label=label)
        ax2.axhline(self.budget / 2**20, color="red", linestyle="--", label="budget")
        ax2.set_xlabel("op")
        ax2.set_ylabel(f"MiB alive on {self.device}")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


# -- planned forwards ---------------------------------------------------------------------------------------


class _PlannedForward:
    """A block's forward under its plan. An object, not a closure: ``copy.deepcopy`` of the model maps
    ``module`` to the copy, so a copied model checkpoints its own blocks."""

    def __init__(self, module: nn.Module, action: str, previous, checkpointers=()):
        self.module = module
        self.action = action
        self.previous = previous  # an instance-level forward that was there before (None: the class's)
        # the block and the modules holding it that Hugging Face's gradient checkpointing can turn on for
        self.checkpointers = tuple(checkpointers)

    def _contexts(self):
        # (the copies of the CPU generator's state torch's checkpoint takes, 5 KiB each, are counted by
        # slimgrad.estimate for every checkpoint in a simulated step, the user's own too: estimate._rng_states_counted)
        return contextlib.nullcontext(), _recomputation(self.module)

    def _inner(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self._inner(*args, **kwargs)
        if any(m.training and getattr(m, "gradient_checkpointing", False) is True
               for m in getattr(self, "checkpointers", ())):  # (a plan pickled before it had them)
            _step_aside_for_hf_checkpointing()
            return self._inner(*args, **kwargs)
        if self.action == "checkpoint":
            from torch.utils.checkpoint import checkpoint

            if torch.compiler.is_compiling():
                # traced into one graph: the recomputation is part of the functional joint graph, so the
                # running statistics are updated once, and dynamo takes no context_fn but its own
                return checkpoint(self._inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(self._inner, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(_to_host, _from_host):
            return self._inner(*args, **kwargs)


_STEPPED_ASIDE = []


def _step_aside_for_hf_checkpointing() -> None:
    """Hugging Face's gradient checkpointing turned on after the plan (``gradient_checkpointing_enable()``, or a
    Trainer/TRL config with ``gradient_checkpointing=True``, TRL's default): its recomputation of each layer ran the
    plan's checkpoint again, whose own recomputation ran the part a third time (131 matmuls a step against 110,
    silently; the checkpointing sweep). The plan's actions step aside while it is on; said once a process."""
    if not _STEPPED_ASIDE:
        _STEPPED_ASIDE.append(True)
        warnings.warn("slimgrad: Hugging Face gradient checkpointing is on over blocks slimgrad's plan checkpoints or "
                      "offloads: the plan's actions step aside while it is on (each layer is recomputed once, by "
                      "Hugging Face); turn it off to use the plan (SlimgradCallback does), or plan with it on",
                      SlimgradWarning, stacklevel=4)


def _to_host(t: torch.Tensor):
    """A kept CUDA tensor's copy in pinned host memory, asynchronous, with the tensor's own strides.

    Not torch's ``save_on_cpu(pin_memory=True)``: that packs into a contiguous host tensor, so a kept transposed
    view (linear's ``weight.t()``) came back contiguous, cuBLAS ran another kernel on it and the weight
    gradients differed in their last bits from the same model's without offloading (tests/test_plan.py on an
    H200). The copy is queued on the current stream: memory the forward frees after it is reused by later work
    on that stream only, after the copy. A tensor whose strides a copy cannot keep (expanded, overlapping) and
    a tensor not on CUDA stay where they are."""
    if t.device.type != "cuda" or not _dense(t):
        return t
    # (a simulated step's fake tensor gets an unpinned host copy: pinning changes no device bytes)
    from torch._subclasses.fake_tensor import FakeTensor

    pin = torch.cuda.is_available() and not isinstance(t, FakeTensor)
    host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=pin)
    host.copy_(t, non_blocking=True)
    return t.device, host


def _from_host(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)  # (preserve_format: the strides come back too)


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


@contextlib.contextmanager
def _recomputation(block: nn.Module):
    """The recomputation's context: batch-norm statistics restored."""
    with _running_stats_restored(block):
        yield


@contextlib.contextmanager
def _running_stats_restored(block: nn.Module):
    """The recomputation in backward leaves normalisation statistics as the forward left them: a batch norm
    in training mode would otherwise update its running mean and variance (and batch count) a second time."""
    saved = []
    for m in block.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            saved += [(b, b.clone()) for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def apply_plan(model: nn.Module, actions: dict[str, str]) -> nn.Module:
    """Install ``actions`` ({block path: "checkpoint" | "offload"}) on ``model`` in place; returns it.
    Type, parameters, ``state_dict`` keys and hooks are unchanged; :func:`remove_plan` (and
    :func:`slimgrad.revert`) take it off."""
    modules = dict(unwrap(model).named_modules())  # paths of the module inside DDP / compile wrappers
    for path, action in actions.items():
        if action not in _ACTIONS:
            raise ValueError(f"plan: the action for {path!r} must be one of {', '.join(_ACTIONS)}, got {action!r}")
        if path not in modules:
            raise ValueError(f"plan: {path!r} is not a submodule of the model")
    remove_plan(model)
    for path, action in actions.items():
        if action == "keep":
            continue
        module = modules[path]
        parts = path.split(".") if path else []
        holders = [modules[".".join(parts[:i])] for i in range(len(parts) + 1)]
        planned = _PlannedForward(module, action, module.__dict__.get("forward"),
                                  [m for m in holders if hasattr(m, "gradient_checkpointing")])
        module.__dict__[_PLANNED] = planned
        module.forward = planned
    if "checkpoint" in actions.values():
        # A Hugging Face cache filled during forward would be filled again by the recomputation (HF's own
        # checkpointing turns use_cache off in training for the same reason): off while the plan is on.
        for module in unwrap(model).modules():
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", None) is True:
                config.use_cache = False
                module.__dict__[_USE_CACHE] = config
    return model


def caches_turned_off(model: nn.Module) -> list:
    """The configs whose ``use_cache`` :func:`apply_plan` turned off (a plan that checkpoints), each once."""
    configs = {id(c): c for m in model.modules() if (c := m.__dict__.get(_USE_CACHE)) is not None}
    return list(configs.values())


def remove_plan(model: nn.Module) -> nn.Module:
    for module in model.modules():
        config = module.__dict__.pop(_USE_CACHE, None)
        if config is not None:
            config.use_cache = True
        planned = module.__dict__.pop(_PLANNED, None)
        if planned is not None:
            if planned.previous is not None:
                module.forward = planned.previous
            else:
                module.__dict__.pop("forward", None)
    return model


def planned_actions(model: nn.Module) -> dict[str, str]:
    return {p: m.__dict__[_PLANNED].action for p, m in unwrap(model).named_modules() if _PLANNED in m.__dict__}


# -- costs --------------------------------------------------------------------------------------------------


_TIMES: dict = {}  # per device: the host copy bandwidth
#: model -> {(example shapes, blocks or units): seconds}, gone with the model (keyed by id(model), a new model at a
#: freed one's address read the freed one's timings)
_MODEL_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _times(model: nn.Module) -> dict:
    return _MODEL_TIMES.setdefault(model, {})


def _example_key(args, kwargs):
    from torch.utils import _pytree

    leaves = _pytree.tree_leaves((args, kwargs))
    return tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


class _Stopwatch:
    """Seconds each module's forward took, summed over its calls, synchronised with the GPU at both ends (its work
    is asynchronous): what block_forward_seconds and block_offload_seconds time with."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.starts: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self, path: str) -> None:
        self.sync()
        self.starts[path] = time.perf_counter()

    def stop(self, path: str) -> None:
        self.sync()
        self.spent[path] = self.spent.get(path, 0.0) + time.perf_counter() - self.starts[path]


def block_forward_seconds(model: nn.Module, blocks: list[str], args, kwargs, repeats: int = 2) -> dict[str, float]:
    """Seconds of one forward of each block on the example, under ``no_grad`` (the best of ``repeats``);
    cached per model and example shapes. Inputs on the meta device give zeros (nothing can run)."""
    from torch.utils import _pytree

    key = (_example_key(args, kwargs), tuple(blocks))
    times = _times(model)
    if key in times:
        return times[key]
    leaves = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in leaves) or any(p.device.type == "meta" for p in model.parameters()):
        return {b: 0.0 for b in blocks}
    watch = _Stopwatch(any(t.device.type == "cuda" for t in leaves))
    modules = dict(model.named_modules())
    best: dict[str, float] = {b: float("inf") for b in blocks}
    total = watch.spent

    def pre(path):
        return lambda _m, _a: watch.start(path)

    def post(path):
        return lambda _m, _a, _o: watch.stop(path)

    handles = []
    for b in blocks:
        handles.append(modules[b].register_forward_pre_hook(pre(b)))
        handles.append(modules[b].register_forward_hook(post(b)))
    try:
        was_training = model.training
        # timing must not change the model or the run: batch norms in training mode would update their running
        # statistics, and dropout would advance the generator (the planned run would then differ from the plain one)
        rng_devices = [t.device for t in leaves if t.device.type == "cuda"][:1]
        with torch.no_grad(), _running_stats_restored(model), torch.random.fork_rng(devices=rng_devices):
            for _ in range(repeats):
                total.clear()
                model(*args, **kwargs)
                for b in blocks:
                    best[b] = min(best[b], total.get(b, 0.0))
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    result = {b: (v if v != float("inf") else 0.0) for b, v in best.items()}
    times[key] = result
    return result


def _alike_timed_alike(model: nn.Module, rows: dict, seconds: dict[str, float]) -> dict[str, float]:
    """Blocks of one type that keep the same bytes (a transformer's layers) get their median time: timing noise
    must not decide which of equal blocks a plan takes."""
    modules = dict(model.named_modules())
    groups: dict = {}
    for path in seconds:
        groups.setdefault((type(modules[path]), rows[path].kept_bytes), []).append(path)
    result = dict(seconds)
    for paths in groups.values():
        times = sorted(seconds[p] for p in paths)
        for p in paths:
            result[p] = times[len(times) // 2]
    return result


def block_offload_seconds(model: nn.Module, units: list[str], args, kwargs, repeats: int = 2) -> dict[str, float]:
    """Seconds one step spends offloading each unit's kept tensors to pinned host memory and bringing them back,
    measured: a forward (gradients on) whose unit packs what it saves with :func:`_to_host`, against the same
    forward without, plus the time to unpack them all with :func:`_from_host`; synchronised around each (the
    best of ``repeats``). The copy bandwidth alone priced it far too low where a step is host-bound: each kept
    tensor costs a pinned allocation, two copies and a device allocation of host work (on an H200 host one
    offloaded Llama block cost 13 ms a step, a full recomputation of all four as much; bandwidth said 0.1 ms).
    Units are measured in two passes, blocks and their parts apart (a part's tensors are its block's too). Each
    unit's output is cut from its graph after it and its host copies are unpacked right away, so the measurement
    holds one unit's kept tensors at a time, not the forward's (a plan is made where the step does not fit).
    Cached per model and example shapes; meta inputs give zeros (nothing can run)."""
    from torch.utils import _pytree

    key = ("offload", _example_key(args, kwargs), tuple(units))
    times = _times(model)
    if key in times:
        return times[key]
    leaves = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in leaves) or any(p.device.type == "meta" for p in model.parameters()):
        return {u: 0.0 for u in units}
    cuda = any(t.device.type == "cuda" for t in leaves)
    modules = dict(model.named_modules())

    def cut(t):
        """A unit's output cut from its graph (its kept tensors die with it), still requiring grad: the memory of
        one unit's kept tensors at a time, not the forward's, where a plan is made because the step does not fit."""
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t.detach().requires_grad_()
        return t

    def timed_pass(hooked: list[str], timed: list[str]) -> tuple[dict[str, float], dict[str, float]]:
        """One forward with ``hooked`` units packing to host: each timed unit's forward seconds, and each hooked
        unit's seconds to unpack what it packed (right after its forward: one unit's host copies at a time)."""
        watch = _Stopwatch(cuda)
        unpacked: dict[str, float] = {}
        packed: dict[str, list] = {u: [] for u in hooked}
        contexts: dict[str, object] = {}

        def pre(path):
            def hook(_m, _a):
                if path in packed:
                    def pack(t, path=path):
                        out = _to_host(t)
                        packed[path].append(out)
                        return out
                    contexts[path] = torch.autograd.graph.saved_tensors_hooks(pack, _from_host)
                    contexts[path].__enter__()
                watch.start(path)
            return hook

        def post(path):
            def hook(_m, _a, output):
                watch.stop(path)
                if path in contexts:
                    contexts.pop(path).__exit__(None, None, None)
                    t = time.perf_counter()
                    for item in packed[path]:
                        _from_host(item)
                    watch.sync()
                    unpacked[path] = time.perf_counter() - t
                    packed[path].clear()
                return _pytree.tree_map(cut, output)
            return hook

        handles = []
        for u in dict.fromkeys(hooked + timed):
            handles.append(modules[u].register_forward_pre_hook(pre(u)))
            handles.append(modules[u].register_forward_hook(post(u)))
        try:
            model(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            for c in contexts.values():
                c.__exit__(None, None, None)
        return watch.spent, unpacked

    blocks = [u for u in units if not any(u.startswith(v + ".") for v in units)]
    parts = [u for u in units if u not in blocks]
    best = {u: float("inf") for u in units}
    rng_devices = [t.device for t in leaves if t.device.type == "cuda"][:1]
    with _running_stats_restored(model), torch.random.fork_rng(devices=rng_devices):
        for _ in range(repeats):
            plain, _ = timed_pass([], units)
            for group in (blocks, parts):
                if group:
                    hooked, unpacked = timed_pass(group, group)
                    for u in group:
                        best[u] = min(best[u], max(hooked.get(u, 0.0) - plain.get(u, 0.0), 0.0) + unpacked.get(u, 0.0))
    result = {u: (v if v != float("inf") else 0.0) for u, v in best.items()}
    times[key] = result
    return result


def host_copy_bytes_per_second(device: str) -> float:
    """Device -> pinned host -> device bandwidth, timed once on 64 MiB (0 where there is nothing to copy to)."""
    if device != "cuda" or not torch.cuda.is_available():
        return 0.0
    key = ("bandwidth", device)
    if key not in _TIMES:
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        host = torch.empty(x.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            host.copy_(x, non_blocking=True)
            x.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        _TIMES[key] = 6 * x.numel() / (time.perf_counter() - t)
    return _TIMES[key]


def _amount(n: int) -> str:
    """A difference of bytes, readable however small (a small model's refusal read "0.0 MiB over")."""
    return _gib(n) if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


# -- the search ---------------------------------------------------------------------------------------------


def parts_of(model: nn.Module, blocks: list[str]) -> list[str]:
    """The composite parts of each block that a plan may checkpoint instead of the whole block: its children that
    hold parameters and modules of their own (a transformer layer's attention and MLP), looking through
    ``nn.ModuleList``/``nn.ModuleDict`` containers, which are never called (a UNet block's resnets and
    attentions). Single layers are never parts (see :func:`slimgrad.estimate.blocks_of`)."""
    modules = dict(model.named_modules())
    found: list[str] = []

    def visit(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child_path, child)
            elif _is_block(child):
                found.append(child_path)

    for b in blocks:
        if b in modules:  # (a path that is not a submodule: estimate's error names it)
            visit(b, modules[b])
    return found


def _already_checkpointed(model: nn.Module) -> bool:
    """Hugging Face's own gradient checkpointing is on (``gradient_checkpointing_enable()``)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def first_fitting(n: int, fits: Callable[[int], bool], start: int) -> int:
    """The smallest ``k`` in 1..n with ``fits(k)``, where ``fits(n)`` holds and fitting is monotone in ``k`` (the
    peak falls as units are checkpointed): steps of 1, 2, 4 ... away from ``start``, then bisection. It finds what
    a bisection over 1..n finds; each ``fits`` is an estimate (seconds), and from a right ``start`` it takes two
    (``start`` and ``start - 1``) where a bisection takes log2(n)."""
    start = min(max(start, 1), n)
    if fits(start):  # the answer is start or below: step down until one does not fit
        lo, hi, step = 1, start, 1
        while hi > 1:
            probe = max(hi - step, 1)
            if not fits(probe):
                lo = probe + 1
                break
            hi, step = probe, step * 2
    else:  # above start: step up until one fits (n does)
        lo, hi, step = start + 1, n, 1
        while lo < n:
            probe = min(start + step, n)
            if fits(probe):
                hi = probe
                break
            lo, step = probe + 1, step * 2
    while lo < hi:  # hi fits; lo - 1 does not, or lo is 1
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def plan(model: nn.Module, budget, example, *, optimizer=None, loss_fn: Callable | None = None,
         blocks: list[str] | None = None, actions=("checkpoint", "offload"), parts: bool = True,
         hold_output: bool = False) -> MemoryPlan:
    """The cheapest per-block plan that fits one training step of ``model`` on ``example`` into ``budget``.

    ``budget``: bytes, or a string such as ``"12GiB"``. ``example``: one batch as the model takes it (a dict
    of keyword inputs, a tensor, or a tuple of positional inputs); ``optimizer``, ``loss_fn``, ``hold_output``
    (a loop that holds the model's output through backward): as in :func:`slimgrad.estimate`. ``actions``: which
    of ``"checkpoint"``, ``"offload"`` the plan may use
    (offload only on CUDA). ``parts``: whether a block's composite parts (:func:`parts_of`) may be planned
    instead of the whole block. The model is not changed: :func:`apply_plan` (or ``slimgrad.convert(model,
    budget=..., example=...)``) installs the result.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap(model)  # DDP / compile: the inner module is planned (the paths are its own)
    budget_bytes = parse_bytes(budget)
    if isinstance(actions, str):  # actions="checkpoint": one action, not its letters
        actions = (actions,)
    if not isinstance(actions, (list, tuple, set, frozenset)):
        raise TypeError(f"plan: 'actions' must be a list of 'checkpoint' and 'offload', got {actions!r}")
    for a in actions:
        if a not in ("checkpoint", "offload"):
            raise ValueError(f"plan: 'actions' may hold 'checkpoint' and 'offload', got {a!r}")
    args, kwargs = split_example(example)
    block_paths = block_list(blocks, "plan") if blocks is not None else blocks_of(model)
    part_paths = parts_of(model, block_paths) if parts else []
    previous = planned_actions(model)
    notes: list[str] = []
    remove_plan(model)
    try:
        def run(acts: dict[str, str]) -> MemoryEstimate:
            apply_plan(model, acts)
            try:
                return estimate(model, *args, optimizer=optimizer, loss_fn=loss_fn, blocks=block_paths + part_paths,
                                hold_output=hold_output, **kwargs)
            finally:
                remove_plan(model)

        before = run({})
        device = before.device
        if "offload" in actions and device != "cuda":
            actions = tuple(a for a in actions if a != "offload")
            if "checkpoint" not in actions:
                notes.append("offload moves kept tensors to host memory, which on CPU is the same memory: "
                             "nothing to plan with")
        rows = {b.path: b for b in before.blocks}
        if _already_checkpointed(model):
            notes.append("the model's own gradient checkpointing is on (gradient_checkpointing_enable()): its "
                         "layers are already recomputed, so the plan adds nothing on top; turn it off "
                         "(gradient_checkpointing_disable()) to let the plan checkpoint only where needed")
            planned_blocks: list[str] = []
        elif actions:
            planned_blocks = [b for b in block_paths if rows[b].kept_bytes > 0]
        else:  # (offload alone, on CPU: nothing to plan with, noted above)
            planned_blocks = []
        # a part is worth planning where its checkpoint keeps less than the part does (its inputs instead)
        planned_parts = [p for p in part_paths if any(p.startswith(b + ".") for b in planned_blocks)
                         and rows[p].kept_bytes > rows[p].input_bytes]
        units = planned_blocks + planned_parts
        seconds = block_forward_seconds(model, units, args, kwargs) if units else {}
        seconds = _alike_timed_alike(unwrap(model), rows, seconds)
        bandwidth = host_copy_bytes_per_second(device) if "offload" in actions else 0.0
        # offloading's cost measured per unit (its per-tensor host work), never below what the bandwidth allows
        offload_seconds = (_alike_timed_alike(unwrap(model), rows, block_offload_seconds(model, units, args, kwargs))
                           if bandwidth > 0 and units else {})

        def offload_cost(path: str) -> float:
            return max(offload_seconds.get(path, 0.0), 2 * rows[path].kept_bytes / bandwidth)

        def cost(path: str) -> tuple[str, float]:
            options = []
            if "checkpoint" in actions:
                options.append(("checkpoint", seconds.get(path, 0.0)))
            if "offload" in actions and bandwidth > 0:
                options.append(("offload", offload_cost(path)))
            return min(options, key=lambda o: o[1])

        choice = {p: cost(p) for p in units}

        def freed(path: str) -> int:
            """What a unit's action frees: checkpointing keeps the unit's inputs instead of its activations."""
            row = rows[path]
            return row.kept_bytes - (row.input_bytes if choice[path][0] == "checkpoint" else 0)

        # bytes freed per second of extra time, best first; ties (alike units) in model order, so the same model
        # and budget give the same plan from run to run
        position = {p: i for i, p in enumerate(units)}

        def ranked(candidates: list[str]) -> list[str]:
            return sorted(candidates, key=lambda p: (-max(freed(p), 0) / max(choice[p][1], 1e-9), position[p]))

        def taken(order: list[str]):
            """The units taken after each of ``order``'s: a block taken after some of its parts replaces them, a
            part taken after its block adds nothing."""
            acts: dict[str, str] = {}
            for p in order:
                if not any(p.startswith(q + ".") for q in acts):
                    for q in [q for q in acts if q.startswith(p + ".")]:
                        del acts[q]
                    acts[p] = choice[p][0]
                yield acts

        def acts_for(order: list[str], k: int) -> dict[str, str]:
            """The first k units of ``order``, as :func:`taken` takes them."""
            return dict(next(itertools.islice(taken(order), k - 1, None))) if k else {}

        tried = {(): before}  # planned actions -> estimate; checkpointing can also raise a peak (the recompute)

        def at(acts: dict[str, str]) -> MemoryEstimate:
            key = tuple(sorted(acts.items()))
            if key not in tried:
                tried[key] = run(acts)
            return tried[key]

        def guess(order: list[str]) -> int:
            """How many units of ``order`` free the bytes the budget needs, were each unit's saving taken off
            the peak: where the search starts (an estimate costs seconds; the freed bytes are known)."""
            need = before.peak_bytes - budget_bytes
            for k, acts in enumerate(taken(order), 1):
                if sum(max(freed(q), 0) for q in acts) >= need:
                    return k
            return len(order)

        def search(order: list[str]) -> dict[str, str] | None:
            """The fewest units of ``order`` (cheapest first) that meet the budget; None if all of them do not."""
            n = len(order)
            if at(acts_for(order, n)).peak_bytes > budget_bytes:
                return None
            k = first_fitting(n, lambda k: at(acts_for(order, k)).peak_bytes <= budget_bytes, guess(order))
            return acts_for(order, k)

        def upgrades(order: list[str]) -> list[dict[str, str]]:
            """Every unit of ``order`` at its cheaper action (``choice``'s), then the fewest of the checkpointed
            ones offloaded that meet the budget, those that free the most (their inputs) per extra second first."""
            base = {p: choice[p][0] for p in order}
            ups = sorted((p for p in order if base[p] == "checkpoint"),
                         key=lambda p: (-rows[p].input_bytes / max(offload_cost(p) - seconds.get(p, 0.0), 1e-9),
                                        position[p]))

            def upgraded(k: int) -> dict[str, str]:
                return {**base, **{p: "offload" for p in ups[:k]}}

            if not ups or at(upgraded(len(ups))).peak_bytes > budget_bytes:
                return []
            return [upgraded(first_fitting(len(ups), lambda k: at(upgraded(k)).peak_bytes <= budget_bytes, 1))]

        def lowest(start: dict[str, str]) -> dict[str, str]:
            """``start`` less the units whose action raises the peak, last in model order first, until three in a
            row do not lower it. The searches above try every unit of an order at once where nothing fits, but
            checkpointing a late block can raise the peak (its recomputation runs while the loss's gradients are
            alive: a ConvNeXt's last stage, a GPT-2's last layer), so fewer units can reach lower."""
            best, misses = dict(start), 0
            for p in sorted(start, key=lambda p: -position[p]):
                trial = {q: a for q, a in best.items() if q != p}
                if at(trial).peak_bytes < at(best).peak_bytes:
                    best, misses = trial, 0
                else:
                    misses += 1
                    if misses == 3:
                        break
            return best

        def lowest_tried() -> dict[str, str]:
            return lowest(dict(min(tried, key=lambda k: (tried[k].peak_bytes, len(k)))))

        def action_seconds(path: str, action: str) -> float:
            return seconds.get(path, 0.0) if action == "checkpoint" else offload_cost(path)

        def extra(acts: dict[str, str]) -> float:
            return sum(action_seconds(p, a) for p, a in acts.items())

        # every part, and each block without parts whole: where recomputing a whole block at once is the peak,
        # recomputing its parts one by one stays lower (a UNet's up block: 20.6 MiB against 22.3 MiB every block),
        # so this, not every block, can be the lowest peak a plan reaches
        whole = [b for b in planned_blocks if not any(p.startswith(b + ".") for p in planned_parts)]
        finest = ranked(planned_parts) + ranked(whole)
        chosen: dict[str, str] = {}
        if before.peak_bytes > budget_bytes and units:
            # the greedy order by bytes freed per second overshoots where a budget needs only a little: a block
            # frees more per second than its parts, yet two parts may free enough for less time than one block.
            # So these orders are searched: blocks alone, blocks and parts together, parts before blocks, and
            # parts without the blocks that have them
            def orders() -> list[list[str]]:
                found_orders = [ranked(planned_blocks)]
                if planned_parts:
                    found_orders += [ranked(units), ranked(planned_parts) + ranked(planned_blocks),
                                     ranked(planned_parts) + ranked(whole)]
                return found_orders

            found = [a for a in (search(o) for o in orders()) if a is not None]
            if not found:  # every unit of an order peaks above the budget, yet fewer units can peak lower
                low = lowest_tried()
                if at(low).peak_bytes <= budget_bytes:
                    found = [low]
            if not found and "checkpoint" in actions and "offload" in actions and bandwidth > 0:
                # each unit's cheaper action cannot meet the budget: offloading frees a unit's whole kept bytes
                # where checkpointing keeps its inputs (the H200's QLoRA at a 50 % budget: batch 14 with the
                # cheaper checkpoints, 23 offloaded). Two ways on, the cheaper plan of the two taken: the fewest
                # units offloaded, and every unit at its cheaper action with the fewest of them offloaded instead
                found = upgrades(finest)
                choice.update({p: ("offload", offload_cost(p)) for p in units})
                found += [a for a in (search(o) for o in orders()) if a is not None]
            if found:
                chosen = min(found, key=lambda a: (extra(a), len(a)))
            else:  # nothing fits: the lowest peak a plan reaches (the smallest budget the refusal names)
                chosen = lowest_tried()
        elif units:  # for smallest_feasible
            at(acts_for(units, len(units)))
            if planned_parts:
                at(acts_for(finest, len(finest)))
            if "checkpoint" in actions and "offload" in actions and bandwidth > 0:
                # (offloading every unit frees more than checkpointing it, where the cheaper action was the latter)
                at({p: "offload" for p in planned_blocks})
        after = at(chosen)
        smallest = min(e.peak_bytes for e in tried.values())
        fits = after.peak_bytes <= budget_bytes
        if before.peak_bytes <= budget_bytes:
            notes.append("slimgrad's minimal saving alone fits: nothing is checkpointed or offloaded")
        elif not fits:
            notes.append(f"the peak is at {after.peak_where}; no plan lowers it below {_gib(smallest)}")
            if ("cross_entropy" in after.peak_where or "LogSoftmax" in after.peak_where
                    or "lm_head" in after.peak_where):
                notes.append("the peak is in the loss: slimgrad.convert(model, chunked_loss=True) computes it in "
                             "chunks (then a training forward returns no logits)")
        choices = []
        for b in block_paths:  # each block, then its parts the plan takes
            for path in [b, *(p for p in part_paths if p in chosen and p.startswith(b + "."))]:
                action = chosen.get(path, "keep")
                extra_s = action_seconds(path, action) if action != "keep" else 0.0
                choices.append(BlockChoice(path, action, rows[path].kept_bytes, seconds.get(path, 0.0), extra_s))
        return MemoryPlan(budget=budget_bytes, device=device, peak_before=before.peak_bytes,
                          peak_after=after.peak_bytes, smallest_feasible=smallest, fits=fits, blocks=choices,
                          extra_seconds=sum(c.extra_seconds for c in choices), notes=notes,
                          converted=any(changes_what_is_kept(type(m)) for m in model.modules()),
                          estimate_before=before, estimate_after=after)
    finally:
        apply_plan(model, previous)
