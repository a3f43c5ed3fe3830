"""The compiled core's CPU kernels (:mod:`slimgrad.csrc`) against the torch references of their families: same
bits for outputs, masks, positions and gradients; the Functions under either preference against stock."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _util import FLOAT_DTYPES, assert_same
from slimgrad import csrc, kernels
from slimgrad.functional.activation import leaky_relu, relu
from slimgrad.functional.dropout import dropout
from slimgrad.functional.pooling import max_pool1d, max_pool2d
from slimgrad.kernels import dropout as dropout_family
from slimgrad.kernels import max_pool, range_mask, relu_mask

pytestmark = pytest.mark.skipif(csrc.core() is None, reason=f"compiled core unavailable: {csrc.status()['reason']}")

SPECIALS = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0]
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def core_impl(family, like):
    with kernels.preference("core"):
        impl = kernels.choose(family, like)
    assert impl is not None and impl.name == "core", f"no core kernel for {family} {like.dtype}"
    return impl


def bits_equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.is_floating_point():
        a, b = a.view(_INT[a.element_size()]), b.view(_INT[b.element_size()])
    assert torch.equal(a, b), f"{what}: bits differ"


def special_input(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    k = min(n, len(SPECIALS))
    x[:k] = torch.tensor(SPECIALS[:k], dtype=torch.float64)
    return x[torch.randperm(n, generator=gen)].to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("slope", [None, 0.01, 0.0, -0.3, 2.0])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 64, 1001])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_relu_mask_core_equals_torch(dtype, slope, n, inplace):
    if inplace and slope is not None and slope < 0:
        pytest.skip("outside the contract: the Function runs stock's op and keeps nothing there")
    x = special_input(n, dtype)
    g = special_input(n, dtype, seed=1)
    fast = core_impl(relu_mask.FAMILY, x)
    ref = relu_mask.TORCH_IMPL
    x1, x2 = x.clone(), x.clone()
    out1, packed1 = ref.forward(x1, slope, inplace)
    out2, packed2 = fast.forward(x2, slope, inplace)
    if inplace:
        assert out2 is x2
    bits_equal(out2, out1, "output")
    bits_equal(packed2, packed1, "mask")
    bits_equal(fast.backward(g, packed2, slope), ref.backward(g, packed1, slope), "grad")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("n", [0, 5, 8, 1001])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_dropout_bits_core_equals_torch(dtype, p, n, inplace):
    x = special_input(n, dtype)
    g = special_input(n, dtype, seed=1)
    keep = torch.empty(n, dtype=torch.uint8).bernoulli_(1 - p, generator=torch.Generator().manual_seed(2))
    scale = dropout_family.noise_scale(p, dtype)
    fast = core_impl(dropout_family.BITS, x)
    ref = dropout_family.BITS_TORCH
    out1, packed1 = ref.forward(x.clone(), keep, scale, inplace)
    out2, packed2 = fast.forward(x.clone(), keep, scale, inplace)
    bits_equal(out2, out1, "output")
    bits_equal(packed2, packed1, "mask")
    bits_equal(fast.backward(g, packed2, scale), ref.backward(g, packed1, scale), "grad")
    # and the reference is stock's formula: x * noise, noise = keep / (1 - p) in the dtype
    noise = keep.to(dtype).div_(1 - p)
    bits_equal(out1, x * noise, "stock formula")


POOL_CASES = [
    # kernel, stride, padding, dilation, ceil_mode, shape
    ((3, 3), (2, 2), (1, 1), (1, 1), False, (2, 3, 9, 10)),
    ((2, 2), (2, 2), (0, 0), (1, 1), False, (2, 3, 8, 8)),
    ((3, 3), (1, 1), (1, 1), (1, 1), True, (1, 2, 7, 5)),  # overlapping windows: accumulation order
    ((3, 2), (2, 1), (1, 0), (2, 1), True, (2, 2, 9, 7)),
    ((16, 16), (1, 1), (0, 0), (1, 1), False, (1, 1, 18, 17)),  # 256-element windows
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"k{c[0]}s{c[1]}p{c[2]}d{c[3]}c{int(c[4])}")
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_max_pool_positions_core_equals_torch(dtype, case, ties):
    kernel, stride, padding, dilation, ceil_mode, shape = case
    n = math.prod(shape)
    x = special_input(n, dtype).reshape(shape)
    if ties:  # few distinct values: ties everywhere, and windows of -inf only
        x = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        x[x == 0] = -float("inf")
    g = special_input(0, dtype)
    fast = core_impl(max_pool.FAMILY, x)
    ref = max_pool.TORCH_IMPL
    out1, pos1 = ref.forward(x, kernel, stride, padding, dilation, ceil_mode)
    out2, pos2 = fast.forward(x, kernel, stride, padding, dilation, ceil_mode)
    bits_equal(out2, out1, "output")
    assert torch.equal(pos2, pos1), "positions"
    g = torch.randn(out1.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    args = (x.shape, kernel, stride, padding, dilation, ceil_mode)
    bits_equal(fast.backward(g, pos2, *args), ref.backward(g, pos1, *args), "grad")


@pytest.mark.parametrize("preference", ["torch", "core"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_functions_match_stock_under_each_preference(preference, layout, dtype):
    """relu, leaky_relu, max_pool and dropout: stock's outputs and gradients whichever backend runs."""
    base = special_input(2 * 3 * 6 * 8, dtype).reshape(2, 3, 6, 8)
    if layout == "channels_last":
        base = base.contiguous(memory_format=torch.channels_last)
    pairs = [(F.relu, relu), (lambda t: F.leaky_relu(t, 0.2), lambda t: leaky_relu(t, 0.2)),
             (lambda t: F.max_pool2d(t, 3, 2, 1), lambda t: max_pool2d(t, 3, 2, 1)),
             (lambda t: F.max_pool1d(t.flatten(2), 3, 2), lambda t: max_pool1d(t.flatten(2), 3, 2)),
             (lambda t: F.dropout(t, 0.3), lambda t: dropout(t, 0.3, policy="bits"))]
    for stock_fn, slim_fn in pairs:
        results = []
        for fn in (stock_fn, slim_fn):
            leaf = base.clone().requires_grad_()
            x = leaf[..., ::2] if layout == "sliced" else leaf
            torch.manual_seed(0)
            with kernels.preference(preference):
                out = fn(x * 1.0)
                out.backward(torch.ones_like(out).mul_(0.75))
            results.append((out, leaf.grad))
        (so, sg), (mo, mg) = results
        assert_same(mo, so, what=f"{preference} output")
        assert_same(mg, sg, what=f"{preference} grad")


