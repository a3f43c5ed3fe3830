"""ReLU6 / Hardtanh / Threshold / Hardsigmoid against stock PyTorch: bitwise outputs and gradients (NaN,
±inf, -0 and the region boundaries included), 1 bit per element kept."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
import slimgrad.nn.clamp  # noqa: F401  (registers the replacements)
from _util import FLOAT_DTYPES, assert_same, input_grad_as_returned, laid_out, slim_copy
from slimgrad import kernels
from slimgrad.functional import _layout
from slimgrad.functional import clamp as C
from slimgrad.functional._common import note_input_kept
from slimgrad.measure import SavedTensors

SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40]
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(actual, expected, what):
    """Bit patterns equal (+0 and -0 differ), NaN where stock has NaN (payloads not compared)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan]), f"{what}: bits differ"


def assert_grad(actual, expected, x, case, what="grad"):
    """Bitwise equal to stock, except at NaN inputs of hardtanh/relu6: stock's own answer there depends on
    the element's position (see slimgrad.functional.clamp); ours is always +0 (the vectorised rule)."""
    if not case.startswith(("relu6", "hardtanh", "ReLU6", "Hardtanh")):
        return assert_bitwise(actual, expected, what)
    nan_in = torch.isnan(x.detach())
    assert torch.equal(bits(actual)[nan_in], torch.zeros_like(bits(actual)[nan_in])), f"{what}: NaN input passes"
    assert_bitwise(actual.masked_fill(nan_in, 0), expected.masked_fill(nan_in, 0), what)


