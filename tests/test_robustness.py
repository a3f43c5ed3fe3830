"""Converted models under the things users do to models: freezing between steps, swapping parameters,
sharing modules, converting twice, saving and loading, copying."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from tests._util import assert_same
from torch import nn

import slimgrad
from slimgrad._registry import ORIGINALS

torch.set_num_threads(1)
SHAPE = (2, 3, 8, 8)


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def step(model, x, input_grad=True):
    x = x.clone().requires_grad_(input_grad)
    with slimgrad.SavedTensors(exclude=[model]) as kept:
        out = model(x)
    out.sum().backward()
    return out, x.grad, kept.bytes


def compare(stock, slim, x, input_grad=True):
    for model in (stock, slim):
        model.zero_grad(set_to_none=True)
    a, ga, _ = step(stock, x, input_grad)
    b, gb, kept = step(slim, x, input_grad)
    assert_same(b, a, what="output")
    assert_same(gb, ga, what="input grad")
    for (n, p), q in zip(stock.named_parameters(), slim.parameters()):
        # A conv's bias gradient with its weight frozen is a plain sum over dY in slimgrad, oneDNN's fused
        # kernel in stock (README, Exactness): equal within fp32 rounding, not bitwise.
        frozen_conv_bias = n.endswith("bias") and isinstance(getattr(stock, n.split(".")[0]), nn.Conv2d) \
            and not getattr(stock, n.split(".")[0]).weight.requires_grad
        assert_same(q.grad, p.grad, exact=not frozen_conv_bias, rtol=1e-5, atol=1e-6, what=n)
    return kept


def _conv_in(numel_in, conv_trains):
    return numel_in * 4 if conv_trains else 0


def test_requires_grad_toggled_between_steps():
    stock = cnn()
    slim = slimgrad.convert(stock)
    x = torch.randn(SHAPE)
    n0, n1, pooled = 2 * 3 * 64, 2 * 6 * 64, 2 * 6 * 16
    for conv_trains in (True, False, True):
        for model in (stock, slim):
            model[0].requires_grad_(conv_trains)
            model[4].requires_grad_(conv_trains)
        kept = compare(stock, slim, x)
        # conv0 keeps x only for its dW; BN (train) keeps its input + 2 stats; ReLU 1 bit per element (its
        # consumer, the max pool, keeps nothing, so never the output); max pool 1 byte per output; conv4
        # keeps its input only for dW; the Linear keeps its input (its weight trains).
        expected = (_conv_in(n0, conv_trains) + n1 * 4 + 2 * 6 * 4 + (n1 + 7) // 8 + pooled
                    + _conv_in(pooled, conv_trains) + 2 * 4 * 4)
        assert kept == expected, conv_trains
        assert (slim[0].weight.grad is None) == (not conv_trains)


def test_parameters_replaced_after_conversion():
    stock = cnn()
    slim = slimgrad.convert(stock)
    for model in (stock, slim):
        torch.manual_seed(5)
        model[0].weight = nn.Parameter(torch.randn(6, 3, 3, 3), requires_grad=False)
        model[1].bias = nn.Parameter(torch.randn(6))
    assert type(slim[0]) is slimgrad.nn.Conv2d
    compare(stock, slim, torch.randn(SHAPE))
    assert slim[0].weight.grad is None and slim[1].bias.grad is not None


def test_module_shared_by_two_parents():
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(shared), nn.Sequential(shared))
    slim = slimgrad.convert(stock)
    assert slim[1][0] is slim[2][0] and type(slim[1][0][0]) is slimgrad.nn.Conv2d
    compare(stock, slim, torch.randn(SHAPE))
    compare(stock, slim, torch.randn(SHAPE))  # the second step, decisions learned


def test_converting_twice_changes_nothing():
    model = cnn()
    once, report = slimgrad.convert(model, report=True)
    classes = [type(m) for m in once.modules()]
    twice, report2 = slimgrad.convert(once, inplace=True, report=True)
    assert twice is once and [type(m) for m in twice.modules()] == classes
    assert report.converted and not report2.converted and not report2.skipped


def test_state_dict_round_trips_between_stock_and_converted():
    stock = cnn()
    slim = slimgrad.convert(stock)
    step(slim, torch.randn(SHAPE))  # changes running stats and num_batches_tracked
    for p in slim.parameters():
        p.data.add_(0.5)
    fresh = cnn()
    fresh.load_state_dict(slim.state_dict())
    back = slimgrad.convert(cnn())
    back.load_state_dict(fresh.state_dict())
    for (k, v), (k2, v2) in zip(slim.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert all(type(m) not in ORIGINALS for m in fresh.modules())


def test_whole_model_pickle_round_trip():
    slim = slimgrad.convert(cnn())
    buf = io.BytesIO()
    torch.save(slim, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in slim.modules()]
    compare(copy.deepcopy(slim), loaded, torch.randn(SHAPE))


def test_deepcopy_is_independent():
    slim = slimgrad.convert(cnn())
    twin = copy.deepcopy(slim)
    assert [type(m) for m in twin.modules()] == [type(m) for m in slim.modules()]
    assert all(p is not q for p, q in zip(twin.parameters(), slim.parameters()))
    compare(slim, twin, torch.randn(SHAPE))
    twin[0].weight.data.zero_()
    assert slim[0].weight.abs().sum() > 0


def test_revert_after_training_gives_a_stock_model_with_the_same_numbers():
    slim = slimgrad.convert(cnn())
    x = torch.randn(SHAPE)
    step(slim, x)
    ref = copy.deepcopy(slim)
    slimgrad.revert(slim)
    assert all(type(m) not in ORIGINALS for m in slim.modules())
    assert not any("_slimgrad_" in k for m in slim.modules() for k in vars(m))
    compare(slim, ref, x)


def test_old_weight_norm_and_spectral_norm_hooks_survive_the_default_copy():
    """torch.nn.utils.weight_norm / spectral_norm (the hook versions) keep their computed weight as a non-leaf
    attribute, which plain deepcopy refuses; convert's copy works, leaves the original alone, and trains as
    stock does (the hooks recompute the weight before each forward)."""
    from torch.nn.utils import spectral_norm, weight_norm

    def make():
        torch.manual_seed(0)
        return nn.Sequential(weight_norm(nn.Conv2d(3, 4, 3)), nn.ReLU(), spectral_norm(nn.Conv2d(4, 4, 3)),
                             nn.Flatten(), weight_norm(nn.Linear(64, 2)))

    stock, original = make(), make()
    weight = original[0].weight
    slim = slimgrad.convert(original)
    assert original[0].weight is weight and type(original[0]) is nn.Conv2d
    assert type(slim[0]) in ORIGINALS and type(slim[2]) in ORIGINALS
    x = torch.randn(SHAPE)
    for _ in range(2):
        xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        stock(xs).sum().backward()
        slim(xm).sum().backward()
        assert_same(xm.grad, xs.grad, what="input grad")
        for (name, p), q in zip(stock.named_parameters(), slim.parameters()):
            assert_same(q.grad, p.grad, what=name)
    for (name, b), c in zip(stock.named_buffers(), slim.buffers()):  # spectral norm's power iteration
        assert_same(c, b, what=name)


def _double_backward_cases():
    from slimgrad.functional import gated_activation, lora_linear
    from slimgrad.functional.lora import LoraAdapter

    def lora(x):
        # with dropout: where stock keeps what slimgrad would (no dropout, no cast), stock's ops run directly
        return lora_linear(x, torch.randn(3, 8), None, [LoraAdapter(torch.randn(2, 8, requires_grad=True),
                                                                    torch.randn(3, 2, requires_grad=True),
                                                                    dropout=0.1)])

    return {
        # eval, frozen: where stock keeps what slimgrad would, stock's own batch norm runs (and double-backs)
        "batch norm": (nn.BatchNorm2d(3).eval().requires_grad_(False), (2, 3, 4, 4), "exclude=[nn.BatchNorm2d]"),
        "max pooling": (nn.MaxPool2d(2), (2, 3, 4, 4), "exclude=[nn.MaxPool2d]"),
        "average pooling": (nn.AvgPool2d(2), (2, 3, 4, 4), "exclude=[nn.AvgPool2d"),
        "RMSNorm": (nn.RMSNorm(4), (2, 3, 4), "exclude=[nn.RMSNorm]"),
        "gated MLP activation": (lambda x: gated_activation(x, x * 2), (2, 8), "LlamaMLP"),
        "LoRA linear": (lora, (2, 8), "lora.Linear"),
    }


@pytest.mark.parametrize("layer", list(_double_backward_cases()))
def test_double_backward_error_names_the_layer_and_the_way_out(layer):
    """Gradient penalties differentiate a gradient: the layers that refuse it say that slimgrad is the cause,
    which layer it is, and how to keep it stock."""
    module, shape, how = _double_backward_cases()[layer]
    if isinstance(module, nn.Module):
        module = slimgrad.convert(module)
    x = torch.randn(shape, requires_grad=True)
    second_order = {
        "backward": lambda penalty: penalty.backward(),
        # runs only the nodes on a path to x: the error node must be on it (it was not: None, no error)
        "grad": lambda penalty: torch.autograd.grad(penalty, x),
        "grad, allow_unused": lambda penalty: torch.autograd.grad(penalty, x, allow_unused=True),
    }
    for how_second in second_order.values():
        (g,) = torch.autograd.grad(module(x).pow(3).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError) as err:
            how_second(g.pow(2).sum())
        message = str(err.value)
        assert message.startswith(f"slimgrad: {layer} (") and "double backward" in message, message
        assert how in message and "slimgrad.revert(model)" in message, message


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(4), lambda: nn.GroupNorm(1, 3)], ids=["LayerNorm", "GroupNorm"])
@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
def test_layer_group_norm_double_backward_where_x_needs_grad(make, core):
    """Where x needs a gradient, layer and group norm keep what stock keeps (x, mean, rstd): the core runs stock's
    own op there, so a gradient penalty differentiates through it as stock's does (bitwise); the Python path's
    Function refuses with slimgrad's message instead."""
    from slimgrad import csrc

    stock = make()
    torch.nn.init.normal_(stock.weight)
    slim = slimgrad.convert(stock)
    x0 = torch.randn(2, 3, 4)
    ctx = contextlib.nullcontext() if core else csrc.disabled()

    def penalty(m):
        x = x0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(m(x).pow(3).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        return x.grad, m.weight.grad

    want = penalty(stock)
    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    with ctx:
        if not core:
            with pytest.raises(RuntimeError, match="double backward"):
                penalty(slim)
            return
        got = penalty(slim)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class _ModifiedAfterActivation(nn.Module):
    """conv -> activation -> the user's in-place change of its output -> conv (whose weight trains, so it
    keeps its input: what would make the activation keep its output instead of a mask)."""

    def __init__(self, act):
        super().__init__()
        self.c1, self.act, self.c2 = nn.Conv2d(3, 4, 3, padding=1), act, nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.act(self.c1(x))
        y.mul_(2.0).sub_(0.5)
        return self.c2(y)


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "save_on_cpu"])
@pytest.mark.parametrize("act", [nn.LeakyReLU(0.1), nn.ReLU6(), nn.ReLU6(inplace=True), nn.Hardtanh(-1, 1),
                                 nn.Threshold(0.1, 0.0)], ids=repr)
