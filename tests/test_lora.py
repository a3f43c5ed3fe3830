"""peft's lora.Linear against slimgrad's fused replacement: outputs and gradients equal to peft's on
independent copies, frozen parameters without gradients, and saved bytes equal to the analytical minimum
(x once in its own dtype when dW or a dA is requested, A(dropout(x)) per adapter when its B trains, an
8-byte seed per dropping adapter)."""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
from tests._util import OneLayer as _Base
from tests._util import TwoReaders, assert_same, two_active_adapters
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import slimgrad  # noqa: E402
from slimgrad import csrc  # noqa: E402
from slimgrad.functional.dropout import _fill_noise, dropout_policy  # noqa: E402
from slimgrad.functional.lora import LoraAdapter, lora_linear  # noqa: E402
from slimgrad.integrations.peft_lora import SlimLinear  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

IN, OUT, R, ROWS = 12, 10, 4, (3, 2)


def peft_layer(dtype=torch.float32, *, conv1d=False, dropout=0.0, seed=0, **config):
    """A peft model around one Linear (or Conv1D) with non-zero adapters (init_lora_weights=False)."""
    torch.manual_seed(seed)
    layer = Conv1D(OUT, IN) if conv1d else nn.Linear(IN, OUT)
    with torch.no_grad():
        if conv1d:
            layer.weight.normal_(0, 0.3)
            layer.bias.normal_(0, 0.3)
    cfg = LoraConfig(r=R, lora_alpha=8, target_modules=["proj"], lora_dropout=dropout, init_lora_weights=False,
                     fan_in_fan_out=conv1d, **config)
    return get_peft_model(_Base(layer.to(dtype)), cfg)


def slim_of(model):
    """An independent converted copy where only the LoRA layers are swapped (other families have their own
    tests), with the conversion checked."""
    slim, report = slimgrad.convert(model, include=[LoraLinear], report=True)
    assert report.converted and not report.skipped, str(report)
    assert all(type(m) is not LoraLinear for m in slim.modules())
    return slim


def lora_modules(model):
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def step(model, x, seed=1):
    """Forward and backward with a fixed upstream gradient; returns (output, x.grad)."""
    out = model(x)
    out = out.logits if hasattr(out, "logits") else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    if out.requires_grad:
        out.backward(g)
    return out, (x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None)


def compare_grads(stock, slim, *, exact=True, rtol=None, atol=None):
    for (name, p), (name2, q) in zip(stock.named_parameters(), slim.named_parameters(), strict=True):
        assert name == name2
        if not p.requires_grad:
            assert p.grad is None and q.grad is None, name
        assert_same(q.grad, p.grad, exact=exact, rtol=rtol, atol=atol, what=name)


