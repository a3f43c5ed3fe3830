"""The compiled core's max pooling (csrc/max_pool.cpp) against the Python path and stock.

Outputs, returned indices and input gradients bit for bit equal to stock PyTorch and to the Python path
(``csrc.disabled()``) on independent copies, with stock's strides; the same saved bytes as the Python path (one
window position per output); 1-d, 2-d and 3-d pooling, batched and unbatched, every float dtype, contiguous /
channels_last / sliced inputs, kernel, stride, padding, dilation and ceil_mode combinations, NaN, ±inf and ties;
modules and functional forms. Each test asserts that the core's Function actually ran (or, for the calls it
leaves to the Python Function, that it did not).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad.nn.pooling  # noqa: F401  (registers the replacements)
from _util import FLOAT_DTYPES, slim_copy
from slimgrad import csrc
from slimgrad.functional import pooling as P
from slimgrad.kernels import max_pool, registry
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.skipif(csrc.core() is None,
                                reason=f"the compiled core is unavailable here: {csrc.status()['reason']}")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def bits(t):
    return t.detach().view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t.detach()


def assert_bitwise(actual, expected, what):
    """Same dtype, shape, strides and bit patterns (NaN payloads and the sign of zero included)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.stride() == expected.stride(), f"{what}: strides {actual.stride()} != {expected.stride()}"
    assert torch.equal(bits(actual), bits(expected)), f"{what}: bits differ"


def ran_core(out, function="MaxPoolFunction") -> bool:
    return out.grad_fn is not None and function in out.grad_fn.name() and "CppNode" in out.grad_fn.name()


