"""``slimgrad.enabled()``: functional calls of any module reach slimgrad's forms, with stock's numbers.

Every route in ``slimgrad.mode.ROUTES`` must have a case in ``CASES`` (checked below), so a family that adds
a route adds one line here: the stock callable, how to build its arguments, and the analytical bytes its
slimgrad twin keeps when only the input needs grad.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from tests._util import assert_same
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import slimgrad
from slimgrad import functional as SF
from slimgrad.mode import ROUTES, enabled

torch.set_num_threads(1)


def frozen(*shape):
    """A parameter that needs no grad: SavedTensors never counts parameters, so only activations count."""
    return nn.Parameter(torch.randn(*shape), requires_grad=False)


def _bits(numel):
    return (numel + 7) // 8


# One line per route: (stock callable, make(x) -> (args, kwargs) with x first, input shape,
#                      bytes the slimgrad twin keeps with only x needing grad (from shapes), exact vs stock)
CONV_W = {1: frozen(4, 3, 3), 2: frozen(4, 3, 3, 3), 3: frozen(4, 3, 3, 3, 3)}
CONVT_W = {1: frozen(3, 4, 3), 2: frozen(3, 4, 3, 3), 3: frozen(3, 4, 3, 3, 3)}
BN = dict(rm=torch.randn(3), rv=torch.rand(3) + 0.5, w=frozen(3), b=frozen(3))
SHAPE = {1: (2, 3, 10), 2: (2, 3, 6, 6), 3: (2, 3, 4, 4, 4)}
N = {nd: math.prod(s) for nd, s in SHAPE.items()}


def _pool_out(nd, k):
    return SHAPE[nd][0] * SHAPE[nd][1] * math.prod(s // k for s in SHAPE[nd][2:])


CASES = {}
for nd in (1, 2, 3):
    CASES[getattr(F, f"conv{nd}d")] = (lambda x, nd=nd: ((x, CONV_W[nd]), {"padding": 1}), SHAPE[nd], 0, True)
    CASES[getattr(F, f"conv_transpose{nd}d")] = (
        lambda x, nd=nd: ((x, CONVT_W[nd]), {"stride": 2}), SHAPE[nd], 0, True)
    CASES[getattr(F, f"max_pool{nd}d")] = (lambda x: ((x, 2), {}), SHAPE[nd], _pool_out(nd, 2), True)
    # the returned int64 indices exist anyway: kept in place of window positions (positions beside them would put
    # the step's peak above stock's), still less than stock's input + indices
    CASES[getattr(F, f"max_pool{nd}d_with_indices")] = (
        lambda x: ((x, 2), {}), SHAPE[nd], 8 * _pool_out(nd, 2), True)
    CASES[getattr(F, f"avg_pool{nd}d")] = (lambda x: ((x, 2), {}), SHAPE[nd], 0, True)
    CASES[getattr(F, f"adaptive_avg_pool{nd}d")] = (lambda x: ((x, 1), {}), SHAPE[nd], 0, True)
    # Feature dropout is stock's own (it keeps one value per (sample, channel), nothing to save).
    CASES[getattr(F, f"dropout{nd}d")] = (lambda x: ((x, 0.5), {"training": True}), SHAPE[nd],
                                          4 * SHAPE[nd][0] * SHAPE[nd][1], True)
CASES.update({
    # eval with frozen affine: dX = dY * w * invstd reads no activation
    F.batch_norm: (lambda x: ((x, BN["rm"], BN["rv"], BN["w"], BN["b"]), {}), SHAPE[2], 0, True),
    # norms with frozen affine and x needing grad: x and fp32 per-row (per-group) statistics
    F.layer_norm: (lambda x: ((x, (6,), frozen(6), frozen(6)), {}), SHAPE[2], 4 * N[2] + 2 * 4 * 36, True),
    F.group_norm: (lambda x: ((x, 3, frozen(3), frozen(3)), {}), SHAPE[2], 4 * N[2] + 2 * 4 * 2 * 3, True),
    F.rms_norm: (lambda x: ((x, (6,), frozen(6)), {}), SHAPE[2], 4 * N[2] + 4 * 36, True),
    F.relu: (lambda x: ((x,), {}), SHAPE[2], _bits(N[2]), True),
    torch.relu: (lambda x: ((x,), {}), SHAPE[2], _bits(N[2]), True),
    torch.relu_: (lambda x: ((x * 1,), {}), SHAPE[2], _bits(N[2]), True),
    F.leaky_relu: (lambda x: ((x, 0.1), {}), SHAPE[2], _bits(N[2]), True),
    F.leaky_relu_: (lambda x: ((x * 1, 0.1), {}), SHAPE[2], _bits(N[2]), True),
    # dropout policy "auto" on CPU: stock's mask (bitwise), kept as bits
    F.dropout: (lambda x: ((x, 0.3), {}), SHAPE[2], _bits(N[2]), True),
    # clamp-like activations: a 1-bit mask of the region where the gradient passes
    F.hardtanh: (lambda x: ((x, -0.5, 0.5), {}), SHAPE[2], _bits(N[2]), True),
    F.hardtanh_: (lambda x: ((x * 1, -0.5, 0.5), {}), SHAPE[2], _bits(N[2]), True),
    F.relu6: (lambda x: ((x * 4,), {}), SHAPE[2], _bits(N[2]), True),
    F.threshold: (lambda x: ((x, 0.1, 2.0), {}), SHAPE[2], _bits(N[2]), True),
    torch.threshold: (lambda x: ((x, 0.1, 2.0), {}), SHAPE[2], _bits(N[2]), True),
    torch.threshold_: (lambda x: ((x * 1, 0.1, 2.0), {}), SHAPE[2], _bits(N[2]), True),
    F.hardsigmoid: (lambda x: ((x * 4,), {}), SHAPE[2], _bits(N[2]), True),
})


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run(fn, make, shape, ctx=None):
    torch.manual_seed(0)
    x = torch.randn(shape).requires_grad_()
    args, kwargs = make(x)
    excluded = [BN["rm"], BN["rv"]]
    with slimgrad.SavedTensors(exclude=excluded) as kept:
        if ctx is None:
            out = fn(*args, **kwargs)
        else:
            with ctx:
                out = fn(*args, **kwargs)
    g = torch.randn(_first(out).shape, generator=torch.Generator().manual_seed(1))
    _first(out).backward(g)
    return out, x.grad, kept.bytes


def test_every_route_has_a_case():
    assert set(ROUTES) == set(CASES), "add a CASES line for each new route"


@pytest.mark.parametrize("fn", list(CASES), ids=lambda f: getattr(f, "__name__", str(f)))
def test_route_matches_stock_and_keeps_the_minimum(fn):
    make, shape, minimum, exact = CASES[fn]
    out, grad, kept = _run(fn, make, shape, enabled())
    assert kept == minimum
    stock_out, stock_grad, stock_kept = _run(fn, make, shape)
    assert kept < stock_kept or kept == stock_kept == minimum  # less than stock, or stock is already minimal
    if exact:
        outs = zip(out, stock_out) if isinstance(out, tuple) else [(out, stock_out)]
        for a, b in outs:
            assert_same(a, b, what="output")
        assert_same(grad, stock_grad, what="grad")
    else:  # dropout: same mask as slimgrad's own functional form under the same seed
        slim_out, slim_grad, _ = _run(ROUTES[fn], make, shape)
        assert_same(out, slim_out, what="output")
        assert_same(grad, slim_grad, what="grad")
        assert not torch.equal(out, stock_out)  # a slimgrad draw, not stock's: the route really ran


@pytest.fixture
def spy(monkeypatch):
    """Every route wrapped to record its name when it is taken."""
    calls = []
    for stock, target in list(ROUTES.items()):
        name = getattr(stock, "__name__", str(stock))

        def record(*args, _target=target, _name=name, **kwargs):
            calls.append(_name)
            return _target(*args, **kwargs)
        monkeypatch.setitem(ROUTES, stock, record)
    return calls


def test_routes_only_calls_that_need_grad_and_never_recurses(spy):
    w = frozen(4, 3, 3, 3)
    x = torch.randn(2, 3, 6, 6)
    with enabled():
        F.conv2d(x, w)  # nothing requires grad
        with torch.no_grad():
            F.conv2d(x.requires_grad_(), w)
    assert spy == []
    with enabled():
        # conv's backward computes dX with conv_transpose2d and relu's backward uses torch ops: both run
        # with grad mode off, inside the block, and must not be routed; nor may the calls slimgrad's forms
        # make to torch inside their forward.
        y = F.relu(F.conv2d(x, w, padding=1))
        y = F.max_pool2d(y, 2)
        y.sum().backward()
    assert spy == ["conv2d", "relu", "max_pool2d"]


class ThirdPartyNet(nn.Module):
    """A module the converter knows nothing about: it calls torch.nn.functional directly."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.b1 = nn.Parameter(torch.randn(6) * 0.1)
        self.g, self.beta = nn.Parameter(torch.rand(6) + 0.5), nn.Parameter(torch.randn(6) * 0.1)
        self.register_buffer("rm", torch.zeros(6))
        self.register_buffer("rv", torch.ones(6))
        self.c2 = nn.Parameter(torch.randn(5, 6, 3, 3) * 0.2)

    def forward(self, x):
        y = F.conv2d(x, self.c1, self.b1, padding=1)
        y = F.batch_norm(y, self.rm, self.rv, self.g, self.beta, self.training)
        y = F.relu_(y)
        y = F.max_pool2d(y, 2)
        y = F.leaky_relu(F.conv2d(y, self.c2, padding=1), 0.2)
        return F.adaptive_avg_pool2d(F.avg_pool2d(y, 2), 1).flatten(1)