def test_stock_hardtanh_nan_rule_depends_on_position():
    """Why hardtanh's NaN inputs are compared apart: stock's vectorised body blocks them, its scalar tail
    lets them through. If torch makes this consistent, this test says so."""
    n = 67
    x = torch.full((n,), float("nan"), requires_grad=True)
    F.hardtanh(x).backward(torch.ones(n))
    passed = x.grad != 0
    assert not passed[:n // 2].any() and passed[-1]
    xm = torch.full((n,), float("nan"), requires_grad=True)
    C.hardtanh(xm).backward(torch.ones(n))
    assert not (xm.grad != 0).any()


# name -> (stock F call, slimgrad call, region edges worth hitting exactly, whether stock keeps a clone in place)
CASES = {
    "relu6": (lambda x, ip: F.relu6(x, inplace=ip), lambda x, ip: C.relu6(x, inplace=ip), (0.0, 6.0)),
    "hardtanh": (lambda x, ip: F.hardtanh(x, inplace=ip), lambda x, ip: C.hardtanh(x, inplace=ip), (-1.0, 1.0)),
    "hardtanh(-0.5,2.5)": (lambda x, ip: F.hardtanh(x, -0.5, 2.5, ip), lambda x, ip: C.hardtanh(x, -0.5, 2.5, ip),
                           (-0.5, 2.5)),
    "hardtanh(1,1)": (lambda x, ip: F.hardtanh(x, 1.0, 1.0, ip), lambda x, ip: C.hardtanh(x, 1.0, 1.0, ip),
                      (1.0,)),
    "threshold(0.5,2)": (lambda x, ip: F.threshold(x, 0.5, 2.0, ip), lambda x, ip: C.threshold(x, 0.5, 2.0, ip),
                         (0.5, 2.0)),
    "threshold(0.5,-2)": (lambda x, ip: F.threshold(x, 0.5, -2.0, ip), lambda x, ip: C.threshold(x, 0.5, -2.0, ip),
                          (0.5, -2.0)),
    "hardsigmoid": (lambda x, ip: F.hardsigmoid(x, inplace=ip), lambda x, ip: C.hardsigmoid(x, inplace=ip),
                    (-3.0, 3.0)),
    # bounds no half-precision dtype holds exactly: stock's kernels round them differently (see _bounds)
    "hardtanh(-0.1,0.1)": (lambda x, ip: F.hardtanh(x, -0.1, 0.1, ip), lambda x, ip: C.hardtanh(x, -0.1, 0.1, ip),
                           (-0.1, 0.1)),
    "threshold(0.1,-1)": (lambda x, ip: F.threshold(x, 0.1, -1.0, ip), lambda x, ip: C.threshold(x, 0.1, -1.0, ip),
                          (0.1,)),
}


def make_input(shape, dtype, layout, edges=(), seed=0):
    """A leaf of ``shape`` in ``layout`` holding random values, every special value and each region edge
    exactly, just below and just above it (in ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    x = (torch.randn(numel, generator=gen, dtype=torch.float64) * 4).to(dtype)
    specials = torch.tensor(SPECIALS, dtype=dtype)
    for e in edges:
        t = torch.tensor(e, dtype=dtype)
        specials = torch.cat([specials, torch.stack([t, torch.nextafter(t, t - 1), torch.nextafter(t, t + 1)])])
    k = min(numel, len(specials))
    x[:k] = specials[:k]
    x = x[torch.randperm(numel, generator=gen)].reshape(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3).contiguous().transpose(1, 3)
    return x


def run(fn, x_leaf, inplace, grad, sliced=False):
    with SavedTensors() as counter:
        x = x_leaf[..., ::2] if sliced else x_leaf
        inp = x.clone() if inplace else x
        out = fn(inp, inplace)
    out.backward(grad)
    return out, x_leaf.grad, counter.bytes


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("backend", ["torch", "core"])
def test_matches_stock_bitwise(case, dtype, layout, inplace, backend):
    with kernels.preference(backend):
        _matches_stock_bitwise(case, dtype, layout, inplace)


def _matches_stock_bitwise(case, dtype, layout, inplace):
    stock, slim, edges = CASES[case]
    shape = (2, 3, 5, 7)  # 210 elements: not a multiple of 8
    sliced = layout == "sliced"
    base = make_input(shape, dtype, "contiguous" if sliced else layout, edges)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    out_shape = (2, 3, 5, 4) if sliced else shape
    grad = make_input(out_shape, dtype, "contiguous", seed=1)
    ys, gs, bytes_stock = run(stock, xs, inplace, grad, sliced)
    ym, gm, bytes_slim = run(slim, xm, inplace, grad, sliced)
    assert_bitwise(ym, ys, "output")
    assert_grad(gm, gs, base, case)
    numel = math.prod(out_shape)
    assert bytes_slim == (numel + 7) // 8
    # Stock keeps its input out of place (for a slice, the whole storage it views), in place the result
    # (hardtanh) or a clone of the input (threshold, hardsigmoid): either way one tensor of the input's size.
    whole = math.prod(shape) if sliced and not inplace else numel
    assert bytes_stock == whole * base.element_size()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", [(0,), (0, 3), (1,), (7,), (9,), (3, 1, 1, 5)])
def test_odd_and_empty_shapes(case, shape):
    stock, slim, edges = CASES[case]
    base = make_input(shape, torch.float32, "contiguous", edges)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input(shape, torch.float32, "contiguous", seed=2)
    ys, gs, _ = run(stock, xs, False, grad)
    ym, gm, kept = run(slim, xm, False, grad)
    assert_bitwise(ym, ys, "output")
    assert_grad(gm, gs, base, case)
    assert kept == (math.prod(shape) + 7) // 8


def test_no_grad_needed_is_stock_and_keeps_nothing():
    x = torch.randn(4, 4)
    with SavedTensors() as counter:
        y = C.relu6(x)
    assert counter.bytes == 0 and torch.equal(y, F.relu6(x))


def test_errors_like_stock():
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        C.relu6(torch.randn(3, requires_grad=True), inplace=True)
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        C.hardtanh(torch.randn(3), 2.0, 1.0)
    with pytest.raises(TypeError, match="argument 'input'"):
        C.hardsigmoid([1.0])
    with pytest.raises(TypeError, match="argument 'value'"):
        C.threshold(torch.randn(2), 0.0, "1")


MODULES = [nn.ReLU6(), nn.ReLU6(inplace=True), nn.Hardtanh(-2.0, 0.5), nn.Threshold(0.1, 20.0),
           nn.Threshold(0.1, 0.0, inplace=True), nn.Hardsigmoid(), nn.Hardsigmoid(inplace=True)]


@pytest.mark.parametrize("module", MODULES, ids=repr)
def test_modules_match_stock(module):
    slim = slim_copy(module)
    base = make_input((2, 4, 3, 3), torch.float32, "channels_last", (-3.0, 0.0, 0.1, 0.5, 3.0, 6.0))
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input((2, 4, 3, 3), torch.float32, "contiguous", seed=3)
    ys = module(xs * 1.0)
    ys.backward(grad)
    with SavedTensors() as counter:
        ym = slim(xm * 1.0)
    ym.backward(grad)
    assert_bitwise(ym, ys, "output")
    assert_grad(xm.grad, xs.grad, base, type(module).__name__)
    assert counter.bytes == 9  # the 72-element mask; the multiplication by a constant keeps nothing


X_LAYOUTS = ["contiguous", "channels_last", "transposed"]
GRAD_LAYOUTS = ["contiguous", "channels_last", "transposed", "sliced", "expanded"]


@pytest.mark.parametrize("module", MODULES + [nn.Hardtanh(inplace=True)], ids=repr)
@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (2, 4, 1, 5)])  # size 1: TensorIterator's tie-breaking
def test_input_grad_layout_matches_stock(module, shape):
    """The gradient returned to a non-leaf input has stock's strides (stock's kernels take their layout
    from the gradient, threshold's from x) and stock's bits, for every pair of layouts."""
    slim = slim_copy(module)
    values = make_input(shape, torch.float32, "contiguous", (-3.0, 0.0, 0.1, 0.5, 3.0, 6.0))
    for x_layout in X_LAYOUTS:
        x = laid_out(values, x_layout)
        for g_layout in GRAD_LAYOUTS:
            grad = laid_out(make_input(shape, torch.float32, "contiguous", seed=3), g_layout)
            ys, dxs = input_grad_as_returned(module, x, grad)
            ym, dxm = input_grad_as_returned(slim, x, grad)
            what = f"x {x_layout}, grad {g_layout}"
            assert dxm.stride() == dxs.stride(), what
            assert ym.stride() == ys.stride(), what
            assert_grad(dxm, dxs, x, type(module).__name__, what)


def test_layout_replays_tensor_iterator():
    """_layout.binary_strides gives the strides aten's element-wise backward kernels give, on random
    layouts (permuted, sliced, expanded, size-1 dimensions), and conform copies only when it must."""
    rng = torch.Generator().manual_seed(0)

    def pick(n):
        return int(torch.randint(n, (), generator=rng))

    def random_layout(shape):
        kind = pick(4)
        if kind == 0:
            return torch.zeros(()).expand(shape)
        perm = torch.randperm(len(shape), generator=rng).tolist()
        t = torch.zeros([shape[d] for d in perm]).permute([perm.index(d) for d in range(len(shape))])
        if kind == 1:
            d = pick(len(shape))
            wide = torch.zeros(*(2 * s if i == d else s for i, s in enumerate(shape)))
            t = wide.narrow(d, 0, shape[d])
        return t

    for _ in range(300):
        shape = [(1, 2, 3)[pick(3)] for _ in range(1 + pick(4))]
        g, x = random_layout(shape), random_layout(shape)
        first_grad = torch.ops.aten.hardtanh_backward(g, x, -1.0, 1.0).stride()
        first_x = torch.ops.aten.threshold_backward(g, x, 0.0).stride()
        case = (shape, g.stride(), x.stride())
        assert _layout.binary_strides(tuple(shape), g.stride(), x.stride()) == first_grad, case
        assert _layout.binary_strides(tuple(shape), x.stride(), g.stride()) == first_x, case
        assert _layout.like_strides(x) == torch.empty_like(x).stride()

    t = torch.randn(2, 3, 1, 4)
    assert _layout.conform(t, t.stride()) is t
    view = _layout.conform(t, (12, 4, 99, 1))  # only the size-1 dimension's stride differs: a view
    assert view.stride() == (12, 4, 99, 1) and view.data_ptr() == t.data_ptr() and torch.equal(view, t)
    copy = _layout.conform(t, (12, 1, 12, 3))
    assert copy.stride() == (12, 1, 12, 3) and torch.equal(copy, t)


def test_convert_swaps_the_modules():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU6(), nn.Hardtanh(), nn.Threshold(0.0, 0.0), nn.Hardsigmoid(),
                          nn.Hardswish())
    slim = slimgrad.convert(model)
    assert [type(m).__module__ for m in slim[1:5]] == ["slimgrad.nn.clamp"] * 4
    assert type(slim[5]) is nn.Hardswish  # its gradient reads x: nothing to gain, left as stock
    for m in slim[1:5]:
        assert isinstance(m, type(model[list(slim).index(m)]))


class KeepInput(torch.autograd.Function):
    """A consumer that keeps its input for backward, as a trainable conv does."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        note_input_kept(x)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum()


@pytest.mark.parametrize("module", [nn.ReLU6(), nn.ReLU6(inplace=True), nn.Hardtanh(), nn.Threshold(0.5, 0.5),
                                    nn.Threshold(0.5, 3.0), nn.Hardsigmoid()], ids=repr)
def test_producer_keeps_output_when_consumer_keeps_it(module):
    slim = slim_copy(module)
    w_stock, w_slim = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.tensor(1.5))
    shape = (4, 10)  # 40 elements: a 5-byte mask
    base = make_input(shape, torch.float32, "contiguous", (-3.0, 0.5, 1.0, 3.0, 6.0))
    grad = make_input(shape, torch.float32, "contiguous", seed=4)

    def step(mod, w):
        x = base.clone().requires_grad_()
        with SavedTensors() as counter:
            y = KeepInput.apply(mod(x * 1.0), w)
        y.backward(grad)
        return y, x.grad, counter.bytes

    ys, gs, _ = step(module, w_stock)
    act = math.prod(shape) * 4
    first = step(slim, w_slim)
    assert first[2] == act + 5
    second = step(slim, w_slim)
    # The output stands in for the input where stock's backward on it gives the same answer: hardtanh,
    # and threshold with value <= threshold. Then nothing extra is kept; otherwise the mask.
    stands_in = not isinstance(module, nn.Hardsigmoid) and not (
        isinstance(module, nn.Threshold) and module.value > module.threshold)
    assert second[2] == act + (0 if stands_in else 5)
    for y, g, _ in (first, second):
        assert_bitwise(y, ys, "output")
        assert_grad(g, gs, base, type(module).__name__)