def test_activation_output_changed_in_place_after_it(act, hooks):
    """Stock keeps these activations' input, so changing their output in place is allowed. The consumer then
    keeps the changed tensor, which must not teach the activation to keep its output: that failed autograd's
    version check from the second step, and under saved-tensor hooks that skip the check (``save_on_cpu`` on
    CPU hands back the same tensor) gave wrong gradients. Every step's gradients equal stock's."""
    torch.manual_seed(0)
    stock = _ModifiedAfterActivation(copy.deepcopy(act))
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        grads = []
        for model in (stock, slim):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            if hooks:
                with torch.autograd.graph.save_on_cpu():
                    out = model(xi)
            else:
                out = model(xi)
            out.square().sum().backward()
            grads.append([xi.grad, *(p.grad for p in model.parameters())])
        for a, b in zip(*grads):
            assert_same(b, a)
    assert not slim.act.__dict__.get("_slimgrad_output_kept", False)


class _CountingParametrization(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, w):
        self.calls += 1
        return w


@pytest.mark.parametrize("make", [lambda: nn.Conv1d(3, 4, 3), lambda: nn.Conv2d(3, 4, 3),
                                  lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                                  lambda: nn.ConvTranspose2d(3, 4, 3)],
                         ids=["conv1d", "conv2d", "reflect", "transpose"])
