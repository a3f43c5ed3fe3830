"""``slimgrad.estimate`` against the allocator's own records of a real step.

Every case builds a small model (tests/_budget_models.py), estimates one training step on fake tensors, then
runs the same step for real and measures its peak above the step's start with ``slimgrad.peak_bytes`` (the
profiler's memory events on CPU). Issue 23's target is |error| <= 5 %; on CPU the simulation replays the
allocator exactly, so most cases agree to the byte and the tolerance only absorbs the few that do not
(T5 converted: +1.8 %, see the case's comment).

With an optimizer the step is the steady state of training: the optimizer's state exists (two real steps
first), then zero_grad, forward, backward and the optimizer's step are measured together.

Besides accuracy: the estimate leaves the model and its inputs as they were, allocates none of the
activations it counts, reports per-block rows and the phase of the peak, and rejects bad arguments with an
error naming the argument.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from tests import _budget_models as bm
from torch import nn
from torch.utils import _pytree

import slimgrad
from slimgrad.audit import default_loss
from slimgrad.estimate import MemoryEstimate, blocks_of, estimate, parse_bytes, split_example

TOLERANCE = 0.05
MiB = 2**20


@pytest.fixture(autouse=True)
def _quiet():
    names = ("bitsandbytes", "transformers", "diffusers", "peft")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    yield
    for name, level in levels.items():  # other tests in this process read these loggers' records
        logging.getLogger(name).setLevel(level)


def _estimate(model, example, **kw) -> MemoryEstimate:
    args, kwargs = split_example(example)
    return estimate(model, *args, **kw, **kwargs)


def _assert_estimated_to_the_byte(model, example, warm=None):
    """The estimate of one step is the measured peak within 0.1 % (the input's gradient, where it has one, dropped
    between the two, as measured_step_peak drops the model's)."""
    measured = bm.measured_step_peak(model, example, warm=warm)
    for t in _pytree.tree_leaves(example):
        if isinstance(t, torch.Tensor):
            t.grad = None
    estimated = _estimate(model, example).step_peak_bytes
    assert abs(bm.relative_error(estimated, measured)) <= 0.001, (estimated, measured)


def _build(name, converted, **kw):
    model, example = bm.BUILDERS[name](**kw)
    if converted:
        model = slimgrad.convert(model)
    return model, example


def _check(e: MemoryEstimate, measured: int, what: str) -> None:
    err = bm.relative_error(e.step_peak_bytes, measured)
    assert abs(err) <= TOLERANCE, (f"{what}: estimated {e.step_peak_bytes} B, measured {measured} B "
                                   f"({err:+.2%}), peak at {e.peak_where}\n{e}")


def _measured_and_estimated(model, step, estimate_step):
    """A warm step's measured peak, then ``estimate_step()``'s estimate, gradients set to None before each."""
    step()
    for p in model.parameters():
        p.grad = None
    measured = slimgrad.peak_bytes(step)
    for p in model.parameters():
        p.grad = None
    return measured, estimate_step()


# --- accuracy on every family of issue 23, stock and converted --------------------------------------------

# a second or more per estimate on one core (many layer signatures); vgg11 and convnext are in-repo CNNs like
# resnet18 and vit, which stay fast
SLOW = {"hf_mobilenet", "unet_lora", "vgg11", "convnext"}
FAMILIES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
            for n in bm.BUILDERS if n != "qlora_llama"]


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("name", FAMILIES)
def test_estimate_matches_measured_peak(name, converted):
    model, example = _build(name, converted)
    # a converted model's first step may build caches (compiled core, masks): measure a later one, and
    # estimate after it too, as a user would on a model that has trained
    measured = bm.measured_step_peak(model, example, warm=1 if converted else 0)
    e = _estimate(model, example)
    _check(e, measured, f"{name} {'converted' if converted else 'stock'}")


# fast: resnet18 with AdamW (its step is the peak) and llama LoRA with an SGD instance; the rest is slow
OPTIMIZER_CASES = [pytest.param(name, opt, marks=() if (name, opt) in {("resnet18", "adamw"),
                                                                        ("llama_lora", "sgd-momentum-instance")}
                                else pytest.mark.slow)
                   for name in ("resnet18", "llama_lora", "vgg11", "hf_resnet", "hf_mobilenet", "hf_vit", "t5_lora",
                                "unet_lora")
                   for opt in ("adamw", "sgd-momentum-instance")]


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("name,optimizer", OPTIMIZER_CASES)
def test_estimate_with_optimizer_matches_steady_state(name, optimizer, converted):
    model, example = _build(name, converted)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt, spec = torch.optim.AdamW(params, lr=1e-3), "adamw"  # what the name builds: AdamW's defaults
    else:
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        spec = opt
    measured = bm.measured_step_peak(model, example, opt)
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    e = _estimate(model, example, optimizer=spec)
    _check(e, measured, f"{name} {optimizer} {'converted' if converted else 'stock'}")
    # the optimizer's state, simulated, has the real one's bytes
    real_state = sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert e.optimizer_bytes == real_state
    # the instance is read, not stepped: its state is what the real steps left
    assert {id(p): s for p, s in opt.state.items()}.keys() == state_before.keys()
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state_before[id(p)][k]), k


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("bits,optimizer,targets", [(4, None, "all-linear"),
                                                    pytest.param(4, "adamw", "all-linear", marks=pytest.mark.slow),
                                                    pytest.param(8, None, "all-linear", marks=pytest.mark.slow),
                                                    (4, None, ["q_proj", "v_proj"])],
                         ids=["nf4", "nf4-adamw", "int8", "nf4-qv"])
