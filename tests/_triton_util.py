"""Shared by the Triton kernel tests: run them with ``SLIMGRAD_KERNELS=triton`` on CPU tensors under the
Triton interpreter, or compiled on CUDA, and compare with the torch path within the dtype's rounding.

Why CPU cases need ``TRITON_INTERPRET=1`` from the start of the process: triton decorates its own library
functions (``tl.sum``, ``tl.sigmoid``, ...) when it is imported, compiled or interpreted as the variable says
then, and an interpreted kernel cannot call compiled library functions. So the CPU cases run only in a process
started with the variable set; ``tests/test_triton_interpreter.py`` starts one (a pytest subprocess over these
files) from the ordinary suite, and a CUDA machine runs them compiled in-process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from slimgrad import kernels
from slimgrad.kernels.registry import triton_interpreting

#: Tolerance per dtype, in units K of the dtype's epsilon: rtol = K·eps, atol = K·eps·max|exact|/4 (on top of
#: the torch path's own error, see assert_no_worse).
#: The kernels reduce in fp32 in another order than the torch path (per-row sums, the weight gradient's
#: per-program partial sums), which moves a result by an ulp or so before it is rounded to the output dtype;
#: relative to the tensor's scale, cancellation in dX (``rstd·m − rstd³/N·Σ(m·x)·x``) stays within that.
#: Under the interpreter (triton 3.9) an fp32 -> bf16 cast truncates instead of rounding to nearest even: one
#: more bf16 ulp, biased towards zero (so bf16's K is 3 there, 2 on CUDA). Where a bf16 rounding happens inside
#: an fp32 result (Llama's ``w_fp32 · x̂.to(bf16)``) the tolerance is the narrower dtype's (``dtype=`` of
#: assert_no_worse).
ULPS = {torch.float32: 64, torch.bfloat16: 3 if triton_interpreting() else 2, torch.float16: 4}


def tolerance(dtype: torch.dtype, scale: float) -> dict:
    eps = torch.finfo(dtype).eps
    k = ULPS[dtype]
    return dict(rtol=k * eps, atol=k * eps * max(scale, 1e-30) / 4)


def assert_no_worse(actual, reference, exact, what="", dtype=None):
    """``actual`` (Triton) as close to ``exact`` (the torch path in fp64) as ``reference`` (the torch path in
    the tested dtype) is, up to :func:`tolerance`: elementwise ``|a − e| ≤ |r − e| + atol + rtol·|e|``.

    Why not only "close to the torch path": where the torch path itself rounds in the low precision (CPU
    LayerNorm's bf16 weight gradient is 2x further from the fp64 result than the kernel's), closeness to it
    would demand the same rounding errors; this asks for no larger ones.
    """
    if reference is None or actual is None:
        assert actual is None and reference is None, f"{what}: one is None ({actual is None}, {reference is None})"
        return
    assert actual.dtype == reference.dtype, f"{what}: dtype {actual.dtype} != {reference.dtype}"
    assert actual.shape == reference.shape, f"{what}: shape {actual.shape} != {reference.shape}"
    a, r, e = (t.detach().double().cpu() for t in (actual, reference, exact))
    scale = e.abs().max().item() if e.numel() else 1.0
    tol = tolerance(dtype if dtype is not None else reference.dtype, scale)
    bound = (r - e).abs() + tol["atol"] + tol["rtol"] * e.abs()
    excess = (a - e).abs() - bound
    assert (excess <= 0).all(), (f"{what}: Triton result further from the fp64 result than the torch path's plus "
                                 f"tolerance at {int((excess > 0).sum())} of {excess.numel()} elements (worst "
                                 f"excess {excess.max().item():.3g}, scale {scale:.3g})")


#: Devices the kernel tests run on in this process: CPU under the interpreter (process started with
#: TRITON_INTERPRET=1), else CUDA when present; empty (the tests skip) otherwise.
DEVICES = ["cpu"] if triton_interpreting() else (["cuda"] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def triton_path(device: str):
    """Triton kernels preferred over torch."""
    pytest.importorskip("triton")
    with kernels.preference("triton"):
        yield


@contextlib.contextmanager
def torch_path():
    with kernels.preference("torch"):
        yield


class AllocationLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (shape, dtype) of every tensor an ``empty``-like op creates (the kernels' output buffers)."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.zeros,
                                   torch.ops.aten.new_empty, torch.ops.aten.empty_like, torch.ops.aten.zeros_like):
            self.created.append((tuple(out.shape), out.dtype))
        return out
