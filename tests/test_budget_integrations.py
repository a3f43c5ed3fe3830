"""A memory budget where users train: ``SlimgradCallback(budget=...)`` in transformers' Trainer and TRL's
SFTTrainer, a planned model under ``torch.compile(fullgraph=True)``, and DDP (the estimate is per rank).

The trainer tests train two independent copies of one tiny Llama with peft LoRA, both converted by the
callback, one with a budget between the smallest peak any plan reaches and the unplanned peak (so the plan
must checkpoint blocks), and compare every step's loss bitwise: checkpointing recomputes the same forward with
the RNG restored, so a plan changes memory and time, never the numbers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.plan import apply_plan, planned_actions

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("datasets")

from tests.test_trainer import (  # noqa: E402
    RecordingTrainer,  # noqa: E402
    dataset,
    lora_config,
    tiny_llama,
    tiny_tokenizer,
    training_args,
)

from slimgrad.integrations.transformers import SlimgradCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def lora_llama():
    return peft.get_peft_model(tiny_llama(), lora_config())


#: the rows' attention mask is all ones; it is left out of what the trainer feeds because transformers 4.x's
#: sdpa mask reads its values (``_ignore_causal_mask_sdpa``: ``padding_mask.all()``), which a step simulated on
#: fake tensors cannot (slimgrad.estimate says so); transformers 5 does not read them
KEYS = ("input_ids", "labels")


def first_batch(rows=2, keys=KEYS):
    return {k: torch.tensor(dataset()[k][:rows]) for k in keys}


def train_trainer(tmp_path, name, model, callbacks=None, **overrides):
    args = transformers.TrainingArguments(**training_args(tmp_path, name, **overrides))
    data = dataset().remove_columns(["attention_mask"])
    trainer = RecordingTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


def middle_budget(model, batch, autocast=None, optimizer="adamw"):
    """A budget halfway between the smallest peak a plan reaches and the unplanned peak of ``model``
    converted (a copy), with AdamW: one the plan meets only by checkpointing some blocks."""
    converted = slimgrad.convert(copy.deepcopy(model))
    converted.config.use_cache = False
    context = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with context:
        unlimited = slimgrad.plan(converted, "1TiB", batch, optimizer=optimizer)
    assert unlimited.smallest_feasible < unlimited.peak_before, unlimited  # the premise: checkpointing lowers it
    return (unlimited.smallest_feasible + unlimited.peak_before) // 2


def checkpointing_flags(model):
    return [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]


# -- Trainer ------------------------------------------------------------------------------------------------


def test_trainer_budget_plans_on_the_first_batch_and_trains_bitwise_as_without(tmp_path, caplog):
    stock = lora_llama()
    budget = middle_budget(stock, first_batch())
    plain_callback, budget_callback = SlimgradCallback(), SlimgradCallback(budget=budget)
    expected = train_trainer(tmp_path, "plain", copy.deepcopy(stock), callbacks=[plain_callback])
    with caplog.at_level(logging.INFO, logger="slimgrad"):
        actual = train_trainer(tmp_path, "budget", copy.deepcopy(stock), callbacks=[budget_callback])
    assert actual.losses == expected.losses  # bitwise, every step
    assert expected.losses[-1] < expected.losses[0]
    chosen = budget_callback.plan
    assert chosen.fits and chosen.peak_after <= budget < chosen.peak_before
    assert budget_callback.report.plan is chosen
    installed = planned_actions(actual.model)
    assert installed == chosen.actions and installed, installed
    assert all(p.startswith("base_model.model.model.layers.") for p in installed)
    assert planned_actions(expected.model) == {} and plain_callback.plan is None
    # the batch planned for is what the trainer feeds: 2 rows, the text column dropped, labels kept (int64)
    assert chosen.estimate_before.input_bytes == len(KEYS) * 2 * 12 * 8
    assert any("slimgrad.plan: budget" in r.getMessage() and "(2, 12), labels (2, 12) (per rank)" in r.getMessage()
               for r in caplog.records)
    # the trainer's AdamW state is counted: the estimate's optimizer state is two fp32 copies of the LoRA weights
    lora_bytes = sum(p.numel() * 4 for p in actual.model.parameters() if p.requires_grad)
    assert chosen.estimate_before.optimizer_bytes >= 2 * lora_bytes


@pytest.mark.slow
def test_trainer_budget_that_checkpoints_nothing_keeps_stocks_cache_and_numbers(tmp_path):
    """A T5 decoder stack keeps a config of its own whose use_cache stays True in stock training; the callback turned
    every config's off for every plan, and T5's gradients move by fp32 roundings with the cache off: a plan that
    checkpointed nothing trained off stock's numbers (third loss 4.367865 against 4.367864, 50 parameters apart).
    Now the cache is left as stock has it unless the plan checkpoints (found by this stop's task-heads sweep)."""
    from datasets import Dataset

    def t5():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.1, feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(5, 60, (8, 10), generator=g), torch.randint(5, 60, (8, 6), generator=g)
    data = Dataset.from_dict({"input_ids": x.tolist(), "labels": y.tolist()}).with_format("torch")

    def train(name, callbacks):
        args = transformers.TrainingArguments(**training_args(tmp_path, name, per_device_train_batch_size=4,
                                                              learning_rate=5e-3))
        trainer = RecordingTrainer(model=t5(), args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        return trainer

    expected = train("stock", [])
    callback = SlimgradCallback(budget="10GiB")
    actual = train("budget", [callback])
    assert callback.plan.actions == {}
    assert actual.losses == expected.losses
    assert all(torch.equal(a, b) for a, b in zip(actual.model.parameters(), expected.model.parameters()))
    assert actual.model.decoder.config.use_cache is True  # as stock's


def test_trainer_budget_turns_hf_checkpointing_off_and_plans_instead(tmp_path, caplog):
    """gradient_checkpointing=True checkpoints every layer before training; with a budget the callback turns it
    off (warning) so no layer is checkpointed twice, and the plan checkpoints what the budget needs. The numbers
    are those of the fully checkpointed run. Without a budget Hugging Face's checkpointing stays on."""
    stock = lora_llama()
    budget = middle_budget(stock, first_batch())
    overrides = dict(gradient_checkpointing=True)
    if not hasattr(transformers.TrainingArguments, "activation_checkpointing_kwargs"):
        # transformers 4.x checkpoints reentrantly by default, where a frozen embedding fails (as in test_trainer)
        overrides["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    expected = train_trainer(tmp_path, "hf", copy.deepcopy(stock), callbacks=[SlimgradCallback()], **overrides)
    assert any(checkpointing_flags(expected.model)) and planned_actions(expected.model) == {}
    callback = SlimgradCallback(budget=budget)
    with caplog.at_level(logging.WARNING, logger="slimgrad"):
        actual = train_trainer(tmp_path, "budget", copy.deepcopy(stock), callbacks=[callback], **overrides)
    assert actual.losses == expected.losses
    assert checkpointing_flags(actual.model) and not any(checkpointing_flags(actual.model))
    assert planned_actions(actual.model) == callback.plan.actions and callback.plan.actions
    # a layer or parts of it, never both (which of the two is cheaper is a measured time: either may be taken)
    acts = callback.plan.actions
    layers = [f"base_model.model.model.layers.{i}" for i in range(len(actual.model.base_model.model.model.layers))]
    assert all(any(a == b or a.startswith(b + ".") for b in layers) for a in acts), acts
    assert not any(a != b and b.startswith(a + ".") for a in acts for b in acts), acts
    assert any("turned off Hugging Face's gradient checkpointing" in r.getMessage() for r in caplog.records)


def test_trainer_budget_no_plan_meets_raises_at_train_begin(tmp_path):
    model = lora_llama()
    with pytest.raises(ValueError, match=r"(?s)no plan meets the budget.*over; the smallest budget any plan meets"):
        train_trainer(tmp_path, "tiny", model, callbacks=[SlimgradCallback(budget="1KiB")])
    assert planned_actions(model) == {}


def test_callback_budget_options_are_checked_up_front():
    with pytest.raises(ValueError, match="'example' is used with 'budget'"):
        SlimgradCallback(example=first_batch())
    with pytest.raises(ValueError, match="SlimgradCallback: 'budget'"):
        SlimgradCallback(budget="twelve GiB")
    with pytest.raises(TypeError, match="'loss_fn' must be a callable"):
        SlimgradCallback(budget="1GiB", loss_fn=3)
    # no dataloader passed (a callback called by hand): the batch must be given
    with pytest.raises(ValueError, match="example=batch"):
        SlimgradCallback(budget="1GiB").on_train_begin(None, None, None, model=lora_llama())


def test_callback_budget_with_example_and_optimizer_name():
    model = lora_llama()
    budget = middle_budget(model, first_batch(), optimizer="sgd")
    callback = SlimgradCallback(budget=budget, example=first_batch(), optimizer="sgd")
    assert model.config.use_cache is True  # (transformers 5's Trainer sets it from args.use_cache, False)
    callback.on_train_begin(None, None, None, model=model)
    assert callback.plan.fits and planned_actions(model) == callback.plan.actions and callback.plan.actions
    assert callback.plan.estimate_before.optimizer_bytes == 0  # plain SGD keeps no state
    # a recomputed layer must not append to a cache twice: off for training, as the user had it afterwards
    assert model.config.use_cache is False
    callback.on_train_end(None, None, None, model=model)
    assert model.config.use_cache is True


# -- TRL ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="TRL's collator feeds an attention mask, whose values transformers 4.x's sdpa mask reads "
                           "(see KEYS); slimgrad.estimate cannot simulate that step")
def test_sft_trainer_budget_same_losses_as_hf_checkpointing(tmp_path):
    """SFTConfig's defaults: gradient_checkpointing=True, bf16 autocast. The callback with a budget plans under
    the trainer's autocast, replaces TRL's every-layer checkpointing by the plan, and trains bitwise alike."""
    trl = pytest.importorskip("trl")

    class RecordingSFT(trl.SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            self.__dict__.setdefault("losses", []).append(loss.item())
            return result

    data = dataset().remove_columns(["labels", "attention_mask", "text"])
    batch = first_batch(keys=("input_ids",))
    batch["labels"] = batch["input_ids"]
    budget = middle_budget(lora_llama(), batch, autocast=torch.bfloat16)

    def run(name, callback):
        config = trl.SFTConfig(**training_args(tmp_path, name))
        assert config.gradient_checkpointing and config.bf16  # the premise above
        trainer = RecordingSFT(model=tiny_llama(), args=config, train_dataset=data, peft_config=lora_config(),
                               processing_class=tiny_tokenizer(), callbacks=[callback])
        trainer.train()
        return trainer

    expected = run("hf", SlimgradCallback())
    callback = SlimgradCallback(budget=budget)
    actual = run("budget", callback)
    assert actual.losses == expected.losses and len(actual.losses) == 3
    assert any(checkpointing_flags(expected.model)) and not any(checkpointing_flags(actual.model))
    assert callback.plan.fits and planned_actions(actual.model) == callback.plan.actions and callback.plan.actions


# -- torch.compile ------------------------------------------------------------------------------------------


def small_cnn(dropout=0.0):
    torch.manual_seed(0)

    def block(c):
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Dropout(dropout))

    return slimgrad.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), block(8), block(8), block(8),
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))