def x_for(dtype, requires_grad=True, seed=2):
    x = torch.randn(*ROWS, IN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.requires_grad_(requires_grad)


def minimum_bytes(x, adapter_dtype, *, keep_x, kept_xa, seeds=0, masks=0):
    """x once in its own dtype, r columns of the adapter dtype per row for each adapter whose B trains, 8
    bytes per seed (dropout policy "seed"), one bit per element of x per mask (policy "bits")."""
    rows = x.numel() // x.shape[-1]
    elt = torch.empty((), dtype=adapter_dtype).element_size()
    return ((x.numel() * x.element_size() if keep_x else 0) + sum(rows * r * elt for r in kept_xa) + 8 * seeds
            + masks * ((x.numel() + 7) // 8))


# ---------------------------------------------------------------- one layer, every requires_grad combination

@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("combo", list(itertools.product([False, True], repeat=5)),
                         ids=lambda c: "".join("xWbAB"[i] if f else "-" for i, f in enumerate(c)))
def test_layer_matches_peft(combo, dtype, conv1d):
    rg_x, rg_w, rg_b, rg_a, rg_bb = combo
    stock = peft_layer(dtype, conv1d=conv1d)
    layer = lora_modules(stock)[0]
    adapter_dtype = layer.lora_A["default"].weight.dtype
    assert adapter_dtype == torch.float32  # peft upcasts bf16 adapters by default
    layer.base_layer.weight.requires_grad_(rg_w)
    layer.base_layer.bias.requires_grad_(rg_b)
    layer.lora_A["default"].weight.requires_grad_(rg_a)
    layer.lora_B["default"].weight.requires_grad_(rg_bb)
    slim = slim_of(stock)
    xs, xk = x_for(dtype, rg_x), x_for(dtype, rg_x)

    with SavedTensors(exclude=[stock]) as kept_stock:
        out_s, gx_s = step(stock, xs)
    with SavedTensors(exclude=[slim]) as kept:
        out_k, gx_k = step(slim, xk)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert kept.bytes == minimum_bytes(xk, adapter_dtype, keep_x=rg_w or rg_a, kept_xa=[R] if rg_bb else [])
    assert kept.bytes <= kept_stock.bytes
    if dtype == torch.bfloat16 and rg_a:
        assert kept.bytes < kept_stock.bytes  # peft keeps an fp32 copy of x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_adapters_and_lora_bias(dtype):
    """Adapters left in the model's dtype (autocast_adapter_dtype=False) and lora_bias=True (B has a bias)."""
    torch.manual_seed(0)
    stock = get_peft_model(_Base(nn.Linear(IN, OUT).to(dtype)),
                           LoraConfig(r=R, target_modules=["proj"], init_lora_weights=False, lora_bias=True),
                           autocast_adapter_dtype=False)
    assert lora_modules(stock)[0].lora_A["default"].weight.dtype == dtype
    slim = slim_of(stock)
    xs, xk = x_for(dtype), x_for(dtype)
    out_s, gx_s = step(stock, xs)
    with SavedTensors(exclude=[slim]) as kept:
        out_k, gx_k = step(slim, xk)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert lora_modules(slim)[0].lora_B["default"].bias.grad is not None
    assert kept.bytes == minimum_bytes(xk, dtype, keep_x=True, kept_xa=[R])


# ------------------------------------------------------------------------------------------------ dropout

class _FixedNoise(nn.Module):
    """Stands in for peft's nn.Dropout in the reference: multiplies by a given noise, as F.dropout does."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise

    def forward(self, x):
        return x * self.noise


def _noises_of_next_call(x_shape, ps, adapter_dtype, seed):
    """The noises slimgrad's Function draws right after torch.manual_seed(seed): one int64 seed per dropping
    adapter from the default generator, each expanded by a private generator."""
    torch.manual_seed(seed)
    seeds = torch.empty(len(ps), dtype=torch.int64).random_()
    return [_fill_noise(torch.empty(x_shape, dtype=adapter_dtype), p, s) for p, s in zip(ps, seeds)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rg", [(True, True, True), (False, True, True), (True, False, False),
                                (False, False, True), (False, True, False)], ids=["xAB", "AB", "x", "B", "A"])
@pytest.mark.parametrize("policy", ["bits", "seed"])
def test_dropout_matches_peft_with_same_mask(dtype, rg, policy):
    """Policy "bits" draws PEFT's own mask (same default-generator draw); "seed" draws its own, given to
    the reference here."""
    rg_x, rg_a, rg_b = rg
    p = 0.1
    stock = peft_layer(dtype, dropout=p)
    layer = lora_modules(stock)[0]
    layer.lora_A["default"].weight.requires_grad_(rg_a)
    layer.lora_B["default"].weight.requires_grad_(rg_b)
    slim = slim_of(stock)
    xs, xk = x_for(dtype, rg_x), x_for(dtype, rg_x)
    # x frozen, not cast, read by this layer alone: peft's own forward runs (its nn.Dropout's draw, under either
    # policy), keeping the dropped x where the Function would keep x and a mask (functional/lora.py's
    # read_alone_last_time)
    alone = not rg_x and rg_a and xk.dtype == torch.float32
    if policy == "seed" and not alone:
        (noise,) = _noises_of_next_call(xs.shape, [p], torch.float32, seed=7)
        assert 0 < (noise == 0).sum() < noise.numel()
        layer.lora_dropout["default"] = _FixedNoise(noise)

    with dropout_policy(policy):
        torch.manual_seed(7)
        with SavedTensors(exclude=[slim]) as kept:
            out_k, gx_k = step(slim, xk)
    torch.manual_seed(7)
    out_s, gx_s = step(stock, xs)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    if alone:
        assert "LoraLinear" not in out_k.grad_fn.name()
        assert kept.bytes == minimum_bytes(xk, torch.float32, keep_x=True, kept_xa=[R] if rg_b else [])
        return
    masks = 1 if (rg_x or rg_a) else 0
    assert kept.bytes == minimum_bytes(xk, torch.float32, keep_x=rg_a, kept_xa=[R] if rg_b else [],
                                       seeds=masks if policy == "seed" else 0,
                                       masks=masks if policy == "bits" else 0)


def test_dropout_eval_mode_is_identity():
    stock = peft_layer(dropout=0.5).eval()
    slim = slim_of(stock)
    out_s, _ = step(stock, x_for(torch.float32))
    out_k, _ = step(slim, x_for(torch.float32))
    assert_same(out_k, out_s, what="output")
    compare_grads(stock, slim)


def test_dropout_reproducible_and_checkpoint():
    """Same seed, same mask; non-reentrant and reentrant checkpointing recompute the same mask."""
    slim = slim_of(peft_layer(dropout=0.5))
    x = x_for(torch.float32)
    torch.manual_seed(3)
    ref, _ = step(slim, x)
    ref_grads = [p.grad.clone() for p in slim.parameters() if p.grad is not None]
    for reentrant in (False, True):
        slim.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        x2 = x_for(torch.float32)
        out = torch.utils.checkpoint.checkpoint(slim, x2, use_reentrant=reentrant)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        assert_same(out, ref, what=f"output, reentrant={reentrant}")
        assert_same(x2.grad, x.grad, what=f"x.grad, reentrant={reentrant}")
        for a, b in zip([p.grad for p in slim.parameters() if p.grad is not None], ref_grads, strict=True):
            assert_same(a, b, what=f"grad, reentrant={reentrant}")


# ------------------------------------------------------------------------------------------- several adapters

def _two_adapters(dtype, dropout=0.0):
    stock = peft_layer(dtype, dropout=dropout)
    stock.add_adapter("second", LoraConfig(r=2 * R, lora_alpha=3, target_modules=["proj"], use_rslora=True,
                                           lora_dropout=dropout, init_lora_weights=False))
    # peft 0.17's add_adapter leaves a bf16 model's new adapter in bf16 (get_peft_model upcasts the first);
    # later releases (0.21) upcast it too: do what they do, so that both adapters are fp32 on every release
    stock.base_model._cast_adapter_dtype(adapter_name="second", autocast_adapter_dtype=True)
    stock.base_model.set_adapter(["default", "second"])
    layer = lora_modules(stock)[0]
    assert layer.scaling["default"] == 2.0 and layer.scaling["second"] == 3 / (2 * R) ** 0.5
    for name in ("default", "second"):
        assert layer.lora_A[name].weight.requires_grad and layer.lora_B[name].weight.requires_grad
    return stock


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_several_active_adapters(dtype, dropout):
    stock = _two_adapters(dtype, dropout)
    slim = slim_of(stock)
    xs, xk = x_for(dtype), x_for(dtype)
    if dropout:  # policy "seed": its masks are handed to the reference
        noises = _noises_of_next_call(xs.shape, [dropout, dropout], torch.float32, seed=5)
        layer = lora_modules(stock)[0]
        for name, noise in zip(("default", "second"), noises):
            layer.lora_dropout[name] = _FixedNoise(noise)
    torch.manual_seed(5)
    with dropout_policy("seed"), SavedTensors(exclude=[slim]) as kept:
        out_k, gx_k = step(slim, xk)
    out_s, gx_s = step(stock, xs)
    assert_same(out_k, out_s, what="output")
    # the adapters' input gradients are summed in the order autograd sums them
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert kept.bytes == minimum_bytes(xk, torch.float32, keep_x=True, kept_xa=[R, 2 * R],
                                       seeds=2 if dropout else 0)


def test_seed_policy_asks_the_kernel_registry_once_per_call(monkeypatch):
    """Policy "seed" with several dropping adapters: backward regenerates every mask with the kernel forward chose
    (one registry lookup a call), not one lookup per adapter in forward and again in backward, and the result is
    the one reached without counting (test_several_active_adapters checks it against peft)."""
    from slimgrad.kernels import dropout as dropout_kernels

    stock = _two_adapters(torch.float32, 0.1)
    stock.add_adapter("third", LoraConfig(r=R, lora_alpha=2, target_modules=["proj"], lora_dropout=0.2,
                                          init_lora_weights=False))
    stock.base_model.set_adapter(["default", "second", "third"])
    for m in lora_modules(stock):
        for name in ("default", "second", "third"):
            m.lora_A[name].weight.requires_grad_(True)
            m.lora_B[name].weight.requires_grad_(True)
    slim = slim_of(stock)
    results, calls, choose = [], [], dropout_kernels.choose_seed
    for counting in (False, True):
        if counting:
            monkeypatch.setattr(dropout_kernels, "choose_seed", lambda t: calls.append(t) or choose(t))
        for p in slim.parameters():
            p.grad = None
        torch.manual_seed(5)
        with dropout_policy("seed"), csrc.disabled():  # the Python Function (the core calls its kernel directly)
            results.append(step(slim, x_for(torch.float32)) + tuple(p.grad for p in slim.parameters()))
        if counting:
            assert len(calls) == 1, f"{len(calls)} registry lookups for 3 dropping adapters"
    for a, b in zip(*results, strict=True):
        assert_same(b, a, what="same seed, same result")

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_several_adapters_bits_policy_is_peft_bitwise(dtype):
    """Policy "bits" (CPU default) draws each adapter's mask as PEFT's nn.Dropout does, in PEFT's order."""
    stock = _two_adapters(dtype, 0.1)
    slim = slim_of(stock)
    xs, xk = x_for(dtype), x_for(dtype)
    torch.manual_seed(5)
    with dropout_policy("bits"), SavedTensors(exclude=[slim]) as kept:
        out_k, gx_k = step(slim, xk)
    torch.manual_seed(5)
    out_s, gx_s = step(stock, xs)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert kept.bytes == minimum_bytes(xk, torch.float32, keep_x=True, kept_xa=[R, 2 * R], masks=2)


@pytest.mark.parametrize("module_policy, global_policy", [("seed", "bits"), ("bits", "seed")])
def test_convert_dropout_option_reaches_lora(module_policy, global_policy):
    """``convert(model, dropout=...)`` sets the LoRA layers' dropout policy as it sets the dropout modules'
    (it was read by nn.Dropout only; the LoRA Function followed the process-wide policy): the bytes kept are
    the module policy's, whatever the process-wide one; "bits" still draws PEFT's very masks."""
    stock = _two_adapters(torch.float32, 0.1)
    slim, report = slimgrad.convert(stock, include=[LoraLinear], report=True, dropout=module_policy)
    assert report.converted and not report.skipped, str(report)
    xs, xk = x_for(torch.float32), x_for(torch.float32)
    torch.manual_seed(5)
    with dropout_policy(global_policy), SavedTensors(exclude=[slim]) as kept:
        out_k, gx_k = step(slim, xk)
    expect = dict(seeds=2) if module_policy == "seed" else dict(masks=2)
    assert kept.bytes == minimum_bytes(xk, torch.float32, keep_x=True, kept_xa=[R, 2 * R], **expect)
    if module_policy == "bits":
        torch.manual_seed(5)
        out_s, gx_s = step(stock, xs)
        assert_same(out_k, out_s, what="output")
        assert_same(gx_k, gx_s, what="x.grad")
        compare_grads(stock, slim)
    with pytest.raises(ValueError, match="lora_linear's argument 'dropout_policy'"):
        lora_linear(xk, torch.randn(OUT, IN), None, [LoraAdapter(torch.randn(R, IN), torch.randn(OUT, R))],
                    dropout_policy="mask")


# ------------------------------------------------------------------------------ whole Hugging Face models

def tiny_llama(dtype, r=R, dropout=0.0, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg).to(dtype)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                            lora_dropout=dropout, init_lora_weights=False))


def tiny_gpt2(dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(dtype)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        return get_peft_model(model, LoraConfig(r=R, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                                init_lora_weights=False))


def ids(seed=3):
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))


