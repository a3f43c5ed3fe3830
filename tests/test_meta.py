"""Every slimgrad family on the meta device: shape propagation (same output shapes, dtypes and strides as
stock), backward giving meta gradients of the right shapes, and models built under ``torch.device("meta")``
then converted. FSDP2's meta-device initialisation is in ``tests/test_distributed.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.functional import (
    fused_add_rms_norm,
    fused_linear_cross_entropy,
    gated_activation,
    lora_linear,
    poly_norm,
)
from slimgrad.functional.hf_activations import gelu_new
from slimgrad.functional.lora import LoraAdapter
from slimgrad.models.cnn import build_model

META = torch.device("meta")

MODULES = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), (2, 3, 8)),
    "conv2d-reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 8, 8)),
    "conv2d-same": (lambda: nn.Conv2d(3, 4, 4, padding="same"), (2, 3, 8, 8)),
    "conv3d": (lambda: nn.Conv3d(3, 4, 3), (2, 3, 5, 5, 5)),
    "conv-transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1), (2, 3, 8, 8)),
    "max-pool1d": (lambda: nn.MaxPool1d(2), (2, 3, 8)),
    "max-pool2d": (lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 3, 8, 8)),
    "max-pool3d-indices": (lambda: nn.MaxPool3d(2, return_indices=True), (2, 3, 4, 4, 4)),
    "avg-pool2d": (lambda: nn.AvgPool2d(2, divisor_override=3), (2, 3, 8, 8)),
    "avg-pool3d": (lambda: nn.AvgPool3d(2), (2, 3, 4, 4, 4)),
    "adaptive-avg-pool2d": (lambda: nn.AdaptiveAvgPool2d(3), (2, 3, 8, 8)),
    "adaptive-avg-pool2d-1": (lambda: nn.AdaptiveAvgPool2d(1), (2, 3, 8, 8)),
    "dropout": (lambda: nn.Dropout(0.3), (2, 3, 8)),
    "dropout2d": (lambda: nn.Dropout2d(), (2, 3, 8, 8)),
    "batch-norm-train": (lambda: nn.BatchNorm2d(3), (2, 3, 8, 8)),
    "batch-norm-eval": (lambda: nn.BatchNorm2d(3).eval(), (2, 3, 8, 8)),
    "layer-norm": (lambda: nn.LayerNorm(8), (2, 3, 8)),
    "group-norm": (lambda: nn.GroupNorm(1, 3), (2, 3, 8, 8)),
    "rms-norm": (lambda: nn.RMSNorm(8), (2, 3, 8)),
    "relu": (lambda: nn.ReLU(), (2, 3, 8)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.1), (2, 3, 8)),
    "relu6": (lambda: nn.ReLU6(), (2, 3, 8)),
    "hardtanh": (lambda: nn.Hardtanh(-2.0, 2.0), (2, 3, 8)),
    "threshold": (lambda: nn.Threshold(0.1, 5.0), (2, 3, 8)),
    "hardsigmoid": (lambda: nn.Hardsigmoid(), (2, 3, 8)),
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("frozen", [False, True], ids=["params-train", "params-frozen"])
@pytest.mark.parametrize("default_device", [False, True], ids=["tensors", "device-context"])
def test_module_on_meta(name, frozen, default_device):
    """Stock runs on meta tensors (no data, shapes only); the converted module must too, forward and
    backward, in every requires_grad case slimgrad distinguishes, also inside ``with torch.device("meta")``
    (which makes every factory call meta: the clamp family's bound rounding failed there)."""
    make, shape = MODULES[name]
    stock = make().to(META).requires_grad_(not frozen)
    slim = slimgrad.convert(stock)
    context = torch.device("meta") if default_device else contextlib.nullcontext()
    with context:
        _forward_backward_on_meta(stock, slim, shape, frozen)


def _forward_backward_on_meta(stock, slim, shape, frozen):
    for rg in (True, False):
        xs = torch.empty(shape, device=META, requires_grad=rg)
        xm = torch.empty(shape, device=META, requires_grad=rg)
        ys, ym = _first(stock(xs)), _first(slim(xm))
        assert (ym.device, ym.shape, ym.dtype, ym.stride()) == (ys.device, ys.shape, ys.dtype, ys.stride())
        assert ym.requires_grad == ys.requires_grad
        if ym.requires_grad:
            ym.sum().backward()
            if rg:
                assert xm.grad.device == META and xm.grad.shape == xm.shape
        for p in slim.parameters():
            assert (p.grad is None) == frozen
            if p.grad is not None:
                assert p.grad.device == META and p.grad.shape == p.shape
            p.grad = None


def test_functional_families_on_meta():
    """The families without a stock module of their own: gated MLP activation, transformers' formula
    activations, FusedAddRMSNorm, PolyNorm, the fused LoRA linear (with dropout) and the chunked loss."""
    def leaf(*shape):
        return torch.empty(shape, device=META, requires_grad=True)

    x, w = leaf(4, 8), leaf(8)
    outs = [
        (gated_activation(leaf(4, 8), leaf(4, 8)), (4, 8)),
        (gelu_new(leaf(4, 8)), (4, 8)),
        (fused_add_rms_norm(x, leaf(4, 8), w)[0], (4, 8)),
        (poly_norm(leaf(4, 8), leaf(3), leaf(1)), (4, 8)),
        (lora_linear(leaf(2, 3, 8), torch.empty(6, 8, device=META), None,
                     [LoraAdapter(leaf(2, 8), leaf(6, 2), 2.0, 0.1)]), (2, 3, 6)),
        (fused_linear_cross_entropy(leaf(5, 8), leaf(11, 8), torch.zeros(5, dtype=torch.long, device=META)), ()),
    ]
    for out, shape in outs:
        assert out.device == META and tuple(out.shape) == shape
        leaves = [t for t in out.grad_fn.next_functions if t[0] is not None]
        assert leaves
        out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.device == META


def test_model_built_on_meta_then_converted():
    """``with torch.device("meta")``: build a ResNet, convert it, propagate shapes through a training step;
    then materialise it (``to_empty``) and check it computes what the stock model computes."""
    with torch.device(META):
        stock = build_model("resnet18", width_scale=0.125, num_classes=5)
    slim = slimgrad.convert(stock)
    assert all(p.device == META for p in slim.parameters())
    x = torch.empty(2, 3, 32, 32, device=META, requires_grad=True)
    out = slim(x)
    assert out.shape == (2, 5) and out.device == META
    out.sum().backward()
    assert x.grad.shape == x.shape

    torch.manual_seed(0)
    reference = build_model("resnet18", width_scale=0.125, num_classes=5)
    slim.to_empty(device="cpu")
    slim.load_state_dict(reference.state_dict())
    xr = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(slim.eval()(xr), reference.eval()(xr), rtol=0, atol=0)


def test_peft_lora_model_on_meta():
    """A peft LoRA model (dropout > 0, on a conv and linear layers) built on meta and converted: the fused LoRA
    Functions propagate shapes, and only the adapters get (meta) gradients."""
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(5, 5, 3, padding=1)
            self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.o(torch.relu(self.q(self.conv(x))))

    with torch.device(META):
        model = peft.get_peft_model(Block(), peft.LoraConfig(r=2, target_modules=["conv", "q", "o"],
                                                             lora_dropout=0.1))
    slim = slimgrad.convert(model)
    names = {type(m).__module__ for m in slim.modules()}
    assert any(n.startswith("slimgrad") for n in names)
    x = torch.empty(3, 5, 8, device=META, requires_grad=True)
    out = slim(x)
    assert out.shape == (3, 5, 4) and out.device == META
    out.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in slim.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
