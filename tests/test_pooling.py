"""Pooling against stock PyTorch: bitwise outputs, indices and gradients, and what is kept for backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._util import assert_same, saved_bytes, slim_copy
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
import slimgrad.functional.pooling as P
import slimgrad.nn.pooling  # noqa: F401  (registers the replacements for slim_copy)
from slimgrad._registry import FACADE
from slimgrad.measure import peak_bytes

CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _grads(module, x, seed=0):
    """Output(s) and the raw input gradient (torch.autograd.grad, so AccumulateGrad's re-layout of leaf
    gradients does not hide the layout the backward kernel produced)."""
    x = x.clone().requires_grad_()
    out = module(x)
    first = out[0] if isinstance(out, tuple) else out
    g = torch.randn(first.shape, generator=torch.Generator().manual_seed(seed)).to(first.dtype)
    if first.dim() in CL and first.is_contiguous(memory_format=CL[first.dim()]):
        g = g.contiguous(memory_format=CL[first.dim()])
    (gx,) = torch.autograd.grad(first, x, g)
    return out, gx


def _compare(stock, x, seed=0):
    slim = slim_copy(stock)
    out_s, g_s = _grads(stock, x, seed)
    out_m, g_m = _grads(slim, x, seed)
    if isinstance(out_s, tuple):
        assert_same(out_m[1], out_s[1], what="indices")
        assert not out_m[1].requires_grad
        out_s, out_m = out_s[0], out_m[0]
    assert_same(out_m, out_s, what="output")
    assert_same(g_m, g_s, what="grad")
    assert out_m.stride() == out_s.stride(), "output layout"
    assert g_m.stride() == g_s.stride(), "grad layout"
    return slim


# --------------------------------------------------------------------------------------------- max

MAX_CASES = [
    (nn.MaxPool1d(3), (2, 3, 11)),
    (nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True), (2, 3, 12)),
    (nn.MaxPool1d(4, 1, 2, return_indices=True), (3, 10)),  # no batch dim, overlapping
    (nn.MaxPool2d(3, 2, 1), (2, 3, 9, 10)),
    (nn.MaxPool2d(2), (2, 3, 8, 8)),
    (nn.MaxPool2d((3, 2), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True, return_indices=True), (2, 3, 9, 7)),
    (nn.MaxPool2d(3, 1, 1), (2, 3, 4, 2)),  # window wider than input: the division fallback
    (nn.MaxPool2d(3, 2, 1, ceil_mode=True), (3, 8, 9)),  # no batch dim
    (nn.MaxPool3d(3, 2, 1), (2, 3, 7, 8, 9)),
    (nn.MaxPool3d((2, 3, 1), (1, 2, 1), (1, 1, 0), dilation=(1, 2, 1), ceil_mode=True, return_indices=True),
     (2, 2, 5, 7, 4)),
    (nn.MaxPool3d(7, 1, 3), (1, 2, 8, 8, 8)),  # 343-element window: int16 positions
]


@pytest.mark.parametrize("stock,shape", MAX_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("values", ["randn", "ties", "inf_nan"])
def test_max_pool_matches_stock(stock, shape, values):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g)
    if values == "ties":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, torch.zeros(()), x.round())
    elif values == "inf_nan":
        u = torch.rand(shape, generator=g)
        x = torch.where(u < 0.3, -math.inf, x)
        x = torch.where(u > 0.95, math.nan, x)
        x = torch.where((u > 0.9) & (u <= 0.95), math.inf, x)
    _compare(stock, x)


def test_max_pool_all_constant_and_all_neg_inf():
    for fill in (0.0, -math.inf):
        _compare(nn.MaxPool2d(3, 1, 1), torch.full((1, 2, 5, 6), fill))


@pytest.mark.parametrize("fn,stock_fn,shape", [
    (P.max_pool1d, F.max_pool1d, (2, 3, 10)),
    (P.max_pool2d, F.max_pool2d, (2, 3, 9, 8)),
    (P.max_pool3d, F.max_pool3d, (1, 2, 5, 6, 7)),
])
@pytest.mark.parametrize("kwargs", [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=None, padding=1, dilation=1, ceil_mode=True, return_indices=True),
    dict(kernel_size=2, stride=1, padding=1, dilation=2, ceil_mode=False, return_indices=True),
])
def test_max_pool_functional(fn, stock_fn, shape, kwargs):
    x = torch.randn(shape)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_s, out_m = stock_fn(a, **kwargs), fn(b, **kwargs)
    if kwargs.get("return_indices"):
        assert_same(out_m[1], out_s[1], what="indices")
        out_s, out_m = out_s[0], out_m[0]
    assert_same(out_m, out_s)
    g = torch.randn(out_s.shape)
    out_s.backward(g)
    out_m.backward(g.clone())
    assert_same(b.grad, a.grad)
    # no grad wanted: stock runs unchanged
    with torch.no_grad():
        r_s, r_m = stock_fn(x, **kwargs), fn(x, **kwargs)
    assert_same(r_m[0] if isinstance(r_m, tuple) else r_m, r_s[0] if isinstance(r_s, tuple) else r_s)


# --------------------------------------------------------------------------------------------- avg

AVG_CASES = [
    (nn.AvgPool1d(3), (2, 3, 11)),
    (nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), (3, 12)),
    (nn.AvgPool2d(3, 2, 1), (2, 3, 9, 10)),
    (nn.AvgPool2d((3, 2), (2, 1), (1, 1), ceil_mode=True, count_include_pad=False), (2, 3, 9, 7)),
    (nn.AvgPool2d(3, 1, 1, divisor_override=5), (3, 6, 5)),
    (nn.AvgPool3d(3, 2, 1), (2, 3, 7, 8, 9)),
    (nn.AvgPool3d(2, 1, 1, ceil_mode=True, count_include_pad=False, divisor_override=3), (2, 5, 4, 6)),
    (nn.AdaptiveAvgPool1d(4), (2, 3, 11)),
    (nn.AdaptiveAvgPool1d(1), (2, 3, 11)),
    (nn.AdaptiveAvgPool2d((3, None)), (2, 3, 9, 10)),
    (nn.AdaptiveAvgPool2d(4), (3, 7, 10)),
    (nn.AdaptiveAvgPool2d(1), (2, 3, 9, 10)),
    (nn.AdaptiveAvgPool2d((1, None)), (2, 3, 9, 1)),
    (nn.AdaptiveAvgPool3d((2, 3, 5)), (2, 3, 7, 8, 9)),
    (nn.AdaptiveAvgPool3d((None, 1, 3)), (2, 3, 4, 5, 7)),
    (nn.AdaptiveAvgPool3d(1), (2, 3, 4, 5, 6)),
]


@pytest.mark.parametrize("stock,shape", AVG_CASES, ids=lambda v: str(v))
def test_avg_pool_matches_stock(stock, shape):
    _compare(stock, torch.randn(shape))


def test_avg_functional_signatures():
    x = torch.randn(2, 3, 8, 9)
    for fn, stock_fn, args in [
        (P.avg_pool2d, F.avg_pool2d, (3, None, 1, True, False, 4)),
        (P.avg_pool1d, F.avg_pool1d, (3, 2, 1, True, False)),
        (P.adaptive_avg_pool2d, F.adaptive_avg_pool2d, ((None, 4),)),
        (P.adaptive_avg_pool1d, F.adaptive_avg_pool1d, (5,)),
    ]:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        if fn in (P.avg_pool1d, P.adaptive_avg_pool1d):
            a, b = a[0], b[0]
        out_s, out_m = stock_fn(a, *args), fn(b, *args)
        assert_same(out_m, out_s)
        (ga,) = torch.autograd.grad(out_s, a, torch.ones_like(out_s))
        (gb,) = torch.autograd.grad(out_m, b, torch.ones_like(out_m))
        assert_same(gb, ga)


# ------------------------------------------------------------------------------- dtypes and layouts

LAYOUT_CASES = [
    (nn.MaxPool1d(3, 2, 1), (2, 4, 9)),
    (nn.MaxPool2d(3, 2, 1), (2, 4, 9, 10)),
    (nn.MaxPool3d(3, 1, 1), (2, 4, 5, 6, 7)),
    (nn.AvgPool1d(3, 2, 1), (2, 4, 9)),
    (nn.AvgPool2d(3, 2, 1), (2, 4, 9, 10)),
    (nn.AvgPool3d(3, 2, 1), (2, 4, 5, 6, 7)),
    (nn.AdaptiveAvgPool1d(3), (2, 4, 9)),
    (nn.AdaptiveAvgPool2d((3, 4)), (2, 4, 9, 10)),
    (nn.AdaptiveAvgPool2d(1), (2, 4, 9, 10)),
    (nn.AdaptiveAvgPool3d((2, 3, 4)), (2, 4, 5, 6, 7)),
]


@pytest.mark.parametrize("stock,shape", LAYOUT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_dtypes_and_channels_last(stock, shape, dtype, layout):
    if isinstance(stock, nn.AvgPool3d) and dtype in (torch.float16, torch.bfloat16):
        pytest.skip("stock avg_pool3d has no half/bfloat16 CPU kernel")
    x = torch.randn(shape).to(dtype)
    if layout == "channels_last":
        # 1-d "channels last" is a (N, L, C) buffer seen as (N, C, L): stock runs it as channels_last 2-d
        x = x.contiguous(memory_format=CL[x.dim()]) if x.dim() in CL else x.mT.contiguous().mT
    _compare(stock, x)


@pytest.mark.parametrize("stock,shape", [
    (nn.MaxPool2d(3, 2, 1), (2, 4, 9, 10)),
    (nn.MaxPool3d(3, 2, 1), (2, 4, 5, 6, 7)),
    (nn.AvgPool3d(3, 2, 1), (2, 4, 5, 6, 7)),
    (nn.AdaptiveAvgPool3d(2), (2, 4, 5, 6, 7)),
    (nn.AvgPool2d(3, 2, 1), (2, 4, 9, 10)),
], ids=lambda v: str(v))
def test_autocast_mirrors_stock(stock, shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _compare(stock, x)


# --------------------------------------------------------------------------------- what is kept


@pytest.mark.parametrize("stock,shape,pos_itemsize", [
    (nn.MaxPool2d(3, 2, 1), (2, 8, 16, 16), 1),
    (nn.MaxPool1d(5, 2, 2), (2, 8, 33), 1),
    (nn.MaxPool3d(3, 2, 1, return_indices=True), (2, 4, 8, 8, 8), 8),  # returned indices, kept in their place
    (nn.MaxPool3d(7, 1, 3), (1, 2, 8, 8, 8), 2),  # 343 positions need int16
], ids=lambda v: str(v))
def test_max_pool_keeps_only_positions(stock, shape, pos_itemsize):
    x = torch.randn(shape, requires_grad=True)
    slim = slim_copy(stock)
    out = stock(x)
    out = out[0] if isinstance(out, tuple) else out
    minimum = out.numel() * pos_itemsize  # one window position (or returned index) per output element
    assert saved_bytes(slim, x) == minimum
    stock_bytes = saved_bytes(stock, x)
    assert stock_bytes == x.numel() * x.element_size() + out.numel() * 8  # X and int64 indices
    assert stock_bytes > 4 * minimum


@pytest.mark.parametrize("stock,shape", [c for c in AVG_CASES], ids=lambda v: str(v))
def test_avg_pool_keeps_nothing(stock, shape):
    x = torch.randn(shape, requires_grad=True)
    assert saved_bytes(slim_copy(stock), x) == 0
    output_one = isinstance(stock, nn.AdaptiveAvgPool1d | nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool3d) and all(
        s == 1 for s in stock(x).shape[-(x.dim() - 1 if x.dim() < 4 else 2):]
    )
    if not output_one and not isinstance(stock, nn.AdaptiveAvgPool3d | nn.AdaptiveAvgPool1d):
        assert saved_bytes(stock, x) >= x.numel() * x.element_size()  # stock keeps X


def test_position_dtype():
    assert P.position_dtype(9) == torch.uint8
    assert P.position_dtype(256) == torch.uint8
    assert P.position_dtype(257) == torch.int16
    assert P.position_dtype(2**15) == torch.int16
    assert P.position_dtype(2**15 + 1) == torch.int32


@pytest.mark.parametrize("stock,shape", [
    (nn.MaxPool2d(3, 2, 1), (4, 16, 32, 32)),
    (nn.MaxPool2d(2), (4, 16, 32, 32)),
    (nn.MaxPool3d(3, 2, 1), (2, 8, 12, 12, 12)),
    (nn.AvgPool2d(3, 2, 1), (4, 16, 32, 32)),
    (nn.AdaptiveAvgPool2d(5), (4, 16, 32, 32)),
    (nn.AvgPool3d(3, 2, 1), (2, 8, 12, 12, 12)),
], ids=lambda v: str(v))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_backward_peak_not_above_stock(stock, shape, layout):
    """Memory in use during backward = what forward kept + backward's own peak; ours must not exceed
    stock's. (Stock's kept input counts: in a network it would otherwise have been freed.)"""
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=CL[x.dim()])

    def in_use(module):
        xx = x.clone().requires_grad_()
        kept = saved_bytes(module, xx)
        out = module(xx)
        g = torch.ones_like(out)
        return kept + peak_bytes(lambda: torch.autograd.grad(out, xx, g))

    assert in_use(slim_copy(stock)) <= in_use(stock)


# --------------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(
    nd=st.integers(1, 3),
    kernel=st.integers(1, 4),
    stride=st.one_of(st.none(), st.integers(1, 3)),
    pad_frac=st.integers(0, 2),
    dilation=st.integers(1, 2),
    ceil_mode=st.booleans(),
    extra=st.integers(0, 4),
    batch=st.booleans(),
    ties=st.booleans(),
    avg=st.booleans(),
)
def test_property_against_stock(nd, kernel, stride, pad_frac, dilation, ceil_mode, extra, batch, ties, avg):
    padding = min(pad_frac, kernel // 2)
    size = (kernel - 1) * dilation + 1 + extra
    shape = ((2,) if batch else ()) + (3,) + (size,) * nd
    x = torch.randn(shape)
    if ties:
        x = x.round()
    if avg:
        cls = [nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d][nd - 1]
        stock = cls(kernel, stride, padding, ceil_mode=ceil_mode, count_include_pad=bool(extra % 2))
    else:
        cls = [nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d][nd - 1]
        stock = cls(kernel, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=bool(extra % 2))
    _compare(stock, x)


# ------------------------------------------------------------------- autograd machinery and errors


@pytest.mark.parametrize("stock", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), nn.AdaptiveAvgPool2d(3)],
                         ids=str)
def test_double_backward_is_refused_clearly(stock):
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    out = slim_copy(stock)(x)
    gout = torch.ones_like(out, requires_grad=True)
    (g,) = torch.autograd.grad(out, x, gout, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("stock", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), nn.MaxPool1d(2)], ids=str)
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing(stock, reentrant):
    x = torch.randn(2, 3, 8, 8) if not isinstance(stock, nn.MaxPool1d) else torch.randn(2, 3, 8)
    slim = slim_copy(stock)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(a).square().sum().backward()
    checkpoint(lambda t: slim(t).square(), b, use_reentrant=reentrant).sum().backward()
    assert_same(b.grad, a.grad)


@pytest.mark.parametrize("make,shape", [
    (lambda m: m.MaxPool2d(0), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(2, padding=2), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(2, stride=0), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(2, dilation=0), (1, 2, 5, 5)),
    (lambda m: m.MaxPool1d(0), (1, 2, 5)),
    (lambda m: m.MaxPool1d(3, padding=2), (1, 2, 5)),
    (lambda m: m.MaxPool3d(2, padding=2), (1, 1, 4, 4, 4)),
    (lambda m: m.MaxPool2d(7), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(2), (5, 5)),
    (lambda m: m.AvgPool2d(0), (1, 2, 5, 5)),
    (lambda m: m.AvgPool2d(2, padding=2), (1, 2, 5, 5)),
    (lambda m: m.AvgPool1d(3, padding=2), (1, 2, 5)),
    (lambda m: m.AvgPool2d(2, divisor_override=0), (1, 2, 5, 5)),
    (lambda m: m.AdaptiveAvgPool2d((2, 2, 2)), (1, 2, 5, 5)),
    (lambda m: m.AdaptiveAvgPool2d((None, 2)), (5,)),
    (lambda m: m.AdaptiveAvgPool3d(0), (1, 2, 5, 5, 5)),
])
def test_bad_input_errors_like_stock(make, shape):
    import slimgrad.nn.pooling as slim_nn

    x = torch.randn(shape)
    for requires_grad in (False, True):
        a, b = x.clone().requires_grad_(requires_grad), x.clone().requires_grad_(requires_grad)
        try:
            expected = make(nn)(a)
        except Exception as stock_err:  # noqa: BLE001 - whatever stock raises, we must raise the same
            with pytest.raises(type(stock_err)) as slim_err:
                make(slim_nn)(b)
            assert str(slim_err.value) == str(stock_err)
        else:  # stock accepts it (e.g. an empty adaptive output): so must we
            assert_same(make(slim_nn)(b), expected)


def test_non_tensor_input_named():
    with pytest.raises(TypeError, match="argument 'input'"):
        P.max_pool2d([1.0, 2.0], 2)


def test_modules_override_forward_only():
    import slimgrad.nn.pooling as slim_nn

    for name in slim_nn.__all__:
        cls = getattr(slim_nn, name)
        stock = getattr(nn, name)
        assert cls.__mro__[1] is stock
        assert set(vars(cls)) - {"__module__", "__doc__", "__qualname__", "forward", "__firstlineno__",
                                 "__static_attributes__"} == set(FACADE)


@pytest.mark.slow
@pytest.mark.parametrize("stock,channels_last", [
    (nn.MaxPool2d(3, 2, 1), False),
    (nn.MaxPool2d(3, 2, 1, return_indices=True), True),
    (nn.AvgPool2d(3, 2, 1), False),
    (nn.AvgPool2d(3, 2, 1), True),
], ids=str)
def test_compile_fullgraph(stock, channels_last):
    torch._dynamo.reset()
    x = torch.randn(2, 3, 9, 10)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    slim = slim_copy(stock)
    compiled = torch.compile(slim, fullgraph=True)
    out_s, g_s = _grads(stock, x)
    out_c, g_c = _grads(compiled, x)
    if isinstance(out_s, tuple):
        assert_same(out_c[1], out_s[1])
        out_s, out_c = out_s[0], out_c[0]
    assert_same(out_c, out_s)
    assert_same(g_c, g_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: nn.MaxPool2d(3, 1, 1), lambda: nn.Hardtanh()],
                         ids=["MaxPool2d(3,1,1)", "Hardtanh"])
def test_python_path_step_peak_at_most_stock(make, dtype):
    """The Python path (core off) of max pooling and the range-mask activations: gradients bitwise stock's and the
    step's peak at most stock's. Max pooling's backward rebuilt stock's int64 indices whole (with an int64 copy
    of each window digit) while the positions stayed saved; Hardtanh's select widened the bool mask to a
    full-size integer copy, and its bf16 pack compared an fp32 copy of x. The slack: the 0-dim zero ``where``
    takes for its ``+0`` (one element of the gradient's width; stock's kernels take none)."""
    import copy

    from slimgrad import csrc

    torch.manual_seed(0)
    stock = make()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x0 = torch.randn(4, 8, 24, 24, dtype=dtype)
    g = torch.randn(stock(x0).shape, dtype=dtype)
    peaks, grads = [], []
    for m in (stock, slim):
        x = x0.clone().requires_grad_()

        def step(m=m, x=x):
            (m(x) * g).sum().backward()

        with csrc.disabled():
            peaks.append(peak_bytes(step))
            x.grad = None
            step()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert peaks[1] <= peaks[0] + dtype.itemsize, peaks


# --------------------------------------------------------------------------------- a step's peak, input held


def _channels_last_1d(shape):
    """A 1-d input whose unsqueezed view suggests channels_last (channels innermost): stock's 1-d gradient
    follows it."""
    n, c, length = shape
    return torch.randn(n, length, c, dtype=torch.float64).transpose(1, 2)


STEP_CASES = [
    # average pooling: backward's stand-in for the input was a fresh element, one above stock's peak
    (lambda: nn.AvgPool1d(2), (4, 8, 48), "contiguous"),
    (lambda: nn.AvgPool2d(3, 2, 1), (4, 8, 12, 12), "contiguous"),
    (lambda: nn.AvgPool2d(3, 2, 1), (4, 8, 12, 12), "channels_last"),
    (lambda: nn.AvgPool3d(2), (2, 8, 6, 6, 6), "contiguous"),
    (lambda: nn.AdaptiveAvgPool1d(5), (4, 8, 48), "contiguous"),
    (lambda: nn.AdaptiveAvgPool2d(5), (4, 8, 12, 12), "contiguous"),
    (lambda: nn.AdaptiveAvgPool3d(5), (2, 8, 6, 6, 6), "contiguous"),
    # adaptive pooling with a channels_last gradient: an input-sized carrier of the layout
    (lambda: nn.AdaptiveAvgPool2d(5), (4, 8, 12, 12), "channels_last"),
    (lambda: nn.AdaptiveAvgPool2d(6), (4, 8, 12, 12), "channels_last"),
    (lambda: nn.AdaptiveAvgPool1d(5), (4, 8, 48), "channels_last"),
    # returned indices: positions kept beside them
    (lambda: nn.MaxPool1d(2, return_indices=True), (4, 8, 48), "contiguous"),
    (lambda: nn.MaxPool2d(2, return_indices=True), (4, 8, 12, 12), "contiguous"),
    (lambda: nn.MaxPool2d(3, 1, 1, return_indices=True), (4, 8, 12, 12), "channels_last"),
    (lambda: nn.MaxPool3d(2, return_indices=True), (2, 8, 6, 6, 6), "contiguous"),
]


@pytest.mark.parametrize("core", ["on", "off"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("make,shape,layout", STEP_CASES, ids=[f"{m()!r}-{layout}" for m, _, layout in STEP_CASES])
def test_step_peak_and_kept_at_most_stock_input_held(make, shape, layout, dtype, core):
    """A forward+backward step on an input the caller holds (a leaf): saved bytes and the step's peak at most
    stock's, outputs (indices too) and gradients bitwise stock's with its strides, on the core and the Python path.
    Stock reads the input it kept, so any allocation our backward makes in its place is above stock's: a one-element
    stand-in (average pooling: +1 element), an input-sized channels_last carrier (adaptive: 58504 B against 40072 in
    fp32), window positions beside returned indices (1-d: 16338 B against 15368)."""
    import contextlib
    import copy

    from slimgrad import csrc

    if core == "on" and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    stock = make()
    if layout == "channels_last" and len(shape) == 3:
        x0 = _channels_last_1d(shape).to(dtype)
    else:
        x0 = torch.randn(shape, dtype=torch.float64).to(dtype)
        if layout == "channels_last":
            x0 = x0.contiguous(memory_format=CL[x0.dim()])
    try:
        y0 = stock(x0)
    except (NotImplementedError, RuntimeError) as e:  # e.g. CPU avg_pool3d in bf16/fp16
        pytest.skip(f"stock raises: {e}")
    y0 = y0[0] if isinstance(y0, tuple) else y0
    g = torch.randn(y0.shape, generator=torch.Generator().manual_seed(1))
    slim = slimgrad.convert(copy.deepcopy(stock))
    ctx = contextlib.nullcontext() if core == "on" else csrc.disabled()

    def step(m, x):
        y = m(x)
        ((y[0] if isinstance(y, tuple) else y).float() * g).sum().backward()

    results = {}
    with ctx:
        for name, m in (("stock", stock), ("slim", slim)):
            step(m, x0.clone().requires_grad_())  # warm: options checked and cached
            x = x0.clone().requires_grad_()
            out = m(x)
            outs = out if isinstance(out, tuple) else (out,)
            ((outs[0]).float() * g).sum().backward()
            kept = saved_bytes(m, x0.clone().requires_grad_())
            peak = peak_bytes(step, m, x0.clone().requires_grad_())
            results[name] = (kept, peak, [o.detach() for o in outs], x.grad)
    (s_kept, s_peak, s_outs, s_grad), (c_kept, c_peak, c_outs, c_grad) = results["stock"], results["slim"]
    for c, s in zip(c_outs, s_outs, strict=True):
        assert_same(c, s, what="output")
        assert c.stride() == s.stride()
    assert_same(c_grad, s_grad, what="grad")
    assert c_grad.stride() == s_grad.stride()
    assert c_kept <= s_kept, (c_kept, s_kept)
    assert c_peak <= s_peak, (c_peak, s_peak)
