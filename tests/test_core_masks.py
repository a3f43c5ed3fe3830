"""The compiled core's mask activations (csrc/relu_mask.cpp, csrc/range_mask.cpp) against the Python path and stock.

For ReLU / LeakyReLU and the clamp family (ReLU6, Hardtanh, Threshold, Hardsigmoid): outputs and input gradients
bitwise equal to the Python path (``csrc.disabled()``) and to stock PyTorch, with the same strides; the same saved
bytes as the Python path; every float dtype, contiguous / channels_last / transposed / sliced inputs, in place,
NaN / ±inf / ±0 values, sizes that are not a multiple of 8; double backward as the Python path; saved-tensor hooks
see the mask; the producer/consumer rule (the output kept instead of a mask once a consumer keeps it). Each test
asserts that the core's Function actually ran.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
import slimgrad.nn.activation  # noqa: F401  (registers the replacements)
import slimgrad.nn.clamp  # noqa: F401
from _util import FLOAT_DTYPES, slim_copy
from slimgrad import csrc
from slimgrad.functional import activation as A
from slimgrad.functional import clamp as C
from slimgrad.kernels import range_mask, registry, relu_mask
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.skipif(csrc.core() is None,
                                reason=f"the compiled core is unavailable here: {csrc.status()['reason']}")

SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0, 6.0, 1.0, -1.0]
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(actual, expected, what, strides=True):
    """Bit patterns equal (+0 and -0 differ), NaN where expected has NaN (payloads not compared: stock's own
    16-bit kernels give different NaN bits on their vectorised and scalar paths), and the same strides."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if strides:
        assert actual.stride() == expected.stride(), f"{what}: strides {actual.stride()} != {expected.stride()}"
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan]), f"{what}: bits differ"


