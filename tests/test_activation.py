"""ReLU / LeakyReLU against stock PyTorch: bitwise outputs and gradients, 1 bit per element kept."""

from __future__ import annotations

import math
import warnings

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
import slimgrad.nn.activation  # noqa: F401  (registers the replacements)
from _util import FLOAT_DTYPES, assert_same, input_grad_as_returned, laid_out, saved_bytes, slim_copy
from slimgrad.functional._common import note_input_kept
from slimgrad.functional.activation import leaky_relu, relu
from slimgrad.kernels import bitmask as _bitmask

LEAF_MSG = "a leaf Variable that requires grad is being used in an in-place"
SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0]
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(actual, expected, what):
    """Bit patterns equal (so +0 and -0 differ), NaN where stock has NaN. NaN payloads are not compared:
    stock's own bf16 kernels give different NaN bits on their vectorised and scalar paths."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan]), f"{what}: bits differ"


def make_input(shape, dtype, layout, seed=0):
    """A leaf of ``shape`` in ``layout`` holding random values and every special value."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    x[: min(numel, len(SPECIALS))] = torch.tensor(SPECIALS[: min(numel, len(SPECIALS))], dtype=torch.float64)
    x = x[torch.randperm(numel, generator=gen)].reshape(shape).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":  # dense but not contiguous
        x = x.transpose(1, 3).contiguous().transpose(1, 3)
    return x


def stock_fn(slope):
    return (lambda x, inplace=False: F.relu(x, inplace=inplace)) if slope is None else (
        lambda x, inplace=False: F.leaky_relu(x, slope, inplace=inplace))


def slim_fn(slope):
    return (lambda x, inplace=False: relu(x, inplace=inplace)) if slope is None else (
        lambda x, inplace=False: leaky_relu(x, slope, inplace=inplace))


def run(fn, x_leaf, inplace, grad, sliced=False):
    """Forward (on a clone when in place, since a leaf cannot be modified) and backward; returns output,
    the leaf's grad and the bytes kept for backward."""
    from slimgrad.measure import SavedTensors

    with SavedTensors() as counter:
        x = x_leaf[..., ::2] if sliced else x_leaf
        inp = x.clone() if inplace else x
        out = fn(inp, inplace=inplace)
    out.backward(grad)
    return out, x_leaf.grad, counter.bytes


SLOPES = [None, 0.01, 0.0, 2.0, -0.3]


@pytest.mark.parametrize("slope", SLOPES, ids=lambda s: f"slope={s}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_matches_stock_bitwise(slope, dtype, layout, inplace):
    if inplace and slope is not None and slope < 0:
        pytest.skip("stock refuses in-place leaky_relu backward with a negative slope: tested below")
    shape = (2, 3, 5, 7)  # 210 elements: not a multiple of 8
    sliced = layout == "sliced"
    base = make_input(shape, dtype, "contiguous" if sliced else layout)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    out_shape = (2, 3, 5, 4) if sliced else shape
    grad = make_input(out_shape, dtype, "contiguous", seed=1)
    ys, gs, bytes_stock = run(stock_fn(slope), xs, inplace, grad, sliced)
    ym, gm, bytes_slim = run(slim_fn(slope), xm, inplace, grad, sliced)
    assert_bitwise(ym, ys, "output")
    assert_bitwise(gm, gs, "grad")
    numel = math.prod(out_shape)
    assert bytes_slim == (numel + 7) // 8
    # stock keeps relu's output (a fresh tensor) or leaky_relu's input (the whole sliced storage)
    # or, in place, the modified clone
    keeps_whole_base = slope is not None and sliced and not inplace
    assert bytes_stock == (math.prod(shape) if keeps_whole_base else numel) * base.element_size()


@pytest.mark.parametrize("slope", SLOPES, ids=lambda s: f"slope={s}")
@pytest.mark.parametrize("shape", [(0,), (0, 3), (1,), (7,), (9,), (3, 1, 1, 5)])
def test_odd_and_empty_shapes(slope, shape):
    base = make_input(shape, torch.float32, "contiguous")
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input(shape, torch.float32, "contiguous", seed=2)
    ys, gs, _ = run(stock_fn(slope), xs, False, grad)
    ym, gm, kept = run(slim_fn(slope), xm, False, grad)
    assert_bitwise(ym, ys, "output")
    assert_bitwise(gm, gs, "grad")
    assert kept == (math.prod(shape) + 7) // 8


@pytest.mark.parametrize("module", [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1), nn.LeakyReLU(0.1, True)],
                         ids=repr)
