"""Non-reentrant checkpointing around converted activations, where one backward ends before another forward's
recomputation: gradient accumulation written forwards-first, ``backward(retain_graph=True)`` twice, ``autograd.grad``
then ``backward``, selective checkpointing. An activation module learns during backward whether to keep its output
instead of a mask; a recomputation that applied a decision published after its forward saved other tensors than
the forward, and checkpoint raised (CheckpointError; with the check off, a dtype error). Stock ran."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import slimgrad

ACTIVATIONS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "leaky": lambda: nn.LeakyReLU(0.1),
               "leaky-inplace": lambda: nn.LeakyReLU(0.1, inplace=True)}


def _block(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), ACTIVATIONS[act](), nn.Conv2d(8, 4, 3, padding=1))


def _sac(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE


def _run(model, pattern, steps=2):
    xs = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    kwargs = {"use_reentrant": False}
    if pattern == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _sac)
    if pattern == "unchecked":
        kwargs["determinism_check"] = "none"
    record = []
    for step in range(steps):
        losses = [checkpoint(model, x, **kwargs).square().mean() for x in xs[2 * (step % 2):][:2]]
        if pattern == "retain":
            losses[0].backward(retain_graph=True)
            losses[0].backward()
        elif pattern == "grad-then-backward":
            params = [p for p in model.parameters() if p.requires_grad]
            record += list(torch.autograd.grad(losses[0], params))
            losses[1].backward()
        else:
            for loss in losses:
                loss.backward()
        record += [loss.detach() for loss in losses]
        record += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        if step == 0:
            model[2].requires_grad_(False)  # the consumer freezes: the activation's decision changes
    return record


@pytest.mark.parametrize("pattern", ["forwards-first", "retain", "grad-then-backward", "selective", "unchecked"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_recomputation_after_another_backward(act, pattern):
    if act.endswith("inplace") and pattern == "selective":
        pytest.skip("stock raises too: an in-place op on a tensor selective checkpointing must save")
    stock = _block(act)
    slim = slimgrad.convert(copy.deepcopy(stock))
    expected, got = _run(stock, pattern), _run(slim, pattern)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_hf_bert_relu_with_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, hidden_act="relu", hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    stock = transformers.BertForMaskedLM(config)
    stock.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stock.train()
    slim = slimgrad.convert(copy.deepcopy(stock))
    ids = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    results = []
    for model in (stock, slim):
        losses = [model(input_ids=i, labels=i).loss for i in ids]  # forwards first, then the backwards
        for loss in losses:
            loss.backward()
        results.append([loss.detach() for loss in losses] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
