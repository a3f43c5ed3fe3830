"""Hugging Face RMSNorm classes: each converted class gives its own forward's outputs and gradients bit for
bit, keeps the input plus one fp32 statistic per row, and a tiny Llama converts with the same logits/grads."""

from __future__ import annotations

import contextlib
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
    # T5's norm copied under other names (recognised by its forward, not its name: they were left stock, unreported)
    "mt5": ("mt5", "MT5LayerNorm", "t5"),
    "umt5": ("umt5", "UMT5LayerNorm", "t5"),
    "longt5": ("longt5", "LongT5LayerNorm", "t5"),
    # the same computation written otherwise (left stock, reported, until their forwards were read)
    "llama4": ("llama4", "Llama4TextRMSNorm", "llama"),
    "helium": ("helium", "HeliumRMSNorm", "olmo2"),
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
    if style == "llama" and x.dtype == torch.float64:
        # the normalised input (fp64), as stock: rebuilding it from the fp32 copy would cost the backward's peak
        # more than keeping it (functional/norms.py save_rms)
        return x.numel() * x.element_size()
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
        # Helium's fp64 weight: its fp32 copy, which the product reads for dX (stock keeps it too)
        w_copy = 4 * x.shape[-1] if key == "helium" and dtype == torch.float64 and rg_x else 0
        assert got == minimum_bytes(style, x, rg_x, rg_w) + w_copy, (what, got)
        assert got <= ref
        if rg_x and dtype in (torch.bfloat16, torch.float16):
            assert got < ref, (what, got, ref)


@pytest.mark.parametrize("fp32_weight", [False, True], ids=["w-as-x", "w-fp32"])
@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("key", ["llama", "olmo2", "gemma", "t5", "llama4", "helium"])
def test_step_peak_not_above_stock(key, dtype, core, fp32_weight):
    """A training step's peak, every requires_grad combination: the backward may not hold more at once than
    stock's, whose engine frees dY after each node (found above it: T5 fp64 with x alone training, +1/2 x, the
    row sum's product made while dX's first term lived; a one-element stand-in weight where only dW is requested;
    Olmo2/Gemma half/fp64 x with only dW, +1 x, dY held beside its cast; an fp64 Llama x with only dW, +1 x,
    its fp32 copy kept and the normalised input rebuilt beside it; an fp64 x with an fp32 weight, +1 dW, C++'s
    product alive through the cast)."""
    from slimgrad.measure import peak_bytes

    for rg_x, rg_w in grad_combos(2):
        if not (rg_x or rg_w):
            continue
        stock, slim = _pair(key, dtype, hidden=64)
        for m in (stock, slim):
            if fp32_weight:
                m.weight.data = m.weight.data.float()
            m.weight.requires_grad_(rg_w)
        x = torch.randn(4, 32, 64).to(dtype).requires_grad_(rg_x)
        g = torch.randn(4, 32, 64)

        def step(m, x=x, g=g):
            (m(x).float() * g).sum().backward()

        with contextlib.nullcontext() if core else slimgrad.csrc.disabled():
            got, ref = peak_bytes(step, slim), peak_bytes(step, stock)
        assert got <= ref, (key, dtype, (rg_x, rg_w), got, ref)


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
    assert type(slim.model.norm).__qualname__ == "SlimLlamaRMSNorm"
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