def test_estimate_qlora_matches_measured_peak(bits, optimizer, targets, converted):
    """QLoRA: bitsandbytes' packed bases (4-bit nf4 with double quantization, or LLM.int8) with LoRA on every
    linear layer, on CPU. The packed weights stay real during the estimate (bitsandbytes' forward reads their
    quantization state) and count as weights. With LoRA on q/v only, the MLP's 4-bit outputs are bf16 values in
    fp32 and the converted gated MLP keeps them in bf16 (functional._common.kept_input): the estimate follows."""
    pytest.importorskip("bitsandbytes")
    model, example = bm.qlora_llama(bits=bits, targets=targets)
    if converted:
        model = slimgrad.convert(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]) if optimizer else None
    measured = bm.measured_step_peak(model, example, opt, warm=None if opt else 1)
    e = _estimate(model, example, optimizer=optimizer)
    _check(e, measured, f"qlora {bits}-bit {optimizer} {'converted' if converted else 'stock'}")
    packed = [p for p in model.parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]
    assert packed and e.weight_bytes >= sum(p.nbytes for p in model.parameters())  # the packed ones included


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_qlora_with_biases_is_estimated_before_the_first_step_as_every_later_step_runs(converted):
    """bitsandbytes casts a layer's bias to the input's or compute dtype on the parameter itself the first time the
    layer runs (fp32 -> bf16 here, peft's prepare_model_for_kbit_training having made it fp32): an estimate made
    before any step saw that cast free the fp32 storage inside the step and was low by the biases' bytes (2048 B
    here, 2304 B on a GPT-NeoX). It now simulates again with the biases cast, the state every later step runs in,
    and says so; the real model keeps its fp32 biases until its own first step."""
    pytest.importorskip("bitsandbytes")
    model, example = bm.qlora_llama(bits=4, targets=["q_proj", "v_proj"], bias=True)
    if converted:
        model = slimgrad.convert(model)
    biases = {n: p for n, p in model.named_parameters() if n.endswith("bias")}
    assert biases and {p.dtype for p in biases.values()} == {torch.float32}
    e = _estimate(model, example)  # before any real step
    assert {p.dtype for p in biases.values()} == {torch.float32}  # untouched
    assert any("cast in place" in n for n in e.notes), e.notes
    measured = bm.measured_step_peak(model, example, None, warm=1)
    assert {p.dtype for p in biases.values()} == {torch.bfloat16}  # the real first step cast them
    _check(e, measured, f"qlora 4-bit with biases {'converted' if converted else 'stock'}")
    assert e.step_peak_bytes == measured
    again = _estimate(model, example)  # after it: nothing left to cast, the same figure
    assert not any("cast in place" in n for n in again.notes) and again.step_peak_bytes == e.step_peak_bytes
    assert again.weight_bytes == e.weight_bytes


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_qlora_estimate_under_older_fake_mode(monkeypatch, converted):
    """torch before 2.13 (2.11 on the GPU machine) has fake mode answer NotImplemented for any tensor subclass but
    Parameter, attribute-only ones such as bitsandbytes' Params4bit included: there the QLoRA estimate failed at
    ``matmul_4bit``'s ``B.view(-1, 1)`` ("all __torch_dispatch__ handlers returned NotImplemented"). With that
    rule put back, the estimate still runs and equals the one under 2.13's rule, and the measured peak."""
    pytest.importorskip("bitsandbytes")
    from torch._subclasses import fake_tensor

    model, example = bm.qlora_llama(bits=4)
    if converted:
        model = slimgrad.convert(model)
    today = _estimate(model, example)

    def older_rule(x):  # torch 2.11's fake_tensor._check_for_subclass_arg
        return (not isinstance(x, fake_tensor.FakeTensor) and isinstance(x, torch.Tensor)
                and type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter)

    monkeypatch.setattr(fake_tensor, "_check_for_subclass_arg", older_rule)
    with torch.no_grad():  # the rule is what fails the unfixed estimate: check it bites
        w = next(p for p in model.parameters() if type(p).__name__ == "Params4bit")
        with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(TypeError, match="NotImplemented"):
            w.view(-1, 1)
    older = _estimate(model, example)
    monkeypatch.undo()
    assert older.step_peak_bytes == today.step_peak_bytes and older.weight_bytes == today.weight_bytes
    measured = bm.measured_step_peak(model, example, None, warm=1)
    _check(older, measured, f"qlora 4-bit {'converted' if converted else 'stock'} under the older fake rule")


@pytest.mark.parametrize("bits,training", [(4, False), pytest.param(4, True, marks=pytest.mark.slow),
                                           pytest.param(8, False, marks=pytest.mark.slow)],
                         ids=["nf4-eval", "nf4-train", "int8-eval"])
def test_qlora_model_is_untouched(bits, training):
    """The packed weights stay real during the estimate, and bitsandbytes' forward may rewrite them (on a CPU
    with AVX512-BF16, a 4-bit layer in eval mode repacks its weight and quant_state on its first call): after
    the estimate the model's state, packed weights and quantization state included, is what it was, and its
    real step gives what an untouched copy gives. LLM.int8 in eval mode runs bitsandbytes' inference kernel,
    whose output shape depends on the data (outlier columns): the estimate refuses it, leaving the model as
    it was too."""
    pytest.importorskip("bitsandbytes")
    model, example = bm.qlora_llama(bits=bits)
    model.train(training)
    twin = copy.deepcopy(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    e = None
    if bits == 8 and not training:
        with pytest.raises(ValueError, match="reads a tensor's values.*int8_vectorwise_quant"):
            _estimate(model, example)
    else:
        e = _estimate(model, example)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].device == v.device and torch.equal(after[k], v), k
    assert all(p.grad is None for p in model.parameters())
    loss, loss_twin = (default_loss(m(**example)) for m in (model, twin))
    assert torch.equal(loss, loss_twin)
    if e is not None:  # and a real step holds what the estimate says
        model.zero_grad(set_to_none=True)
        measured = bm.measured_step_peak(model, example)
        _check(e, measured, f"qlora {bits}-bit {'train' if training else 'eval'} mode")


# --- how the estimate scales with the batch --------------------------------------------------------------


def test_estimate_follows_the_batch_size():
    """At batch 2, 4 and 8 the estimate equals the measured peak, so it follows how a CNN's peak grows with
    the batch (activations and backward temporaries scale, weights do not)."""
    rows = []
    for batch in (2, 4, 8):
        model, x = bm.cnn("resnet18", batch=batch)
        measured = bm.measured_step_peak(model, x)
        e = _estimate(model, x)
        _check(e, measured, f"resnet18 batch {batch}")
        rows.append((batch, e.step_peak_bytes, measured))
    # the growth per sample, estimated and measured, agree, and it is near-linear: the last doubling adds
    # about twice what the first did (both measured)
    (_, e2, m2), (_, e4, m4), (_, e8, m8) = rows
    assert abs((e8 - e4) - (m8 - m4)) <= TOLERANCE * (m8 - m4)
    assert 1.6 <= (m8 - m4) / (m4 - m2) <= 2.4, rows
    assert 1.6 <= (e8 - e4) / (e4 - e2) <= 2.4, rows


def test_estimate_follows_the_sequence_length():
    """A Llama-like LoRA model at 16, 32 and 64 tokens: the estimate equals the measured peak at each length,
    so the per-token cost a planner fits from estimates is the real one."""
    rows = []
    for seq in (16, 32, 64):
        model, example = bm.llama_lora(seq=seq)
        measured = bm.measured_step_peak(model, example)
        e = _estimate(model, example)
        _check(e, measured, f"llama_lora seq {seq}")
        rows.append((seq, e.step_peak_bytes, measured))
    (_, e16, m16), (_, e32, m32), (_, e64, m64) = rows
    assert m16 < m32 < m64 and abs((e64 - e32) - (m64 - m32)) <= TOLERANCE * (m64 - m32), rows


