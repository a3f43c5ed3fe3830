"""convert(model, chunked_loss=True) on tiny Hugging Face causal LMs: same loss and gradients, no logits.

Only the causal-LM class itself is converted here (``include=[type(model)]``), so what is compared is the
head and its loss. Tolerances: fp32 loss and gradients within fp32 rounding of a different summation order
(the weight gradient of the head is summed chunk by chunk); bf16 gradients within bf16 rounding, which
grows through the layers below the head (a 1-ulp difference in dHidden becomes a few ulps in the first
layer's gradients).

No version gate: the heads the README claims must engage on the installed transformers, and the simulated
upstream edits (a renamed keyword, a new decorator, a head that scales its logits, a wrapped loss function)
must give stock's numbers: chunked where the check passes, stock with a warning where it does not.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimgrad  # noqa: E402
from slimgrad import _notices  # noqa: E402
from slimgrad._notices import SlimgradWarning  # noqa: E402
from slimgrad._registry import ORIGINALS, REPLACEMENTS  # noqa: E402
from slimgrad.integrations import hf_loss  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

V = 96
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=3e-2, atol=1e-3)}


def _decoder(family, config_name=None, **extra):
    def build():
        module = sys.modules[f"transformers.models.{family}.modeling_{family}"]
        head = next(v for k, v in vars(module).items() if k.endswith("ForCausalLM") and k[0].isupper()
                    and v.__module__ == module.__name__ and "PreTrainedModel" not in k)
        config_class = getattr(transformers, config_name) if config_name else head.config_class
        return head(config_class(**LLAMA_LIKE, **extra))
    return build


def gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


#: the heads the README claims (a soft cap small enough that tanh is far from linear on these logits)
MODELS = {
    "llama": _decoder("llama"),
    "qwen2": _decoder("qwen2"),
    "qwen3": _decoder("qwen3", head_dim=8),
    "mistral": _decoder("mistral"),
    "gemma": _decoder("gemma", head_dim=8),
    "gemma2": _decoder("gemma2", head_dim=8, final_logit_softcapping=0.1),
    "gemma3": _decoder("gemma3", "Gemma3TextConfig", head_dim=8, sliding_window=8, final_logit_softcapping=0.1),
    "phi3": _decoder("phi3", pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "olmo2": _decoder("olmo2"),
    "gpt2": gpt2,
}
CLAIMED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
           "gpt2": "GPT2LMHeadModel"}


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
    """Convert the head only; fail naming the reason when the chunked head does not engage."""
    head_type = head_type or type(model)
    slim, report = slimgrad.convert(model, chunked_loss=True, include=[head_type], report=True, **kwargs)
    engaged = [m for m in slim.modules() if ORIGINALS.get(type(m)) is head_type]
    reasons = "; ".join(g.message() for g in report.gaps) or "no gap recorded"
    assert engaged, (f"chunked_loss did not engage on {head_type.__name__} (transformers "
                     f"{transformers.__version__}): {reasons}")
    return slim


def _close(actual, expected, what, **tol):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def _compare_grads(slim, stock, dtype):
    for (name, p), q in zip(stock.named_parameters(), slim.parameters()):
        if not p.requires_grad or p.grad is None:  # frozen, or unused (cross-attention without an encoder)
            assert q.grad is None and p.grad is None, name
            continue
        _close(q.grad, p.grad, name, **TOL[dtype])

def _assert_chunked_like_stock(slim, stock) -> None:
    """One fp32 training step of both: slimgrad's returns no logits, the same loss and the same gradients."""
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids, labels=labels)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, torch.float32)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    _notices.reset_warned()
    yield
    _notices.reset_warned()


def test_claimed_classes_are_registered():
    registered = {cls.__name__ for cls in REPLACEMENTS if hf_loss._is_head(cls)}
    missing = set(CLAIMED.values()) - registered
    assert not missing, (f"transformers {transformers.__version__}: claimed heads not registered for chunked_loss: "
                         f"{sorted(missing)} ({[str(_notices.class_gap(c)) for c in REPLACEMENTS if c in missing]})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_gradients_match_stock(name, dtype):
    stock = _build(name, dtype)
    assert type(stock).__name__ == CLAIMED[name]
    slim = _converted(stock)
    assert type(slim) is not type(stock) and isinstance(slim, type(stock))
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids.clone(), labels=labels.clone())
    assert actual.logits is None and expected.logits is not None
    assert type(actual) is type(expected)
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