def _norm_pair(key, dtype):
    """(stock, slimgrad) copies of a Hugging Face RMSNorm (CLASSES) or, ``torch``, of nn.RMSNorm."""
    if key != "torch":
        return _pair(key, dtype)
    torch.manual_seed(0)
    stock = torch.nn.RMSNorm(16, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(-1.5, 1.5)
    return stock, slimgrad.convert(stock)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("key", ["llama", "olmo2", "gemma", "t5", "torch"])
def test_input_that_also_feeds_a_residual(key, dtype, core):
    """A decoder layer reads x twice: ``x + attn(norm(x))``. Where stock's formula gives x two gradients (x feeds
    both the square and the product: T5 always, the others where x is in the statistics' dtype), the engine adds
    them to the residual's one by one, ((res + product's) + square's); slimgrad hands the same two over separately
    (x passed twice) rather than their sum, so x's gradient is bitwise too.

    The step's peak: at or below stock's where the core's one-pass kernels run (fp32/bf16/fp16); on the aten
    sequence (the Python path, and the core's for fp64) up to four per-row fp32 statistics above it (the node
    holds dY while it works, where stock's engine has freed it by its last nodes; fp64 ones for nn.RMSNorm in
    fp64), and for T5 in fp64 one fp32 copy of x more (stock keeps that copy from the forward; slimgrad makes it
    in backward, and keeps less before)."""
    from slimgrad import csrc
    from slimgrad.measure import peak_bytes

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    stock, slim = _norm_pair(key, dtype)
    torch.manual_seed(1)
    proj = torch.nn.Linear(16, 16).to(dtype)
    x0 = torch.randn(4, 32, 16).to(dtype)
    rows = x0.numel() // 16
    stat_size = 8 if key == "torch" and dtype == torch.float64 else 4  # torch style: statistics in opmath
    slack = 0 if core and dtype != torch.float64 else 4 * stat_size * rows
    if key == "t5" and dtype == torch.float64:
        slack += 4 * x0.numel()
    with contextlib.nullcontext() if core else csrc.disabled():
        for rg_w in (True, False):
            grads, peaks = [], []
            for norm in (stock, slim):
                norm.weight.requires_grad_(rg_w)
                norm.weight.grad = None

                def step(x, norm=norm):
                    y = proj(norm(x))
                    (x + y).float().square().sum().backward()
                    return x.grad

                grads.append(step(x0.clone().requires_grad_()))
                peaks.append(peak_bytes(step, x0.clone().requires_grad_()))
            assert_same(grads[1], grads[0], what=f"{key} {dtype} rg_w={rg_w} dx")
            assert_same(slim.weight.grad, stock.weight.grad, what=f"{key} {dtype} rg_w={rg_w} dw")
            assert peaks[1] <= peaks[0] + slack, (key, dtype, rg_w, peaks, slack)


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                               vocab_size=128, dropout_rate=0.0))


def _tiny_decoder():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


@pytest.mark.parametrize("case", ["llama-fp32-full", "t5-fp32-lora", "t5-bf16-norms", "t5-bf16-full"])
def test_whole_model_training_steps_are_bitwise(case):
    """Every decoder layer reads its RMSNorm's input again in the residual, so x's gradient sums three terms; with
    them handed over as stock hands them (test_input_that_also_feeds_a_residual), three AdamW steps of a whole
    model give stock's losses and gradients bit for bit. Before, these four cases drifted from the second step
    (T5 in bf16 by a bf16 ulp of the loss)."""
    name, dtype, mode = case.split("-")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    stock = (_tiny_t5 if name == "t5" else _tiny_decoder)().to(dtype)
    if mode == "lora":
        peft = pytest.importorskip("peft")
        stock = peft.get_peft_model(stock, peft.LoraConfig(r=4, target_modules=["q", "v"], lora_dropout=0.0))
    elif mode == "norms":
        for n, p in stock.named_parameters():
            p.requires_grad_("norm" in n)
    slim = slimgrad.convert(copy.deepcopy(stock))
    assert any(type(m).__qualname__.startswith("Slim") and "Norm" in type(m).__name__ for m in slim.modules())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, labels=ids, **(dict(decoder_input_ids=ids) if name == "t5" else {}))
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (stock, slim)]
    for step in range(3):
        losses = []
        for m in (stock, slim):
            loss = m(**kw).loss
            loss.backward()
            losses.append(loss.detach())
        assert_same(losses[1], losses[0], what=f"step {step} loss")
        for (n, p), q in zip(stock.named_parameters(), slim.parameters()):
            assert_same(q.grad, p.grad, what=f"step {step} {n}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