@pytest.mark.parametrize("kind,lo,hi,value", [("hardtanh", -1.0, 1.0, None), ("threshold", 0.2, None, -1.0),
                                              ("hardsigmoid", -3.0, 3.0, None)])
@pytest.mark.parametrize("kept", [False, True], ids=["mask", "output"])
def test_double_backward(kind, lo, hi, value, kept):
    if kind == "hardsigmoid":
        if kept:
            pytest.skip("hardsigmoid always keeps its mask")
        # stock has no double backward for hardsigmoid; ours fails the same way, with stock's error
        for fn in (F.hardsigmoid, C.hardsigmoid):
            x = torch.randn(5, dtype=torch.float64, requires_grad=True)
            with pytest.raises(RuntimeError, match="derivative for aten::hardsigmoid_backward is not implemented"):
                torch.autograd.gradgradcheck(fn, (x,))
        return
    x = torch.randn(3, 4, dtype=torch.float64) * 3
    x = x[(x - lo).abs() > 0.1]
    if hi is not None:
        x = x[(x - hi).abs() > 0.1]
    x.requires_grad_()
    torch.autograd.gradgradcheck(
        lambda t: C.RangeMaskFunction.apply(t, kind, lo, hi, value, False, kept, None, False)[0], (x,))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("module", [nn.ReLU6(), nn.Hardsigmoid()], ids=repr)