_MASK_CASES = {
    "attention mask, all ones": lambda ids: {"attention_mask": torch.ones_like(ids)},
    "attention mask, padded": lambda ids: {"attention_mask": torch.ones_like(ids).index_fill_(1, torch.arange(
        ids.shape[1] - 5, ids.shape[1]), 0)},
    "position ids, one sequence a row": lambda ids: {"position_ids": torch.arange(ids.shape[1]).expand_as(ids)},
    "position ids, packed": lambda ids: {"position_ids": torch.cat([torch.arange(20), torch.arange(
        ids.shape[1] - 20)]).expand_as(ids)},
    "no mask": lambda ids: {},
}


@pytest.mark.parametrize("case,use_cache,converted", [
    *((case, use_cache, False) for case in _MASK_CASES for use_cache in (True, False)),
    ("attention mask, all ones", False, True), ("no mask", False, True),
])
def test_attention_mask_decided_as_the_real_step_decides(case, use_cache, converted):
    """transformers leaves the causal mask to SDPA's ``is_causal`` when the attention mask is all ones and the
    position ids hold one sequence per row, decisions it takes from values that fake tensors do not have.
    Before, the estimate then simulated a materialized B×1×S×S mask and SDPA's masked path: 5.6 % high with an
    all-ones attention mask or ``use_cache=False`` (8.3 % converted). Now the estimate equals the measured peak
    in every case: all-ones and padded masks (the real step builds the mask there too), the model's own
    positions, the user's, and packed sequences."""
    model, example = bm.llama_lora(seq=48)
    model.config.use_cache = use_cache
    example.update(_MASK_CASES[case](example["input_ids"]))
    if converted:
        model = slimgrad.convert(model)
    measured = bm.measured_step_peak(model, example)
    e = _estimate(model, example)
    assert abs(bm.relative_error(e.step_peak_bytes, measured)) <= 0.001, (case, e.step_peak_bytes, measured)


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
@pytest.mark.parametrize("case", ["attention mask, all ones", "attention mask, padded", "no mask"])
def test_bidirectional_mask_decided_as_the_real_step_decides(case, converted):
    """An encoder's bidirectional mask (BERT, RoBERTa: ``create_bidirectional_mask``) is left to SDPA when the
    attention mask is all ones, a decision transformers takes from its values (``padding_mask.all()``). On fake
    tensors it kept the B×1×S×S mask: the estimate was 12-14 % high for a BERT at 2×256 (found by a sweep of
    models the suite did not cover). Now every case equals the measured peak."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(pytest.importorskip("transformers.masking_utils"), "_ignore_bidirectional_mask_sdpa"):
        # transformers 4.x builds BERT's mask in modeling_attn_mask_utils, whose check reads the mask's values: the
        # estimate stops there with an error naming it (a known limit on that release line)
        pytest.skip("this transformers' BERT decides its mask from values outside masking_utils")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=256, num_labels=3,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg).train()
    if converted:
        model = slimgrad.convert(model)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(2))
    example = {"input_ids": ids, "labels": torch.tensor([0, 2]), **_MASK_CASES[case](ids)}
    measured = bm.measured_step_peak(model, example, warm=1 if converted else 0)
    e = _estimate(model, example)
    if converted and slimgrad.csrc.for_eager(torch.empty(0)) is None:
        # the Python path packs a dropout mask through numpy, outside the allocator's records: high by at most
        # a hidden state's mask, never low (test_dropout_policies_are_estimated)
        assert measured <= e.step_peak_bytes <= measured + ids.numel() * 64 + 64, (case, e, measured)
    else:
        assert e.step_peak_bytes == measured, (case, e.step_peak_bytes, measured)


def test_an_unknown_bidirectional_mask_decision_is_noted(monkeypatch):
    """Where transformers' bidirectional-mask decision is not the form slimgrad answers from the real mask, it runs
    on fake tensors (the estimate may then be high): ``notes`` says so rather than leave it silently off."""
    masking = pytest.importorskip("transformers.masking_utils")
    real = getattr(masking, "_ignore_bidirectional_mask_sdpa", None)
    if real is None:
        pytest.skip("this transformers has no bidirectional-mask decision in masking_utils")
    monkeypatch.setattr(masking, "_ignore_bidirectional_mask_sdpa", lambda mask_2d, *a, **k: real(mask_2d, *a, **k))
    model, example = bm.llama_lora(seq=16)
    example["attention_mask"] = torch.ones_like(example["input_ids"])
    e = _estimate(model, example)
    assert any("_ignore_bidirectional_mask_sdpa" in n for n in e.notes), e.notes


@pytest.mark.parametrize("policy", ["bits", "seed"])
@pytest.mark.parametrize("model_kind", ["lora", "dropout"])
def test_dropout_policies_are_estimated(policy, model_kind):
    """The "seed" dropout policy (the default on CUDA: an 8-byte seed kept, the mask drawn again in backward)
    reads the seed's value to seed a generator, which fake tensors do not have: the estimate of any model with
    dropout failed on the GPU (found by the budget benchmark on an H200). Its noise now keeps its allocation
    without a draw there, and the estimate equals the measured peak for the seed policy, for peft LoRA dropout
    and for a converted nn.Dropout.

    The "bits" policy: where the compiled core runs the real step, fake tensors take a branch that allocates what
    its C++ allocates, in order, and the estimate equals the measured peak to the byte. With the core off, the
    Python path packs the mask through numpy, outside the allocator's records: high by at most that mask, never
    low."""
    if model_kind == "lora":
        model, example = bm.llama_lora(seq=32, dropout=0.1)
        mask_bytes = 2 * 32 * 64  # the adapters' input, batch x seq x hidden
    else:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 8))
        example = torch.randn(32, 64, requires_grad=True)
        mask_bytes = 32 * 256
    model = slimgrad.convert(model, dropout=policy)
    measured = bm.measured_step_peak(model, example)
    e = _estimate(model, example)
    core = slimgrad.csrc.for_eager(torch.empty(0)) is not None
    if policy == "seed":
        assert abs(bm.relative_error(e.step_peak_bytes, measured)) <= 0.001, (e.step_peak_bytes, measured)
    elif core:
        assert e.step_peak_bytes == measured
    else:
        # the mask, plus one small scalar's allocation (the Python path's scale factor: 40 B measured)
        assert measured <= e.step_peak_bytes <= measured + mask_bytes + 64, (e.step_peak_bytes, measured)


# --- the estimate's own accounting, against the real model -----------------------------------------------


def _unique_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", ["resnet18", "llama_lora"])
def test_totals_match_the_real_model(name):
    model, example = bm.BUILDERS[name]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    args, kwargs = split_example(example)
    e = estimate(model, *args, optimizer=opt, **kwargs)
    bm.measured_step_peak(model, example, opt)  # real steps: real gradients and optimizer state
    default_loss(model(*args, **kwargs)).backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert e.weight_bytes == _unique_bytes([*model.parameters(), *model.buffers()])
    assert e.input_bytes == _unique_bytes([t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)])
    assert e.gradient_bytes == _unique_bytes([p.grad for p in trainable])
    assert e.optimizer_bytes == sum(v.nbytes for s in opt.state.values() for v in s.values())
    # what existed before the step: weights, inputs and the optimizer's state
    assert e.peak_bytes - e.step_peak_bytes == e.weight_bytes + e.input_bytes + e.optimizer_bytes
    # the split at the peak adds up to the peak
    assert sum(e.at_peak.values()) == e.peak_bytes, e.at_peak
    assert 0 < e.kept_bytes <= e.peak_bytes
    assert e.device == "cpu"
    assert e.fits(e.peak_bytes) and not e.fits(e.peak_bytes - 1)
    assert "timeline" not in e.as_dict() and e.as_dict()["peak_bytes"] == e.peak_bytes
    assert "slimgrad.estimate: peak" in str(e) and e.blocks[0].path in str(e)


# --- nothing of the user's is touched, nothing big is allocated ------------------------------------------


def _snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "forward": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
        "types": {n: type(m) for n, m in model.named_modules()},
        "params": {n: p for n, p in model.named_parameters()},
    }


def _assert_untouched(model, before):
    after = _snapshot(model)
    for key in ("requires_grad", "training", "forward", "types"):
        assert after[key] == before[key], key
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k  # values, BN running statistics and counters included
    for n, p in model.named_parameters():
        assert p is before["params"][n], n  # the same Parameter objects, not reassigned
        assert p.grad is None, n


@pytest.mark.parametrize("name,converted", [("resnet18", False), pytest.param("resnet18", True, marks=pytest.mark.slow),
                                            ("llama_lora", True), ("t5_lora", False)])
def test_model_and_inputs_are_untouched(name, converted):
    model, example = _build(name, converted)
    if name == "resnet18":
        example = example.requires_grad_()  # an input that asks for a gradient gets none from the estimate
    twin = copy.deepcopy(model)
    before = _snapshot(model)
    args, kwargs = split_example(example)
    inputs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
    inputs_before = [(t.clone(), t.requires_grad) for t in inputs]
    _estimate(model, example, optimizer="adamw")
    _assert_untouched(model, before)
    for t, (v, rg) in zip(inputs, inputs_before):
        assert torch.equal(t, v) and t.requires_grad == rg and t.grad is None
    # the model still trains as its untouched copy does: same loss, same gradients (no patch left behind)
    torch.manual_seed(3)
    loss = default_loss(model(*args, **kwargs))
    loss.backward()
    torch.manual_seed(3)
    loss_twin = default_loss(twin(*[a.detach() for a in args], **kwargs))
    loss_twin.backward()
    assert torch.equal(loss, loss_twin)
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n


class _Scale(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.w = nn.Parameter(torch.ones(channels, 1, 1))

    def forward(self, x):
        return torch.sigmoid(x * self.w)


def test_estimate_allocates_no_activation():
    """A model whose step holds several hundred MiB of activations: the estimate counts them, but running it
    allocates next to nothing (fake tensors; no op here needs its scratch space measured on real tensors)."""
    model = nn.Sequential(*[_Scale(16) for _ in range(8)])
    x = torch.randn(8, 16, 256, 256)  # 32 MiB per activation
    e = slimgrad.estimate(model, x)
    assert e.step_peak_bytes > 250 * MiB
    used = slimgrad.peak_bytes(lambda: slimgrad.estimate(model, x))
    assert used < 2 * MiB, used
    # and it is right: the real step holds what the estimate says
    measured = slimgrad.peak_bytes(lambda: model(x).sum().backward())
    _check(e, measured, "sigmoid chain")


def test_estimate_with_scratch_ops_allocates_one_op_at_a_time():
    """Convolutions' scratch space is measured on real tensors, one op signature at a time: the estimate's own
    peak stays far below the step's."""
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())])
    x = torch.randn(8, 8, 128, 128)  # 4 MiB per activation
    e = slimgrad.estimate(model, x)
    used = slimgrad.peak_bytes(lambda: slimgrad.estimate(model, x))
    assert used < e.step_peak_bytes / 2, (used, e.step_peak_bytes)