@pytest.mark.parametrize("train_bn", [True, False], ids=["bn-train", "bn-eval"])
@pytest.mark.parametrize("trainable", ["all", "input", "norm"])
def test_unknown_module_matches_stock_with_less_kept(trainable, train_bn):
    torch.manual_seed(0)
    stock = ThirdPartyNet().train(train_bn)
    for name, p in stock.named_parameters():
        p.requires_grad_(trainable == "all" or (trainable == "norm" and name in ("g", "beta")))
    routed = copy.deepcopy(stock)
    x = torch.randn(2, 3, 8, 8)
    results = []
    for model, ctx in ((stock, None), (routed, enabled())):
        xi = x.clone().requires_grad_()
        with slimgrad.SavedTensors(exclude=[model]) as kept:
            if ctx is None:
                out = model(xi)
            else:
                with ctx:
                    out = model(xi)
        out.sum().backward()
        results.append((out, xi.grad, kept.bytes, model))
    (a, ga, kept_stock, _), (b, gb, kept_slim, _) = results
    assert_same(b, a, what="output")
    assert_same(gb, ga, what="input grad")
    for (n, p), q in zip(stock.named_parameters(), routed.parameters()):
        assert_same(q.grad, p.grad, what=n)
    for buf in ("rm", "rv"):
        assert_same(getattr(routed, buf), getattr(stock, buf), what=buf)
    # Analytical minimum from shapes: conv1 (X needs no grad beyond dW) keeps x only for dW; batch norm
    # keeps y1 + 2 stats in training when x or w needs grad, y1 in eval only for dW; relu 1 bit per
    # element; max pool 1 byte per output; conv2 keeps its input for dW; leaky_relu 1 bit; pools nothing.
    w_train = trainable == "all"
    bn_w = trainable in ("all", "norm")
    x_b, y1, p1, y2 = 2 * 3 * 64 * 4, 2 * 6 * 64 * 4, 2 * 6 * 16, 2 * 5 * 16
    expected = (x_b if w_train else 0)
    expected += (y1 + 2 * 6 * 4) if train_bn else (y1 if bn_w else 0)
    expected += _bits(2 * 6 * 64) + p1 + (p1 * 4 if w_train else 0) + _bits(y2)
    assert kept_slim == expected
    assert kept_slim < kept_stock