def test_checkpoint(module, reentrant):
    lin = nn.Linear(6, 6)
    x = (torch.randn(5, 6) * 4).requires_grad_()
    nn.Sequential(lin, module)(x).sum().backward()
    expected = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    checkpoint(nn.Sequential(lin, slim_copy(module)), x, use_reentrant=reentrant).sum().backward()
    assert_same(x.grad, expected[0], what="input grad")
    assert_same(lin.weight.grad, expected[1], what="weight grad")


def test_autocast_runs_in_input_dtype():
    lin = nn.Linear(5, 5)
    x = torch.randn(4, 5) * 4
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, ym = F.relu6(lin(xs)), C.relu6(lin(xm))
        hs, hm = F.hardsigmoid(lin(xs)), C.hardsigmoid(lin(xm))
    assert_same(ym, ys, what="relu6 output")
    assert_same(hm, hs, what="hardsigmoid output")
    (ys.sum() + hs.sum()).backward()
    (ym.sum() + hm.sum()).backward()
    assert_same(xm.grad, xs.grad, what="grad")


def test_enabled_routes_every_entry_point():
    x = make_input((4, 8), torch.float32, "contiguous", (0.0, 6.0))
    calls = [("relu6", lambda t: F.relu6(t)), ("relu6", lambda t: F.relu6(t * 1.0, inplace=True)),
             ("hardtanh", lambda t: F.hardtanh(t, -2.0, 2.0)), ("hardtanh", lambda t: F.hardtanh_(t * 1.0, -2.0, 2.0)),
             ("threshold", lambda t: F.threshold(t, 0.1, 5.0)), ("threshold", lambda t: torch.threshold(t, 0.1, 5.0)),
             ("threshold", lambda t: F.threshold_(t * 1.0, 0.1, 5.0)), ("hardsigmoid", lambda t: F.hardsigmoid(t))]
    for case, call in calls:
        xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys = call(xs)
        ys.backward(torch.ones_like(ys))
        with SavedTensors() as counter, slimgrad.enabled():
            ym = call(xm)
        ym.backward(torch.ones_like(ym))
        assert_bitwise(ym, ys, "output")
        assert_grad(xm.grad, xs.grad, x, case)
        assert counter.bytes == 4  # 32 elements, one bit each


