"""Nothing a converted model allocates outlives the step: not after a backward, and not where a forward's graph is
dropped without one (a validation pass with grad on, an output turned into bytes, an ignored auxiliary output).

Counted from the profiler's allocation records (every allocation and free, C++ kernels' included): what a call made
and did not free by the end. Stock leaves nothing in these cases; neither may slimgrad. Found by a diffusers sweep
(2026-11-27): a converted ReLU whose consumer kept its output registered a learning hook on its node from a cell that
held that node, a cycle through C++ that Python's collector cannot see, so every dropped graph leaked with its saved
tensors (AutoencoderTiny, whose forward turns the latents into bytes: +614 KiB a step)."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import slimgrad
from slimgrad import csrc
from slimgrad.measure import _allocation_events


def live_after(fn) -> int:
    """Bytes that ``fn`` allocated and that are still allocated after it returned (and a collection)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        gc.collect()
    made = {}
    events = _allocation_events(prof.profiler.kineto_results.experimental_event_tree())
    for e in sorted(events, key=lambda e: e.start_time_ns):
        f = e.extra_fields
        if f.alloc_size > 0:
            made[f.ptr] = f.alloc_size
        else:
            made.pop(f.ptr, None)
    return sum(made.values())


def _cnn():
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.LeakyReLU(0.1), nn.Conv2d(8, 8, 1), nn.ReLU6(),
        nn.Dropout(0.2), nn.Conv2d(8, 8, 3, padding=1), nn.Hardtanh(), nn.GroupNorm(2, 8), nn.SiLU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.LayerNorm(128), nn.Linear(128, 5),
    )


CASES = {
    "all": lambda m: m,
    "input": lambda m: m.requires_grad_(False),
    "norms": lambda m: [p.requires_grad_(isinstance(mod, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)))
                        for mod in m.modules() for p in mod.parameters(recurse=False)] and m,
}


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("case", list(CASES))
def test_dropped_graphs_and_steps_leave_nothing(case, core):
    torch.manual_seed(0)
    stock = CASES[case](_cnn().train())
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 4, 16, 16)
    xr = x.clone().requires_grad_(case == "input")
    with contextlib.nullcontext() if core else csrc.disabled():
        for model in (stock, slim):
            def dropped(model=model):
                for _ in range(3):
                    model(xr).round().to(torch.uint8)  # a graph that gets no backward

            def step(model=model):
                model(xr).pow(2).sum().backward()
                for p in model.parameters():
                    p.grad = None
                xr.grad = None

            # the first calls (no step yet: masks kept), then steps (the ReLUs learn to keep their output where a
            # consumer keeps it), then dropped graphs again with what was learnt
            assert live_after(dropped) == 0, f"{'stock' if model is stock else 'slimgrad'}: a dropped graph leaked"
            assert live_after(step) == 0, "a step leaked"
            assert live_after(step) == 0, "a second step leaked"
            assert live_after(dropped) == 0, "a dropped graph leaked after steps"


def test_dropped_graphs_of_a_lora_language_model_leave_nothing():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    stock = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    slim = slimgrad.convert(stock, chunked_loss=True)
    ids = torch.randint(0, 64, (2, 8))

    def dropped():
        for _ in range(2):
            slim(input_ids=ids, labels=ids).loss.detach()
            slim(input_ids=ids).logits.argmax(-1)

    def step():
        slim(input_ids=ids, labels=ids).loss.backward()
        for p in slim.parameters():
            p.grad = None

    assert live_after(dropped) == 0
    assert live_after(step) == 0
    assert live_after(dropped) == 0
