"""Hugging Face models built from tiny configs, wrapped with peft LoRA: converted equals stock.

Forward and backward of the converted model equal stock (fp32 tightly, bf16 within its rounding), the
LoRA adapters' gradients agree, frozen base weights get none, and a 5-step AdamW fine-tune tracks stock
loss for loss. Dropout probabilities are zero so that both sides compute the same function.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import slimgrad  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

V = 96  # vocabulary
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens(batch=2, seq=12):
    ids = torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_LIKE)), _tokens(), PROJECTIONS


def qwen3():
    cfg = transformers.Qwen3Config(**LLAMA_LIKE, head_dim=16)
    return transformers.Qwen3ForCausalLM(cfg), _tokens(), PROJECTIONS


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA_LIKE)), _tokens(), PROJECTIONS


def gemma3():
    cfg = transformers.Gemma3TextConfig(**LLAMA_LIKE, head_dim=16, sliding_window=8)
    return transformers.Gemma3ForCausalLM(cfg), _tokens(), PROJECTIONS


def phi3():
    cfg = transformers.Phi3Config(**{**LLAMA_LIKE, "num_key_value_heads": 4}, pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg), _tokens(), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg), _tokens(), ["c_attn", "c_proj", "c_fc"]


def bert():
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=V, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg), _tokens(), ["query", "key", "value", "dense"]


def t5():
    cfg = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=V,
                                dropout_rate=0.0, decoder_start_token_id=0)
    inputs = _tokens()
    return transformers.T5ForConditionalGeneration(cfg), inputs, ["q", "k", "v", "o", "wi", "wo"]


def vit():
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=5, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    model = transformers.ViTForImageClassification(cfg)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]  # transformers 5 names
    if not any(n.endswith(".fc1") for n, _ in model.named_modules()):  # transformers 4: BERT-style names
        targets = ["query", "key", "value", "dense"]
    inputs = {"pixel_values": pixels, "labels": torch.tensor([1, 3])}
    return model, inputs, targets


MODELS = {f.__name__: f for f in (llama, qwen3, mistral, gemma3, phi3, gpt2, bert, t5, vit)}
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def build(name, dtype):
    torch.manual_seed(0)
    model, inputs, targets = MODELS[name]()
    model = model.to(dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             fan_in_fan_out=(name == "gpt2"))
    stock = peft.get_peft_model(model, config)
    stock.train()
    return stock, inputs


def _loss(model, inputs):
    return model(**{k: v.clone() for k, v in inputs.items()}).loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_converted_lora_model_matches_stock(name, dtype):
    stock, inputs = build(name, dtype)
    slim, report = slimgrad.convert(stock, report=True)
    assert report.converted, "nothing was converted"
    la, lb = _loss(stock, inputs), _loss(slim, inputs)
    torch.testing.assert_close(lb, la, **TOLERANCE[dtype])
    la.backward()
    lb.backward()
    for (n, p), (m, q) in zip(stock.named_parameters(), slim.named_parameters()):
        assert n == m
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **TOLERANCE[dtype], msg=lambda s, n=n: f"{n}: {s}")
    assert all(p.grad is None for n, p in slim.named_parameters() if "lora_" not in n)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_five_adamw_steps_track_stock(name, dtype):
    stock, inputs = build(name, dtype)
    slim = slimgrad.convert(stock)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (stock, slim)]
    for _ in range(5):
        losses = []
        for model, opt in zip((stock, slim), opts):
            opt.zero_grad()
            loss = _loss(model, inputs)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_converted_model_keeps_less_and_reverts(name):
    stock, inputs = build(name, torch.bfloat16)
    slim = slimgrad.convert(stock)
    kept = []
    for model in (stock, slim):
        _loss(model, inputs).backward()  # warm-up
        with SavedTensors(exclude=[model]) as counter:
            loss = _loss(model, inputs)
        loss.backward()
        kept.append(counter.bytes)
    assert kept[1] < kept[0], kept
    back = slimgrad.revert(copy.deepcopy(slim))
    torch.testing.assert_close(_loss(back, inputs), _loss(stock, inputs), rtol=0, atol=0)
