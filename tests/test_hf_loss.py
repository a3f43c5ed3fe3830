"""convert(model, chunked_loss=True) on tiny Hugging Face causal LMs: same loss and gradients, no logits.

Only the causal-LM class itself is converted here (``include=[type(model)]``), so what is compared is the
head and its loss. Tolerances: fp32 loss and gradients within fp32 rounding of a different summation order
(the weight gradient of the head is summed chunk by chunk); bf16 gradients within bf16 rounding, which
grows through the layers below the head (a 1-ulp difference in dHidden becomes a few ulps in the first
layer's gradients).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimgrad  # noqa: E402
from slimgrad.integrations import hf_loss  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

V = 96
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=3e-2, atol=1e-3)}
READ_VERSION = "5.23."  # the transformers release whose forwards hf_loss's templates were read from


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_LIKE))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**LLAMA_LIKE, head_dim=8))


def gemma3():
    # A soft cap small enough that tanh is far from linear on these logits.
    cfg = transformers.Gemma3TextConfig(**LLAMA_LIKE, head_dim=8, sliding_window=8, final_logit_softcapping=0.1)
    return transformers.Gemma3ForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama": llama, "qwen3": qwen3, "gemma3": gemma3, "gpt2": gpt2}


def _batch(batch=2, seq=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    return ids, labels


def _build(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    model.config._attn_implementation = "eager"
    return model


def _converted(model, head_type=None, **kwargs):
    head_type = head_type or type(model)
    if not transformers.__version__.startswith(READ_VERSION) and head_type not in slimgrad._registry.REPLACEMENTS:
        pytest.skip(f"transformers {transformers.__version__}: {head_type.__name__}'s forward is not the one read")
    return slimgrad.convert(model, chunked_loss=True, include=[head_type], **kwargs)


def _close(actual, expected, what, **tol):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def _compare_grads(slim, stock, dtype):
    for (name, p), q in zip(stock.named_parameters(), slim.parameters()):
        if not p.requires_grad:
            assert q.grad is None and p.grad is None, name
            continue
        _close(q.grad, p.grad, name, **TOL[dtype])


def test_registered_classes():
    if not transformers.__version__.startswith(READ_VERSION):
        pytest.skip("the expected set is that of the transformers release that was read")
    names = {cls.__name__ for cls in hf_loss._HEADS}
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM",
            "GPT2LMHeadModel"} <= names
    # heads that scale or post-process their logits differently must not match any template
    from transformers.models.granite.modeling_granite import GraniteForCausalLM

    hf_loss.register_loaded()
    assert GraniteForCausalLM not in hf_loss._HEADS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_gradients_match_stock(name, dtype):
    stock = _build(name, dtype)
    slim = _converted(stock)
    assert type(slim) is not type(stock) and isinstance(slim, type(stock))
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids.clone(), labels=labels.clone())
    assert actual.logits is None and expected.logits is not None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, dtype)


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_bytes_drop_by_the_logits(name):
    stock = _build(name)
    slim = _converted(stock)
    ids, labels = _batch()
    kept = {}
    for key, model in (("stock", stock), ("slim", slim)):
        with SavedTensors(exclude=[model]) as rec:
            model(input_ids=ids, labels=labels)
        kept[key] = rec.bytes
    tokens = ids.numel()
    # stock keeps log_softmax's fp32 output (tokens x V), and tanh's output when soft-capping
    extra = tokens * V * 4 + (tokens * V * 4 if stock.config.get_text_config().to_dict().get(
        "final_logit_softcapping") else 0)
    assert kept["stock"] - kept["slim"] == extra, kept


def test_without_the_option_the_head_is_untouched_and_revert_restores_it():
    stock = _build("llama")
    plain, report = slimgrad.convert(stock, report=True)
    assert type(plain) is type(stock)
    assert "" not in [path for path, _ in report.converted]
    ids, labels = _batch()
    assert plain(input_ids=ids, labels=labels).logits is not None
    slim = _converted(stock)
    slimgrad.revert(slim)
    assert type(slim) is type(stock)
    out = slim(input_ids=ids, labels=labels)
    assert out.logits is not None
    _close(out.loss, stock(input_ids=ids, labels=labels).loss, "loss", rtol=0, atol=0)


def test_stock_forward_where_the_chunked_path_cannot_honour_the_call():
    stock = _build("llama")
    slim = _converted(stock)
    ids, labels = _batch()
    with torch.no_grad():  # evaluation: logits wanted
        out, ref = slim(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    _close(out.logits, ref.logits, "logits", rtol=0, atol=0)
    out = slim(input_ids=ids)  # no labels
    assert out.loss is None and out.logits.shape == (*ids.shape, V)
    out = slim(input_ids=ids, labels=labels[:, -1:], logits_to_keep=1)  # labels for the kept positions
    ref = stock(input_ids=ids, labels=labels[:, -1:], logits_to_keep=1)
    assert out.logits.shape == (ids.shape[0], 1, V)
    torch.testing.assert_close(out.loss, ref.loss, equal_nan=True, rtol=0, atol=0)
    slim.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().sum()  # a custom loss
    out = slim(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, out.logits.float().sum())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_num_items_in_batch_shift_labels_ignore_index_and_tuples(name):
    stock = _build(name)
    slim = _converted(stock)
    ids, labels = _batch()
    n = torch.tensor(5)
    expected = stock(input_ids=ids, labels=labels, num_items_in_batch=n)
    actual = slim(input_ids=ids, labels=labels, num_items_in_batch=n.clone())
    _close(actual.loss, expected.loss, "num_items_in_batch loss", **TOL[torch.float32])
    shifted = torch.roll(labels, -2, dims=1)
    expected = stock(input_ids=ids, labels=labels, shift_labels=shifted)
    actual = slim(input_ids=ids, labels=labels, shift_labels=shifted.clone())
    _close(actual.loss, expected.loss, "shift_labels loss", **TOL[torch.float32])
    other = labels.masked_fill(labels == -100, 7)
    expected = stock(input_ids=ids, labels=other, ignore_index=7)
    actual = slim(input_ids=ids, labels=other.clone(), ignore_index=7)
    _close(actual.loss, expected.loss, "ignore_index loss", **TOL[torch.float32])
    expected = stock(ids, labels=labels, return_dict=False)
    actual = slim(ids, labels=labels, return_dict=False)
    assert isinstance(actual, tuple) and len(actual) == len(expected) - 1  # the logits are left out
    _close(actual[0], expected[0], "tuple loss", **TOL[torch.float32])


def test_peft_lora_model_finds_the_head_inside():
    peft = pytest.importorskip("peft")
    base = _build("llama")
    stock = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    slim = _converted(stock, transformers.LlamaForCausalLM)
    inner = slim.get_base_model()
    assert type(inner) is not transformers.LlamaForCausalLM and isinstance(inner, transformers.LlamaForCausalLM)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids, labels=labels)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, torch.float32)
    assert slim.get_base_model().lm_head.weight.grad is None  # frozen by peft


def test_with_every_other_converter():
    stock = _build("llama")
    if stock.__class__ not in slimgrad._registry.REPLACEMENTS:
        pytest.skip("LlamaForCausalLM not registered on this transformers")
    slim = slimgrad.convert(stock, chunked_loss=True)
    ids, labels = _batch()
    expected, actual = stock(input_ids=ids, labels=labels), slim(input_ids=ids, labels=labels)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, torch.float32)
