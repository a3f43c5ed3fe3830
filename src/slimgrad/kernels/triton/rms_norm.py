"""RMSNorm and FusedAddRMSNorm in Triton, in every casting style of :data:`slimgrad.functional.norms.RMS_STYLES`.

Forward: one program per row; reads x (and, fused, the residual r, writing ``s = x + r``), writes y and
one fp32 rstd per row. That rstd and x in its own dtype are all backward reads.

Backward: one program per SM loops over its rows. dX and dW are compiled in or out by ``tl.constexpr``
flags taken from ``ctx.needs_input_grad``: with a frozen weight no dW work is done and no fp32 partial
buffer is allocated (Liger-Kernel 0.8.5 does the same for RMSNorm, LayerNorm and FusedAddRMSNorm, not yet for
GroupNorm and PolyNorm). ``HAS_DS`` adds the gradient reaching FusedAddRMSNorm's second output ``s`` only when
there is one: the Function does not materialise unused outputs' gradients, so an unused ``s`` costs no read
and an unused ``y`` runs no kernel (Liger materialises them as zeros and runs the whole backward).

Casting follows each reference: the statistics in fp32; Llama rounds ``x·rstd`` to x's dtype before the
weight multiplies it, T5 rounds it to a half-precision weight's dtype, Olmo2 multiplies in fp32, Gemma
scales by ``1 + w`` in fp32, torch style multiplies in fp32. Products that the reference rounds to a half
dtype are rounded the same way here (a half-by-half product is an fp32 product rounded once), so only the
reduction order differs from the reference: results agree within the dtype's rounding.

Only the weight trainable: stock keeps one tensor there, the normalised input as the weight multiplies it (x's
dtype for Llama, fp32 for the torch style's CPU composite, Olmo2 and Gemma, ...), while x plus one fp32 rstd per
row is more at small hidden sizes. The Function then asks ``forward`` to write that normalised input in the same
pass (where it is no bigger than x plus rstd) and keeps only it; dW is ``weight_grad_from_normed``.

Interface (family ``rms_norm`` / ``rms_norm_hf``, used by :class:`slimgrad.functional.norms.RMSNormFunction`):
``supports(x, weight, n)``, ``forward(x, weight, eps, style, n, residual=None, normed=None) -> (y, rstd[, s | h])``,
``backward(dy, x, rstd, weight, style, n, need_x, need_w, ds=None) -> (dx, dw)``, ``normed_dtype(x_dtype, weight,
style)`` and ``weight_grad_from_normed(dy, h, n, weight_shape, weight_dtype) -> dw``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from slimgrad.kernels.triton._jit import jit, num_programs, num_warps, row_block

__all__ = ["backend", "supports", "forward", "backward", "normed_dtype", "weight_grad_from_normed", "STYLES", "MAX_N"]

backend = "triton"
#: Style codes passed to the kernels (constexpr).
STYLES = {"torch": 0, "llama": 1, "olmo2": 2, "gemma": 3, "t5": 4}
#: Widest row one program holds in registers; wider rows use the torch path.
MAX_N = 65536
_HALF = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _forward_kernel(X, R, S, W, Y, RSTD, H, stride_x, stride_r, stride_s, stride_y, stride_h, N, eps,
                    BLOCK: tl.constexpr, STYLE: tl.constexpr, HAS_W: tl.constexpr, T5_CAST: tl.constexpr,
                    HAS_R: tl.constexpr, HAS_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        # s = x + r in s's dtype (an fp32 sum rounded once, as torch's add), then normalised.
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    h = x * rstd
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if STYLE == 1:  # llama: w * (x·rstd).to(x.dtype)
            h = h.to(X.dtype.element_ty).to(tl.float32)
            y = w * h
        elif STYLE == 3:  # gemma: x̂ · (1 + w) in fp32
            y = h * (1.0 + w)
        elif STYLE == 4:  # t5: x̂ cast to a half weight's dtype first
            if T5_CAST:
                h = h.to(W.dtype.element_ty).to(tl.float32)
            y = w * h
        else:  # torch, olmo2: product in fp32
            y = h * w
        if HAS_H:  # the normalised input as the weight multiplies it (only dW requested: kept instead of x)
            tl.store(H + row * stride_h + cols, h.to(H.dtype.element_ty), mask=mask)
    else:
        y = h
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@jit
def _backward_kernel(DY, X, W, RSTD, DX, DS, DWP, stride_dy, stride_x, stride_dx, stride_ds, M, N, rows_per_program,
                     BLOCK: tl.constexpr, STYLE: tl.constexpr, HAS_W: tl.constexpr, T5_CAST: tl.constexpr,
                     COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_DS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    # Row pointers advance by their strides (64-bit pointer arithmetic: no int32 overflow on large tensors).
    start64 = start.to(tl.int64)
    dy_row = DY + start64 * stride_dy
    x_row = X + start64 * stride_x
    dx_row = DX + start64 * stride_dx
    ds_row = DS + start64 * stride_ds
    for row in range(start, end):
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if COMPUTE_DW:
            h = x * rstd
            if STYLE == 1:  # the weight multiplied x̂ rounded to x's dtype
                h = h.to(X.dtype.element_ty).to(tl.float32)
            if STYLE == 4:
                if T5_CAST:
                    h = h.to(W.dtype.element_ty).to(tl.float32)
            dw += dy * h
        if COMPUTE_DX:
            # m: the gradient reaching x̂, rounded where the reference rounds it.
            if HAS_W:
                if STYLE == 1:
                    m = (dy * w).to(X.dtype.element_ty).to(tl.float32)
                elif STYLE == 3:
                    m = dy * (1.0 + w)
                elif STYLE == 4:
                    m = dy * w
                    if T5_CAST:
                        m = m.to(W.dtype.element_ty).to(tl.float32)
                else:
                    m = dy * w
            else:
                m = dy
            dot = tl.sum(m * x, axis=0)
            dx = rstd * m - (rstd * rstd * rstd) * (dot / N) * x
            if HAS_DS:
                dx += tl.load(ds_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dy_row += stride_dy
        x_row += stride_x
        dx_row += stride_dx
        ds_row += stride_ds
    if COMPUTE_DW:
        tl.store(DWP + pid * N + cols, dw, mask=mask)


@jit
def _dw_kernel(DY, X, W, RSTD, DWP, stride_dy, stride_x, M, N, rows_per_program,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STYLE: tl.constexpr, T5_CAST: tl.constexpr):
    """dW partials over a (rows, column block) tile: program (n, m) sums ``dy·x̂`` over rows
    [m·rows_per_program, ...) for its columns (the split variant, see :data:`SPLIT_DW`)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    start = pid_m * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        h = x * rstd[:, None]
        if STYLE == 1:
            h = h.to(X.dtype.element_ty).to(tl.float32)
        if STYLE == 4:
            if T5_CAST:
                h = h.to(W.dtype.element_ty).to(tl.float32)
        acc += tl.sum(dy * h, axis=0)
    tl.store(DWP + pid_m * N + cols, acc, mask=cmask)


