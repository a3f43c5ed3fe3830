"""Bytes kept for backward under ``torch.compile`` (inductor, the default backend), per family.

Under compile an autograd Function's ``save_for_backward`` is not binding: AOTAutograd traces forward and
backward into one graph and its partitioner decides anew what the backward reads, and inductor's layout
optimisation used to save a channels-last copy of every conv weight. So what slimgrad keeps is measured on
the compiled module itself: ``SavedTensors`` sees the compiled graph's saved tensors (AOTAutograd's
``CompiledFunction`` saves through ``save_for_backward``). The target: compiled slimgrad keeps no more than
1.05x what eager slimgrad keeps, in the default (contiguous) layout, and values match stock eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests._util import assert_same
from torch import nn

import slimgrad
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.slow

RATIO = 1.05


def kept(model, x, compiled):
    """Bytes kept by one training forward (after a warm-up step), and the input gradient of that step."""
    run = torch.compile(model, fullgraph=True) if compiled else model
    run(x.detach().clone().requires_grad_(x.requires_grad)).sum().backward()  # warm-up (and compile)
    xi = x.detach().clone().requires_grad_(x.requires_grad)
    with SavedTensors(exclude=[model]) as counter:
        out = run(xi)
    out.sum().backward()
    return counter.bytes, out, xi.grad


def check_family(stock, x, *, at_most_eager=True):
    torch._dynamo.reset()
    eager = slimgrad.convert(copy.deepcopy(stock))
    compiled = slimgrad.convert(copy.deepcopy(stock))
    b_eager, out_e, g_e = kept(eager, x, False)
    b_comp, out_c, g_c = kept(compiled, x, True)
    _, out_s, g_s = kept(copy.deepcopy(stock), x, False)
    assert_same(out_c, out_s, exact=False, rtol=1e-4, atol=1e-5, what="compiled output vs stock eager")
    assert_same(g_c, g_s, exact=False, rtol=1e-4, atol=1e-5, what="compiled input grad vs stock eager")
    if at_most_eager:
        assert b_comp <= RATIO * b_eager, f"compiled keeps {b_comp} bytes, eager {b_eager}"
    return b_eager, b_comp


def _frozen(model):
    return model.requires_grad_(False)


def test_conv_frozen_and_trainable():
    """Frozen convs (input needs grad) keep no weight copies; trainable ones keep what eager keeps (the
    reflect-padded conv used to keep its padded input under compile: 36,992 vs 34,816 bytes here)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
                        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    b_eager, b_comp = check_family(_frozen(copy.deepcopy(net)), x)
    assert b_eager == 0 and b_comp == 0  # a frozen conv needs nothing for dX; compiled as well
    check_family(net, x)


def test_pooling_and_activations():
    """Max pool, average and adaptive pooling with int and tuple output sizes, ReLU masks. Under compile the
    max pool Function hands Inductor int64 indices (see pooling.py), and Inductor's low-memory lowering keeps
    1-byte window offsets in their place: what eager keeps, 1-3-D."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.LeakyReLU(0.1),
                        nn.AvgPool2d(2), nn.AdaptiveAvgPool2d((3, 3)), nn.AdaptiveAvgPool2d(1))
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    check_family(_frozen(net), x)
    check_family(nn.Sequential(nn.MaxPool3d(2)), torch.randn(2, 4, 4, 8, 8, requires_grad=True))
    check_family(nn.Sequential(nn.MaxPool1d(3, 2)), torch.randn(2, 4, 33, requires_grad=True))


def test_batch_norm_eval_and_train():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.BatchNorm2d(8))
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    check_family(_frozen(copy.deepcopy(net)).eval(), x)
    norm_only = copy.deepcopy(net).requires_grad_(False)
    for m in (norm_only[1], norm_only[4]):
        m.requires_grad_(True)
    check_family(norm_only, x)


def test_norms_and_gated():
    """RMSNorm / LayerNorm / GroupNorm with frozen and trainable weights."""
    net = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
    x = torch.randn(4, 5, 16, requires_grad=True)
    check_family(_frozen(copy.deepcopy(net)), x)
    gn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4))
    check_family(gn, torch.randn(2, 3, 8, 8))


def test_lora_step():
    """A peft LoRA decoder block in bf16 with fp32 adapters: compiled keeps x once in bf16 per adapted input,
    as eager does (the partitioner used to keep fp32 copies of x for the adapters)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=128)
    base = peft.get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    ids = torch.randint(0, 128, (2, 16))

    def kept_lora(model, compiled):
        torch._dynamo.reset()
        run = torch.compile(model) if compiled else model
        run(input_ids=ids, labels=ids).loss.backward()
        with SavedTensors(exclude=[model]) as counter:
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return counter.bytes, loss

    b_eager, loss_e = kept_lora(slimgrad.convert(copy.deepcopy(base)), False)
    b_comp, loss_c = kept_lora(slimgrad.convert(copy.deepcopy(base)), True)
    assert_same(loss_c, loss_e, exact=False, rtol=2e-2, atol=2e-2, what="loss")
    assert b_comp <= RATIO * b_eager, f"compiled keeps {b_comp} bytes, eager {b_eager}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_dropout_keeps_a_bit_an_element_compiled(dtype):
    """peft LoRA with dropout, two layers reading one input: compiled, each adapter keeps its mask as 1 bit an
    element, as eager does (a bool mask, 8 bits, before; the partitioner then kept the fp32 dropped inputs, as
    compiled stock does: 33.8 KB against eager's 26.1 KB here, found by a compile sweep), and the step is compiled
    stock's bit for bit (the same native_dropout draw)."""
    peft = pytest.importorskip("peft")

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.v = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.q(x) * self.v(x)

    torch.manual_seed(0)
    base = peft.get_peft_model(Two().to(dtype), peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q", "v"],
                                                                 init_lora_weights=False))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step(model, compiled):
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True) if compiled else model
        torch.manual_seed(3)
        run(x).float().sum().backward()  # warm-up (and compile)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        with SavedTensors(exclude=[model]) as counter:
            out = run(x)
        out.float().sum().backward()
        return counter.bytes, out.detach(), [p.grad for p in model.parameters() if p.requires_grad]

    b_eager, _, _ = step(slimgrad.convert(copy.deepcopy(base)), False)
    b_comp, out_c, grads_c = step(slimgrad.convert(copy.deepcopy(base)), True)
    b_stock, out_s, grads_s = step(copy.deepcopy(base), True)
    assert b_comp <= b_eager < b_stock, (b_comp, b_eager, b_stock)
    assert_same(out_c, out_s, what="compiled output vs compiled stock")
    for gc, gs in zip(grads_c, grads_s, strict=True):
        assert_same(gc, gs, what="compiled grad vs compiled stock")