def test_matches_convert_on_a_sequential_cnn():
    """Same layers built as modules: enabled() keeps what a fresh convert keeps, value for value."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.LeakyReLU(0.1),
                          nn.Dropout(0.3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    results = []
    for m, ctx in ((slimgrad.convert(model), None), (copy.deepcopy(model), enabled())):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)
        with slimgrad.SavedTensors(exclude=[m]) as kept:
            if ctx is None:
                out = m(xi)
            else:
                with ctx:
                    out = m(xi)
        out.sum().backward()
        results.append((out, xi.grad, kept.records, [p.grad for p in m.parameters()]))
    (a, ga, ra, pa), (b, gb, rb, pb) = results
    assert_same(b, a, what="output")
    assert_same(gb, ga, what="input grad")
    assert rb == ra
    for p, q in zip(pa, pb):
        assert_same(q, p, what="param grad")


def test_nested_and_reentrant_use():
    """A converted model inside enabled() is not routed twice; nested blocks behave as one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    slim = slimgrad.convert(model)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    with enabled(), enabled():
        out = slim(x)
    ref = model(x)
    assert_same(out, ref, what="output")
    grads = torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0]
    assert_same(*grads, what="grad")


def test_route_rejects_non_callables():
    with pytest.raises(TypeError, match="'stock' and 'replacement' must be callables"):
        slimgrad.mode.route(F.conv2d, None)