@pytest.mark.parametrize("name", ["llama_lora", "resnet18"])
def test_each_storage_is_let_go_at_the_first_op_after_it_died(name, monkeypatch):
    """The estimate learns that a storage died from a callback on its Python object (asking every live storage
    at every op was quadratic: 17 of a UNet plan's 29 s). At every sweep, each storage reported dead has died and
    none still counted has: the same bytes at every op as asking each storage."""
    import sys

    allocations = sys.modules["slimgrad.estimate"]._Allocations
    sweep, sweeps = allocations.sweep, []

    def checked(self):
        assert all(self.live[k][0].expired() for k in self.dead if k in self.live)
        sweep(self)
        assert not [k for k, v in self.live.items() if v[0].expired()]
        sweeps.append(len(self.live))

    monkeypatch.setattr(allocations, "sweep", checked)
    model, example = _build(name, converted=True)
    _estimate(model, example, optimizer="adamw")
    assert len(sweeps) > 100 and max(sweeps) > 10


# --- per-block rows and where the peak is ----------------------------------------------------------------


def test_blocks_of_picks_the_repeated_layers():
    llama, _ = bm.llama_lora()
    assert blocks_of(llama) == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    t5, _ = bm.t5_lora()
    assert blocks_of(t5) == [f"base_model.model.{part}.block.{i}" for part in ("encoder", "decoder") for i in (0, 1)]
    resnet, _ = bm.hf_resnet()
    assert blocks_of(resnet)[:4] == [f"resnet.encoder.stages.{i}" for i in range(4)]
    cnn, _ = bm.cnn("resnet18")  # its stages are attributes (layer1..layer4): their residual blocks
    assert blocks_of(cnn) == [f"layer{i}.{j}" for i in range(1, 5) for j in (0, 1)]
    for model in (llama, t5, resnet, cnn):  # no block inside another: their rows do not count anything twice
        paths = blocks_of(model)
        assert not [(a, b) for a in paths for b in paths if b.startswith(a + ".")], paths