@pytest.mark.slow
@pytest.mark.parametrize("module", [nn.ReLU6(), nn.Hardsigmoid()], ids=repr)
def test_compile_fullgraph(module):
    torch._dynamo.reset()
    slim = torch.compile(slim_copy(module), fullgraph=True)
    base = make_input((2, 3, 4, 5), torch.float32, "contiguous", (-3.0, 0.0, 3.0, 6.0))
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input((2, 3, 4, 5), torch.float32, "contiguous", seed=5)
    ys = module(xs)
    ys.backward(grad)
    with SavedTensors() as counter:
        ym = slim(xm)
    ym.backward(grad)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="grad")
    assert counter.bytes == (2 * 3 * 4 * 5 + 7) // 8


@pytest.mark.slow
def test_compiled_autograd_after_eager_forward():
    """Compiled autograd traces the eager forward's backward, layout matching included (computed without
    the cache dynamo would warn about): stock's gradient, no warning."""
    import warnings

    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    stock = nn.Sequential(nn.Hardsigmoid(), nn.ReLU6(), nn.Hardtanh(-0.5, 0.5))
    slim = nn.Sequential(*(slim_copy(m) for m in stock))
    base = make_input((2, 3, 4, 5), torch.float32, "channels_last", (-3.0, 0.0, 3.0, 6.0))
    grad = make_input((2, 3, 4, 5), torch.float32, "contiguous", seed=5)
    grads = []
    for model in (stock, slim):
        x = base.clone().requires_grad_()
        y = model(x * 2.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with compiled_autograd._enable(torch.compile(backend="eager")):
                y.backward(grad)
        assert not [w for w in caught if "lru_cache" in str(w.message)]
        grads.append(x.grad)
    assert_grad(grads[1], grads[0], base, "Hardsigmoid")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("rule,lo,hi", [("inside", 0.0, 6.0), ("inside", -0.1, 0.1), ("above", 0.1, None),
                                        ("above", -float("inf"), None)])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1001])
def test_range_mask_backends_agree(dtype, rule, lo, hi, numel):
    """Every registered backend of the range_mask family against the reference, masks and selections."""
    from slimgrad.kernels import range_mask, registry

    x = make_input((numel,), dtype, "contiguous", (lo,) + ((hi,) if hi is not None else ()))
    grad = make_input((numel,), dtype, "contiguous", seed=9)
    if hi is not None:  # bounds as the Function hands them over: exact in the comparison dtype
        lo, hi = C._bounds("hardtanh", lo, hi, dtype)
    else:
        lo, _ = C._bounds("threshold", lo, None, dtype)
    ref_packed = range_mask.TORCH_IMPL.pack(x, rule, lo, hi)
    ref_sel = range_mask.TORCH_IMPL.select(grad, ref_packed)
    backends = [k for k in registry.implementations(range_mask.FAMILY) if k.supports("cpu", dtype) and k.available]
    from slimgrad import csrc

    assert {k.backend for k in backends} >= {"torch"} | ({"core"} if csrc.core() is not None else set())
    for k in backends:
        impl = k.implementation()
        assert torch.equal(impl.pack(x, rule, lo, hi), ref_packed), k.backend
        assert torch.equal(bits(impl.select(grad, ref_packed)), bits(ref_sel)), k.backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hardtanh_inplace_takes_min_above_max_as_stock(dtype):
    """Stock's ``F.hardtanh_`` builtin takes ``min_val > max_val`` (every element becomes max_val, no gradient passes);
    only ``F.hardtanh`` refuses it. slimgrad's raised, which broke such code inside ``slimgrad.enabled()`` (found by
    this stop's mode sweep)."""
    from slimgrad import functional as SF

    x0 = torch.randn(4, 37, dtype=dtype, generator=torch.Generator().manual_seed(0))
    results = []
    for fn in (F.hardtanh_, SF.hardtanh_):
        x = x0.clone().requires_grad_()
        y = fn(x * 1, 2.0, -1.0)
        y.sum().backward()
        results.append((y.detach(), x.grad))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        SF.hardtanh(x0, 2.0, -1.0)  # as F.hardtanh
