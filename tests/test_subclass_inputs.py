"""Tensor subclasses as inputs: a ``__torch_function__`` subclass, a jagged NestedTensor, a DTensor.

The mask families' kernels read plain storage: handed a subclass they returned plain tensors (the subclass's type
dropped), crashed on wrappers without storage ("data is not allocated yet") or segfaulted (a NestedTensor into the
clamp family's C++ kernel); a ``__torch_function__`` subclass's wrapped results inside a Function made its output a
view, so an in-place op after it raised. Such an input runs stock's op (``_common.foreign_input``): stock's numbers,
type and bytes. Found by the subclass sweep of 2026-11-28 (subclass44); compared with stock on independent copies.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import slimgrad


class Tagged(torch.Tensor):
    """A pass-through ``__torch_function__`` subclass (what tagging and tracing libraries wrap tensors in)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


MASKS = {
    "relu": nn.ReLU, "leaky": lambda: nn.LeakyReLU(0.1), "dropout": lambda: nn.Dropout(0.3),
    "maxpool": lambda: nn.MaxPool2d(2), "relu6": nn.ReLU6, "hardsigmoid": nn.Hardsigmoid,
}
FROZEN = {
    "conv": lambda: nn.Conv2d(4, 4, 3).requires_grad_(False),
    "conv_t": lambda: nn.ConvTranspose2d(4, 4, 3).requires_grad_(False),
    "avgpool": lambda: nn.AvgPool2d(2),
    "relu6": nn.ReLU6,
}


def _run(model, x0, mode, inplace_after=False):
    x = x0.clone().as_subclass(Tagged).requires_grad_()
    torch.manual_seed(1)
    if mode == "enabled":
        with slimgrad.enabled():
            y = model(x)
            if inplace_after:
                y.mul_(2)
    else:
        y = model(x)
        if inplace_after:
            y.mul_(2)
    y.sum().backward()
    return y, x.grad


def _stock_and_slimgrad(make, mode, inplace_after=False):
    """(stock's output and input gradient, slimgrad's) on independent copies, x a Tagged tensor."""
    torch.manual_seed(0)
    stock = make()
    slim = slimgrad.convert(copy.deepcopy(stock)) if mode == "convert" else copy.deepcopy(stock)
    x0 = torch.randn(2, 4, 6, 6)
    return _run(stock, x0, "stock", inplace_after), _run(slim, x0, mode, inplace_after)


@pytest.mark.parametrize("mode", ["convert", "enabled"])
@pytest.mark.parametrize("name", list(MASKS))
def test_a_torch_function_subclass_keeps_its_type_and_stocks_numbers(name, mode):
    (ys, gs), (yq, gq) = _stock_and_slimgrad(MASKS[name], mode)
    assert type(yq) is type(ys) is Tagged
    assert torch.equal(yq.as_subclass(torch.Tensor), ys.as_subclass(torch.Tensor))
    assert torch.equal(gq.as_subclass(torch.Tensor), gs.as_subclass(torch.Tensor))


@pytest.mark.parametrize("mode", ["convert", "enabled"])
@pytest.mark.parametrize("name", list(FROZEN))
def test_an_in_place_op_after_a_layer_on_a_torch_function_subclass(name, mode):
    """raised "Output 0 of _ConvFunction is a view and is being modified inplace" where stock runs."""
    (_, gs), (_, gq) = _stock_and_slimgrad(FROZEN[name], mode, inplace_after=True)
    assert torch.equal(gq.as_subclass(torch.Tensor), gs.as_subclass(torch.Tensor))


def _jagged():
    g = torch.Generator().manual_seed(0)
    return torch.nested.nested_tensor([torch.randn(n, 8, generator=g) for n in (3, 5, 2)], layout=torch.jagged,
                                      requires_grad=True)


