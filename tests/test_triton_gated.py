"""Triton gated activation ``act(gate) * up`` against slimgrad's torch path (bitwise stock, test_gated.py), on
CPU under the interpreter and compiled on CUDA: outputs and requested gradients no further from the fp64
result than the torch path's plus the dtype's tolerance (_triton_util.ULPS), unrequested gradients never
written, saved bytes gate (+ up when gate needs a gradient)."""

from __future__ import annotations

import pytest
import torch
from tests._triton_util import DEVICES, AllocationLog, assert_no_worse, torch_path, triton_path
from tests._util import grad_combos

from slimgrad import kernels
from slimgrad.functional.gated import ACTIVATIONS, gated_activation
from slimgrad.measure import saved_bytes

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
    up = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return gate, up, g


def _run(kind, gate, up, g, rg):
    a, b = gate.clone().requires_grad_(rg[0]), up.clone().requires_grad_(rg[1])
    out = gated_activation(a, b, kind)
    if out.requires_grad:
        out.backward(g.to(out.dtype))
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("rg", grad_combos(2))
def test_gated_matches_torch_path(device, dtype, kind, rg):
    gate, up, g = _inputs((3, 1000 + 7), dtype, device)  # more than one block, a ragged tail
    with torch_path():
        ref = _run(kind, gate, up, g, rg)
        exact = _run(kind, gate.double(), up.double(), g.double(), rg)
    with triton_path(device):
        got = _run(kind, gate, up, g, rg)
    for what, a, b, e in zip(("out", "d_gate", "d_up"), got, ref, exact):
        assert_no_worse(a, b, e, what=f"{kind} {dtype} rg={rg} {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_gated_non_contiguous(device):
    base = torch.randn(2, 33, 8, device=device)
    gate, up = base[..., :4].transpose(1, 2), base[..., 4:].transpose(1, 2)
    g = torch.randn(gate.shape, device=device)
    with torch_path():
        ref = _run("silu", gate, up, g, (True, True))
        exact = _run("silu", gate.double(), up.double(), g.double(), (True, True))
    with triton_path(device):
        got = _run("silu", gate, up, g, (True, True))
    for what, a, b, e in zip(("out", "d_gate", "d_up"), got, ref, exact):
        assert_no_worse(a, b, e, what=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rg", grad_combos(2))
def test_gated_saved_bytes_and_outputs(device, rg):
    """gate when any gradient is requested, up too when gate's is; backward writes only what is requested."""
    gate, up, g = _inputs((4, 33), torch.bfloat16, device)
    gate.requires_grad_(rg[0])
    up.requires_grad_(rg[1])
    nbytes = gate.numel() * 2
    expected = (nbytes if any(rg) else 0) + (nbytes if rg[0] else 0)
    with triton_path(device):
        assert kernels.choose("gated_activation", gate).backend == "triton"
        assert saved_bytes(gated_activation, gate, up, "silu") == expected
        if any(rg):
            out = gated_activation(gate, up, "silu")
            with AllocationLog() as log:
                out.backward(g)
            created = [c for c in log.created if c == (tuple(gate.shape), torch.bfloat16)]
            assert len(created) == int(rg[0]) + int(rg[1]), log.created


@pytest.mark.parametrize("device", DEVICES)
def test_gated_keeps_noted_inputs_narrower_on_the_triton_path(device):
    """gate and up that their producer noted as bf16 values in fp32 (bitsandbytes' 4-bit output in QLoRA) are kept
    in bf16 and widened for the kernel's backward: the same results as without the note, half the bytes."""
    from slimgrad.functional import _common

    gen = torch.Generator().manual_seed(3)
    gate0 = (torch.randn(3, 1007, generator=gen) * 3).bfloat16().float().to(device)
    up0 = torch.randn(3, 1007, generator=gen).bfloat16().float().to(device)
    g = torch.randn(3, 1007, generator=gen).to(device)
    results = []
    for note in (False, True):
        a, b = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        ga, gb = a * 1, b * 1
        if note:
            _common.note_exactly_narrower(ga, torch.bfloat16)
            _common.note_exactly_narrower(gb, torch.bfloat16)
        with triton_path(device):
            kept = saved_bytes(lambda x, y: gated_activation(x, y, "silu"), ga, gb)
            out = gated_activation(ga, gb, "silu")
            out.backward(g)
        results.append((kept, out.detach(), a.grad, b.grad))
    assert results[1][0] == results[0][0] // 2 == 3 * 1007 * 2 * 2
    for x, y in zip(results[0][1:], results[1][1:]):
        assert torch.equal(x, y)
