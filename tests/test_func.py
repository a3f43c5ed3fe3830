"""torch.func on converted models: ``grad``, ``vmap``, ``jacrev`` and ``functional_call`` give stock's numbers.

Under a transform each slimgrad Function runs itself where it serves the transform stack, else its stock
computation (its class's ``stock``: ``slimgrad.functional._transforms``): the same kernels or the reference
formulas, so results equal stock's. Tested per family,
for per-sample gradients (``vmap(grad(loss))``, the DP-SGD recipe) and input gradients on a converted CNN
and on an LLM block with peft LoRA adapters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests._util import assert_same
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import slimgrad
from slimgrad.functional import fused_linear_cross_entropy, gated_activation
from slimgrad.functional.hf_activations import gelu_new
from slimgrad.measure import graph_saved_bytes, saved_in_graph
from slimgrad.models.cnn import build_model

FAMILIES = {
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 6, 6)),
    "conv-reflect-frozen": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect").requires_grad_(False),
                            (3, 6, 6)),
    "conv-transpose": (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), (3, 6, 6)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), (3, 8)),
    "bn-eval": (lambda: nn.BatchNorm2d(3).eval(), (3, 6, 6)),
    "relu": (lambda: nn.ReLU(), (3, 6, 6)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.1), (3, 6, 6)),
    "max-pool": (lambda: nn.MaxPool2d(3, 2, 1), (3, 6, 6)),
    "avg-pool": (lambda: nn.AvgPool2d(2), (3, 6, 6)),
    "adaptive-int": (lambda: nn.AdaptiveAvgPool2d(2), (3, 6, 6)),
    "layer-norm": (lambda: nn.LayerNorm(6), (3, 6)),
    "group-norm": (lambda: nn.GroupNorm(1, 3), (3, 6, 6)),
    "rms-norm": (lambda: nn.RMSNorm(6), (3, 6)),
}


def _loss_fn(model):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, x):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return out.square().sum()

    return params, loss


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_grad_vmap_jacrev(name):
    """Per-sample parameter gradients (vmap over grad of functional_call), input gradients (grad) and a
    Jacobian (jacrev): converted equals stock, bitwise where stock's own kernels run."""
    make, shape = FAMILIES[name]
    torch.manual_seed(0)
    stock = make()
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn((4,) + shape)
    results = []
    for model in (stock, slim):
        params, loss = _loss_fn(model)
        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x) if params else {}
        input_grad = vmap(grad(loss, argnums=1), in_dims=(None, 0))(params, x)
        jac = jacrev(lambda xx, m=model: m(xx.unsqueeze(0)).sum(0))(x[0])
        results.append((per_sample, input_grad, jac))
    (ps_s, ig_s, j_s), (ps_m, ig_m, j_m) = results
    assert ps_m.keys() == ps_s.keys()
    for k in ps_s:
        assert_same(ps_m[k], ps_s[k], what=f"per-sample grad {k}")
    assert_same(ig_m, ig_s, what="input grad")
    assert_same(j_m, j_s, what="jacobian")


def test_functional_families_under_grad():
    """Gated MLP activation, transformers' formula activations and the chunked loss: torch.func.grad equals
    autograd on the same slimgrad call outside any transform (and the stock formula)."""
    torch.manual_seed(0)
    gate, up, h = torch.randn(4, 8), torch.randn(4, 8), torch.randn(5, 8)
    w, target = torch.randn(11, 8), torch.randint(0, 11, (5,))

    def f(g, u, hh, ww):
        return (gated_activation(g, u, "silu").sum() + gelu_new(g).square().sum()
                + fused_linear_cross_entropy(hh, ww, target, chunk_size=2))

    got = grad(f, argnums=(0, 1, 2, 3))(gate, up, h, w)
    leaves = [t.clone().requires_grad_() for t in (gate, up, h, w)]
    f(*leaves).backward()
    for i, (a, b) in enumerate(zip(got, leaves)):
        assert_same(a, b.grad, exact=False, rtol=1e-5, atol=1e-6, what=f"argument {i}")


