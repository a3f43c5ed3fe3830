"""``slimgrad.estimate``: the peak memory of one training step, known before the step runs.

The step (forward, loss, backward, and optionally the optimizer's step) runs once on fake tensors
(``torch._subclasses.FakeTensorMode``: the shapes, dtypes, strides and devices of the real run, no data), so
nothing the size of an activation is allocated. An allocator simulation watches every op the dispatcher sees
(forward, backward, optimizer) and replays what a real allocator would hold:

* an op's outputs that bring a new storage are an allocation of that storage's bytes (rounded to the CUDA
  caching allocator's 512-byte blocks on CUDA);
* a storage is freed when no tensor, view or autograd node refers to it any more; frees are looked for before
  each op, so the bytes alive while an op runs are exactly those that a real run holds then;
* parameters, buffers and inputs are alive from the start; gradients are the storages that end up in a
  parameter's ``.grad``; optimizer state is what the optimizer's step allocates and keeps.

Why fake tensors rather than the meta device: fake tensors report the real device, so every layer (stock,
slimgrad's Python path, Hugging Face's attention dispatch) takes the branch it takes in the real run.
Not seen: scratch space a kernel allocates and frees inside one op (oneDNN's convolution backward on CPU,
cuDNN's workspace on CUDA). The tests measure how far that puts the estimate from the allocator's records.

Counted although the allocator's records miss it: with the compiled core off (``SLIMGRAD_CORE=0``), slimgrad's
Python path packs and unpacks its CPU masks (ReLU, dropout, clamp) with numpy, whose arrays are memory of the
process that torch's allocator, and so the profiler's records behind :func:`slimgrad.peak_bytes`, never see. The
estimate counts them while they are alive (a packed mask kept for backward, an unpacked one while backward reads
it), so there it is above ``peak_bytes`` by the numpy bytes alive at the peak. Measured (tracemalloc's numpy
domain at the end of the real forward, one thread, ``OMP_NUM_THREADS=1``): the in-repo ResNet-18 (width 0.25, 2×32²)
+7144 B (0.24 %: its peak is the stem ReLU's backward, where numpy holds that ReLU's packed and unpacked mask, 9216
B), at 8×64² +16384 B (0.31 %: the packed masks), an MLP with one dropout +1024 B (its packed mask); the same steps
simulated without the numpy arrays are the measured peaks (to 1 B).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import numbers
import os
import re
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._forwards import forwards_wrapped

__all__ = ["BlockEstimate", "MemoryEstimate", "MemoryScaling", "blocks_of", "estimate", "largest_fitting",
           "parse_bytes", "scaling", "split_example"]

_CUDA_BLOCK = 512


def parse_bytes(value, what: str = "budget") -> int:
    """``12GiB``, ``"800 MB"``, ``1.5e9`` or an int: bytes. GiB/MiB/KiB are powers of 1024, GB/MB/kB of 1000 (units
    in any case); a fraction of a byte is dropped, and what is left must be at least one byte."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected a number of bytes or a string like '12GiB', got {value!r}")
    if isinstance(value, numbers.Real):
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"{what}: expected a positive number of bytes (finite, at least 1), got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*\+?([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kmgt]i?b|b)?\s*", value, re.IGNORECASE)
        if m:
            unit = (m.group(2) or "B").upper().replace("IB", "iB")
            scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
            n = float(m.group(1)) * scale
            if math.isfinite(n) and n >= 1:
                return int(n)
    raise ValueError(f"{what}: expected a positive number of bytes or a string like '12GiB', '800MB', got {value!r}")


def _gib(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    if abs(n) >= 2**20 // 10:  # (below 0.1 MiB, "0.0 MiB" read as nothing: a small model's budget and peak)
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def split_example(example) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one batch: a dict (or ``BatchEncoding``) is keyword inputs, a tuple or list is
    positional inputs, a tensor is the one positional input."""
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    if isinstance(example, torch.Tensor):
        return (example,), {}
    raise TypeError(f"'example' must be a batch: a dict of keyword inputs, a tensor, or a tuple of positional "
                    f"inputs, got {type(example).__name__}")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` / ``torch.compile`` wrappers, which
    :func:`estimate` and :func:`slimgrad.plan` work on (block paths are the inner module's).

    Why: DDP's forward drives its reducer (fake parameters never report their gradients, and after a real
    step it touches its real buckets), and a compiled module's forward would trace fake tensors. What the
    estimate gives is the eager step of the inner module, per rank: DDP adds its gradient buckets (one more
    copy of the trainable parameters' gradients, none with ``gradient_as_bucket_view=True``), and a compiled
    graph usually holds less (fused temporaries)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DataParallel, DistributedDataParallel)) and isinstance(model.module, nn.Module):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


# -- blocks -------------------------------------------------------------------------------------------------


def _is_block(m: nn.Module) -> bool:
    """A module worth a plan's decision: it holds parameters and has modules of its own (a layer, a stage),
    not a single conv, activation or dropout."""
    return any(True for _ in m.children()) and any(True for _ in m.parameters())


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch's fake tensors log a failed meta kernel (the user's wrong shape) with its whole traceback at ERROR
    before raising; the estimate raises that error itself, named: the log is left out."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def misspelt_option(model: nn.Module, kwargs: dict, options: tuple[str, ...], fn: str) -> None:
    """Refuse a keyword that is not a parameter of ``model.forward`` but reads like one of ``fn``'s ``options``
    (``optimiser="adamw"``): a forward taking ``**kwargs`` (every Hugging Face model) ignores it, and the figure
    came out without the option, silently (41 % low without the optimizer's state)."""
    import difflib
    import inspect

    if not isinstance(model, nn.Module):
        return  # (the caller's own check names it)
    try:
        named = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return
    for key in kwargs:
        if key in named:
            continue
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
        if close:
            raise TypeError(f"{fn}: got {key!r}, which {type(model).__name__}.forward does not name (it would ignore "
                            f"it): did you mean {fn}'s option {close[0]!r}?")


def block_list(blocks, fn: str) -> list[str]:
    """``blocks`` as a list of module paths (one path alone is one block, not its letters)."""
    if isinstance(blocks, str):
        return [blocks]
    if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, str) for b in blocks):
        raise TypeError(f"{fn}: 'blocks' must be a list of module paths (str), got {blocks!r}")
    return list(blocks)


def blocks_of(model: nn.Module) -> list[str]:
    """The blocks a plan decides about: the composite children (modules of modules, holding parameters) of the
    outermost ``nn.ModuleList``/``nn.Sequential`` that has at least two of them — a transformer's layers (an
    encoder's and a decoder's), a ResNet's residual blocks, a UNet's down, mid and up blocks. Single layers
    (a conv, an activation, a dropout) are never blocks: recomputing one saves nothing worth its time. A model
    without such a list: its composite top-level children, else its top-level children with parameters."""
    lists: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        if any(p == "" or path.startswith(p + ".") for p, _ in lists):
            continue  # inside a kept list: its blocks are decided as a whole
        if sum(1 for k in m.children() if _is_block(k)) >= 2:
            lists.append((path, m))
    blocks = [f"{path}.{name}" if path else name
              for path, m in lists for name, k in m.named_children() if _is_block(k)]
    if not blocks:
        blocks = [name for name, m in model.named_children() if _is_block(m)]
    if not blocks:
        blocks = [name for name, m in model.named_children() if any(True for _ in m.parameters())]
    return blocks


# -- results ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BlockEstimate:
    """One block's share: its parameters, their gradients and optimizer state, the activations it keeps for
    backward (alive at the end of forward), and the most bytes alive while it ran (forward or backward)."""

    path: str
    weight_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_bytes: int = 0
    kept_bytes: int = 0
    peak_bytes: int = 0
    forward_flops: int = 0
    input_bytes: int = 0  # the block's tensor inputs (first call): what checkpointing it keeps instead


@dataclasses.dataclass
class MemoryEstimate:
    """What one training step holds, simulated on fake tensors (see :mod:`slimgrad.estimate`).

    ``peak_bytes`` is the most bytes alive at any point of the step, everything included (parameters,
    buffers, inputs, gradients, optimizer state, activations kept for backward, temporaries).
    ``step_peak_bytes`` is the part above what existed before the step began (parameters, buffers, inputs,
    and optimizer state when it already exists): what :func:`slimgrad.peak_bytes` measures around a step.
    ``at_peak`` splits the peak by kind; ``blocks`` splits it per block (:func:`blocks_of`)."""

    peak_bytes: int
    step_peak_bytes: int
    weight_bytes: int
    input_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    kept_bytes: int
    at_peak: dict[str, int]
    peak_where: str
    blocks: list[BlockEstimate]
    device: str
    host_peak_bytes: int = 0
    #: under autocast (its weight cache on): the bytes of the low-precision copies autocast made of trainable leaf
    #: tensors (a LoRA's A and B, trainable weights), counted in ``step_peak_bytes`` as a step in its own autocast
    #: region makes them. Autocast caches them until its region exits: a loop whose one region spans several steps
    #: holds them from its first step on, and its later steps peak this much lower above their start (the same
    #: ``peak_bytes``). An upper bound: the simulation cannot tell autocast's cast from the model's own ``.to()`` of
    #: such a tensor (or one in an autocast-disabled part), which autocast does not cache and which it counts too
    autocast_cache_bytes: int = 0
    #: what the estimate could not count (ops too large to replay for their scratch space)
    notes: list[str] = dataclasses.field(default_factory=list)
    timeline: list[tuple[int, str, int]] = dataclasses.field(repr=False, default_factory=list)

    def fits(self, budget) -> bool:
        return self.peak_bytes <= parse_bytes(budget)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        return d

    def __str__(self) -> str:
        lines = [f"slimgrad.estimate: peak {_gib(self.peak_bytes)} on {self.device} "
                 f"({_gib(self.step_peak_bytes)} above the step's start), at {self.peak_where}",
                 "  at the peak: " + ", ".join(f"{k} {_gib(v)}" for k, v in self.at_peak.items() if v),
                 f"  weights {_gib(self.weight_bytes)}, inputs {_gib(self.input_bytes)}, gradients "
                 f"{_gib(self.gradient_bytes)}, optimizer state {_gib(self.optimizer_bytes)}, kept for backward "
                 f"{_gib(self.kept_bytes)}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.blocks:
            w = max(len(b.path) for b in self.blocks)
            lines.append(f"  {'block':<{w}}  {'weights':>10}  {'grads':>10}  {'optim':>10}  {'kept':>10}  {'peak':>10}")
            for b in self.blocks:
                lines.append(f"  {b.path:<{w}}  {_gib(b.weight_bytes):>10}  {_gib(b.gradient_bytes):>10}  "
                             f"{_gib(b.optimizer_bytes):>10}  {_gib(b.kept_bytes):>10}  {_gib(b.peak_bytes):>10}")
        return "\n".join(lines)


# -- the allocator simulation -------------------------------------------------------------------------------


def _storage(t: torch.Tensor):
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: str

    def real(self) -> torch.Tensor:
        extent = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride)) + 1 if all(self.shape) else 0
        base = torch.empty(max(extent, 1), dtype=self.dtype, device=self.device)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            # the user's generator is not advanced: an estimate (or a plan) must not change the run's random draws
            with torch.random.fork_rng(devices=[base.device] if base.device.type == "cuda" else []):
                base.normal_()
        else:
            base.zero_()
        return base.as_strided(self.shape, self.stride, self.offset)