def _model_steps_match(stock, slim, dtype):
    """One step of each whole model, with the same dropout draws: the same logits and gradients, bit for bit.
    Returns the bytes (slim, stock) kept for backward."""
    with SavedTensors(exclude=[stock]) as kept_stock:
        torch.manual_seed(5)
        out_s, _ = step(stock, ids())
    with SavedTensors(exclude=[slim]) as kept:
        torch.manual_seed(5)
        out_k, _ = step(slim, ids())
    assert_same(out_k, out_s, what="logits")
    # Each converted layer hands its input two gradients (the adapters', then the base layer's), which autograd
    # adds to the other readers' (q, k and v share one x) one at a time, as peft's graph does: the same sums in
    # the same order. (Before, each layer handed one pre-summed gradient: fp32 a few ulps off, bf16 up to a few
    # ulps of the largest element.)
    for (name, p), q in zip(stock.named_parameters(), slim.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_same(q.grad, p.grad, what=name)
    return kept.bytes, kept_stock.bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_models_match_peft(build, dtype):
    stock = build(dtype)
    slim = slim_of(stock)
    assert len(lora_modules(slim)) == len(lora_modules(stock)) > 0
    assert all(type(m) is SlimLinear for m in lora_modules(slim))
    kept, kept_stock = _model_steps_match(stock, slim, dtype)
    for m in lora_modules(slim):
        assert m.base_layer.weight.grad is None and m.base_layer.weight.requires_grad is False
        assert m.lora_A["default"].weight.grad is not None and m.lora_B["default"].weight.grad is not None
    # fp32: stock already keeps the shared x once; bf16: stock keeps an fp32 copy of x per adapted layer
    if dtype == torch.float32:
        assert kept == kept_stock
    else:
        assert kept < kept_stock


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj")],
                         ids=["qkvo", "qv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_dropout_in_a_model_is_peft_bitwise(dtype, targets):
    """LoRA with dropout on layers that read one input (q, k and v; and k a plain Linear between them): the
    converted layers' Functions run, and every gradient is peft's bit for bit (a sweep of 19 architectures found
    them ~1e-7 relative off in fp32 and 1 bf16 ulp off in bf16 while each layer handed x one summed gradient)."""
    stock = tiny_llama(dtype, dropout=0.1, targets=targets)
    stock.train()
    slim = slim_of(stock)
    _model_steps_match(stock, slim, dtype)


def tiny_falcon(dtype, *, bias=False, new_arch=False, dropout=0.0):
    """Falcon-7B's layout (multi-query, parallel attention) or Falcon-40B's (new decoder architecture), LoRA on
    every ``FalconLinear``."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    cfg = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bias=bias,
                       new_decoder_architecture=new_arch, num_kv_heads=2 if new_arch else None,
                       multi_query=not new_arch, parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = FalconForCausalLM(cfg).to(dtype)
    return get_peft_model(model, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=dropout, init_lora_weights=False,
                                            target_modules=["query_key_value", "dense", "dense_h_to_4h",
                                                            "dense_4h_to_h"]))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("new_arch", [False, True], ids=["falcon-7b", "falcon-40b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_falcon_lora_matches_peft_and_keeps_less(dtype, new_arch, dropout):
    """LoRA over Falcon's bias-less FalconLinear (``x @ W.T``, which is aten's bias-less linear) converts: the same
    logits as peft, gradients within the association tolerance of the other models, and with dropout less kept."""
    stock = tiny_falcon(dtype, new_arch=new_arch, dropout=dropout)
    slim = slim_of(stock)
    assert len(lora_modules(slim)) == len(lora_modules(stock)) == 8
    assert all(type(m) is SlimLinear for m in lora_modules(slim))
    assert all(type(m.base_layer).__name__ == "FalconLinear" for m in lora_modules(slim))
    stock.train(), slim.train()
    kept, kept_stock = _model_steps_match(stock, slim, dtype)
    if dropout or dtype != torch.float32:
        assert kept < kept_stock, (kept, kept_stock)
    else:
        assert kept == kept_stock


def test_falcon_lora_with_bias_is_left_to_peft_and_says_why():
    stock = tiny_falcon(torch.bfloat16, bias=True, dropout=0.1)
    slim, report = slimgrad.convert(stock, include=[LoraLinear], report=True)
    assert not report.converted and len(report.skipped) == 8
    assert all("FalconLinear with a bias" in s.reason for s in report.skipped), report.skipped[0].reason
    assert all(type(m) is LoraLinear for m in lora_modules(slim))
    torch.manual_seed(5)
    out_s, _ = step(stock, ids())
    torch.manual_seed(5)
    out_k, _ = step(slim, ids())
    assert_same(out_k, out_s, what="logits")
    compare_grads(stock, slim)


def test_falcon_lora_over_a_changed_falcon_linear_is_left_to_peft(monkeypatch):
    """A FalconLinear.forward slimgrad has not read (here: patched, before or after the conversion) is never run as
    F.linear: the layers are left to peft, with stock's numbers."""
    from transformers.models.falcon import modeling_falcon

    def changed(self, input):
        return input @ self.weight.T * 0.5

    stock = tiny_falcon(torch.float32)
    converted = slim_of(stock)
    monkeypatch.setattr(modeling_falcon.FalconLinear, "forward", changed)
    slim, report = slimgrad.convert(stock, include=[LoraLinear], report=True)
    assert not report.converted and len(report.skipped) == 8
    assert all("FalconLinear.forward" in s.reason and "not a version" in s.reason for s in report.skipped)
    out_s, _ = step(stock, ids())
    for model in (slim, converted):  # converted before the patch: its layers see the change at their next call
        out_k, _ = step(model, ids())
        assert_same(out_k, out_s, what="logits")


def test_merged_disabled_mixed_batch_and_revert():
    stock = _two_adapters(torch.float32)
    stock.add_adapter("third", LoraConfig(r=R, target_modules=["proj"], init_lora_weights=False))
    slim = slim_of(stock)
    x = x_for(torch.float32, False)

    # disabled: base only
    with stock.disable_adapter(), slim.disable_adapter():
        assert_same(slim(x), stock(x), what="disabled")
        assert_same(slim(x), lora_modules(slim)[0].base_layer(x), what="disabled is base")
    # mixed batch (inference only in peft): peft's own forward
    stock.eval(), slim.eval()
    rows = ["default", "third"] + ["__base__"] * (x.shape[0] - 2)
    mixed = slim(x, adapter_names=rows)
    assert_same(mixed, stock(x, adapter_names=rows), what="adapter_names")
    assert not torch.equal(mixed, slim(x))
    stock.train(), slim.train()
    # merged: base only, with the merged weight
    stock.merge_adapter()
    slim.merge_adapter()
    assert lora_modules(slim)[0].merged
    with SavedTensors(exclude=[slim]) as kept:
        out_k, _ = step(slim, x_for(torch.float32))
    out_s, _ = step(stock, x_for(torch.float32))
    assert_same(out_k, out_s, what="merged")
    assert kept.bytes == 0  # frozen nn.Linear keeps nothing
    stock.unmerge_adapter()
    slim.unmerge_adapter()

    reverted = slimgrad.revert(slim)
    assert reverted is slim and all(type(m) is LoraLinear for m in lora_modules(slim))
    for a, b in zip(stock.parameters(), slim.parameters(), strict=True):
        a.grad = b.grad = None
    out_s, _ = step(stock, x_for(torch.float32))
    out_k, _ = step(slim, x_for(torch.float32))
    assert_same(out_k, out_s, what="reverted")
    compare_grads(stock, slim)


def test_unsupported_variants_are_reported():
    torch.manual_seed(0)
    model = get_peft_model(_Base(nn.Linear(IN, OUT)), LoraConfig(r=R, target_modules=["proj"], use_dora=True))
    slim, report = slimgrad.convert(model, include=[LoraLinear], report=True)
    assert not report.converted
    assert len(report.skipped) == 1 and "variant" in report.skipped[0].reason
    assert type(lora_modules(slim)[0]) is LoraLinear


def test_hooks_on_submodules_use_peft_forward():
    """A hook on the base layer would be skipped by a direct parameter read: peft's forward runs instead."""
    stock = peft_layer()
    slim = slim_of(stock)
    calls = []
    for model in (stock, slim):
        lora_modules(model)[0].base_layer.register_forward_hook(lambda m, i, o: calls.append(1))
    out_s, _ = step(stock, x_for(torch.float32))
    out_k, _ = step(slim, x_for(torch.float32))
    assert calls == [1, 1]
    assert_same(out_k, out_s)


def test_autocast_matches_peft():
    stock = peft_layer()
    slim = slim_of(stock)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_s, gx_s = step(stock, x_for(torch.float32))
        out_k, gx_k = step(slim, x_for(torch.float32))
    assert out_k.dtype == out_s.dtype == torch.bfloat16
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)