@pytest.mark.parametrize("name", ["llama_lora", "hf_resnet"])
def test_block_rows(name):
    model, example = bm.BUILDERS[name]()
    e = _estimate(model, example, optimizer="adamw")
    assert [b.path for b in e.blocks] == blocks_of(model)
    modules = dict(model.named_modules())
    for b in e.blocks:
        params = list(modules[b.path].parameters())
        trainable = [p for p in params if p.requires_grad]
        assert b.weight_bytes == sum(p.nbytes for p in params), b
        assert b.gradient_bytes == sum(p.nbytes for p in trainable), b
        assert b.optimizer_bytes >= 2 * b.gradient_bytes, b  # AdamW: two moments per trainable parameter
        assert 0 <= b.peak_bytes <= e.peak_bytes, b
        if ".layers." in b.path or ".stages." in b.path:  # (HF ResNet's blocks also hold its classifier's)
            assert b.gradient_bytes > 0 and b.kept_bytes > 0 and b.peak_bytes > 0, b
    assert sum(b.kept_bytes for b in e.blocks) <= e.kept_bytes
    # blocks chosen by the caller
    first = e.blocks[0].path
    e1 = _estimate(model, example, blocks=[first])
    assert [b.path for b in e1.blocks] == [first]
    assert e1.blocks[0].kept_bytes == _estimate(model, example).blocks[0].kept_bytes


@pytest.mark.parametrize("optimizer,phase", [(None, "backward"), ("adamw", "optimizer")])
def test_peak_where_names_the_phase(optimizer, phase):
    # resnet18 (in-repo, quarter width): the peak is a convolution's backward without an optimizer; with AdamW
    # its step over every parameter holds more (the measured cases above agree to the byte)
    model, x = bm.cnn("resnet18")
    e = slimgrad.estimate(model, x, optimizer=optimizer)
    assert e.peak_where.startswith(f"{phase} of "), e.peak_where
    assert e.peak_where.split(" of ")[0] in {"forward", "backward", "optimizer"}


# --- arguments -------------------------------------------------------------------------------------------


def _tiny():
    return nn.Linear(4, 3), torch.randn(2, 4)


def test_errors_name_the_argument():
    model, x = _tiny()
    with pytest.raises(TypeError, match="'model'"):
        slimgrad.estimate(lambda x: x, x)
    with pytest.raises(ValueError, match="inputs"):
        slimgrad.estimate(model)
    with pytest.raises(ValueError, match="'optimizer'"):
        slimgrad.estimate(model, x, optimizer="adamax-typo")
    with pytest.raises(TypeError, match="'optimizer'"):
        slimgrad.estimate(model, x, optimizer=3)
    with pytest.raises(ValueError, match="'blocks'.*'nope'"):
        slimgrad.estimate(model, x, blocks=["nope"])
    with pytest.raises(TypeError, match="'loss_fn'"):
        slimgrad.estimate(model, x, loss_fn="sum")
    with pytest.raises(ValueError, match="loss"):
        slimgrad.estimate(model, x, loss_fn=lambda out: out)  # not one element
    with pytest.raises(ValueError, match="loss"):
        slimgrad.estimate(model, x, loss_fn=lambda out: out.detach().sum())  # needs no grad
    # a failed estimate leaves no patch behind either
    assert "forward" not in model.__dict__ and model.weight.grad is None


def test_arguments_the_errors_sweep_found_unchecked():
    """Each of these returned a figure without a word, or raised from slimgrad's internals (the errors sweep)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    early = torch.optim.AdamW(nn.Linear(8, 8).parameters())  # none of this model's parameters
    with pytest.raises(ValueError, match="'optimizer'.*holds none of the model's parameters"):
        slimgrad.estimate(model, x, optimizer=early)
    for bad in (x.double(), x.bfloat16(), torch.randint(0, 3, (4, 8))):  # the real step raises: so does the estimate
        with pytest.raises(RuntimeError, match="dtype"):
            slimgrad.estimate(model, bad)
    with pytest.raises(TypeError, match="'hold_output'"):
        slimgrad.estimate(model, x, hold_output="no")
    with pytest.raises(TypeError, match="'blocks'"):
        slimgrad.estimate(model, x, blocks=3)
    assert [b.path for b in slimgrad.estimate(model, x, blocks="0").blocks] == ["0"]  # one path: one block
    with pytest.raises(TypeError, match="'model'"):
        slimgrad.plan(None, "1GiB", x)
    with pytest.raises(TypeError, match="'actions'"):
        slimgrad.plan(model, "1GiB", x, actions=3)
    with pytest.raises(TypeError, match="'make_example'"):
        slimgrad.scaling(model, x)
    with pytest.raises(TypeError, match="'sizes'"):
        slimgrad.scaling(model, lambda n: torch.randn(n, 8), sizes="abc")
    with pytest.raises(ValueError, match="must grow with n"):
        slimgrad.scaling(model, lambda n: x)
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(ValueError, match="^slimgrad: no floating-point tensor .*\\(a tensor\\)"):
        slimgrad.estimate(frozen, x)


def test_a_misspelt_option_is_refused_where_the_model_would_swallow_it():
    """A Hugging Face forward takes **kwargs and ignores unknown names: optimiser="adamw" gave an estimate without
    the optimizer's state, 41 % low, silently (the errors sweep)."""

    class TakesAnything(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, **kwargs):
            return self.lin(x)

    model = TakesAnything()
    with pytest.raises(TypeError, match="did you mean estimate's option 'optimizer'"):
        slimgrad.estimate(model, torch.randn(2, 8), optimiser="adamw")
    with pytest.raises(TypeError, match="did you mean audit's option 'case'"):
        slimgrad.audit(model, torch.randn(2, 8), cas="input")


def test_loss_fn_and_positional_kwargs_forms():
    model, x = _tiny()
    e_default = slimgrad.estimate(model, x)
    e_mean = slimgrad.estimate(model, x, loss_fn=lambda out: out.mean())
    measured = slimgrad.peak_bytes(lambda: model(x).mean().backward())
    model.zero_grad(set_to_none=True)
    _check(e_mean, measured, "linear, mean loss")
    assert e_default.gradient_bytes == e_mean.gradient_bytes == (4 * 3 + 3) * 4
    assert slimgrad.estimate(model, input=x).step_peak_bytes == e_default.step_peak_bytes


@pytest.mark.parametrize("text,expected", [
    ("12GiB", 12 * 2**30), ("800MB", 800 * 10**6), ("800 MiB", 800 * 2**20), (" 1.5 GB ", 1_500_000_000),
    ("64KiB", 65536), ("2TB", 2 * 10**12), ("1000", 1000), ("100B", 100), ("1e9", 10**9),
    # SI's kB and lower-case units, signed exponents, a leading plus
    ("5kB", 5000), ("12mib", 12 * 2**20), ("1e+6", 10**6), ("1e-3GB", 10**6), ("+5MiB", 5 * 2**20), ("2.7", 2),
])
def test_parse_bytes_strings(text, expected):
    assert parse_bytes(text) == expected


