"""transformers 5's mixture-of-experts layers: the experts' gated product keeps gate and up only.

The experts of Mixtral, Qwen2-MoE, OLMoE (and some fifty other families) run ``act_fn(gate) * up`` through
``_apply_gate`` in the "grouped_mm" (default) and "batched_mm" implementations; slimgrad's replacement computes it
with its gated activation. Checked here against stock on independent copies: the experts module alone bit for bit
in every requires_grad combination, whole models bit for bit (with the RMSNorms left stock, whose closed-form
backward sums a residual's gradient in another order, see the README's exactness notes, and the fused LoRA layers
likewise), the bytes kept (exactly
``act_fn(gate)`` less per routed token), and what is left alone and said so.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tests._util import assert_same

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers.integrations.moe")

import slimgrad  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def _config(family, implementation):
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON)
        cls, inter, top_k = transformers.MixtralForCausalLM, 48, cfg.num_experts_per_tok
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=40,
                                          shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                          **COMMON)
        cls, inter, top_k = transformers.Qwen2MoeForCausalLM, 40, 2
    else:
        cfg = transformers.OlmoeConfig(intermediate_size=40, num_experts=4, num_experts_per_tok=2, **COMMON)
        cls, inter, top_k = transformers.OlmoeForCausalLM, 40, 2
    cfg._experts_implementation = implementation
    return cfg, cls, inter, top_k


def _model(family, implementation="grouped_mm", dtype=torch.float32):
    cfg, cls, inter, top_k = _config(family, implementation)
    torch.manual_seed(0)
    model = cls(cfg).to(dtype)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora).train(), inter, top_k


def _experts_type(model):
    return next(type(m) for m in model.modules() if type(m).__name__.endswith("Experts"))


def _norm_type(model):
    return next(type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm"))


def _step(model, ids):
    with SavedTensors(exclude=[model]) as kept:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, kept.bytes


def _bitwise_stock_keeping_less(stock, replacement: str) -> int:
    """Convert ``stock`` (a copy) with and without its experts; assert the converted one's loss and gradients are
    stock's bit for bit and its experts are ``replacement``; return the bytes kept less than without the experts.
    Left stock on both sides: the RMSNorms' closed form and the fused LoRA layer (bf16) hand their input gradient
    over as one tensor, which autograd then sums with the residual's / the other projections' in another order
    (README, docs/lora.md: within rounding); the experts' product is the subject here."""
    others = [_norm_type(stock), peft.tuners.lora.Linear]
    slim = slimgrad.convert(copy.deepcopy(stock), exclude=others)
    without = slimgrad.convert(copy.deepcopy(stock), exclude=others + [_experts_type(stock)])
    assert _experts_type(slim).__qualname__ == replacement
    assert not _experts_type(without).__qualname__.startswith("Slim")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads, _ = _step(stock, ids)
    loss, grads, kept = _step(slim, ids)
    _, _, kept_without = _step(without, ids)
    assert_same(loss, ref_loss, what="loss")
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in grads.items():
        assert_same(g, ref_grads[n], what=n)
    return kept_without - kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_model_is_stock_bit_for_bit_and_keeps_act_gate_less(family, implementation, dtype):
    stock, inter, top_k = _model(family, implementation, dtype)
    less = _bitwise_stock_keeping_less(stock, "Slim" + _experts_type(stock).__name__)
    # act_fn(gate) of every routed (token, expert) pair is no longer kept
    assert less == COMMON["num_hidden_layers"] * 2 * 12 * top_k * inter * dtype.itemsize, less


