"""Triton RMSNorm (every casting style), FusedAddRMSNorm and LayerNorm kernels against slimgrad's torch path
(itself bitwise stock, see test_norms.py), under the Triton interpreter on CPU and compiled on CUDA when
present: outputs and every requested gradient within the dtype's rounding (tolerance in _triton_util.ULPS),
frozen parameters get no gradient and no dW/dB buffer is allocated, saved bytes are x plus fp32 per-row
statistics."""

from __future__ import annotations

import pytest
import torch
from tests._triton_util import DEVICES, AllocationLog, assert_no_worse, torch_path, triton_path
from tests._util import grad_combos

from slimgrad import kernels
from slimgrad.functional.norms import fused_add_rms_norm, layer_norm, rms_norm, rms_norm_hf
from slimgrad.kernels.registry import triton_interpreting
from slimgrad.measure import saved_bytes

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STYLES = ["torch", "llama", "olmo2", "gemma", "t5"]


def _inputs(shape, dtype, device, seed=0, w_dtype=None, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    w = (torch.rand(shape[-1], generator=gen) * 2 - 1 + offset).to(device=device, dtype=w_dtype or dtype)
    g = torch.randn(shape, generator=gen).to(device=device)
    return x, w, g


def _rms(style):
    if style == "torch":
        return lambda x, w: rms_norm(x, (x.shape[-1],), w, 1e-6)
    return lambda x, w: rms_norm_hf(x, w, 1e-6, style)


def _run(fn, tensors, rg, g):
    """fn on fresh leaf copies with requires_grad per rg; returns (output, grads)."""
    leaves = [t.clone().requires_grad_(r) for t, r in zip(tensors, rg)]
    out = fn(*leaves)
    if out.requires_grad:
        out.backward(g.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _compare(fn, tensors, rg, g, device, what, dtype=None):
    """Triton vs the torch path in the same dtypes, both measured against the torch path in fp64."""
    with torch_path():
        ref, ref_grads = _run(fn, tensors, rg, g)
        exact, exact_grads = _run(fn, [t.double() for t in tensors], rg, g.double())
    with triton_path(device):
        got, got_grads = _run(fn, tensors, rg, g)
    assert_no_worse(got, ref, exact, what=f"{what} output", dtype=dtype)
    for i, (a, b, e) in enumerate(zip(got_grads, ref_grads, exact_grads)):
        assert_no_worse(a, b, e, what=f"{what} grad {i}", dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("rg", grad_combos(2))
def test_rms_norm_matches_torch_path(device, dtype, style, rg):
    for shape in ((2, 3, 33), (3, 1000)):
        x, w, g = _inputs(shape, dtype, device)
        _compare(_rms(style), (x, w), rg, g, device, f"{style} {dtype} {shape} rg={rg}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style,w_dtype", [("llama", torch.float32), ("t5", torch.float32), ("t5", torch.bfloat16),
                                           ("olmo2", torch.float32), ("gemma", torch.float32)])
def test_rms_norm_mixed_weight_dtype(device, style, w_dtype):
    """bf16 activations with an fp32 (or half) weight: Llama's output promotes, T5 follows a half weight."""
    x, w, g = _inputs((4, 33), torch.bfloat16, device, w_dtype=w_dtype)
    # x̂ is rounded to bf16 inside the fp32 output/gradients: bf16's tolerance.
    _compare(_rms(style), (x, w), (True, True), g, device, f"{style} w={w_dtype}", dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_non_contiguous_and_strided_rows(device):
    base = torch.randn(33, 6, device=device)
    x_t = base.t()  # last dim not contiguous: the kernel gets a copy
    wide = torch.randn(5, 40, device=device)
    x_s = wide[:, 3:36]  # rows strided by 40: read in place
    w = torch.randn(33, device=device)
    g = torch.randn(6, 33, device=device)
    for x, gg in ((x_t, g), (x_s, g[:5])):
        for style in ("torch", "llama"):
            _compare(_rms(style), (x, w), (True, True), gg, device, f"{style} strides={x.stride()}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_multi_dim_normalized_shape_and_no_weight(device):
    x, _, g = _inputs((3, 4, 5), torch.float32, device)
    w = torch.randn(4, 5, device=device)
    fn = lambda x, w: rms_norm(x, (4, 5), w, 1e-5)
    _compare(fn, (x, w), (True, True), g, device, "2-d normalized_shape")
    _compare(lambda x: rms_norm(x, (5,), None), (x,), (True,), g, device, "no weight")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rg", grad_combos(2))
def test_rms_norm_saved_bytes_minimum(device, dtype, rg):
    """x in its own dtype plus one fp32 rstd per row when any gradient is requested, else nothing; with only the
    weight trainable, the normalised input as the weight multiplies it (what stock keeps: x's dtype for Llama, fp32
    for the torch style) where that is no bigger (tests/test_core_norms.py compares with stock)."""
    rows, h = 6, 33
    x, w, _ = _inputs((2, 3, h), dtype, device)
    x.requires_grad_(rg[0])
    w = torch.nn.Parameter(w, requires_grad=rg[1])
    with triton_path(device):
        for style, normed_size in (("llama", x.element_size()), ("torch", 4)):
            expected = rows * h * x.element_size() + rows * 4 if any(rg) else 0
            if rg == (False, True) and normed_size * h <= x.element_size() * h + 4:
                expected = rows * h * normed_size
            assert saved_bytes(_rms(style), x, w) == expected, style


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_weight_allocates_no_dw_buffer(device):
    """With the weight frozen, backward creates dX only: no fp32 (programs, H) partial buffer, no dW. With the
    weight trainable the buffer appears (so the check can fail)."""
    h = 33
    x, w, g = _inputs((8, h), torch.bfloat16, device)
    with triton_path(device):
        impl = kernels.choose("rms_norm_hf", x)
        assert impl.backend == "triton"
        y, rstd = impl.forward(x, w, 1e-6, "llama", h)
        for need_w in (False, True):
            with AllocationLog() as log:
                dx, dw = impl.backward(g.to(y.dtype), x, rstd, w, "llama", h, True, need_w)
            fp32_rows = [s for s, dt in log.created if dt == torch.float32 and len(s) == 2 and s[1] == h]
            assert (dw is not None) == need_w
            assert bool(fp32_rows) == need_w, log.created
            assert (x.shape, torch.bfloat16) in log.created
        # Through the Function: a frozen weight gets no .grad.
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_(False)
        rms_norm_hf(xx, ww).backward(g.to(torch.bfloat16))
        assert ww.grad is None and xx.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rg", [(True, True, True), (True, False, False), (False, True, False),
                                (False, False, True), (True, True, False)])
@pytest.mark.parametrize("use", ["both", "out", "s"])
def test_fused_add_rms_norm(device, dtype, rg, use):
    """Gradients through y only (dS_out is None), s only (dY is None), or both, for every input combination."""
    x, w, g = _inputs((3, 33), dtype, device)
    r, _, g2 = _inputs((3, 33), dtype, device, seed=1)

    def run(cast=lambda t: t):
        leaves = [cast(t).clone().requires_grad_(q) for t, q in zip((x, r, w), rg)]
        y, s = fused_add_rms_norm(*leaves, eps=1e-6, style="llama")
        terms = []
        if use in ("both", "out"):
            terms.append((y.double() * g.double()).sum())
        if use in ("both", "s"):
            terms.append((s.double() * g2.double()).sum())
        loss = sum(terms)
        if loss.requires_grad:
            loss.backward()
        return y.detach(), s.detach(), [t.grad for t in leaves]

    with torch_path():
        ry, rs, rgs = run()
        ey, es, egs = run(torch.Tensor.double)
    with triton_path(device):
        ty, ts, tgs = run()
    if device == "cuda":
        assert torch.equal(ts, rs), "s = x + r is one add rounded to nearest in both paths"
    assert_no_worse(ts, rs, es, what="s")
    assert_no_worse(ty, ry, ey, what="y")
    for i, (a, b, e) in enumerate(zip(tgs, rgs, egs)):
        assert_no_worse(a, b, e, what=f"grad {i} use={use} rg={rg}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rg", grad_combos(3))
def test_layer_norm_matches_torch_path(device, dtype, rg):
    for shape in ((2, 3, 33), (3, 1000)):
        x, w, g = _inputs(shape, dtype, device)
        b = torch.randn(shape[-1]).to(device=device, dtype=dtype)
        fn = lambda x, w, b: layer_norm(x, (x.shape[-1],), w, b, 1e-5)
        _compare(fn, (x, w, b), rg, g, device, f"{dtype} {shape} rg={rg}")


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_no_affine_and_fp32_params(device):
    x, w, g = _inputs((4, 33), torch.bfloat16, device, w_dtype=torch.float32)
    b = torch.randn(33, device=device)
    _compare(lambda x: layer_norm(x, (33,)), (x,), (True,), g, device, "no affine")
    if device == "cpu":  # CUDA's stock layer norm refuses a bf16 input with fp32 parameters: no reference there
        _compare(lambda x, w, b: layer_norm(x, (33,), w, b), (x, w, b), (True, True, True), g, device,
                 "fp32 params", dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rg", grad_combos(3))
def test_layer_norm_saved_bytes_and_buffers(device, rg):
    """x + fp32 mean and rstd per row when dX or dW is requested; nothing when only dB is (dB = Σ dy)."""
    rows, h = 4, 33
    x, w, g = _inputs((rows, h), torch.float16, device)
    b = torch.randn(h).to(device=device, dtype=torch.float16)
    x.requires_grad_(rg[0])
    w, b = torch.nn.Parameter(w, requires_grad=rg[1]), torch.nn.Parameter(b, requires_grad=rg[2])
    expected = rows * h * 2 + 2 * rows * 4 if (rg[0] or rg[1]) else 0
    with triton_path(device):
        assert saved_bytes(lambda: layer_norm(x, (h,), w, b)) == expected
        if any(rg):
            y = layer_norm(x, (h,), w, b)
            with AllocationLog() as log:
                y.backward(g.to(y.dtype))
            partials = [s for s, dt in log.created if dt == torch.float32 and len(s) == 2 and s[1] == h]
            assert len(partials) == int(rg[1]) + int(rg[2]), log.created
            assert (w.grad is not None) == rg[1] and (b.grad is not None) == rg[2]


def test_registry_choices():
    """auto never picks Triton on CPU; "triton" picks it on CPU only under the interpreter (else torch); on
    CUDA auto prefers the Triton kernels for the Hugging Face styles and aten's for F.rms_norm / layer_norm."""
    x = torch.randn(2, 4)
    with kernels.preference("auto"):
        for family in ("rms_norm", "rms_norm_hf", "fused_add_rms_norm", "layer_norm"):
            assert kernels.choose(family, x).backend == "torch"
            assert kernels.choose(family, x.double()).backend == "torch"
        chosen = {(r["family"], r["dtype"]): r["chosen"] for r in kernels.table(("cuda",))}
        assert chosen[("rms_norm_hf", "bfloat16")] == "triton"
        assert chosen[("layer_norm", "bfloat16")] == "torch"
        assert chosen[("rms_norm_hf", "float64")] == "torch"
    with triton_path("cpu"):
        expected = "triton" if triton_interpreting() else "torch"
        assert kernels.choose("rms_norm_hf", x).backend == expected
        assert kernels.choose("rms_norm_hf", x.double()).backend == "torch"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputes_through_kernels(device, reentrant):
    """Under activation checkpointing the kernels recompute the forward in backward: gradients equal an
    uncheckpointed run of the same kernels (they are deterministic)."""
    from torch.utils.checkpoint import checkpoint

    from slimgrad.functional.gated import gated_activation

    x, w, g = _inputs((4, 33), torch.bfloat16, device)
    b = torch.randn(33).to(device=device, dtype=torch.bfloat16)

    def block(x, w, b):
        h = rms_norm_hf(x, w, 1e-6, "llama")
        h = gated_activation(h, layer_norm(h, (33,), w, b), "silu")
        return fused_add_rms_norm(h, x, w, 1e-6)[0]

    grads = []
    with triton_path(device):
        for ckpt in (False, True):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            out = checkpoint(block, *leaves, use_reentrant=reentrant) if ckpt else block(*leaves)
            out.backward(g)
            grads.append([t.grad for t in leaves])
    for a, b_ in zip(*grads):
        assert torch.equal(a, b_)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,style", [(torch.bfloat16, s) for s in STYLES] + [(torch.float32, "llama")])
@pytest.mark.parametrize("rg", [(True, True), (False, True), (True, False)])
def test_rms_norm_split_dw_variant(device, dtype, style, rg, monkeypatch):
    """The experimental split backward (dX per row, dW as a tiled column reduction; off by default) gives the
    same gradients within the same tolerance, across several row tiles and column blocks."""
    from slimgrad.kernels.triton import rms_norm as kernel

    monkeypatch.setattr(kernel, "SPLIT_DW", 0)
    for shape in ((40, 33), (3, 600)):  # 3 row tiles (16 rows), 3 column blocks (256 columns), ragged
        x, w, g = _inputs(shape, dtype, device)
        _compare(_rms(style), (x, w), rg, g, device, f"split {style} {dtype} {shape} rg={rg}")
