"""Counting what backward keeps, and the peak of a step.

Saved bytes are counted with ``torch.autograd.graph.saved_tensors_hooks``, so they see exactly what every
autograd node (stock or ours) stores through ``save_for_backward``. Storages are counted once, however many
nodes keep them, and parameters and buffers are left out: they exist whether or not backward runs.

On the meta device nothing is allocated, but every tensor has a shape, a dtype and a storage size, so saved
bytes are counted there too (a model built under ``torch.device("meta")`` can be measured before it is
materialised); the peak cannot be, and :func:`peak_bytes` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["SavedTensors", "saved_bytes", "saved_in_graph", "graph_saved_bytes", "peak_bytes"]


@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One storage kept for backward: the first tensor seen on it and the storage's size."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _storage_key(t: torch.Tensor):
    """(device, storage address) and storage bytes; for wrapper subclasses without a real storage (torchao's
    NF4Tensor, ...) the key of their first inner tensor and the sum of their inner tensors' storages."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        names, _ = flatten()
        inner = [getattr(t, n) for n in names if isinstance(getattr(t, n, None), torch.Tensor)]
        parts = [_storage_key(i) for i in inner]
        parts = [p for p in parts if p[0] is not None]
        if parts:
            return parts[0][0], sum(nbytes for _, nbytes in parts)
    try:
        storage = t.untyped_storage()
        # meta storages have no address (data_ptr() is 0 for all of them, parameters included, which made every
        # saved meta tensor look like an excluded parameter): there the storage object itself identifies them
        address = storage._cdata if t.device.type == "meta" else storage.data_ptr()
        return (t.device.type, t.device.index, address), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None, 0


def _exclude_list(exclude, fn: str) -> list:
    """``exclude`` as a list of modules and tensors, or a TypeError naming the argument."""
    if isinstance(exclude, (nn.Module, torch.Tensor)):
        return [exclude]  # one given alone
    try:
        items = list(exclude)
    except TypeError:
        raise TypeError(f"{fn}: 'exclude' must be modules or tensors (one, or an iterable of them), got "
                        f"{type(exclude).__name__}") from None
    for item in items:
        if not isinstance(item, (nn.Module, torch.Tensor)):
            raise TypeError(f"{fn}: 'exclude' must hold modules or tensors, got a {type(item).__name__}")
    return items


def _excluded_keys(exclude: Iterable) -> set:
    keys = set()
    for item in exclude:
        tensors = (
            list(item.parameters()) + list(item.buffers()) if isinstance(item, nn.Module) else [item]
        )
        for t in tensors:
            key, _ = _storage_key(t)
            if key is not None:
                keys.add(key)
    return keys


class SavedTensors:
    """Context manager counting the bytes autograd keeps for backward while it is active.

    ``exclude``: modules (their parameters and buffers) or tensors whose storages are not counted.
    Parameters (``nn.Parameter``) and views of them (the ``weight.t()`` a matmul keeps) are never counted. After
    the block, ``.bytes`` holds the total and ``.records`` one :class:`SavedRecord` per distinct storage.
    """

    def __init__(self, exclude: Iterable = ()):
        self._exclude_items = _exclude_list(exclude, "SavedTensors")
        self.records: list[SavedRecord] = []
        self._seen: set = set()
        self._hooks = None

    @property
    def bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def _pack(self, t: torch.Tensor):
        # a parameter, or a view of one (a matmul keeps ``weight.t()``, a plain tensor on the parameter's storage)
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            key, nbytes = _storage_key(t)
            if key is not None and key not in self._seen and key not in self._excluded:
                self._seen.add(key)
                self._alive.append(t)
                self.records.append(SavedRecord(tuple(t.shape), t.dtype, nbytes))
        return t

    def __enter__(self) -> SavedTensors:
        self._excluded = _excluded_keys(self._exclude_items)
        # Storages are told apart by address, so none of those counted or excluded may be freed before the block
        # ends: the allocator may give a freed one's address to a new saved tensor, which was then taken for it
        # (excluded, or merged). A parameter's storage is freed when a layer replaces it in its forward
        # (bitsandbytes packs a Linear4bit weight for its CPU kernel on a first eval-mode forward: 48 or 49
        # storages between identical runs of a QLoRA Llama); a saved one when its graph branch is dropped.
        # Detached aliases hold them (for the block only; the graph holds the saved ones anyway).
        self._alive = [t.detach() for item in self._exclude_items
                       for t in (list(item.parameters()) + list(item.buffers()) if isinstance(item, nn.Module)
                                 else [item])]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._alive = []