@pytest.mark.parametrize("rg", list(itertools.product([False, True], repeat=3)), ids=str)
def test_experts_alone_in_every_requires_grad_combination(rg):
    """(hidden states, routing weights, expert weights) needing a gradient or not: outputs and every gradient are
    stock's bit for bit."""
    stock, _, _ = _model("mixtral")
    experts = dict(stock.named_modules())["base_model.model.model.layers.0.mlp.experts"]
    slim = slimgrad.convert(copy.deepcopy(experts))
    assert type(slim).__qualname__ == "SlimMixtralExperts" and isinstance(slim, type(experts))
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(10, 64, generator=g)
    index = torch.randint(0, 4, (10, 2), generator=g)
    weights0 = torch.rand(10, 2, generator=g)
    dy = torch.randn(10, 64, generator=g)
    results = []
    for module in (experts, slim):
        module.requires_grad_(rg[2])
        x = x0.clone().requires_grad_(rg[0])
        w = weights0.clone().requires_grad_(rg[1])
        y = module(x, index, w)
        if y.requires_grad:
            y.backward(dy)
        results.append((y.detach(), x.grad, w.grad, [p.grad for p in module.parameters()]))
    (y0, dx0, dw0, dp0), (y1, dx1, dw1, dp1) = results
    assert_same(y1, y0, what="output")
    for a, b, what in ((dx1, dx0, "dX"), (dw1, dw0, "routing weights' gradient"), *zip(dp1, dp0, ["dW1", "dW2"])):
        assert (a is None) == (b is None), what
        if a is not None:
            assert_same(a, b, what=what)


def test_eager_implementation_is_left_alone_and_said_so():
    stock, _, _ = _model("mixtral", "eager")
    slim, report = slimgrad.convert(stock, report=True)
    assert type(dict(slim.named_modules())["base_model.model.model.layers.0.mlp.experts"]).__name__ == "MixtralExperts"
    assert "experts implementation 'eager'" in str(report)


def test_classes_with_their_own_gate_are_registered_only_where_it_is_read():
    from slimgrad._registry import REPLACEMENTS
    from slimgrad.integrations import hf_moe

    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    slimgrad.convert(torch.nn.Linear(2, 2))  # loads the integrations and registers the loaded classes
    assert MixtralExperts in REPLACEMENTS
    assert REPLACEMENTS[gpt_oss.GptOssExperts]._apply_gate is hf_moe._clamped_swiglu_gate  # its own gate, read
    # a gate of another source is left alone
    other = type("OtherExperts", (gpt_oss.GptOssExperts,), {"_apply_gate": lambda self, x: x * 2})
    assert not hf_moe._register_experts(other) and other not in REPLACEMENTS
    from slimgrad._notices import class_gap

    gap = class_gap(other)  # and convert says so for a model that has one
    assert gap is not None and gap.family == "MoE experts" and "OtherExperts._apply_gate" in gap.reason, gap