def test_functional_forms_are_the_route_targets():
    assert ROUTES[F.conv2d] is SF.conv2d and ROUTES[torch.conv2d] is SF.conv2d


_CHECKPOINTS = {
    "non-reentrant": dict(use_reentrant=False),
    "no-determinism-check": dict(use_reentrant=False, determinism_check="none"),
    "selective": dict(use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(
        lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)),
    "reentrant": dict(use_reentrant=True),
}


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-inside", "backward-after"])
@pytest.mark.parametrize("kind", list(_CHECKPOINTS))
def test_checkpointed_regions_run_stock_inside_the_mode(kind, backward_inside):
    """A non-reentrant checkpoint's recomputation runs in backward, outside the mode, with stock's ops: its check of
    the recomputed tensors failed on slimgrad's masks (CheckpointError), with the check off slimgrad's backward got
    stock's tensors ("expected scalar type Byte but found Float"), and selective checkpointing found no cached relu.
    Inside a checkpointed region the mode now runs stock's ops (the region's tensors are recomputed anyway); the
    layers outside it keep slimgrad's savings (found by this stop's mode sweep)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3, padding=1))
    head = nn.Sequential(nn.ReLU(), nn.Dropout(0.3), nn.Flatten(), nn.Linear(64, 5))
    x0 = torch.randn(2, 3, 8, 8)
    grads = []
    for mode in (False, True):
        x = x0.clone().requires_grad_()
        torch.manual_seed(1)
        ctx = enabled() if mode else contextlib.nullcontext()
        with ctx:
            loss = head(checkpoint(block, x, **_CHECKPOINTS[kind])).square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        grads.append([x.grad] + [p.grad.clone() for p in (*block.parameters(), *head.parameters())])
        block.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)


def test_transformers_gradient_checkpointing_inside_the_mode():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    stock = transformers.BertForSequenceClassification(cfg).train()
    slim = copy.deepcopy(stock)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1])
    results = []
    for model, mode in ((stock, False), (slim, True)):
        model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
        torch.manual_seed(2)
        with enabled() if mode else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(results[1][0], results[0][0])
    for name, grad in results[0][1].items():
        assert torch.equal(results[1][1][name], grad), name


@pytest.mark.slow
def test_compiled_model_inside_the_mode_is_one_graph():
    """dynamo cannot call the builtin the mode asks whether a checkpointed forward runs: ``fullgraph=True``
    raised (Unsupported), and without it every routed layer broke the graph (the compile sweep)."""
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
    model.eval().requires_grad_(False)  # input-only (style transfer, adversarial examples): bitwise stock's
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    expected_out = torch.compile(copy.deepcopy(model), backend="eager", fullgraph=True)(x)
    (expected,) = torch.autograd.grad(expected_out.sum(), x)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    with enabled():
        out = torch.compile(model, backend="eager", fullgraph=True)(x)
    (got,) = torch.autograd.grad(out.sum(), x)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(out, expected_out) and torch.equal(got, expected)