@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (2, 4, 1, 5)])  # size 1: TensorIterator's tie-breaking
def test_input_grad_layout_matches_stock(module, shape):
    """Stock's threshold_backward(grad, result) / leaky_relu_backward(grad, x) take their layout from the
    result or x first, the gradient breaking ties: ours has the same strides and bits for every pair."""
    slim = slim_copy(module)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    grad_values = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for x_layout in ("contiguous", "channels_last", "transposed"):
        x = laid_out(values, x_layout)
        for g_layout in ("contiguous", "channels_last", "transposed", "sliced", "expanded"):
            grad = laid_out(grad_values, g_layout)
            ys, dxs = input_grad_as_returned(module, x, grad)
            ym, dxm = input_grad_as_returned(slim, x, grad)
            what = f"x {x_layout}, grad {g_layout}"
            assert dxm.stride() == dxs.stride() and ym.stride() == ys.stride(), what
            assert_bitwise(dxm, dxs, what)


def test_inplace_leaf_error_like_stock():
    for fn in (lambda x: relu(x, inplace=True), lambda x: leaky_relu(x, 0.1, inplace=True)):
        with pytest.raises(RuntimeError, match=LEAF_MSG):
            fn(torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match=LEAF_MSG):
        F.relu(torch.randn(3, requires_grad=True), inplace=True)


def test_inplace_negative_slope_refused_in_backward_like_stock():
    from slimgrad.measure import SavedTensors

    for fn in (F.leaky_relu, leaky_relu):
        x = torch.randn(5, requires_grad=True)
        with SavedTensors() as counter:
            y = fn(x.clone(), -0.2, inplace=True)
        with pytest.raises(RuntimeError, match="In-place leakyReLu backward calculation is triggered with a"):
            y.sum().backward()
    assert counter.bytes == 0  # ours keeps nothing for a backward that can only fail


def test_no_grad_needed_is_stock_and_keeps_nothing():
    x = torch.randn(4, 4)
    assert saved_bytes(relu, x) == 0
    assert torch.equal(relu(x), F.relu(x))
    with torch.no_grad():
        y = torch.randn(4, requires_grad=True)
        assert saved_bytes(leaky_relu, y) == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="argument 'input'"):
        relu([1.0, -1.0])
    with pytest.raises(TypeError, match="argument 'negative_slope'"):
        leaky_relu(torch.randn(2), "0.1")


@pytest.mark.parametrize("module", [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.2),
                                    nn.LeakyReLU(-0.5), nn.LeakyReLU(0.1, inplace=True)], ids=repr)
def test_modules_match_stock(module):
    slim = slim_copy(module)
    base = make_input((2, 4, 3, 3), torch.float32, "channels_last")
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input((2, 4, 3, 3), torch.float32, "contiguous", seed=3)
    ys = module(xs * 1.0)
    ys.backward(grad)
    from slimgrad.measure import SavedTensors

    with SavedTensors() as counter:
        ym = slim(xm * 1.0)
    ym.backward(grad)
    assert_bitwise(ym, ys, "output")
    assert_bitwise(xm.grad, xs.grad, "grad")
    # the multiplication keeps nothing (constant factor); ours the 72-element mask: 9 bytes
    assert counter.bytes == 9


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


class KeepNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("module", [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1), nn.LeakyReLU(0.0),
                                    nn.LeakyReLU(-0.1)], ids=repr)
