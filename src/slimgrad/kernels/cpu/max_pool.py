"""numba kernels of the ``max_pool_positions`` family (contract: :mod:`slimgrad.kernels.max_pool`).

2-d pooling of float32/float64 inputs (1-d, 3-d and reduced precision run the torch reference):

* forward: per output, stock's window scan (row-major over the in-bounds positions, ``v > max or
  isnan(v)``, starting from ``-inf`` with the first in-bounds position), writing the output and the
  window position in one pass, instead of stock's kernel, an int64 index tensor and its conversion;
* backward: zero the input gradient, then per channel plane add each output's gradient at its winner in
  row-major output order, the order stock's backward kernel adds them, so overlapping windows give
  bitwise stock's sums.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from slimgrad.kernels.max_pool import TORCH_IMPL
from slimgrad.kernels.max_pool import output_size as _out_size

from ._numba import jit, prange, report_first_compile

__all__ = ["NumbaMaxPoolPositions"]


@jit
def _fwd2d(x, out, pos, kh, kw, sh, sw, ph, pw, dh, dw, ninf):
    planes, H, W = x.shape
    _, OH, OW = out.shape
    for c in prange(planes):
        for oh in range(OH):
            h0 = oh * sh - ph
            h1 = min(h0 + (kh - 1) * dh + 1, H)
            hs = h0
            while hs < 0:
                hs += dh
            for ow in range(OW):
                w0 = ow * sw - pw
                w1 = min(w0 + (kw - 1) * dw + 1, W)
                ws = w0
                while ws < 0:
                    ws += dw
                best = ninf
                bh = hs
                bw = ws
                for ih in range(hs, h1, dh):
                    for iw in range(ws, w1, dw):
                        v = x[c, ih, iw]
                        if v > best or v != v:
                            best = v
                            bh = ih
                            bw = iw
                out[c, oh, ow] = best
                pos[c, oh, ow] = ((bh - h0) // dh) * kw + (bw - w0) // dw


@jit
def _bwd2d(g, pos, gi, kw, sh, sw, ph, pw, dh, dw):
    planes, OH, OW = g.shape
    for c in prange(planes):
        gi[c, :, :] = 0
        for oh in range(OH):
            h0 = oh * sh - ph
            for ow in range(OW):
                w0 = ow * sw - pw
                p = pos[c, oh, ow]
                gi[c, h0 + (p // kw) * dh, w0 + (p % kw) * dw] += g[c, oh, ow]



class NumbaMaxPoolPositions:
    name = "numba"

    def __init__(self):
        started = time.perf_counter()
        x = torch.linspace(-1.0, 1.0, 16).reshape(1, 1, 4, 4)  # never the default generator
        out, pos = self.forward(x, (2, 2), (2, 2), (0, 0), (1, 1), False)
        self.backward(out, pos, x.shape, (2, 2), (2, 2), (0, 0), (1, 1), False)
        report_first_compile(started, "max_pool_positions")

    @staticmethod
    def _fits(x, kernel):
        return len(kernel) == 2 and x.dtype in (torch.float32, torch.float64) and math.prod(kernel) <= 256

    def forward(self, x, kernel, stride, padding, dilation, ceil_mode):
        if not self._fits(x, kernel):
            return TORCH_IMPL.forward(x, kernel, stride, padding, dilation, ceil_mode)
        H, W = x.shape[-2:]
        # Stock's own checks and messages (pad at most half the kernel, a non-empty output).
        if (any(p > k // 2 or p < 0 for p, k in zip(padding, kernel))
                or min(kernel + stride + dilation) <= 0 or x.dim() not in (3, 4)):
            return TORCH_IMPL.forward(x, kernel, stride, padding, dilation, ceil_mode)
        OH = _out_size(H, kernel[0], stride[0], padding[0], dilation[0], ceil_mode)
        OW = _out_size(W, kernel[1], stride[1], padding[1], dilation[1], ceil_mode)
        if OH <= 0 or OW <= 0:
            return TORCH_IMPL.forward(x, kernel, stride, padding, dilation, ceil_mode)
        lead = x.shape[:-2]
        planes = math.prod(lead)
        out = torch.empty(lead + (OH, OW), dtype=x.dtype)
        pos = torch.empty(lead + (OH, OW), dtype=torch.uint8)
        ninf = np.float32(-np.inf) if x.dtype == torch.float32 else np.float64(-np.inf)
        _fwd2d(x.detach().reshape(planes, H, W).numpy(), out.view(planes, OH, OW).numpy(),
               pos.view(planes, OH, OW).numpy(), kernel[0], kernel[1], stride[0], stride[1], padding[0], padding[1],
               dilation[0], dilation[1], ninf)
        return out, pos

    def backward(self, grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode):
        if not (len(kernel) == 2 and grad_out.dtype in (torch.float32, torch.float64)
                and positions.dtype == torch.uint8):
            return TORCH_IMPL.backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode)
        H, W = x_shape[-2:]
        OH, OW = grad_out.shape[-2:]
        planes = math.prod(x_shape[:-2])
        gi = torch.empty(tuple(x_shape), dtype=grad_out.dtype)
        _bwd2d(grad_out.reshape(planes, OH, OW).numpy(), positions.reshape(planes, OH, OW).numpy(),
               gi.view(planes, H, W).numpy(), kernel[1], stride[0], stride[1], padding[0], padding[1],
               dilation[0], dilation[1])
        return gi