class _ThreeReaders(nn.Module):
    """Three projections reading one x, as q/k/v read an RMSNorm's output."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(IN, OUT), nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x):
        return self.q(x) + self.k(x) * 0.5 + self.v(x) * 0.25


@pytest.mark.parametrize("readers", [1, 3])
def test_autocast_non_leaf_x_matches_peft(readers):
    """Inside a model x is no leaf (an RMSNorm's fp32 output): autocast then casts it once per linear op, the
    base's and each adapter's A, and autograd adds those casts' gradients in fp32. test_autocast_matches_peft's
    leaf x hides the difference (autocast caches a leaf's cast, so stock adds in bf16 too): summing the base's
    and the adapter's input gradient in bf16 first put x's gradient 1 bf16 ulp off stock's on about half its
    elements (tests/test_trainer.py's SFT run, bf16 by default, diverged from the second step on, once B != 0)."""
    torch.manual_seed(0)
    base = _Base(nn.Linear(IN, OUT)) if readers == 1 else _ThreeReaders()
    cfg = LoraConfig(r=R, lora_alpha=8, target_modules=["proj"] if readers == 1 else ["q", "k", "v"],
                     init_lora_weights=False)  # B != 0: with B = 0 the adapters' input gradient is 0
    stock = get_peft_model(base, cfg)
    slim = slim_of(stock)
    results = []
    for model in (stock, slim):
        leaf = x_for(torch.float32)
        with SavedTensors(exclude=[model]) as kept, torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = step(model, leaf * 1.5)
        results.append((out, leaf.grad, kept.bytes))
    (out_s, gx_s, kept_stock), (out_k, gx_k, kept_slim) = results
    assert out_k.dtype == out_s.dtype == torch.bfloat16
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert kept_slim <= kept_stock


# ------------------------------------------------------------------------------------------------- functional

def test_functional_bad_arguments():
    x, w = torch.randn(3, IN), torch.randn(OUT, IN)
    good = LoraAdapter(torch.randn(R, IN), torch.randn(OUT, R), 2.0)
    with pytest.raises(TypeError, match="'x'"):
        lora_linear(x.numpy(), w, None, [good])
    with pytest.raises(TypeError, match=r"'adapters\[0\]'"):
        lora_linear(x, w, None, [(good.A, good.B)])
    with pytest.raises(ValueError, match=r"'adapters\[0\]'"):
        lora_linear(x, w, None, [LoraAdapter(good.A, good.A)])
    with pytest.raises(ValueError, match=r"'adapters\[1\]'"):
        lora_linear(x, w, None, [good, LoraAdapter(good.A.double(), good.B.double())])
    with pytest.raises(ValueError, match="dropout"):
        lora_linear(x, w, None, [good._replace(dropout=1.5)])


def test_functional_refuses_double_backward():
    x = torch.randn(3, IN, requires_grad=True)
    # with dropout our Function runs (without it stock's ops run, and double backward is stock's)
    a = LoraAdapter(torch.randn(R, IN, requires_grad=True), torch.randn(OUT, R, requires_grad=True), 2.0, 0.1)
    out = lora_linear(x, torch.randn(OUT, IN), None, [a])
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        gx.sum().backward()


def test_no_dropout_no_cast_runs_stock_ops():
    """Without dropout or a cast stock keeps what we keep: PEFT's ops run directly (no Function)."""
    torch.manual_seed(0)
    x = torch.randn(3, IN, requires_grad=True)
    w = torch.randn(OUT, IN)
    a = LoraAdapter(torch.randn(R, IN, requires_grad=True), torch.randn(OUT, R, requires_grad=True), 2.0)
    out = lora_linear(x, w, None, [a])
    # grad_fn.name(): the Python Function's node or the compiled core's (CppNode<...LoraLinearFunction>)
    assert "LoraLinear" not in out.grad_fn.name()
    assert "LoraLinear" in lora_linear(x, w, None, [a._replace(dropout=0.1)]).grad_fn.name()
    assert "LoraLinear" in lora_linear(x.double(), w.double(), None, [a]).grad_fn.name()  # a cast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["bits", "seed"])
def test_peak_never_above_peft(dtype, dropout, policy):
    """The peak over a whole step (forward and backward, temporaries included) is at most PEFT's."""
    from slimgrad.measure import peak_bytes

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64).to(dtype)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], lora_dropout=dropout,
                          init_lora_weights=False)
    stock = peft.get_peft_model(One(), cfg)
    slim = slim_of(stock)
    x = torch.randn(4, 128, 64, dtype=dtype, requires_grad=True)

    def step(m):
        out = m(x)
        out.backward(torch.ones_like(out))

    with dropout_policy(policy):
        peaks = [peak_bytes(step, m) for m in (stock, slim)]
    assert peaks[1] <= peaks[0], f"slimgrad peak {peaks[1]} > peft's {peaks[0]}"


