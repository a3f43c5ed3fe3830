"""The gated activations' compiled-core path (csrc/gated.cpp) against the Python path (``csrc.disabled()``) and the
stock expression ``act(gate) * up``, on independent copies: for every activation, float dtype, requires_grad
combination and input layout, the output and both gradients bitwise (bit patterns and strides), saved bytes equal to
the Python path's, and the core's Function actually ran (its grad_fn), the Python path's where it must not (autocast,
torch.func, a TorchFunctionMode, tensor subclasses, dtypes it does not take). Also double backward's refusal, the
producer notes, and bad arguments reaching the Python path's errors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tests._util import FLOAT_DTYPES, grad_combos
from tests.test_gated import reference  # the stock formulas, written out independently of slimgrad

from slimgrad import csrc
from slimgrad.functional import _common
from slimgrad.functional.gated import ACTIVATIONS, gated_activation
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.skipif(csrc.core() is None,
                                reason=f"the compiled core is unavailable here: {csrc.status()['reason']}")

CORE_NODE = "GatedFn"
PY_NODE = "GatedFunctionBackward"
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise(actual, expected, what):
    """Both None, or the same dtype, shape, strides and bit patterns (+0 and -0 differ; NaN where expected has NaN,
    payloads not compared)."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: one is None"
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    assert actual.stride() == expected.stride(), f"{what}: strides {actual.stride()} vs {expected.stride()}"
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    a = actual.detach().contiguous().view(_INT_OF_SIZE[actual.element_size()])
    e = expected.detach().contiguous().view(_INT_OF_SIZE[expected.element_size()])
    assert torch.equal(a[~nan], e[~nan]), (
        f"{what}: bits differ (max abs diff {(actual.double() - expected.double()).abs().nan_to_num().max()})")


def _layout(t, layout):
    if layout == "transposed":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":  # a view with a gap between rows (storage bigger than the tensor)
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        wide[..., 1:1 + t.shape[-1]] = t
        return wide[..., 1:1 + t.shape[-1]]
    if layout == "expanded":  # stride 0 along the first dim (one row's storage)
        return t[:1].clone().expand(t.shape)
    return t.clone()


