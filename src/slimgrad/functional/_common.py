"""Small helpers shared by every autograd Function in slimgrad.

They exist so that each op family takes the same decisions the same way: how a backward kernel is fed a
tensor whose values it never reads, how autocast is mirrored, and how double backward is refused.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "Function",
    "standin",
    "autocast_dtype",
    "autocast_enabled",
    "autocast_lower_precision",
    "autocast_off",
    "check_tensor",
    "UseCell",
    "learn_from_use",
    "mark_producer",
    "note_input_kept",
    "fast_kernel",
    "register_torch_kernel",
]


class Function(torch.autograd.Function):
    """Base of slimgrad's autograd Functions: refuses ``torch.func`` transforms with a message that says
    what to do, instead of torch's generic one about ``setup_context``.

    The Functions decide what to keep inside ``forward`` from ``ctx.needs_input_grad`` and the tensors'
    values (masks, positions, seeds), which functorch's split ``forward``/``setup_context`` protocol
    cannot express without returning those as extra outputs; until they do, transforms are refused.
    """

    @classmethod
    def apply(cls, *args, **kwargs):
        if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                f"slimgrad: {cls.__name__} does not support torch.func transforms (grad, vmap, jacrev, "
                f"functional_call under a transform, ...). Run this part with stock layers "
                f"(slimgrad.revert(model), or outside `with slimgrad.enabled():`)."
            )
        return super().apply(*args, **kwargs)


def standin(shape, like: torch.Tensor) -> torch.Tensor:
    """A zero-stride tensor of ``shape`` backed by a single element.

    Backward kernels take the input (or weight) tensor even when they only read its shape. Feeding them
    this instead of the real tensor lets a Function skip saving the real one without allocating an
    input-sized placeholder. Only pass it where the kernel provably never reads the values (tests check
    the gradients bitwise against stock PyTorch) and never calls ``.contiguous()`` on it (tests check
    peak bytes).
    """
    return torch.empty((), dtype=like.dtype, device=like.device).expand(shape)


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types autocast does not know (``meta``:
    torch raises there, while stock layers run on meta tensors for shape propagation and meta init)."""
    if device_type == "meta":
        return False
    return torch.is_autocast_enabled(device_type)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast would use on ``device_type``, or None when it is off."""
    if not autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_lower_precision(*tensors: torch.Tensor | None):
    """Cast floating tensors the way autocast casts the inputs of ops on its lower-precision list
    (convolutions, linear). Returns the tensors unchanged when autocast is off.

    The cast happens outside our Function, as a differentiable ``.to``, exactly like stock autocast, so
    the gradient of an fp32 parameter comes back in fp32 and the Function itself sees one dtype.
    """
    first = next(t for t in tensors if t is not None)
    dtype = autocast_dtype(first.device.type)
    if dtype is None:
        return tensors
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def autocast_off(device_type: str):
    """A context that disables autocast for ``device_type`` when it is on (a no-op otherwise), so the ops
    inside a Function run in the dtypes we already chose."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def check_tensor(value, name: str, *, fn: str) -> None:
    """Raise a TypeError naming the argument when ``value`` is not a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(value).__name__}")


# The producer/consumer rule. An activation (a ReLU module, say) can keep either a small mask or its
# output; keeping the output is free when a consumer keeps that same tensor anyway (the next conv whose
# weight trains keeps its input), while a mask would then be extra. Whether a consumer keeps it is only
# known after the producer's forward, so the producer decides from what it learned in the previous step:
#
# - each call of the producer gets a :class:`UseCell`, attached to its output tensor (``mark_producer``);
# - a consumer that saves that tensor for backward marks the cell (``note_input_kept``);
# - the producer's backward ORs its cells into the module (``learn_from_use``) and queues a callback that
#   publishes the result as ``module._slimgrad_output_kept`` once the whole backward pass is over.
#
# Publishing only at the end of backward keeps the decision fixed while checkpointing recomputes the
# forward inside backward (non-reentrant checkpointing insists that the recomputation saves the same
# tensors), and a module called several times per forward (torchvision reuses ``self.relu``) keeps its
# output when any of its uses is kept. Gradients are exact either way; only the bytes kept differ.
_PRODUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class UseCell:
    """Whether a consumer kept the output of one call of a producer."""

    __slots__ = ("kept",)

    def __init__(self):
        self.kept = False


def mark_producer(output: torch.Tensor, cell: UseCell) -> None:
    """Attach ``cell`` to ``output`` so that a consumer saving ``output`` can mark it."""
    if not torch.compiler.is_compiling():
        _PRODUCERS[output] = cell


def note_input_kept(x: torch.Tensor) -> None:
    """Called by a Function that saves its input ``x`` for backward: marks x's producer cell, if any."""
    if torch.compiler.is_compiling():
        return
    cell = _PRODUCERS.get(x)
    if cell is not None:
        cell.kept = True


def learn_from_use(producer, cell: UseCell) -> None:
    """Called from the producer's backward: fold this call's cell into what the next forward will use."""
    if torch.compiler.is_compiling():
        return
    task = torch._C._current_graph_task_id()
    if getattr(producer, "_slimgrad_task", None) != task:
        producer._slimgrad_task = task
        producer._slimgrad_uses_kept = False

        def publish():
            producer._slimgrad_output_kept = producer._slimgrad_uses_kept

        torch.autograd.Variable._execution_engine.queue_callback(publish)
    producer._slimgrad_uses_kept = producer._slimgrad_uses_kept or cell.kept


def fast_kernel(family: str, tensor: torch.Tensor):
    """The non-torch implementation :mod:`slimgrad.kernels` chose for ``family`` on ``tensor`` (a Triton or
    numba kernel module/object), or None when the Function's own torch code should run: the torch backend
    was chosen, nothing fits, or we are being traced by torch.compile (which generates its own fused
    kernels from the torch code and cannot trace a deferred Triton launch)."""
    if torch.compiler.is_compiling():
        return None
    from slimgrad import kernels

    impl = kernels.choose(family, tensor)
    return None if impl is None or getattr(impl, "backend", "torch") == "torch" else impl


class TorchKernel:
    """The registry entry standing for a Function's own torch code (``backend == "torch"``)."""

    backend = "torch"

    def __init__(self, family: str):
        self.family = family

    def __repr__(self):
        return f"TorchKernel({self.family!r})"


_ALL_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def register_torch_kernel(family: str, *, priority: int = 0, devices=("cpu", "cuda", "xpu", "mps"),
                          dtypes=_ALL_FLOATS) -> None:
    """Register a Function's torch code as the ``torch`` implementation of ``family`` (the fallback the
    registry lists and ``SLIMGRAD_KERNELS=torch`` selects)."""
    from slimgrad.kernels import registry

    if any(k.backend == registry.TORCH for k in registry.implementations(family)):
        return
    impl = TorchKernel(family)
    registry.register(family, registry.TORCH, devices=devices, dtypes=dtypes, load=lambda: impl, priority=priority)