def test_the_check_leaves_the_model_as_it_was():
    stock = _build("llama")
    stock.train()
    stock.model.layers[0].train(False)  # a mixed state must come back as it was
    before = {k: v.clone() for k, v in stock.state_dict().items()}
    rng = torch.random.get_rng_state()
    slim = slimgrad.convert(stock, chunked_loss=True, include=[type(stock)], inplace=True)
    assert type(slim) in ORIGINALS
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert slim.training and not slim.model.layers[0].training and slim.model.layers[1].training
    assert all(p.grad is None for p in slim.parameters())
    for k, v in slim.state_dict().items():
        assert torch.equal(v, before[k]), k


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
    with pytest.warns(SlimgradWarning, match="loss_function"):
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
    assert actual.logits is None
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
    # stock's positions, None in the logits' slot (ModelOutput.to_tuple() drops None: the cache took the logits' place)
    assert isinstance(actual, tuple) and len(actual) == len(expected) and actual[1] is None
    assert [type(v) for v in actual[2:]] == [type(v) for v in expected[2:]]
    _close(actual[0], expected[0], "tuple loss", **TOL[torch.float32])


def test_peft_lora_model_finds_the_head_inside():
    peft = pytest.importorskip("peft")
    base = _build("llama")
    stock = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    slim = _converted(stock, transformers.LlamaForCausalLM)
    inner = slim.get_base_model()
    assert type(inner) is not transformers.LlamaForCausalLM and isinstance(inner, transformers.LlamaForCausalLM)
    _assert_chunked_like_stock(slim, stock)
    assert slim.get_base_model().lm_head.weight.grad is None  # frozen by peft


def test_with_every_other_converter():
    stock = _build("llama")
    slim = slimgrad.convert(stock, chunked_loss=True)
    assert type(slim) in ORIGINALS, "LlamaForCausalLM not converted by convert(chunked_loss=True)"
    _assert_chunked_like_stock(slim, stock)


# -- simulated upstream edits ----------------------------------------------------------------------------------


def _edited_head(name: str, forward) -> type:
    """A new head class, as a next transformers release could ship it: Llama's head with ``forward``, defined in
    a throwaway transformers modeling module (where slimgrad looks for heads) and registered from there."""
    module_name = f"transformers.models.edited_{name.lower()}.modeling_edited_{name.lower()}"
    module = types.ModuleType(module_name)
    cls = type(name, (transformers.LlamaForCausalLM,), {"forward": forward, "__module__": module_name})
    module.__dict__[name] = cls
    sys.modules[module_name] = module
    try:
        hf_loss.register_loaded()
    finally:
        del sys.modules[module_name]
    assert cls in REPLACEMENTS
    return cls


def _new_decorator(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


def _build_as(cls, dtype=torch.float32):
    torch.manual_seed(0)
    model = cls(transformers.LlamaConfig(**LLAMA_LIKE)).to(dtype)
    model.config._attn_implementation = "eager"
    return model


def test_renamed_keyword_new_decorator_and_extra_output_field_still_engage():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @_new_decorator
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_state=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=kv_state, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state[:, -logits_to_keep:] if logits_to_keep
                              else outputs.last_hidden_state)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states)

    cls = _edited_head("RenamedForCausalLM", forward)
    stock = _build_as(cls)
    slim = _converted(stock)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels, output_hidden_states=True)
    actual = slim(input_ids=ids, labels=labels, output_hidden_states=True)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    for a, e in zip(actual.hidden_states, expected.hidden_states, strict=True):
        _close(a, e, "hidden_states", rtol=0, atol=0)
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, torch.float32)