def test_producer_keeps_output_when_consumer_keeps_it(module):
    from slimgrad.measure import SavedTensors

    slim = slim_copy(module)
    w_stock = nn.Parameter(torch.tensor(1.5))  # parameters are not counted as kept
    w_slim = nn.Parameter(torch.tensor(1.5))
    shape = (4, 10)  # 40 elements
    base = make_input(shape, torch.float32, "contiguous")
    grad = make_input(shape, torch.float32, "contiguous", seed=4)

    def step(mod, w):
        x = base.clone().requires_grad_()
        with SavedTensors() as counter:
            h = mod(x * 1.0)
            y = KeepInput.apply(h, w)
        y.backward(grad)
        return y, x.grad, counter.bytes

    ys, gs, _ = step(module, w_stock)
    activation_bytes = math.prod(shape) * 4
    first = step(slim, w_slim)  # no consumer seen yet: mask
    assert first[2] == activation_bytes + 5
    second = step(slim, w_slim)
    output_kept = not (isinstance(module, nn.LeakyReLU) and module.negative_slope < 0)
    # the activation itself is shared with the consumer: nothing extra; otherwise the mask
    assert second[2] == activation_bytes + (0 if output_kept else 5)
    if output_kept and not (isinstance(module, nn.LeakyReLU) and not module.inplace):
        # stock keeps the output as well (relu; in-place leaky_relu): stock's own op runs
        assert "Backward" in type(slim(base.clone().requires_grad_() * 1.0).grad_fn).__name__
        assert "ReLUFunction" not in type(slim(base.clone().requires_grad_() * 1.0).grad_fn).__name__
    for y, g, _ in (first, second):
        assert_bitwise(y, ys, "output")
        assert_bitwise(g, gs, "grad")

    # a consumer that keeps nothing: the first step still keeps the output (the flag lags one step),
    # then back to the mask
    for expected in (activation_bytes, 5):
        with SavedTensors() as counter:
            x = base.clone().requires_grad_()
            KeepNothing.apply(slim(x * 1.0)).backward(grad)
        assert counter.bytes == (expected if output_kept else 5)


def test_functional_relu_always_masks():
    x = torch.randn(16, requires_grad=True)
    h = relu(x)
    KeepInput.apply(h, nn.Parameter(torch.tensor(1.0)))
    assert saved_bytes(relu, x) == 2


@pytest.mark.parametrize("slope", [None, 0.1, -0.4])
@pytest.mark.parametrize("kept", [False, True], ids=["mask", "output"])
def test_double_backward(slope, kept):
    from slimgrad.functional.activation import _ReLUFunction

    x = torch.randn(3, 4, dtype=torch.float64)
    x = (x + x.sign() * 0.1).requires_grad_()  # away from the kink
    torch.autograd.gradgradcheck(lambda t: _ReLUFunction.apply(t, slope, False, kept, None, False)[0], (x,))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("module", [nn.ReLU(), nn.LeakyReLU(0.2)], ids=repr)
def test_checkpoint(module, reentrant):
    lin = nn.Linear(6, 6)
    stock = nn.Sequential(lin, module)
    slim = nn.Sequential(lin, slim_copy(module))
    x = torch.randn(5, 6, requires_grad=True)
    stock(x).sum().backward()
    expected = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    checkpoint(slim, x, use_reentrant=reentrant).sum().backward()
    assert_same(x.grad, expected[0], what="input grad")
    assert_same(lin.weight.grad, expected[1], what="weight grad")


def test_autocast_runs_in_input_dtype():
    x = torch.randn(4, 5)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin = nn.Linear(5, 5)
        ys = F.relu(lin(xs))
        ym = relu(lin(xm))
    assert_same(ym, ys, what="output")
    ys.sum().backward()
    ym.sum().backward()
    assert_same(xm.grad, xs.grad, what="grad")


# ---- bit packing -------------------------------------------------------------------------------

@pytest.mark.parametrize("pack_impl", ["torch", "numpy"])
@pytest.mark.parametrize("unpack_impl", ["torch", "numpy"])
def test_bitmask_every_byte(pack_impl, unpack_impl):
    values = torch.arange(256, dtype=torch.uint8)
    flat = ((values[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1)
    assert torch.equal(_bitmask.pack(flat, impl=pack_impl), values)
    assert torch.equal(_bitmask.unpack(values, (256 * 8,), impl=unpack_impl), flat)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=4), seed=st.integers(0, 2**31 - 1),
       density=st.floats(0, 1), pack_impl=st.sampled_from(["torch", "numpy"]),
       unpack_impl=st.sampled_from(["torch", "numpy"]))
def test_bitmask_round_trip(shape, seed, density, pack_impl, unpack_impl):
    shape = tuple(shape)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
    flat, view = _bitmask.new_padded_mask(shape, mask.device)
    view.copy_(mask)
    packed = _bitmask.pack(flat, impl=pack_impl)
    assert packed.dtype == torch.uint8 and packed.numel() == (mask.numel() + 7) // 8
    assert torch.equal(_bitmask.unpack(packed, shape, impl=unpack_impl), mask)


def test_bitmask_errors():
    with pytest.raises(ValueError, match="'flat'"):
        _bitmask.pack(torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="'packed'"):
        _bitmask.unpack(torch.zeros(2, dtype=torch.uint8), (3, 8))


