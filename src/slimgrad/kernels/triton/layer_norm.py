"""LayerNorm in Triton: forward keeps x (own dtype) plus fp32 mean and rstd per row; backward compiles dX,
dW and dB in or out with ``tl.constexpr`` flags from ``ctx.needs_input_grad``.

With only dB requested the kernel reads dY alone (``dB = Σ dy``): x, mean and rstd need not be kept at all.
No fp32 partial buffer exists for a gradient that is not requested. Statistics in fp32, output and dX
rounded once to x's dtype (as aten's CUDA kernel); agreement with stock is within the dtype's rounding
(reduction order differs).

Interface (family ``layer_norm``, used by :class:`slimgrad.functional.norms.LayerNormFunction`):
``supports(x, weight, bias, n)``, ``forward(x, weight, bias, eps, n) -> (y, mean, rstd)``,
``backward(dy, x, mean, rstd, weight, n, need_x, need_w, need_b) -> (dx, dw, db)``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from slimgrad.kernels.triton._jit import jit, num_programs, num_warps, row_block
from slimgrad.kernels.triton.rms_norm import _rows, _stride0

__all__ = ["backend", "supports", "forward", "backward", "MAX_N"]

backend = "triton"
MAX_N = 65536
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _forward_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
                    BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@jit
def _backward_kernel(DY, X, W, MEAN, RSTD, DX, DWP, DBP, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
                     BLOCK: tl.constexpr, HAS_W: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
                     COMPUTE_DB: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    start64 = start.to(tl.int64)
    dy_row = DY + start64 * stride_dy
    x_row = X + start64 * stride_x
    dx_row = DX + start64 * stride_dx
    for row in range(start, end):
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        if COMPUTE_DB:
            db += dy
        if COMPUTE_DX or COMPUTE_DW:
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            if COMPUTE_DW:
                dw += dy * xhat
            if COMPUTE_DX:
                if HAS_W:
                    wdy = w * dy
                else:
                    wdy = dy
                c1 = tl.sum(xhat * wdy, axis=0) / N
                c2 = tl.sum(wdy, axis=0) / N
                dx = (wdy - (xhat * c1 + c2)) * rstd
                tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dy_row += stride_dy
        x_row += stride_x
        dx_row += stride_dx
    if COMPUTE_DW:
        tl.store(DWP + pid * N + cols, dw, mask=mask)
    if COMPUTE_DB:
        tl.store(DBP + pid * N + cols, db, mask=mask)


def supports(x: torch.Tensor, weight, bias, n: int) -> bool:
    return (x.dtype in _DTYPES and 0 < n <= MAX_N and x.numel() > 0
            and all(p is None or p.dtype in _DTYPES for p in (weight, bias)))


def forward(x: torch.Tensor, weight, bias, eps: float, n: int):
    """(y in x's dtype, mean, rstd): the statistics fp32, one per row of the last ``n`` elements."""
    x2 = _rows(x, n)
    rows = x2.shape[0]
    block = row_block(n)
    y2 = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    _forward_kernel[(rows,)](x2, w if w is not None else x2, b if b is not None else x2, y2, mean, rstd,
                             _stride0(x2), _stride0(y2), n, eps, BLOCK=block, HAS_W=w is not None,
                             HAS_B=b is not None, num_warps=num_warps(block))
    return y2.view(x.shape), mean, rstd


def backward(dy: torch.Tensor, x, mean, rstd, weight, n: int, need_x: bool, need_w: bool, need_b: bool,
             bias_dtype: torch.dtype | None = None):
    """(dx, dw, db), each None unless requested. ``x``, ``mean``, ``rstd`` may be None when only dB is;
    db comes in ``bias_dtype``."""
    if not (need_x or need_w or need_b):
        return None, None, None
    dy2 = _rows(dy, n)
    rows = dy2.shape[0]
    x2 = _rows(x, n) if x is not None else dy2
    block = row_block(n)
    programs = num_programs(dy.device, rows)
    per_program = -(-rows // programs)
    programs = -(-rows // per_program)
    w = weight.contiguous() if weight is not None else None
    dx2 = torch.empty((rows, n), dtype=x.dtype, device=dy.device) if need_x else None
    dwp = torch.empty((programs, n), dtype=torch.float32, device=dy.device) if need_w else None
    dbp = torch.empty((programs, n), dtype=torch.float32, device=dy.device) if need_b else None
    stat = rstd if rstd is not None else dy2
    _backward_kernel[(programs,)](
        dy2, x2, w if w is not None else dy2, mean if mean is not None else stat, stat,
        dx2 if dx2 is not None else dy2, dwp if dwp is not None else dy2, dbp if dbp is not None else dy2,
        _stride0(dy2), _stride0(x2), _stride0(dx2) if dx2 is not None else n, rows, n, per_program,
        BLOCK=block, HAS_W=w is not None, COMPUTE_DX=need_x, COMPUTE_DW=need_w, COMPUTE_DB=need_b,
        num_warps=num_warps(block))
    dx = dx2.view(dy.shape) if need_x else None
    dw = dwp.sum(0).to(weight.dtype).view(weight.shape) if need_w else None
    db = dbp.sum(0).to(bias_dtype or dy.dtype) if need_b else None  # flat (n,): the caller views it
    return dx, dw, db