def saved_bytes(fn: Callable, *args, exclude: Iterable = (), **kwargs) -> int:
    """Bytes that autograd keeps for backward when calling ``fn(*args, **kwargs)``.

    The count happens while ``fn`` runs, so pass the callable and its inputs, not a result:
    ``saved_bytes(model, x)``, ``saved_bytes(model, input_ids=ids)`` or ``saved_bytes(lambda: model(x))``.
    ``saved_bytes(model(x))`` raises a TypeError saying so: by the time it is called the forward is over.
    When ``fn`` is a module, its parameters and buffers are excluded. The result of ``fn`` is dropped.
    """
    if not callable(fn):
        got = type(fn).__name__
        raise TypeError(f"saved_bytes: 'fn' must be the callable to run (a module or a function), got a {got}: "
                        f"saved_bytes counts while the forward runs, so call saved_bytes(model, x) or "
                        f"saved_bytes(lambda: model(x)), not saved_bytes(model(x))")
    extra = [fn] if isinstance(fn, nn.Module) else []
    with SavedTensors(exclude=_exclude_list(exclude, "saved_bytes") + extra) as counter:
        fn(*args, **kwargs)
    return counter.bytes


def _physical(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch's wrappers (grad levels, vmap's batched tensors): for a batched tensor
    that is the whole batch, which is what memory holds."""
    from torch._C._functorch import get_unwrapped, is_batchedtensor, is_gradtrackingtensor

    while is_batchedtensor(t) or is_gradtrackingtensor(t):
        t = get_unwrapped(t)
    return t


_CORE_NODE = "torch::autograd::CppNode<slimgrad::"


def saved_in_graph(*outputs: torch.Tensor, exclude: Iterable = ()) -> list[SavedRecord]:
    """What the autograd graph behind ``outputs`` keeps for backward, read from the graph itself: one
    :class:`SavedRecord` per distinct storage, parameters and ``exclude`` (modules or tensors) left out.

    The counterpart of :class:`SavedTensors` under ``torch.func`` (``grad``, ``vmap(grad(...))``, ``jacrev``),
    which refuses saved-tensor hooks: call it inside the transformed function on the tensors whose graph
    matters (the model's output, say), before returning. Stock nodes expose what they saved as ``_saved_*``
    attributes, custom Functions as ``saved_tensors``; functorch's wrappers are looked through, so under a
    ``vmap`` a record is the whole batch's storage. Tensors kept as ctx attributes are not seen (slimgrad keeps
    none). Outside transforms it agrees with :func:`saved_bytes` for the same forward, where the forward ran
    slimgrad's Python path: the compiled core's C++ nodes do not show their saved tensors to Python, so a graph
    holding one is refused with a ValueError that says what to use instead.
    """
    for k, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"saved_in_graph: the outputs must be tensors (whose autograd graph is read), got a "
                            f"{type(o).__name__} at position {k}")
    excluded = _excluded_keys(_exclude_list(exclude, "saved_in_graph"))
    seen_nodes, seen, records = set(), set(), []
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen_nodes:
            continue
        seen_nodes.add(node)
        if node.name().startswith(_CORE_NODE):
            raise ValueError(
                "saved_in_graph: the graph holds a node of slimgrad's compiled core (a C++ autograd Function, "
                f"{node.name()}), whose saved tensors Python cannot read. In eager mode count with "
                "slimgrad.measure.SavedTensors / saved_bytes (saved-tensor hooks see the core's tensors), or run the "
                "forward under slimgrad.csrc.disabled(); under torch.func the core never runs.")
        values = []
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                values.extend(value if isinstance(value, (tuple, list)) else (value,))
        if hasattr(node, "saved_tensors"):
            values.extend(node.saved_tensors)
        for value in values:
            if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
                continue
            t = _physical(value)
            key, nbytes = _storage_key(t)
            if key is not None and key not in seen and key not in excluded:
                seen.add(key)
                records.append(SavedRecord(tuple(t.shape), t.dtype, nbytes))
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return records


def graph_saved_bytes(*outputs: torch.Tensor, exclude: Iterable = ()) -> int:
    """Bytes of :func:`saved_in_graph` (``outputs``' autograd graph, under torch.func transforms too)."""
    return sum(r.nbytes for r in saved_in_graph(*outputs, exclude=exclude))


def peak_bytes(fn: Callable, *args, **kwargs) -> int:
    """Peak bytes allocated above the starting level while ``fn(*args, **kwargs)`` runs.

    On CUDA (a CUDA tensor among the arguments, or none at all while CUDA is in use and the step allocates
    there) this is ``max_memory_allocated``; on CPU it replays the profiler's allocation records (every
    allocation and free, including those inside C++ kernels), so temporaries inside a backward kernel
    count. The result of ``fn`` is released before returning.

    On CPU, only the blocks the call allocates are counted: memory made before the call and freed inside it is not
    subtracted (the profiler knows such a block's size only if an earlier profile saw it made, and may keep a
    stale size for a reused address, so counting it would make the reading depend on what ran before). A step that
    starts with ``zero_grad(set_to_none=True)`` while gradients exist therefore reads higher by those gradients
    than ``max_memory_allocated`` would on CUDA. Measure from a start without them (set the gradients to None
    before the call), as slimgrad's estimate describes the step and its tests and benchmarks measure it.
    """
    import gc

    if not callable(fn):
        raise TypeError(f"peak_bytes: 'fn' must be the callable to run (a step: peak_bytes(lambda: step(batch)), or "
                        f"a module and its inputs), got a {type(fn).__name__}: the peak is measured while it runs")
    gc.collect()  # garbage of earlier steps freed inside the measured one would count against it
    device = next(
        (a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)),
        None,
    )
    if device is None and _meta_referenced(fn):
        device = torch.device("meta")
    if device is not None and device.type == "meta":
        raise ValueError("peak_bytes: the inputs are on the meta device, which allocates no memory, so there is no "
                         "peak to measure; slimgrad.saved_bytes counts what backward keeps on meta tensors (from "
                         "their shapes), peak_bytes needs a real device (cpu, cuda)")
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # A closure (``peak_bytes(lambda: step(model, batch))``) names no device: measure CUDA too and report it
        # when the step allocated there (the CPU allocator records see none of a GPU step's tensors).
        cuda = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(cuda)
        start = torch.cuda.memory_allocated(cuda)
        torch.cuda.reset_peak_memory_stats(cuda)
        cpu_peak = _cpu_peak(fn, *args, **kwargs)
        torch.cuda.synchronize(cuda)
        cuda_peak = torch.cuda.max_memory_allocated(cuda) - start
        return cuda_peak if cuda_peak > 0 else cpu_peak
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn(*args, **kwargs)
        del out
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    return _cpu_peak(fn, *args, **kwargs)