#: aten ops whose kernels allocate scratch space inside one call (oneDNN convolution, im2col, flash attention
#: on CPU, oneDNN matmul packing, the embedding backward's counts; CPU upsampling's forward, about one more output;
#: (log-)softmax's contiguous copy of a channels-last input, as SegFormer's loss makes): measured once per distinct
#: signature (the last two found by the vision sweep of 2026-11-27: 50 % and 1.4-1.7 % low before)
_SCRATCH_OPS = re.compile(r"conv|mkldnn|_scaled_dot_product|attention|^(mm|bmm|addmm|baddbmm|addbmm|_grouped_mm)$|"
                          r"norm.*backward|embedding.*backward|pool.*backward|_softmax_backward|nll_loss|"
                          r"_fft|linalg|^upsample|^_log_softmax$|^_softmax$|_weight_int|_convert_weight")


def _mixed_dtypes(args) -> bool:
    """Tensors of two floating dtypes in one op (bf16 + fp32), or a bool tensor with one of another dtype (a gradient's
    bits times a 0/1 mask): TensorIterator may cast one into a temporary copy inside the op (an add of bf16 and fp32
    on CPU holds twice its output; ``int32 * bool`` casts the mask to int32 first: a ReLU6 step's peak, 12544 B
    missed by the estimate)."""
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim()}
    if len(dtypes) < 2:
        return False
    return torch.bool in dtypes or sum(1 for d in dtypes if d.is_floating_point) > 1


_REDUCTIONS = frozenset({"sum", "nansum", "prod", "mean", "cumsum", "cumprod"})

#: ops whose real kernels refuse operands of different dtypes, where the meta kernels fake tensors run do not check
#: (an fp64, bf16 or int64 batch into fp32 Linear layers was estimated, where the real step raises)
_ONE_DTYPE_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "convolution"))


def _check_one_dtype(func, args) -> None:
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    if len(set(dtypes)) > 1:
        raise RuntimeError(f"{func.__name__.split('.')[0]}: expected its operands to have one dtype, got "
                           f"{', '.join(str(d).replace('torch.', '') for d in dtypes)} (the real step raises here: "
                           f"does the example's dtype match the model's?)")


def _casts_to_reduce(func, args, out) -> bool:
    """A reduction whose output dtype is not its input's (a bool or int32 tensor summed to int64, ``sum(dtype=)``):
    on CPU it first casts the whole input to the output's dtype, inside the op (a 32x1024 bool mask's ``sum()``
    holds 262144 B there, a step's peak the estimate missed)."""
    return (func.__name__.split(".")[0] in _REDUCTIONS and len(args) > 0 and isinstance(args[0], torch.Tensor)
            and args[0].dim() > 0 and isinstance(out, torch.Tensor) and out.dtype != args[0].dtype)


def _spec_of(x):
    if isinstance(x, torch.Tensor):
        return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_spec_of(v) for v in x)  # hashable; aten takes a tuple for a list argument
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format)):
        return x
    raise TypeError  # not replayable


def _signature(func, args, kwargs) -> tuple | None:
    """The op and its arguments' specs, hashable, to run it again on real stand-ins; None where an argument is not
    replayable."""
    try:
        sig = (func, _spec_of(tuple(args)), tuple(sorted((k, _spec_of(v)) for k, v in kwargs.items())))
        hash(sig)
    except TypeError:
        return None
    return sig


def _real_of(x):
    if isinstance(x, _TensorSpec):
        return x.real()
    if isinstance(x, tuple):
        return [_real_of(v) for v in x]
    return x


def _is_packed_param(x) -> bool:
    """A real Parameter subclass that only adds attributes (bitsandbytes' ``Params4bit``, ``Int8Params``): the
    packed weights the estimate leaves real. torch 2.13's fake mode converts such a tensor where an op reads it;
    older releases (2.11, on the GPU machine) answer NotImplemented for any type but Tensor and Parameter, so an op
    on it (``B.view(-1, 1)`` in ``matmul_4bit``) failed with "all __torch_dispatch__ handlers returned
    NotImplemented"."""
    return (isinstance(x, nn.Parameter) and type(x) is not nn.Parameter and not _is_fake(x)
            and type(x).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def _has_packed_param(args, kwargs) -> bool:
    # (per op: a fake tensor, most arguments, is never a packed weight, and is skipped before Parameter's
    # Python-level isinstance check)
    fake = _fake_tensor_type()
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) is fake:
            continue
        if isinstance(a, (list, tuple)):
            if any(type(b) is not fake and _is_packed_param(b) for b in a):
                return True
        elif _is_packed_param(a):
            return True
    return False


def _as_fake_params(fake_mode, args, kwargs):
    """The packed weights in an op's arguments as fake mode's own (memoized) fakes of them: the same fake tensors
    that the estimate counted as weights, on every torch release."""
    def convert(x):
        return fake_mode.from_tensor(x, static_shapes=True) if _is_packed_param(x) else x

    return _pytree.tree_map_only(torch.Tensor, convert, (tuple(args), kwargs))


#: aten ops whose autograd formula saves the operand a Python number became, for the tensor's gradient
_SAVES_NUMBER = frozenset({torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor, torch.ops.aten.div.Tensor,
                           torch.ops.aten.div_.Tensor, torch.ops.aten.div.Tensor_mode, torch.ops.aten.div_.Tensor_mode})


#: bytes of the 0-dim tensor the C++ argument parser makes of a Python number passed where an op takes a Tensor
_WRAPPED_BYTES = {bool: 1, int: 8, float: 8, complex: 16}
_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


#: binary ops whose Scalar overloads (``eq.Scalar``, ``add_.Scalar``, ``remainder.Scalar_Tensor``) wrap the number in a
#: 0-dim tensor inside the op and run the Tensor overload (measured on CPU; ``pow.Tensor_Scalar``, ``clamp``,
#: ``lerp``, ``masked_fill``, the activations read the number itself)
_WRAPS_SCALAR = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "rsub", "mul", "div", "true_divide",
                           "floor_divide", "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor",
                           "bitwise_left_shift", "bitwise_right_shift", "xlogy", "special_xlogy", "special_xlog1py",
                           "copysign"})


def _wraps(func, arg, value) -> bool:
    """Whether the Python number ``value`` passed as the schema argument ``arg`` becomes a 0-dim tensor."""
    if type(value) not in _WRAPPED_BYTES:
        return False
    if isinstance(arg.type, torch.TensorType):  # wrapped by the argument parser, before the op
        return True
    if not isinstance(arg.type, torch.NumberType):
        return False
    name = func.__name__.split(".")[0]
    base = name[:-1] if name.endswith("_") else name
    return base in _WRAPS_SCALAR or (base == "pow" and func._overloadname == "Scalar")


def _wrapped_numbers(func, args, kwargs) -> int:
    """The host bytes an op's Python numbers hold while it runs on CPU (``x * 0.5``, ``x.add(1)``, ``x.eq(0)``):
    where the op's schema takes a Tensor, the argument parser wraps the number in a 0-dim tensor before the op, and
    a binary op's Scalar overload does so inside it (:data:`_WRAPS_SCALAR`): 8 bytes for an int or a float, 1 for a
    bool, 16 for a complex; TensorIterator then casts that tensor to the op's common dtype inside the op (4 bytes for
    fp32, 2 for bf16; none where the dtypes agree).
    Both are alive while the op's output is made: a dispatch mode sees the number itself, so they are counted here
    (an RMSNorm step's backward peak, ``2.0 * up.pow(1)``, was 12 B above the estimate)."""
    if not any(type(a) in _WRAPPED_BYTES for a in args) and not (
            kwargs and any(type(v) in _WRAPPED_BYTES for v in kwargs.values())):
        return 0  # (no Python number: what _wraps answers for every argument)
    schema = getattr(getattr(func, "_schema", None), "arguments", None)
    if not schema:
        return 0
    numbers = [a for i, a in enumerate(args) if i < len(schema) and _wraps(func, schema[i], a)]
    if kwargs:
        by_name = {a.name: a for a in schema}
        numbers += [v for k, v in kwargs.items() if k in by_name and _wraps(func, by_name[k], v)]
    if not numbers:
        return 0
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    total = 0
    for number in numbers:
        total += _WRAPPED_BYTES[type(number)]
        if tensor is not None:
            try:
                common = torch.result_type(tensor, number)
            except (RuntimeError, TypeError):  # no common dtype: the op itself refuses them
                continue
            if common != _WRAPPED_DTYPE[type(number)]:
                total += common.itemsize
    return total


def released_by_the_core(grad: torch.Tensor) -> None:
    """The simulated step's note that the compiled core's backward frees dY here (the LoRA Functions reset the
    engine's handle on it after its last reader, as stock's engine frees it after peft's scaling product), where
    the Python Function standing in for it cannot drop the engine's reference: counted as freed when nothing else
    holds it (its only tensors are the one the engine and this Function share and, where that is a view, the base
    it holds: no other view of its storage lives)."""
    own = (1 if grad._base is None else 2) + 1  # (+ the storage object asked here)
    if grad._use_count() > 2 or torch._C._storage_Use_Count(grad.untyped_storage()._cdata) > own:
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _Allocations):
            mode.release(grad)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _called_by_the_engine() -> bool:
    """Whether the op being dispatched comes from autograd's engine itself (its C++ nodes and input buffers), not
    from a Python backward: above the dispatch mode's frames, torch's own frames lead to ``_engine_run_backward``
    before any frame of other code (a custom Function's backward). A device thread of the engine has none."""
    frame = sys._getframe(3)  # (this <- _note_sum <- __torch_dispatch__ <- ...)
    for _ in range(12):
        if frame is None:
            return True
        code = frame.f_code
        if code.co_name == "_engine_run_backward":
            return True
        if not code.co_filename.startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


