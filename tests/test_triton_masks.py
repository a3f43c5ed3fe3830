"""Triton ``relu_mask`` and ``dropout_seed`` kernels (contracts in slimgrad/kernels/relu_mask.py and
dropout.py), on CPU under the interpreter and compiled on CUDA.

relu_mask: output, packed mask and gradient bitwise the torch reference's (special values, odd sizes, in
place), that is stock's on CUDA; under the interpreter bf16 leaky_relu may be one bf16 ulp off (its fp32 ->
bf16 cast truncates), and relu maps -0.0 to +0.0 as CUDA's stock kernel does (CPU's keeps -0.0).

dropout_seed: the mask is a pure function of the device seed (backward equals forward's mask, manual_seed
reproduces it, checkpoint recomputation regenerates it), drops about p, scales by stock's rounded 1/(1-p),
keeps 8 bytes; LoRA dropout through the kernel matches a plain-torch reference given the same mask."""

from __future__ import annotations

import pytest
import torch
from tests._triton_util import DEVICES, triton_path
from tests._util import assert_same

from slimgrad import kernels
from slimgrad.functional.dropout import dropout
from slimgrad.functional.lora import LoraAdapter, lora_linear
from slimgrad.kernels.dropout import noise_scale
from slimgrad.kernels.relu_mask import TORCH_IMPL
from slimgrad.measure import saved_bytes

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT = {4: torch.int32, 2: torch.int16}


def _bits(t):
    return t.view(_INT[t.element_size()])


def _special(n, dtype, device):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    specials = torch.tensor([float("nan"), -0.0, 0.0, float("-inf"), float("inf"), -1e-30, 1e-30]).to(dtype)
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    return x.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slope", [None, 0.01, 0.2])
@pytest.mark.parametrize("n", [1, 8, 9, 1037])
def test_relu_mask_matches_reference(device, dtype, slope, n):
    x = _special(n, dtype, device)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    with triton_path(device):
        impl = kernels.choose("relu_mask", x)
        assert impl.backend == "triton"
        out, packed = impl.forward(x.clone(), slope, False)
        grad_in = impl.backward(g, packed, slope)
        x_in = x.clone()
        out_in, packed_in = impl.forward(x_in, slope, True)
    ref_out, ref_packed = TORCH_IMPL.forward(x.clone(), slope, False)
    ref_grad = TORCH_IMPL.backward(g.cpu(), ref_packed.cpu(), slope).to(device)
    assert out_in is x_in
    assert torch.equal(packed, ref_packed) and torch.equal(packed_in, ref_packed)
    assert packed.shape == ((n + 7) // 8,) and packed.dtype == torch.uint8
    if slope is not None and dtype == torch.bfloat16 and device == "cpu":
        # The interpreter truncates fp32 -> bf16: the slope branch may be one bf16 ulp off.
        for a, b in ((out, ref_out), (out_in, ref_out), (grad_in, ref_grad)):
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=0, equal_nan=True)
        return
    if slope is None and device == "cpu":
        # The kernel follows CUDA's relu (-0.0 -> +0.0); CPU's keeps -0.0: equal values, bitwise elsewhere.
        neg_zero = (x == 0) & torch.signbit(x)
        for a in (out, out_in):
            assert torch.equal(a[neg_zero], torch.zeros_like(a[neg_zero])) and not torch.signbit(a[neg_zero]).any()
            a[neg_zero] = ref_out[neg_zero]
    for what, a, b in (("out", out, ref_out), ("in-place out", out_in, ref_out), ("grad", grad_in, ref_grad)):
        assert torch.equal(_bits(a), _bits(b)), f"{what} not bitwise the reference's"


@pytest.mark.parametrize("device", DEVICES)
def test_relu_module_through_triton_matches_stock(device):
    from slimgrad.functional.activation import relu

    x = torch.randn(3, 5, 7, device=device)
    xs, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 5, 7, device=device)
    torch.relu(xs).backward(g)
    with triton_path(device):
        assert saved_bytes(relu, xk) == (x.numel() + 7) // 8
        relu(xk).backward(g)
    assert_same(xk.grad, xs.grad, what="relu input grad")