def test_a_missing_mask_seam_is_said(monkeypatch):
    """Where transformers has no ``_ignore_causal_mask_sdpa`` of the form slimgrad knows, the mask decision runs
    on fake tensors (the estimate may be high): the estimate's notes say so instead of staying silent."""
    import transformers.masking_utils as masking

    model, example = bm.llama_lora(seq=16)
    example["attention_mask"] = torch.ones_like(example["input_ids"])
    assert not any("attention-mask decision" in n for n in _estimate(model, example).notes)
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # another form: no padding_mask
    notes = _estimate(model, example).notes
    assert any("attention-mask decision" in n and "may be high" in n for n in notes), notes


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -x  # reads a value: data-dependent control flow


def test_data_dependent_step_names_the_module():
    """A step that reads a tensor's value cannot be simulated: the error says so and names the module where it
    happened (it said "(model)" before: the modules' frames had unwound by the time the error was written)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), _Branchy()))
    with pytest.raises(ValueError, match=r"reads a tensor's values .* in the forward of 1\.1\b"):
        estimate(model, torch.randn(4, 8, requires_grad=True))


def test_parse_bytes_numbers_and_errors():
    assert parse_bytes(1e9) == 10**9
    assert parse_bytes(4096) == 4096
    for bad in ("12 GiBs", "lots", "", "-1GB", "0", "1.5.2GB", "GiB"):
        with pytest.raises(ValueError, match="budget"):
            parse_bytes(bad)
    assert parse_bytes(2.7) == 2
    for bad in (0, -5, -1e9, 0.0, 0.5, float("nan"), float("inf"), "1e400", "0.5"):  # (under a byte: not a budget)
        with pytest.raises(ValueError, match="^budget: expected a positive number of bytes"):
            parse_bytes(bad)
    for bad in (True, False):
        with pytest.raises(TypeError, match="budget"):
            parse_bytes(bad)
    with pytest.raises((TypeError, ValueError), match="budget"):
        parse_bytes(None)
    with pytest.raises(ValueError, match="memory"):
        parse_bytes("x", what="memory")


def test_split_example_forms():
    x, y = torch.randn(2, 3), torch.randn(2)
    assert split_example(x)[0][0] is x and split_example(x)[1] == {}
    args, kwargs = split_example((x, y))
    assert args[0] is x and args[1] is y and kwargs == {}
    assert split_example([x, y])[0] == (x, y)
    args, kwargs = split_example({"input_ids": x, "labels": y})
    assert args == () and kwargs["input_ids"] is x and kwargs["labels"] is y
    with pytest.raises(TypeError, match="'example'"):
        split_example(3)
    # a BatchEncoding (a Mapping, not a dict) is keyword inputs too
    transformers = pytest.importorskip("transformers")
    args, kwargs = split_example(transformers.BatchEncoding({"input_ids": x}))
    assert args == () and kwargs["input_ids"] is x


def test_each_example_form_estimates_the_same_step():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):
            return self.a(x) * self.b(y)

    model = Two()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    forms = [(x, y), {"x": x, "y": y}]
    peaks = {_estimate(model, ex).step_peak_bytes for ex in forms}
    measured = slimgrad.peak_bytes(lambda: model(x, y).sum().backward())
    assert len(peaks) == 1 and peaks.pop() == measured
    lin = nn.Linear(8, 8)
    assert _estimate(lin, x).step_peak_bytes == slimgrad.peak_bytes(lambda: lin(x).sum().backward())


class _AliasedEmbedding(nn.Module):
    """transformers 4.x T5's layout: one embedding reached by two paths (``shared`` is also ``enc.embed``), and a
    head tied to its weight."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(32, 8)
        self.enc = nn.Module()
        self.enc.embed = self.shared
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.shared.weight
        self.norm = nn.BatchNorm1d(8)
        self.enc.norm = self.norm  # a buffer reached by two paths too

    def forward(self, ids):
        h = self.proj(self.enc.embed(ids))
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