def make(shape, dtype, seed=0):
    """gate (wide range, with ±0 and a saturating value), up, and the upstream gradient, in float64 then cast."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=gen, dtype=torch.float64) * 4
    k = min(3, gate.numel())
    gate.view(-1)[:k] = torch.tensor([0.0, -0.0, 30.0], dtype=torch.float64)[:k]
    up = torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    return gate.to(dtype), up.to(dtype), dy.to(dtype)


def node_name(y):
    return "" if y.grad_fn is None else y.grad_fn.name()


def step(fn, gate0, up0, dy, rg, mode, layouts=("contiguous", "contiguous"), grad_layout="contiguous"):
    """One forward + backward on fresh copies: (output, dGate, dUp, saved bytes, grad_fn name).

    ``mode``: "core" (the core on), "python" (csrc.disabled()), or "stock" (``fn`` is the stock expression)."""
    gate = _layout(gate0, layouts[0]).requires_grad_(rg[0])
    up = _layout(up0, layouts[1]).requires_grad_(rg[1])
    ctx = csrc.disabled if mode == "python" else contextlib.nullcontext
    with ctx(), SavedTensors() as kept:
        y = fn(gate, up)
    if y.requires_grad:
        g = dy
        if grad_layout == "transposed":
            g = dy.transpose(0, 1).contiguous().transpose(0, 1)
        elif grad_layout == "expanded":
            g = dy[:1].expand(dy.shape)
        with ctx():
            y.backward(g)
    return y.detach(), gate.grad, up.grad, kept.bytes, node_name(y)


def check(kind, dtype, rg, shape=(3, 5, 12), layouts=("contiguous", "contiguous"), grad_layout="contiguous"):
    gate0, up0, dy = make(shape, dtype)

    def slim(g, u):
        return gated_activation(g, u, kind)

    def stock(g, u):
        return reference(kind, g) * u

    core = step(slim, gate0, up0, dy, rg, "core", layouts, grad_layout)
    python = step(slim, gate0, up0, dy, rg, "python", layouts, grad_layout)
    ref = step(stock, gate0, up0, dy, rg, "stock", layouts, grad_layout)
    what = f"{kind} {dtype} rg={rg} layouts={layouts} grad={grad_layout}"
    if any(rg):
        assert CORE_NODE in core[4], f"{what}: the core did not run ({core[4]})"
        assert python[4] == PY_NODE, f"{what}: the Python path did not run ({python[4]})"
    else:
        assert core[4] == python[4] == "", what
    for i, name in enumerate(("output", "dGate", "dUp")):
        assert_bitwise(core[i], python[i], f"{what} {name} core vs python")
        assert_bitwise(core[i], ref[i], f"{what} {name} core vs stock")
    assert core[3] == python[3], f"{what}: saved bytes core {core[3]} vs python {python[3]}"
    # gate's storage where either input needs a gradient, up's too where gate does (a view pins its storage)
    n_gate, n_up = (_layout(t, lay).untyped_storage().nbytes() for t, lay in zip((gate0, up0), layouts))
    assert core[3] == (n_gate + n_up if rg[0] else n_gate if rg[1] else 0), f"{what}: saved {core[3]} bytes"
    return core


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_core_matches_python_and_stock(kind, dtype):
    for rg in grad_combos(2):
        check(kind, dtype, rg)


LAYOUTS = [("transposed", "transposed"), ("sliced", "contiguous"), ("contiguous", "transposed"),
           ("sliced", "sliced"), ("contiguous", "expanded"), ("expanded", "transposed")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_core_non_contiguous_inputs(kind, dtype):
    for layouts in LAYOUTS:
        for rg in grad_combos(2):
            check(kind, dtype, rg, layouts=layouts)


@pytest.mark.parametrize("grad_layout", ["transposed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_core_non_contiguous_gradient(kind, dtype, grad_layout):
    for rg in grad_combos(2)[1:]:
        check(kind, dtype, rg, grad_layout=grad_layout)


@pytest.mark.parametrize("shape", [(0, 4), (7,), (), (2, 3, 4, 33)], ids=str)
def test_core_shapes(shape):
    for kind in ("silu", "gelu_new"):
        for rg in grad_combos(2)[1:]:
            check(kind, torch.float32, rg, shape=shape)


def test_core_under_no_grad_and_inference_mode():
    gate, up, _ = make((4, 6), torch.float32)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    for guard in (torch.no_grad, torch.inference_mode):
        with guard():
            y = gated_activation(g, u, "silu")
        with csrc.disabled(), guard():
            y_py = gated_activation(g, u, "silu")
        assert y.grad_fn is None and not y.requires_grad
        assert y.is_inference() == y_py.is_inference()
        assert_bitwise(y, y_py, f"{guard.__name__} output")


def test_core_declines_where_the_python_path_serves():
    gate, up, dy = make((4, 6), torch.float32)

    def name(fn):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        return node_name(fn(g, u))

    assert CORE_NODE in name(lambda g, u: gated_activation(g, u, "silu"))
    # autocast (its casts are the Python path's business)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert name(lambda g, u: gated_activation(g, u, "silu")) == PY_NODE

    # a TorchFunctionMode sees gated_activation itself (and its own call through runs with the mode off)
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        name(lambda g, u: gated_activation(g, u, "silu"))
    assert gated_activation in seen

    # a tensor subclass (without __torch_function__, so that gated_activation itself runs on it)
    class Sub(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

    assert name(lambda g, u: gated_activation(g.as_subclass(Sub), u, "silu")) == PY_NODE
    # torch.func: the torch code runs (and gives stock's gradient)
    g_func = torch.func.grad(lambda g: (gated_activation(g, up, "gelu_new") * dy).sum())(gate)
    g_ref = torch.func.grad(lambda g: (reference("gelu_new", g) * up * dy).sum())(gate)
    assert_bitwise(g_func, g_ref, "torch.func.grad")


def test_core_declines_other_dtypes_and_refuses_bad_arguments_as_the_python_path():
    gate, up, _ = make((4, 6), torch.float32)
    for kind in ACTIVATIONS:  # complex: not a floating-point tensor, the Python path's TypeError
        with pytest.raises(TypeError, match="'gate' must be a floating-point tensor"):
            gated_activation(gate.to(torch.complex64), up.to(torch.complex64), kind)
    with pytest.raises(ValueError, match="'activation' must be one of"):
        gated_activation(gate, up, "relu")
    with pytest.raises(ValueError, match="'activation' must be one of"):
        gated_activation(gate, up, ["silu"])
    with pytest.raises(ValueError, match="'up' must have gate's shape, dtype and device"):
        gated_activation(gate, up.double(), "silu")
    with pytest.raises(ValueError, match="'up' must have gate's shape, dtype and device"):
        gated_activation(gate, up[:2], "silu")
    with pytest.raises(TypeError, match="argument 'up' must be a torch.Tensor"):
        gated_activation(gate, 2.0, "silu")


def test_core_refuses_double_backward_as_the_python_path():
    gate, up, dy = make((4, 6), torch.float64)
    messages = []
    for ctx in (contextlib.nullcontext, csrc.disabled):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        with ctx():
            y = gated_activation(g, u, "gelu")
            dg, = torch.autograd.grad(y, g, dy.clone().requires_grad_(), create_graph=True)
            with pytest.raises(RuntimeError) as err:
                dg.sum().backward()
        messages.append(str(err.value))
    assert "gated MLP activation" in messages[0]
    assert messages[0] == messages[1]


def test_core_notes_the_inputs_it_keeps(monkeypatch):
    """The producer/consumer rule: note_input_kept on gate when either input needs a gradient, on up when gate
    does, as GatedFunction.setup_context."""
    gate, up, _ = make((4, 6), torch.float32)
    for rg in grad_combos(2):
        seen = {}
        for mode in ("core", "python"):
            noted = []
            monkeypatch.setattr(_common, "note_input_kept", lambda x, noted=noted: noted.append(x))
            monkeypatch.setattr(_common, "_PRODUCERS", {object(): None})  # a producer is waiting to hear
            g, u = gate.clone().requires_grad_(rg[0]), up.clone().requires_grad_(rg[1])
            with csrc.disabled() if mode == "python" else contextlib.nullcontext():
                y = gated_activation(g, u, "silu")
            assert (CORE_NODE in node_name(y)) == (mode == "core" and any(rg))
            seen[mode] = sorted("gate" if t is g else "up" if t is u else "?" for t in noted)
            monkeypatch.undo()
        assert seen["core"] == seen["python"] == (["gate", "up"] if rg[0] else ["gate"] if rg[1] else []), rg