def _seed_run(x, p, g, device, seed=0, checkpoint=False):
    xx = x.clone().requires_grad_()
    torch.manual_seed(seed)
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as ckpt

        out = ckpt(lambda t: dropout(t, p, policy="seed") * 1.0, xx, use_reentrant=False)
    else:
        out = dropout(xx, p, policy="seed")
    out.backward(g)
    return out.detach(), xx.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_seed_kernel(device, dtype):
    p, n = 0.3, 4099
    x = (torch.rand(n, generator=torch.Generator().manual_seed(0)) + 0.5).to(device=device, dtype=dtype)  # no zeros
    g = (torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5).to(device=device, dtype=dtype)
    with triton_path(device):
        assert kernels.choose("dropout_seed", x).backend == "triton"
        out, gx = _seed_run(x, p, g, device)
        out2, gx2 = _seed_run(x, p, g, device)  # manual_seed reproduces the mask
        out3, _ = _seed_run(x, p, g, device, seed=1)  # another seed, another mask
        out_c, gx_c = _seed_run(x, p, g, device, checkpoint=True)  # recomputation regenerates it
        xx = x.clone().requires_grad_()
        assert saved_bytes(lambda t: dropout(t, p, policy="seed"), xx) == 8  # the int64 seed, nothing else
    kept = out != 0
    assert torch.equal(gx != 0, kept), "backward regenerated another mask than forward's"
    assert torch.equal(out, out2) and torch.equal(gx, gx2)
    assert not torch.equal(out, out3)
    assert torch.equal(out_c, out) and torch.equal(gx_c, gx)
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) < 4 * (p * (1 - p) / n) ** 0.5, frac  # four standard deviations
    scale = noise_scale(p, dtype)
    expected = (x.float() * scale).to(dtype)  # one fp32 product rounded once
    if device == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        torch.testing.assert_close(out[kept], expected[kept], rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(out[kept], expected[kept])
        assert torch.equal(gx[kept], (g.float() * scale).to(dtype)[kept])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rg", [(True, True, True), (False, True, False), (True, False, False)])
def test_lora_dropout_through_kernel(device, rg):
    """LoRA's dropout under the seed policy uses the kernel: same mask in forward and backward, equal to the
    mask ``keep_mask`` reports for the seed the Function draws, so a plain-torch reference with that mask
    gives the same output and gradients."""
    from slimgrad.functional.dropout import dropout_policy

    torch.manual_seed(0)
    rows, d_in, d_out, r, p = 6, 33, 5, 4, 0.25
    x = torch.randn(rows, d_in, device=device)
    W = torch.randn(d_out, d_in, device=device)
    A, B = torch.randn(r, d_in, device=device) * 0.3, torch.randn(d_out, r, device=device) * 0.3
    g = torch.randn(rows, d_out, device=device)
    leaves = [t.clone().requires_grad_(q) for t, q in zip((x, A, B), rg)]
    with triton_path(device), dropout_policy("seed"):
        torch.manual_seed(5)
        out = lora_linear(leaves[0], W, None, [LoraAdapter(leaves[1], leaves[2], 2.0, p)])
        out.backward(g)
        torch.manual_seed(5)
        seed = torch.empty(1, dtype=torch.int64, device=device).random_()[0]
        keep = kernels.choose("dropout_seed", x).keep_mask(x, p, seed)
    assert 0 < keep.sum() < keep.numel()
    noise = keep.float() * noise_scale(p, torch.float32)
    ref = [t.clone().requires_grad_(q) for t, q in zip((x, A, B), rg)]
    ref_out = ref[0] @ W.t() + ((ref[0] * noise) @ ref[1].t()) @ ref[2].t() * 2.0
    ref_out.backward(g)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves, ref):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed_value", [0, 1, -1, 2**31, 2**40 + 12345, -(2**62) + 7, 2**63 - 1, -(2**63)])
@pytest.mark.parametrize("p", [1e-8, 0.1, 0.5, 0.999])
def test_dropout_seed_mask_is_the_reference_philox(device, seed_value, p):
    """Triton's mask for a seed is the torch reference's ``philox_keep`` (and the core's, tests/test_dropout_philox):
    a mask drawn on one backend is regenerated by any other, and a seed gives one mask on CPU and CUDA. Odd sizes,
    seeds with the high word set and negative (Triton reads the int64 seed as unsigned), p at a draw's own value."""
    from slimgrad.kernels.dropout import _philox_uniform, philox_keep

    seed = torch.tensor(seed_value, dtype=torch.int64)
    n = 5003
    with triton_path(device):
        impl = kernels.choose("dropout_seed", torch.empty(1, device=device))
        assert impl.backend == "triton"
        keep = impl.keep_mask(torch.empty(n, device=device), p, seed.to(device))
        at_draw = _philox_uniform(torch.arange(n), seed)[17].item()  # p equal to element 17's draw: kept (u >= p)
        keep_at = impl.keep_mask(torch.empty(n, device=device), at_draw, seed.to(device))
    assert torch.equal(keep.cpu().bool(), philox_keep((n,), p, seed))
    assert torch.equal(keep_at.cpu().bool(), philox_keep((n,), at_draw, seed)) and keep_at[17]
