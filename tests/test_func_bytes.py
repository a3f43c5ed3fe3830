"""Under torch.func, slimgrad keeps what it keeps in eager (each family's one Function, in functorch's
``setup_context`` form: ``slimgrad.functional._transforms``).

Saved-tensor hooks are refused inside ``torch.func.grad``, so bytes are read from the autograd graph itself
(:func:`slimgrad.measure.saved_in_graph`, checked here against :func:`slimgrad.saved_bytes` in eager). For each
family, under ``vmap(grad)`` (per-sample gradients of the parameters, or input gradients) and under ``grad``:
the values equal stock's under the same transform, and the bytes the graph keeps equal what eager slimgrad
keeps for the same batch, strictly less than stock's wherever eager slimgrad keeps less.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests._util import assert_same
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import slimgrad
from slimgrad import csrc
from slimgrad.functional import gated_activation
from slimgrad.functional.hf_activations import gelu_new
from slimgrad.measure import graph_saved_bytes, saved_bytes, saved_in_graph

# name -> (stock module factory, per-sample input shape, training cases: "params" (per-sample parameter
# gradients, input constant), "bias" (the same for the bias alone, the weight frozen) and/or "input" (input
# gradients, parameters frozen)). Per-sample sizes are
# multiples of 8 so that a per-sample bit-packed mask takes what the batch's mask takes.
FAMILIES = {
    "conv": (lambda: nn.Conv2d(4, 4, 3, padding=1), (4, 6, 6), ("params", "bias", "input")),
    "conv-reflect": (lambda: nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), (4, 6, 6), ("params", "input")),
    "conv-transpose": (lambda: nn.ConvTranspose2d(4, 4, 2, stride=2), (4, 6, 6), ("params", "input")),
    "conv1d": (lambda: nn.Conv1d(4, 4, 3), (4, 8), ("input",)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular"), (2, 4, 4, 4), ("params", "input")),
    "bn-eval": (lambda: nn.BatchNorm2d(4).eval(), (4, 6, 6), ("bias", "input")),
    "relu": (lambda: nn.ReLU(), (4, 6, 6), ("input",)),
    "relu-inplace": (lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True)), (4, 6, 6), ("input",)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.1), (4, 6, 6), ("input",)),
    "relu6": (lambda: nn.ReLU6(), (4, 6, 6), ("input",)),
    "hardtanh-inplace": (lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.Hardtanh(-0.5, 0.5, inplace=True)), (4, 6, 6),
                         ("input",)),
    "hardsigmoid": (lambda: nn.Hardsigmoid(), (4, 6, 6), ("input",)),
    "threshold": (lambda: nn.Threshold(0.1, 20.0), (4, 6, 6), ("input",)),
    "max-pool": (lambda: nn.MaxPool2d(3, 2, 1), (4, 6, 6), ("input",)),
    "max-pool1d-indices": (lambda: _First(nn.MaxPool1d(2, return_indices=True)), (4, 8), ("input",)),
    "avg-pool": (lambda: nn.AvgPool2d(2), (4, 6, 6), ("input",)),
    "adaptive": (lambda: nn.AdaptiveAvgPool2d(2), (4, 6, 6), ("input",)),
    "layer-norm": (lambda: nn.LayerNorm(8), (4, 8), ("params", "bias", "input")),
    "group-norm": (lambda: nn.GroupNorm(2, 4), (4, 6, 6), ("params", "bias", "input")),
    "rms-norm": (lambda: nn.RMSNorm(8), (4, 8), ("params", "input")),
    "rms-norm-bf16": (lambda: nn.RMSNorm(8).bfloat16(), (4, 8), ("params", "input")),
    "conv-cl": (lambda: nn.Conv2d(4, 4, 3, padding=1), (4, 6, 6), ("bias", "input")),
    "bn-eval-cl": (lambda: nn.BatchNorm2d(4).eval(), (4, 6, 6), ("input",)),
    "max-pool-cl": (lambda: nn.MaxPool2d(3, 2, 1), (4, 6, 6), ("input",)),
    "avg-pool-cl": (lambda: nn.AvgPool2d(3, 2, 1), (4, 6, 6), ("input",)),
}
# Stock under torch.func runs group norm's backward as its double-differentiable formula (functorch's grad
# runs backward with grad mode on), 1-2 ulp from the native kernel that stock eager and slimgrad run.
NOT_BITWISE = {"group-norm"}


class _First(nn.Module):
    """A layer returning (output, indices), reduced to its output."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def _run(model, x, case, differentiate):
    """Per-sample gradients under vmap(grad) of ``model`` on each ``x[i:i+1]``: of the trainable parameters
    ("params"), of the bias alone ("bias") or of the input ("input"). Returns (gradients, bytes the graph
    behind the output keeps)."""
    params = {k: v.detach() for k, v in model.named_parameters() if case != "bias" or k.endswith("bias")}
    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in params}
    buffers = dict(model.named_buffers())
    kept = []

    def loss(p, xi):
        out = functional_call(model, ({**p, **frozen}, buffers), (xi.unsqueeze(0),))
        kept.append(graph_saved_bytes(out, exclude=[model]))
        return out.square().sum()

    if differentiate == "vmap":
        fn = vmap(grad(loss, argnums=1 if case == "input" else 0), in_dims=(None, 0))
        out = fn(params, x)
    else:
        out = grad(loss, argnums=1 if case == "input" else 0)(params, x[0].clone())
    return out, kept[-1]


