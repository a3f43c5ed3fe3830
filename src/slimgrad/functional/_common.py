"""Small helpers shared by every autograd Function in slimgrad.

They exist so that each op family takes the same decisions the same way: how a backward kernel is fed a
tensor whose values it never reads, how autocast is mirrored, and how double backward is refused.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "standin",
    "autocast_dtype",
    "autocast_lower_precision",
    "autocast_off",
    "check_tensor",
    "mark_producer",
    "note_input_kept",
]


def standin(shape, like: torch.Tensor) -> torch.Tensor:
    """A zero-stride tensor of ``shape`` backed by a single element.

    Backward kernels take the input (or weight) tensor even when they only read its shape. Feeding them
    this instead of the real tensor lets a Function skip saving the real one without allocating an
    input-sized placeholder. Only pass it where the kernel provably never reads the values (tests check
    the gradients bitwise against stock PyTorch) and never calls ``.contiguous()`` on it (tests check
    peak bytes).
    """
    return torch.empty((), dtype=like.dtype, device=like.device).expand(shape)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast would use on ``device_type``, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
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
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def check_tensor(value, name: str, *, fn: str) -> None:
    """Raise a TypeError naming the argument when ``value`` is not a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(value).__name__}")


# Activation outputs whose producer could keep them instead of a mask, and who produced them. A producer
# (for instance a ReLU module) reads its ``_slimgrad_output_kept`` flag at the next forward: True means a
# consumer kept the output anyway last time, so keeping it again costs nothing, whereas a mask would be
# extra. Only the flag's value changes what is kept; gradients are exact either way.
_PRODUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_producer(output: torch.Tensor, producer) -> None:
    """Record that ``producer`` made ``output`` and wants to hear whether a consumer keeps it."""
    if torch.compiler.is_compiling():
        return
    producer._slimgrad_output_kept = False
    _PRODUCERS[output] = producer


def note_input_kept(x: torch.Tensor) -> None:
    """Called by a Function that saves its input ``x`` for backward: tells x's producer, if any."""
    if torch.compiler.is_compiling():
        return
    producer = _PRODUCERS.get(x)
    if producer is not None:
        producer._slimgrad_output_kept = True
