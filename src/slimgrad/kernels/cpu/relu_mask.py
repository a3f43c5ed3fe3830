"""numba kernels of the ``relu_mask`` family (contract: :mod:`slimgrad.kernels.relu_mask`).

* relu forward: torch's own vectorized ``relu``/``relu_``, then one pass packing ``out != 0`` from the
  output's integer bits (magnitude bits not all zero: NaN passes, ``-0.0`` does not), for every float
  dtype. A single fused float loop (compare, store, pack) was measured slower: LLVM does not vectorize
  the packing reduction next to the float store (0.55 ms against 0.12-0.26 + 0.2 ms for 512K fp32).
* relu backward: one pass over the gradient and the bits, copying or zeroing (``+0``) each element;
  16-bit dtypes through their integer view, so bitwise by construction.
* leaky_relu (float32/float64): fused forward (``x > 0 ? x : x * slope``, the slope rounded to the dtype
  first, as stock) and backward; bf16/fp16 leaky_relu runs the torch reference (its product's rounding).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from slimgrad.kernels.relu_mask import TORCH_IMPL

from ._numba import as_flat_numpy as _np
from ._numba import jit, prange, report_first_compile

__all__ = ["NumbaReluMask"]

_ZERO = {torch.float32: np.float32(0), torch.float64: np.float64(0)}
_MAGNITUDE = {
    torch.float32: (torch.int32, np.int32(0x7FFFFFFF)),
    torch.float64: (torch.int64, np.int64(0x7FFFFFFFFFFFFFFF)),
    torch.bfloat16: (torch.int16, np.int16(0x7FFF)),
    torch.float16: (torch.int16, np.int16(0x7FFF)),
}


# Branch-free bodies (selects, fixed 8-element inner loops) so LLVM if-converts and vectorizes them: a
# data-dependent branch per element costs a misprediction on random signs (measured 6x slower).


@jit
def _pack_nonzero(bits, packed, magnitude):
    # bits: the output's integer view; an element passes where its magnitude bits are not all zero (NaN
    # included, -0.0 excluded): out != 0. Integer compares vectorize; a float relu with a packing store in
    # the same loop did not (measured 0.55 ms vs torch's relu_ 0.12-0.26 ms + this 0.2 ms, 512K fp32).
    n = bits.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        m = min(8, n - base)
        for j in range(m):
            byte |= ((bits[base + j] & magnitude) != 0) << j
        packed[b] = byte


@jit
def _leaky_fwd(x, out, packed, slope):
    n = x.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        m = min(8, n - base)
        for j in range(m):
            v = x[base + j]
            pos = v > 0
            out[base + j] = v if pos else v * slope
            byte |= pos << j
        packed[b] = byte


@jit
def _relu_bwd(g, packed, gi, zero):
    n = g.size
    for b in prange(packed.size):
        base = b * 8
        byte = packed[b]
        m = min(8, n - base)
        for j in range(m):
            v = g[base + j]
            gi[base + j] = v if (byte >> j) & 1 else zero


@jit
def _leaky_bwd(g, packed, gi, slope):
    n = g.size
    for b in prange(packed.size):
        base = b * 8
        byte = packed[b]
        m = min(8, n - base)
        for j in range(m):
            v = g[base + j]
            gi[base + j] = v if (byte >> j) & 1 else v * slope



class NumbaReluMask:
    name = "numba"

    def __init__(self):
        started = time.perf_counter()
        x = torch.tensor([-1.0, 0.0, 2.0], device="cpu")
        self.backward(x, self.forward(x, None, False)[1], None)  # compile (or load) the fp32 relu pair
        report_first_compile(started, "relu_mask")

    @staticmethod
    def forward(x: torch.Tensor, negative_slope, inplace: bool):
        dtype = x.dtype
        if negative_slope is not None and dtype not in (torch.float32, torch.float64):
            return TORCH_IMPL.forward(x, negative_slope, inplace)
        packed = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        if negative_slope is None:
            # torch's own (vectorized) relu, then one packing pass over its output's bits.
            out = torch.relu_(x) if inplace else torch.relu(x)
            ints, magnitude = _MAGNITUDE[dtype]
            _pack_nonzero(_np(out.view(ints)), packed.numpy(), magnitude)
            return out, packed
        out = x if inplace else torch.empty_like(x)
        npdtype = np.float32 if dtype == torch.float32 else np.float64
        _leaky_fwd(_np(x), _np(out), packed.numpy(), npdtype(negative_slope))
        return out, packed

    @staticmethod
    def backward(grad: torch.Tensor, packed: torch.Tensor, negative_slope):
        dtype = grad.dtype
        if negative_slope is not None and dtype not in (torch.float32, torch.float64):
            return TORCH_IMPL.backward(grad, packed, negative_slope)
        gi = torch.empty_like(grad)
        if dtype in (torch.bfloat16, torch.float16):
            _relu_bwd(_np(grad.view(torch.int16)), packed.numpy(), _np(gi.view(torch.int16)), np.int16(0))
        elif negative_slope is None:
            _relu_bwd(_np(grad), packed.numpy(), _np(gi), _ZERO[dtype])
        else:
            npdtype = np.float32 if dtype == torch.float32 else np.float64
            _leaky_bwd(_np(grad), packed.numpy(), _np(gi), npdtype(negative_slope))
        return gi