def test_drop_in_and_revert():
    stock, _, _ = _model("qwen2_moe")
    keys = list(stock.state_dict())
    slim = slimgrad.convert(stock)
    experts = [m for m in slim.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(type(m).__qualname__ == "SlimQwen2MoeExperts" for m in experts)
    assert list(slim.state_dict()) == keys
    back = slimgrad.revert(slim)
    assert all(type(m).__name__ == "Qwen2MoeExperts" for m in back.modules() if type(m).__name__.endswith("Experts"))


def test_an_activation_hooked_after_conversion_runs_stock_product():
    """A hook on the experts' activation would be skipped by the fused product: stock's product runs, the hook
    fires, and the numbers are stock's."""
    stock, _, _ = _model("mixtral")
    experts = dict(stock.named_modules())["base_model.model.model.layers.0.mlp.experts"]
    slim = slimgrad.convert(copy.deepcopy(experts))
    calls = []
    slim.act_fn.register_forward_hook(lambda *a: calls.append(1))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g, requires_grad=True)
    index = torch.randint(0, 4, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    assert_same(slim(x, index, w), experts(x, index, w), what="output with a hooked activation")
    assert calls


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("family,dtype", [("mixtral", torch.float32), ("mixtral", torch.bfloat16),
                                          ("qwen2_moe", torch.float32), ("qwen2_moe", torch.bfloat16),
                                          ("gpt_oss", torch.float32), ("gpt_oss", torch.bfloat16)],
                         ids=["mixtral-fp32", "mixtral-bf16", "qwen2_moe-fp32", "qwen2_moe-bf16", "gpt_oss-fp32",
                              "gpt_oss-bf16"])
def test_estimate_of_a_moe_step_is_the_measured_peak(family, dtype, converted):
    """``slimgrad.estimate`` on a MoE model against the allocator's records of a real step. fp32: to the byte (the
    estimate sizes ``aten._grouped_mm`` itself, whose meta kernel takes bf16 only where the CPU kernel takes fp32
    too). bf16 on CPU: the grouped matmul holds scratch that grows with its largest group, which the routing
    decides; the estimate counts an even split and says so: here within 1 % (exact where the step's peak is
    elsewhere, as on Mixtral). fp32: no such scratch, exact, and no note."""
    from tests import _budget_models as bm

    if family == "gpt_oss":
        pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
        model, _, _ = _gpt_oss("grouped_mm", dtype)
    else:
        model, _, _ = _model(family, "grouped_mm", dtype)
    if converted:
        model = slimgrad.convert(model)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    example = {"input_ids": ids, "labels": ids}
    measured = bm.measured_step_peak(model, example, warm=1)
    est = slimgrad.estimate(model, **example)
    # fp32 on CPU: no scratch beyond the output whatever the routing, so nothing to say about it
    assert any("grouped matmuls" in n for n in est.notes) == (dtype != torch.float32), est.notes
    if dtype == torch.float32 or family == "mixtral":
        assert est.step_peak_bytes == measured
    else:
        assert abs(est.step_peak_bytes - measured) <= 0.01 * measured, (est.step_peak_bytes, measured)


@pytest.mark.slow
def test_converted_experts_compile_with_fullgraph():
    """``torch.compile(fullgraph=True)`` traces the converted experts (grouped_mm and slimgrad's gated product);
    Inductor fuses the elementwise ops, so the numbers are eager stock's within fp32 rounding."""
    stock, _, _ = _model("mixtral")
    experts = dict(stock.named_modules())["base_model.model.model.layers.0.mlp.experts"]
    compiled = torch.compile(slimgrad.convert(copy.deepcopy(experts)), fullgraph=True)
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(10, 64, generator=g)
    index = torch.randint(0, 4, (10, 2), generator=g)
    w0 = torch.rand(10, 2, generator=g)
    results = []
    for module in (experts, compiled):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = module(x, index, w)
        y.sum().backward()
        results.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# -- GPT-OSS: its own clamped SwiGLU on interleaved columns, keeping its input only -------------------------------


def _gpt_oss_gate_values(dtype, limit=7.0):
    """Interleaved [gate, up] columns with values at and around the clamps' bounds, zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 7, 24, generator=g) * 6
    special = torch.tensor([limit, -limit, limit + 1, -limit - 1, 0.0, -0.0, float("inf"), float("-inf"),
                            float("nan"), 1e-30, -1e-30, 3.0])
    x.view(-1)[:special.numel()] = special
    x.view(-1)[40:40 + special.numel()] = special.flip(0)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clamped_swiglu_is_gpt_oss_gate_bit_for_bit_keeping_its_input(dtype):
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from slimgrad.functional.clamped_swiglu import clamped_swiglu

    cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=2)
    experts = gpt_oss.GptOssExperts(cfg)  # only its _apply_gate is used: the stock reference
    x0 = _gpt_oss_gate_values(dtype, experts.limit)
    dy = torch.randn(5, 7, 12, generator=torch.Generator().manual_seed(7)).to(dtype)
    dy.view(-1)[:3] = torch.tensor([-0.0, 0.0, -1e-30])
    results = []
    for fn in (lambda x: experts._apply_gate(x), lambda x: clamped_swiglu(x, experts.limit, experts.alpha)):
        leaf = x0.clone().requires_grad_()
        x = leaf * 1
        with SavedTensors() as kept:
            y = fn(x)
        y.backward(dy)
        results.append((y.detach(), leaf.grad, kept.bytes))
    (y0, g0, k0), (y1, g1, k1) = results
    assert_same(y1, y0, what="output")
    assert_same(g1, g0, what="gradient")
    assert torch.equal(torch.signbit(g1), torch.signbit(g0))  # -0.0 where stock has -0.0 only
    assert k1 == x0.numel() * x0.element_size() and k0 >= 2 * k1, (k0, k1)


def _gpt_oss(implementation="grouped_mm", dtype=torch.float32):
    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg._experts_implementation = implementation
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # the gate_up outputs spread over the clamps' bounds (limit 7)
        for m in model.modules():
            if type(m).__name__ == "GptOssExperts":
                m.gate_up_proj.normal_(0, 1.5)
                m.gate_up_proj_bias.normal_(0, 2)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora).train(), 40, 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_gpt_oss_model_is_stock_bit_for_bit_and_keeps_four_intermediates_less(implementation, dtype):
    pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    stock, inter, top_k = _gpt_oss(implementation, dtype)
    less = _bitwise_stock_keeping_less(stock, "SlimGptOssExperts")
    # the clamped gate, the sigmoid, up + 1 and the GLU of every routed pair are no longer kept
    assert less == 2 * (2 * 12 * top_k) * 4 * inter * dtype.itemsize, less


def test_gpt_oss_experts_under_peft_target_parameters_are_converted():
    """GPT-OSS fine-tuning recipes put LoRA on the experts' weights themselves (peft's ``target_parameters``: a
    ``ParamWrapper`` around the experts, which slimgrad leaves to peft and reports): the experts inside are still
    converted, with peft's numbers bit for bit and less kept."""
    pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    stock, _, _ = _gpt_oss()
    base = stock.get_base_model()
    torch.manual_seed(2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(copy.deepcopy(base), lora).train()
    others = [_norm_type(model), peft.tuners.lora.Linear]
    slim, report = slimgrad.convert(copy.deepcopy(model), exclude=others, report=True)
    assert sum(type(m).__qualname__ == "SlimGptOssExperts" for m in slim.modules()) == 2
    assert "ParamWrapper" in str(report)  # left to peft, and said so
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads, ref_kept = _step(model, ids)
    loss, grads, kept = _step(slim, ids)
    assert_same(loss, ref_loss, what="loss")
    assert grads.keys() == ref_grads.keys() and any("experts" in n for n in grads)
    for n, g in grads.items():
        assert_same(g, ref_grads[n], what=n)
    assert kept < ref_kept


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_experts_in_bf16_are_as_accurate_as_stock(family, device):
    """bf16 experts against an fp32 run of the same module (grouped_mm takes no fp64): slimgrad's output and
    gradients are as close to it as stock's (on CUDA the gated product runs slimgrad's Triton kernel, whose rounding
    may differ from stock's elementwise ops; on CPU they are stock's bits), and less is kept."""
    if family == "gpt_oss":
        pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
        model, _, _ = _gpt_oss()
    else:
        model, _, _ = _model("mixtral")
    experts = dict(model.named_modules())["base_model.model.model.layers.0.mlp.experts"].to(device)
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(16, 64, generator=g).to(device)
    index = torch.randint(0, 4, (16, 2), generator=g).to(device)
    w0 = torch.rand(16, 2, generator=g).to(device)
    dy = torch.randn(16, 64, generator=g).to(device)

    def run(module, dtype):
        module = copy.deepcopy(module).to(dtype)
        x, w = x0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
        with SavedTensors(exclude=[module]) as kept:
            y = module(x, index, w)
        y.backward(dy.to(dtype))
        return [t.double() for t in (y.detach(), x.grad, w.grad)], kept.bytes

    exact, _ = run(experts, torch.float32)
    stock, stock_kept = run(experts, torch.bfloat16)
    slim, slim_kept = run(slimgrad.convert(copy.deepcopy(experts)), torch.bfloat16)
    for what, e, a, b in zip(("output", "dX", "routing weights' gradient"), exact, stock, slim):
        err_stock, err_slim = (a - e).abs().max().item(), (b - e).abs().max().item()
        assert err_slim <= 2 * err_stock + 1e-6, (what, err_slim, err_stock)
        if device == "cpu":
            assert torch.equal(a, b), what
    assert slim_kept < stock_kept