class _Allocations(TorchDispatchMode):
    """Every storage an op brings into being, alive until nothing refers to it; one event per op."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, list] = {}  # cdata -> [weakref, nbytes, kind, owner]
        # cdata of live storages that have died since the last sweep, appended by their Python weakref's callback
        self.dead: list[int] = []
        self.watches: dict[int, weakref.ref] = {}  # cdata -> the weakref whose callback reports its death
        self.totals: dict[str, int] = {}
        self.current = 0
        self.phase = "forward"
        self.module_stack: list[str] = []
        self.node_token = object()  # this step's label on its autograd nodes (_nodes_from)
        # (bytes alive after the op, bytes its outputs added, signature or None, phase, owner, node name,
        #  bytes per kind alive after the op, bytes alive only inside the op besides its scratch: _wrapped_numbers)
        self.events: list[tuple] = []
        self.signatures: dict = {}
        self.failed_at: tuple | None = None  # (owner, node) of the op that raised, for the error
        self.fake_mode = None  # set by estimate: converts the real packed weights an op reads (_as_fake_params)
        self.wrapped: list = []  # (weak output, storage): saved numbers of the last op (_count_saved_number)
        self.made_by: dict[int, int] = {}  # cdata -> id of the autograd node whose backward made it
        self.summed = None  # (cdata, event index, bytes, kind): a sum of two gradients the engine may do in place
        self.autocast_cache_bytes = 0  # forward casts autocast keeps in its cache (_count_autocast_cache)
        self.autocast_dtype = None  # autocast's lower precision where the step runs under autocast with its cache on

    def _bytes(self, s, device_type: str) -> int:
        n = s.nbytes()
        if device_type == "cuda":
            n = (n + _CUDA_BLOCK - 1) // _CUDA_BLOCK * _CUDA_BLOCK
        return n

    def add(self, t: torch.Tensor, kind: str, owner: str = "") -> int:
        from torch.multiprocessing.reductions import StorageWeakRef

        s = _storage(t)
        if s is None:
            return 0
        ref = StorageWeakRef(s)
        if ref.cdata in self.live:
            return 0
        if t.device.type != self.device_type:  # (a fake tensor's storage is on meta: ask the tensor)
            kind = "host"  # offloaded to host memory (save_on_cpu): not on the device being planned
        n = self._bytes(s, t.device.type)
        self._watch(s, ref, n, kind, owner)
        self.current += n
        self.totals[kind] = self.totals.get(kind, 0) + n
        return n

    def release(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as freed from now on, though a Python Function simulating a C++ one still holds
        it (:func:`released_by_the_core`): its later death subtracts nothing more."""
        from torch.multiprocessing.reductions import StorageWeakRef

        s = _storage(t)
        entry = None if s is None else self.live.get(StorageWeakRef(s).cdata)
        if entry is None or entry[1] == 0:
            return
        self.current -= entry[1]
        self.totals[entry[2]] -= entry[1]
        entry[1] = 0

    def relabel(self, old: str, new: str) -> None:
        for v in self.live.values():
            if v[2] == old:
                v[2] = new
                self.totals[old] -= v[1]
                self.totals[new] = self.totals.get(new, 0) + v[1]

    def _watch(self, storage, ref, n: int, kind: str, owner: str) -> None:
        """Track ``storage`` until it dies. A storage's Python object is kept alive by C++ as long as the storage
        is (PyTorch preserves it, as it does a tensor's), so a weakref callback on it reports the death itself;
        asking every live storage whether it expired at every op cost O(ops x live storages): 17 of a diffusers
        UNet plan's 29 s. ``ref`` (a C++ weak reference) is kept until the sweep so that the storage's address,
        the key, is not reused by a new storage before the sweep has let the dead one go."""
        key = ref.cdata
        self.live[key] = [ref, n, kind, owner]
        dead = self.dead
        self.watches[key] = weakref.ref(storage, lambda _, key=key: dead.append(key))

    def sweep(self) -> None:
        summed, self.summed = self.summed, None
        if not self.dead:
            return
        dead = self.dead[:]
        del self.dead[:len(dead)]
        for k in dead:
            entry = self.live.pop(k, None)
            self.watches.pop(k, None)
            self.made_by.pop(k, None)
            if entry is None:
                continue
            _, n, kind, _ = entry
            self.current -= n
            self.totals[kind] -= n
        if summed is not None and summed[0] in dead:
            self._summed_in_place(*summed)

    def _note_sum(self, func, args, kwargs, out) -> None:
        """Remember a backward ``add`` that may be the engine summing two gradients of one tensor (a parameter or an
        activation read twice): its first operand a gradient another node made, the second of its shape and dtype.
        A real step sums those in place when the engine holds the only reference (``aten::add_``, no new storage);
        under any dispatch mode, as here, the engine sums out of place. :meth:`sweep` tells which it was."""
        if (self.phase != "backward" or func is not torch.ops.aten.add.Tensor or kwargs.get("alpha", 1) != 1
                or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args)
                or not isinstance(out, torch.Tensor)):
            return
        first, second = args
        if (first._base is not None or first.shape != second.shape or first.dtype != second.dtype
                or first.shape != out.shape or first.dtype != out.dtype or first.stride() != out.stride()):
            return
        from torch.multiprocessing.reductions import StorageWeakRef

        storages = [_storage(t) for t in (first, out)]
        if any(st is None for st in storages) or storages[0].nbytes() != storages[1].nbytes():
            return
        if not _called_by_the_engine():
            return  # a Python backward's own add (a custom Function's `grad_output + t`): it allocates
        key = StorageWeakRef(storages[0]).cdata
        made = self.made_by.get(key)
        entry = self.live.get(key)
        current = id(torch._C._current_autograd_node())
        second_storage = _storage(second)
        second = StorageWeakRef(second_storage).cdata if second_storage is not None else None
        if (made is None or made == current or self.made_by.get(second) != current or entry is None
                or entry[1] == 0):
            return  # not the engine's sum of an earlier node's gradient and the one this node just made
        self.summed = (key, len(self.events) - 1, entry[1], entry[2])

    def _summed_in_place(self, key: int, index: int, n: int, kind: str) -> None:
        """The first operand of the sum at ``events[index]`` died before the next op: the engine held its only
        reference, so the real step summed into it (``add_``) and never held both. That op's event is corrected;
        every later one already counts the operand freed."""
        current, new, sig, phase, owner, node, totals, transient = self.events[index]
        totals = dict(totals)
        totals[kind] = totals.get(kind, 0) - n
        self.events[index] = (current - n, max(new - n, 0), sig, phase, owner, node, totals, transient)

    def _where(self):
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is None:
                return "", ""
            label = node.metadata.get(_OWNER)
            return (label[1] if label is not None and label[0] is self.node_token else ""), node.name()
        return (self.module_stack[-1] if self.module_stack else ""), ""

    def _count_saved_number(self, func, args, out, kind: str, owner: str) -> int:
        """The host allocation of a Python number that autograd saves (``x * 0.5``, ``x / 3``): the C++ argument
        parser makes it a 0-dim CPU tensor (a "wrapped number", 8 bytes) before the op, which a dispatch mode
        sees as the number itself, and ``MulBackward0``/``DivBackward0`` keep it until they run. Each is small,
        but a diffusers UNet keeps 47 (its LoRA scalings, the residuals' rescaling): the CPU estimate was 376 B low.
        A real storage of the number's bytes stands for it, tied to the op's autograd node (once the op returned
        to autograd: :meth:`_attach_saved_numbers`). On CUDA the number is host memory: not counted."""
        if (self.device_type != "cpu" or self.phase != "forward" or func not in _SAVES_NUMBER or len(args) < 2
                or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad
                or not isinstance(args[1], (bool, int, float, complex)) or not torch.is_grad_enabled()):
            return 0
        from torch.multiprocessing.reductions import StorageWeakRef

        n = 1 if isinstance(args[1], bool) else 16 if isinstance(args[1], complex) else 8
        storage = torch.UntypedStorage(n)
        self._watch(storage, StorageWeakRef(storage), n, kind, owner)
        self.current += n
        self.totals[kind] = self.totals.get(kind, 0) + n
        self.wrapped.append((weakref.ref(out), storage))
        return n

    def _attach_saved_numbers(self) -> None:
        """The last op's saved numbers live as long as its autograd node keeps them: until the node has run (its
        post hook lets go, as the engine releases saved variables), or the node dies unrun."""
        pending, self.wrapped = self.wrapped, []
        for out_ref, storage in pending:
            out = out_ref()
            node = out.grad_fn if out is not None else None
            if node is not None:
                box = [storage]
                node.register_hook(lambda grad_inputs, grad_outputs, box=box: box.clear())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        facts = _op_facts(func)
        if self.wrapped and not facts.prim:  # (prim.device runs on the output before autograd has it)
            self._attach_saved_numbers()
        self.sweep()
        if self.fake_mode is not None and _has_packed_param(args, kwargs):
            args, kwargs = _as_fake_params(self.fake_mode, args, kwargs)
        try:
            if facts.one_dtype:
                _check_one_dtype(func, args)
            out = _grouped_mm_on_fakes(func, args, kwargs) if facts.grouped else func(*args, **kwargs)
        except Exception:
            # where the step stopped, before the modules' frames unwind (the caller's error names it)
            self.failed_at = self._where()
            raise
        if self.device_type == "cpu" and _lays_out_ambiguously(func, args):
            out = self._as_real_kernel_lays_out(func, args, kwargs, out)
        kind = {"forward": "activations", "backward": "backward", "optimizer": "optimizer"}[self.phase]
        owner, node = self._where()
        new = 0
        made = id(torch._C._current_autograd_node()) if self.phase == "backward" else None
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                added = self.add(t, kind, owner)
                new += added
                if added and made is not None:
                    from torch.multiprocessing.reductions import StorageWeakRef

                    self.made_by[StorageWeakRef(_storage(t)).cdata] = made
        # the op's Python numbers, wrapped in host tensors while it runs (on CPU: device memory there)
        transient = _wrapped_numbers(func, args, kwargs) if self.device_type == "cpu" else 0
        if facts.saves_number and isinstance(out, torch.Tensor):
            saved = self._count_saved_number(func, args, out, kind, owner)
            new += saved
            transient -= saved  # the saved number is that wrapped tensor, counted as the op's new storage
        sig = None
        if facts.scratch or _mixed_dtypes(args) or (facts.reduction and _casts_to_reduce(func, args, out)):
            sig = _signature(func, args, kwargs)
            if sig is not None:
                self.signatures.setdefault(sig, None)
        self.events.append((self.current, new, sig, self.phase, owner, node, dict(self.totals), transient))
        self._note_sum(func, args, kwargs, out)
        if new and func is torch.ops.aten._to_copy.default:
            self._count_autocast_cache(args, out, new)
        return out

    def _count_autocast_cache(self, args, out, new: int) -> None:
        """A forward cast that autocast keeps in its cache (``cached_cast``: an fp32 leaf that requires grad, a
        trainable weight, cast to autocast's lower precision), counted in the step as a step in its own autocast
        region makes it; a region that spans several steps made it in its first one (MemoryEstimate's field)."""
        if self.phase != "forward" or not args or not isinstance(args[0], torch.Tensor) \
                or not isinstance(out, torch.Tensor):
            return
        src = args[0]
        # (autocast's state reads off inside a dispatch mode: it is taken when the step starts, see estimate)
        if (self.autocast_dtype is not None and src.dtype == torch.float32 and src.requires_grad and src.is_leaf
                and src._base is None and out.dtype == self.autocast_dtype):
            self.autocast_cache_bytes += new

    def _as_real_kernel_lays_out(self, func, args, kwargs, out):
        """The op's outputs with the strides the real CPU kernel gives them. Where an input is both contiguous and
        channels-last (a 1x1 pooled map), a meta kernel may choose the other layout than the CPU kernel (training
        batch norm: channels-last against contiguous), and the ops after it follow: a pyramid-pooling head's
        upsampled map, its cat and the 3x3 conv's backward scratch were simulated channels-last, the estimate 3.8-7.8 %
        below the measured peak of UperNet/PSPNet steps (the vision sweep). Such inputs are small: the op runs once
        per signature on real stand-ins, and fresh outputs whose strides differ are made again with the real ones."""
        sig = _signature(func, args, kwargs)
        if sig is None:
            return out
        key = (torch.get_num_threads(), bool(torch.backends.mkldnn.enabled), sig)
        if key not in _REAL_STRIDES:
            _REAL_STRIDES[key] = _real_strides(func, sig)
        strides = _REAL_STRIDES[key]
        leaves, spec = _pytree.tree_flatten(out)
        if strides is None or len(strides) != len(leaves):
            return out
        restrided = [torch.empty_strided(t.shape, real, dtype=t.dtype, device=t.device)
                     if isinstance(t, torch.Tensor) and real is not None and tuple(t.stride()) != real else t
                     for t, real in zip(leaves, strides)]
        return _pytree.tree_unflatten(restrided, spec)