def step(model, x, call=None, seed=1):
    """One loss and backward through ``call`` (a compiled ``model``, say); the gradients by ``model``'s names."""
    torch.manual_seed(seed)
    loss = (call or model)(x).square().sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_planned_model_compiles_fullgraph_like_eager(backend):
    """Checkpointed blocks under torch.compile(fullgraph=True): the loss, gradients and batch-norm running
    statistics (updated once, not again by the recomputation) of the eager planned model, within the
    tolerance of the repo's compile tests (inductor reorders fp32 sums)."""
    torch._dynamo.reset()
    eager = small_cnn()
    apply_plan(eager, {"1": "checkpoint", "2": "checkpoint"})
    compiled_model = copy.deepcopy(eager)
    assert planned_actions(compiled_model) == {"1": "checkpoint", "2": "checkpoint"}
    x = torch.randn(4, 3, 16, 16)
    loss, grads = step(eager, x)
    compiled_loss, compiled_grads = step(compiled_model, x, torch.compile(compiled_model, fullgraph=True,
                                                                          backend=backend))
    torch.testing.assert_close(compiled_loss, loss, rtol=2e-5, atol=2e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, buffer), (_, compiled_buffer) in zip(eager.named_buffers(), compiled_model.named_buffers()):
        torch.testing.assert_close(compiled_buffer, buffer, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_planned_model_compiled_draws_the_same_dropout_masks_as_unplanned():
    """Compiled, the recomputation of a checkpointed block draws the dropout masks of its forward: the planned
    model's loss and gradients are bitwise those of the unplanned one under the same backend and seed."""
    torch._dynamo.reset()
    model = small_cnn(dropout=0.3)
    planned = apply_plan(copy.deepcopy(model), {"1": "checkpoint", "2": "checkpoint"})
    x = torch.randn(4, 3, 16, 16)
    loss, grads = step(model, x, torch.compile(model, fullgraph=True, backend="aot_eager"))
    planned_loss, planned_grads = step(planned, x, torch.compile(planned, fullgraph=True, backend="aot_eager"))
    assert torch.equal(planned_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(planned_grads[name], grad), name


def test_estimate_and_plan_of_a_compiled_model_are_the_eager_inner_module():
    model = small_cnn()
    compiled = torch.compile(model)
    x = torch.randn(4, 3, 16, 16)
    slimgrad.estimate(model, x, optimizer="adamw")  # (the first estimate in a process can measure scratch apart)
    eager, through = slimgrad.estimate(model, x, optimizer="adamw"), slimgrad.estimate(compiled, x, optimizer="adamw")
    assert through.peak_bytes == eager.peak_bytes
    assert [b.path for b in through.blocks] == [b.path for b in eager.blocks] and "1" in [b.path for b in eager.blocks]
    chosen = slimgrad.plan(compiled, eager.peak_bytes, x)
    assert [b.path for b in chosen.blocks] == [b.path for b in eager.blocks]
    apply_plan(compiled, {"2": "checkpoint"})
    assert planned_actions(compiled) == planned_actions(model) == {"2": "checkpoint"}


# -- DDP ----------------------------------------------------------------------------------------------------


_DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    import slimgrad
    from slimgrad.plan import apply_plan, planned_actions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "store"), rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = slimgrad.convert(nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)],
                                               nn.Linear(16, 2)))
        reference = slimgrad.convert(nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                                     for _ in range(4)], nn.Linear(16, 2)))
        reference.load_state_dict(model.state_dict())
        ddp = nn.parallel.DistributedDataParallel(model)
        x = torch.randn(8, 16)
        ddp(x).sum().backward()  # a real step first: DDP's reducer has buckets now
        for p in model.parameters():
            p.grad = None
        slimgrad.estimate(reference, x, optimizer="adamw")  # (the first in a process can measure scratch apart)
        alone = slimgrad.estimate(reference, x, optimizer="adamw")
        through = slimgrad.estimate(ddp, x, optimizer="adamw")
        chosen = slimgrad.plan(ddp, alone.peak_bytes, x, optimizer="adamw")
        apply_plan(ddp, {"1": "checkpoint", "2": "checkpoint"})
        for p in model.parameters():
            p.grad = None
        ddp(x).sum().backward()  # planned, under DDP
        reference(x).sum().backward()
        same = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        result = dict(alone=alone.peak_bytes, through=through.peak_bytes, paths=[b.path for b in chosen.blocks],
                      reference_paths=[b.path for b in alone.blocks],
                      planned=planned_actions(ddp), same=same)
        with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13's gloo can abort at interpreter exit (see tests/test_distributed.py)