def test_head_that_scales_its_logits_is_left_as_stock_with_a_warning():
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state) / 1.25  # a logit scale the chunked path does not know
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=logits)

    cls = _edited_head("ScaledForCausalLM", forward)
    stock = _build_as(cls)
    with pytest.warns(SlimgradWarning, match="ScaledForCausalLM"):
        slim = slimgrad.convert(stock, chunked_loss=True, include=[cls])
    assert type(slim) is cls
    assert "ScaledForCausalLM" in str(_notices.class_gap(cls))
    ids, labels = _batch()
    out = slim(input_ids=ids, labels=labels)
    assert out.logits is not None
    _close(out.loss, stock(input_ids=ids, labels=labels).loss, "loss", rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_function_wrapped_in_partial_runs_stock_with_a_warning(dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    stock = _build("llama", dtype)
    slim = _converted(stock)
    for model in (stock, slim):
        model.loss_function = functools.partial(ForCausalLMLoss)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    with pytest.warns(SlimgradWarning, match=rf"LlamaForCausalLM.*transformers {transformers.__version__}.*partial"):
        actual = slim(input_ids=ids, labels=labels)
    assert actual.logits is not None
    _close(actual.loss, expected.loss, "loss", rtol=0, atol=0)
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, dtype)


def test_moe_router_outputs_requested_at_call_time_run_stock_with_a_warning():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)
    stock = transformers.MixtralForCausalLM(cfg)
    slim = _converted(stock)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids, labels=labels)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected = stock(input_ids=ids, labels=labels, output_router_logits=True)  # adds the auxiliary loss
    with pytest.warns(SlimgradWarning, match="router_logits"):
        actual = slim(input_ids=ids, labels=labels, output_router_logits=True)
    _close(actual.loss, expected.loss, "loss with aux loss", rtol=0, atol=0)
    _close(actual.aux_loss, expected.aux_loss, "aux loss", rtol=0, atol=0)


