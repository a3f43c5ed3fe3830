"""numba kernels of the ``dropout_bits`` family (contract: :mod:`slimgrad.kernels.dropout`).

Forward: one pass reading x and the drawn keep mask, writing ``x * (keep ? scale : 0)`` and the packed
bits (stock does ``div_`` over its float noise, then ``x * noise``: two passes and a float mask kept).
Backward: one pass over the gradient and the bits. float32/float64: the product of two values of the
dtype, rounded once, as stock's; bf16/fp16 run the torch reference.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from slimgrad.kernels.dropout import BITS_TORCH

from ._numba import as_flat_numpy as _np
from ._numba import jit, prange, report_first_compile

__all__ = ["NumbaDropoutBits"]

_NP = {torch.float32: np.float32, torch.float64: np.float64}


@jit
def _fwd(x, keep, out, packed, scale, zero):
    n = x.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        m = min(8, n - base)
        for j in range(m):
            k = keep[base + j] != 0
            out[base + j] = x[base + j] * (scale if k else zero)
            byte |= k << j
        packed[b] = byte


@jit
def _bwd(g, packed, gi, scale, zero):
    n = g.size
    for b in prange(packed.size):
        base = b * 8
        byte = packed[b]
        m = min(8, n - base)
        for j in range(m):
            gi[base + j] = g[base + j] * (scale if (byte >> j) & 1 else zero)



class NumbaDropoutBits:
    name = "numba"

    def __init__(self):
        started = time.perf_counter()
        x = torch.linspace(-1.0, 1.0, 9)  # never the default generator: a warm-up must not move it
        out, packed = self.forward(x, torch.ones(9, dtype=torch.uint8), 2.0, False)
        self.backward(x, packed, 2.0)
        report_first_compile(started, "dropout_bits")

    @staticmethod
    def forward(x, keep, scale, inplace):
        t = _NP.get(x.dtype)
        if t is None:
            return BITS_TORCH.forward(x, keep, scale, inplace)
        out = x if inplace else torch.empty_like(x)
        packed = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        _fwd(_np(x), _np(keep), _np(out), packed.numpy(), t(scale), t(0))
        return out, packed

    @staticmethod
    def backward(grad, packed, scale, out=None):
        t = _NP.get(grad.dtype)
        if t is None:
            return BITS_TORCH.backward(grad, packed, scale, out)
        gi = torch.empty_like(grad) if out is None else out
        _bwd(_np(grad), packed.numpy(), _np(gi), t(scale), t(0))
        return gi
