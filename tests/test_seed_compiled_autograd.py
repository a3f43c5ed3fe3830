"""The "seed" dropout policy regenerates, in backward, the very mask its forward applied: also when compiled
autograd traces that backward over an eager forward, and whatever the input's layout (issue 22, exactness).

Why these cases: while torch.compile traces, the kernel registry answers with the torch reference (a
``torch.Generator`` mask, :func:`slimgrad.kernels.registry.choose_or_reference`), while an eager forward on CUDA
drew Triton's counter-based mask: dropout's and LoRA's traced backward used another mask than the forward (found
on CPU with the Triton kernel under the interpreter: the gradients differed). And LoRA drew its forward noise in
x's memory order (``empty_like(x)``) but rebuilt it contiguous in backward: a transposed or channels-last x got a
gradient through another mask, eager as well.

The Triton cases run on CPU tensors in a process started with ``TRITON_INTERPRET=1`` (this file starts one:
``test_triton_cases_under_interpreter``) and compiled on CUDA; the torch-reference and layout cases run anywhere.
Each compares with an independent computation: the compiled-autograd gradient with the eager backward's, and the
layout cases with plain torch ops given the mask drawn from the seed the Function draws.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests._triton_util import DEVICES
from tests._util import assert_same

from slimgrad import csrc, kernels
from slimgrad.functional.dropout import dropout, dropout_policy
from slimgrad.functional.lora import LoraAdapter, lora_linear
from slimgrad.functional.lora_conv import ConvOptions, LoraConvAdapter, lora_conv
from slimgrad.kernels import dropout as dropout_kernels
from slimgrad.kernels.registry import triton_interpreting

P = 0.25
_SAME = ConvOptions((1, 1), (1, 1), (1, 1), 1)
_POINT = ConvOptions((1, 1), (0, 0), (1, 1), 1)


class _Graphs:
    """A torch.compile backend that runs each graph eagerly and counts them (a graph break makes two)."""

    def __init__(self):
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


def _backward(out, grad, compiled, backend="eager"):
    """``out.backward(grad)``, eager or traced by compiled autograd; the number of graphs compiled."""
    if not compiled:
        out.backward(grad)
        return 0
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    graphs = _Graphs() if backend == "eager" else None
    with compiled_autograd._enable(torch.compile(backend=graphs or backend)):
        out.backward(grad)
    return graphs.count if graphs else 0


def _dropout_step(device, dtype, compiled, backend="eager", shape=(5, 7, 9), transpose=False):
    torch.manual_seed(0)
    x = (torch.rand(shape, device=device) + 0.5).to(dtype)
    if transpose:
        x = x.transpose(0, 2)
    x.requires_grad_()
    g = (torch.rand(x.shape, device=device) + 0.5).to(dtype)
    torch.manual_seed(3)
    out = dropout(x * 1.0, P, policy="seed")
    graphs = _backward(out, g, compiled, backend)
    return out.detach(), x.grad, graphs


def _lora_step(device, compiled, need=(True, True, True), transpose=False):
    torch.manual_seed(0)
    x = torch.randn(6, 2, 33, device=device)
    x = x.transpose(0, 1) if transpose else x.reshape(2, 6, 33)
    W = torch.randn(5, 33, device=device)
    A, B = torch.randn(4, 33, device=device) * 0.3, torch.randn(5, 4, device=device) * 0.3
    leaves = [t.clone().requires_grad_(q) for t, q in zip((x, A, B), need)]
    g = torch.randn(2, 6, 5, device=device)
    torch.manual_seed(5)
    with csrc.disabled():  # the Python Function, whose backward is traced here (the core's C++ node: a graph break)
        out = lora_linear(leaves[0], W, None, [LoraAdapter(leaves[1], leaves[2], 2.0, P)])
    graphs = _backward(out, g, compiled)
    return (out.detach(), *(t.grad for t in leaves)), graphs


def _lora_conv_step(device, compiled, channels_last=False):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    W = torch.randn(4, 3, 3, 3, device=device)
    A, B = torch.randn(2, 3, 3, 3, device=device) * 0.3, torch.randn(4, 2, 1, 1, device=device) * 0.3
    x, A, B = (t.clone().requires_grad_() for t in (x, A, B))
    g = torch.randn(2, 4, 6, 6, device=device)
    base = F.conv2d(x, W, padding=1)
    torch.manual_seed(5)
    out = lora_conv(x, base, [LoraConvAdapter(A, B, _SAME, _POINT, 2.0, P)])
    graphs = _backward(out, g, compiled)
    return (out.detach(), x.grad, A.grad, B.grad), graphs


def _assert_all_same(compiled, eager, names=("output", "dX", "dA", "dB")):
    """Bitwise the eager step's values; the traced backward in one graph (no break)."""
    (compiled, graphs), (eager, _) = compiled, eager
    for c, e, name in zip(compiled, eager, names):
        assert_same(c, e, what=name)
    assert graphs == 1


