"""torch's compiled autograd (``torch._dynamo.compiled_autograd._enable``) over converted layers run eagerly: it cannot
take the compiled core's C++ Functions (a conv's or batch norm's saved capsule: "unhashable type"; an in-place
activation's ``mark_dirty``: an internal assert), so while it is on, the Python Functions run: stock's numbers. With
compiled autograd switched on only around ``backward()`` the forward cannot know (README, Limits)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad

pytestmark = pytest.mark.slow


def _cases():
    yield "frozen-conv", nn.Conv2d(3, 4, 3), False
    yield "frozen-bn-eval", nn.BatchNorm2d(3).eval(), False
    yield "inplace-relu", nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU(inplace=True)), True


@pytest.mark.parametrize("name,module,train", list(_cases()), ids=[c[0] for c in _cases()])
def test_step_under_compiled_autograd_matches_stock(name, module, train):
    from torch._dynamo import compiled_autograd

    module.requires_grad_(train)
    x0 = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (copy.deepcopy(module), slimgrad.convert(module)):
        torch._dynamo.reset()
        x = x0.clone().requires_grad_(True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            model(x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)
