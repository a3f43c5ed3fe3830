"""``relu_mask`` in Triton: ReLU / LeakyReLU output and its packed 1-bit mask in one kernel; the gradient from
the mask in one kernel (the contract is in :mod:`slimgrad.kernels.relu_mask`).

Each forward program handles a block of elements (a multiple of 8): it writes the output (in place when asked:
the input is read before it is overwritten) and the block's mask bytes, bit ``i % 8`` of byte ``i // 8``, LSB
first, by summing the block's bits reshaped to (bytes, 8) against ``1 << j``. Backward reads one byte per 8
elements. Outputs and gradients are bitwise stock's on CUDA (checked on an H100): selects, and for leaky_relu
one fp32 product rounded once. ReLU follows CUDA's stock kernel, which maps -0.0 to +0.0 (the CPU kernel keeps
-0.0; the mask is the same either way).
"""

from __future__ import annotations

import torch
import triton.language as tl

from slimgrad.kernels.triton._jit import jit

__all__ = ["name", "backend", "forward", "backward"]

name = backend = "triton"
_BLOCK = 1024


@jit
def _forward_kernel(X, OUT, PACKED, numel, nbytes, slope, LEAKY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)  # compare in fp32 (exact), select the input's own bits (NaN payloads, -0.0 kept)
    if LEAKY:
        bit = xf > 0
        out = tl.where(bit, x, (xf * slope).to(x.dtype))
    else:
        # CUDA's stock relu: x <= 0 gives +0 (-0.0 too, unlike the CPU kernel, which passes -0.0), NaN passes.
        # Decided and selected on the integer bits alone. A float compare-and-select against zero is folded
        # into a max instruction on the GPU, which returns the hardware's canonical NaN (0x7FFFFFFF) where
        # stock keeps the input's NaN bits (seen on an H100, even with the select done on bitcast integers).
        # Kept: positive non-zero patterns (x > 0, +inf, positive NaNs) and negative NaNs.
        if X.dtype.element_ty.primitive_bitwidth == 32:
            xi = x.to(tl.int32, bitcast=True)
            nan_neg = (xi < 0) & ((xi & 0x7FFFFFFF) > 0x7F800000)
        elif X.dtype.element_ty == tl.bfloat16:
            xi = x.to(tl.int16, bitcast=True)
            nan_neg = (xi < 0) & ((xi & 0x7FFF) > 0x7F80)
        else:
            xi = x.to(tl.int16, bitcast=True)
            nan_neg = (xi < 0) & ((xi & 0x7FFF) > 0x7C00)
        bit = (xi > 0) | nan_neg  # out != 0: positives and NaN
        out = (xi & tl.where(bit, -1, 0).to(xi.dtype)).to(X.dtype.element_ty, bitcast=True)
    tl.store(OUT + offs, out, mask=mask)
    bits = (mask & bit).to(tl.int32)
    weights = (1 << tl.arange(0, 8)).to(tl.int32)
    byte = tl.sum(tl.reshape(bits, (BLOCK // 8, 8)) * weights[None, :], axis=1)
    boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(PACKED + boffs, byte.to(tl.uint8), mask=boffs < nbytes)


@jit
def _backward_kernel(G, PACKED, DX, numel, slope, LEAKY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0)
    byte = tl.load(PACKED + offs // 8, mask=mask, other=0).to(tl.int32)
    bit = ((byte >> (offs % 8).to(tl.int32)) & 1) != 0
    if LEAKY:
        dx = tl.where(bit, g, (g.to(tl.float32) * slope).to(g.dtype))
    else:
        dx = tl.where(bit, g, tl.zeros_like(g))
    tl.store(DX + offs, dx, mask=mask)


def _grid(numel: int):
    return (max(1, -(-numel // _BLOCK)),)


def forward(x: torch.Tensor, negative_slope, inplace: bool):
    numel = x.numel()
    nbytes = -(-numel // 8)
    out = x if inplace else torch.empty_like(x)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if numel:
        leaky = negative_slope is not None
        _forward_kernel[_grid(numel)](x, out, packed, numel, nbytes, float(negative_slope) if leaky else 0.0,
                                      LEAKY=leaky, BLOCK=_BLOCK)
    return out, packed


def backward(grad: torch.Tensor, packed: torch.Tensor, negative_slope):
    numel = grad.numel()
    dx = torch.empty_like(grad)
    if numel:
        leaky = negative_slope is not None
        _backward_kernel[_grid(numel)](grad, packed, dx, numel, float(negative_slope) if leaky else 0.0,
                                       LEAKY=leaky, BLOCK=_BLOCK)
    return dx