def make_input(shape, dtype, values, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if values == "ties":  # few distinct values: ties everywhere, windows of -inf only
        x = torch.randint(0, 3, shape, generator=gen).double()
        x[x == 0] = -math.inf
    elif values == "special":
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        x = torch.where(u < 0.25, -math.inf, x)
        x = torch.where(u > 0.92, math.nan, x)
        x = torch.where((u > 0.88) & (u <= 0.92), math.inf, x)
        x = torch.where((u > 0.84) & (u <= 0.88), -0.0, x)
    x = x.to(dtype)
    if layout == "channels_last":
        if x.dim() in CL:
            x = x.contiguous(memory_format=CL[x.dim()])
        else:  # (N, C, L) or (C, L) with the channel dim innermost in memory
            c = 1 if x.dim() == 3 else 0
            x = x.movedim(c, -1).contiguous().movedim(-1, c)
    elif layout == "sliced":
        x = torch.cat([x, x], -1)[..., ::2]
    return x


def upstream(out, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    g[..., :1] = -0.0  # a -0.0 gradient: stock adds it to +0.0
    if out.dim() in CL and out.is_contiguous(memory_format=CL[out.dim()]) and not out.is_contiguous():
        g = g.contiguous(memory_format=CL[out.dim()])
    return g


def run(fn, x, seed=1, *, core=True, function="MaxPoolFunction"):
    """(output(s), input gradient, saved bytes, whether the core ran) of fn on an independent copy of x."""
    leaf = x.detach().clone(memory_format=torch.preserve_format)
    if x.stride() != leaf.stride():  # a sliced view: the same values every other element of a wider leaf
        leaf = torch.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
        leaf[..., ::2] = x.detach()
        leaf.requires_grad_()
        inp = leaf[..., ::2]
    else:
        inp = leaf.requires_grad_()
    with SavedTensors() as counter:
        if core:
            out = fn(inp)
        else:
            with csrc.disabled():
                out = fn(inp)
    first = out[0] if isinstance(out, tuple) else out
    (gx,) = torch.autograd.grad(first, leaf, upstream(first, seed))
    return out, gx, counter.bytes, ran_core(first, function)


def python_keeps_indices(nd, x):
    """Where the Python Function keeps stock's int64 indices instead of positions: 3-d channels_last inputs with
    -inf (stock's kernel may report an element outside an all -inf window there, which no position names; see
    pooling._depthless_winners and test_3d_channels_last_all_neg_inf_windows_follow_stock)."""
    return nd == 3 and not x.is_contiguous() and bool(torch.isneginf(x).any())


def compare_three(stock_fn, slim_fn, x, *, expect_core=True, nd=None):
    s_out, s_g, _, _ = run(stock_fn, x)
    c_out, c_g, c_bytes, c_ran = run(slim_fn, x)
    p_out, p_g, p_bytes, p_ran = run(slim_fn, x, core=False)
    # Returned indices are left to the Python Function, which keeps them in place of positions.
    expect_core = expect_core and not isinstance(s_out, tuple)
    assert c_ran == expect_core, f"core ran: {c_ran}, expected {expect_core}"
    assert not p_ran
    if isinstance(s_out, tuple):
        assert_bitwise(c_out[1], s_out[1], "indices vs stock")
        assert_bitwise(p_out[1], s_out[1], "indices vs python")
        assert not c_out[1].requires_grad
        s_out, c_out, p_out = s_out[0], c_out[0], p_out[0]
    assert_bitwise(c_out, s_out, "output vs stock")
    assert_bitwise(c_g, s_g, "grad vs stock")
    assert_bitwise(c_out, p_out, "output vs python")
    assert_bitwise(c_g, p_g, "grad vs python")
    if c_ran and nd is not None and python_keeps_indices(nd, x):
        assert p_bytes in (c_bytes, c_out.numel() * 8)  # positions, or stock's indices where it kept them
    else:
        assert c_bytes == p_bytes, f"saved bytes: core {c_bytes}, python {p_bytes}"
    return c_bytes, c_out


MODULE_CASES = [
    (nn.MaxPool1d(3), (2, 5, 13)),
    (nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True), (2, 5, 12)),
    (nn.MaxPool1d(4, 1, 2, return_indices=True), (5, 10)),  # unbatched, overlapping windows
    (nn.MaxPool2d(3, 2, 1), (2, 5, 9, 10)),  # the ResNet stem pool
    (nn.MaxPool2d(2), (2, 5, 8, 8)),
    (nn.MaxPool2d((3, 2), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True, return_indices=True), (2, 5, 9, 7)),
    (nn.MaxPool2d(3, 1, 1), (2, 5, 4, 2)),  # windows wider than the input
    (nn.MaxPool2d(3, 2, 1, ceil_mode=True), (5, 8, 9)),  # unbatched
    (nn.MaxPool2d(3, 2, 1), (2, 40, 7, 6)),  # channels past one vector (channels_last NaN bits)
    (nn.MaxPool2d(3, 2, 1), (1, 24, 5, 6)),  # 16 bf16 lanes (stock's AVX2 kernel) and 8 scalar channels
    (nn.MaxPool2d(3, 2, 1), (2, 64, 9, 10)),  # four 16-channel blocks (channels_last: the next window prefetched)
    (nn.MaxPool2d(17, 3, 8), (1, 32, 20, 19)),  # int16 positions, vector-packed (channels_last)
    (nn.MaxPool2d((33, 32), 8, 16), (1, 16, 40, 36)),  # windows too large to list: walked per channel block
    (nn.MaxPool3d(2, 2), (1, 6, 4, 4, 5)),  # 3-d channels_last: vector and scalar channels
    (nn.MaxPool3d(3, 2, 1), (2, 3, 5, 6, 7)),
    (nn.MaxPool3d((2, 3, 1), (1, 2, 1), (1, 1, 0), dilation=(1, 2, 1), ceil_mode=True, return_indices=True),
     (2, 3, 5, 7, 4)),
    (nn.MaxPool3d(2, 1, 1), (3, 4, 5, 6)),  # unbatched
]


@pytest.mark.parametrize("stock,shape", MODULE_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("values", ["randn", "ties", "special"])
def test_modules_match_stock_and_python(stock, shape, dtype, layout, values):
    x = make_input(shape, dtype, values, "contiguous" if layout == "channels_last" and len(shape) == 4
                   and isinstance(stock, nn.MaxPool3d) else layout)
    if isinstance(stock, nn.MaxPool3d) and len(shape) == 4 and layout == "channels_last":
        x = x.unsqueeze(0).contiguous(memory_format=torch.channels_last_3d)[0]  # (C, D, H, W), C innermost
    # 3-d pooling of an unbatched non-contiguous input: aten's layout workaround, left to the Python Function
    expect_core = not (isinstance(stock, nn.MaxPool3d) and len(shape) == 4 and not x.is_contiguous())
    kept, out = compare_three(stock, slim_copy(stock), x, expect_core=expect_core, nd=len(_kernel(stock)))
    if stock.return_indices:  # kept in place of positions
        assert kept == out.numel() * 8
        return
    if not expect_core and python_keeps_indices(3, x):
        assert kept in (out.numel() * 8, out.numel() * P.position_dtype(math.prod(_kernel(stock))).itemsize)
    else:
        assert kept == out.numel() * P.position_dtype(math.prod(_kernel(stock))).itemsize


def _kernel(module):
    nd = int(type(module).__name__[-2])
    k = module.kernel_size
    return (k,) * nd if isinstance(k, int) else tuple(k)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=None, padding=1, dilation=1, ceil_mode=True, return_indices=True),
    dict(kernel_size=2, stride=1, padding=1, dilation=2, ceil_mode=False, return_indices=True),
    dict(kernel_size=[3], stride=[2], padding=[1]),  # lists: not cached, checked per call
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_functional_matches_stock_and_python(nd, kwargs, dtype):
    stock_fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    slim_fn = {1: P.max_pool1d, 2: P.max_pool2d, 3: P.max_pool3d}[nd]
    x = make_input((2, 3) + (7, 8, 9)[3 - nd:], dtype, "special", "contiguous")
    compare_three(lambda t: stock_fn(t, **kwargs), lambda t: slim_fn(t, **kwargs), x)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_geometries(nd, seed):
    """Random kernel/stride/padding/dilation/ceil_mode/sizes/layouts/dtypes, each against stock and Python."""
    gen = torch.Generator().manual_seed(100 * nd + seed)

    def pick(n):
        return int(torch.randint(0, n, (), generator=gen))

    for _ in range(8):
        kernel = tuple(1 + pick(4) for _ in range(nd))
        dilation = tuple(1 + pick(2) for _ in range(nd))
        padding = tuple(pick(k // 2 + 1) for k in kernel)
        stride = tuple(1 + pick(3) for _ in range(nd))
        ceil_mode, return_indices = bool(pick(2)), bool(pick(2))
        sizes = tuple((k - 1) * d + 1 + pick(5) for k, d in zip(kernel, dilation))
        shape = (1 + pick(2), 1 + pick(20)) + sizes
        dtype = FLOAT_DTYPES[pick(4)]
        layout = ["contiguous", "channels_last", "sliced"][pick(3)]
        values = ["randn", "ties", "special"][pick(3)]
        x = make_input(shape, dtype, values, layout, seed=pick(1000))
        cls = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[nd - 1]
        stock = cls(kernel, stride, padding, dilation, return_indices=return_indices, ceil_mode=ceil_mode)
        compare_three(stock, slim_copy(stock), x, nd=nd)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parallel_sizes(threads, layout, dtype):
    """Inputs large enough for the parallel split (planes, rows, channel blocks) of both passes."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stock = nn.MaxPool2d(3, 2, 1)
        compare_three(stock, slim_copy(stock), make_input((3, 24, 40, 36), dtype, "special", layout))
        stock = nn.MaxPool2d(3, 1, 1, return_indices=True)  # overlapping windows: accumulation order
        compare_three(stock, slim_copy(stock), make_input((1, 20, 30, 31), dtype, "ties", layout))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("channels", [3, 6, 17, 24])
def test_3d_channels_last_all_neg_inf_windows_follow_stock(dtype, channels):
    """Stock's 3-d channels_last kernel starts its scalar (tail) channels from the first in-bounds (h, w) of
    depth 0: an all -inf window there reports, and sends its gradient to, that element. The core follows it (and
    the Python Function, which alone serves returned indices)."""
    x = torch.full((1, channels, 4, 4, 4), -math.inf, dtype=dtype).contiguous(memory_format=torch.channels_last_3d)
    for return_indices in (False, True):
        stock = nn.MaxPool3d(2, 2, return_indices=return_indices)
        s_out, s_g, _, _ = run(stock, x)
        c_out, c_g, _, ran = run(slim_copy(stock), x)
        assert ran != return_indices
        if return_indices:
            assert_bitwise(c_out[1], s_out[1], "indices")
            s_out, c_out = s_out[0], c_out[0]
        assert_bitwise(c_out, s_out, "output")
        assert_bitwise(c_g, s_g, "grad")


def test_saved_tensor_hooks_see_the_positions():
    packed = []

    def pack(t):
        packed.append((t.dtype, t.shape))
        return t

    x = torch.randn(2, 3, 9, 10, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = slim_copy(nn.MaxPool2d(3, 2, 1))(x)
    assert ran_core(out)
    assert packed == [(torch.uint8, out.shape)]
    out.sum().backward()


def test_double_backward_refused_as_the_python_path():
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    slim = slim_copy(nn.MaxPool2d(3, 2, 1))
    messages = []
    for core in (True, False):
        out = slim(x) if core else _disabled(slim, x)
        assert ran_core(out) == core
        (g,) = torch.autograd.grad(out, x, torch.ones_like(out, requires_grad=True), create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable") as err:
            g.sum().backward()
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def _disabled(fn, *args):
    with csrc.disabled():
        return fn(*args)


def test_checkpointing():
    from torch.utils.checkpoint import checkpoint

    slim = slim_copy(nn.MaxPool2d(3, 2, 1))
    x = torch.randn(2, 3, 8, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.max_pool2d(a, 3, 2, 1).square().sum().backward()
    for reentrant in (True, False):
        b.grad = None
        checkpoint(lambda t: slim(t).square(), b, use_reentrant=reentrant).sum().backward()
        assert_bitwise(b.grad, a.grad, f"grad (reentrant={reentrant})")


@pytest.mark.parametrize("make,shape", [
    (lambda m: m.MaxPool2d(2, padding=2), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(7), (1, 2, 5, 5)),
    (lambda m: m.MaxPool2d(2), (5, 5)),
    (lambda m: m.MaxPool1d(3, padding=2), (1, 2, 5)),
    (lambda m: m.MaxPool3d(2, stride=0), (1, 1, 4, 4, 4)),
])
def test_invalid_calls_raise_stocks_error(make, shape):
    import slimgrad.nn.pooling as slim_nn

    x = torch.randn(shape, requires_grad=True)
    with pytest.raises(Exception) as stock_err:
        make(nn)(x)
    with pytest.raises(type(stock_err.value)) as slim_err:
        make(slim_nn)(x)
    assert str(slim_err.value) == str(stock_err.value)


def test_calls_left_to_the_python_function():
    slim = slim_copy(nn.MaxPool3d(2))
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # stock casts 3-d pooling to fp32 here
        out = slim(x)
    assert not ran_core(out) and out.dtype == torch.float32
    empty = torch.randn(0, 2, 4, 4, 4, requires_grad=True)
    assert slim(empty).shape == (0, 2, 2, 2, 2)
    with torch.no_grad():
        assert slim(x).grad_fn is None
    assert not ran_core(slim(x.detach()))


def test_module_options_rechecked_when_changed():
    slim = slim_copy(nn.MaxPool2d(2))
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    assert slim(x).shape == (1, 2, 4, 4)
    slim.kernel_size, slim.stride, slim.padding = 3, 1, 1
    out = slim(x)
    assert ran_core(out)
    assert_bitwise(out, F.max_pool2d(x, 3, 1, 1), "output after options changed")
    slim.padding = 2  # invalid now: stock's error
    with pytest.raises(RuntimeError, match="pad should be"):
        slim(x)


# ------------------------------------------------------------------------------------ registry kernels


def test_registry_chooses_the_core():
    x = torch.randn(4)
    for dtype in FLOAT_DTYPES:
        assert registry.choose(max_pool.FAMILY, x.to(dtype)).name == "core"
    with csrc.disabled():
        assert registry.choose(max_pool.FAMILY, x.bfloat16()).name != "core"


@pytest.mark.parametrize("case", [
    # kernel, stride, padding, dilation, ceil_mode, shape
    ((3,), (2,), (1,), (1,), False, (2, 3, 11)),
    ((3, 3), (2, 2), (1, 1), (1, 1), False, (2, 3, 9, 10)),
    ((3, 3), (1, 1), (1, 1), (1, 1), True, (3, 7, 5)),
    ((3, 2), (2, 1), (1, 0), (2, 1), True, (2, 2, 9, 7)),
    ((16, 16), (1, 1), (0, 0), (1, 1), False, (1, 1, 18, 17)),  # 256-element windows
    ((2, 3, 2), (1, 2, 1), (1, 1, 0), (1, 1, 2), True, (2, 2, 5, 6, 7)),
    ((7, 7, 7), (1, 1, 1), (3, 3, 3), (1, 1, 1), False, (1, 2, 8, 8, 8)),  # int16 positions
])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_registry_kernel_equals_the_torch_reference(case, dtype):
    kernel, stride, padding, dilation, ceil_mode, shape = case
    x = make_input(shape, dtype, "special", "contiguous")
    impl = registry.choose(max_pool.FAMILY, x)
    assert impl.name == "core"
    ref = max_pool.TORCH_IMPL
    out1, pos1 = ref.forward(x, kernel, stride, padding, dilation, ceil_mode)
    out2, pos2 = impl.forward(x, kernel, stride, padding, dilation, ceil_mode)
    assert_bitwise(out2, out1, "output")
    assert pos2.dtype == pos1.dtype and torch.equal(pos2, pos1), "positions"
    g = upstream(out1)
    args = (x.shape, kernel, stride, padding, dilation, ceil_mode)
    assert_bitwise(impl.backward(g, pos2, *args), ref.backward(g, pos1, *args), "grad")
    with pytest.raises(RuntimeError, match="pad should be"):  # declined: the reference raises stock's error
        impl.forward(x, kernel, stride, tuple(k for k in kernel), dilation, ceil_mode)


def test_module_copies_and_pickles_start_without_the_cached_options():
    import copy
    import io

    slim = slim_copy(nn.MaxPool2d(3, 2, 1))
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    assert ran_core(slim(x))
    twin = copy.deepcopy(slim)
    assert ran_core(twin(x))
    buffer = io.BytesIO()
    torch.save(slim, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert ran_core(loaded(x))


# ------------------------------------------------------------------------------------------- average pooling

AVG_CASES = [
    (nn.AvgPool1d(3), (2, 5, 11)),
    (nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), (5, 12)),
    (nn.AvgPool2d(3, 2, 1), (2, 5, 9, 10)),
    (nn.AvgPool2d((3, 2), (2, 1), (1, 1), ceil_mode=True, count_include_pad=False), (2, 5, 9, 7)),
    (nn.AvgPool2d(3, 1, 1, divisor_override=5), (5, 6, 5)),
    (nn.AvgPool3d(3, 2, 1), (2, 3, 7, 8, 9)),
    (nn.AvgPool3d(2, 1, 1, ceil_mode=True, count_include_pad=False, divisor_override=3), (2, 5, 4, 6)),
    (nn.AdaptiveAvgPool1d(4), (2, 5, 11)),
    (nn.AdaptiveAvgPool2d((3, None)), (2, 5, 9, 10)),
    (nn.AdaptiveAvgPool2d(4), (5, 7, 10)),
    (nn.AdaptiveAvgPool2d((3, 4)), (2, 24, 9, 10)),
    (nn.AdaptiveAvgPool3d((2, 3, 5)), (2, 3, 7, 8, 9)),
    (nn.AdaptiveAvgPool3d((None, 1, 3)), (2, 3, 4, 5, 7)),
]


def compare_avg(stock_fn, slim_fn, x, *, expect_core=True, stock_runs=False):
    """``stock_runs``: slimgrad leaves the call to stock's op (core and Python path), keeping what stock keeps."""
    s_out, s_g, s_bytes, _ = run(stock_fn, x, function="AvgPoolFunction")
    c_out, c_g, c_bytes, c_ran = run(slim_fn, x, function="AvgPoolFunction")
    p_out, p_g, p_bytes, p_ran = run(slim_fn, x, core=False, function="AvgPoolFunction")
    assert c_ran == (expect_core and not stock_runs) and not p_ran
    for a, b, what in ((c_out, s_out, "output vs stock"), (c_g, s_g, "grad vs stock"),
                       (c_out, p_out, "output vs python"), (c_g, p_g, "grad vs python")):
        assert_bitwise(a, b, what)
    assert c_bytes == p_bytes == (s_bytes if stock_runs else 0)


@pytest.mark.parametrize("stock,shape", AVG_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_avg_modules_match_stock_and_python(stock, shape, dtype, layout):
    if isinstance(stock, nn.AvgPool3d) and dtype in (torch.float16, torch.bfloat16):
        pytest.skip("stock avg_pool3d has no half/bfloat16 CPU kernel")
    x = make_input(shape, dtype, "special", layout)
    # a batched adaptive input with channels innermost: stock's gradient is channels_last, which only an input-sized
    # tensor conveys to its backward kernel, so stock's op runs
    batched = len(shape) == (3 if isinstance(stock, nn.AdaptiveAvgPool1d) else 4)
    adaptive = isinstance(stock, nn.AdaptiveAvgPool1d | nn.AdaptiveAvgPool2d)
    compare_avg(stock, slim_copy(stock), x, stock_runs=adaptive and batched and layout == "channels_last")


@pytest.mark.parametrize("fn,stock_fn,args", [
    (P.avg_pool1d, F.avg_pool1d, (3, 2, 1, True, False)),
    (P.avg_pool2d, F.avg_pool2d, (3, None, 1, True, False, 4)),
    (P.avg_pool2d, F.avg_pool2d, ([3, 2], [2, 1])),  # lists: checked per call
    (P.avg_pool3d, F.avg_pool3d, (2, 1, 1)),
    (P.adaptive_avg_pool1d, F.adaptive_avg_pool1d, (5,)),
    (P.adaptive_avg_pool2d, F.adaptive_avg_pool2d, ((None, 4),)),
    (P.adaptive_avg_pool3d, F.adaptive_avg_pool3d, ((2, 3, 2),)),
], ids=lambda v: getattr(v, "__name__", str(v)))  # names, not reprs with addresses (xdist compares ids)
def test_avg_functional_matches_stock_and_python(fn, stock_fn, args):
    nd = int(fn.__name__[-2])
    x = make_input((2, 3) + (7, 8, 9)[3 - nd:], torch.float32, "special", "contiguous")
    compare_avg(lambda t: stock_fn(t, *args), lambda t: fn(t, *args), x)


def test_avg_calls_left_to_the_python_path():
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    out = slim_copy(nn.AdaptiveAvgPool2d(1))(x)  # stock's mean: no Function at all
    assert "Mean" in out.grad_fn.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = slim_copy(nn.AvgPool3d(2))(torch.randn(1, 2, 4, 4, 4, dtype=torch.bfloat16, requires_grad=True))
    assert not ran_core(out, "AvgPoolFunction") and out.dtype == torch.float32


@pytest.mark.parametrize("make,shape", [
    (lambda m: m.AvgPool2d(0), (1, 2, 5, 5)),
    (lambda m: m.AvgPool2d(2, padding=2), (1, 2, 5, 5)),
    (lambda m: m.AvgPool1d(3, padding=2), (1, 2, 5)),
    (lambda m: m.AvgPool2d(2, divisor_override=0), (1, 2, 5, 5)),
    (lambda m: m.AdaptiveAvgPool2d((2, 2, 2)), (1, 2, 5, 5)),
    (lambda m: m.AdaptiveAvgPool2d((None, 2)), (5,)),
    (lambda m: m.AdaptiveAvgPool3d(0), (1, 2, 5, 5, 5)),
])
def test_avg_invalid_calls_raise_stocks_error(make, shape):
    import slimgrad.nn.pooling as slim_nn

    x = torch.randn(shape, requires_grad=True)
    try:
        expected = make(nn)(x)
    except Exception as stock_err:  # noqa: BLE001 - whatever stock raises, slimgrad must raise the same
        with pytest.raises(type(stock_err)) as slim_err:
            make(slim_nn)(x)
        assert str(slim_err.value) == str(stock_err)
    else:
        assert_bitwise(make(slim_nn)(x), expected, "output")


def test_avg_double_backward_refused():
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    out = slim_copy(nn.AvgPool2d(3, 2, 1))(x)
    assert ran_core(out, "AvgPoolFunction")
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_revert_removes_the_cached_options():
    import slimgrad

    model = slimgrad.convert(nn.Sequential(nn.MaxPool2d(2), nn.AvgPool2d(2)))
    model(torch.randn(1, 2, 8, 8, requires_grad=True))
    assert all("_slimgrad_core_pool" in m.__dict__ for m in model)
    slimgrad.revert(model)
    assert not any("_slimgrad_core_pool" in m.__dict__ for m in model)


@pytest.mark.parametrize("kind", ["max", "avg", "adaptive"])
def test_a_list_option_changed_in_place_is_seen(kind):
    """The core's option cache kept the module's own list (``MaxPool2d([2, 2])``) as its key, equal to itself after
    any in-place change: the old size kept being used (4x4 where stock gives 3x4; the state-change sweep)."""
    make = {"max": lambda: nn.MaxPool2d([2, 2]), "avg": lambda: nn.AvgPool2d([2, 2]),
            "adaptive": lambda: nn.AdaptiveAvgPool2d([2, 2])}[kind]
    stock = make()
    slim = slimgrad.convert(stock)
    x = torch.randn(2, 3, 8, 8)
    for size in ([2, 2], [3, 2]):
        for m in (stock, slim):
            option = m.output_size if kind == "adaptive" else m.kernel_size
            option[:] = size
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = stock(xa), slim(xb)
        assert a.shape == b.shape and torch.equal(a, b), size
        a.square().sum().backward()
        b.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad), size