def _is_meta(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, nn.Module):
        if offloaded_by_accelerate(value):
            return False  # on meta between calls only: accelerate's hooks bring each weight in for its forward
        first = next(value.parameters(), None)
        if first is None:
            first = next(value.buffers(), None)
        return first is not None and first.is_meta
    return False


def offloaded_by_accelerate(model: nn.Module) -> bool:
    """Whether accelerate offloads some of the model's weights (``cpu_offload``, ``disk_offload``, a ``device_map``
    with "cpu" or "disk" entries under ``dispatch_model``): they sit on the meta device between calls, and a hook
    loads each module's weights for its forward and puts them back after it."""
    for m in model.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in [hook, *getattr(hook, "hooks", ())]:
            if getattr(h, "offload", False) is True:
                return True
    return False


def _meta_referenced(fn) -> bool:
    """Whether the closure ``fn`` reaches meta tensors or a model on meta: a module called directly, a bound
    method's owner, a partial's arguments, a function's closure cells and the global names its code reads (the
    README's ``peak_bytes(lambda: model(x).sum().backward())`` at a script's top level reads globals). Meta tensors
    allocate nothing, so such a step has no peak: measured, it read 16 bytes."""
    import functools

    seen = []
    if isinstance(fn, functools.partial):
        seen += list(fn.args) + list(fn.keywords.values())
        fn = fn.func
    seen.append(fn)
    seen.append(getattr(fn, "__self__", None))
    code = getattr(fn, "__code__", None)
    if code is not None:
        seen += [cell.cell_contents for cell in (fn.__closure__ or ()) if _cell_filled(cell)]
        glob = getattr(fn, "__globals__", {})
        seen += [glob[name] for name in code.co_names if name in glob]
    return any(_is_meta(v) for v in seen)


def _cell_filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True


def _cpu_peak(fn: Callable, *args, **kwargs) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
        del out
    allocations = sorted(_allocation_events(prof.profiler.kineto_results.experimental_event_tree()),
                         key=lambda e: e.start_time_ns)
    made: dict[int, int] = {}  # address -> bytes of a block the call allocated and has not freed
    current = peak = 0
    for e in allocations:
        fields = e.extra_fields
        if fields.device.type != "cpu":
            continue
        if fields.alloc_size > 0:
            made[fields.ptr] = fields.alloc_size
            current += fields.alloc_size
            peak = max(peak, current)
        else:
            # A free of a block made before the call: the profiler knows its size only if an earlier profile saw
            # it made, and may hold a stale size for a reused address. Never counted, so the reading does not
            # depend on what ran before.
            current -= made.pop(fields.ptr, 0)
    return peak


def _allocation_events(nodes):
    """The allocation records in the profiler's event tree (each holds the address, which the flat list lacks)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            yield node
        stack.extend(node.children)
