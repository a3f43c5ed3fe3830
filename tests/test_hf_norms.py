"""Hugging Face RMSNorm classes: each converted class gives its own forward's outputs and gradients bit for
bit, keeps the input plus one fp32 statistic per row, and a tiny Llama converts with the same logits/grads."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from tests._util import assert_same, grad_combos

import slimgrad
from slimgrad._registry import REPLACEMENTS
from slimgrad.measure import saved_bytes

transformers = pytest.importorskip("transformers")
from slimgrad.integrations import hf_norms  # noqa: E402

CLASSES = {  # module, class, casting style
    "llama": ("llama", "LlamaRMSNorm", "llama"),
    "mistral": ("mistral", "MistralRMSNorm", "llama"),
    "qwen2": ("qwen2", "Qwen2RMSNorm", "llama"),
    "qwen3": ("qwen3", "Qwen3RMSNorm", "llama"),
    "phi3": ("phi3", "Phi3RMSNorm", "llama"),
    "olmo2": ("olmo2", "Olmo2RMSNorm", "olmo2"),
    "gemma": ("gemma", "GemmaRMSNorm", "gemma"),
    "gemma2": ("gemma2", "Gemma2RMSNorm", "gemma"),
    "gemma3": ("gemma3", "Gemma3RMSNorm", "gemma"),
    "t5": ("t5", "T5LayerNorm", "t5"),
}


def _cls(key):
    module, name, _ = CLASSES[key]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def _pair(key, dtype, hidden=16):
    cls = _cls(key)
    hf_norms.register_loaded()
    assert cls in REPLACEMENTS, f"{cls.__name__} not registered"
    torch.manual_seed(0)
    stock = cls(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(-1.5, 1.5)
    slim = copy.deepcopy(stock)
    slim.__class__ = REPLACEMENTS[cls]
    return stock, slim


def minimum_bytes(style, x, rg_x, rg_w):
    """x + one fp32 rstd per row; fp32 styles keep an fp64 input as its fp32 copy; when only the weight
    trains, the normalised input the weight multiplies, when that is smaller (x's dtype in Llama/T5 style,
    fp32 in Olmo2/Gemma)."""
    if not (rg_x or rg_w):
        return 0
    rows = x.numel() // x.shape[-1]
    x_size = x.element_size()
    if style != "t5" and x.dtype == torch.float64:
        x_size = 4
    full = x.numel() * x_size + 4 * rows
    if rg_x:
        return full
    if style == "llama":
        normed = x.element_size()
    elif style == "t5":  # x·rstd promoted to at least fp32, cast to w's dtype when w is half
        normed = x.element_size() if x.dtype in (torch.float16, torch.bfloat16) else max(4, x.element_size())
    else:
        normed = 4
    return min(full, x.numel() * normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("key", list(CLASSES))
def test_matches_reference_bitwise(key, dtype):
    style = CLASSES[key][2]
    for rg_x, rg_w in grad_combos(2):
        stock, slim = _pair(key, dtype)
        for m in (stock, slim):
            m.weight.requires_grad_(rg_w)
        x0 = torch.randn(2, 3, 16).to(dtype)
        xs, xm = x0.clone().requires_grad_(rg_x), x0.clone().requires_grad_(rg_x)
        ys, ym = stock(xs), slim(xm)
        what = f"{key} {dtype} rg={(rg_x, rg_w)}"
        assert_same(ym, ys, what=f"{what} output")
        if ys.requires_grad:
            g = torch.randn(ys.shape).to(ys.dtype)
            ys.backward(g)
            ym.backward(g.clone())
        assert_same(xm.grad, xs.grad, what=f"{what} dx")
        assert_same(slim.weight.grad, stock.weight.grad, what=f"{what} dw")
        if not rg_w:
            assert slim.weight.grad is None
        x = x0.clone().requires_grad_(rg_x)
        got, ref = saved_bytes(slim, x), saved_bytes(stock, x)
        assert got == minimum_bytes(style, x, rg_x, rg_w), (what, got)
        assert got <= ref
        if rg_x and dtype in (torch.bfloat16, torch.float16):
            assert got < ref, (what, got, ref)


def test_mixed_precision_weight():
    """fp32 weight on bf16 activations (what mixed-precision training without autocast gives)."""
    for key in ("llama", "gemma", "t5", "olmo2"):
        stock, slim = _pair(key, torch.float32)
        x0 = torch.randn(4, 16).bfloat16()
        xs, xm = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        ys, ym = stock(xs), slim(xm)
        assert_same(ym, ys, what=f"{key} out")
        g = torch.randn(ys.shape).to(ys.dtype)
        ys.backward(g)
        ym.backward(g.clone())
        assert_same(xm.grad, xs.grad, what=f"{key} dx")
        assert_same(slim.weight.grad, stock.weight.grad, what=f"{key} dw")


def test_only_read_forwards_are_converted():
    """Classes whose forward differs from the references we reproduce stay unregistered."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    hf_norms.register_loaded()
    assert Gemma3nRMSNorm not in REPLACEMENTS
    assert Qwen3NextRMSNormGated not in REPLACEMENTS
    assert hf_norms._style_of(Gemma3nRMSNorm) is None


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=128)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("frozen_norms", [False, True], ids=["norms-train", "norms-frozen"])
def test_tiny_llama_converts(dtype, frozen_norms):
    model = _tiny_llama(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(not ("norm" in name and frozen_norms))
    slim, report = slimgrad.convert(model, report=True)
    norms = [path for path, kind in report.converted if kind == "LlamaRMSNorm"]
    assert len(norms) == 3  # input/post-attention norms of the one layer, and the final norm
    assert type(slim.model.norm).__name__ == "SlimLlamaRMSNorm"
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"  # the original is untouched
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    out_s, out_m = model(ids).logits, slim(ids).logits
    # The norms are bitwise; other converted layers (MLP/loss integrations of other engineers) may not be.
    exact = set(kind for _, kind in report.converted) <= {"LlamaRMSNorm"}
    kw = {} if exact else dict(exact=False, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert_same(out_m, out_s, what="logits", **kw)
    g = torch.randn(out_s.shape).to(dtype)
    out_s.backward(g)
    out_m.backward(g.clone())
    for (name, p_s), (_, p_m) in zip(model.named_parameters(), slim.named_parameters()):
        if not p_s.requires_grad:
            assert p_m.grad is None and p_s.grad is None, name
            continue
        assert_same(p_m.grad, p_s.grad, what=name, **kw)


@pytest.mark.parametrize("key", ["llama", "gemma"])
def test_input_that_also_feeds_a_residual(key):
    """A decoder layer reads x twice: ``x + attn(norm(x))``. Stock's Python RMSNorm gives x's gradient in
    several autograd nodes (the square, the product), which the engine adds to the residual's one by one;
    slimgrad's closed form gives one tensor, added once: the same terms summed in another order, within fp32
    rounding (documented in README's Exactness list). Without the residual the input gradient is bitwise."""
    torch.manual_seed(0)
    stock, slim = _pair(key, torch.float32)
    proj = torch.nn.Linear(16, 16)
    x0 = torch.randn(4, 7, 16)
    for residual in (False, True):
        grads = []
        for norm in (stock, slim):
            x = x0.clone().requires_grad_()
            y = proj(norm(x))
            (x + y if residual else y).square().sum().backward()
            grads.append(x.grad)
        if residual:
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
        else:
            assert_same(grads[1], grads[0])
