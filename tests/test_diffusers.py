"""diffusers' GEGLU / SwiGLU / ApproximateGELU (and FeedForward built from them) against stock: bitwise
outputs and gradients for every requires_grad combination and dtype, bytes kept from shapes."""

from __future__ import annotations

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers.models.activations import GEGLU, GELU, ApproximateGELU, SwiGLU  # noqa: E402
from diffusers.models.attention import FeedForward  # noqa: E402

import slimgrad  # noqa: E402
from _util import FLOAT_DTYPES, assert_same, grad_combos  # noqa: E402
from slimgrad._registry import REPLACEMENTS  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

TOKENS, DIM_IN, DIM_OUT = (2, 5), 8, 6


def _swap(module):
    slimgrad.integrations.load_available()
    twin = copy.deepcopy(module)
    twin.__class__ = REPLACEMENTS[type(module)]
    return twin


def _step(module, x, grad_seed=1):
    with SavedTensors(exclude=[module]) as kept:
        out = module(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    if out.requires_grad:
        out.backward(g)
    return out, kept.bytes


def _bytes(n, dtype):
    return n * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("cls", [GEGLU, SwiGLU, ApproximateGELU])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("need_x,need_w,need_b", grad_combos(3))
def test_matches_stock_and_keeps_the_minimum(cls, dtype, need_x, need_w, need_b):
    torch.manual_seed(0)
    stock = cls(DIM_IN, DIM_OUT).to(dtype)
    stock.proj.weight.requires_grad_(need_w)
    stock.proj.bias.requires_grad_(need_b)
    slim = _swap(stock)
    base = torch.randn(*TOKENS, DIM_IN).to(dtype)
    xs, xm = base.clone().requires_grad_(need_x), base.clone().requires_grad_(need_x)
    ys, kept_stock = _step(stock, xs)
    ym, kept_slim = _step(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    for name in ("weight", "bias"):
        assert_same(getattr(slim.proj, name).grad, getattr(stock.proj, name).grad, what=f"{name} grad")
    rows = TOKENS[0] * TOKENS[1]
    width = 2 * DIM_OUT if cls is not ApproximateGELU else DIM_OUT  # the projection output
    anything = need_x or need_w or need_b
    # slimgrad: the projection output (gate and hidden, or the activation's input) whenever anything needs
    # grad, plus x for the weight's gradient
    expected = (_bytes(rows * width, dtype) if anything else 0) + (_bytes(rows * DIM_IN, dtype) if need_w else 0)
    assert kept_slim == expected
    # stock also keeps act(gate) (d), or ApproximateGELU's sigmoid (d): a third / a half more
    if anything:
        assert kept_stock == expected + _bytes(rows * DIM_OUT, dtype)


@pytest.mark.parametrize("activation_fn", ["geglu", "swiglu", "gelu-approximate", "gelu"])
def test_feed_forward_converts(activation_fn):
    torch.manual_seed(0)
    stock = FeedForward(DIM_IN, mult=2, activation_fn=activation_fn, dropout=0.0).to(torch.bfloat16)
    slim = slimgrad.convert(stock)
    act_stock, act_slim = stock.net[0], slim.net[0]
    if isinstance(act_stock, GELU):
        assert type(act_slim) is GELU  # F.gelu keeps only its input already: nothing to convert
    else:
        assert type(act_slim) is REPLACEMENTS[type(act_stock)]
    base = torch.randn(*TOKENS, DIM_IN, dtype=torch.bfloat16)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    ys, kept_stock = _step(stock, xs)
    ym, kept_slim = _step(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    for (n, ps), pm in zip(stock.named_parameters(), slim.parameters()):
        assert_same(pm.grad, ps.grad, what=n)
    if not isinstance(act_stock, GELU):
        assert kept_slim < kept_stock


def test_deprecated_scale_argument_runs_diffusers_forward():
    stock = GEGLU(DIM_IN, DIM_OUT)
    slim = _swap(stock)
    x = torch.randn(3, DIM_IN, requires_grad=True)
    with pytest.warns(FutureWarning):
        ym = slim(x, scale=1.0)
    assert_same(ym, stock(x), what="output")


def test_autocast_matches_stock():
    torch.manual_seed(0)
    stock = GEGLU(DIM_IN, DIM_OUT)
    slim = _swap(stock)
    base = torch.randn(*TOKENS, DIM_IN)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, _ = _step(stock, xs)
        ym, _ = _step(slim, xm)
    assert ym.dtype == torch.bfloat16
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    assert_same(slim.proj.weight.grad, stock.proj.weight.grad, what="weight grad")


def test_edited_class_is_left_alone(monkeypatch):
    slimgrad.integrations.load_available()
    monkeypatch.setattr(ApproximateGELU, "forward", lambda self, x: self.proj(x))
    model, report = slimgrad.convert(torch.nn.Sequential(ApproximateGELU(4, 4)), report=True)
    assert type(model[0]) is ApproximateGELU
    assert "changed after slimgrad verified its source" in str(report)


def test_swiglu_with_another_activation_is_left_alone():
    m = SwiGLU(4, 4)
    m.activation = torch.nn.GELU()
    model, report = slimgrad.convert(torch.nn.Sequential(m), report=True)
    assert type(model[0]) is SwiGLU
    assert "not nn.SiLU" in str(report)
