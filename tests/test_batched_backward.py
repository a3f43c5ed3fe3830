"""Autograd's batched backward through converted layers: ``torch.autograd.grad(..., is_grads_batched=True)`` and
what is built on it (``torch.autograd.functional.jacobian(vectorize=True)``, ``hessian(vectorize=True)``). Its
gradients are legacy-vmap BatchedTensors, which the mask activations' bit views, the core's kernels, pooling's
out= forms and the norms' in-place products could not take ("Cannot access data pointer of Tensor that doesn't
have storage", "Batching rule not implemented for aten::view.dtype"): every Function, Python or the core's C++,
now runs its backward once per batch entry there (``_common.serves_batched_grads``, ``csrc/common.h``'s
``per_batch_entry``). Compared with stock's batched backward on independent copies, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import csrc

_IMG, _SEQ = (2, 3, 8, 8), (2, 5, 8)


def _lora(base: nn.Module, dropout: float) -> nn.Module:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(nn.Sequential(base), peft.LoraConfig(target_modules=["0"], r=2,
                                                                    lora_dropout=dropout)).base_model.model


def _hf(name: str) -> nn.Module:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {
        "llama_rms": lambda: LlamaRMSNorm(8), "t5_layer_norm": lambda: T5LayerNorm(8),
        "gemma_rms": lambda: GemmaRMSNorm(8),
        "llama_mlp": lambda: LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                                  num_key_value_heads=2)),
    }[name]()


# name -> (module factory, input shape)
_CASES = {
    "relu": (nn.ReLU, _IMG),
    "relu_inplace_after_conv": (lambda: nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU(inplace=True)), _IMG),
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), _IMG),
    "relu6": (nn.ReLU6, _IMG),
    "hardtanh": (nn.Hardtanh, _IMG),
    "threshold": (lambda: nn.Threshold(0.1, 0.5), _IMG),
    "hardsigmoid": (nn.Hardsigmoid, _IMG),
    "max_pool2d": (lambda: nn.MaxPool2d(2), _IMG),
    "max_pool1d": (lambda: nn.MaxPool1d(2), _SEQ),
    "avg_pool2d": (lambda: nn.AvgPool2d(2), _IMG),
    "adaptive_avg_pool2d": (lambda: nn.AdaptiveAvgPool2d(2), _IMG),
    "dropout": (lambda: nn.Dropout(0.3), _IMG),
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), _IMG),
    "conv_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), _IMG),
    "batch_norm_train": (lambda: nn.BatchNorm2d(3), _IMG),
    "batch_norm_eval": (lambda: nn.BatchNorm2d(3).eval(), _IMG),
    "layer_norm": (lambda: nn.LayerNorm(8), _SEQ),
    "group_norm": (lambda: nn.GroupNorm(1, 3), _IMG),
    "rms_norm": (lambda: nn.RMSNorm(8), _SEQ),
    "llama_rms": (lambda: _hf("llama_rms"), _SEQ),
    "t5_layer_norm": (lambda: _hf("t5_layer_norm"), _SEQ),
    "gemma_rms": (lambda: _hf("gemma_rms"), _SEQ),
    "llama_mlp": (lambda: _hf("llama_mlp"), _SEQ),
    "lora_linear_dropout": (lambda: _lora(nn.Linear(8, 8), 0.1), _SEQ),
    "lora_conv": (lambda: _lora(nn.Conv2d(3, 4, 3, padding=1), 0.0), _IMG),
}


def _batched_grads(model: nn.Module, x: torch.Tensor, train_params: bool):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)  # dropout's mask
    y = model(x)
    v = torch.randn(3, *y.shape, generator=torch.Generator().manual_seed(1))
    wrt = [x] + ([p for p in model.parameters() if p.requires_grad] if train_params else [])
    return torch.autograd.grad(y, wrt, v, is_grads_batched=True)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("train_params", [False, True], ids=["input", "input+params"])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_batched_backward_matches_stock(name, train_params, core):
    make, shape = _CASES[name]
    torch.manual_seed(0)
    base = make()
    names = [n for n, _ in base.named_parameters()]
    if train_params and not names:
        pytest.skip("no parameters")
    lora = any("lora" in n for n in names)
    for n, p in base.named_parameters():
        p.requires_grad_(train_params and (not lora or "lora" in n))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    expected = _batched_grads(copy.deepcopy(base), x, train_params)
    converted = slimgrad.convert(copy.deepcopy(base))
    with (csrc.disabled() if not core else torch.enable_grad()):
        got = _batched_grads(converted, x, train_params)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(4, 2, 1), nn.LeakyReLU(0.1), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


@pytest.mark.parametrize("mode", ["convert", "enabled"])
def test_jacobian_vectorized_matches_stock(mode):
    """jacobian(vectorize=True) of a small frozen CNN in eval mode with respect to its input (input saliency,
    Jacobian regularisers)."""
    stock = _cnn().eval().requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    expected = torch.autograd.functional.jacobian(copy.deepcopy(stock), x, vectorize=True)
    if mode == "convert":
        got = torch.autograd.functional.jacobian(slimgrad.convert(copy.deepcopy(stock)), x, vectorize=True)
    else:
        with slimgrad.enabled():
            got = torch.autograd.functional.jacobian(copy.deepcopy(stock), x, vectorize=True)
    assert torch.equal(got, expected)


def test_hessian_vectorized_through_conv_and_relu_matches_stock():
    """hessian(vectorize=True): a batched backward of a double backward, through the layers that support double
    backward (conv, ReLU)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 1, 1)).requires_grad_(False)
    converted = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(4))

    def energy(model):
        return lambda inp: model(inp).square().sum()

    expected = torch.autograd.functional.hessian(energy(copy.deepcopy(stock)), x, vectorize=True)
    got = torch.autograd.functional.hessian(energy(converted), x, vectorize=True)
    assert torch.equal(got, expected)