def _eager_bytes(model, x, case):
    """What eager slimgrad (or stock) keeps for the same batch and the same requested gradients."""
    model = copy.deepcopy(model).requires_grad_(case == "params")
    for name, p in model.named_parameters():
        p.requires_grad_(case == "params" or (case == "bias" and name.endswith("bias")))
    x = x.clone().requires_grad_(case == "input")
    return saved_bytes(model, x)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("name,case", [(n, c) for n, (_, _, cases) in FAMILIES.items() for c in cases])
def test_family_keeps_what_eager_keeps(name, case, transform):
    make, shape, _ = FAMILIES[name]
    torch.manual_seed(0)
    stock = make()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn((4,) + shape, dtype=next(iter(stock.parameters()), torch.empty(0)).dtype)
    if name.endswith("-cl"):  # a channels-last batch (per-sample views have no memory format under vmap)
        x = x.contiguous(memory_format=torch.channels_last)
    (g_stock, b_stock), (g_slim, b_slim) = (_run(m, x, case, transform) for m in (stock, slim))
    exact = name not in NOT_BITWISE
    if case != "input":
        assert g_slim.keys() == g_stock.keys()
        for k in g_stock:
            assert_same(g_slim[k], g_stock[k], exact=exact, rtol=1e-6, atol=1e-5, what=k)
    else:
        assert_same(g_slim, g_stock, exact=exact, rtol=1e-6, atol=1e-5, what="input grad")
    batch = x if transform == "vmap" else x[:1].clone()
    eager_slim, eager_stock = _eager_bytes(slim, batch, case), _eager_bytes(stock, batch, case)
    assert b_slim == eager_slim, f"{name}/{case}: {b_slim} bytes under {transform}, eager slimgrad keeps {eager_slim}"
    assert b_stock == eager_stock  # the graph walk reads what the hooks count
    if eager_slim < eager_stock:
        assert b_slim < b_stock


