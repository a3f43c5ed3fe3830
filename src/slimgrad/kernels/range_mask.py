"""Kernel family ``range_mask``: the 1-bit masks of the clamp-like activations (ReLU6, Hardtanh, Threshold,
Hardsigmoid; :mod:`slimgrad.functional.clamp`) and the backward that reads them.

Contract (every backend implements exactly this; the torch backend below is the reference the tests
compare the others with)::

    impl.pack(x, rule, lo, hi) -> packed
    impl.select(grad, packed) -> grad_input

* ``x``: a **contiguous** floating tensor (the Function hands channels_last and other dense layouts over
  as their contiguous permuted view), any shape, numel >= 0. Not modified.
* ``rule``: ``"inside"``: the bit is ``lo < x < hi`` (NaN clear: hardtanh, relu6, hardsigmoid);
  ``"above"``: the bit is ``not (x <= lo)`` (NaN set: threshold; ``hi`` unused).
* ``lo``, ``hi``: Python floats, exactly representable in fp32 (or x's dtype when that is fp64), compared
  with x's values exactly (for fp16/bf16 x the comparison is made in fp32; the caller rounds the bounds
  the way stock's backward kernel does, see ``slimgrad.functional.clamp._bounds``).
* ``packed``: ``uint8``, 1-D, ``ceil(numel / 8)`` bytes, bit ``i % 8`` (LSB first) of byte ``i // 8`` for
  element ``i`` of ``x.reshape(-1)``, unused high bits of the last byte zero (the format of
  :mod:`slimgrad.kernels.bitmask`).
* ``grad``: contiguous, never requiring grad. ``grad_input``: a new contiguous tensor of grad's shape and
  dtype, bitwise ``bit ? grad : +0.0`` (so inf/NaN gradients at clear bits give +0, as stock's kernels).

Dtypes: float32, float64, bfloat16, float16 for the torch backend; a fast backend declares what it handles.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import registry

__all__ = ["FAMILY", "RULES", "CoreRangeMask", "TorchRangeMask", "choose"]

FAMILY = "range_mask"
RULES = ("inside", "above")
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_NUMPY_DTYPES = (torch.float32, torch.float64)  # not fp16: numpy would round an fp32 bound to fp16
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mask_torch(x: torch.Tensor, rule: str, lo: float, hi: float) -> torch.Tensor:
    """The bool mask of ``rule`` with torch ops (also what the Functions use under torch.compile).

    Eager, fp16/bf16 ``x`` is compared in its own dtype with the bounds rounded outward to it (:func:`_outward`:
    the same answer for every value of that dtype, NaN included), not widened to fp32 (a float copy of x and
    bool temporaries: the step peaked 1-2x x above stock's); the mask is formed in place (one bool temporary).
    """
    if torch.compiler.is_compiling():
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # exact values; the bounds are fp32 numbers
        # Bounds as given (symbolic under dynamic=True, see clamp._bounds): rounded to x's dtype here, in
        # the graph, as the eager path rounds them before the call.
        lo = torch.full((), lo, dtype=x.dtype, device=x.device)
        hi = None if hi is None else torch.full((), hi, dtype=x.dtype, device=x.device)
        if rule == "above":
            return ~(x <= lo)
        return (x > lo) & (x < hi)
    lo, hi = _outward(lo, hi, x.dtype)
    if rule == "above":
        return torch.le(x, lo).logical_not_()
    return torch.gt(x, lo).logical_and_(torch.lt(x, hi))


_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=256)
def _outward(lo: float, hi: float | None, dtype: torch.dtype) -> tuple[float, float | None]:
    """For fp16/bf16: ``lo`` rounded down and ``hi`` rounded up to ``dtype`` (other dtypes: as given). For every
    x of that dtype, ``x <= lo`` iff ``x <= lo'``, ``x > lo`` iff ``x > lo'`` and ``x < hi`` iff ``x < hi'`` (no
    value of the dtype lies strictly between a bound and its rounding), so comparing in x's dtype, where the
    rounded bounds are exact, gives the fp32 comparison's mask; NaN bounds stay NaN (every comparison false)."""
    if dtype not in _HALF:
        return lo, hi
    return _round_toward(lo, dtype, down=True), None if hi is None else _round_toward(hi, dtype, down=False)


def _round_toward(v: float, dtype: torch.dtype, down: bool) -> float:
    t = torch.tensor(v, dtype=torch.float32, device="cpu").to(dtype)  # nearest (v is an fp32 number)
    r = float(t)
    if (r > v) if down else (r < v):
        toward = torch.tensor(float("-inf") if down else float("inf"), dtype=dtype, device="cpu")
        r = float(torch.nextafter(t, toward))
    return r


