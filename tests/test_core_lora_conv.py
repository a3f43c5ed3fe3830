"""LoRA on a convolution through the compiled core (csrc/lora_conv.cpp) against the Python Function (the core off)
and against peft's ops (stock): bitwise outputs and gradients for every dtype, requires-grad combination and input
layout, the same bytes saved, the same generator state after the call, and the path that ran."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests._triton_util import DEVICES
from tests._util import assert_same, laid_out
from torch import nn

from slimgrad import csrc
from slimgrad.functional.dropout import dropout_policy
from slimgrad.functional.lora_conv import ConvOptions, LoraConvAdapter, lora_conv
from slimgrad.kernels.registry import triton_interpreting
from slimgrad.measure import SavedTensors

R = 4
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_SPATIAL = {1: (13,), 2: (9, 7), 3: (5, 6, 4)}


@pytest.fixture(autouse=True)
def _need_core(request):
    if "triton" not in request.node.name and csrc.core() is None:
        pytest.skip("the compiled core is off or unavailable here")


def _param(shape, dtype, seed, rg=True):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    return nn.Parameter(t.to(dtype), requires_grad=rg)


class Case:
    """A frozen base convolution and ``n`` adapters; inputs made fresh (independent copies) per run."""

    def __init__(self, dtype, a_dtype, *, nd=2, layout="contiguous", p=0.0, rg=(True, True, True, True), bias=False,
                 n=1, groups=1, cast=True):
        self.nd, self.layout, self.cast = nd, layout, cast
        rg_x, rg_a, rg_b, rg_base_out = rg
        self.rg_x, self.rg_base_out = rg_x, rg_base_out
        k = (3,) * nd
        c_in, c_out = 4, 6
        self.base_w = _param((c_out, c_in // groups, *k), dtype, 1, rg=False)
        self.base_opts = ConvOptions((2,) * nd, (1,) * nd, (1,) * nd, groups)
        self.adapters = []
        for i in range(n):
            r = R + 2 * i  # (even: B's groups are the base's)
            A = _param((r, c_in, *k), a_dtype, 10 + i, rg_a)
            B = _param((c_out, r // groups, *(1,) * nd), a_dtype, 20 + i, rg_b)
            bb = _param((c_out,), a_dtype, 30 + i, rg_b) if bias else None
            self.adapters.append(LoraConvAdapter(A, B, ConvOptions((2,) * nd, (1,) * nd, (1,) * nd, 1),
                                                 ConvOptions((1,) * nd, (0,) * nd, (1,) * nd, groups),
                                                 0.5 + i, p, bb))
        self.x0 = torch.randn((2, c_in, *_SPATIAL[nd]), generator=torch.Generator().manual_seed(3)).to(dtype)

    def fresh(self):
        adapters = [ad._replace(A=copy.deepcopy(ad.A), B=copy.deepcopy(ad.B),
                                bias=copy.deepcopy(ad.bias)) for ad in self.adapters]
        x = laid_out(self.x0, self.layout)
        x = x.requires_grad_(self.rg_x) if self.layout == "sliced" else x.detach().requires_grad_(self.rg_x)
        return x, adapters

    def base(self, x):
        o = self.base_opts
        out = _CONV[self.nd](x, self.base_w, None, o.stride, o.padding, o.dilation, o.groups)
        if self.rg_base_out and not out.requires_grad:
            out = out.detach().requires_grad_()
        return out

    def run(self, path):
        """(output, x.grad, base_out.grad, parameter grads, saved bytes, rng state, grad_fn name)."""
        x, adapters = self.fresh()
        torch.manual_seed(7)
        with SavedTensors() as kept:
            base_out = self.base(x)
            if path == "stock":
                out = stock(x, base_out, adapters, self.cast)
            elif path == "core":
                out = lora_conv(x, base_out, adapters, cast_input=self.cast)
            else:
                with csrc.disabled():
                    out = lora_conv(x, base_out, adapters, cast_input=self.cast)
        state = torch.get_rng_state()
        name = out.grad_fn.name() if out.grad_fn is not None else ""
        if base_out.requires_grad:
            base_out.retain_grad()
        if out.requires_grad:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
            out.backward(g)
        grads = [t.grad for ad in adapters for t in (ad.A, ad.B, ad.bias) if t is not None]
        return out, x.grad, base_out.grad, grads, kept.bytes, state, name


def stock(x, base_out, adapters, cast):
    """peft's _ConvNd.forward on the adapters (x cast to their dtype, nn.Dropout, A, B, scaling, the sum)."""
    xa = x.to(adapters[0].A.dtype) if cast else x
    result = base_out
    for ad in adapters:
        dropped = F.dropout(xa, ad.dropout, True) if ad.dropout > 0 else xa
        a, b = ad.a, ad.b
        t = _CONV[x.dim() - 2](dropped, ad.A, None, a.stride, a.padding, a.dilation, a.groups)
        result = result + _CONV[x.dim() - 2](t, ad.B, ad.bias, b.stride, b.padding, b.dilation, b.groups) * ad.scaling
    return result.to(base_out.dtype)


