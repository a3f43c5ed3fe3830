"""Mask activations on a broadcast view (``expand``: zero strides). Stock's LeakyReLU and clamp family keep their
input, which there is the view's small storage; a 1-bit mask of every element can be larger. slimgrad keeps
whichever is smaller, and its numbers stay stock's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
import slimgrad.functional as SF
from slimgrad.measure import SavedTensors

MODULES = [
    nn.LeakyReLU(0.1), nn.ReLU6(), nn.Hardtanh(-0.5, 0.5), nn.Threshold(0.1, 20.0), nn.Hardsigmoid(), nn.ReLU(),
]
FUNCTIONAL = [
    ("leaky_relu", (0.1,)), ("relu6", ()), ("hardtanh", (-0.5, 0.5)), ("threshold", (0.1, 20.0)),
    ("hardsigmoid", ()), ("relu", ()),
]
# (base shape, expanded shape): a batch broadcast, a wide feature broadcast, and one where the mask is smaller
SHAPES = [((1, 8), (64, 8)), ((4, 1), (4, 4096)), ((1, 256), (2, 256))]


def _run(fn, base_data, expanded):
    base = base_data.clone().requires_grad_(True)
    with SavedTensors() as counter:
        out = fn(base.expand(*expanded))
    (grad,) = torch.autograd.grad(out, base, torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out, grad, counter.bytes


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: f"{s[0]}->{s[1]}")
@pytest.mark.parametrize("module", MODULES, ids=lambda m: type(m).__name__)
def test_module_keeps_no_more_than_stock(module, shapes):
    base_shape, expanded = shapes
    data = torch.randn(base_shape, generator=torch.Generator().manual_seed(0)) * 4
    slim = slimgrad.convert(nn.Sequential(copy.deepcopy(module)))
    out_s, grad_s, kept_s = _run(module, data, expanded)
    out_m, grad_m, kept_m = _run(slim, data, expanded)
    assert torch.equal(out_m, out_s) and torch.equal(grad_m, grad_s)
    assert kept_m <= kept_s
    numel = torch.Size(expanded).numel()
    if type(module) is nn.ReLU or data.numel() * 4 * 8 > numel:
        assert kept_m == numel // 8  # the 1-bit mask where it is the smaller (ReLU: stock keeps its full output)
    else:
        assert kept_m == kept_s == data.numel() * 4  # stock's own op: the view's storage


@pytest.mark.parametrize("shapes", SHAPES[:2], ids=lambda s: f"{s[0]}->{s[1]}")
@pytest.mark.parametrize("name,args", FUNCTIONAL, ids=lambda v: v if isinstance(v, str) else "")
def test_functional_and_mode_keep_no_more_than_stock(name, args, shapes):
    base_shape, expanded = shapes
    data = torch.randn(base_shape, generator=torch.Generator().manual_seed(0)) * 4
    stock_fn, slim_fn = getattr(F, name), getattr(SF, name)
    out_s, grad_s, kept_s = _run(lambda x: stock_fn(x, *args), data, expanded)
    out_f, grad_f, kept_f = _run(lambda x: slim_fn(x, *args), data, expanded)
    with slimgrad.enabled():
        out_e, grad_e, kept_e = _run(lambda x: stock_fn(x, *args), data, expanded)
    for out, grad, kept in ((out_f, grad_f, kept_f), (out_e, grad_e, kept_e)):
        assert torch.equal(out, out_s) and torch.equal(grad, grad_s)
        assert kept <= kept_s
