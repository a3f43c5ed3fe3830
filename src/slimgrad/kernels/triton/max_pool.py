"""Max pooling (1-d and 2-d) in Triton for the ``max_pool_positions`` family (contract in
:mod:`slimgrad.kernels.max_pool`): one pass writes the output and each window's winner position.

Why: the torch reference runs stock's forward, then derives positions from its int64 indices with about ten
elementwise ops (and rebuilds the indices in backward); on a GPU each op is a launch, and the host-side cost
of those launches, not the bytes, dominated a ResNet step (H100 profile). Here forward is one launch and
backward one launch. Geometry (stride, padding, dilation, kernel) is compile-time, so divisions by it are
strength-reduced, and index arithmetic is int32 unless a tensor is too large for it.

Forward: one lane per output element; the window is scanned in row-major order with stock's rule
(``value > max or isnan(value)``; the first in-bounds element starts the scan), so output values and
winners are stock's bit for bit. Positions count over the full window, padding included.

Backward mirrors stock's CUDA kernel (``max_pool_backward_nchw``): one lane per *input* element gathers,
over the outputs whose windows can contain it (in row-major order), the gradients whose winner it is,
summing in fp32 (fp64 for double) and rounding once. That is bitwise stock's CUDA gradient; stock's CPU
kernel adds in the dtype in output order, which for bf16/fp16 with overlapping windows can differ by an ulp
(the tests compare with the CPU torch path within that).

3-d pooling uses the torch reference.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from slimgrad.kernels.max_pool import output_size as _out_size
from slimgrad.kernels.triton._jit import jit

__all__ = ["backend", "forward", "backward"]

backend = "triton"
_BLOCK = 256


def _as_2d(kernel, stride, padding, dilation):
    if len(kernel) == 1:
        return (1,) + tuple(kernel), (1,) + tuple(stride), (0,) + tuple(padding), (1,) + tuple(dilation)
    return tuple(kernel), tuple(stride), tuple(padding), tuple(dilation)


@jit
def _forward_kernel(X, OUT, POS, total, H, W, OH, OW, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                    PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    F64: tl.constexpr, I64: tl.constexpr, BLOCK: tl.constexpr):
    if I64:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    ow = offs % OW
    oh = (offs // OW) % OH
    plane = offs // (OW * OH)
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    base = plane * H * W
    best = tl.full([BLOCK], float("-inf"), tl.float64 if F64 else tl.float32)
    pos = tl.zeros([BLOCK], tl.int32)
    found = tl.zeros([BLOCK], tl.int1)
    for kh in tl.static_range(KH):
        ih = h0 + kh * DH
        for kw in tl.static_range(KW):
            iw = w0 + kw * DW
            inside = live & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(X + base + ih * W + iw, mask=inside, other=float("-inf")).to(best.dtype)
            # Stock: start with the first in-bounds element, then take v > max or NaN.
            take = inside & ((v > best) | (v != v) | (found == 0))
            best = tl.where(take, v, best)
            pos = tl.where(take, kh * KW + kw, pos)
            found = found | inside
    tl.store(OUT + offs, best.to(OUT.dtype.element_ty), mask=live)
    tl.store(POS + offs, pos.to(POS.dtype.element_ty), mask=live)


@jit
def _backward_kernel(G, POS, DX, total, H, W, OH, OW, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                     PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                     NPH: tl.constexpr, NPW: tl.constexpr, F64: tl.constexpr, I64: tl.constexpr,
                     BLOCK: tl.constexpr):
    if I64:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    iw = offs % W
    ih = (offs // W) % H
    plane = offs // (W * H)
    # Stock's candidate output range for an input row/column.
    ext_h = (KH - 1) * DH + 1
    ext_w = (KW - 1) * DW + 1
    ph_start = tl.where(ih + PH < ext_h, 0, (ih + PH - ext_h) // SH + 1)
    pw_start = tl.where(iw + PW < ext_w, 0, (iw + PW - ext_w) // SW + 1)
    ph_end = tl.minimum((ih + PH) // SH + 1, OH)
    pw_end = tl.minimum((iw + PW) // SW + 1, OW)
    acc = tl.zeros([BLOCK], tl.float64 if F64 else tl.float32)
    gbase = plane * OH * OW
    for i in tl.static_range(NPH):
        ph = ph_start + i
        dh = ih + PH - ph * SH  # offset of ih inside window row ph
        ok_h = live & (ph < ph_end) & (dh >= 0) & (dh % DH == 0) & (dh // DH < KH)
        kh = dh // DH
        for j in tl.static_range(NPW):
            pw = pw_start + j
            dw = iw + PW - pw * SW
            ok = ok_h & (pw < pw_end) & (dw >= 0) & (dw % DW == 0) & (dw // DW < KW)
            o = gbase + ph * OW + pw
            p = tl.load(POS + o, mask=ok, other=0).to(tl.int32)
            hit = ok & (p == kh * KW + dw // DW)
            g = tl.load(G + o, mask=hit, other=0.0).to(acc.dtype)
            acc = tl.where(hit, acc + g, acc)
    tl.store(DX + offs, acc.to(DX.dtype.element_ty), mask=live)


def _reference():
    from slimgrad.kernels.max_pool import TORCH_IMPL

    return TORCH_IMPL


def forward(x, kernel, stride, padding, dilation, ceil_mode):
    if len(kernel) == 3:
        return _reference().forward(x, kernel, stride, padding, dilation, ceil_mode)
    from slimgrad.kernels.max_pool import position_dtype

    nd = len(kernel)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _as_2d(kernel, stride, padding, dilation)
    h = x.shape[-2] if nd == 2 else 1
    w = x.shape[-1]
    oh = _out_size(h, kh, sh, ph, dh, ceil_mode) if nd == 2 else 1
    ow = _out_size(w, kw, sw, pw, dw, ceil_mode)
    lead = tuple(x.shape[:-nd])
    out_shape = lead + ((oh, ow) if nd == 2 else (ow,))
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    pos = torch.empty(out_shape, dtype=position_dtype(math.prod(kernel)), device=x.device)
    total = out.numel()
    if total:
        grid = (triton_cdiv(total, _BLOCK),)
        _forward_kernel[grid](x, out, pos, total, h, w, oh, ow, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw,
                              KH=kh, KW=kw, F64=x.dtype == torch.float64, I64=_needs_int64(x.numel()),
                              BLOCK=_BLOCK)
    return out, pos


def backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode):
    if len(kernel) == 3:
        return _reference().backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode)
    nd = len(kernel)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _as_2d(kernel, stride, padding, dilation)
    h = x_shape[-2] if nd == 2 else 1
    w = x_shape[-1]
    oh = grad_out.shape[-2] if nd == 2 else 1
    ow = grad_out.shape[-1]
    dx = torch.empty(tuple(x_shape), dtype=grad_out.dtype, device=grad_out.device)
    total = dx.numel()
    if total:
        # At most ceil(extent / stride) windows along a dimension contain a given input element.
        nph = -(-((kh - 1) * dh + 1) // sh)
        npw = -(-((kw - 1) * dw + 1) // sw)
        grid = (triton_cdiv(total, _BLOCK),)
        _backward_kernel[grid](grad_out, positions, dx, total, h, w, oh, ow, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh,
                               DW=dw, KH=kh, KW=kw, NPH=nph, NPW=npw, F64=grad_out.dtype == torch.float64,
                               I64=_needs_int64(total), BLOCK=_BLOCK)
    return dx


def _needs_int64(numel: int) -> bool:
    """int64 index arithmetic only where int32 could overflow: 64-bit division and modulo are emulated on the
    GPU and made the first version's backward ~9x slower than stock's (H100 profile of a ResNet step)."""
    return numel + _BLOCK >= 2**31


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