def test_torch_preference_chooses_the_references():
    x = torch.randn(4)
    with kernels.preference("torch"):
        for family in (relu_mask.FAMILY, dropout_family.BITS, max_pool.FAMILY):
            assert kernels.choose(family, x).name == "torch"
    with kernels.preference("auto"):
        for family in (relu_mask.FAMILY, dropout_family.BITS, max_pool.FAMILY, range_mask.FAMILY):
            for dtype in FLOAT_DTYPES:
                assert kernels.choose(family, x.to(dtype)).name == "core", (family, dtype)
        with csrc.disabled():
            assert kernels.choose(relu_mask.FAMILY, x).name == "torch"


def test_numba_preference_says_what_replaced_it():
    with pytest.raises(ValueError, match="compiled core"):
        kernels.set_preference("numba")


def test_loading_a_kernel_never_moves_the_default_generator():
    """Loading a CPU kernel must not draw from the default generator: the first dropout call of a run would
    otherwise leave the generator in another state than stock's, and every later mask would differ (seen in TRL
    SFT with lora_dropout=0.1, with the numba kernels this project used before the core)."""
    from slimgrad.kernels import registry

    for family in (relu_mask.FAMILY, dropout_family.BITS, max_pool.FAMILY, range_mask.FAMILY):
        for kernel in registry.implementations(family):
            if kernel.backend != "core":
                continue
            kernel._loaded = False  # load again, as a fresh process would
            torch.manual_seed(0)
            before = torch.get_rng_state()
            assert kernel.implementation() is not None
            assert torch.equal(torch.get_rng_state(), before), family


def test_first_dropout_call_leaves_the_generator_as_stock_does():
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    expected_out, expected_state = F.dropout(x, 0.1), torch.get_rng_state()
    torch.manual_seed(1)
    out = dropout(x, 0.1, policy="bits")
    assert torch.equal(out, expected_out) and torch.equal(torch.get_rng_state(), expected_state)