def make_input(shape, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    x = (torch.randn(numel, generator=gen, dtype=torch.float64) * 3).to(dtype)
    k = min(numel, len(SPECIALS))
    x[:k] = torch.tensor(SPECIALS[:k], dtype=dtype)
    x = x[torch.randperm(numel, generator=gen)].reshape(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3).contiguous().transpose(1, 3)
    return x


def graph_names(t):
    """The names of every node in t's backward graph."""
    names, todo, seen = [], [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        todo.extend(n for n, _ in node.next_functions)
    return names


def ran_core(t, function):
    return any("CppNode" in n and function in n for n in graph_names(t))


@contextlib.contextmanager
def spy_core():
    """Records the calls into the core's Functions (relu_mask_apply, range_mask_apply) made inside the block."""
    core, calls, saved = csrc.core(), [], {}
    for name in ("relu_mask_apply", "range_mask_apply"):
        saved[name] = fn = getattr(core, name)

        def spy(*args, _fn=fn, _name=name):
            out = _fn(*args)
            calls.append((_name, out is not None))
            return out

        setattr(core, name, spy)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(core, name, fn)


def run(fn, base, inplace, grad, sliced):
    """fn on a non-leaf copy of ``base`` (sliced: every other element of the last dim); returns the output, the
    gradient reaching the tensor fn's input came from (as the op's backward returned it), the saved bytes and
    whether the core ran."""
    leaf = base.clone().requires_grad_()
    h = leaf * 1.0
    with SavedTensors() as counter:
        src = h.clone() if inplace else h
        inp = src[..., ::2] if sliced else src
        out = fn(inp, inplace)
    names = graph_names(out)
    (g,) = torch.autograd.grad(out, h, grad)
    return out.detach(), g, counter.bytes, names


RELU_CASES = {
    "relu": (lambda x, ip: F.relu(x, inplace=ip), lambda x, ip: A.relu(x, inplace=ip)),
    "leaky(0.01)": (lambda x, ip: F.leaky_relu(x, 0.01, ip), lambda x, ip: A.leaky_relu(x, 0.01, ip)),
    "leaky(0)": (lambda x, ip: F.leaky_relu(x, 0.0, ip), lambda x, ip: A.leaky_relu(x, 0.0, ip)),
    "leaky(2)": (lambda x, ip: F.leaky_relu(x, 2.0, ip), lambda x, ip: A.leaky_relu(x, 2.0, ip)),
    "leaky(-0.3)": (lambda x, ip: F.leaky_relu(x, -0.3, ip), lambda x, ip: A.leaky_relu(x, -0.3, ip)),
}
CLAMP_CASES = {
    "relu6": (lambda x, ip: F.relu6(x, inplace=ip), lambda x, ip: C.relu6(x, inplace=ip)),
    "hardtanh": (lambda x, ip: F.hardtanh(x, inplace=ip), lambda x, ip: C.hardtanh(x, inplace=ip)),
    "hardtanh(-0.5,2.5)": (lambda x, ip: F.hardtanh(x, -0.5, 2.5, ip), lambda x, ip: C.hardtanh(x, -0.5, 2.5, ip)),
    "hardtanh(1,1)": (lambda x, ip: F.hardtanh(x, 1.0, 1.0, ip), lambda x, ip: C.hardtanh(x, 1.0, 1.0, ip)),
    "hardtanh(-0.1,0.1)": (lambda x, ip: F.hardtanh(x, -0.1, 0.1, ip), lambda x, ip: C.hardtanh(x, -0.1, 0.1, ip)),
    "threshold(0.5,2)": (lambda x, ip: F.threshold(x, 0.5, 2.0, ip), lambda x, ip: C.threshold(x, 0.5, 2.0, ip)),
    "threshold(0.1,-1)": (lambda x, ip: F.threshold(x, 0.1, -1.0, ip), lambda x, ip: C.threshold(x, 0.1, -1.0, ip)),
    "hardsigmoid": (lambda x, ip: F.hardsigmoid(x, inplace=ip), lambda x, ip: C.hardsigmoid(x, inplace=ip)),
}
FUNCTION = {**{k: "ReluMaskFunction" for k in RELU_CASES}, **{k: "RangeMaskFunction" for k in CLAMP_CASES}}


def _check(case, dtype, layout, inplace, shape=(2, 3, 5, 7)):
    stock, slim = {**RELU_CASES, **CLAMP_CASES}[case]
    sliced = layout == "sliced"
    base = make_input(shape, dtype, "contiguous" if sliced else layout)
    out_shape = (*shape[:-1], (shape[-1] + 1) // 2) if sliced else shape
    grad = make_input(out_shape, dtype, "contiguous", seed=1)
    ys, gs, _, _ = run(stock, base, inplace, grad, sliced)
    with csrc.disabled():
        yp, gp, bytes_python, names_python = run(slim, base, inplace, grad, sliced)
    with spy_core() as calls:
        yc, gc, bytes_core, names_core = run(slim, base, inplace, grad, sliced)
    assert len(calls) == 1
    if not (sliced and inplace):  # in place on a view, the node sits inside autograd's CopySlices
        assert any(FUNCTION[case] in n and "CppNode" in n for n in names_core), names_core
    assert not any("CppNode" in n for n in names_python), names_python
    assert_bitwise(yc, yp, "output vs Python path")
    assert_bitwise(gc, gp, "grad vs Python path")
    assert_bitwise(yc, ys, "output vs stock")
    if case.startswith(("relu6", "hardtanh")):
        # stock's NaN rule in hardtanh_backward depends on the element's position (see functional/clamp.py)
        nan_in = torch.zeros(shape, dtype=torch.bool)
        if sliced:
            nan_in[..., ::2] = torch.isnan(base[..., ::2])
        else:
            nan_in = torch.isnan(base)
        gs, gc = gs.masked_fill(nan_in, 0), gc.masked_fill(nan_in, 0)
    assert_bitwise(gc, gs, "grad vs stock")
    assert bytes_core == bytes_python == (math.prod(out_shape) + 7) // 8


@pytest.mark.parametrize("case", list(RELU_CASES) + list(CLAMP_CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_core_matches_python_path_and_stock(case, dtype, layout, inplace):
    if inplace and case == "leaky(-0.3)":
        pytest.skip("stock refuses it in backward; the Python Function runs it (tested in test_activation)")
    _check(case, dtype, layout, inplace)


@pytest.mark.parametrize("case", ["relu", "leaky(0.01)", "relu6", "threshold(0.5,2)", "hardsigmoid"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 1, 1, 7), (1, 1, 1, 9), (1, 1, 3, 17), (3, 5, 7, 331)])
def test_odd_sizes(case, dtype, shape):
    """Vector bodies, scalar tails and the last partial mask byte; (3, 5, 7, 331) spans several parallel
    chunks at two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(case, dtype, "contiguous", False, shape)
    finally:
        torch.set_num_threads(threads)


aten_route = relu_mask.aten_route_on_cpu


@pytest.mark.parametrize("case", list(RELU_CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_aten_route_matches_python_path_and_stock(case, dtype, layout, inplace):
    """ReLU / LeakyReLU's aten route (relu_mask.cpp: the kernels the core launches for CUDA tensors) gives the
    bits, strides and saved bytes of the Python path and stock, special values included."""
    if inplace and case == "leaky(-0.3)":
        pytest.skip("stock refuses it in backward; the Python Function runs it (tested in test_activation)")
    with aten_route():
        _check(case, dtype, layout, inplace)


@pytest.mark.parametrize("case", ["relu", "leaky(0.01)"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 1, 1, 7), (1, 1, 1, 9), (1, 1, 3, 17), (3, 5, 7, 331)])
def test_aten_route_odd_sizes(case, shape):
    """The last partial mask byte of the aten route (its padding bits packed as zeros, never read)."""
    with aten_route():
        _check(case, torch.float32, "contiguous", False, shape)


def test_aten_route_double_backward_and_module():
    """Double backward through the aten route's mask, and the module path (nn.ReLU, inplace) with it."""
    x0 = torch.randn(3, 4, 5, dtype=torch.float64) * 4
    g0 = torch.randn_like(x0)
    results = []
    for route in (aten_route, contextlib.nullcontext):
        x, g = x0.clone().requires_grad_(), g0.clone().requires_grad_()
        with route():
            y = A.leaky_relu(x, 0.1)
            assert ran_core(y, "ReluMaskFunction")
            (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
            (gg,) = torch.autograd.grad((gx * gx).sum(), g)
        results.append((gx.detach(), gg))
    for a, b in zip(*results, strict=True):
        assert_bitwise(a, b, "aten route vs kernels")
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True)).requires_grad_(False)
    slim = slimgrad.convert(stock)
    xi = torch.randn(2, 3, 8, 8)
    want_x = xi.clone().requires_grad_()
    stock(want_x).sum().backward()
    got_x = xi.clone().requires_grad_()
    with aten_route():
        out = slim(got_x)
        assert ran_core(out, "ReluMaskFunction")
        out.sum().backward()
    assert_bitwise(got_x.grad, want_x.grad, "input grad through conv + inplace ReLU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", [nn.ReLU6(), nn.Hardtanh(-1.0, 1.0), nn.ReLU6(inplace=True)], ids=repr)
def test_output_kept_step_peak_not_above_stock(act, dtype):
    """A clamp whose consumer keeps its output (a trainable conv after it) tests the output in backward. The core
    compared a float copy of it and multiplied the gradient's bits by the bool mask (a full-size integer copy on
    CPU): its step peaked up to 3 bytes an element above stock's. Now the Python path's ops: at or below stock's,
    equal to the Python path's, every gradient bitwise stock's."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(8, 16, 1).requires_grad_(False), act, nn.Conv2d(16, 8, 1)).to(dtype)
    slim = slimgrad.convert(stock)
    x = torch.randn(4, 8, 32, 32, dtype=dtype)

    def step(m):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        m(xi).float().sum().backward()
        return xi.grad

    for _ in range(2):  # the clamp learns that its consumer keeps the output
        step(slim)
    assert slim[1].__dict__.get("_slimgrad_output_kept"), "the output-kept mode did not engage"
    assert_bitwise(step(slim), step(stock), "input grad", strides=False)
    assert_bitwise(slim[2].weight.grad, stock[2].weight.grad, "consumer weight grad")
    peak_stock = slimgrad.peak_bytes(lambda: step(stock))
    peak_core = slimgrad.peak_bytes(lambda: step(slim))
    with csrc.disabled():
        peak_python = slimgrad.peak_bytes(lambda: step(slim))
    assert peak_core == peak_python, (peak_core, peak_python)
    assert peak_core <= peak_stock, (peak_core, peak_stock)
    # last: a forward with grad whose graph never runs backward counts as a call whose output was not kept (the
    # out-of-place clamps keep their output only when every call's was kept; README Limits), so the next step would
    # keep the mask
    out = slim[1](slim[0](x.clone().requires_grad_()))
    assert ran_core(out, "RangeMaskFunction")


def test_inplace_leaky_negative_slope_runs_python_function():
    x = torch.randn(4, 5, requires_grad=True)
    y = A.leaky_relu(x * 1.0, -0.3, inplace=True)
    assert not ran_core(y, "ReluMaskFunction")
    with pytest.raises(RuntimeError, match="negative slope"):
        y.sum().backward()


@pytest.mark.parametrize("case", ["relu", "leaky(0.01)", "relu6", "threshold(0.5,2)", "hardsigmoid"])
def test_no_gradient_is_stock(case):
    stock, slim = {**RELU_CASES, **CLAMP_CASES}[case]
    x = make_input((3, 9), torch.float32, "contiguous")
    for requires_grad, grad_enabled in ((False, True), (True, False), (False, False)):
        with torch.set_grad_enabled(grad_enabled), SavedTensors() as counter:
            y = slim(x.clone().requires_grad_(requires_grad), False)
        assert y.grad_fn is None and counter.bytes == 0
        assert_bitwise(y, stock(x.clone(), False), "output")


@pytest.mark.parametrize("case", ["relu", "leaky(0.1)", "leaky(-0.4)", "relu6", "hardtanh(-0.5,2.5)",
                                  "threshold(0.5,2)", "hardsigmoid"])
def test_double_backward_as_python_path(case):
    fns = {**RELU_CASES, **CLAMP_CASES,
           "leaky(0.1)": (None, lambda x, ip: A.leaky_relu(x, 0.1, ip)),
           "leaky(-0.4)": (None, lambda x, ip: A.leaky_relu(x, -0.4, ip))}
    slim = fns[case][1]
    x0 = torch.randn(3, 4, 5, dtype=torch.float64) * 4
    x0 = x0 + x0.sign() * 0.1  # away from the kinks
    g0 = torch.randn_like(x0)

    def second(core):
        x = x0.clone().requires_grad_()
        g = g0.clone().requires_grad_()
        with (csrc.disabled() if not core else _null()):
            y = slim(x, False)
            assert ran_core(y, FUNCTION.get(case, "ReluMaskFunction")) == core
            (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
            (gg,) = torch.autograd.grad((gx * gx).sum(), g)
        return gx.detach(), gg

    if case == "hardsigmoid":  # stock's hardsigmoid_backward has no derivative: both paths say so
        for core in (True, False):
            with pytest.raises(RuntimeError, match="derivative for aten::hardsigmoid_backward is not implemented"):
                second(core)
        return
    (gx_c, gg_c), (gx_p, gg_p) = second(True), second(False)
    assert_bitwise(gx_c, gx_p, "first gradient")
    assert_bitwise(gg_c, gg_p, "gradient of the gradient")
    torch.autograd.gradgradcheck(lambda t: slim(t, False), (x0.clone().requires_grad_(),))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("module", [nn.ReLU(), nn.LeakyReLU(0.1), nn.ReLU6(), nn.Threshold(0.5, -1.0),
                                    nn.Hardsigmoid()], ids=repr)
def test_saved_tensor_hooks_see_the_mask(module):
    slim = slim_copy(module)
    x = torch.randn(4, 3, 5, requires_grad=True)
    packed = []

    def pack_hook(t):
        packed.append((t.dtype, t.numel()))
        return t.clone()  # backward must read what the hook hands back

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        y = slim(x * 1.0)
    assert ran_core(y, "Mask")
    assert packed == [(torch.uint8, (60 + 7) // 8)]
    y.backward(torch.ones_like(y))
    xs = x.detach().clone().requires_grad_()
    module(xs * 1.0).backward(torch.ones_like(y))
    assert_bitwise(x.grad, xs.grad, "grad")


def _net(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act, nn.Conv2d(8, 4, 3, padding=1))


@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1), nn.ReLU6(),
                                 nn.Hardtanh(-2.0, 2.0)], ids=repr)
def test_producer_keeps_output_before_trainable_conv(act):
    """A trainable conv keeps its input: after one step the activation keeps its output (shared with the conv)
    instead of a mask, as on the Python path, with stock's gradients on every step."""
    stock = _net(act)
    slim = slimgrad.convert(_net(act))
    x = torch.randn(2, 3, 6, 6)

    def step(model, core=True):
        model.zero_grad()
        with (csrc.disabled() if not core else _null()), SavedTensors() as counter:
            y = model(x.clone().requires_grad_())
        y.sum().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()], counter.bytes

    ref = step(stock)
    runs = [step(slim) for _ in range(3)]
    python_model = slimgrad.convert(_net(act))
    python = [step(python_model, core=False) for _ in range(3)]
    for (y, grads, _), (yp, gp, _) in zip(runs, python):
        assert_bitwise(y, ref[0], "output", strides=False)
        assert_bitwise(y, yp, "output vs Python path", strides=False)
        for g, gr, gq in zip(grads, ref[1], gp):
            assert_bitwise(g, gr, "parameter grad", strides=False)
            assert_bitwise(g, gq, "parameter grad vs Python path", strides=False)
    mask = (2 * 8 * 6 * 6 + 7) // 8
    assert [r[2] for r in runs] == [p[2] for p in python]
    assert runs[0][2] - runs[1][2] == mask  # the first step keeps the mask, then the shared output
    assert runs[1][2] == runs[2][2]


def test_functional_form_runs_core_and_keeps_mask():
    x = torch.randn(16, requires_grad=True)
    for fn in (A.relu, lambda t: A.leaky_relu(t, 0.2), C.relu6, lambda t: C.threshold(t, 0.1, 0.0), C.hardsigmoid):
        with SavedTensors() as counter:
            y = fn(x * 1.0)
        assert ran_core(y, "MaskFunction") and counter.bytes == 2


@pytest.mark.parametrize("family", ["relu_mask", "range_mask"])
def test_registry_core_kernels_serve_the_python_function(family):
    """The core's raw kernels are the registry's choice (priority 20, above numba) and follow the contract."""
    x = make_input((5, 13), torch.float32, "contiguous")
    impl = registry.choose(family, x)
    assert impl.name == "core"
    with csrc.disabled():
        assert registry.choose(family, x).name != "core"
    for dtype in FLOAT_DTYPES:
        xd = make_input((5, 13), dtype, "contiguous")
        g = make_input((5, 13), dtype, "contiguous", seed=3)
        if family == "relu_mask":
            for slope in (None, 0.01, -0.5):
                out, packed = impl.forward(xd, slope, False)
                ref_out, ref_packed = relu_mask.TORCH_IMPL.forward(xd, slope, False)
                assert_bitwise(out, ref_out, "forward")
                assert torch.equal(packed, ref_packed)
                assert_bitwise(impl.backward(g, packed, slope), relu_mask.TORCH_IMPL.backward(g, packed, slope),
                               "backward")
        else:
            for rule, lo, hi in (("inside", -1.0, 1.0), ("inside", 0.0, 6.0), ("above", 0.5, None)):
                packed = impl.pack(xd, rule, lo, hi)
                assert torch.equal(packed, range_mask.TORCH_IMPL.pack(xd, rule, lo, hi))
                assert_bitwise(impl.select(g, packed), range_mask.TORCH_IMPL.select(g, packed), "select")


@pytest.mark.parametrize("bounds", [(0.0, 6.0), (-1.0, 1.0), (-0.0, 2.0), (-3.0, -0.0), (-0.5, 2.5), (1.0, 1.0)])
@pytest.mark.parametrize("values", ["finite", "signed zeros", "nan"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_hardtanh_fp32_one_pass(bounds, values, layout):
    """fp32 hardtanh/relu6 make the output in the mask's pass; where stock's vectorised and scalar paths may
    disagree (NaN, a zero of the other sign than a zero bound) stock's own op finishes the output. Values on and
    next to the bounds, sizes spanning parallel chunks at two threads."""
    lo, hi = bounds
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8, 37, 41, generator=gen) * 4
    flat = x.view(-1)
    edges = torch.tensor([lo, hi], dtype=torch.float32)
    for e in edges:
        idx = torch.randint(0, flat.numel(), (300,), generator=gen)
        flat[idx[:100]] = e
        flat[idx[100:200]] = torch.nextafter(e, e - 1)
        flat[idx[200:]] = torch.nextafter(e, e + 1)
    if values != "finite":
        idx = torch.randint(0, flat.numel(), (50,), generator=gen)
        flat[idx[:25]] = 0.0
        flat[idx[25:]] = -0.0 if values == "signed zeros" else float("nan")
    x = laid(x, layout)
    grad = torch.randn(x.shape, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for inplace in (False, True):
            ys, gs, _, _ = run(lambda t, ip: F.hardtanh(t, lo, hi, ip), x, inplace, grad, False)
            with spy_core() as calls:
                yc, gc, kept, _ = run(lambda t, ip: C.hardtanh(t, lo, hi, ip), x, inplace, grad, False)
            assert calls == [("range_mask_apply", True)] and kept == (x.numel() + 7) // 8
            assert_bitwise(yc, ys, f"output, in place {inplace}")
            nan_in = torch.isnan(x)
            assert_bitwise(gc.masked_fill(nan_in, 0), gs.masked_fill(nan_in, 0), f"grad, in place {inplace}")
    finally:
        torch.set_num_threads(threads)


def laid(x, layout):
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("values", ["finite", "nan"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_hardsigmoid_one_pass(dtype, values, layout):
    """hardsigmoid makes output and mask in one pass and its gradient (factor and mask) in one pass; NaN inputs
    and 16-bit NaN gradients are finished by stock's own kernels (position-dependent NaN bits there)."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(4, 8, 37, 41, generator=gen, dtype=torch.float64) * 4).to(dtype)
    grad = (torch.randn(x.shape, generator=gen, dtype=torch.float64) * 10).to(dtype)
    flat = x.view(-1)
    for e in torch.tensor([-3.0, 3.0], dtype=dtype):
        idx = torch.randint(0, flat.numel(), (300,), generator=gen)
        flat[idx[:100]] = e
        flat[idx[100:200]] = torch.nextafter(e, e - 1)
        flat[idx[200:]] = torch.nextafter(e, e + 1)
    if values == "nan":
        flat[torch.randint(0, flat.numel(), (40,), generator=gen)] = float("nan")
        grad.view(-1)[torch.randint(0, flat.numel(), (40,), generator=gen)] = float("nan")
    x = laid(x, layout)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for inplace in (False, True):
            ys, gs, _, _ = run(lambda t, ip: F.hardsigmoid(t, ip), x, inplace, grad, False)
            with csrc.disabled():
                yp, gp, _, _ = run(lambda t, ip: C.hardsigmoid(t, ip), x, inplace, grad, False)
            with spy_core() as calls:
                yc, gc, kept, _ = run(lambda t, ip: C.hardsigmoid(t, ip), x, inplace, grad, False)
            assert calls == [("range_mask_apply", True)] and kept == (x.numel() + 7) // 8
            for y, g, what in ((ys, gs, "stock"), (yp, gp, "Python path")):
                assert_bitwise(yc, y, f"output vs {what}, in place {inplace}")
                assert_bitwise(gc, g, f"grad vs {what}, in place {inplace}")
    finally:
        torch.set_num_threads(threads)
