"""numba kernels of the ``range_mask`` family (contract: :mod:`slimgrad.kernels.range_mask`): one pass
that reads x and writes the packed bits, one pass that reads the bits and writes the gradient.

The reference makes a bool byte per element with numpy (two comparisons and an AND for "inside"), then
packs; here eight comparisons fill one byte in a register. Packing runs for float32/float64 (bounds
rounded to the dtype by the caller, so the comparison is stock's); fp16/bf16 delegate to the reference.
Backward copies the gradient's bit pattern where the bit is set and writes integer zero (+0.0) elsewhere,
on the same-size integer view, so every float dtype is covered bit for bit.
"""

from __future__ import annotations

import time

import torch

from slimgrad.kernels.range_mask import TORCH_IMPL

from ._numba import jit, prange, report_first_compile

__all__ = ["NumbaRangeMask"]

_PACK_DTYPES = (torch.float32, torch.float64)
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


# Branch-free bodies (the comparison's 0/1 shifted into the byte) so LLVM can vectorise them.


@jit
def _pack_inside(a, lo, hi, packed):
    n = a.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        for j in range(min(8, n - base)):
            v = a[base + j]
            byte |= ((v > lo) & (v < hi)) << j
        packed[b] = byte


@jit
def _pack_above(a, lo, packed):
    n = a.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        for j in range(min(8, n - base)):
            byte |= (not (a[base + j] <= lo)) << j
        packed[b] = byte


@jit
def _select(g, packed, out):
    n = g.size
    for b in prange(packed.size):
        base = b * 8
        byte = packed[b]
        for j in range(min(8, n - base)):
            out[base + j] = g[base + j] * ((byte >> j) & 1)


class NumbaRangeMask:
    name = "numba"

    def __init__(self):
        started = time.perf_counter()
        one = torch.ones(9)
        self.select(one, self.pack(one, "inside", 0.0, 6.0))  # compile (or load from the cache) now
        report_first_compile(started, "range_mask")

    @staticmethod
    def pack(x, rule, lo, hi):
        if x.dtype not in _PACK_DTYPES:
            return TORCH_IMPL.pack(x, rule, lo, hi)
        out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        a = x.detach().reshape(-1).numpy()
        if rule == "above":
            _pack_above(a, a.dtype.type(lo), out.numpy())
        else:
            _pack_inside(a, a.dtype.type(lo), a.dtype.type(hi), out.numpy())
        return out

    @staticmethod
    def select(grad, packed):
        ints = grad.view(_SAME_SIZE_INT[grad.element_size()])
        out = torch.empty_like(ints)
        _select(ints.reshape(-1).numpy(), packed.numpy(), out.view(-1).numpy())
        return out.view(grad.dtype)