def compare(case, *, exact_x_vs_stock=True):
    c, py, s = case.run("core"), case.run("python"), case.run("stock")
    assert "CppNode" in c[6] or not c[0].requires_grad, c[6]
    assert "CppNode" not in py[6]
    for k, what in ((0, "output"), (1, "x.grad"), (2, "base_out.grad")):
        assert_same(c[k], py[k], what=f"core vs python {what}")
    for a, b in zip(c[3], py[3], strict=True):
        assert_same(a, b, what="core vs python parameter grad")
    assert c[4] == py[4], ("saved bytes core vs python", c[4], py[4])
    assert torch.equal(c[5], py[5]) and torch.equal(c[5], s[5]), "generator state after the call"
    assert_same(c[0], s[0], what="output vs stock")
    assert_same(c[1], s[1], exact=exact_x_vs_stock, rtol=1e-2, atol=1e-2, what="x.grad vs stock")
    assert_same(c[2], s[2], what="base_out.grad vs stock")
    for a, b in zip(c[3], s[3], strict=True):
        assert_same(a, b, what="parameter grad vs stock")
    return c, py, s


CASTS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
_CAST_IDS = ["fp32", "bf16+fp32", "fp16+fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype,a_dtype", CASTS, ids=_CAST_IDS)
@pytest.mark.parametrize("rg", [r for r in itertools.product([False, True], repeat=4) if any(r)],
                         ids=lambda r: "".join("xabo"[i] if f else "-" for i, f in enumerate(r)))
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
def test_core_is_python_is_stock(dtype, a_dtype, rg, p):
    case = Case(dtype, a_dtype, p=p, rg=rg)
    compare(case)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
