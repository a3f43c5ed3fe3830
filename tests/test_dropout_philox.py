"""The "seed" dropout policy's mask: Philox4x32-10 on the element index (Triton's ``tl.rand`` stream), one
definition for every ``dropout_seed`` backend. Here: the torch reference against Philox's published known answer,
the compiled core's CPU kernels against the torch reference bit for bit (mask, output, gradient, in place, every
float dtype, odd sizes, signed seeds), and the policy's calls (dropout, peft-style LoRA linear and conv) giving the
same bits with the core on and off. Triton's kernel against the same reference: tests/test_triton_masks.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from tests._util import FLOAT_DTYPES

from slimgrad import csrc
from slimgrad.functional.dropout import dropout, dropout_policy
from slimgrad.functional.lora import LoraAdapter, lora_linear
from slimgrad.kernels import dropout as dk
from slimgrad.kernels import registry

needs_core = pytest.mark.skipif(csrc.core() is None, reason="the compiled core is unavailable here "
                                f"({csrc.status()['reason']}): only the Python path runs")

SEEDS = [0, 1, -1, 2**31, 2**40 + 12345, 2**63 - 1, -(2**63)]
SIZES = [1, 7, 8, 9, 4099, 70001]


def bits(t):
    """A tensor's bits, every NaN as one value: NaN payloads are not part of the contract (aten's own bf16 product
    gives 0xffff in its vector loop and 0x7fc0 in its scalar tail; the kernels round each element alone)."""
    t = t.detach().contiguous()
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t) if t.is_floating_point() else t
    return t.view(torch.uint8 if t.element_size() == 1 else getattr(torch, f"int{8 * t.element_size()}"))


def test_reference_is_philox_4x32_10():
    """Random123's known answer for Philox4x32-10, counter 0 and key 0: first word 0x6627e8d5 (Salmon et al. 2011,
    kat_vectors); and a word for a key with both halves set differs from the zero key's (the key is used)."""
    z = torch.zeros((), dtype=torch.int64)
    assert dk.philox_first_word(z, z, z, z).item() == 0x6627E8D5
    k = torch.tensor(0xFFFFFFFF, dtype=torch.int64)
    assert dk.philox_first_word(z, z, k, k).item() != 0x6627E8D5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_reference_mask_drops_about_p_and_depends_on_seed_and_index(p):
    n = 200_000
    a = dk.philox_keep((n,), p, torch.tensor(5))
    b = dk.philox_keep((n,), p, torch.tensor(6))
    frac = 1 - a.double().mean().item()
    assert abs(frac - p) < 5 * (p * (1 - p) / n) ** 0.5, frac
    assert (a != b).any()
    assert torch.equal(dk.philox_keep((40, 5000), p, torch.tensor(5)).reshape(-1), a[:n])  # the logical index
    # a 64-bit index: counter (i mod 2**32, i >> 32), as Triton's randint4x for int64 offsets
    hi = dk._philox_uniform(torch.tensor([2**32 + 3]), torch.tensor(5))
    lo = dk._philox_uniform(torch.tensor([3]), torch.tensor(5))
    assert hi.item() != lo.item()


@needs_core
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_core_kernels_are_the_reference(dtype, n):
    core = dk.CoreDropoutSeed(csrc.core())
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[: min(n, 5)] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf"), 0.0])[: min(n, 5)].to(dtype)
    g = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).to(dtype)
    for seed_value, p in itertools.product(SEEDS, [1e-8, 0.1, 0.5, 0.999]):
        seed = torch.tensor(seed_value, dtype=torch.int64)
        keep = core.keep_mask(x, p, seed)
        assert keep.dtype == torch.uint8 and keep.shape == x.shape
        assert torch.equal(keep.bool(), dk.philox_keep(x.shape, p, seed)), (seed_value, p)
        out = core.forward(x, p, seed, False)
        assert torch.equal(bits(out), bits(dk.SEED_TORCH.forward(x, p, seed, False))), (seed_value, p)
        assert torch.equal(bits(core.backward(g, p, seed)), bits(dk.SEED_TORCH.backward(g, p, seed)))
        xi = x.clone()
        assert core.forward(xi, p, seed, True) is xi and torch.equal(bits(xi), bits(out))