def _cnn_case(model, x, y, case):
    """Per-sample gradients of the trainable parameters ("params") or of the input ("input": every weight
    constant), and the bytes the graph behind the logits keeps under vmap(grad)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v for k, v in model.named_parameters() if not v.requires_grad}
    buffers = dict(model.named_buffers())
    kept = []

    def loss(p, xi, yi):
        logits = functional_call(model, ({**p, **frozen}, buffers), (xi.unsqueeze(0),))
        kept.append(graph_saved_bytes(logits, exclude=[model]))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    return vmap(grad(loss, argnums=0 if case == "params" else 1), in_dims=(None, 0, 0))(params, x, y), kept[-1]


@pytest.mark.parametrize("case", ["params", "input"])
def test_per_sample_gradients_of_a_converted_cnn(case):
    """DP-SGD's recipe on a converted ResNet (batch norm in eval, as per-sample training requires, frozen
    stem): per-sample gradients and input gradients equal stock's, and the graph keeps what eager slimgrad
    keeps for the same batch, less than stock (the Functions' own saving under torch.func: the frozen stem
    keeps no input, max pooling positions; for input gradients with every weight frozen, convolutions and
    batch norms keep no activation, ReLUs a bit mask)."""
    torch.manual_seed(0)
    stock = build_model("resnet18", width_scale=0.125, num_classes=3).eval()
    stock.conv1.requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 2, 1])
    eager = []
    for model in (stock, slim):  # first calls on fresh copies (ReLU's keep-the-output rule learns per call)
        m = copy.deepcopy(model)
        if case == "input":
            m.requires_grad_(False)
        eager.append(slimgrad.saved_bytes(m, x.clone().requires_grad_(case == "input")))
    (g_stock, b_stock), (g_slim, b_slim) = (_cnn_case(m, x, y, case) for m in (stock, slim))
    if case == "params":
        for k in g_stock:
            assert_same(g_slim[k], g_stock[k], exact=False, rtol=1e-5, atol=1e-6, what=k)
    else:
        assert_same(g_slim, g_stock, exact=False, rtol=1e-5, atol=1e-6, what="input grad")
    assert (b_stock, b_slim) == tuple(eager)
    assert b_slim < b_stock / (1.2 if case == "params" else 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["params", "input"])
def test_per_sample_gradients_of_an_llm_block_with_lora(case, dtype):
    """An RMSNorm + gated MLP block (Hugging Face Llama classes) with peft LoRA adapters, converted: per-sample
    gradients of the adapters ("params") and input gradients ("input", adapters constant) equal stock's, and
    the graph keeps what eager slimgrad keeps for the same batch, less than stock: the gated activation keeps
    gate and up (stock also silu(gate)); in bf16 (adapters upcast to fp32, peft's default) the LoRA layers
    keep x once in bf16 (stock an fp32 copy per adapted layer)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    cfg = LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(16), LlamaMLP(cfg)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    torch.manual_seed(0)
    stock = peft.get_peft_model(Block().to(dtype), peft.LoraConfig(
        r=2, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False))
    slim = slimgrad.convert(copy.deepcopy(stock))
    assert any(type(m).__module__.startswith("slimgrad") for m in slim.modules())
    x = torch.randn(3, 5, 16, dtype=dtype)
    out, kept, eager = [], [], []
    for model in (stock, slim):
        params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
        frozen = {k: v for k, v in model.named_parameters() if not v.requires_grad}
        box = []

        def loss(p, xi, m=model, fz=frozen, box=box):
            y = functional_call(m, {**p, **fz}, (xi.unsqueeze(0),))
            # Under functorch a Python-number factor (LoRA's scaling) is saved as a 0-d fp64 tensor, in eager as a
            # number: 0-d records are left out to compare with eager.
            box.append(sum(r.nbytes for r in saved_in_graph(y, exclude=[m]) if r.shape))
            return y.float().square().mean()

        out.append(vmap(grad(loss, argnums=0 if case == "params" else 1), in_dims=(None, 0))(params, x))
        kept.append(box[-1])
        m = copy.deepcopy(model)
        if case == "input":
            m.requires_grad_(False)
        eager.append(slimgrad.saved_bytes(m, x.clone().requires_grad_(case == "input")))
    tol = dict(exact=False, rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(exact=False, rtol=2e-2,
                                                                                      atol=2e-2)
    if case == "params":
        for k in out[0]:
            assert_same(out[1][k], out[0][k], what=k, **tol)
    else:
        assert_same(out[1], out[0], what="input grad", **tol)
    assert kept == eager
    assert kept[1] < kept[0]


def test_eager_outside_transforms_still_runs_the_functions():
    """The fallback is only taken under a transform: a plain step still keeps slimgrad's bytes."""
    slim = slimgrad.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2)).requires_grad_(False))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    assert slimgrad.saved_bytes(slim, x) == 2 * 4 * 3 * 3  # max pool's 1-byte positions only