@pytest.mark.parametrize("dtype,a_dtype", CASTS[:2] + CASTS[3:4], ids=["fp32", "bf16+fp32", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_layouts(layout, dtype, a_dtype, p):
    compare(Case(dtype, a_dtype, layout=layout, p=p))


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_dims_groups_bias(nd, groups, bias):
    compare(Case(torch.bfloat16, torch.float32, nd=nd, groups=groups, bias=bias, p=0.1))


@pytest.mark.parametrize("dtype,a_dtype", CASTS[:2], ids=["fp32", "bf16+fp32"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_two_adapters(dtype, a_dtype, p):
    # two adapters' input gradients are summed in autograd's order (last first) by core and Python alike; stock's
    # engine may sum them otherwise: x.grad vs stock within a tolerance, the rest bitwise
    compare(Case(dtype, a_dtype, n=2, p=p, bias=True), exact_x_vs_stock=False)


def test_no_cast_and_no_grad():
    compare(Case(torch.bfloat16, torch.bfloat16, cast=False, p=0.2))
    case = Case(torch.float32, torch.float32, p=0.2, rg=(False, False, False, False))
    c, py, s = case.run("core"), case.run("python"), case.run("stock")
    assert_same(c[0], py[0], what="no grad: core vs python")
    assert_same(c[0], s[0], what="no grad: core vs stock")
    with torch.no_grad():
        compare(Case(torch.float32, torch.float32, p=0.2))


def test_seed_policy_and_autocast_run_python():
    case = Case(torch.float32, torch.float32, p=0.2)
    x, adapters = case.fresh()
    with dropout_policy("seed"):
        out = lora_conv(x, case.base(x), adapters)
    assert "CppNode" not in out.grad_fn.name()
    out = lora_conv(x, case.base(x), [ad._replace(dropout=0.0) for ad in adapters])
    assert "CppNode" in out.grad_fn.name()


def test_double_backward_refused_with_the_python_message():
    case = Case(torch.float64, torch.float64, p=0.2)
    messages = []
    for core in (True, False):
        x, adapters = case.fresh()
        with contextlib.nullcontext() if core else csrc.disabled():
            out = lora_conv(x, case.base(x), adapters)
        assert ("CppNode" in out.grad_fn.name()) == core
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward") as info:
            gx.sum().backward()
        messages.append(str(info.value))
    assert "LoraConvFunction" in messages[0] and messages[0] == messages[1]


# --- the "seed" policy's Triton kernel (CUDA's default policy; checked on CPU under TRITON_INTERPRET=1) -----------


def _seed_step(device, channels_last, compiled=False):
    """One LoRA-conv step with the seed policy: (output, dX, dA, dB), x's layout as asked."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    W = torch.randn(4, 3, 3, 3, device=device)
    A, B = torch.randn(2, 3, 3, 3, device=device) * 0.3, torch.randn(4, 2, 1, 1, device=device) * 0.3
    x, A, B = (t.clone().requires_grad_() for t in (x, A, B))
    g = torch.randn(2, 4, 6, 6, device=device)
    same, point = ConvOptions((1, 1), (1, 1), (1, 1), 1), ConvOptions((1, 1), (0, 0), (1, 1), 1)
    torch.manual_seed(5)
    out = lora_conv(x, F.conv2d(x, W, padding=1), [LoraConvAdapter(A, B, same, point, 2.0, 0.25)],
                    dropout_policy="seed")
    if compiled:
        from torch._dynamo import compiled_autograd

        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.backward(g)
    else:
        out.backward(g)
    return (out.detach(), x.grad, A.grad, B.grad), (x.detach(), W, A.detach(), B.detach(), g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_triton_seed_kernel_runs_and_its_mask_is_the_gradients(device, channels_last, monkeypatch):
    """The forward draws with the Triton kernel (no torch.Generator) in x's memory order, and backward applies the
    same mask: plain torch's output and gradients given that kernel's noise for the seed the Function drew."""
    from slimgrad import kernels
    from slimgrad.functional.dropout import _canonical, _inverse, _memory_order
    from slimgrad.kernels import dropout as dropout_kernels

    pytest.importorskip("triton")
    with kernels.preference("triton"):
        impl = dropout_kernels.choose_seed(torch.ones(1, device=device))
        assert impl.name == "triton"
        calls = []
        real = dropout_kernels.TorchDropoutSeed.noise
        # the torch reference (Philox in ~200 integer ops an element block) must not run
        monkeypatch.setattr(dropout_kernels.TorchDropoutSeed, "noise",
                            staticmethod(lambda *a: calls.append(1) or real(*a)))
        (out, gx, ga, gb), (x, W, A, B, g) = _seed_step(device, channels_last)
        assert not calls
        torch.manual_seed(5)
        seed = torch.empty(1, dtype=torch.int64, device=device).random_()[0]
        perm = _memory_order(x)
        noise = impl.forward(_canonical(torch.ones_like(x), perm), 0.25, seed, False)
        noise = noise if perm is None else noise.permute(_inverse(perm))
    assert 0 < int((noise == 0).sum()) < noise.numel()
    x, A, B = (t.clone().requires_grad_() for t in (x, A, B))
    ref = F.conv2d(x, W, padding=1) + F.conv2d(F.conv2d(x * noise, A, padding=1), B) * 2.0
    ref.backward(g)
    for a, b, name in zip((out, gx, ga, gb), (ref.detach(), x.grad, A.grad, B.grad), ("out", "dX", "dA", "dB")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_seed_kernel_under_compiled_autograd(device):
    """Compiled autograd over the eager forward: the traced backward runs the forward's Triton kernel by name (the
    registry answers the torch reference while tracing), in the same memory order: the eager backward's gradients."""
    from slimgrad import kernels

    pytest.importorskip("triton")
    with kernels.preference("triton"):
        eager, _ = _seed_step(device, True)
        compiled, _ = _seed_step(device, True, compiled=True)
    for a, b, name in zip(compiled, eager, ("out", "dX", "dA", "dB")):
        assert_same(a, b, what=name)


def test_triton_cases_under_interpreter():
    """The Triton cases above on CPU tensors, in a pytest subprocess started with ``TRITON_INTERPRET=1``."""
    if triton_interpreting():
        pytest.skip("this process already runs under the interpreter: the Triton cases run here directly")
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", SLIMGRAD_KERNELS="auto")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "triton and not interpreter",
           Path(__file__).relative_to(root).as_posix()]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    tail = (result.stdout[-6000:] + "\n" + result.stderr[-3000:]).strip()
    assert result.returncode == 0, tail
    summary = re.search(r"(\d+) passed", result.stdout)
    assert summary and int(summary.group(1)) >= 3, tail
    assert "skipped" not in result.stdout.splitlines()[-1], tail


peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize("dtype,a_dtype", CASTS[:3], ids=_CAST_IDS[:3])
def test_peft_model_core_is_python_is_peft(dtype, a_dtype):
    import slimgrad

    torch.manual_seed(0)
    stock_model = get_peft_model(_Net().to(dtype), LoraConfig(r=R, lora_alpha=8, target_modules=["conv"],
                                                              lora_dropout=0.1, init_lora_weights=False))
    for name, prm in stock_model.named_parameters():
        if "lora_" in name:
            prm.data = prm.data.to(a_dtype)
    slim = slimgrad.convert(copy.deepcopy(stock_model))
    x0 = torch.randn(2, 4, 9, 7, generator=torch.Generator().manual_seed(3)).to(dtype)

    def step(model, core=True):
        x = x0.clone().requires_grad_()
        for prm in model.parameters():
            prm.grad = None
        torch.manual_seed(7)
        with SavedTensors(exclude=[model]) as kept:
            if core:
                out = model(x)
            else:
                with csrc.disabled():
                    out = model(x)
        name = out.grad_fn.name()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
        return out, x.grad, [prm.grad for prm in model.parameters()], kept.bytes, name

    s, c, py = step(stock_model), step(slim), step(slim, core=False)
    assert "CppNode" in c[4] and "CppNode" not in py[4]
    assert c[3] == py[3] < s[3]
    for k in (0, 1):
        assert_same(c[k], py[k], what="core vs python")
        assert_same(c[k], s[k], what="core vs peft")
    for a, b, d in zip(c[2], py[2], s[2], strict=True):
        assert_same(a, b, what="core vs python grad")
        assert_same(a, d, what="core vs peft grad")
