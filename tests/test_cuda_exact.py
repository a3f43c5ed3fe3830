"""CUDA only (skipped elsewhere): converted batch norm runs stock's own kernel where stock runs cuDNN, so its
output, running statistics and every requested gradient are stock's bits (BRIEF's "Exact" rule: bitwise where
the same kernel can run).

Stock's ``torch.batch_norm`` picks cuDNN on CUDA (fp32, or fp16 input with fp32 parameters; weight and bias
defined; 3+ dims); slimgrad's Function used to run ``native_batch_norm`` there, whose reductions and affine step
round differently (scripts/gpu_stock_diff.py measures every class). The cases here are the ones the Function
serves (stock's own functional runs where the weight trains, or in training where x needs a gradient): evaluation
with a frozen affine (dX, dB), training with only dB, and no gradient at all (inference). Each is checked with the
compiled core on and off, and each asserts that stock really picks cuDNN there, so a case cannot pass vacuously.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import csrc
from slimgrad.measure import saved_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda"


def _bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: not bitwise, max abs diff {(a.double() - b.double()).abs().max().item():.3g}"
    assert a.stride() == b.stride() or a.numel() <= 1, f"{what}: strides {a.stride()} vs {b.stride()}"


def _module(nd, training, dtype, fmt):
    torch.manual_seed(nd)
    m = (nn.BatchNorm2d if nd == 2 else nn.BatchNorm3d)(6)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
        m.running_mean.uniform_(-0.5, 0.5)
        m.running_var.uniform_(0.5, 2.0)
    m = m.to(DEVICE).train(training)
    shape = (4, 6, 5, 7) if nd == 2 else (2, 6, 3, 4, 5)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    if fmt == "cl":
        x = x.contiguous(memory_format=torch.channels_last if nd == 2 else torch.channels_last_3d)
    return m, x


def _stock_backend(m, x):
    return torch._C._select_batch_norm_backend(x, m.weight, m.bias, m.running_mean, m.running_var, m.training, m.eps)


def _run(m, x, x_grad, b_grad, dy):
    m.weight.requires_grad_(False)
    m.bias.requires_grad_(b_grad)
    x = x.detach().clone().requires_grad_(x_grad)
    out = m(x)
    wanted = [t for t, flag in ((x, x_grad), (m.bias, b_grad)) if flag]
    grads = []
    if wanted:
        if dy == "expanded":  # out.sum().backward()'s zero-stride dY
            g = torch.full((), 0.75, device=DEVICE, dtype=out.dtype).expand(out.shape)
        else:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, out.dtype)
            g = g.contiguous(memory_format=_format(out))
        grads = torch.autograd.grad(out, wanted, g)  # the gradients as backward laid them out
    return out, grads, m.running_mean.clone(), m.running_var.clone()


def _format(t):
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dim and not t.is_contiguous() and t.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


CASES = [  # (training, x_grad, b_grad): the combinations the Function serves with a frozen weight
    (False, True, False), (False, True, True), (False, False, True), (False, False, False),
    (True, False, True), (True, False, False),
]


@pytest.mark.parametrize("core", ["on", "off"])
@pytest.mark.parametrize("dy", ["dense", "expanded"])
@pytest.mark.parametrize("fmt", ["contig", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nd", [2, 3])
def test_batch_norm_runs_stocks_cudnn_bitwise(nd, dtype, fmt, dy, core):
    for training, x_grad, b_grad in CASES:
        what = f"train={training} x_grad={x_grad} b_grad={b_grad}"
        stock, x = _module(nd, training, dtype, fmt)
        assert _stock_backend(stock, x) == torch._C._BatchNormBackend.Cudnn, f"{what}: stock does not pick cuDNN"
        slim = slimgrad.convert(copy.deepcopy(stock))
        with csrc.disabled() if core == "off" else contextlib.nullcontext():
            got = _run(slim, x, x_grad, b_grad, dy)
        want = _run(stock, x, x_grad, b_grad, dy)
        _bitwise(got[0], want[0], f"{what}: output")
        for i, (a, b) in enumerate(zip(got[1], want[1])):
            _bitwise(a, b, f"{what}: gradient {i}")
        _bitwise(got[2], want[2], f"{what}: running_mean")
        _bitwise(got[3], want[3], f"{what}: running_var")


@pytest.mark.parametrize("training", [False, True])
def test_batch_norm_inference_under_no_grad_is_stocks_cudnn(training):
    stock, x = _module(2, training, torch.float32, "cl")
    slim = slimgrad.convert(copy.deepcopy(stock))
    with torch.no_grad():
        _bitwise(slim(x), stock(x), "output")
    _bitwise(slim.running_mean, stock.running_mean, "running_mean")


def test_batch_norm_cudnn_bias_only_keeps_no_input():
    """Training with only dB requested keeps cuDNN's statistics and reserve, never x (stock keeps x)."""
    stock, x = _module(2, True, torch.float32, "contig")
    slim = slimgrad.convert(copy.deepcopy(stock))
    for m in (stock, slim):
        m.weight.requires_grad_(False)
    x_bytes = x.numel() * x.element_size()
    reserve = torch._C._get_cudnn_batch_norm_reserve_space_size(x, True)
    kept = saved_bytes(slim, x)
    assert kept < x_bytes // 2 + reserve, (kept, reserve, x_bytes)
    assert saved_bytes(stock, x) >= x_bytes