@pytest.mark.parametrize("where", ["keyword", "config"])
def test_moe_router_outputs_asked_for_run_the_body_once(where):
    """The chunked path ran the whole body, saw router_logits, dropped that graph and ran stock's forward: every
    such call ran the body twice (hooks fired twice, dropout drew twice: loss 5.53942 against 5.53801; peak 604 KB
    against 415 KB; the hfloss sweep). It is decided from the call's flags before the body runs."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**{**LLAMA_LIKE, "attention_dropout": 0.3}, num_local_experts=4,
                                     num_experts_per_tok=2)
    stock = transformers.MixtralForCausalLM(cfg).train()
    slim = _converted(copy.deepcopy(stock))
    ids, labels = _batch()
    kwargs = {"output_router_logits": True} if where == "keyword" else {}
    if where == "config":
        for model in (stock, slim):
            model.config.output_router_logits = True
    calls = []
    slim.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    torch.manual_seed(5)
    expected = stock(input_ids=ids, labels=labels, **kwargs)
    expected.loss.backward()
    torch.manual_seed(5)
    with pytest.warns(SlimgradWarning, match="output_router_logits"):
        actual = slim(input_ids=ids, labels=labels, **kwargs)
    actual.loss.backward()
    assert len(calls) == 1
    _close(actual.loss, expected.loss, "loss with aux loss", rtol=0, atol=0)
    for p, q in zip(stock.parameters(), slim.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_meta_device_is_left_as_stock_with_a_warning():
    with torch.device("meta"):
        model = MODELS["llama"]()
    with pytest.warns(SlimgradWarning, match="meta device"):
        slim = slimgrad.convert(model, chunked_loss=True, include=[type(model)])
    assert type(slim) is type(model)
    real = _build("llama")  # the meta refusal is not remembered for real modules of the class
    _converted(real)


def _trl_with_fused_head():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head (SFTTrainer calls the model's own forward)")
    return trl_utils


def test_trl_fused_head_on_the_instance_is_left_to_trl_with_a_warning():
    trl_utils = _trl_with_fused_head()
    model = _build("llama")
    trl_utils.add_fused_lm_head(model)  # what SFTTrainer does to its model
    with pytest.warns(SlimgradWarning, match="TRL"):
        slim = slimgrad.convert(model, chunked_loss=True, include=[type(model)], inplace=True)
    assert type(slim) is transformers.LlamaForCausalLM


def _tiny(config_name, model_name, **kwargs):
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
    model.config._attn_implementation = "eager"
    return model


BERT_LIKE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=V,
                 is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
#: heads that do more than a plain linear layer, each verified by the check with what its config names
OTHER_HEADS = {
    "cohere logit_scale": lambda: _tiny("CohereConfig", "CohereForCausalLM", **LLAMA_LIKE, logit_scale=0.25,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "granite logits_scaling": lambda: _tiny("GraniteConfig", "GraniteForCausalLM", **LLAMA_LIKE, logits_scaling=4.0),
    "bert transform head": lambda: _tiny("BertConfig", "BertLMHeadModel", **BERT_LIKE),
    "bart unshifted loss": lambda: _tiny("BartConfig", "BartForCausalLM", d_model=32, decoder_layers=2,
                                         decoder_attention_heads=4, decoder_ffn_dim=48, vocab_size=V, dropout=0.0,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                                         forced_eos_token_id=2),
}


@pytest.mark.parametrize("name", list(OTHER_HEADS))
def test_heads_beyond_a_plain_linear_layer_engage_with_stock_numbers(name):
    stock = OTHER_HEADS[name]()
    slim = _converted(stock)
    _assert_chunked_like_stock(slim, stock)


def test_trl_fused_head_over_a_converted_head_does_the_work_once():
    """convert first, then what SFTTrainer does: TRL's fused head computes the loss from the body, slimgrad's
    head forward does not run on top (no double work), and the numbers are TRL's on a stock model."""
    trl_utils = _trl_with_fused_head()
    stock = _build("llama")
    slim = _converted(stock)
    trl_utils.add_fused_lm_head(stock)
    trl_utils.add_fused_lm_head(slim)
    calls = []
    handle = slim.lm_head.register_forward_pre_hook(lambda m, a: calls.append("lm_head"))
    original = hf_loss._loss
    hf_loss._loss = lambda *a, **k: calls.append("chunked") or original(*a, **k)
    try:
        ids, labels = _batch()
        expected = stock(input_ids=ids, labels=labels, fused_lm_head=True)
        actual = slim(input_ids=ids, labels=labels, fused_lm_head=True)
    finally:
        hf_loss._loss = original
        handle.remove()
    assert calls == []  # neither slimgrad's chunked loss nor the head's linear layer ran
    _close(actual.loss, expected.loss, "TRL loss", rtol=0, atol=0)


def test_a_config_change_after_convert_is_checked_again():
    stock = OTHER_HEADS["granite logits_scaling"]()
    slim = _converted(stock)
    for model in (stock, slim):
        model.config.logits_scaling = 2.0  # what the check read at convert time was 4.0
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids, labels=labels)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])