class TorchRangeMask:
    """The reference: numpy comparisons into a padded buffer and ``packbits`` on CPU in eager mode, torch
    comparisons elsewhere (written into that buffer, fp16/bf16 in their own dtype); backward selects the
    gradient's bits by the mask (``where(mask, bits, 0)``: ``where(mask, grad, +0)`` bit for bit, with no
    full-size integer copy of the mask, which a product with it costs on CPU)."""

    name = "torch"

    @staticmethod
    def pack(x: torch.Tensor, rule: str, lo: float, hi: float) -> torch.Tensor:
        from slimgrad.kernels import bitmask as _bitmask

        if torch.compiler.is_compiling():
            flat = mask_torch(x, rule, lo, hi).reshape(-1)
            pad = _bitmask.packed_numel(flat.numel()) * 8 - flat.numel()
            return _bitmask.pack(torch.cat([flat, flat.new_zeros(pad)]))
        flat, view = _bitmask.new_padded_mask(x.shape, x.device)
        if x.dtype in _NUMPY_DTYPES and _bitmask.use_numpy(x):
            a, o = x.detach().numpy(), view.numpy()
            if rule == "above":
                np.less_equal(a, lo, out=o)
                np.logical_not(o, out=o)
            else:
                np.greater(a, lo, out=o)
                o &= np.less(a, hi)
        elif rule == "above":
            lo, _ = _outward(lo, None, x.dtype)
            torch.le(x, lo, out=view)
            view.logical_not_()
        else:
            # Each comparison written into the one bool buffer and packed on its own, the packs and-ed: no
            # bool temporary beside the buffer.
            lo, hi = _outward(lo, hi, x.dtype)
            torch.gt(x, lo, out=view)
            packed = _bitmask.pack(flat)
            torch.lt(x, hi, out=view)
            return packed.bitwise_and_(_bitmask.pack(flat))
        return _bitmask.pack(flat)

    @staticmethod
    def select(grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``where`` on the gradient's bits: the bool mask is read as it is (a product with it would widen it
        to a full-size integer copy first, on CPU)."""
        from slimgrad.kernels import bitmask as _bitmask

        mask = _bitmask.unpack(packed, grad.shape)
        bits = grad.view(_SAME_SIZE_INT[grad.element_size()])
        return torch.where(mask, bits, 0).view(grad.dtype)

    @staticmethod
    def select_into(grad: torch.Tensor, packed: torch.Tensor, shape, inverse, out: torch.Tensor) -> torch.Tensor:
        """:meth:`select` of a gradient in another memory order than the mask's: ``packed`` holds the mask of
        ``shape`` (the contiguous order), which ``permute(inverse)`` turns into grad's logical order; written into
        ``out`` (grad's shape, any strides; grad itself allowed: in place), returned."""
        from slimgrad.kernels import bitmask as _bitmask

        mask = _bitmask.unpack(packed, shape).permute(inverse)
        bits = out.view(_SAME_SIZE_INT[out.element_size()])
        torch.where(mask, grad.view(bits.dtype), bits.new_zeros(()), out=bits)
        return out


TORCH_IMPL = TorchRangeMask()

registry.register(FAMILY, registry.TORCH, devices=("cpu", "cuda", "meta"), dtypes=_FLOATS,
                  load=lambda: TORCH_IMPL, priority=0, note="numpy compare + packbits (reference)")


class CoreRangeMask:
    """The compiled core's kernels (``slimgrad/csrc/range_mask.cpp``): one parallel, vectorised pass packing the
    comparison's bits from x (fp16/bf16 widened to fp32 exactly), one pass selecting the gradient by them.
    Supersedes numba for this family (priority 20)."""

    name = "core"

    def __init__(self, core):
        self.pack = core.range_mask_pack
        self.select = core.range_mask_select



registry.register(FAMILY, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20,
                  load=registry.core_loader(CoreRangeMask),
                  note="compiled core: one pass packing, one pass selecting")


class CoreRangeMaskSimulation:
    """What the core's kernels allocate (``range_mask_pack``: the packed mask; ``range_mask_select``: the
    gradient), without data: for fake tensors (``slimgrad.estimate``) whose real ones would get the core
    (:func:`registry.simulates_core`)."""

    name = "core-simulation"

    @staticmethod
    def pack(x, rule, lo, hi):
        return torch.empty(((x.numel() + 7) // 8,), dtype=torch.uint8, device=x.device)

    @staticmethod
    def select(grad, packed):
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


CORE_SIMULATION = CoreRangeMaskSimulation()


def choose(x: torch.Tensor):
    """The implementation for ``x`` (the torch reference while compiling: fast backends are eager-only; for the
    estimate's fake tensors the core's allocations)."""
    if type(x) is not torch.Tensor and registry.simulates_core(FAMILY, x):
        return CORE_SIMULATION
    return registry.choose_or_reference(FAMILY, x, TORCH_IMPL)