# ----------------------------------------------------------------------------------------------------- slow

def test_adamw_finetune_tracks_peft():
    stock = tiny_llama(torch.float32, dropout=0.0)
    slim = slim_of(stock)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (stock, slim)]
    for i in range(5):
        losses = []
        for model, opt in zip((stock, slim), opts):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids(i), labels=ids(i)).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(stock.parameters(), slim.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_fullgraph_one_layer():
    stock = peft_layer(dropout=0.0)
    layer = lora_modules(slim_of(stock))[0]
    ref = copy.deepcopy(lora_modules(stock)[0])
    compiled = torch.compile(layer, fullgraph=True)
    out_k, gx_k = step(compiled, x_for(torch.float32))
    out_s, gx_s = step(ref, x_for(torch.float32))
    assert_same(out_k, out_s, exact=False, rtol=1e-5, atol=1e-6, what="output")
    assert_same(gx_k, gx_s, exact=False, rtol=1e-5, atol=1e-6, what="x.grad")
    compare_grads(ref, layer, exact=False, rtol=1e-5, atol=1e-6)


def test_no_grad_inference_matches_peft():
    stock = peft_layer(torch.bfloat16).eval()
    slim = slim_of(stock)
    with torch.no_grad(), SavedTensors() as kept:
        out_k = slim(x_for(torch.bfloat16, False))
    with torch.no_grad():
        out_s = stock(x_for(torch.bfloat16, False))
    assert_same(out_k, out_s)
    assert kept.bytes == 0 and not out_k.requires_grad


@pytest.mark.slow
def test_compiled_bf16_lora_within_bf16_rounding_of_compiled_stock():
    """Compiled with bf16 weights, Inductor fuses the LoRA Function's ops otherwise than peft's, so bf16
    roundings fall elsewhere (README's Exactness list): output and LoRA gradients within bf16 rounding of
    compiled stock's, and as close to an fp64 reference."""
    stock = peft_layer(torch.bfloat16)
    slim = slim_of(copy.deepcopy(stock))
    reference = copy.deepcopy(stock).double()
    x0 = torch.randn(4, 5, IN)
    results = []
    for model, dtype, compiled in ((stock, torch.bfloat16, True), (slim, torch.bfloat16, True),
                                   (reference, torch.float64, False)):
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True) if compiled else model
        out = run(x0.to(dtype))
        out.float().square().sum().backward()
        results.append((out.float(), [p.grad.float() for m in lora_modules(model)
                                      for p in (m.lora_A["default"].weight, m.lora_B["default"].weight)]))
    torch._dynamo.reset()
    (out_s, grads_s), (out_g, grads_g), (out_r, grads_r) = results
    torch.testing.assert_close(out_g, out_s, rtol=2 ** -7, atol=2 ** -7 * out_s.abs().max().item())
    for gs, gg, gr in zip(grads_s, grads_g, grads_r):
        scale = gr.abs().max().item()
        torch.testing.assert_close(gg, gs, rtol=0, atol=0.02 * scale)
        assert (gg - gr.float()).abs().max() <= 2 * (gs - gr.float()).abs().max() + 1e-3 * scale


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_adapters_peak_not_above_peft(conv, dtype):
    """Dropout whose mask no gradient reads (x and A frozen: LoRA-FA's B alone, or an active adapter loaded frozen
    while the base layer trains): stock's dropout itself runs, nothing packed; and t = A(drop(x)) goes once B has read
    it unless B trains. Those requires_grad combinations, on the compiled core: the step's peak at most peft's
    (linear fp32 4x32x64: +1024 B with B alone training before, the packed mask; +3072 with the base alone
    training, the mask and t), outputs and gradients bitwise peft's (the same draw). (The Python path, the fallback
    without a compiler, keeps t through the scaling product: its Function returns it; README Limits.)"""
    from slimgrad import csrc
    from slimgrad.measure import peak_bytes

    if not csrc.enabled() or csrc.core() is None:
        pytest.skip("the compiled core is off or unbuilt")

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Conv2d(8, 16, 3, padding=1) if conv else nn.Linear(64, 96)

        def forward(self, x):
            return self.layer(x)

    x = torch.randn((4, 8, 12, 12) if conv else (4, 32, 64), generator=torch.Generator().manual_seed(1)).to(dtype)
    # (the base weight and B training together: B's kept t lives through the base's weight gradient inside the one
    # Function, where stock frees it first: +t at one thread in bf16, README Limits)
    for rw, rb, rB in [(False, False, True), (False, True, False), (False, True, True), (True, False, False),
                       (True, True, False)]:
        torch.manual_seed(0)
        stock = get_peft_model(Wrap(), LoraConfig(r=4, lora_alpha=8, target_modules=["layer"], lora_dropout=0.1,
                                                  init_lora_weights=False)).to(dtype)
        layer = stock.base_model.model.layer
        layer.base_layer.weight.requires_grad_(rw)
        layer.base_layer.bias.requires_grad_(rb)
        layer.lora_A["default"].weight.requires_grad_(False)
        layer.lora_B["default"].weight.requires_grad_(rB)
        slim = slimgrad.convert(copy.deepcopy(stock))
        g = torch.randn(stock(x).shape, generator=torch.Generator().manual_seed(2)).to(dtype)

        def step(m, g=g):
            torch.manual_seed(5)
            out = m(x)
            out.backward(g)
            return out

        for m in (stock, slim):  # (first calls' one-time allocations out of the measured step)
            step(m)
            m.zero_grad(set_to_none=True)
        ref, got = peak_bytes(step, stock), peak_bytes(step, slim)
        assert got <= ref, (rw, rb, rB, got, ref)
        outs = []
        for m in (stock, slim):
            m.zero_grad(set_to_none=True)
            outs.append((step(m), [(n, p.grad) for n, p in m.named_parameters() if p.grad is not None]))
        assert_same(outs[1][0], outs[0][0], what="output")
        assert [n for n, _ in outs[1][1]] == [n for n, _ in outs[0][1]] and outs[0][1]
        for (n, a), (_, b) in zip(outs[1][1], outs[0][1]):
            # (a conv's fp32 bias gradient with its weight frozen is a plain sum: README, Exactness)
            exact = not (conv and dtype == torch.float32 and n.endswith("base_layer.bias") and not rw)
            assert_same(a, b, exact=exact, what=n)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_several_active_adapters_on_a_shared_input(dtype, core):
    """Two LoRA layers reading one x (q and k), two adapters active in each, with dropout ("bits", stock's masks).
    fp32 (adapters read x itself): peft's graph hands x one gradient per adapter, then the base's, and autograd adds
    the other layer's between them; each adapter runs a Function of its own and hands its gradient over in that
    order (pre-summed, fp32 gradients upstream of x were ~1e-6 relative off). bf16 (fp32 adapters read one cast copy
    of x, whose gradient peft's graph hands over once, pre-summed in fp32): one Function. Bitwise either way, and
    never more kept than peft."""

    torch.manual_seed(0)
    reader = TwoReaders(lambda: nn.Linear(IN, IN, bias=False)).to(dtype)
    stock = two_active_adapters(reader, R, second_dropout=0.1)
    slim = slim_of(stock)
    xs, xk = x_for(dtype), x_for(dtype)
    with dropout_policy("bits"), contextlib.nullcontext() if core else csrc.disabled():
        torch.manual_seed(7)
        with SavedTensors(exclude=[slim]) as kept:
            out_k, gx_k = step(slim, xk)
        torch.manual_seed(7)
        with SavedTensors(exclude=[stock]) as kept_stock:
            out_s, gx_s = step(stock, xs)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="x.grad")
    compare_grads(stock, slim)
    assert 0 < kept.bytes < kept_stock.bytes