@needs_core
def test_core_is_the_cpu_choice_and_rejects_a_bad_seed():
    x = torch.randn(10)
    assert registry.choose_kernel(dk.SEED, "cpu", torch.float32).backend == "core"
    core = dk.CoreDropoutSeed(csrc.core())
    with pytest.raises(RuntimeError, match="argument 'seed'"):
        core.forward(x, 0.5, torch.tensor(1.0), False)
    with pytest.raises(RuntimeError, match="argument 'seed'"):
        core.forward(x, 0.5, torch.tensor([1, 2]), False)


def _dropout_run(x0, p, g):
    x = x0.clone().requires_grad_()
    torch.manual_seed(11)
    out = dropout(x, p, policy="seed")
    out.backward(g)
    return out.detach(), x.grad


@needs_core
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_seed_policy_dropout_same_bits_core_on_and_off(dtype, layout):
    x0 = torch.randn(3, 4, 5, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    if layout == "channels_last":
        x0 = x0.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x0 = x0.transpose(1, 3)
    g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    on = _dropout_run(x0, 0.3, g)
    with csrc.disabled():
        off = _dropout_run(x0, 0.3, g)
    for a, b in zip(on, off):
        assert torch.equal(bits(a), bits(b)) and a.stride() == b.stride()
    assert (on[0] == 0).any() and (on[0] != 0).any()


def _lora_run(p, dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 7, 33, dtype=dtype, requires_grad=True)
    W = torch.randn(9, 33, dtype=dtype)
    A = (torch.randn(4, 33) * 0.3).requires_grad_()
    B = (torch.randn(9, 4) * 0.3).requires_grad_()
    with dropout_policy("seed"):
        torch.manual_seed(5)
        out = lora_linear(x, W, None, [LoraAdapter(A, B, 2.0, p)])
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype))
    return out.detach(), x.grad, A.grad, B.grad


@needs_core
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seed_policy_lora_same_bits_core_on_and_off(dtype):
    """LoRA's seeded adapter dropout: the core's kernel (core on) and the reference's noise (core off) apply the same
    mask, so outputs and every gradient are bitwise equal."""
    on = _lora_run(0.25, dtype)
    with csrc.disabled():
        off = _lora_run(0.25, dtype)
    for a, b in zip(on, off):
        assert torch.equal(bits(a), bits(b))


def test_seed_policy_reference_peaks_no_higher_than_stock():
    """The Python path (core off) computes the Philox mask with integer ops in 16 Ki-element chunks, written straight
    into the noise: a step peaks below stock's (a mask-sized bool, a noise copy and 64 Ki-element chunks put it at
    2.06x; the review sweep)."""
    import copy

    import slimgrad

    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 64))
    slim = slimgrad.convert(copy.deepcopy(stock), dropout="seed")
    x = torch.randn(4096, 64)

    def peak(m):
        def step():
            m(x).sum().backward()

        step()
        for q in m.parameters():
            q.grad = None
        return slimgrad.peak_bytes(step)

    with csrc.disabled():
        assert peak(slim) <= peak(stock)


def test_cuda_seed_switch_that_cannot_engage_says_so(monkeypatch):
    """SLIMGRAD_CORE_CUDA_SEED=1 where the core has no CUDA kernels (a CPU torch here): a SlimgradWarning and the
    Python Function's route (None). A stand-in with a CUDA device: core_seeded reads only that."""
    from slimgrad import _notices
    from slimgrad.functional import lora as lora_module

    monkeypatch.setattr(lora_module, "_CUDA_SEED", True)
    monkeypatch.setattr(_notices, "_WARNED", set())

    class _Cuda:
        is_cpu, is_cuda, device = False, True, torch.device("cuda")

    with pytest.warns(UserWarning, match="SLIMGRAD_CORE_CUDA_SEED=1 is set"):
        assert lora_module.core_seeded(_Cuda(), (0.1,), "seed") is None