# ---- torch.compile -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("module", [nn.ReLU(), nn.LeakyReLU(0.1)], ids=repr)
def test_compile_fullgraph(module):
    torch._dynamo.reset()
    slim = torch.compile(slim_copy(module), fullgraph=True)
    base = make_input((2, 3, 4, 5), torch.float32, "contiguous")
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    grad = make_input((2, 3, 4, 5), torch.float32, "contiguous", seed=5)
    ys = module(xs)
    ys.backward(grad)
    from slimgrad.measure import SavedTensors

    with SavedTensors() as counter:
        ym = slim(xm)
    ym.backward(grad)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="grad")
    assert counter.bytes == (2 * 3 * 4 * 5 + 7) // 8  # the compiled graph keeps the packed mask too


@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU6(), nn.LeakyReLU(0.0, inplace=True)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_trainable_linear_consumer_is_heard(act, dtype):
    """An all-trainable MLP (Linear, activation, Linear): the second linear keeps the activation's output, as stock
    does, so from the second step the activation shares it (no mask on top: never more than stock), bitwise stock;
    with that linear frozen, the activation goes back to its mask (under stock's bytes). Stock's nn.Linear never
    told the activation before (nn/linear.py)."""
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(16, 64), act, nn.Linear(64, 8)).to(dtype)
    slim = slimgrad.convert(stock)
    assert type(slim[2]) is slimgrad.nn.Linear and isinstance(slim[2], nn.Linear)
    x = torch.randn(32, 16, dtype=dtype)

    def step(model):
        with SavedTensors() as counter:
            out = model(x)
        out.float().square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return out, grads, counter.bytes

    out_s, grads_s, kept_s = step(stock)
    for i in range(3):
        out, grads, kept = step(slim)
        assert_bitwise(out, out_s, "output")
        for g, gs in zip(grads, grads_s):
            assert_bitwise(g, gs, "grad")
        if i:  # (the first step has heard no consumer yet: a 1-bit mask, 32x64 bits, more)
            # (stock's ReLU6 keeps its input besides the output the linear layer keeps: there slimgrad keeps less)
            assert kept == kept_s if not isinstance(act, nn.ReLU6) else kept == kept_s - 32 * 64 * dtype.itemsize, \
                (i, kept, kept_s)
    for model in (stock, slim):
        model[2].weight.requires_grad_(False)
    _, _, kept_s = step(stock)
    step(slim)  # (the decision lags one step)
    _, _, kept = step(slim)
    assert kept == kept_s - 32 * 64 * dtype.itemsize + 32 * 64 // 8


def test_linear_under_autocast_keeps_its_cast_copy_so_the_activation_keeps_its_mask():
    """Under autocast a linear layer keeps a bf16 copy of an fp32 input, not the input: the ReLU before it keeps
    its mask (what stock keeps minus the fp32 output), not the output. (Where the linear layer's input is bf16
    already, it keeps the ReLU's output itself, which is then shared: the MLP test above.)"""
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))
    slim = slimgrad.convert(stock)
    base = torch.randn(32, 64)
    kept = []
    for model in (stock, slim, slim):
        x = base.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensors() as counter:
            out = model(x * 1.0)
        out.float().sum().backward()
        kept.append(counter.bytes)
    assert kept[2] == kept[1] == kept[0] - 32 * 64 * 4 + 32 * 64 // 8, kept