@pytest.mark.parametrize("weight_trains", [True, False])
def test_parametrized_weight_is_computed_once_per_forward(make, weight_trains):
    """A parametrization registered on a converted conv runs once per forward, as on stock's: spectral_norm
    advances its power iteration per run, so a second run changed the output (6.7e-6 off stock's)."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    stock = make().requires_grad_(weight_trains)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 6) if isinstance(stock, nn.Conv1d) else torch.randn(2, 3, 6, 6)
    counting = _CountingParametrization()
    parametrize.register_parametrization(slim, "weight", counting)
    counting.calls = 0  # registering ran it once, to check its output
    slim(x.clone().requires_grad_())
    assert counting.calls == 1
    parametrize.remove_parametrizations(slim, "weight")
    torch.manual_seed(1)
    spectral_norm(stock)
    torch.manual_seed(1)
    spectral_norm(slim)
    for _ in range(2):
        xs, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yg = stock(xs), slim(xg)
        assert_same(yg, ys)
        ys.square().sum().backward()
        yg.square().sum().backward()
        assert_same(xg.grad, xs.grad)


def test_flags_of_the_wrong_kind_raise_as_stock_and_0d_tensor_numbers_run():
    """Stock refuses a str for ceil_mode / count_include_pad / dropout's training (TypeError); slimgrad read "no" as
    True and ran. Stock takes a 0-d tensor as a number (negative_slope, min_val, threshold); slimgrad raised under
    the mode (the errors sweep)."""
    import torch.nn.functional as F

    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    for stock_call, slim_module in ((lambda: F.max_pool2d(x, 2, ceil_mode="no"), torch.nn.MaxPool2d(2, ceil_mode="no")),
                                    (lambda: F.avg_pool2d(x, 2, padding=1, count_include_pad="no"),
                                     torch.nn.AvgPool2d(2, padding=1, count_include_pad="no"))):
        with pytest.raises(TypeError):
            stock_call()
        with pytest.raises(TypeError, match="must be bool"):
            slimgrad.convert(slim_module)(x)
    with pytest.raises(TypeError):
        F.dropout(x, 0.5, training="no")
    with slimgrad.enabled(), pytest.raises(TypeError, match="'training' must be bool"):
        F.dropout(x, 0.5, training="no")
    # a float size after the equal int's call found that call's cached options and ran (review sweep)
    torch.nn.functional.max_pool2d(x, 2, stride=2)
    with slimgrad.enabled():
        F.max_pool2d(x, 2, stride=2)
        with pytest.raises(TypeError):
            F.max_pool2d(x, 2, stride=2.0)
        F.dropout(x, 0.5, training=True, inplace=0)  # stock tests inplace's truth only
    for call in (lambda t: F.leaky_relu(t, torch.tensor(0.2)), lambda t: F.hardtanh(t, min_val=torch.tensor(-0.5)),
                 lambda t: F.threshold(t, torch.tensor(0.1), 0.0), lambda t: F.leaky_relu(t, True)):
        x1 = torch.randn(2, 8, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        expected = call(x1)
        expected.sum().backward()
        with slimgrad.enabled():
            got = call(x2)
        got.sum().backward()
        assert torch.equal(got, expected) and torch.equal(x2.grad, x1.grad)


class _StoredTransposed(nn.Module):
    """A parametrization whose weight is a transposed view of what is stored (``orthogonal`` does as much for conv
    kernels whose matrices are wide)."""

    def forward(self, stored):
        return stored.transpose(-1, -2)

    def right_inverse(self, weight):
        return weight.transpose(-1, -2).contiguous()


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("case", ["weight trains, X frozen", "weight frozen, X needs grad", "both"])
@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
def test_computed_weight_in_another_layout_gives_stock_bits(groups, case, core):
    """A conv whose weight is computed as a transposed view: dW came from a contiguous carrier (other kernels than
    stock's strided weight, ~2e-6 off, and contiguous where stock's keeps the weight's strides) and dX from the
    transposed convolution on the strided weight (~4e-7 off at groups > 1; the wrappers sweep). Now stock's bits,
    and no more bytes than stock."""
    from torch.nn.utils import parametrize

    from slimgrad import csrc
    from slimgrad.measure import SavedTensors

    x = torch.randn(2, 16, 10, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 16, 11, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    base = nn.Conv1d(16, 16, 8, padding=4, groups=groups)
    results = []
    for model in (copy.deepcopy(base), slimgrad.convert(copy.deepcopy(base))):
        parametrize.register_parametrization(model, "weight", _StoredTransposed())
        stored = model.parametrizations.weight.original
        stored.requires_grad_(case != "weight frozen, X needs grad")
        model.bias.requires_grad_(False)
        xx = x.clone().requires_grad_(case != "weight trains, X frozen")
        with contextlib.nullcontext() if core else csrc.disabled(), SavedTensors() as kept:
            y = model(xx)
        y.backward(g)
        results.append((y, stored.grad, xx.grad, kept.bytes))
    (y0, w0, x0, b0), (y1, w1, x1, b1) = results
    assert_same(y1, y0, what="output")
    assert_same(w1, w0, what="dW")
    if w0 is not None:
        assert w1.stride() == w0.stride(), (w1.stride(), w0.stride())
    assert_same(x1, x0, what="dX")
    assert b1 <= b0, (b1, b0)