@pytest.mark.parametrize("name", ["relu", "relu6", "hardsigmoid", "dropout", "relu_inplace"])
def test_a_jagged_nested_tensor_runs_as_stock(name):
    """ReLU raised, Dropout raised, ReLU6 / Hardsigmoid / an in-place ReLU after a Linear killed the process."""
    make = {"relu": nn.ReLU, "relu6": nn.ReLU6, "hardsigmoid": nn.Hardsigmoid, "dropout": lambda: nn.Dropout(0.3),
            "relu_inplace": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))}[name]
    torch.manual_seed(0)
    stock = make()
    slim = slimgrad.convert(copy.deepcopy(stock))
    outs = []
    for model in (stock, slim):
        x = _jagged()
        torch.manual_seed(1)
        y = model(x)
        y.values().sum().backward()
        outs.append((y.values().detach(), x.grad.values()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_estimate_refuses_a_jagged_input_by_name():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="estimate: an input is a nested"):
        slimgrad.estimate(model, _jagged())


_DTENSOR = textwrap.dedent("""
    import copy, os, sys, warnings
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    import slimgrad
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    bad = []

    def replicated(module):
        def fn(name, mod, me):
            for k, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(k, nn.Parameter(distribute_tensor(p.detach(), me, [Replicate()]),
                                                       requires_grad=p.requires_grad))
        return distribute_module(module, mesh, fn)

    def step(model, x0, placement):
        torch.manual_seed(1)
        x = distribute_tensor(x0.clone(), mesh, [placement]).requires_grad_()
        y = model(x)
        y.sum().backward()
        return y.full_tensor(), x.grad.full_tensor()

    cases = [("relu", nn.ReLU, (4, 6)), ("dropout", lambda: nn.Dropout(0.3), (4, 6)),
             ("maxpool", lambda: nn.MaxPool2d(2), (2, 3, 4, 4))]
    try:
        from peft import LoraConfig, get_peft_model

        class Lin(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(6, 6)

            def forward(self, x):
                return self.lin(x)

        class Cnv(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(4, 6, 3, padding=1)

            def forward(self, x):
                return self.conv(x)

        def lora(base, target, dropout, train):
            def make():
                torch.manual_seed(0)
                m = get_peft_model(base(), LoraConfig(r=2, target_modules=[target], lora_dropout=dropout,
                                                      init_lora_weights="gaussian"))
                for p in m.parameters():
                    p.requires_grad_(train and p.requires_grad)
                return replicated(m)
            return make

        cases += [("lora_linear_dropout", lora(Lin, "lin", 0.1, True), (4, 6)),
                  ("lora_conv_input_only", lora(Cnv, "conv", 0.0, False), (2, 4, 6, 6))]
    except ImportError:
        pass
    for name, make, shape in cases:
        for placement in (Replicate(), Shard(0)):
            torch.manual_seed(0)
            stock = make()
            slim = slimgrad.convert(copy.deepcopy(stock))
            x0 = torch.randn(shape)
            try:
                ys, gs = step(stock, x0, placement)
                yq, gq = step(slim, x0, placement)
                if not (torch.equal(ys, yq) and torch.equal(gs, gq)):
                    bad.append(f"{name} {placement}: differs")
            except Exception as e:
                bad.append(f"{name} {placement}: {type(e).__name__}: {e}")
    print("BAD", bad)
    dist.destroy_process_group()
    os._exit(0)
""")


def test_a_dtensor_input_runs_as_stock(tmp_path):
    """A DTensor input (one-process gloo mesh, Replicate and Shard(0)) into ReLU, Dropout, MaxPool2d and peft LoRA:
    stock runs; slimgrad raised "data is not allocated yet" (the kernels) or an AssertionError (DTensor's conv
    backward handed a plain tensor)."""
    port = str(29700 + os.getpid() % 200)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _DTENSOR, port], env=env, capture_output=True, text=True,
                          timeout=300)
    assert "BAD []" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])


@pytest.mark.parametrize("frozen", [True, False])
def test_an_in_place_op_after_a_conv_with_a_torch_function_subclass_weight(frozen):
    torch.manual_seed(0)
    stock = nn.Conv2d(4, 4, 3)
    stock.weight = nn.Parameter(stock.weight.detach().as_subclass(Tagged), requires_grad=not frozen)
    slim = slimgrad.convert(nn.Conv2d(4, 4, 3))  # (deepcopy refuses a Tagged parameter: stock's limit)
    slim.weight = nn.Parameter(stock.weight.detach().clone().as_subclass(Tagged), requires_grad=not frozen)
    slim.bias = nn.Parameter(stock.bias.detach().clone())
    grads = []
    for model in (stock, slim):
        x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = model(x)
        y.mul_(2)
        y.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0].as_subclass(torch.Tensor), grads[1].as_subclass(torch.Tensor))


def test_a_subclass_input_says_once_that_it_runs_stock():
    from slimgrad._notices import SlimgradWarning, reset_warned

    reset_warned()
    model = slimgrad.convert(nn.Sequential(nn.ReLU(), nn.Dropout(0.3)))
    with pytest.warns(SlimgradWarning, match="a Tagged .*stock's op runs there"):
        model(torch.randn(4, 6).as_subclass(Tagged).requires_grad_())