# --- the forward's kernel under compiled autograd --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dropout_compiled_autograd_uses_forwards_mask(device, dtype):
    """Eager forward through Triton's kernel; the gradient under compiled autograd is the eager backward's (the
    torch reference's mask gave other zeros), in one graph (no break for the reference's ``.item()``)."""
    pytest.importorskip("triton")
    with kernels.preference("triton"):
        assert kernels.choose(dropout_kernels.SEED, torch.ones(1, device=device, dtype=dtype)).backend == "triton"
        out, gx, _ = _dropout_step(device, dtype, compiled=False)
        out_c, gx_c, graphs = _dropout_step(device, dtype, compiled=True)
    assert_same(out_c, out, what="output")
    assert 0 < int((out == 0).sum()) < out.numel()
    assert_same(gx_c, gx, what="grad (compiled autograd vs eager backward)")
    assert graphs == 1


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_triton_lora_compiled_autograd_uses_forwards_mask(device):
    """LoRA's adapters' dropout through Triton's kernel: dX and dA under compiled autograd are the eager
    backward's (the traced backward asked the registry, got the torch reference and another mask)."""
    pytest.importorskip("triton")
    with kernels.preference("triton"), dropout_policy("seed"):
        eager = _lora_step(device, compiled=False)
        compiled = _lora_step(device, compiled=True)
    _assert_all_same(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_triton_lora_conv_compiled_autograd_uses_forwards_mask(device):
    """LoRA on convolutions draws its seeded noise with the torch reference in forward and backward, also traced:
    the same gradients under compiled autograd (checked beside LoRA's under the Triton preference)."""
    pytest.importorskip("triton")
    with kernels.preference("triton"), dropout_policy("seed"):
        eager = _lora_conv_step(device, compiled=False)
        compiled = _lora_conv_step(device, compiled=True)
    _assert_all_same(compiled, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_dropout_double_backward(device):
    """Double backward through the seed policy's Triton kernel: the gradient stays differentiable in the incoming
    gradient (the kernel's result had no graph: create_graph silently gave a constant), ``d(gx·v)/dg = v·noise``."""
    pytest.importorskip("triton")
    with kernels.preference("triton"):
        _double_backward_check(device)


@pytest.mark.slow
def test_triton_cases_under_interpreter():
    """The Triton cases above on CPU tensors, in a pytest subprocess started with ``TRITON_INTERPRET=1`` (triton
    must be imported under it: tests/_triton_util.py)."""
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
    assert summary and int(summary.group(1)) >= 5, tail
    assert "skipped" not in result.stdout.splitlines()[-1], tail


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "transposed"])
def test_torch_reference_dropout_compiled_autograd(backend, transpose):
    """The torch reference (CPU, the "torch" preference) under compiled autograd: the eager backward's gradient,
    in one graph (the seed is read inside the opaque op, not by a traced ``.item()``); aot_eager traces the op's
    fake implementation."""
    with kernels.preference("torch"):
        out, gx, _ = _dropout_step("cpu", torch.float32, compiled=False, transpose=transpose)
        out_c, gx_c, graphs = _dropout_step("cpu", torch.float32, compiled=True, backend=backend,
                                            transpose=transpose)
    assert_same(out_c, out, what="output")
    assert_same(gx_c, gx, what="grad")
    assert backend != "eager" or graphs == 1


@pytest.mark.slow
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_torch_reference_lora_compiled_autograd(permuted):
    """LoRA (a transposed x when permuted) and LoRA on convolutions (channels-last) with the torch reference:
    compiled autograd's gradients are the eager backward's, in one graph."""
    with kernels.preference("torch"), dropout_policy("seed"):
        _assert_all_same(_lora_step("cpu", compiled=True, transpose=permuted),
                         _lora_step("cpu", compiled=False, transpose=permuted))
        _assert_all_same(_lora_conv_step("cpu", compiled=True, channels_last=permuted),
                         _lora_conv_step("cpu", compiled=False, channels_last=permuted))


def _double_backward_check(device):
    torch.manual_seed(0)
    x = (torch.rand(4, 9, device=device) + 0.5).requires_grad_()
    g = (torch.rand(4, 9, device=device) + 0.5).requires_grad_()
    v = torch.rand(4, 9, device=device) + 0.5
    out = dropout(x * 1.0, P, policy="seed")
    (gx,) = torch.autograd.grad(out, x, g, create_graph=True)
    assert gx.requires_grad
    noise = (out.detach() != 0) * dropout_kernels.noise_scale(P, torch.float32)  # x has no zeros
    assert_same(gx.detach(), g.detach() * noise, what="grad")
    (gg,) = torch.autograd.grad(gx, g, v)
    assert_same(gg, v * noise, what="double backward")