#: (threads, oneDNN on, signature) -> the real CPU kernel's output strides, for the process (a plan's estimates ask the
#: same small ops at every candidate)
_REAL_STRIDES: dict = {}

#: the most bytes of inputs an op is run on for real to learn its outputs' layout (:func:`_lays_out_ambiguously`)
_AMBIGUOUS_REPLAY_BYTES = 1 << 20


def _lays_out_ambiguously(func, args) -> bool:
    """A fresh-output aten op reading a small 4-/5-d tensor that is contiguous in both memory formats."""
    if not _op_facts(func).fresh_aten:
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _AMBIGUOUS_REPLAY_BYTES:
        return False
    for t in tensors:
        if t.dim() in (4, 5) and t.numel() > 1 and t.is_contiguous():
            if t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d):
                return True
    return False


def _real_strides(func, sig) -> list | None:
    """The strides of each output the real kernel makes for ``sig`` (None where it raises)."""
    from torch.utils._python_dispatch import _disable_current_modes

    _, args, kwargs = sig
    with _disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            out = func(*_real_of(args), **{k: _real_of(v) for k, v in kwargs})
        except Exception:  # a real kernel that refuses what the meta one took: the simulation's layout stands
            return None
    return [tuple(t.stride()) if isinstance(t, torch.Tensor) else None for t in _pytree.tree_leaves(out)]


