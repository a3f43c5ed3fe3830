"""Helpers shared by the tests: requires_grad combinations and comparisons with stock PyTorch."""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from slimgrad._registry import REPLACEMENTS
from slimgrad.measure import saved_bytes

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def grad_combos(n: int):
    """Every tuple of n booleans (which of n tensors require grad)."""
    return list(itertools.product([False, True], repeat=n))


def slim_copy(module: nn.Module) -> nn.Module:
    """An independent deep copy of a stock module, converted by class swap to its slimgrad replacement."""
    twin = copy.deepcopy(module)
    twin.__class__ = REPLACEMENTS[type(module)]
    return twin


def set_requires_grad(module: nn.Module, **flags: bool) -> None:
    """set_requires_grad(m, weight=False, bias=True): sets flags on named parameters that exist."""
    for name, flag in flags.items():
        p = getattr(module, name, None)
        if isinstance(p, nn.Parameter):
            p.requires_grad_(flag)


def assert_same(actual: torch.Tensor | None, expected: torch.Tensor | None, *, exact=True, rtol=None, atol=None,
                what=""):
    """Equal values and dtype; bitwise when exact, else within the given (or dtype-default) tolerance."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: one is None ({actual is None}, {expected is None})"
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if exact:
        assert torch.equal(actual, expected) or (
            torch.equal(torch.isnan(actual), torch.isnan(expected))
            and torch.equal(actual.nan_to_num(), expected.nan_to_num())
        ), f"{what}: not bitwise equal, max abs diff {(actual.double() - expected.double()).abs().max()}"
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def run_step(module: nn.Module, x: torch.Tensor, grad_out_seed: int = 0):
    """Forward, then backward with a fixed random upstream gradient; returns (output, input grad)."""
    out = module(x)
    first = out[0] if isinstance(out, tuple) else out
    g = torch.randn(first.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(first.dtype)
    if first.requires_grad:
        first.backward(g)
    return out, (x.grad if x.requires_grad else None)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in a named memory layout: "contiguous", "channels_last", "transposed" (last two dims
    swapped in memory), "sliced" (every other element of a wider buffer) or "expanded" (t's first element
    broadcast: zero strides, what ``y.sum().backward()`` sends)."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "expanded":
        return t.reshape(-1)[:1].reshape([1] * t.dim()).expand(t.shape)
    raise ValueError(layout)


class _GradProbe(torch.autograd.Function):
    """Identity (a copy in x's layout) whose backward records the gradient it receives as it arrives."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.clone(memory_format=torch.preserve_format)

    @staticmethod
    def backward(ctx, grad):
        ctx.box.append(grad)
        return grad, None


def input_grad_as_returned(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, seed: int = 0):
    """Run ``module`` on a non-leaf tensor laid out like the dense ``x`` and back-propagate ``grad``;
    returns (output, the input gradient exactly as the module's backward returned it). A leaf's ``.grad``
    would not do: AccumulateGrad restrides it to the leaf's layout."""
    box = []
    leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    inner = _GradProbe.apply(leaf, box)
    assert inner.stride() == x.stride()
    torch.manual_seed(seed)
    out = module(inner)
    out.backward(grad)
    return out.detach(), box[0]


__all__ = ["FLOAT_DTYPES", "assert_same", "grad_combos", "input_grad_as_returned", "laid_out", "run_step",
           "saved_bytes", "set_requires_grad", "slim_copy"]


class OneLayer(nn.Module):
    """A model that is one wrapped layer (``.proj``), as peft and the converter see a layer inside a model."""

    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


class TwoReaders(nn.Module):
    """``q(x) * k(x)``: two layers reading one input (attention's q and k), where their input gradients meet."""

    def __init__(self, make):
        super().__init__()
        self.q, self.k = make(), make()

    def forward(self, x):
        return self.q(x) * self.k(x)


def two_active_adapters(model: nn.Module, r: int, second_dropout: float) -> nn.Module:
    """``model``'s q and k under peft LoRA with two adapters active at once, both dropping, both in fp32 (peft's
    upcast, on every release): where several adapters' input gradients meet other layers' at one x."""
    from peft import LoraConfig, get_peft_model

    stock = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=["q", "k"], lora_dropout=0.1,
                                             init_lora_weights=False))
    stock.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q", "k"], lora_dropout=second_dropout,
                                           init_lora_weights=False))
    stock.base_model._cast_adapter_dtype(adapter_name="second", autocast_adapter_dtype=True)
    stock.base_model.set_adapter(["default", "second"])
    return stock
