"""gated_activation and the Python-formula activations against the stock expressions: bitwise outputs
and gradients in every dtype and requires_grad combination, and saved bytes at the analytical minimum."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tests._util import FLOAT_DTYPES, assert_same, grad_combos
from torch.utils.checkpoint import checkpoint

from slimgrad.functional.gated import ACTIVATIONS, gated_activation
from slimgrad.functional.hf_activations import FORMULA_ACTIVATIONS, gelu_new, gelu_python, quick_gelu
from slimgrad.measure import SavedTensors


def reference(kind, x):
    """The stock formulas, written out independently of slimgrad (transformers' expressions)."""
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if kind == "gelu_python":
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    raise AssertionError(kind)


FORMULAS = {"gelu_new": gelu_new, "gelu_python": gelu_python, "quick_gelu": quick_gelu}


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Wide range so every branch of the activations (saturation, near zero) is exercised.
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype)
    gate.view(-1)[:3] = torch.tensor([0.0, -0.0, 30.0]).to(dtype)
    up = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    return gate, up, g


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_gated_matches_stock_bitwise(kind, dtype):
    gate, up, g = inputs((3, 5, 12), dtype)
    nbytes = gate.numel() * gate.element_size()
    for rg_gate, rg_up in grad_combos(2):
        gs, us = gate.clone().requires_grad_(rg_gate), up.clone().requires_grad_(rg_up)
        gm, um = gate.clone().requires_grad_(rg_gate), up.clone().requires_grad_(rg_up)
        ys = reference(kind, gs) * us
        with SavedTensors() as kept:
            ym = gated_activation(gm, um, kind)
        what = f"{kind} {dtype} rg={rg_gate, rg_up}"
        assert_same(ym, ys, what=f"{what} output")
        # Minimum: dGate reads gate and up, dUp reads gate only (act(gate) is recomputed).
        expected = 2 * nbytes if rg_gate else nbytes if rg_up else 0
        assert kept.bytes == expected, what
        assert ym.requires_grad == ys.requires_grad
        if ys.requires_grad:
            ys.backward(g)
            ym.backward(g)
        assert_same(gm.grad, gs.grad, what=f"{what} dGate")
        assert_same(um.grad, us.grad, what=f"{what} dUp")


@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_stock_keeps_more_when_both_need_grad(kind):
    gate, up, _ = inputs((4, 8), torch.float32)
    with SavedTensors() as stock:
        reference(kind, gate.clone().requires_grad_()) * up.clone().requires_grad_()
    with SavedTensors() as slim:
        gated_activation(gate.clone().requires_grad_(), up.clone().requires_grad_(), kind)
    assert slim.bytes == 2 * gate.numel() * 4 < stock.bytes


def test_views_of_a_fused_projection():
    """Phi3's layout: gate and up are the two halves of one output (non-contiguous views)."""
    gate_up, _, _ = inputs((2, 3, 16), torch.float32)
    g = torch.randn(2, 3, 8)
    a, b = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    gs, us = (a * 1).chunk(2, dim=-1)
    gm, um = (b * 1).chunk(2, dim=-1)
    ys = us * F.silu(gs)
    with SavedTensors() as kept:
        ym = gated_activation(gm, um)
    assert kept.bytes == gate_up.numel() * 4  # both views share one storage, counted once
    ys.backward(g)
    ym.backward(g)
    assert_same(ym, ys, what="output")
    assert_same(b.grad, a.grad, what="grad")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", FORMULA_ACTIVATIONS)
def test_formula_activations_bitwise_and_keep_only_input(kind, dtype):
    x, _, g = inputs((4, 7, 6), dtype, seed=1)
    for rg in (False, True):
        xs, xm = x.clone().requires_grad_(rg), x.clone().requires_grad_(rg)
        ys = reference(kind, xs)
        with SavedTensors() as kept:
            ym = FORMULAS[kind](xm)
        assert kept.bytes == (x.numel() * x.element_size() if rg else 0)
        assert_same(ym, ys, what=f"{kind} {dtype} output")
        if rg:
            with SavedTensors() as stock:
                reference(kind, x.clone().requires_grad_())
            assert stock.bytes > kept.bytes
            ys.backward(g)
            ym.backward(g)
        assert_same(xm.grad, xs.grad, what=f"{kind} {dtype} grad")


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint(reentrant):
    gate, up, g = inputs((3, 10), torch.float32)
    gs, us = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gm, um = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ys = reference("gelu_new", gs) * us
    ym = checkpoint(lambda a, b: gated_activation(a, b, "gelu_new") * 1, gm, um, use_reentrant=reentrant)
    ys.backward(g)
    ym.backward(g)
    assert_same(ym, ys, what="output")
    assert_same(gm.grad, gs.grad, what="dGate")
    assert_same(um.grad, us.grad, what="dUp")


def test_autocast_matches_stock():
    gate, up, g = inputs((4, 8), torch.float32)
    w = torch.randn(8, 8)
    outs = []
    for fn in (lambda a, b: reference("silu", a) * b, gated_activation):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(a @ w, b @ w)
        y.backward(g.to(y.dtype))
        outs.append((y, a.grad, b.grad))
    for (ym, *gm), (ys, *gs) in [(outs[1], outs[0])]:
        assert_same(ym, ys, what="output")
        for m, s in zip(gm, gs):
            assert_same(m, s, what="grad")


def test_double_backward_is_refused():
    gate, up, _ = inputs((3, 4), torch.float64)
    a, b = gate.requires_grad_(), up.requires_grad_()
    (da,) = torch.autograd.grad(gated_activation(a, b).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|twice"):
        da.sum().backward()


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="'activation'"):
        gated_activation(x, x, "relu")
    with pytest.raises(ValueError, match="'up'"):
        gated_activation(x, torch.randn(2, 4))
    with pytest.raises(ValueError, match="'up'"):
        gated_activation(x, x.double())
    with pytest.raises(TypeError, match="'gate'"):
        gated_activation([1.0], x)
    with pytest.raises(TypeError, match="'gate'"):
        gated_activation(torch.ones(2, 3, dtype=torch.long), x)
    with pytest.raises(TypeError, match="'input'"):
        gelu_new(torch.ones(3, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["silu", "gelu_new"])
def test_compile_fullgraph(kind):
    gate, up, g = inputs((4, 8), torch.float32)
    fn = torch.compile(lambda a, b: gated_activation(a, b, kind), fullgraph=True)
    gs, us = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gm, um = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ys = reference(kind, gs) * us
    ym = fn(gm, um)
    ys.backward(g)
    ym.backward(g)
    # Inductor fuses and may reorder element-wise arithmetic: equal within fp32 rounding.
    for m, s in ((ym, ys), (gm.grad, gs.grad), (um.grad, us.grad)):
        assert_same(m, s, exact=False, rtol=1e-5, atol=1e-6)