_GROUPED_MM = {torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set()


def _grouped_mm_on_fakes(func, args, kwargs):
    """``aten._grouped_mm`` (transformers' MoE experts, "grouped_mm"): its meta kernel, which fake tensors run,
    accepts bf16 inputs only, where the CPU kernel also runs fp32 (a stock fp32 Mixtral on CPU). For other dtypes
    the shapes are taken from the op on bf16 stand-ins and the output is made in the real op's dtype; the stand-ins
    are fake-mode temporaries the simulation does not see (the real kernel makes no such copies)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if all(t.dtype == torch.bfloat16 for t in tensors if t.is_floating_point()):
        return func(*args, **kwargs)
    out_dtype = kwargs.get("out_dtype") or tensors[0].dtype
    stand_ins = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    shaped = func(*stand_ins, **{k: v for k, v in kwargs.items() if k != "out_dtype"})
    return torch.empty(shaped.shape, dtype=out_dtype, device=shaped.device)


#: the most bytes of inputs one op replay may allocate (``SLIMGRAD_ESTIMATE_REPLAY_BYTES``): a bigger op's
#: scratch is left out of the estimate, and the estimate says so
_REPLAY_LIMIT = int(float(os.environ.get("SLIMGRAD_ESTIMATE_REPLAY_BYTES", 2 * 2**30)))


def _replay_bytes(sig) -> int:
    total = 0
    for leaf in _pytree.tree_leaves((sig[1], sig[2])):
        if isinstance(leaf, _TensorSpec):
            n = 1
            for d in leaf.shape:
                n *= d
            total += n * leaf.dtype.itemsize
    return total


# Scratch measured so far in this process, by (device, threads, cuDNN benchmark mode, oneDNN on, signature): a plan
# estimates the same ops at every candidate (measured: the replays were most of a second estimate's time).
_MEASURED: dict = {}


def _measure_scratch(signatures: dict, device: str, skipped: list[str], failed: list[str] | None = None) -> None:
    """The most bytes each op signature holds at once inside its call, outputs included, measured by running it
    on real (random) tensors of the same shapes: the allocator's own records on CPU (the profiler's memory
    events), ``max_memory_allocated`` on CUDA. One op's inputs are allocated at a time. Each op runs twice and
    the second call counts: a first call in a process may allocate once for good (oneDNN's and cuBLAS's
    workspaces: measured 64 KiB on a CPU conv backward), which a real step after the first does not repeat.
    Results are kept for the process (threads, cuDNN's benchmark mode and oneDNN's switch are part of the
    key: they change the kernels, and so the scratch)."""
    failed = [] if failed is None else failed
    context = (device, torch.get_num_threads(), bool(torch.backends.cudnn.benchmark),
               bool(torch.backends.mkldnn.enabled))
    todo = []
    for sig, value in signatures.items():
        if value is None:
            known = _MEASURED.get((context, sig))
            if known is not None:
                signatures[sig] = known
            elif _replay_bytes(sig) > _REPLAY_LIMIT:
                signatures[sig] = 0  # one op larger than the replay allows: its scratch is not counted
                skipped.append(sig[0].__name__)
            else:
                todo.append(sig)
    if not todo:
        return
    # a replayed op may draw random numbers (SDPA's dropout): the user's generators must not move. The recorded ops
    # are autocast's output (the simulation sees them below it): replayed with autocast on (an estimate called
    # inside the user's autocast region), autocast cast their arguments again (batch norm's: "mixed dtype" raised)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []), \
            torch.autocast(device, enabled=False):
        _replay(todo, signatures, device, context, failed)


def _routing_decides_scratch(sig, device: str) -> bool:
    """Whether a grouped matmul's scratch may depend on how the router splits the tokens. On CPU, measured: in fp32
    it holds none beyond its output, forward and backward, whatever the split (even, skewed, every row in one
    group); in bf16 it grows with the largest group. Elsewhere (CUDA) it is not known, so assumed."""
    if device != "cpu":
        return True
    return any(isinstance(a, _TensorSpec) and a.dtype.is_floating_point and a.dtype != torch.float32 for a in sig[1])


def _replay_inputs(sig) -> tuple[list, dict]:
    """Real (random) inputs of one op signature. ``aten._grouped_mm``'s scratch depends on its group sizes, which
    the fake step does not know (the routing decides them): its offsets split the rows evenly across the groups.
    (On CPU in bf16 the scratch is, measured, the group's weight in fp32 plus a part per row of the group: an even
    split was 0.5-0.9 % below the measured peak of tiny Qwen2-MoE and GPT-OSS steps, every row in one group 4-7 %
    above; the estimate notes it.)"""
    func, a, kw = sig
    args, kwargs = _real_of(a), {k: _real_of(v) for k, v in kw}
    if func in _GROUPED_MM:
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        rows = args[0].shape[0] if args[0].dim() == 2 and args[1].dim() == 3 else args[0].shape[-1]
        if isinstance(offs, torch.Tensor):
            n = offs.numel()
            offs.copy_(torch.tensor([rows * (i + 1) // n for i in range(n)], dtype=offs.dtype))
    return args, kwargs


def _replay(todo: list, signatures: dict, device: str, context: tuple, failed: list[str]) -> None:
    """Measure each signature's scratch on real inputs. An op whose replay raises (fake tensors' meta functions can
    give another dtype than the real kernel: batch norm's saved statistics under autocast came out bf16, which its
    backward refuses) counts no scratch and is named in ``failed``: the estimate says so, it does not raise."""
    if device == "cuda":
        for sig in todo:
            args, kwargs = _replay_inputs(sig)
            func = sig[0]
            try:
                func(*args, **kwargs)
            except Exception:  # noqa: BLE001 - see the docstring
                signatures[sig] = 0
                failed.append(func.__name__)
                continue
            for _ in range(2):
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = func(*args, **kwargs)
                del out
                torch.cuda.synchronize()
            signatures[sig] = _MEASURED[(context, sig)] = torch.cuda.max_memory_allocated() - start
        return
    from torch.profiler import ProfilerActivity, profile

    windows, replayed = [], []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for sig in todo:
            args, kwargs = _replay_inputs(sig)
            func = sig[0]
            try:
                out = func(*args, **kwargs)  # the first call, not counted
            except Exception:  # noqa: BLE001 - see the docstring
                signatures[sig] = 0
                failed.append(func.__name__)
                continue
            del out
            replayed.append(sig)
            with torch.profiler.record_function("slimgrad.estimate.replay"):
                out = func(*args, **kwargs)
                del out
            del args, kwargs
    events = list(prof.profiler.kineto_results.events())
    windows = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == "slimgrad.estimate.replay")
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    i = 0
    for sig, (start, end) in zip(replayed, windows):
        while i < len(memory) and memory[i][0] < start:
            i += 1
        current = top = 0
        while i < len(memory) and memory[i][0] <= end:
            current += memory[i][1]
            top = max(top, current)
            i += 1
        signatures[sig] = _MEASURED[(context, sig)] = top


# -- running the step on fake tensors -----------------------------------------------------------------------


def _packed_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """A bitsandbytes packed weight (4-bit ``Params4bit``, ``Int8Params``) and the tensors of its quantization
    state. Its forward reads attributes (``quant_state``, ``SCB``) that a fake copy would not have, and would
    rebuild the parameter around the fake: it stays real in the model, and is counted as a weight."""
    name = type(p).__name__
    if name == "Params4bit" and getattr(p, "quant_state", None) is not None:
        from .functional.quantized import _quant_state_tensors

        return [p, *_quant_state_tensors(p.quant_state)]
    if name == "Int8Params":
        return [p, *[t for t in (getattr(p, "SCB", None),) if isinstance(t, torch.Tensor)]]
    return []


@contextlib.contextmanager
def _packed_restored(model: nn.Module):
    """bitsandbytes rewrites packed weights in its forward (on a CPU with AVX512-BF16, a 4-bit layer in eval mode
    repacks its weight, ``weight.data = packed``, and rewrites its quant_state's fields): under fake mode that
    would leave fake tensors in the user's model. Each packed weight's data and quantization state are put back."""
    from torch.utils._python_dispatch import _disable_current_modes

    saved = []
    with _disable_current_modes():  # (under fake mode, reading .data would give a fake alias)
        for p in model.parameters():
            if _packed_tensors(p):
                qs = getattr(p, "quant_state", None)
                saved.append((p, p.data, qs, dict(vars(qs)) if qs is not None else None))
    try:
        yield
    finally:
        with _disable_current_modes():
            for p, data, qs, fields in saved:
                p.data = data
                if qs is not None:
                    vars(qs).clear()
                    vars(qs).update(fields)
                    p.quant_state = qs


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "sgd-momentum", "momentum")


def check_optimizer_spec(spec, fn: str = "estimate") -> None:
    """Refuse an ``optimizer`` argument that is neither one of :data:`OPTIMIZER_NAMES` nor an optimizer."""
    if spec is None or isinstance(spec, torch.optim.Optimizer):
        return
    if not isinstance(spec, str):
        raise TypeError(f"{fn}: 'optimizer' must be 'adamw', 'adam', 'sgd', 'sgd-momentum' or a "
                        f"torch.optim.Optimizer, got {type(spec).__name__}")
    if spec.lower() not in OPTIMIZER_NAMES:
        raise ValueError(f"{fn}: 'optimizer' must be 'adamw', 'adam', 'sgd', 'sgd-momentum' or a "
                         f"torch.optim.Optimizer, got {spec!r}")


def _optimizer_for(spec, params: list[torch.Tensor], fake_of: dict[int, torch.Tensor]):
    """The optimizer the step simulates: a new one of the named kind, or one of ``spec``'s class with its
    parameter groups' options over the fake parameters (``fake_of``: id of a real parameter -> its fake)."""
    if spec is None:
        return None
    check_optimizer_spec(spec)  # (one message for a bad name or kind, also where estimate's caller checked first)
    if isinstance(spec, str):
        name = spec.lower()
        if name == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        if name == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        if name == "sgd":
            return torch.optim.SGD(params, lr=1e-3)
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # "sgd-momentum", "momentum"
    if isinstance(spec, torch.optim.Optimizer):
        import inspect

        accepted = set(inspect.signature(type(spec).__init__).parameters)
        groups = []
        for g in spec.param_groups:
            fakes = [fake_of[id(p)] for p in g["params"] if id(p) in fake_of and fake_of[id(p)].requires_grad]
            if fakes:
                groups.append({**{k: v for k, v in g.items() if k != "params" and k in accepted}, "params": fakes})
        if not groups:
            if not any(id(p) in fake_of for g in spec.param_groups for p in g["params"]):
                raise ValueError(
                    f"estimate: 'optimizer' ({type(spec).__name__}) holds none of the model's parameters, so its "
                    f"state cannot be estimated for this model (an optimizer built before slimgrad.convert, which "
                    f"returns a copy unless inplace=True?): pass one built on this model's parameters, or its kind "
                    f"('adamw', 'sgd', ...)")
            return None  # it steps only parameters that train nothing here: no state
        try:
            return type(spec)(groups)
        except (TypeError, ValueError) as e:
            raise ValueError(f"estimate: cannot rebuild the optimizer {type(spec).__name__} on the simulated "
                             f"parameters ({e}); pass its name ('adamw', 'sgd') instead") from None


#: the key under which a simulated step's autograd nodes carry (the step's token, their module's path)
_OWNER = "slimgrad_estimate_owner"


def _nodes_from(outputs, token: object, owner: str) -> None:
    """Label the autograd nodes made under ``outputs`` (not yet labelled in this step) as ``owner``'s. The label is
    written into each node's ``metadata`` dict, which the node itself keeps: a dict of the nodes would hold every
    node alive, so that an output the loss never reads (BERT's pooler output under a loss on its hidden states)
    kept its branch and what it saved through the simulated backward, where the real step frees them with the
    output (+0.55 % on MiniLM, +11 % on a model with an unused second head; the real-weights sweep)."""
    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        meta = node.metadata
        label = meta.get(_OWNER)
        if label is not None and label[0] is token:
            continue
        meta[_OWNER] = (token, owner)
        todo.extend(f for f, _ in node.next_functions)


@contextlib.contextmanager
def _tracked_forwards(model: nn.Module, sim: _Allocations, paths: dict[int, str], flops: dict[str, int],
                      input_bytes: dict[str, int] | None = None):
    """Wrap every module's forward (as the audit does: hooks would make slimgrad's layers take stock's path)
    to know which module runs each op and which autograd nodes each module created. ``input_bytes``: {path: 0}
    of the modules whose tensor inputs' bytes (unique storages, first call) to record: what a checkpoint of the
    module keeps instead of its activations."""

    def wrap(module):
        inner = module.forward
        path = paths[id(module)]

        def forward(*args, **kwargs):
            if input_bytes is not None and input_bytes.get(path) == 0:
                from torch.multiprocessing.reductions import StorageWeakRef

                storages = {}
                for t in _pytree.tree_leaves((args, kwargs)):
                    s = _storage(t) if isinstance(t, torch.Tensor) else None
                    if s is not None:
                        storages[StorageWeakRef(s).cdata] = sim._bytes(s, t.device.type)
                input_bytes[path] = sum(storages.values()) or -1
            sim.module_stack.append(path)
            try:
                out = inner(*args, **kwargs)
            finally:
                sim.module_stack.pop()
            _nodes_from(_pytree.tree_leaves(out), sim.node_token, path)
            return out

        return forward

    with forwards_wrapped(model, wrap):
        yield


def _storage_keys(output) -> set:
    """The storage keys (as :class:`_Allocations` files them) of the tensors in ``output`` (a ModelOutput, a tuple,
    a list, a dict, a tensor; None is skipped): a model's output held through backward, not counted as kept for it,
    and the gradients."""
    from torch.multiprocessing.reductions import StorageWeakRef

    keys, todo = set(), [output]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            s = _storage(item)
            if s is not None:
                keys.add(StorageWeakRef(s).cdata)
        elif isinstance(item, dict) or hasattr(item, "values") and callable(item.values):
            todo.extend(item.values())
        elif isinstance(item, (tuple, list)):
            todo.extend(item)
    return keys


@contextlib.contextmanager
def _rng_states_counted(sim: _Allocations):
    """A CPU step's copies of the generator's state, which torch's checkpoint takes (``torch.get_rng_state()``: 5 KiB
    per checkpointed block, held until its recomputation, and again by the recomputation's ``fork_rng``), are made
    outside any dispatch mode, so the simulated step did not see them: under gradient checkpointing tiny models read
    2-9 % low. Each state made during the step gets a simulated stand-in of its size that lives as long as it."""
    if sim.device_type != "cpu":
        yield  # a CUDA step: the generator states are host memory
        return
    real = torch.get_rng_state

    def get_rng_state():
        state = real()
        state._slimgrad_stand_in = torch.empty(state.numel(), dtype=state.dtype)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = real


@contextlib.contextmanager
def _data_dependence_explained(sim: _Allocations):
    """Fake tensors have no values: a step that reads one (``.item()``, ``if x.any():``) cannot be simulated.
    Say where, in slimgrad's words, instead of torch's internal exception."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        if sim.phase == "optimizer":
            raise ValueError(f"estimate: the optimizer's step reads a tensor's values ({e.func}; Adafactor's "
                             f"step calls .item()), which a simulated step cannot (fake tensors hold no data). Pass "
                             f"optimizer='adamw', 'sgd' or an instance whose step reads no values, or measure the "
                             f"step with slimgrad.peak_bytes around a real one") from e
        owner, node = sim.failed_at or sim._where()
        where = f"{sim.phase} of {owner or '(model)'}" + (f" ({node})" if node else "")
        raise ValueError(f"estimate: the step reads a tensor's values ({e.func}) in the {where}, which a "
                         f"simulated step cannot (fake tensors hold no data): data-dependent control flow or "
                         f"output shapes there. Estimate the model without that part, or measure it with "
                         f"slimgrad.peak_bytes around a real step") from e


def _is_fake(t) -> bool:
    return isinstance(t, _fake_tensor_type())


_FAKE_TENSOR: list = []


def _fake_tensor_type() -> type:
    if not _FAKE_TENSOR:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE_TENSOR.append(FakeTensor)
    return _FAKE_TENSOR[0]


class _OpFacts:
    """What the simulation asks of an op at every call that depends on the op alone, found once per op."""

    __slots__ = ("name", "prim", "one_dtype", "grouped", "saves_number", "scratch", "reduction", "fresh_aten")

    def __init__(self, func):
        self.name = func.__name__.split(".")[0]
        self.prim = func.namespace == "prim"
        self.one_dtype = func in _ONE_DTYPE_OPS
        self.grouped = func in _GROUPED_MM
        self.saves_number = func in _SAVES_NUMBER
        self.scratch = bool(_SCRATCH_OPS.search(self.name))
        self.reduction = self.name in _REDUCTIONS
        schema = getattr(func, "_schema", None)
        self.fresh_aten = (func.namespace == "aten" and schema is not None
                           and not any(r.alias_info is not None for r in schema.returns))


_OP_FACTS: dict = {}


def _op_facts(func) -> _OpFacts:
    facts = _OP_FACTS.get(func)
    if facts is None:
        facts = _OP_FACTS[func] = _OpFacts(func)
    return facts


@contextlib.contextmanager
def _backward_outside_autocast(device: str):
    """Backward as torch's autocast recipe runs it, outside the region: the region's exit clears autocast's cache of
    the trainable weights' low-precision copies, which then go as backward passes their last readers. Simulated
    inside the user's region, the cache held every copy to the end of backward: a small ResNet trained under CPU
    bf16 autocast read 45 % over its measured step (found on 2026-11-28). A loop that runs backward inside its
    region holds them through backward: up to ``autocast_cache_bytes`` more (docs/estimate.md)."""
    try:
        on = torch.is_autocast_enabled(device)
    except (RuntimeError, TypeError):  # a device type without autocast
        on = False
    if not on:
        yield
        return
    torch.clear_autocast_cache()
    with torch.autocast(device, enabled=False):
        yield


@contextlib.contextmanager
def _masks_decided_on_real_values(facts, kwargs, f_kwargs, notes: list[str]):
    """Hugging Face's attention-mask code decides from values whether the mask can be left to SDPA's
    ``is_causal``: an all-ones ``attention_mask``, ``position_ids`` that hold one sequence per row. On fake
    tensors it cannot read them (transformers' ``is_tracing`` flags fake tensors), so it builds the full
    B×1×S×S mask, which the real step never makes, and SDPA then takes its masked path, which keeps more
    (measured: a 2-layer Llama's estimate 5.6 % high with an attention mask or ``use_cache=False``, 8.3 %
    converted; 20 % at 4×512; a BERT's bidirectional mask 12-14 % at 2×256). Those decisions are taken here from
    the user's real inputs instead, before anything is faked: an all-ones ``attention_mask`` is answered as no
    padding mask (causal and bidirectional), a padded one (queries spanning the keys, as in training) as "keep
    the mask", and ``position_ids`` the model derived itself (no
    cache: ``arange``; or from an all-ones mask) as no packed sequences, where this version of transformers
    answers None for those at all (4.x always returns the tensor). transformers 4.x read the padding mask's
    values in the first decision, which failed on fake tensors: it now gets the real answer too. Where the real
    values are unknown (a meta-device batch, a cache's tensor offset), transformers' own answer stands: the
    estimate is then high, never low. Where a transformers version has no such seam (or another form of it) and
    the batch has an attention mask, ``notes`` says the estimate may be high."""
    masking, ignore, packed, mask, real_mask, mask_all_ones, no_padding, positions_packed = facts
    if masking is None:
        yield
        return
    fake_positions = f_kwargs.get("position_ids")

    def stands_for_the_real_mask(padding_mask) -> bool:
        """Whether ``padding_mask`` is the fake of the user's 2-D attention mask, whose real values are known."""
        return (_is_fake(padding_mask) and real_mask and padding_mask.dim() == 2
                and padding_mask.shape[-1] == mask.shape[-1])

    def ignore_causal_mask(padding_mask, *rest, **kw):
        if stands_for_the_real_mask(padding_mask):
            if mask_all_ones:
                padding_mask = None  # the same answer as the real step's fast_all(padding_mask)
            elif len(rest) >= 2 and rest[0] == rest[1] == mask.shape[-1]:
                # padded, and queries span the keys (a training step): every version's answer is no
                # (transformers 4.x would read the fake mask's values to say so)
                return False
        return ignore(padding_mask, *rest, **kw)

    def ignore_bidirectional_mask(padding_mask, *rest, **kw):
        if stands_for_the_real_mask(padding_mask):
            if not mask_all_ones:
                return False  # padded: the real step's ``padding_mask.all()`` is False in every version
            padding_mask = None  # the same answer as the real step's padding_mask.all()
        return ignore_bi(padding_mask, *rest, **kw)

    def find_packed(position_ids, *rest, **kw):
        if _is_fake(position_ids):
            if position_ids is fake_positions:
                if positions_packed is False:
                    return None
            elif no_padding and "cache_position" not in kwargs:
                return None  # the model's own arange (no cache, nothing padded): one sequence per row
        return packed(position_ids, *rest, **kw)

    saved = {}
    try:
        if ignore is not None and _first_parameter(ignore) == "padding_mask":
            saved["_ignore_causal_mask_sdpa"] = ignore
            masking._ignore_causal_mask_sdpa = ignore_causal_mask
        ignore_bi = getattr(masking, "_ignore_bidirectional_mask_sdpa", None)
        if ignore_bi is not None and _first_parameter(ignore_bi) == "padding_mask":
            saved["_ignore_bidirectional_mask_sdpa"] = ignore_bi
            masking._ignore_bidirectional_mask_sdpa = ignore_bidirectional_mask
        elif ignore_bi is not None and mask is not None:
            notes.append("this transformers version's bidirectional-mask decision (masking_utils."
                         "_ignore_bidirectional_mask_sdpa) is not the form slimgrad knows: it ran on fake tensors, "
                         "which count a materialized batch x 1 x seq x seq mask where the real step may leave the mask "
                         "to SDPA, so the estimate may be high")
        if packed is not None and _first_parameter(packed) == "position_ids":
            saved["find_packed_sequence_indices"] = packed
            masking.find_packed_sequence_indices = find_packed
        if mask is not None and "_ignore_causal_mask_sdpa" not in saved:
            notes.append("this transformers version's attention-mask decision (masking_utils."
                         "_ignore_causal_mask_sdpa) is not the form slimgrad knows: it ran on fake tensors, which "
                         "count a materialized batch x 1 x seq x seq mask where the real step may leave the mask to "
                         "SDPA, so the estimate may be high")
        yield
    finally:
        for name, fn in saved.items():
            setattr(masking, name, fn)


def _mask_facts(kwargs):
    """What :func:`_masks_decided_on_real_values` needs from the real inputs, read before anything is faked."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    ignore = getattr(masking, "_ignore_causal_mask_sdpa", None)
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None:
        return (None,) * 8
    mask = kwargs.get("attention_mask")
    real_mask = bool(isinstance(mask, torch.Tensor) and not _is_fake(mask) and mask.device.type != "meta")
    mask_all_ones = bool(real_mask and mask.dim() == 2 and mask.all())
    no_padding = mask is None or mask_all_ones
    user_positions = kwargs.get("position_ids")
    positions_packed = None  # the real answer for the user's own position_ids, where known
    if packed is not None and packed(torch.arange(2).unsqueeze(0)) is not None:
        packed = None  # this version answers with a tensor even for one sequence a row (4.x): nothing to decide
    if (packed is not None and isinstance(user_positions, torch.Tensor) and not _is_fake(user_positions)
            and user_positions.device.type != "meta" and user_positions.dim() == 2):
        positions_packed = packed(user_positions) is not None
    return masking, ignore, packed, mask, real_mask, mask_all_ones, no_padding, positions_packed


def _one_name_per_slot(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a name per path, tied ones sharing a value) with one name per module attribute: a module reached
    by two paths (transformers 4.x T5's ``shared`` is also ``encoder.embed_tokens``) has one slot under two names.
    torch's reparametrization swaps name by name, so the second name's "original" is the value the first swapped
    in, and restoring left a fake tensor in the user's model (T5's shared embedding, untied from its lm_head).
    Tied parameters in distinct modules (an lm_head tied to the embedding) keep a name each, with one value."""
    seen: set[tuple[int, str]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        owner_path, _, attr = name.rpartition(".")
        key = (id(model.get_submodule(owner_path) if owner_path else model), attr)
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def _first_parameter(fn) -> str | None:
    import inspect

    try:
        return next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return None


#: set while a step is simulated again after its first simulation taught the converted layers (:func:`_learned`)
_RELEARNED: contextvars.ContextVar[bool] = contextvars.ContextVar("slimgrad_estimate_relearned", default=False)


def _learned(model: nn.Module) -> dict:
    """What the model's converted layers learned from earlier steps (which producer outputs a consumer keeps), by
    module."""
    from .functional.lora import READ_KEY, SEVERAL_KEY

    learned = {}
    for m in model.modules():
        state = m.__dict__
        if "_slimgrad_output_kept" in state:
            learned[id(m)] = state["_slimgrad_output_kept"]
        # and which LoRA layers read their frozen x with others (functional.lora.read_alone_last_time)
        if READ_KEY in state:
            learned[(id(m), READ_KEY)] = state[READ_KEY].shared
        if SEVERAL_KEY in state:
            learned[(id(m), SEVERAL_KEY)] = True
    return learned


#: parameter name -> dtype it has in the steady state, for the second simulation of a step whose first one cast
#: parameters in place (see :func:`estimate`)
_STEADY_DTYPES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("slimgrad_estimate_steady_dtypes",
                                                                             default=None)


def estimate(model: nn.Module, *args, optimizer=None, loss_fn: Callable | None = None,
             blocks: list[str] | None = None, device=None, hold_output: bool = False, **kwargs) -> MemoryEstimate:
    """Simulate one training step of ``model(*args, **kwargs)`` on fake tensors and return its memory.

    The loss is ``loss_fn(output)``, by default ``output.loss`` or the sum of the outputs (as
    :func:`slimgrad.audit`). ``optimizer``: ``"adamw"``, ``"sgd"``, or an optimizer instance (its class and
    defaults are used on simulated parameters; the real one is not touched). With an optimizer, the step is
    the steady state of training: forward and backward with the optimizer state alive, then its step.
    ``blocks`` names the modules to report on (default: :func:`blocks_of`).

    The step frees the model's output before backward, as the Hugging Face ``Trainer`` does (``loss =
    model(**batch).loss``). A loop that holds the output through backward and the optimizer's step (``out =
    model(**batch); out.loss.backward()``) holds its logits too: pass ``hold_output=True`` to estimate that loop
    (a tiny Llama LoRA's step read 14 % low without it).

    Nothing of the user's model or
    inputs is modified (but for what a step teaches a converted model, below), and no activation is allocated.

    A model (and inputs) built on the meta device (``with torch.device("meta"): model = ...``) is estimated
    as if it ran on ``device`` (default ``"cpu"``): nothing of its size is ever allocated, so a model that
    does not fit here can be sized before its weights are loaded. (Kernels' scratch space is still measured
    on real tensors of one op's shapes, on ``device``.)

    A step that casts parameters in place the first time it runs (bitsandbytes' 4-bit and 8-bit layers set their
    bias to the input's or compute dtype: ``bias.data = bias.data.to(...)``; Qwen2's, GPT-NeoX's, Falcon's
    projections have biases) is estimated in the state every later step runs in: the simulation runs again with
    those parameters in their new dtype (the real model is left as it is).

    A converted model learns in its first step which ReLU outputs a consumer keeps anyway (then shared rather than
    masked: README, Limits), and a simulated step teaches it as a real one does. A model that has never run is
    simulated again when its first simulation taught it something, so the estimate is of the later steps (a fresh
    DPT's first step peaks 22 % lower than its later ones, whose head ReLU shares its output and runs stock's
    backward; the in-repo ResNet-18 with one block checkpointed keeps 512 B more on its first step).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .audit import default_loss

    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        # anomaly mode's NaN check reads every backward output's values, which fake tensors have not (it raised
        # "the step reads a tensor's values", blaming the model); it allocates nothing the step keeps, so the
        # simulation runs without it (anomaly mode's tracebacks stay on)
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            return estimate(model, *args, optimizer=optimizer, loss_fn=loss_fn, blocks=blocks, device=device,
                            hold_output=hold_output, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap(model)
    if not args and not kwargs:
        raise ValueError("estimate: give the step's inputs: estimate(model, x) or estimate(model, input_ids=ids)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"estimate: 'loss_fn' must be a callable output -> scalar, got {type(loss_fn).__name__}")
    if not isinstance(hold_output, bool):
        raise TypeError(f"estimate: 'hold_output' must be True or False, got {hold_output!r}")
    misspelt_option(model, kwargs, ("optimizer", "loss_fn", "blocks", "device", "hold_output"), "estimate")
    from .measure import offloaded_by_accelerate

    if offloaded_by_accelerate(model):
        # (simulated, accelerate's hook rebuilt each offloaded weight as FakeTensor(...) and failed inside
        # FakeTensor.__new__: the model-loading sweep)
        raise ValueError("estimate: accelerate offloads some of the model's weights (cpu_offload, disk_offload, or a "
                         "device_map with 'cpu' or 'disk' entries): its hooks load each module's weights for its "
                         "forward, which the estimate does not simulate; estimate the model before dispatching it, "
                         "on the device it will train on")
    check_optimizer_spec(optimizer)
    loss_of = loss_fn or default_loss
    block_paths = block_list(blocks, "estimate") if blocks is not None else blocks_of(model)
    modules = dict(model.named_modules())
    for b in block_paths:
        if b not in modules:
            raise ValueError(f"estimate: 'blocks' names {b!r}, which is not a submodule of the model")

    devices = {t.device.type for t in [*model.parameters(), *_pytree.tree_leaves((args, kwargs))]
               if isinstance(t, torch.Tensor)}
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"estimate: 'device' must name where the real step will run ('cpu', 'cuda', "
                             f"'cuda:1'), got {device!r} ({e})") from None
        if target.type not in ("cpu", "cuda", "meta"):
            raise ValueError(f"estimate: 'device' must be 'cpu' or 'cuda' (where slimgrad's estimate knows the "
                             f"kernels), got {device!r}")
        if target.type == "meta":
            raise ValueError("estimate: 'device' names where the real step will run ('cpu', 'cuda'), not 'meta'")
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("estimate: device='cuda' needs a CUDA build of torch and a GPU here (CUDA kernels "
                             "decide the scratch and rounding the estimate counts); estimate on the GPU machine")
        real_devices = devices - {"meta"}
        if real_devices and real_devices != {target.type}:
            raise ValueError(f"estimate: 'device' is {target.type!r} but the model or inputs are on "
                             f"{', '.join(sorted(real_devices))}; 'device' is for models built on the meta device")
    else:
        target = torch.device("cuda" if "cuda" in devices else next(iter(devices - {"meta"}), "cpu"))
    device = target.type
    # a chunked head checks itself on its first real call; the simulated step's tensors are fake, so check it now
    from .integrations import hf_loss

    hf_loss.check_heads(model)
    sim = _Allocations(device)
    try:
        if torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled():
            sim.autocast_dtype = torch.get_autocast_dtype(device)
    except (RuntimeError, TypeError):  # a device type without autocast
        pass
    paths = {id(m): p for p, m in model.named_modules()}
    # bitsandbytes' packed weights stay real (see _packed_tensors); fake mode (or sim, _as_fake_params) converts
    # them where an op reads them
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    sim.fake_mode = fake_mode
    learned_before = _learned(model)
    mask_facts = _mask_facts(kwargs)
    notes: list[str] = []

    for t in _pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.is_nested:
            # (fake tensors need a shape environment for a jagged dimension: torch's own assertion said nothing)
            raise ValueError(f"estimate: an input is a nested (jagged) tensor of shape {tuple(t.shape)}, which the "
                             f"simulated step cannot take; estimate with a padded batch of the same size instead")

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":  # a model built on the meta device: fake tensors where it will run
            return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, target)
        return fake_mode.from_tensor(t, static_shapes=True)

    with fake_mode:
        steady = _STEADY_DTYPES.get() or {}
        fake_param: dict[int, torch.Tensor] = {}  # one fake per real parameter: tied names share it

        def fake_parameter(n, p):
            if id(p) not in fake_param:
                fake_param[id(p)] = fake(p) if n not in steady else nn.Parameter(fake(p).to(steady[n]),
                                                                                 p.requires_grad)
            return fake_param[id(p)]

        params = {n: fake_parameter(n, p) for n, p in model.named_parameters(remove_duplicate=False)}
        expected_dtypes = {n: f.dtype for n, f in params.items()}
        for n, p in model.named_parameters(remove_duplicate=False):
            params[n].requires_grad_(p.requires_grad)
        buffers = {n: fake(b) for n, b in model.named_buffers(remove_duplicate=False)}
        packed = {n: [fake(t) for t in _packed_tensors(p)] for n, p in model.named_parameters(remove_duplicate=False)
                  if _packed_tensors(p)}  # the same fakes as fake mode's own conversions (they are memoized)

        def fake_input(t):
            f = fake(t)
            return f.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else f

        f_args, f_kwargs = _pytree.tree_map_only(torch.Tensor, fake_input, (args, kwargs))

    owned: dict[str, tuple[str, ...]] = {}  # parameter name -> blocks holding it
    for name in params:
        owned[name] = tuple(b for b in block_paths if name.startswith(b + "."))

    trainable = [p for n, p in params.items() if p.requires_grad]
    unique_trainable = list({id(p): p for p in trainable}.values())
    with fake_mode:
        fake_of = {id(p): params[n] for n, p in model.named_parameters(remove_duplicate=False)}
        opt = _optimizer_for(optimizer, unique_trainable, fake_of) if unique_trainable else None

    from torch.nn.utils.stateless import _reparametrize_module

    block_inputs = {b: 0 for b in block_paths}
    with fake_mode, sim, _quiet_fake_tensor_log():
        for t in {id(v): v for v in [*params.values(), *buffers.values(), *sum(packed.values(), [])]}.values():
            sim.add(t, "weights")
        for t in _pytree.tree_leaves((f_args, f_kwargs)):
            if isinstance(t, torch.Tensor):
                sim.add(t, "inputs")
        if opt is not None:
            # the steady state: the state exists before the step (one simulated step creates it)
            sim.phase = "optimizer"
            for p in unique_trainable:
                p.grad = torch.zeros_like(p)
            with _data_dependence_explained(sim):
                opt.step()
            for p in unique_trainable:
                p.grad = None
            sim.sweep()
            sim.relabel("optimizer", "optimizer state")
        start = sim.current
        first_event = len(sim.events)
        sim.phase = "forward"
        # the fake parameters stay in place through backward: checkpointed blocks run their forward again there
        with _reparametrize_module(model, _one_name_per_slot(model, {**{n: p for n, p in params.items()
                                                                         if n not in packed}, **buffers}),
                                   strict=False), \
                _data_dependence_explained(sim), _rng_states_counted(sim), _packed_restored(model), \
                _masks_decided_on_real_values(mask_facts, kwargs, f_kwargs, notes):
            with _tracked_forwards(model, sim, paths, {}, block_inputs):
                out = model(*f_args, **f_kwargs)
            loss = loss_of(out)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError("estimate: the loss must be a one-element tensor that requires grad, got "
                                 f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            held_output = out if hold_output else None
            del out
            sim.sweep()
            output_keys = _storage_keys(held_output)
            kept_by_owner: dict[str, int] = {}
            for key, (_, n, kind, owner) in sim.live.items():
                if kind == "activations" and key not in output_keys:
                    kept_by_owner[owner] = kept_by_owner.get(owner, 0) + n
            kept_total = sum(kept_by_owner.values())
            sim.phase = "backward"
            with _backward_outside_autocast(device):
                loss.backward()
            del loss
        sim.sweep()
        grad_keys = _storage_keys([p.grad for p in unique_trainable])
        grad_bytes = sum(sim.live[k][1] for k in grad_keys if k in sim.live)
        if opt is not None:
            sim.phase = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
            sim.sweep()
        del held_output

    skipped: list[str] = []
    failed: list[str] = []
    _measure_scratch(sim.signatures, device, skipped, failed)
    if any(sig[0] in _GROUPED_MM and value and _routing_decides_scratch(sig, device)
           for sig, value in sim.signatures.items()):
        notes.append("the scratch of the experts' grouped matmuls (aten._grouped_mm) depends on how the router "
                     "splits the tokens; it is counted for an even split across experts, and an uneven one may "
                     "hold a little more")

    def held(event) -> int:
        """The device bytes alive while an op ran: after it, or inside it where its kernel (scratch space, which
        the replay measured with the op's wrapped numbers) or its wrapped numbers held more than its outputs."""
        after, new, sig, *_, totals, transient = event
        inside = sim.signatures.get(sig) or 0 if sig is not None else 0
        return after - totals.get("host", 0) - new + max(new + transient, inside)

    # the peak: after each op, or inside it (each op's bytes found once: the blocks' peaks read them too)
    held_at = [held(e) for e in sim.events[first_event:]]
    peak, peak_at = start, None
    for i, here in enumerate(held_at, first_event):
        if here > peak:
            peak, peak_at = here, i
    at_peak: dict[str, int] = {}
    peak_where = "the step's start"
    if peak_at is not None:
        after, new, sig, phase, owner, node, totals, transient = sim.events[peak_at]
        at_peak = {k: v for k, v in totals.items() if v and k != "host"}
        inside = sim.signatures.get(sig) or 0 if sig is not None else 0
        if inside > new + transient:
            at_peak["scratch inside the op"] = inside - new
        elif transient:
            at_peak["Python numbers inside the op"] = transient
        peak_where = f"{phase} of {owner or '(model)'}" + (f" ({node})" if node else "") + (
            f", inside {sig[0].__name__}" if inside > new + transient else "")
    host_peak = max((e[6].get("host", 0) for e in sim.events[first_event:]), default=0)
    weight_bytes = sim.totals.get("weights", 0)
    input_bytes = sim.totals.get("inputs", 0)
    optim_bytes = sim.totals.get("optimizer state", 0) + sim.totals.get("optimizer", 0)

    def param_bytes(t):
        st = _storage(t)
        return sim._bytes(st, t.device.type) if st is not None else 0

    block_peak: dict[str, int] = {}
    blocks_of_owner: dict[str, list[str]] = {}  # an op's owner -> the blocks holding it, once per owner
    for i, here in enumerate(held_at, first_event):
        owner = sim.events[i][4]
        if not owner:
            continue
        holding = blocks_of_owner.get(owner)
        if holding is None:
            holding = blocks_of_owner[owner] = [b for b in block_paths if owner == b or owner.startswith(b + ".")]
        for b in holding:
            block_peak[b] = max(block_peak.get(b, 0), here)
    rows = []
    for b in block_paths:
        row = BlockEstimate(b)
        for name, p in params.items():
            if b in owned[name]:
                row.weight_bytes += param_bytes(p)
                if p.requires_grad:
                    row.gradient_bytes += param_bytes(p)
                    if opt is not None:
                        st = opt.state.get(p, {})
                        row.optimizer_bytes += sum(param_bytes(v) for v in st.values()
                                                   if isinstance(v, torch.Tensor))
        row.kept_bytes = sum(n for o, n in kept_by_owner.items() if o == b or o.startswith(b + "."))
        row.peak_bytes = block_peak.get(b, 0)
        row.input_bytes = max(block_inputs.get(b, 0), 0)
        rows.append(row)
    timeline = [(i, e[3], e[0]) for i, e in enumerate(sim.events[first_event:])]
    cast = {n: f.dtype for n, f in params.items() if f.dtype != expected_dtypes[n]}  # (p.data = ... in forward)
    if not cast and not steady and not _RELEARNED.get() and _learned(model) != learned_before:
        # the simulated step taught the converted layers what their consumers keep (a ReLU whose output a later layer
        # keeps then shares it instead of a mask, and runs stock's backward): every later step runs so, and may peak
        # higher than the first (a fresh DPT: 22 % higher; the vision sweep). Estimated as those steps run
        token = _RELEARNED.set(True)
        try:
            return estimate(model, *args, optimizer=optimizer, loss_fn=loss_fn, blocks=blocks, device=device,
                            hold_output=hold_output, **kwargs)
        finally:
            _RELEARNED.reset(token)
    if cast and not steady:
        token = _STEADY_DTYPES.set(cast)
        try:  # the steady state: every later step starts with these parameters cast
            again = estimate(model, *args, optimizer=optimizer, loss_fn=loss_fn, blocks=blocks, device=device,
                             hold_output=hold_output, **kwargs)
        finally:
            _STEADY_DTYPES.reset(token)
        again.notes.append(f"{len(cast)} parameter(s) are cast in place by the step's first run (e.g. "
                           f"{next(iter(cast))} to {next(iter(cast.values()))}, as bitsandbytes does with a bias): "
                           f"estimated as every later step runs, with them cast")
        return again
    return MemoryEstimate(
        peak_bytes=peak, step_peak_bytes=peak - start, weight_bytes=weight_bytes, input_bytes=input_bytes,
        gradient_bytes=grad_bytes, optimizer_bytes=optim_bytes, kept_bytes=kept_total, at_peak=at_peak,
        peak_where=peak_where, blocks=rows, device=device, host_peak_bytes=host_peak, timeline=timeline,
        autocast_cache_bytes=sim.autocast_cache_bytes,
        notes=notes
        + ([f"under autocast, {sim.autocast_cache_bytes} B of the step are the low-precision copies autocast caches "
            f"of trainable weights until its region exits: a loop whose one autocast region spans several steps made "
            f"them in its first step, and its later steps peak that much lower above their start "
            f"(autocast_cache_bytes; the same peak_bytes)"]
           if sim.autocast_cache_bytes else [])
        + ([f"scratch space inside {len(skipped)} op call(s) ({', '.join(sorted(set(skipped)))}) is not "
            f"counted: their inputs exceed SLIMGRAD_ESTIMATE_REPLAY_BYTES ({_gib(_REPLAY_LIMIT)})"]
           if skipped else [])
        + ([f"scratch space inside {', '.join(sorted(set(failed)))} is not counted: replayed on real tensors of the "
            f"simulated dtypes it raised (the simulation gave some output another dtype than the real kernel does)"]
           if failed else []))


# -- how the peak grows with the batch ----------------------------------------------------------------------


@dataclasses.dataclass
class MemoryScaling:
    """The peak as a function of one size ``n`` (batch, sequence length, image side), fitted exactly through
    three simulated steps: ``peak(n) = fixed + per_unit * n + per_unit_squared * n**2`` (the square term is
    attention's scores, which grow with the sequence length squared; zero for a batch). ``sizes`` and
    ``peaks`` are the simulated points. Between them :meth:`predict` interpolates; beyond them it extrapolates a
    parabola where the peak may move to another op (a tiny GPT-2 fitted at lengths 8/16/32 read +15 % at 48 and
    +34 % at 64): for an answer to rely on, :func:`largest_fitting` simulates the steps it decides by."""

    sizes: tuple[int, ...]
    peaks: tuple[int, ...]
    fixed: float
    per_unit: float
    per_unit_squared: float

    def predict(self, n: int) -> int:
        return int(round(self.fixed + self.per_unit * n + self.per_unit_squared * n * n))

    def __str__(self) -> str:
        text = f"peak(n) ~= {_gib(int(self.fixed))} + {self.per_unit / 2**20:.3f} MiB * n"
        if abs(self.per_unit_squared) > 1e-9 * max(1.0, abs(self.per_unit)):
            text += f" + {self.per_unit_squared / 2**10:.3f} KiB * n^2"
        return text + f"   (simulated at n = {', '.join(map(str, self.sizes))})"


def scaling(model: nn.Module, make_example: Callable[[int], Any], sizes=(1, 2, 4), **estimate_options) -> MemoryScaling:
    """Fit :class:`MemoryScaling` from :func:`estimate` at three ``sizes``; ``make_example(n)`` builds the batch
    for size ``n`` (a dict of keyword inputs, a tensor, or a tuple of positional inputs)."""
    if not callable(make_example):
        raise TypeError(f"scaling: 'make_example' must be a function n -> batch (the batch for size n), got a "
                        f"{type(make_example).__name__}; e.g. lambda n: {{'input_ids': ids[:, :n]}}")
    if (not isinstance(sizes, (list, tuple)) or
            not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
        raise TypeError(f"scaling: 'sizes' must be three different ints >= 1, got {sizes!r}")
    sizes = tuple(sizes)
    if len(sizes) != 3 or len(set(sizes)) != 3 or min(sizes) < 1:
        raise ValueError(f"scaling: 'sizes' must be three different sizes >= 1, got {sizes!r}")
    peaks = []
    shapes_at: dict = {}
    for n in sizes:
        a, kw = split_example(make_example(n))
        shapes = tuple(tuple(t.shape) for t in _pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor))
        if shapes_at.setdefault(shapes, n) != n:  # (a flat fit from one batch shape, said nothing)
            raise ValueError(f"scaling: make_example({shapes_at[shapes]}) and make_example({n}) built batches of the "
                             f"same shapes {list(shapes)}: the batch must grow with n (a slice ids[:, :n] stops at "
                             f"ids' length)")
        peaks.append(estimate(model, *a, **kw, **estimate_options).peak_bytes)
    (x0, x1, x2), (y0, y1, y2) = sizes, peaks
    # the parabola through three points (Newton's divided differences)
    d01 = (y1 - y0) / (x1 - x0)
    d12 = (y2 - y1) / (x2 - x1)
    c = (d12 - d01) / (x2 - x0)
    b = d01 - c * (x0 + x1)
    a = y0 - b * x0 - c * x0 * x0
    return MemoryScaling(sizes, tuple(peaks), a, b, c)


def largest_fitting(model: nn.Module, budget, make_example: Callable[[int], Any], *, low: int = 1,
                    high: int = 1 << 20, **estimate_options) -> tuple[int, MemoryEstimate | None]:
    """The largest ``n`` in ``[low, high]`` whose simulated step fits ``budget`` (bytes or ``"12GiB"``), and its
    estimate; ``(0, None)`` when even ``low`` does not fit. ``make_example(n)`` builds the batch for size ``n``
    (``lambda n: {"input_ids": ids[:, :n], "labels": ids[:, :n]}`` with ``high=ids.shape[1]`` for "the longest
    sequence that fits"; a batch that stops growing with n raises).
    Doubling, then bisection: about 2·log2(n) simulations, each a few seconds at most, none allocating."""
    limit = parse_bytes(budget)
    if not callable(make_example):
        raise TypeError(f"largest_fitting: 'make_example' must be a function n -> batch (the batch for size n), got a "
                        f"{type(make_example).__name__}; e.g. lambda n: {{'input_ids': ids[:, :n]}}")
    for name, v in (("low", low), ("high", high)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"largest_fitting: '{name}' must be an int, got {v!r}")
    if low < 1 or high < low:
        raise ValueError(f"largest_fitting: need 1 <= low <= high, got low={low}, high={high}")
    shapes_at: dict = {}  # the batch's tensor shapes -> the n that built them

    def at(n):
        a, kw = split_example(make_example(n))
        shapes = tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor))
        if shapes_at.setdefault(shapes, n) != n:
            # The search doubles n until the step no longer fits: a batch that stopped growing (a slice of a fixed
            # tensor, ids[:, :n], ends at its length) always fits, and the answer would be 'high'.
            raise ValueError(f"largest_fitting: make_example({shapes_at[shapes]}) and make_example({n}) built batches "
                             f"of the same shapes {list(shapes)}: the batch must grow with n (a slice ids[:, :n] stops "
                             f"at ids' length: pass high=ids.shape[1], or build the batch for n)")
        return estimate(model, *a, **kw, **estimate_options)

    best = at(low)
    if best.peak_bytes > limit:
        return 0, None
    good, bad = low, None
    n = low
    while bad is None:
        n = min(n * 2, high)
        e = at(n)
        if e.peak_bytes <= limit:
            good, best = n, e
            if n == high:
                return good, best
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        e = at(mid)
        if e.peak_bytes <= limit:
            good, best = mid, e
        else:
            bad = mid
    return good, best