""")


@pytest.mark.slow
def test_estimate_and_plan_look_through_ddp_per_rank(tmp_path):
    """A single-process gloo group (world size 1, in a subprocess that leaves with os._exit): DDP is
    estimated and planned as the module it wraps (the per-rank step: the batch given is the rank's), and a
    plan installed through the wrapper trains with the gradients of the unplanned model."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _DDP_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert (tmp_path / "result.json").exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["through"] == result["alone"] > 0
    assert result["paths"] == result["reference_paths"] and "1" in result["paths"]  # not "module.1"
    assert result["planned"] == {"1": "checkpoint", "2": "checkpoint"}
    assert result["same"]


class _Unrebuildable(torch.optim.SGD):
    """An optimizer whose constructor the estimate cannot call with parameter groups alone."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.1 * scale, momentum=0.9)


def test_callback_counts_the_trainers_optimizer_through_accelerates_wrapper():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    x = torch.randn(8, 16)
    model = mlp()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    wrapper = type("AcceleratedOptimizer", (), {})()  # what accelerate hands callbacks: .optimizer is the real one
    wrapper.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    callback = SlimgradCallback(budget="1GiB", example=x)
    callback.on_train_begin(None, None, None, model=model, optimizer=wrapper)
    assert callback.plan.estimate_before.optimizer_bytes == param_bytes  # SGD's momentum: one copy
    # an optimizer the estimate cannot rebuild: AdamW's state is counted instead (two copies), with a warning
    model = mlp()
    callback = SlimgradCallback(budget="1GiB", example=x)
    callback.on_train_begin(None, None, None, model=model, optimizer=_Unrebuildable(model.parameters(), 1.0))
    n_params = len(list(model.parameters()))
    assert callback.plan.estimate_before.optimizer_bytes == 2 * param_bytes + 4 * n_params  # + fp32 step counts


def test_callback_budget_on_a_trainer_whose_batch_is_not_the_models_inputs_names_example(tmp_path):
    """sentence-transformers' trainers feed anchor_input_ids, positive_input_ids, ... to a loss that calls
    model(features) per column: the budget's plan fed that batch to the model as keyword inputs and train() died in
    the model's forward with a bare TypeError. The error now names SlimgradCallback and example=/loss_fn= (found by
    this stop's task-heads sweep)."""
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(40)]
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                     cls_token="[CLS]", sep_token="[SEP]")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32))
    bert.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    model = st.SentenceTransformer(str(tmp_path / "bert"), device="cpu")
    rows = [" ".join(words[(3 * i + j) % 40] for j in range(4)) for i in range(8)]
    data = Dataset.from_dict({"anchor": rows, "positive": rows[1:] + rows[:1]})
    args = st.SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                                   max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                                   disable_tqdm=True)
    trainer = st.SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data,
        loss=st.sentence_transformer.losses.MultipleNegativesRankingLoss(model),
        callbacks=[SlimgradCallback(budget="10GiB")])
    with pytest.raises(TypeError, match=r"SlimgradCallback\(budget='10GiB'\): the model's forward refused .*"
                                        r"anchor_input_ids.*Pass example= .*loss_fn="):
        trainer.train()