def test_linear_subclasses_are_not_reported():
    """nn.Linear's replacement only reports (it claims no saving): a subclass overriding forward is neither
    converted nor reported as left out."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model, rep = slimgrad.convert(nn.Sequential(Scaled(4, 4), nn.Linear(4, 4)), report=True)
    assert type(model[0]) is Scaled and type(model[1]) is slimgrad.nn.Linear
    assert not rep.skipped and not rep.converted and rep.stock_minimal == {"Linear": 1}, rep
    assert type(slimgrad.revert(model)[1]) is nn.Linear


@pytest.mark.parametrize("make", [lambda: nn.LeakyReLU(0.1), lambda: nn.ReLU6(), lambda: nn.Hardtanh(),
                                  lambda: nn.Threshold(0.1, 20.0), lambda: nn.Hardsigmoid(), lambda: nn.Dropout(0.5)],
                         ids=["leaky_relu", "relu6", "hardtanh", "threshold", "hardsigmoid", "dropout"])
@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
def test_output_of_a_channels_last_input_can_be_modified_in_place(make, core):
    """The kernels run in the input's memory order and permute the result back: that output was a view made inside
    a custom Function, which autograd refuses to modify in place (``out += residual`` in a channels-last block,
    a following in-place ReLU). Stock's output can be; so can slimgrad's, with stock's values and gradients."""
    import contextlib

    from slimgrad import csrc

    results = []
    with contextlib.nullcontext() if core else csrc.disabled():
        for module in (make(), slimgrad.convert(nn.Sequential(make()))[0]):
            module.train()
            x = torch.linspace(-4, 4, 2 * 3 * 4 * 5).view(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            torch.manual_seed(0)
            out = module(x * 1.0)
            out += 1.0
            out.backward(torch.linspace(1, 2, out.numel()).view(out.shape))
            results.append((out.detach(), x.grad))
    assert_bitwise(results[1][0], results[0][0], "output")
    assert_bitwise(results[1][1], results[0][1], "grad")


class _SharedActivation(nn.Module):
    """One activation module called twice a step: a trainable Linear keeps the first call's output, nobody keeps the
    second's, whose input another trainable Linear keeps anyway (so stock's kept input is free there)."""

    def __init__(self, act, d=32):
        super().__init__()
        self.act, self.fc1, self.fc2, self.side = act, nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("w", torch.randn(d))

    def forward(self, x):
        a = self.fc1(self.act(x))
        h = self.fc2(x)
        return a.sum() + self.side(h).sum() + (self.act(h) * self.w).sum()


@pytest.mark.parametrize("make", [lambda: nn.LeakyReLU(0.1), nn.ReLU6, lambda: nn.Hardtanh(-1.0, 2.0),
                                  lambda: nn.Threshold(0.1, 0.5)], ids=["leaky", "relu6", "hardtanh", "threshold"])
def test_activation_used_twice_keeps_its_output_only_if_every_call_is_kept(make):
    """A module whose stock op keeps its input, called twice a step with one call's output kept by a consumer: it
    learned "keep the output" from either call and then kept the unkept call's whole output, a tensor stock does not
    keep (+8 KiB of 24, every step). Now at most its 1-bit masks above stock (README, Limits)."""
    import copy as _copy

    import slimgrad
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = _SharedActivation(make())
    slim = slimgrad.convert(_copy.deepcopy(stock))
    x0 = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    masks = 2 * (16 * 32 + 7) // 8
    for step in range(3):
        kept = []
        for model in (stock, slim):
            model.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            with SavedTensors(exclude=[model]) as counter:
                out = model(x)
            kept.append(counter.bytes)
            out.backward()
        assert kept[1] <= kept[0] + masks, (step, kept)
        for p, q in zip(stock.parameters(), slim.parameters()):
            assert_same(q.grad, p.grad)


@pytest.mark.parametrize("where", ["consumer", "relu", "global"])
def test_full_backward_hook_does_not_hide_the_consumer_keeping_the_output(where):
    """A full backward hook passes the module's inputs (or outputs) on through BackwardHookFunction, new tensor
    objects on the same values: the consumer's keeping of ReLU's output went unseen and the ReLU kept its 1-bit mask
    besides, above stock every step (the wrappers sweep). From the second step on, stock's bytes; gradients stock's."""
    from slimgrad.measure import SavedTensors

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))

    x = torch.randn(2, 3, 8, 8)

    def steps(model):
        handles = []
        if where == "consumer":
            model[2].register_full_backward_hook(lambda mod, gi, go: None)
        elif where == "relu":
            model[1].register_full_backward_pre_hook(lambda mod, go: None)
        else:
            handles.append(nn.modules.module.register_module_full_backward_hook(lambda mod, gi, go: None))
        kept, grads = [], []
        try:
            for _ in range(3):
                with SavedTensors(exclude=[model]) as saved:
                    y = model(x)
                y.sum().backward()
                kept.append(saved.bytes)
                grads.append([p.grad.clone() for p in model.parameters()])
                model.zero_grad(set_to_none=True)
        finally:
            for h in handles:
                h.remove()
        return kept, grads

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the hook fires for outputs where no input needs grad
        stock_kept, stock_grads = steps(build())
        slim_kept, slim_grads = steps(slimgrad.convert(build()))
    assert slim_kept[1:] == stock_kept[1:], (slim_kept, stock_kept)
    for a, b in zip(slim_grads, stock_grads):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb)
