"""Channels-first LayerNorms of transformers (ConvNextLayerNorm, LayerNorm2d copies) against the stock
modules: bitwise outputs and gradients for every requires_grad combination, dtype and memory format; x
and the statistics kept only when x's or the weight's gradient is requested."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm  # noqa: E402
from transformers.models.eomt.modeling_eomt import EomtLayerNorm2d  # noqa: E402
from transformers.models.vitdet.modeling_vitdet import VitDetLayerNorm  # noqa: E402

import slimgrad  # noqa: E402
from _util import FLOAT_DTYPES, assert_same, grad_combos  # noqa: E402
from slimgrad._registry import REPLACEMENTS  # noqa: E402
from slimgrad.functional import layer_norm_2d  # noqa: E402
from slimgrad.integrations import load_available  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

N, C, H, W = 2, 6, 3, 5


def _modules():
    return {
        "convnext-channels_first": ConvNextLayerNorm(C, eps=1e-6, data_format="channels_first"),
        "convnext-channels_last": ConvNextLayerNorm(C, eps=1e-6, data_format="channels_last"),
        "layernorm2d": EomtLayerNorm2d(C),
        "vitdet-formula": VitDetLayerNorm(C),
    }


def _swap(module):
    load_available()
    twin = copy.deepcopy(module)
    twin.__class__ = REPLACEMENTS[type(module)]
    return twin


@pytest.mark.parametrize("name", list(_modules()))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("need_x,need_w,need_b", grad_combos(3))
def test_matches_stock_and_keeps_the_minimum(name, dtype, layout, need_x, need_w, need_b):
    torch.manual_seed(0)
    stock = _modules()[name].to(dtype)
    with torch.no_grad():
        stock.weight.normal_()
        stock.bias.normal_()
    stock.weight.requires_grad_(need_w)
    stock.bias.requires_grad_(need_b)
    slim = _swap(stock)
    shape = (N, H, W, C) if name.endswith("channels_last") else (N, C, H, W)
    base = torch.randn(shape).to(dtype)
    if layout == "channels_last":
        base = base.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for module in (stock, slim):
        x = base.clone().requires_grad_(need_x)
        with SavedTensors(exclude=[module]) as kept:
            y = module(x)
        if y.requires_grad:
            y.backward(grad)
        results.append((y, x.grad, kept.bytes))
    (ys, gs, kept_stock), (ym, gm, kept_slim) = results
    assert_same(ym, ys, what="output")
    assert ym.stride() == ys.stride()
    assert_same(gm, gs, what="input grad")
    for p in ("weight", "bias"):
        assert_same(getattr(slim, p).grad, getattr(stock, p).grad, what=f"{p} grad")
    size = base.element_size()
    x_bytes = N * C * H * W * size
    if name == "vitdet-formula":
        # x alone; stock keeps, for dx, x - u twice (pow's and div's inputs) and sqrt(s + eps) per pixel,
        # and for dw the normalised x
        assert kept_slim == (x_bytes if (need_x or need_w) else 0)
        assert kept_stock == (2 * x_bytes + N * H * W * size if need_x else 0) + (x_bytes if need_w else 0)
        return
    # x (the permuted view shares its storage) + mean and rstd per pixel, in x's dtype on CPU
    x_and_stats = x_bytes + 2 * N * H * W * size
    assert kept_slim == (x_and_stats if (need_x or need_w) else 0)
    assert kept_stock == (x_and_stats if (need_x or need_w or need_b) else 0)


def test_register_class_takes_a_models_own_copy():
    from slimgrad.integrations.hf_layer_norm_2d import register_class

    class LayerNorm2d(torch.nn.Module):  # segment_anything/modeling/common.py, verbatim
        def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(num_channels))
            self.bias = torch.nn.Parameter(torch.zeros(num_channels))
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            x = (x - u) / torch.sqrt(s + self.eps)
            x = self.weight[:, None, None] * x + self.bias[:, None, None]
            return x

    class Shifted(LayerNorm2d):
        def forward(self, x):
            return super().forward(x) + 1

    assert register_class(LayerNorm2d) and not register_class(Shifted)
    stock = LayerNorm2d(C)
    slim = slimgrad.convert(stock)
    x = torch.randn(N, C, H, W)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(xs).sum().backward()
    slim(xm).sum().backward()
    assert_same(xm.grad, xs.grad, what="input grad")
    assert_same(slim.weight.grad, stock.weight.grad, what="weight grad")


def test_formula_under_autocast_and_checkpoint():
    stock = VitDetLayerNorm(C)
    slim = _swap(stock)
    base = torch.randn(N, C, H, W)
    results = []
    for module, reentrant in ((stock, None), (slim, None), (slim, True), (slim, False)):
        module.zero_grad()
        x = base.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x) if reentrant is None else torch.utils.checkpoint.checkpoint(module, x,
                                                                                         use_reentrant=reentrant)
        y.float().sum().backward()
        results.append((y, x.grad, module.weight.grad.clone()))
    for y, gx, gw in results[1:]:
        assert_same(y, results[0][0], what="output")
        assert_same(gx, results[0][1], what="input grad")
        assert_same(gw, results[0][2], what="weight grad")


def test_functional_form():
    x = torch.randn(N, C, H, W, requires_grad=True)
    w, b = torch.randn(C, requires_grad=True), torch.randn(C, requires_grad=True)
    y = layer_norm_2d(x, (C,), w, b, 1e-6)
    ref = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (C,), w, b, 1e-6).permute(0, 3, 1, 2)
    assert_same(y, ref, what="output")
    with pytest.raises(ValueError, match="'input' must be 4-D"):
        layer_norm_2d(torch.randn(2, 3), (3,))


@pytest.mark.parametrize("need_x,need_w,need_b", grad_combos(3))
def test_stock_node_where_nothing_is_saved(need_x, need_w, need_b):
    # x or the weight trains: slimgrad would keep what stock keeps, so stock's own node runs (no extra per-call
    # cost); the bias alone: slimgrad's node, which keeps nothing.
    x = torch.randn(N, C, H, W, requires_grad=need_x)
    w, b = torch.randn(C, requires_grad=need_w), torch.randn(C, requires_grad=need_b)
    y = layer_norm_2d(x, (C,), w, b, 1e-6)
    if not (need_x or need_w or need_b):
        assert y.grad_fn is None
        return
    node = type(y.grad_fn.next_functions[0][0]).__name__
    if need_x or need_w:
        assert node == "NativeLayerNormBackward0"
    else:
        assert node != "NativeLayerNormBackward0"


def test_converted_in_a_model_and_by_source_only(monkeypatch):
    load_available()
    model = torch.nn.Sequential(ConvNextLayerNorm(C, data_format="channels_first"), EomtLayerNorm2d(C),
                                VitDetLayerNorm(C))
    slim, report = slimgrad.convert(model, report=True)
    assert type(slim[0]) is REPLACEMENTS[ConvNextLayerNorm]
    assert type(slim[1]) is REPLACEMENTS[EomtLayerNorm2d]
    assert type(slim[2]) is REPLACEMENTS[VitDetLayerNorm]  # the Python formula, same source
    # a forward edited after verification is left alone and reported
    monkeypatch.setattr(EomtLayerNorm2d, "forward", lambda self, x: x)
    slim, report = slimgrad.convert(model, report=True)
    assert type(slim[1]) is EomtLayerNorm2d
    assert "changed after slimgrad verified its source" in str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["convnext-channels_first", "layernorm2d", "vitdet-formula"])
def test_compile_fullgraph(name):
    torch._dynamo.reset()
    stock = _modules()[name]
    slim = torch.compile(_swap(stock), fullgraph=True)
    base = torch.randn(N, C, H, W)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    stock(xs).sum().backward()
    slim(xm).sum().backward()
    assert_same(xm.grad, xs.grad, exact=False, rtol=1e-5, atol=1e-5, what="input grad")  # compiled kernels