def test_torch_reference_dropout_double_backward():
    with kernels.preference("torch"):
        _double_backward_check("cpu")


# --- the forward's mask whatever x's layout ----------------------------------------------------------------------


def _reference_noise(shape, seed, dtype=torch.float32):
    """The "seed" policy's noise for ``seed``: Philox on the elements' row-major index (``philox_keep``, checked
    against Triton's ``tl.rand`` and Philox's known answer in tests/test_dropout_philox.py and test_triton_masks.py),
    scaled by stock's rounded 1 / (1 - p)."""
    keep = dropout_kernels.philox_keep(tuple(shape), P, torch.as_tensor(seed, dtype=torch.int64))
    return keep.to(dtype) * dropout_kernels.noise_scale(P, dtype)


def _function_seed():
    """The seed the Function draws after ``manual_seed(5)``: the first from the default generator."""
    torch.manual_seed(5)
    return torch.empty(1, dtype=torch.int64).random_()[0]


@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, True, False)],
                         ids=["all", "x-only", "A-only"])
@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "transposed"])
def test_lora_seed_mask_whatever_x_layout(need, transpose):
    """LoRA's seed policy (torch reference): output and gradients are plain torch's given the seed's mask, for a
    transposed x too (its forward drew the noise in x's memory order, backward in row-major order)."""
    with kernels.preference("torch"), dropout_policy("seed"):
        (out, *grads), _ = _lora_step("cpu", compiled=False, need=need, transpose=transpose)
    torch.manual_seed(0)
    x = torch.randn(6, 2, 33)
    x = x.transpose(0, 1) if transpose else x.reshape(2, 6, 33)
    W = torch.randn(5, 33)
    A, B = torch.randn(4, 33) * 0.3, torch.randn(5, 4) * 0.3
    leaves = [t.clone().requires_grad_(q) for t, q in zip((x, A, B), need)]
    g = torch.randn(2, 6, 5)
    noise = _reference_noise(x.shape, _function_seed())
    ref = leaves[0] @ W.t() + ((leaves[0] * noise) @ leaves[1].t()) @ leaves[2].t() * 2.0
    ref.backward(g)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for a, b, name in zip(grads, leaves, ("dX", "dA", "dB")):
        if b.grad is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_lora_conv_seed_mask_whatever_x_layout(channels_last):
    """LoRA on convolutions, seed policy: plain torch's output and gradients given the seed's mask, for a
    channels-last x too (dX and dA used another mask before), whose mask follows its memory order."""
    with dropout_policy("seed"):
        (out, gx, ga, gb), _ = _lora_conv_step("cpu", compiled=False, channels_last=channels_last)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    W = torch.randn(4, 3, 3, 3)
    A, B = torch.randn(2, 3, 3, 3) * 0.3, torch.randn(4, 2, 1, 1) * 0.3
    x, A, B = (t.clone().requires_grad_() for t in (x, A, B))
    g = torch.randn(2, 4, 6, 6)
    # the mask of x's elements in memory order (the seed kernels read a channels-last x as it lies, on every backend)
    noise = (_reference_noise((2, 6, 6, 3), _function_seed()).permute(0, 3, 1, 2) if channels_last
             else _reference_noise(x.shape, _function_seed()))
    ref = F.conv2d(x, W, padding=1) + F.conv2d(F.conv2d(x * noise, A, padding=1), B) * 2.0
    ref.backward(g)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for a, b, name in zip((gx, ga, gb), (x.grad, A.grad, B.grad), ("dX", "dA", "dB")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --- the opaque op ----------------------------------------------------------------------------------------------


def test_traced_seed_op_registrations():
    """The op's fake and autograd registrations agree with its kernel (torch.library.opcheck), and its value is
    the torch reference's ``t * noise`` for the seed."""
    t = torch.rand(3, 17) + 0.5
    seed = torch.tensor(1234)
    expected = t * _reference_noise(t.shape, 1234)
    assert_same(dropout_kernels.traced_seed_apply(t, P, seed, "torch"), expected, what="op value")
    assert_same(dropout_kernels.traced_seed_apply(t, P, seed, ""), expected, what="op value, registry's kernel")
    torch.library.opcheck(torch.ops.slimgrad.dropout_seed_apply.default, (t.requires_grad_(), P, seed, "torch"))


def test_traced_seed_op_unknown_kernel_is_a_clear_error():
    with pytest.raises(RuntimeError, match="dropout_seed kernel 'nope'"):
        dropout_kernels.traced_seed_apply(torch.ones(4), P, torch.tensor(1), "nope")