# ------------------------------------------------------- dropout on a frozen x: read alone, or by several layers

class _FrozenTrunkHead(nn.Module):
    """A frozen trunk and one LoRA head reading its output (a classifier fine-tuned with LoRA): nothing else keeps
    the head's input."""

    def __init__(self, conv=False):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3) if conv else nn.Linear(IN, IN), nn.Tanh())
        self.head = nn.Conv2d(8, 4, 3) if conv else nn.Linear(IN, OUT)

    def forward(self, x):
        return self.head(self.trunk(x))


def _steps_against_peft(stock, slim, steps=3, conv=False):
    """Per step: (stock's saved bytes, slimgrad's), gradients and outputs compared bitwise on every step."""
    kept = []
    for i in range(steps):
        row = []
        for m in (stock, slim):
            for q in m.parameters():
                q.grad = None
            x = (torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(10 + i)) if conv
                 else x_for(torch.float32, requires_grad=False, seed=10 + i))
            torch.manual_seed(i)
            with SavedTensors(exclude=[m]) as k:
                out = m(x)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))
            row.append((k.bytes, out.detach()))
        assert torch.equal(row[0][1], row[1][1])
        compare_grads(stock, slim)
        kept.append((row[0][0], row[1][0]))
    return kept


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_dropout_on_a_frozen_input_read_alone_keeps_what_peft_keeps(conv):
    """x frozen, the base frozen, one dropping adapter, and no other LoRA layer reading x: peft keeps the dropped x
    only (its dropout of a tensor needing no gradient keeps no mask), the Function would keep x and a 1-bit mask,
    one bit an element more (MobileNetV2's, RegNet's LoRA classifiers: +320 B and +16 B a step on the model sweep; a
    LoRA conv head +200 B here). peft's own forward runs there, on every step."""
    torch.manual_seed(0)
    stock = get_peft_model(_FrozenTrunkHead(conv), LoraConfig(r=R, target_modules=["head"], lora_dropout=0.1,
                                                              init_lora_weights=False))
    slim = slimgrad.convert(stock)
    for stock_bytes, slim_bytes in _steps_against_peft(stock, slim, conv=conv):
        assert slim_bytes == stock_bytes


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
def test_dropout_on_a_frozen_input_read_by_two_layers_keeps_x_once_from_the_second_step(core):
    """q and k reading one frozen x, each with its own dropout: peft keeps two dropped copies, the Functions x once
    and two masks. The first step cannot know that x is shared and runs peft's forward (never above peft); from
    the second step the layers know and keep x once."""
    torch.manual_seed(0)
    stock = get_peft_model(TwoReaders(lambda: nn.Linear(IN, OUT)),
                           LoraConfig(r=R, target_modules=["q", "k"], lora_dropout=0.1, init_lora_weights=False))
    slim = slim_of(stock)
    with csrc.disabled() if not core else contextlib.nullcontext():
        kept = _steps_against_peft(stock, slim)
    x = x_for(torch.float32, requires_grad=False)
    assert kept[0][1] == kept[0][0]
    for stock_bytes, slim_bytes in kept[1:]:
        # the dropped copies (x's size each) against x once and two masks
        assert slim_bytes == stock_bytes - x.numel() * x.element_size() + 2 * ((x.numel() + 7) // 8)


# ------------------------------------------------- hooks the fused forward would skip: backward and global hooks

def _hook_step(model, kind, conv):
    """One step with a hook registered as ``kind``; returns (calls, x.grad, parameter gradients)."""
    from torch.nn.modules import module as nn_module

    calls = []
    layer = next(m for m in model.modules() if hasattr(m, "lora_B"))
    sub = layer.base_layer if kind == "base" else layer.lora_B["default"]
    handles = []
    if kind == "pre":
        handles.append(sub.register_full_backward_pre_hook(lambda m, go: (calls.append(m), (go[0] * 3,))[1]))
    elif kind in ("full", "base"):
        handles.append(sub.register_full_backward_hook(lambda m, gi, go: (calls.append(m), (gi[0] * 3,))[1]))
    elif kind == "global_forward":
        handles.append(nn_module.register_module_forward_hook(lambda m, i, o: calls.append(m)))
    else:
        handles.append(nn_module.register_module_full_backward_hook(lambda m, gi, go: calls.append(m)))
    try:
        shape = (2, 3, 6, 6) if conv else (3, IN)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(3)
        model(x).square().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return [type(m).__name__ for m in calls], x.grad, {n: p.grad for n, p in model.named_parameters()
                                                       if p.grad is not None}


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
@pytest.mark.parametrize("kind", ["full", "pre", "base", "global_forward", "global_backward"])
def test_backward_and_global_hooks_on_the_submodules_fire_as_in_peft(kind, conv):
    """The converted layer reads lora_A / lora_B / base_layer's parameters instead of calling them: a full backward
    hook (or pre-hook) there, or a global module hook (FlopCounterMode's, module_tracker's), never fired and a hook
    that edits the gradient was silently ignored (the autograd sweep of 2026-11-28). Where one is registered peft's
    forward runs, and says so: the same calls, in order, and the same gradients."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3) if conv else nn.Linear(IN, OUT))
    stock = get_peft_model(base, LoraConfig(r=2, target_modules=["0"], lora_dropout=0.1, init_lora_weights=False))
    slim = slimgrad.convert(copy.deepcopy(stock))
    expected = _hook_step(stock, kind, conv)
    slimgrad._notices.reset_warned()
    with pytest.warns(slimgrad.SlimgradWarning, match="global module hook" if "global" in kind else "carries hooks"):
        got = _hook_step(slim, kind, conv)  # said once a process: the layer steps aside
    assert got[0] == expected[0] and expected[0]
    assert torch.equal(got[1], expected[1])
    assert got[2].keys() == expected[2].keys()
    for name in expected[2]:
        assert torch.equal(got[2][name], expected[2][name]), name


def test_dropout_on_a_frozen_input_under_checkpointing_matches_peft():
    """The read-alone route (peft's forward or the Function) is the same in a non-reentrant checkpoint's forward and
    its recomputation, which must save what the forward saved, although the q/k reads in between taught the layers
    that they share x: three steps, every gradient peft's. (A reentrant checkpoint of a frozen x gives no gradient,
    in stock too.)"""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = TwoReaders(lambda: nn.Linear(IN, OUT))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    stock = get_peft_model(Checkpointed(), LoraConfig(r=R, target_modules=["q", "k"], lora_dropout=0.1,
                                                      init_lora_weights=False))
    slim = slim_of(stock)
    _steps_against_peft(stock, slim)


class _CalledTwice(nn.Module):
    """q reads x with k, then again a tensor only it reads: the layer's two calls differ within every forward."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x):
        return self.q(x) * self.k(x) + self.q(x.exp())


def test_dropout_on_a_frozen_input_layer_called_twice_a_forward():
    """A layer called twice a forward (on x shared with k, then on an input only it reads) cannot learn one call
    from the other: it took the Function's route on its unshared call every step, 1 bit an element over peft. Seen
    called again while its last input lived, it runs peft's forward from then on; no step keeps more than peft but
    the one after that discovery (k learned to share with it: README, Limits)."""
    torch.manual_seed(0)
    stock = get_peft_model(_CalledTwice(), LoraConfig(r=R, target_modules=["q", "k"], lora_dropout=0.1,
                                                      init_lora_weights=False))
    slim = slim_of(stock)
    kept = _steps_against_peft(stock, slim, steps=4)
    assert kept[0][1] == kept[0][0]
    for stock_bytes, slim_bytes in kept[2:]:
        assert slim_bytes == stock_bytes


def test_a_model_that_learned_its_readers_pickles():
    """What a layer learned about its readers lives in its __dict__ (and held a weak reference to the input it read):
    torch.save(model) after a step raised "cannot pickle 'weakref.ReferenceType' object". Pickled, it keeps what it
    learned, not the input, and the loaded model's steps are peft's, sharing x from its first step."""
    import io

    torch.manual_seed(0)
    stock = get_peft_model(TwoReaders(lambda: nn.Linear(IN, OUT)),
                           LoraConfig(r=R, target_modules=["q", "k"], lora_dropout=0.1, init_lora_weights=False))
    slim = slim_of(stock)
    _steps_against_peft(stock, slim, steps=1)
    loaded = []
    for m in (stock, slim):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        loaded.append(torch.load(buf, weights_only=False))
    for stock_bytes, slim_bytes in _steps_against_peft(*loaded, steps=2):
        assert slim_bytes < stock_bytes


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_autocast_input_without_grad_keeps_no_adapter_cast(p):
    """CPU bf16 autocast, an input needing no gradient (q/k/v over frozen embeddings), adapters training: only dX
    reads A, so its bf16 cast is not kept (the Function kept every adapter tensor: r x in bytes more than peft's, a
    step); values as peft's."""
    torch.manual_seed(0)
    stock = get_peft_model(nn.Sequential(nn.Linear(64, 64)), LoraConfig(
        r=8, target_modules=["0"], lora_dropout=p, init_lora_weights=False))
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(4, 16, 64)
    results = []
    for model in (stock, slim):
        torch.manual_seed(1)
        with SavedTensors(exclude=[model]) as kept, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        results.append((kept.bytes, out, [q.grad for q in model.parameters() if q.requires_grad]))
    assert results[1][0] <= results[0][0], (results[1][0], results[0][0])
    assert_same(results[1][1], results[0][1])
    for a, b in zip(results[1][2], results[0][2], strict=True):
        assert_same(a, b)
