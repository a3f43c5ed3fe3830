"""Eager forward-mode AD (``torch.autograd.forward_ad``: a JVP penalty, consistency-model training) through converted
layers and inside ``slimgrad.enabled()``: slimgrad's Functions define no ``jvp``, and a dual input raised "jvp is not
implemented" (conv, conv-transpose, batch norm, in-place ReLU, the norms) where stock ran. Inside a dual level the
stock forward runs: the same outputs, tangents and gradients as stock, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch import nn

import slimgrad


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.ConvTranspose2d(8, 8, 2, stride=2), nn.GroupNorm(2, 8), nn.LeakyReLU(0.1), nn.Conv2d(8, 4, 1),
        nn.Flatten(), nn.LayerNorm(4 * 8 * 8), nn.Hardtanh(), nn.Linear(4 * 8 * 8, 5),
    )


def _step(model, mode):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    tangent = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with slimgrad.enabled() if mode == "enabled" else torch.enable_grad(), fwad.dual_level():
        y, dy = fwad.unpack_dual(model(fwad.make_dual(x, tangent)))
        loss = y.square().mean() + 0.1 * dy.square().mean()  # a JVP penalty
    loss.backward()
    return [y.detach(), dy.detach(), loss.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["convert", "enabled"])
def test_jvp_penalty_matches_stock(mode, train):
    stock = _model().train(train)
    slim = (slimgrad.convert(copy.deepcopy(stock)) if mode == "convert" else copy.deepcopy(stock)).train(train)
    expected, got = _step(stock, "stock"), _step(slim, mode)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_outside_a_dual_level_the_converted_forward_runs_again():
    model = slimgrad.convert(_model()).requires_grad_(False)  # a frozen conv: slimgrad keeps no input
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with fwad.dual_level():
        model(fwad.make_dual(x.detach(), torch.ones_like(x)))
    out = model[0](x)
    assert "ConvolutionBackward" not in out.grad_fn.name()  # slimgrad's Function, not stock's conv