def test_callback_budget_names_example_when_the_model_refuses_the_batch_with_a_value_error():
    """transformers 5's forwards take **kwargs: ORPO's and CPO's batch columns (prompt_input_ids, ...) passed unnoticed
    and the model raised "You must specify exactly one of input_ids or inputs_embeds", a bare ValueError from inside
    the estimate (the TRL sweep). The error names SlimgradCallback and example=/loss_fn=, as for a TypeError."""
    ids = torch.randint(0, 64, (2, 8))  # (the tiny Llama's vocabulary is larger)
    batch = {"prompt_input_ids": ids, "chosen_input_ids": ids}
    loader = torch.utils.data.DataLoader([batch], batch_size=None, collate_fn=lambda rows: rows[0])
    callback = SlimgradCallback(budget="1GiB")
    args = type("Args", (), {"per_device_train_batch_size": 1})()
    with pytest.raises(ValueError, match=r"SlimgradCallback\(budget='1GiB'\): the model's forward refused .*"
                                         r"prompt_input_ids.*input_ids or inputs_embeds.*Pass example= .*loss_fn="):
        callback.on_train_begin(args, None, None, model=tiny_llama(), train_dataloader=loader)


def test_callback_budget_says_when_trl_computes_the_loss_with_its_fused_head():
    """TRL 1.x's trainers call model(..., fused_lm_head=True), a loss the plan cannot simulate; on CPU its fallback put
    real steps 4-12x over budgets the plan met (the TRL sweep): the plan says so."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    model = tiny_llama()
    trl_utils.add_fused_lm_head(model)
    ids = torch.randint(0, 64, (2, 8))  # (the tiny Llama's vocabulary is larger)
    callback = SlimgradCallback(budget="1GiB", example={"input_ids": ids, "labels": ids})
    callback.on_train_begin(None, None, None, model=model)
    assert any("fused LM head" in n and "cannot simulate" in n for n in callback.plan.notes)
    plain = SlimgradCallback(budget="1GiB", example={"input_ids": ids, "labels": ids})
    plain.on_train_begin(None, None, None, model=tiny_llama())
    assert not any("fused LM head" in n for n in plain.plan.notes)


def test_callback_chunked_loss_under_trl_distillation_says_it_engages_on_nothing():
    """TRL's DistillationTrainer computes its loss with its own chunked divergence from the body: the head was
    reported converted and chunked_loss did nothing, silently (the TRL sweep)."""
    from slimgrad import _notices

    args = type("DistillationConfig", (), {"__module__": "trl.trainer.distillation_config"})()
    _notices.reset_warned()
    with pytest.warns(slimgrad.SlimgradWarning, match="DistillationTrainer computes its loss"):
        SlimgradCallback(chunked_loss=True).on_train_begin(args, None, None, model=tiny_llama())