def test_a_refusal_for_one_instance_is_not_remembered_for_another_of_the_same_config():
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(_build("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.warns(SlimgradWarning, match="not torch.nn.Linear"):
        slim = slimgrad.convert(wrapped, chunked_loss=True, include=[transformers.LlamaForCausalLM])
    assert type(slim.get_base_model()) is transformers.LlamaForCausalLM
    _converted(_build("llama"))  # same class, config and dtype, a plain head: engages


def _chunked_gap(model) -> str:
    _, report = slimgrad.convert(model, chunked_loss=True, report=True)
    gaps = [g.reason for g in report.gaps if g.family == "chunked_loss"]
    assert len(gaps) == 1, report.gaps
    return gaps[0]


def _tiny_bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0)
    return transformers.BartForCausalLM(config)


def test_a_head_whose_stock_loss_is_bf16_is_left_to_stock():
    """BART's decoder head (and Marian's, Pegasus', XLNet's, ...) takes cross-entropy on bf16 logits, a bf16 loss; the
    chunked loss sums in fp32: 0.3 % off stock's loss and every gradient with it, in bf16 only (found by this stop's
    sweep over every causal-LM architecture). The check now refuses it there, naming both dtypes."""
    bart = _tiny_bart()
    assert "stock loss is computed in torch.bfloat16" in _chunked_gap(bart.to(torch.bfloat16))
    _assert_chunked_like_stock(_converted(bart.float()), bart)  # fp32: engaged, as before


def test_a_cast_after_convert_is_checked_again():
    """Converted in fp32 then cast with .to(bfloat16): the fp32 check's verdict was kept, and BART returned an fp32
    chunked loss where stock's is bf16 (3.952882 against 3.953125, gradients 1.14x their largest value off; the
    hfloss sweep). The head's dtype is part of what the verdict depends on."""
    stock = _tiny_bart()
    slim = _converted(copy.deepcopy(stock))
    stock.to(torch.bfloat16)
    slim.to(torch.bfloat16)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    with pytest.warns(SlimgradWarning, match="stock loss is computed in torch.bfloat16"):
        actual = slim(input_ids=ids, labels=labels)
    assert actual.loss.dtype == torch.bfloat16 and actual.logits is not None
    _close(actual.loss, expected.loss, "loss", rtol=0, atol=0)


def test_a_vocabulary_no_larger_than_the_hidden_size_is_left_to_stock():
    """The chunked loss keeps the hidden states where stock keeps the logits: with a vocabulary no larger than the
    head's input (byte-level vocabularies, RemBERT's 1664-wide head input) that is more than stock (1.14-1.34x)."""
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_LIKE, "vocab_size": 16}))
    assert LLAMA_LIKE.get("hidden_size", 0) >= 16
    assert "vocabulary (16) is no larger than its output embedding's input" in _chunked_gap(small)


def test_hidden_states_in_another_dtype_than_the_head_are_cast_as_stock_casts_them():
    """Mamba's body returns fp32 hidden states to a bf16 head, which stock casts to the head's dtype: the chunked path
    refused them ("'weight' has dtype torch.bfloat16 but 'hidden' has torch.float32 ... cast them, or run under
    torch.autocast", advice a user cannot act on), so bf16 Mamba, Mamba2 and FalconMamba never engaged (found by this
    stop's sweep over every causal-LM architecture). It casts as stock does; the check still compares the numbers."""
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2,
                                      expand=2, conv_kernel=4, time_step_rank=4)
    stock = transformers.MambaForCausalLM(config).to(torch.bfloat16)
    slim = _converted(stock)
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    actual = slim(input_ids=ids.clone(), labels=labels.clone())
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(slim, stock, torch.bfloat16)


@pytest.mark.slow
def test_compiled_after_another_chunked_model_was_dropped():
    """The check's result lived in a WeakKeyDictionary that dynamo guarded by entry position: a model dropped (in a
    reference cycle, collected while the next one was traced) broke the guard (IndexError; the compile sweep)."""
    ids, labels = _batch()
    first = _converted(_build("llama"))
    torch.compile(first, backend="eager")(input_ids=ids, labels=labels).loss.backward()
    stock = _build("llama")
    second = _converted(_build("llama"))
    del first  # in reference cycles: the collector frees it while the second model is traced
    torch._dynamo.reset()
    out = torch.compile(second, backend="eager")(input_ids=ids, labels=labels)
    assert out.logits is None  # the chunked path ran under compile
    expected = stock(input_ids=ids, labels=labels).loss
    _close(out.loss, expected, "loss", **TOL[torch.float32])
    hf_loss_state = [k for k in vars(second) if k.startswith("_slimgrad_chunked")]
    assert hf_loss_state and not any(k.startswith("_slimgrad_") for k in vars(slimgrad.revert(second)))


