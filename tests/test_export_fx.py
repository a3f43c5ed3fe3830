"""``torch.export`` and ``torch.fx.symbolic_trace`` of a converted model.

Export runs every replacement's stock forward (``_registry._stock_when_traced``): strict export traced slimgrad's
autograd Functions without their backward, so the exported module gave no gradients and raised nothing; non-strict
export put the ReLU masks' packing into the graph (2.1x stock's inference time on a ResNet-18-like model). Exported
graphs are now stock's, op for op. fx's symbolic tracing keeps torch.nn's layers as leaves by their class, which a
converted layer lacks: it raised fx's own TraceError; now an error naming slimgrad and ``revert``, and the workflow
it names (revert, trace, convert the GraphModule) trains as stock's traced model does."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

import slimgrad


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.GroupNorm(2, 8),
                         nn.LeakyReLU(0.1), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32, 5))


def _ops(exported) -> collections.Counter:
    return collections.Counter(str(n.target) for n in exported.graph.nodes if n.op == "call_function")


def _step(module: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = module(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert a[2][name] is not None and torch.equal(a[2][name], b[2][name]), name


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_export_gives_stocks_graph_and_gradients(strict, training):
    stock = _cnn().train(training)
    converted = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 12, 12)
    exported_stock = torch.export.export(copy.deepcopy(stock), (x,), strict=strict)
    exported = torch.export.export(converted, (x,), strict=strict)
    assert _ops(exported) == _ops(exported_stock)  # stock's ops: no mask packing, no grad-disabled regions
    # the exported module trains as stock's does (strict export gave no gradient to x and 6 of 6 parameters)
    _assert_same(_step(exported.module(), x), _step(exported_stock.module(), x))
    # and the converted model is still slimgrad's after exporting (the check is per call, not a switch)
    assert type(converted[0]) is not nn.Conv2d and slimgrad.revert(converted) is converted


def test_export_lora_llama_gradients():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    base = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"])).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def grads(model):
        kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
        exported = torch.export.export(model, (), kwargs, strict=False).module()
        loss = exported(**kwargs)["loss"]
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in exported.named_parameters() if p.requires_grad}

    stock_loss, stock_grads = grads(copy.deepcopy(base))
    loss, converted_grads = grads(slimgrad.convert(copy.deepcopy(base)))
    assert torch.equal(loss, stock_loss) and stock_grads.keys() == converted_grads.keys() and stock_grads
    assert all(torch.equal(converted_grads[n], stock_grads[n]) for n in stock_grads)


def test_symbolic_trace_names_slimgrad_and_revert_and_that_workflow_trains_as_stock():
    stock = _cnn()
    converted = slimgrad.convert(copy.deepcopy(stock))
    with pytest.raises(RuntimeError, match=r"slimgrad: torch.fx.symbolic_trace .*Conv2d.*slimgrad.revert\(model\)"):
        torch.fx.symbolic_trace(converted)
    traced = slimgrad.convert(torch.fx.symbolic_trace(slimgrad.revert(converted)))
    assert any(type(m).__module__.startswith("slimgrad.") for m in traced.modules())
    x = torch.randn(2, 3, 12, 12)
    _assert_same(_step(traced, x), _step(torch.fx.symbolic_trace(copy.deepcopy(stock)), x))