def test_saved_in_graph_agrees_with_hooks_in_eager():
    """The graph walk counts what saved-tensor hooks count, on a mixed converted model and on stock."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 16, 4))
    slim = slimgrad.convert(copy.deepcopy(stock))
    for model in (stock, slim):
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        with csrc.disabled():  # the Python path: its Functions' saved tensors are readable from the graph
            hooks = saved_bytes(model, x)
            walked = saved_in_graph(model(x), exclude=[model])
        assert sum(r.nbytes for r in walked) == hooks
        assert hooks > 0
    if csrc.core() is not None:  # the core's C++ nodes hide them: refused, saying what to use instead
        with pytest.raises(ValueError, match="compiled core"):
            saved_in_graph(slim(torch.randn(2, 3, 8, 8, requires_grad=True)), exclude=[slim])


def _only_record_per_sample(module, x):
    """The one tensor ``module``'s graph saves under ``vmap(grad(...))`` over x's first dimension."""
    kept = []

    def f(xi):
        out = module(xi)
        kept.append(saved_in_graph(out))
        return out.sum()

    vmap(grad(f))(x)
    (record,) = kept[-1]
    return record


def test_relu_mask_bytes_are_one_bit_per_element():
    """An analytical count: per-sample input gradients through ReLU keep one bit per element (the mask),
    against the float output stock keeps."""
    record = _only_record_per_sample(slimgrad.convert(nn.Sequential(nn.ReLU())), torch.randn(5, 16, 8))
    assert record.dtype == torch.uint8 and record.nbytes == 5 * 16 * 8 // 8


def test_max_pool_keeps_positions():
    """Per-sample max pooling keeps one uint8 window position per output, not the input and int64 indices."""
    record = _only_record_per_sample(slimgrad.convert(nn.MaxPool2d(2)), torch.randn(3, 2, 8, 8))
    assert record.dtype == torch.uint8 and record.nbytes == 3 * 2 * 4 * 4


def _per_sample(fn, *args):
    """vmap(grad) of ``fn(*args).square().sum()`` over every argument; returns (gradients, bytes kept)."""
    kept = []

    def f(*a):
        out = fn(*a)
        kept.append(graph_saved_bytes(out))
        return out.square().sum()

    return vmap(grad(f, argnums=tuple(range(len(args)))))(*args), kept[-1]


@pytest.mark.parametrize("which", ["gated", "gelu_new"])
def test_gated_and_formula_activations(which):
    """The gated MLP activation keeps gate and up (stock: also silu(gate)); ``gelu_new`` keeps its input only
    (stock: every intermediate of the formula). Values equal autograd on the same slimgrad call outside
    transforms (bitwise stock's in eager; under functorch stock's silu backward is its double-differentiable
    formula, a rounding apart)."""
    torch.manual_seed(0)
    gate, up = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    if which == "gated":
        slim, stock, args = (lambda g, u: gated_activation(g, u, "silu")), (lambda g, u: nn.functional.silu(g) * u), (
            gate, up)
    else:
        slim, args = gelu_new, (gate,)
    got, kept = _per_sample(slim, *args)
    assert kept == len(args) * gate.numel() * 4
    leaves = [a.clone().requires_grad_() for a in args]
    slim(*leaves).square().sum().backward()
    for a, b in zip(got, leaves):
        assert_same(a, b.grad, exact=False, rtol=1e-6, atol=1e-6)
    if which == "gated":
        _, stock_kept = _per_sample(stock, *args)
        assert stock_kept == 3 * gate.numel() * 4
    else:
        from transformers.activations import NewGELUActivation

        _, stock_kept = _per_sample(NewGELUActivation(), *args)
        assert stock_kept > kept


def test_jacrev_and_functional_call_use_the_twins():
    """jacrev over a converted conv + ReLU equals stock's; the graph keeps the weight and a bit mask, no input."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU()).requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 4, 4)
    kept = []

    def f(model):
        def g(xx):
            out = functional_call(model, dict(model.named_parameters()), (xx.unsqueeze(0),))
            kept.append(graph_saved_bytes(out, exclude=[model]))
            return out
        return g

    j_stock = jacrev(f(stock))(x)
    j_slim = jacrev(f(slim))(x)
    assert_same(j_slim, j_stock)
    assert kept == [4 * 4 * 4 * 4 + 2 * 4 * 4 * 4, 4 * 4 * 4 // 8]  # stock: conv input + relu output; slim: mask


def test_nested_grad_and_forward_mode_run_stock():
    """Twins serve one reverse-mode level (plus vmaps); grad of grad and forward mode (jacfwd, hessian) run
    stock's computation, with stock's numbers."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(2, 2, 3), nn.ReLU(), nn.MaxPool2d(2)).double()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    for transform in (torch.func.hessian, torch.func.jacfwd, lambda f: grad(lambda xx: grad(f)(xx).square().sum())):
        got = [transform(lambda xx, m=m: m(xx.unsqueeze(0)).square().sum())(x) for m in (stock, slim)]
        assert_same(got[1], got[0])


def test_lora_cast_keeps_x_once_in_its_own_dtype():
    """A bf16 base layer with fp32 adapters (PEFT's default upcast): stock keeps an fp32 copy of x per adapted
    layer, slimgrad x once in bf16, under vmap(grad) as in eager; per-sample adapter gradients equal stock's."""
    from slimgrad.functional.lora import LoraAdapter, lora_linear

    torch.manual_seed(0)
    w = torch.randn(6, 8).bfloat16()
    A, B = torch.randn(2, 8), torch.randn(6, 2)
    x = torch.randn(3, 5, 8).bfloat16()

    def stock(xi, a, b):
        # PEFT's lora.Linear: base result + B(A(x cast to the adapters' dtype)) * scaling, cast back
        u = nn.functional.linear(nn.functional.linear(xi.float(), a), b) * 0.5
        return (nn.functional.linear(xi, w) + u).to(torch.bfloat16)

    def slim(xi, a, b):
        return lora_linear(xi, w, None, [LoraAdapter(a, b, 0.5)])

    got, kept = [], []
    for fn in (stock, slim):
        def loss(a, b, xi, fn=fn):
            out = fn(xi, a, b)
            kept.append(saved_in_graph(out, exclude=[w, A, B]))  # the weights, as parameters are
            return out.float().square().sum()

        got.append(vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(A, B, x))
    for a, b in zip(got[1], got[0]):
        assert_same(a, b, exact=False, rtol=1e-5, atol=1e-5)
    stock_bytes, slim_bytes = (sum(r.nbytes for r in k) for k in kept)
    t_bytes = 3 * 5 * 2 * 4  # A(x), fp32, for dB
    assert slim_bytes == x.numel() * 2 + t_bytes  # x once, bf16
    # x's fp32 copy, and the scaling 0.5, which stock's product keeps as a 0-d fp64 tensor
    assert stock_bytes == x.numel() * 4 + t_bytes + 8


def test_func_policy_stock_keeps_what_stock_keeps():
    """``func_policy("stock")`` trades the saving for stock's speed under transforms: stock's bytes and
    numbers; the default policy is restored after the block; a wrong value is refused by name."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2)).requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(3, 2, 6, 6)
    (g_stock, b_stock), (g_save, b_save) = (_run(m, x, "input", "vmap") for m in (stock, slim))
    with slimgrad.functional.func_policy("stock"):
        g_slim, b_slim = _run(slim, x, "input", "vmap")
    assert slimgrad.functional.get_func_policy() == "save"
    assert_same(g_slim, g_stock)
    assert_same(g_save, g_stock)
    assert b_slim == b_stock and b_save < b_stock
    with pytest.raises(ValueError, match="set_func_policy's argument 'value'.*slow"):
        slimgrad.functional.set_func_policy("slow")