def test_a_head_inside_another_hf_model_is_a_gap_not_engaged():
    """An encoder-decoder (or BLIP-2) calls its causal-LM decoder without labels and computes the loss from the
    logits itself: the chunked head never ran, yet convert reported it converted (the multimodal sweep)."""
    bert = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=48)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=V, n_positions=64,
                                   add_cross_attention=True, is_decoder=True)
    torch.manual_seed(0)
    model = transformers.EncoderDecoderModel(encoder=transformers.BertModel(bert),
                                             decoder=transformers.GPT2LMHeadModel(gpt2))
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    _notices.reset_warned()
    with pytest.warns(SlimgradWarning, match=r"GPT2LMHeadModel .*inside EncoderDecoderModel, which calls it without "
                                             r"labels"):
        slim, report = slimgrad.convert(model, chunked_loss=True, report=True)
    assert type(slim.decoder) is transformers.GPT2LMHeadModel  # left stock
    assert any("EncoderDecoderModel" in g.reason for g in report.gaps)
    ids, labels = _batch()
    torch.manual_seed(1)  # the same dropout masks
    expected = model(input_ids=ids, labels=labels)
    torch.manual_seed(1)
    got = slim(input_ids=ids, labels=labels)
    assert torch.equal(got.loss, expected.loss) and got.logits is not None


def test_a_training_call_without_labels_says_the_chunked_loss_cannot_serve_it():
    """A caller that computes its own loss from the logits (TRL's ORPO or CPO, a value head, a custom loss): stock's
    forward runs, with a warning once, not silently."""
    stock = _build("llama")
    slim = _converted(_build("llama"))
    ids, _ = _batch()
    _notices.reset_warned()
    with pytest.warns(SlimgradWarning, match="called in training without labels"):
        got = slim(input_ids=ids).logits
    assert torch.equal(got, stock(input_ids=ids).logits)
    slim.eval()
    _notices.reset_warned()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlimgradWarning)
        slim(input_ids=ids)  # evaluation wants logits: nothing to say


@pytest.mark.parametrize("family,in_fp32", [("beam", True), ("gemma2", False)])
def test_a_bf16_soft_cap_is_applied_in_the_dtype_stock_applies_it(family, in_fp32):
    """Beam caps its logits after the fp32 upcast, Gemma 2 in the head's dtype. In bf16 the check's tolerance passed
    Gemma's recipe for Beam: gradients 1.6-1.9 % of their largest value off stock's (the architectures sweep)."""
    extra = {"num_experts": 4, "num_experts_per_tok": 2} if family == "beam" else {}
    if family == "beam" and not hasattr(transformers, "BeamForCausalLM"):
        pytest.skip("Beam needs a newer transformers")
    stock = _decoder(family, head_dim=8, final_logit_softcapping=0.1, **extra)().to(torch.bfloat16)
    slim = _converted(copy.deepcopy(stock))
    assert hf_loss.check(slim).recipe.softcap_fp32 is in_fp32
    ids, labels = _batch()
    torch.manual_seed(2)
    expected = stock(input_ids=ids, labels=labels)
    expected.loss.backward()
    torch.manual_seed(2)
    got = slim(input_ids=ids, labels=labels)
    got.loss.backward()
    assert got.logits is None
    _close(got.loss, expected.loss, "loss", rtol=1e-6, atol=0)
    for p, q in zip(stock.parameters(), slim.parameters()):
        if p.grad is not None:
            scale = p.grad.float().abs().max().item()
            assert (q.grad.float() - p.grad.float()).abs().max().item() <= 4e-3 * scale


def test_an_fp32_soft_cap_under_autocast_is_applied_in_the_dtype_stock_applies_it():
    """In fp32 a cap in the head's dtype and one after the fp32 upcast are the same numbers, so the fp32 check took
    Gemma's recipe for Beam; under bf16 autocast (Trainer(bf16=True)) its gradients were 2.3 % off stock's (the hfloss
    sweep). The check tells them apart by stock's logits under autocast; Gemma 2 keeps its recipe."""
    if not hasattr(transformers, "BeamForCausalLM"):
        pytest.skip("Beam needs a newer transformers")
    for family, in_fp32 in (("beam", True), ("gemma2", False)):
        extra = {"num_experts": 4, "num_experts_per_tok": 2} if family == "beam" else {}
        stock = _decoder(family, head_dim=8, final_logit_softcapping=0.1, **extra)()
        slim = _converted(copy.deepcopy(stock))
        assert hf_loss.check(slim).recipe.softcap_fp32 is in_fp32, family
        ids, labels = _batch()
        results = []
        for model in (stock, slim):
            torch.manual_seed(2)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            results.append(out)
        assert results[1].logits is None
        _close(results[1].loss, results[0].loss, "loss", rtol=1e-6, atol=0)
        for p, q in zip(stock.parameters(), slim.parameters()):
            if p.grad is not None:
                scale = p.grad.float().abs().max().item()
                assert (q.grad.float() - p.grad.float()).abs().max().item() <= 4e-3 * scale, family


