"""Several forwards in one autocast region (siamese and contrastive views, distillation): stock casts a trainable
fp32 leaf weight once per region (autocast's cache) and every call shares that copy, so the calls' gradients meet
in bf16 at the one cast and are cast to fp32 once. The compiled core's conv and LoRA run aten's ops under autocast
(the cache applies); the Python Functions cast with a plain ``.to()`` per call, summing the gradients in fp32: one
bf16 ulp off (the loops sweep). With the core loaded they call autocast's own cached cast: bitwise. Without the core
(no compiler) they still cast per call (README, Exactness)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import csrc


@pytest.fixture(autouse=True)
def _need_core():
    if csrc.core() is None:
        pytest.skip("autocast's cached cast is called through the compiled core, which is off or unavailable here")


def _views_step(model, views):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sum((model(v).float() ** 2).mean() for v in views)  # three views, one autocast region
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_conv_views_in_one_region_match_stock(padding_mode):
    """(The core's own conv runs aten's under autocast, which casts through the cache; a reflect-padded conv runs
    the Python Function, which cast per call.)"""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, padding_mode=padding_mode), nn.Conv2d(64, 256, 3, padding=1))
    views = [torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    slim = slimgrad.convert(copy.deepcopy(stock))
    for a, b in zip(_views_step(slim, views), _views_step(stock, views)):
        assert torch.equal(a, b)
    # the next region casts afresh (the cache is cleared when the outermost region ends): the same again
    for a, b in zip(_views_step(slim, views), _views_step(stock, views)):
        assert torch.equal(a, b)


def test_lora_views_in_one_region_match_peft():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    config = peft.LoraConfig(r=16, target_modules=["0", "2"], init_lora_weights=False)
    stock = peft.get_peft_model(base, config)
    slim = slimgrad.convert(copy.deepcopy(stock))
    views = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for a, b in zip(_views_step(slim, views), _views_step(stock, views)):
        assert torch.equal(a, b)
