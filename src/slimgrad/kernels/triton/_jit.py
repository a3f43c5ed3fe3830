"""What every Triton kernel module shares: deferred ``triton.jit`` and launch sizes.

Why deferred: ``triton.jit`` decides at decoration time whether a kernel is compiled for the GPU or run by
the interpreter (``TRITON_INTERPRET=1``). ``jit`` keeps the plain function and decorates it on first launch
(importing a kernel module, as ``python -m slimgrad kernels`` does, compiles nothing). Triton decorates its
own library (``tl.sum``, ``tl.sigmoid``) when triton is imported, so the interpreter works only when the
variable was set before that; a launch under the interpreter otherwise stops with an error saying so.

Kernels written with ``jit`` cannot call each other (triton only inlines its own ``JITFunction``s), so each
kernel is self-contained and picks its variant with ``tl.constexpr`` flags.
"""

from __future__ import annotations

import functools

import torch

from slimgrad.kernels.registry import triton_interpreting

__all__ = ["jit", "row_block", "num_warps", "num_programs"]


class _Deferred:
    """A kernel function whose ``triton.jit`` happens at first launch (per interpreter setting)."""

    __slots__ = ("fn", "_compiled")

    def __init__(self, fn):
        self.fn = fn
        self._compiled = {}

    def __getitem__(self, grid):
        return _Launch(self, grid)

    def compiled(self):
        interpret = triton_interpreting()
        kernel = self._compiled.get(interpret)
        if kernel is None:
            import triton

            if interpret:
                _check_interpreter()
            kernel = self._compiled[interpret] = triton.jit(self.fn)
        return kernel


class _Launch:
    """One launch of a deferred kernel, skipped where an argument is a fake tensor.

    Why: ``slimgrad.estimate`` runs the step on fake tensors (shapes, no data) and its allocator simulation
    counts what the wrappers allocate around the launches (outputs, partial sums); a kernel has nothing to compute
    there. So a simulated step runs each family's Triton wrapper as the real step does, allocations in the same
    order, instead of the torch reference, whose transients differ (:func:`slimgrad.kernels.registry.choose`)."""

    __slots__ = ("deferred", "grid")

    def __init__(self, deferred, grid):
        self.deferred = deferred
        self.grid = grid

    def __call__(self, *args, **kwargs):
        # every kernel's first argument is a tensor, fake in a simulated step (where all are): one type check for
        # a real launch
        first = args[0]
        if type(first) is not torch.Tensor and isinstance(first, torch.Tensor) and _is_fake(first):
            return None
        return self.deferred.compiled()[self.grid](*args, **kwargs)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _check_interpreter() -> None:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(standard, "sum", None), InterpretedFunction):
        raise RuntimeError("slimgrad: TRITON_INTERPRET=1 was set after triton was imported; triton's own "
                           "functions are then compiled, not interpreted. Set it before the process imports "
                           "triton (e.g. in the environment that starts Python).")


def jit(fn) -> _Deferred:
    return _Deferred(fn)


def row_block(n: int) -> int:
    """The power-of-two block that holds one row of ``n`` elements (one program per row)."""
    return 1 << max(int(n) - 1, 0).bit_length() if n > 1 else 1


def num_warps(block: int) -> int:
    """Liger-Kernel's choice of warps for a row block (more warps for wider rows)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, rows: int) -> int:
    """Programs for a row-looping backward kernel: one per SM on CUDA (each accumulates its rows' weight
    gradient in registers and writes one partial row), a few under the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(rows, _sm_count(index)))
    return max(1, min(rows, 4))