#: Experimental, off by default (None): rows at least this wide run backward as two kernels, dX with one
#: program per row and no dW accumulator, dW as a tiled column reduction that reads dY and x again. The
#: one-kernel backward keeps a row-wide fp32 dW accumulator per program in registers, which measured slow for
#: trainable weights at H = 32768 (docs/gpu.md); whether the split is faster is for
#: ``benchmarks/gpu_norms.py`` to show ("slimgrad split" rows) before it becomes a default.
SPLIT_DW: int | None = None
_DW_BLOCK_M, _DW_BLOCK_N = 16, 256


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as (rows, n) with unit stride along the row (a copy only when t's layout needs one)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or n == 1 else t2.contiguous()


def _stride0(t2: torch.Tensor) -> int:
    return t2.stride(0) if t2.shape[0] > 1 else t2.shape[1]


def supports(x: torch.Tensor, weight: torch.Tensor | None, n: int) -> bool:
    """Whether these kernels handle this call (else the caller runs its torch code)."""
    return (x.dtype in _DTYPES and 0 < n <= MAX_N and x.numel() > 0
            and (weight is None or weight.dtype in _DTYPES))


def output_dtype(x_dtype: torch.dtype, weight: torch.Tensor | None, style: str) -> torch.dtype:
    """The reference's output dtype: Llama's ``w * x̂`` promotes, T5's follows a half weight or promotes to
    fp32, the other styles return x's dtype."""
    if weight is None or style in ("torch", "olmo2", "gemma"):
        return x_dtype
    if style == "llama":
        return torch.promote_types(weight.dtype, x_dtype)
    if weight.dtype in _HALF:
        return weight.dtype
    return torch.promote_types(weight.dtype, torch.promote_types(x_dtype, torch.float32))


def normed_dtype(x_dtype: torch.dtype, weight: torch.Tensor, style: str) -> torch.dtype:
    """The dtype of the normalised input as the reference multiplies the weight by it (what stock keeps when only
    the weight trains): x's dtype for Llama, a half weight's dtype for T5, else fp32."""
    if style == "llama":
        return x_dtype
    if style == "t5" and weight.dtype in _HALF:
        return weight.dtype
    return torch.float32


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str, n: int,
            residual: torch.Tensor | None = None, normed: torch.dtype | None = None):
    """(y, rstd) — or (y, rstd, s) with ``residual`` — for rows of the last ``n`` elements; rstd is fp32,
    one per row. With ``normed`` (a dtype, see :func:`normed_dtype`; needs a weight), (y, rstd, h): the normalised
    input, written in the same pass, which is all :func:`weight_grad_from_normed` reads."""
    x2 = _rows(x, n)
    rows = x2.shape[0]
    block = row_block(n)
    w = weight.contiguous() if weight is not None else None
    y2 = torch.empty((rows, n), dtype=output_dtype(x.dtype, weight, style), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = _rows(residual, n)
        s2 = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    else:
        r2 = s2 = x2
    h2 = torch.empty((rows, n), dtype=normed, device=x.device) if normed is not None else None
    _forward_kernel[(rows,)](
        x2, r2, s2, w if w is not None else x2, y2, rstd, h2 if h2 is not None else y2, _stride0(x2), _stride0(r2),
        _stride0(s2), _stride0(y2), _stride0(h2) if h2 is not None else n, n, eps, BLOCK=block, STYLE=STYLES[style],
        HAS_W=w is not None, T5_CAST=w is not None and w.dtype in _HALF, HAS_R=residual is not None,
        HAS_H=h2 is not None, num_warps=num_warps(block))
    y = y2.view(x.shape)
    if residual is not None:
        return y, rstd, s2.view(x.shape)
    if h2 is not None:
        return y, rstd, h2
    return y, rstd


def weight_grad_from_normed(dy: torch.Tensor, h: torch.Tensor, n: int, weight_shape, weight_dtype: torch.dtype):
    """dW = Σ_rows dy·h from the normalised input ``h`` (rows, n) that :func:`forward` wrote: the backward kernel
    with h in x's place, a unit rstd and no rounding (h is already rounded as the weight saw it), dW only."""
    dy2 = _rows(dy, n)
    rows = h.shape[0]
    block = row_block(n)
    programs = num_programs(h.device, rows)
    per_program = -(-rows // programs)
    programs = -(-rows // per_program)
    ones = torch.ones(rows, dtype=torch.float32, device=h.device)
    dwp = torch.empty((programs, n), dtype=torch.float32, device=h.device)
    _backward_kernel[(programs,)](
        dy2, h, h, ones, h, h, dwp, _stride0(dy2), _stride0(h), n, n, rows, n, per_program, BLOCK=block,
        STYLE=STYLES["torch"], HAS_W=False, T5_CAST=False, COMPUTE_DX=False, COMPUTE_DW=True, HAS_DS=False,
        num_warps=num_warps(block))
    return dwp.sum(0).to(weight_dtype).view(weight_shape)


def backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, style: str, n: int,
             need_x: bool, need_w: bool, ds: torch.Tensor | None = None):
    """(dx, dw): each None unless requested. ``ds`` (same shape as x) is added to dx (FusedAddRMSNorm's
    second output). No dW partial buffer exists unless ``need_w``; dx is allocated only when ``need_x``."""
    need_w = need_w and weight is not None
    if not (need_x or need_w):
        return None, None
    x2 = _rows(x, n)
    dy2 = _rows(dy, n)
    rows = x2.shape[0]
    block = row_block(n)
    split = SPLIT_DW is not None and n >= SPLIT_DW
    w = weight.contiguous() if weight is not None else None
    t5_cast = w is not None and w.dtype in _HALF
    if split:
        programs, per_program = rows, 1  # dX: one program per row, no dW accumulator
    else:
        programs = num_programs(x.device, rows)
        per_program = -(-rows // programs)
        programs = -(-rows // per_program)
    dx2 = torch.empty((rows, n), dtype=x.dtype, device=x.device) if need_x else None
    dwp = None
    ds2 = _rows(ds, n) if (need_x and ds is not None) else None
    if need_w and split:
        col_blocks = -(-n // _DW_BLOCK_N)
        row_chunks = max(1, min(-(-rows // _DW_BLOCK_M), 4 * num_programs(x.device, 1 << 30) // col_blocks))
        dw_rows = -(-rows // row_chunks)
        row_chunks = -(-rows // dw_rows)
        dwp = torch.empty((row_chunks, n), dtype=torch.float32, device=x.device)
        _dw_kernel[(col_blocks, row_chunks)](dy2, x2, w, rstd, dwp, _stride0(dy2), _stride0(x2), rows, n, dw_rows,
                                             BLOCK_M=_DW_BLOCK_M, BLOCK_N=_DW_BLOCK_N, STYLE=STYLES[style],
                                             T5_CAST=t5_cast)
    elif need_w:
        dwp = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    if need_x or not split:
        _backward_kernel[(programs,)](
            dy2, x2, w if w is not None else x2, rstd, dx2 if dx2 is not None else x2,
            ds2 if ds2 is not None else x2, dwp if (dwp is not None and not split) else rstd, _stride0(dy2),
            _stride0(x2), _stride0(dx2) if dx2 is not None else n, _stride0(ds2) if ds2 is not None else n, rows,
            n, per_program, BLOCK=block, STYLE=STYLES[style], HAS_W=w is not None, T5_CAST=t5_cast,
            COMPUTE_DX=need_x, COMPUTE_DW=need_w and not split, HAS_DS=ds2 is not None,
            num_warps=num_warps(block))
    dx = dx2.view(x.shape) if need_x else None
    dw = dwp.sum(0).to(weight.dtype).view(weight.shape) if need_w else None
    return dx, dw