@pytest.mark.parametrize("dtype,tokens", [(torch.bfloat16, 64), (torch.bfloat16, 205), (torch.bfloat16, 1024),
                                          (torch.float32, 171), (torch.float32, 190), (torch.float32, 1024)])
def test_a_trained_head_keeps_no_more_than_stock_at_any_length(dtype, tokens, monkeypatch):
    """Where the output embedding trains, the chunked backward holds an fp32 vocab x hidden gradient buffer beside
    each chunk's logits: with few tokens per call it cost more than stock's logits (a bf16 Llama at 1x64 tokens
    peaked 1.45x stock's; the mixed-precision sweep), and just past the first switch still up to 1.17x (fp32 1x171;
    the full fine-tuning sweep). Such calls run stock's forward; long ones stay chunked. The output is freed before
    backward, as the Trainer does (held, stock's logits would live on and hide the excess)."""
    from slimgrad.measure import peak_bytes

    monkeypatch.setattr(hf_loss, "CHOOSE_BY_SIZE", True)  # (conftest turns it off for this module's other tests)

    def build():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=8192)
        return transformers.LlamaForCausalLM(cfg).to(dtype).train()

    stock, slim = build(), _converted(build())
    ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
    peaks, chunked = [], []
    for model in (stock, slim):
        def step(model=model):
            out = model(input_ids=ids, labels=ids)
            chunked.append(out.logits is None)
            loss = out.loss
            del out
            loss.backward()
        step()
        for p in model.parameters():
            p.grad = None
        peaks.append(peak_bytes(step))
    assert chunked[-1] is (tokens == 1024)
    assert peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize("tokens", [12, 128])
def test_a_frozen_head_under_gradient_checkpointing_peaks_no_higher_than_stock(tokens):
    """With one chunk covering every token (few tokens against a chunk's 1M-logit floor) the step peaked one fp32
    hidden-states tensor above stock (+133 KB at 2x128 tokens, hidden 128; gradient checkpointing and a norm-only
    Llama, the mixed-precision sweep): the backward made its input gradient before the chunk's softmax backward,
    and (transformers 4.57's reentrant checkpointing) the chunk's three vocab-wide temporaries are stock's own, with
    the kept hidden states on top. A frozen head's call of more than one row takes two chunks at least now."""
    from slimgrad.measure import peak_bytes

    def build():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
        model = transformers.LlamaForCausalLM(cfg).train()
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        return model

    stock, slim = build(), slimgrad.convert(build(), chunked_loss=True)  # the norms too, as users convert
    ids = torch.randint(0, 4096, (2, tokens), generator=torch.Generator().manual_seed(1))
    peaks, losses = [], []
    for model in (stock, slim):
        def step(model=model):
            loss = model(input_ids=ids, labels=ids).loss  # stock's logits freed before backward, as the Trainer does
            losses.append(loss.detach())
            loss.backward()
        step()
        for p in model.parameters():
            p.grad = None
        peaks.append(peak_bytes(step))
    assert torch.equal(losses[0], losses[2])
    assert peaks[1] < peaks[0], (peaks, peaks[1] - peaks[0])