def test_module_reached_by_two_paths_keeps_its_parameters():
    """The estimate swaps fake tensors into the model and back; a module reached by two paths has one slot under
    two names, which swapping name by name restored with a fake (the tie with the head broken, a fake tensor left
    in the user's model: T5 on transformers 4.x)."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = _AliasedEmbedding()
    weight, proj, mean = model.shared.weight, model.proj.weight, model.norm.running_mean
    ids = torch.randint(0, 32, (2, 5))
    e = slimgrad.estimate(model, ids)
    assert model.shared.weight is weight and model.enc.embed.weight is weight and model.head.weight is weight
    assert model.proj.weight is proj and model.norm.running_mean is mean and model.enc.norm.running_mean is mean
    assert not any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])
    # the tied weight is counted once
    assert e.weight_bytes == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())


def test_largest_fitting_finds_the_boundary_and_refuses_a_batch_that_stops_growing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    budget = estimate(model, torch.randn(40, 16), optimizer="sgd").peak_bytes + 1
    n, est = slimgrad.largest_fitting(model, budget, lambda n: torch.randn(n, 16), optimizer="sgd", high=4096)
    assert n >= 40 and est.peak_bytes <= budget
    assert estimate(model, torch.randn(n + 1, 16), optimizer="sgd").peak_bytes > budget
    # a slice of a fixed tensor stops growing at its length: every n then "fits" and the answer was 'high'
    xs = torch.randn(16, 16)
    with pytest.raises(ValueError, match=r"largest_fitting: make_example\(16\) and make_example\(32\) built "
                                         r"batches of the same shapes .*high="):
        slimgrad.largest_fitting(model, budget, lambda n: xs[:n], optimizer="sgd")
    with pytest.raises(TypeError, match="'make_example' must be a function n -> batch"):
        slimgrad.largest_fitting(model, budget, torch.randn(4, 16))
    with pytest.raises(TypeError, match="'high' must be an int"):
        slimgrad.largest_fitting(model, budget, lambda n: torch.randn(n, 16), high=1e6)


@pytest.mark.parametrize("device", ["tpu", "xla:0", 3.5])
def test_estimate_names_a_bad_device(device):
    with pytest.raises(ValueError, match="estimate: 'device' must"):
        estimate(nn.Linear(2, 2), torch.randn(1, 2), device=device)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_estimate_under_gradient_checkpointing(converted, reentrant):
    """torch's checkpoint copies the CPU generator's state per checkpointed block (5 KiB each, made outside any
    dispatch mode), which the simulated step did not count: 3.4-4.7 % low on this tiny Llama (the quantization
    sweep found 2-9 %)."""
    model, example = bm.llama_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    if converted:
        model = slimgrad.convert(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    measured = bm.measured_step_peak(model, example, opt)
    e = _estimate(model, example, optimizer="adamw")
    err = bm.relative_error(e.step_peak_bytes, measured)
    assert abs(err) <= 0.001, (e.step_peak_bytes, measured, f"{err:+.3%}")


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_hold_output_estimates_a_loop_that_holds_the_output(converted):
    """``out = model(**batch); out.loss.backward(); opt.step()`` holds the logits through backward and the step,
    where the Trainer frees them: the default estimate read 14 % low for that loop (the figures sweep);
    ``hold_output=True`` estimates it."""
    model, example = _build("llama_lora", converted)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    args, kwargs = split_example(example)

    def held_loop():
        opt.zero_grad(set_to_none=True)
        out = model(*args, **kwargs)
        out.loss.backward()
        opt.step()

    for _ in range(2):
        held_loop()
    opt.zero_grad(set_to_none=True)
    measured = slimgrad.peak_bytes(held_loop)
    held = _estimate(model, example, optimizer="adamw", hold_output=True)
    freed = _estimate(model, example, optimizer="adamw")
    assert abs(bm.relative_error(held.step_peak_bytes, measured)) <= 0.001, (held.step_peak_bytes, measured)
    assert freed.step_peak_bytes < held.step_peak_bytes
    assert held.kept_bytes == freed.kept_bytes  # the held output is not "kept for backward"


def test_estimate_inside_autocast_with_batch_norm():
    """Under the user's autocast, a batch norm's recorded backward (its saved statistics bf16 in the simulation,
    fp32 in the kernel) raised when replayed to measure its scratch, where the real step runs (the figures sweep):
    it now counts no scratch for that op and says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(4, 3, 32, 32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()

    def estimated():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return estimate(model, x, loss_fn=lambda out: out.float().sum())

    measured, e = _measured_and_estimated(model, step, estimated)
    assert abs(bm.relative_error(e.step_peak_bytes, measured)) <= 0.01, (e.step_peak_bytes, measured)
    assert any("native_batch_norm_backward" in n for n in e.notes)


def test_an_optimizer_that_reads_values_gets_a_clear_error():
    model, example = _build("llama_lora", False)
    opt = torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(ValueError, match="optimizer's step reads a tensor's values.*optimizer='adamw'"):
        _estimate(model, example, optimizer=opt)


class _ReadTwice(nn.Module):
    """A parameter read by two ops (DiT's final layer reuses block 0's embedding; tied embeddings) and an activation
    with two consumers: each gets two gradients, which the engine sums."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(1001, 16)
        self.lin = nn.Linear(16, 16)

    def forward(self, ids, x):
        h = self.lin(x)
        return (self.e(ids) * 2 + self.e(ids + 1)).sum() + (h * 2).sum() + (h * 3).sum()


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_gradients_summed_in_place_are_estimated_as_the_engine_sums_them(converted):
    """A real step sums a tensor's two gradients in place where the engine holds the only reference (aten::add_);
    under a dispatch mode, as in the simulation, the engine sums out of place: the estimate read one gradient high
    where the peak is that sum (+50 % on an embedding read twice, +37 % on a one-layer diffusers DiT; the diffusers2
    sweep)."""
    torch.manual_seed(0)
    model = _ReadTwice()
    if converted:
        model = slimgrad.convert(model)
    for example in ({"ids": torch.tensor([3, 7]), "x": torch.randn(4, 16)},  # the embedding's sum is the peak
                    {"ids": torch.tensor([3, 7]), "x": torch.randn(4000, 16)}):  # the activation's
        _assert_estimated_to_the_byte(model, example, warm=1 if converted else 0)


def test_small_figures_are_printed_readably():
    """A small model's plan read "budget 0.0 MiB ... smallest budget 0.0 MiB (12112 bytes)" (the errors sweep)."""
    from slimgrad.estimate import _gib

    assert _gib(12112) == "11.8 KiB" and _gib(3 * 2**20) == "3.0 MiB" and _gib(2**31) == "2.000 GiB"


class _ResidualGrad(torch.autograd.Function):
    """A Python backward whose own add (``g + g * s``) allocates: not the engine's in-place sum."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g + g * s, None


def test_a_python_backwards_own_sum_is_not_taken_for_the_engines():
    """The in-place correction took a custom Function's `g + g * s` for the engine's sum: 33 % low (review sweep)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 2)
            self.register_buffer("s", torch.rand(512, 64))

        def forward(self, x):
            return self.b(_ResidualGrad.apply(self.a(x), self.s))

    torch.manual_seed(0)
    model, example = M(), torch.randn(512, 64)
    _assert_estimated_to_the_byte(model, example)


class _UpsampleHead(nn.Module):
    """A segmentation-like head: conv, x8 bilinear upsampling, a loss over a channels-last map's log-softmax."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, target):
        up = F.interpolate(self.conv(x), scale_factor=8, mode="bilinear", align_corners=False)
        return F.cross_entropy(up.contiguous(memory_format=torch.channels_last), target)


def test_scratch_of_upsampling_and_channels_last_log_softmax_is_estimated():
    """CPU upsampling's forward holds about one more output inside the call, and log-softmax copies a channels-last
    input: the estimate read 50 % low on a conv + x8 upsample, 1.4-1.7 % on SegFormer (the vision sweep)."""
    torch.manual_seed(0)
    model = _UpsampleHead()
    example = {"x": torch.randn(2, 3, 8, 8), "target": torch.randint(0, 8, (2, 64, 64))}
    _assert_estimated_to_the_byte(model, example)


class _PyramidPooling(nn.Module):
    """UperNet/PSPNet's pooling branch: pool to 1x1, conv, training batch norm, ReLU, upsample, cat, 3x3 conv."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Conv2d(32, 32, 1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.bottleneck = nn.Conv2d(64, 16, 3, padding=1, bias=False)

    def forward(self, x):
        p = F.relu(self.bn(self.proj(self.pool(x))))
        p = F.interpolate(p, size=x.shape[2:], mode="bilinear", align_corners=False)
        return self.bottleneck(torch.cat([x, p], 1))