def test_lora_conv_and_layer_norm_2d_run_stock_under_transforms(monkeypatch):
    """peft LoRA on a convolution (bf16 base, fp32 adapters: slimgrad's LoRA-conv Function) and the Hugging Face
    LayerNorm2d formula (VitDet's), which have no twin, run their stock computation under vmap(grad) (they were
    refused before): per-sample gradients equal stock's."""
    peft = pytest.importorskip("peft")
    from transformers.models.vitdet.modeling_vitdet import VitDetLayerNorm

    from slimgrad.functional.layer_norm_2d import LayerNorm2dFormulaFunction
    from slimgrad.functional.lora_conv import LoraConvFunction

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 4, 3), VitDetLayerNorm(4)

        def forward(self, x):
            return self.norm(self.conv(x))

    torch.manual_seed(0)
    stock = peft.get_peft_model(Net().bfloat16(), peft.LoraConfig(r=2, target_modules=["conv"],
                                                                  init_lora_weights=False))
    for n, p in stock.named_parameters():
        p.requires_grad_("lora_" in n or "norm" in n)
    slim = slimgrad.convert(copy.deepcopy(stock))
    ran = []
    for cls in (LoraConvFunction, LayerNorm2dFormulaFunction):
        fn, name = cls.stock, cls.__name__
        monkeypatch.setattr(cls, "stock", staticmethod(lambda *a, fn=fn, name=name: (ran.append(name), fn(*a))[1]))
    x = torch.randn(3, 3, 6, 6, dtype=torch.bfloat16)
    out = []
    for model in (stock, slim):
        params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
        frozen = {k: v for k, v in model.named_parameters() if not v.requires_grad}

        def loss(p, xi, m=model, fz=frozen):
            return functional_call(m, {**p, **fz}, (xi.unsqueeze(0),)).float().square().sum()

        out.append(vmap(grad(loss), in_dims=(None, 0))(params, x))
    assert set(ran) == {"LoraConvFunction", "LayerNorm2dFormulaFunction"}
    for k in out[0]:
        assert_same(out[1][k], out[0][k], what=k)


@pytest.mark.parametrize("transform", ["vmap-different", "vmap-same", "vmap-no-grad", "jvp"])
def test_dropout_without_a_gradient_under_transforms(transform):
    """vmap and jvp hand dropout wrapped tensors that do not require grad: it runs stock's op there (the CPU
    kernels cannot read a wrapped tensor: "Cannot access data pointer of Tensor that doesn't have storage").
    Same numbers as stock under the same seed."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 2))
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(4, 6)
    outs = []
    for model in (stock, slim):
        torch.manual_seed(1)
        if transform == "jvp":
            outs.append(torch.func.jvp(model, (x,), (torch.ones_like(x),)))
        elif transform == "vmap-no-grad":
            with torch.no_grad():
                outs.append(torch.func.vmap(model, randomness="different")(x))
        else:
            outs.append(torch.func.vmap(model, randomness=transform.split("-")[1])(x))
    for a, b in zip(torch.utils._pytree.tree_leaves(outs[0]), torch.utils._pytree.tree_leaves(outs[1])):
        assert torch.equal(a, b)


def test_gated_mlp_under_grad_gives_stock_eagers_gradients():
    """Under torch.func.grad the converted Llama MLP gives stock *eager*'s parameter gradients bitwise; stock
    under functorch rounds otherwise (~5e-8 relative, README's Exactness list), so against that it is close."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    stock = LlamaMLP(transformers.LlamaConfig(hidden_size=32, intermediate_size=64))
    slim = slimgrad.convert(copy.deepcopy(stock))
    assert type(slim) is not LlamaMLP
    x = torch.randn(4, 8, 32)

    def loss(model, params):
        return functional_call(model, params, (x,)).pow(2).mean()

    eager = copy.deepcopy(stock)
    loss(eager, dict(eager.named_parameters())).backward()
    frozen = {k: v.detach() for k, v in slim.named_parameters()}
    under_grad = grad(lambda q: loss(slim, q))(frozen)
    stock_under_grad = grad(lambda q: loss(stock, q))({k: v.detach() for k, v in stock.named_parameters()})
    for name, p in eager.named_parameters():
        assert torch.equal(under_grad[name], p.grad), name
        torch.testing.assert_close(under_grad[name], stock_under_grad[name], rtol=1e-6, atol=1e-8)


def _ensemble(models, input_grad):
    from torch.func import stack_module_state

    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_(input_grad)
    out = vmap(lambda p, b, xx: functional_call(base, (p, b), (xx,)), in_dims=(0, 0, None))(params, buffers, x)
    out.pow(2).sum().backward()
    grads = {k: v.grad for k, v in params.items() if v.grad is not None}
    if input_grad:
        grads["<input>"] = x.grad
    return out.detach(), grads


@pytest.mark.parametrize("case", ["all", "input", "train-bn"])
def test_an_ensemble_under_vmap_with_an_in_place_op_after_batch_norm(case):
    """torch.func's ensembling recipe (stack_module_state + vmap over functional_call) on Conv-BN-ReLU(inplace) raised
    "Output 0 of VmappedBatchNormFunction is a view and is being modified inplace" where stock runs (every
    ResNet-like block; the param sweep): batch norm runs stock's op under stacked weights. The conv's input gradient
    there comes from its own backward per model, within fp32 rounding of stock's vmap rule (README, Exactness)."""
    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))
        return m.train(case == "train-bn").requires_grad_(case != "input")

    stock = [build(i) for i in range(3)]
    slim = [slimgrad.convert(build(i)) for i in range(3)]
    out, grads = _ensemble(stock, case == "input")
    got, got_grads = _ensemble(slim, case == "input")
    assert torch.equal(got, out) and got_grads.keys() == grads.keys()
    for name, expected in grads.items():
        if name == "<input>":
            torch.testing.assert_close(got_grads[name], expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
        else:
            assert torch.equal(got_grads[name], expected), name