def test_a_moe_configured_for_router_logits_engages_on_calls_that_turn_them_off():
    """Configured with output_router_logits=True before convert, the check ran with the aux loss and refused the head
    with a reason naming something else ("post-processes its logits ..."), and calls passing
    output_router_logits=False lost the saving (review sweep)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=True)
    stock = transformers.MixtralForCausalLM(cfg)
    slim = _converted(copy.deepcopy(stock))
    ids, labels = _batch()
    expected = stock(input_ids=ids, labels=labels)
    with pytest.warns(SlimgradWarning, match="output_router_logits"):
        actual = slim(input_ids=ids, labels=labels)
    _close(actual.loss, expected.loss, "loss with aux loss", rtol=0, atol=0)
    expected = stock(input_ids=ids, labels=labels, output_router_logits=False)
    actual = slim(input_ids=ids, labels=labels, output_router_logits=False)
    assert actual.logits is None
    _close(actual.loss, expected.loss, "loss", **TOL[torch.float32])


def _resized_or_cast(change, eps):
    cfg = transformers.LlamaConfig(**{**LLAMA_LIKE, "vocab_size": 128, "rms_norm_eps": eps})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model = slimgrad.convert(model, chunked_loss=True) if change else model
    if change in ("resize", None):
        torch.manual_seed(5)
        model.resize_token_embeddings(136)  # the config's vocabulary changes: the head is checked again
    else:
        model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    return model.train()


@pytest.mark.parametrize("change", ["resize", "bf16"])
def test_an_estimate_before_the_recheck_leaves_the_chunked_loss_on(change):
    """A head whose config or dtype changed after convert checks itself again on its next call; slimgrad.estimate's
    simulated step made that call on fake tensors, where the check raised (DataDependentOutputException), and the
    failure was cached on the real model: every later step ran stock's logits, warning of an exception the user never
    caused (the model-loading sweep). The estimate now checks on the real tensors first, and counts the chunked head
    its step will run."""
    model = _resized_or_cast(change, eps=1e-6 + (3e-9 if change == "resize" else 4e-9))  # (a config of its own)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlimgradWarning)
        estimated = slimgrad.estimate(model, input_ids=ids, labels=ids).step_peak_bytes

        def step():
            out = model(input_ids=ids, labels=ids)
            assert out.logits is None  # the chunked path
            out.loss.backward()

        step()
        for p in model.parameters():
            p.grad = None
        assert estimated == slimgrad.peak_bytes(step)


def test_the_recheck_inside_a_step_is_not_counted_as_the_steps_saved_bytes():
    """The check of a head whose vocabulary grew after convert runs inside the next forward; its tiny graphs went
    through the caller's saved-tensor hooks, so SavedTensors read that step at 2.36x stock's bytes (0.79x on later
    steps; the model-loading sweep). With the check's hooks, a saved output held its own node and kept the check's
    graph alive: the parameters' stale gradient accumulators then failed the next step after the resize."""
    stock, slim = _resized_or_cast(None, 1e-6 + 5e-9), _resized_or_cast("resize", 1e-6 + 5e-9)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    kept, losses = [], []
    for model in (stock, slim):
        with SavedTensors(exclude=[model]) as counter:
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        kept.append(counter.bytes)
        losses.append(out.loss.detach())
    assert torch.equal(losses[0], losses[1])
    assert kept[1] < kept[0], kept


def test_a_recheck_due_inside_torch_func_or_inference_mode_waits_for_a_plain_call():
    """A head due to check itself again (its vocabulary grew after convert) met its next call inside
    torch.func.grad(functional_call(...)), where the check's restoring copy_ of the buffers raised out of the user's
    step, or inside inference mode (an estimate called there), where the check's failure was cached and the chunked
    loss stayed off for good (the review sweep). Neither context runs the check now; the next plain call does."""
    from torch.func import functional_call, grad

    model = _resized_or_cast("resize", eps=1e-6 + 6e-9)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    params = {k: v.detach() for k, v in model.named_parameters() if "norm" in k}
    grads = grad(lambda p: functional_call(model, p, (), {"input_ids": ids, "labels": ids}, strict=False).loss)(params)
    assert set(grads) == set(params)
    with torch.inference_mode(), pytest.raises(ValueError):
        slimgrad.estimate(model, input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None  # the chunked path: checked on this plain call
    out.loss.backward()
