"""numba kernels of the ``relu_mask`` family (contract: :mod:`slimgrad.kernels.relu_mask`).

One pass forward (read x; write the output and the packed mask), one pass backward (read the gradient
and the mask; write the input gradient): less memory traffic than stock's relu + threshold_backward,
which reads the whole float output again.

* float32/float64: relu and leaky_relu, compared and multiplied in the dtype as stock's CPU kernels do
  (``x * slope`` with the slope rounded to the dtype first).
* bfloat16/float16: relu only, on the 16-bit patterns (``x < 0`` is "sign set, magnitude in (0, inf]",
  and the gradient is copied or zeroed, never computed), so bitwise by construction. leaky_relu's
  product needs a rounding numba cannot express in those dtypes: the torch reference runs there.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from slimgrad.kernels.relu_mask import TORCH_IMPL

from ._numba import jit, prange, report_first_compile

__all__ = ["NumbaReluMask"]

_INT16_INF = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_ZERO = {torch.float32: np.float32(0), torch.float64: np.float64(0)}


# Branch-free bodies (selects, fixed 8-element inner loops) so LLVM if-converts and vectorizes them: a
# data-dependent branch per element costs a misprediction on random signs (measured 6x slower).


@jit
def _relu_fwd_f(x, out, packed, zero):
    n = x.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        if base + 8 <= n:
            for j in range(8):
                v = x[base + j]
                o = zero if v < 0 else v
                out[base + j] = o
                byte |= (o != 0) << j
        else:
            for j in range(n - base):
                v = x[base + j]
                o = zero if v < 0 else v
                out[base + j] = o
                byte |= (o != 0) << j
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
def _relu_fwd_i16(x, out, packed, inf, zero):
    # x, out: int16 views of bf16/fp16. x < 0 <=> sign set and 0 < magnitude <= inf (NaN excluded).
    n = x.size
    for b in prange(packed.size):
        base = b * 8
        byte = 0
        m = min(8, n - base)
        for j in range(m):
            v = x[base + j]
            mag = v & 0x7FFF
            neg = (v < 0) & (mag != 0) & (mag <= inf)
            out[base + j] = zero if neg else v
            byte |= ((~neg) & (mag != 0)) << j
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


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().reshape(-1)  # numpy's reshape of a contiguous array: cheaper than torch's


class NumbaReluMask:
    name = "numba"

    def __init__(self):
        started = time.perf_counter()
        x = torch.tensor([-1.0, 0.0, 2.0])
        self.backward(x, self.forward(x, None, False)[1], None)  # compile (or load) the fp32 relu pair
        report_first_compile(started, "relu_mask")

    @staticmethod
    def forward(x: torch.Tensor, negative_slope, inplace: bool):
        dtype = x.dtype
        if negative_slope is not None and dtype not in (torch.float32, torch.float64):
            return TORCH_IMPL.forward(x, negative_slope, inplace)
        out = x if inplace else torch.empty_like(x)
        packed = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        if dtype in _INT16_INF:
            inf = np.int16(_INT16_INF[dtype])
            _relu_fwd_i16(_np(x.view(torch.int16)), _np(out.view(torch.int16)), packed.numpy(), inf, np.int16(0))
        elif negative_slope is None:
            _relu_fwd_f(_np(x), _np(out), packed.numpy(), _ZERO[dtype])
        else:
            npdtype = np.float32 if dtype == torch.float32 else np.float64
            _leaky_fwd(_np(x), _np(out), packed.numpy(), npdtype(negative_slope))
        return out, packed

    @staticmethod
    def backward(grad: torch.Tensor, packed: torch.Tensor, negative_slope):
        dtype = grad.dtype
        if negative_slope is not None and dtype not in (torch.float32, torch.float64):
            return TORCH_IMPL.backward(grad, packed, negative_slope)
        gi = torch.empty_like(grad)
        if dtype in _INT16_INF:
            _relu_bwd(_np(grad.view(torch.int16)), packed.numpy(), _np(gi.view(torch.int16)), np.int16(0))
        elif negative_slope is None:
            _relu_bwd(_np(grad), packed.numpy(), _np(gi), _ZERO[dtype])
        else:
            npdtype = np.float32 if dtype == torch.float32 else np.float64
            _leaky_bwd(_np(grad), packed.numpy(), _np(gi), npdtype(negative_slope))
        return gi