@pytest.mark.parametrize("convert", [False, True])
def test_a_pyramid_pooling_head_is_estimated_in_the_real_kernels_layout(convert):
    """On the 1x1 pooled map (contiguous in both formats) the meta batch norm made a channels-last output where the
    CPU kernel makes a contiguous one; the upsample, the cat and the 3x3 conv after it followed, and the conv's
    backward scratch was simulated in the wrong layout: the estimate read 7.8 % (stock) and 11.2 % (converted) low
    here, 3.8-7.8 % on UperNet steps (the vision sweep)."""
    torch.manual_seed(0)
    model = _PyramidPooling().train().requires_grad_(False)
    model = slimgrad.convert(model) if convert else model
    # a channels-last feature map, as a ConvNeXt / Swin stage hands it over (NHWC computed, permuted back)
    x = torch.randn(2, 16, 16, 32).permute(0, 3, 1, 2).detach().requires_grad_(True)
    _assert_estimated_to_the_byte(model, x)


def test_a_fresh_converted_model_is_estimated_as_its_later_steps_run():
    """A fresh converted DPT's first step peaks 22 % below its later ones (its head ReLU learns that a consumer keeps
    its output, then shares it and runs stock's backward), and the estimate was of that first step: a plan from it
    ran 0.9 MB over its budget on every later step (the vision sweep). A simulation that teaches the layers runs
    again."""
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        cfg = transformers.DPTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                                     image_size=32, patch_size=8, backbone_out_indices=[0, 1, 2, 3],
                                     neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16,
                                     reassemble_factors=[4, 2, 1, 0.5], hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
        return transformers.DPTForDepthEstimation(cfg).train()

    example = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    loss = lambda out: out.predicted_depth.sum()  # noqa: E731
    fresh = slimgrad.convert(build())
    estimated = estimate(fresh, loss_fn=loss, **example).step_peak_bytes
    trained = slimgrad.convert(build())
    for _ in range(2):
        loss(trained(**example)).backward()
    for p in trained.parameters():
        p.grad = None
    measured = slimgrad.peak_bytes(lambda: loss(trained(**example)).backward())
    assert abs(bm.relative_error(estimated, measured)) <= 0.01, (estimated, measured)


@pytest.mark.parametrize("size", [32, 64])
def test_a_frozen_strided_stem_conv_is_estimated_with_the_input_as_its_carrier(size):
    """A frozen strided conv's input gradient runs aten's dX-only backward on a carrier of X's shape, which is X itself
    while the caller holds it; the simulated step allocated a fresh one (a fake X is not a plain tensor) and read
    +20-27 % over the measured peak on a ResNet-like 7x7 stride-2 stem (the review sweep)."""
    torch.manual_seed(0)
    model = slimgrad.convert(nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False)).requires_grad_(False))
    x = torch.randn(2, 3, size, size, requires_grad=True)
    _assert_estimated_to_the_byte(model, x, warm=1)


class _UnusedHead(nn.Module):
    """A second output the loss never reads (BERT's pooler output under a loss on the hidden states), whose tanh
    keeps a large output for backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.aux = nn.Linear(256, 1024)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.tanh(self.aux(h))


@pytest.mark.parametrize("converted", [False, True], ids=["stock", "converted"])
def test_an_output_the_loss_never_reads_is_freed_with_it(converted):
    """The real step frees an unused output's branch, and what it saved, with the output before backward; the
    simulation held every autograd node it labelled with its module, so that branch lived through the simulated
    backward (+11 % here, +0.55 % on MiniLM's pooler)."""
    torch.manual_seed(0)
    model = _UnusedHead()
    if converted:
        model = slimgrad.convert(model)
    x = torch.randn(64, 256)

    def loss_fn(out):
        return out[0].pow(2).mean()

    def step():
        loss_fn(model(x)).backward()

    measured, e = _measured_and_estimated(model, step, lambda: slimgrad.estimate(model, x, loss_fn=loss_fn))
    assert e.step_peak_bytes == measured


def test_estimate_under_anomaly_mode_is_the_measured_peak():
    """Anomaly mode's NaN check reads every backward output's values, which the simulation's fake tensors have not:
    estimate raised "the step reads a tensor's values", blaming the model, where the real step ran. It allocates
    nothing the step keeps: the simulation runs without it, to the byte of the step measured under anomaly mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(32, 64)

    def step():
        model(x).sum().backward()

    with torch.autograd.set_detect_anomaly(True):
        measured, e = _measured_and_estimated(model, step, lambda: slimgrad.estimate(model, x))
        assert torch.is_anomaly_check_nan_enabled()  # the user's setting is back
    assert e.step_peak_bytes == measured


@pytest.mark.parametrize("spanning", [False, True], ids=["region_per_step", "one_region"])
def test_autocast_cache_of_trainable_weights_is_named(spanning):
    """Under autocast the bf16 copies of trainable fp32 weights (LoRA's A and B) are counted in the step, as a step in
    its own autocast region makes them; a region spanning several steps keeps them from its first step on
    (autocast's cache), and its later steps peak ``autocast_cache_bytes`` lower (read 4.8 % over; est46)."""
    import contextlib

    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1, init_lora_weights=False)).train()
    model = slimgrad.convert(model)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    example = {"input_ids": ids, "labels": ids}

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def step():
        with contextlib.nullcontext() if spanning else autocast():
            default_loss(model(**example)).backward()

    def no_grads():
        for p in model.parameters():
            p.grad = None

    with autocast() if spanning else contextlib.nullcontext():
        step()
        no_grads()
        measured = slimgrad.peak_bytes(step)
        no_grads()
    with autocast():
        e = _estimate(model, example)
    assert e.autocast_cache_bytes > 0 and any("autocast caches" in n for n in e.notes)
    expected = e.step_peak_bytes - (e.autocast_cache_bytes if spanning else 0)
    assert expected == measured, (expected, measured, e.autocast_cache_bytes)
    assert _estimate(model, example).autocast_cache_bytes == 0  # no autocast: nothing cached


def test_cnn_trained_under_autocast_is_estimated_with_backward_outside_the_region():
    """Torch's recipe runs backward outside the autocast region, whose exit clears autocast's cache of the trainable
    weights' bf16 copies: they then go as backward passes their readers. Simulated inside the user's region the
    cache held every copy to the end of backward: a small ResNet read 45 % over its measured step (2026-11-28)."""
    from slimgrad.models.cnn import build_model

    torch.manual_seed(0)
    model = slimgrad.convert(build_model("resnet18", num_classes=10, width_scale=0.25).train())
    x = torch.randn(2, 3, 32, 32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = default_loss(model(x))
        loss.backward()

    def estimate_under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _estimate(model, x)

    measured, e = _measured_and_estimated(model, step, estimate_under_autocast)
    assert e.autocast_cache_bytes > 0
    assert e.step_peak_bytes == measured, (e.step_peak_bytes, measured)
    assert torch.is_autocast_enabled("cpu") is False  # (the estimate left the user's state as it found it)
