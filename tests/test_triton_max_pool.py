"""Triton max pooling (family ``max_pool_positions``) against the torch path, on CPU under the interpreter and
compiled on CUDA: outputs and positions bitwise; input gradients bitwise where no two windows overlap or the
dtype accumulates exactly (fp32/fp64 here), else within one rounding of the dtype (stock's CPU kernel adds in
the dtype, its CUDA kernel, like this one, in fp32); on CUDA bitwise stock's ``F.max_poolNd``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests._triton_util import DEVICES, torch_path, triton_path
from tests._util import assert_same

from slimgrad import kernels
from slimgrad.functional.pooling import max_pool1d, max_pool2d
from slimgrad.measure import saved_bytes

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (kernel, stride, padding, dilation, ceil_mode)
CONFIGS = [
    ((3, 3), (2, 2), (1, 1), (1, 1), False),  # ResNet stem: overlapping windows
    ((2, 2), (2, 2), (0, 0), (1, 1), False),  # disjoint
    ((3, 2), (1, 2), (1, 0), (2, 1), True),   # dilation, ceil_mode, overlap along H
    ((5, 5), (3, 3), (2, 2), (1, 1), True),
]


def _input(shape, dtype, device, special=True):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    x = (x * 4).round() / 4  # ties inside windows
    if special:
        flat = x.view(-1)
        flat[::7] = float("nan")
        flat[3::11] = float("-inf")
        flat[5::13] = float("inf")
    return x.to(device=device, dtype=dtype)


def _run(fn, x, g, *args):
    xi = x.clone().requires_grad_(True)
    out = fn(xi, *args)
    out.backward(g)
    return out.detach(), xi.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_max_pool2d_matches_torch_path(device, dtype, cfg):
    kernel, stride, padding, dilation, ceil_mode = cfg
    x = _input((2, 3, 11, 13), dtype, device)
    with torch_path():
        ref_out = max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    g = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    args = (kernel, stride, padding, dilation, ceil_mode)
    with torch_path():
        ref = _run(max_pool2d, x, g, *args)
        ref_impl = kernels.max_pool.choose(x)
        ref_pos = ref_impl.forward(x.contiguous(), kernel, stride, padding, dilation, ceil_mode)[1]
    with triton_path(device):
        impl = kernels.max_pool.choose(x)
        assert getattr(impl, "backend", None) == "triton"
        got = _run(max_pool2d, x, g, *args)
        pos = impl.forward(x.contiguous(), kernel, stride, padding, dilation, ceil_mode)[1]
    assert_same(got[0], ref[0], what="out")
    assert_same(pos, ref_pos, what="positions")
    overlap = any(s < (k - 1) * d + 1 for k, s, d in zip(kernel, stride, dilation))
    exact = dtype in (torch.float32, torch.float64) or not overlap
    if device == "cuda":
        xs = x.clone().requires_grad_(True)
        stock = F.max_pool2d(xs, *args)
        stock.backward(g)
        assert_same(got[0], stock.detach(), what="out vs stock")
        assert_same(got[1], xs.grad, what="dx vs stock CUDA")
    elif exact:
        assert_same(got[1], ref[1], what="dx")
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got[1].double(), ref[1].double(), rtol=2 * eps, atol=2 * eps * 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool1d_matches_torch_path(device, dtype):
    x = _input((2, 4, 17), dtype, device)
    g = torch.randn((2, 4, 9), generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    with torch_path():
        ref = _run(max_pool1d, x, g, 3, 2, 1)
    with triton_path(device):
        got = _run(max_pool1d, x, g, 3, 2, 1)
    assert_same(got[0], ref[0], what="out")
    if dtype == torch.float32:
        assert_same(got[1], ref[1], what="dx")


@pytest.mark.parametrize("device", DEVICES)
def test_max_pool2d_keeps_positions_only(device):
    x = _input((2, 3, 12, 12), torch.float32, device, special=False).requires_grad_(True)
    with triton_path(device):
        kept = saved_bytes(lambda t: max_pool2d(t, 3, 2, 1), x)
    assert kept == 2 * 3 * 6 * 6  # one uint8 position per output element
