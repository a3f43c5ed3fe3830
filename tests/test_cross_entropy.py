"""fused_linear_cross_entropy against stock ``F.cross_entropy(F.linear(h, W, b).float(), t)``.

Tolerances: the loss and dHidden come out of the same kernels as stock, row for row; only the row count of
each matmul changes, and BLAS may block the inner sum differently for another row count, so they are usually
but not always bitwise equal: compared within fp32 rounding (rtol 1e-5). dWeight and dBias are sums over all
rows accumulated chunk by chunk, a different summation order than stock's single matmul: fp32 within a few
ulps (rtol 1e-5), bf16 within one bf16 rounding of an fp32 sum (rtol 1.6e-2, torch's bf16 default).

A frozen head (only dHidden asked for, the loss one number) forms dHidden in forward for an upstream gradient of 1
and scales it in backward: bitwise stock's where the upstream gradient is a power of two (tested with one chunk);
otherwise the logits' gradient is rounded to bf16 at another scale than stock's, so a bf16 dHidden is compared
within two bf16 roundings of the sum's terms (``_bf16_terms_bound``), which cancellation can make larger than the
element's own rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from _util import assert_same, grad_combos
from slimgrad.functional.cross_entropy import default_chunk_size, fused_linear_cross_entropy, grad_in_forward
from slimgrad.measure import SavedTensors, peak_bytes

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _close(actual, expected, what, **tol):
    """Same dtype and values within ``tol``; nan where stock gives nan (a mean over no target at all)."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: one is None"
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)


def _reference(h, w, t, b=None, *, ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None):
    z = F.linear(h, w, b)
    if softcap is not None:  # Gemma's head, as Hugging Face writes it
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.float(), t, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)


def _bf16_terms_bound(hidden, weight, target, bias, upstream, **opts):
    """Per element of dHidden, two bf16 roundings (2**-7) of the sum of its terms' magnitudes, ``|dZ| @ |W|`` with
    stock's logits gradient dZ, plus dHidden's own rounding: how far two correct bf16 results can lie apart when
    the logits' gradient was rounded at different scales."""
    h = hidden.detach().clone().requires_grad_()
    z = F.linear(h, weight, bias)
    z.retain_grad()
    softcap = opts.pop("softcap")
    capped = z if softcap is None else torch.tanh(z / softcap) * softcap
    F.cross_entropy(capped.float(), target, **opts).backward(upstream)
    terms = z.grad.double().abs() @ weight.double().abs()
    return terms * 2.0 ** -7 + h.grad.double().abs() * 2.0 ** -8 + 1e-30


def _data(n, h, v, dtype, *, bias, ignore_every=0, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    head = nn.Linear(h, v, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    target = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        target[::ignore_every] = ignore_index
    return hidden, head, target


def _compare(n, hs, v, dtype, *, bias, req, chunk_size, ignore_every=3, ignore_index=-100, label_smoothing=0.0,
             reduction="mean", softcap=None, seed=0):
    hidden, head, target = _data(n, hs, v, dtype, bias=bias, ignore_every=ignore_every, ignore_index=ignore_index,
                                 seed=seed)
    need_h, need_w, need_b = req
    head.weight.requires_grad_(need_w)
    if bias:
        head.bias.requires_grad_(need_b)
    ref_head, slim_head = head, copy.deepcopy(head)
    h_ref = hidden.clone().requires_grad_(need_h)
    h_slim = hidden.clone().requires_grad_(need_h)
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)
    expected = _reference(h_ref, ref_head.weight, target.clone(), ref_head.bias, **opts)
    actual = fused_linear_cross_entropy(h_slim, slim_head.weight, target.clone(), slim_head.bias,
                                        chunk_size=chunk_size, **opts)
    # The loss is fp32 whatever the input dtype (the logits are upcast before the softmax).
    _close(actual, expected, "loss", **TOL[torch.float32])
    if not expected.requires_grad:
        assert not actual.requires_grad
        return
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1))
    expected.backward(upstream)
    actual.backward(upstream.clone())
    tol = TOL[dtype]
    if dtype != torch.float32 and grad_in_forward(h_slim, slim_head.weight, slim_head.bias, reduction):
        bound = _bf16_terms_bound(hidden, head.weight.detach(), target, head.bias, upstream, ignore_index=ignore_index,
                                  label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)
        assert h_slim.grad.dtype == h_ref.grad.dtype
        diff = (h_slim.grad.double() - h_ref.grad.double()).abs()
        assert bool((diff <= bound).all()), f"dHidden: {(diff - bound).max()} over the bound"
    else:
        _close(h_slim.grad, h_ref.grad, "dHidden", **tol)
    _close(slim_head.weight.grad, ref_head.weight.grad, "dWeight", **tol)
    if bias:
        _close(slim_head.bias.grad, ref_head.bias.grad, "dBias", **tol)
    if not need_w:
        assert slim_head.weight.grad is None
    if bias and not need_b:
        assert slim_head.bias.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("req", grad_combos(3))
def test_requires_grad_combinations(dtype, bias, req):
    _compare(29, 8, 40, dtype, bias=bias, req=req, chunk_size=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_options(dtype, reduction, label_smoothing, softcap):
    _compare(23, 8, 33, dtype, bias=True, req=(True, True, True), chunk_size=5, reduction=reduction,
             label_smoothing=label_smoothing, softcap=softcap)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40), hs=st.integers(1, 12), v=st.integers(2, 50), chunk=st.integers(1, 45),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]), label_smoothing=st.sampled_from([0.0, 0.05, 1.0]),
    softcap=st.sampled_from([None, 1.0, 30.0]), ignore_every=st.integers(0, 5),
    ignore_index=st.sampled_from([-100, 0, 3]), req=st.sampled_from(grad_combos(3)[1:]), seed=st.integers(0, 99),
)
def test_random_shapes_and_options(n, hs, v, chunk, dtype, bias, reduction, label_smoothing, softcap,
                                   ignore_every, ignore_index, req, seed):
    _compare(n, hs, v, dtype, bias=bias, req=req, chunk_size=chunk, ignore_every=ignore_every,
             ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
             seed=seed)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_every_row_ignored(reduction, label_smoothing):
    # Stock gives nan for "mean" (0/0) and zero gradients; the same is expected here.
    _compare(10, 4, 7, torch.float32, bias=True, req=(True, True, True), chunk_size=3, ignore_every=1,
             reduction=reduction, label_smoothing=label_smoothing)


def test_leading_dimensions_and_none_shape():
    hidden, head, target = _data(12, 6, 9, torch.float32, bias=False, ignore_every=4)
    h3, t2 = hidden.view(3, 4, 6).requires_grad_(), target.view(3, 4)
    out = fused_linear_cross_entropy(h3, head.weight, t2, reduction="none", chunk_size=5)
    expected = _reference(hidden, head.weight, target, reduction="none").view(3, 4)
    assert_same(out, expected, exact=False, **TOL[torch.float32], what="per-token loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("req", grad_combos(3))
def test_saved_bytes_are_hidden_and_targets(dtype, req):
    n, hs, v = 50, 16, 64
    hidden, head, target = _data(n, hs, v, dtype, bias=True)
    need_h, need_w, need_b = req
    head.weight.requires_grad_(need_w)
    head.bias.requires_grad_(need_b)
    h = hidden.requires_grad_(need_h)
    with SavedTensors() as kept:
        fused_linear_cross_entropy(h, head.weight, target, head.bias, chunk_size=8)
    itemsize = torch.finfo(dtype).bits // 8
    # hidden in its own dtype + int64 targets + the fp32 0-d loss normaliser; parameters not counted. A frozen head:
    # dHidden alone, formed in forward (hidden's size and dtype).
    if req == (True, False, False):
        expected = n * hs * itemsize
    else:
        expected = n * hs * itemsize + n * 8 + 4 if any(req) else 0
    assert kept.bytes == expected, kept.records


def test_peak_stays_below_the_logits():
    n, hs, v = 1024, 32, 8192
    hidden, head, target = _data(n, hs, v, torch.float32, bias=False)
    h = hidden.requires_grad_()
    logits_bytes = n * v * 4
    peak = peak_bytes(lambda: fused_linear_cross_entropy(h, head.weight, target).backward())
    assert peak < logits_bytes // 2, (peak, logits_bytes)
    # and the chunking is what keeps it there: one chunk of fp32 logits is far below the whole
    rows = default_chunk_size(n, hs, v)
    assert rows * v * 4 <= logits_bytes // 8
    stock_peak = peak_bytes(lambda: _reference(h, head.weight, target).backward())
    assert stock_peak >= logits_bytes


def test_chunk_size_does_not_change_the_loss():
    hidden, head, target = _data(64, 8, 20, torch.float32, bias=True, ignore_every=3)
    with torch.no_grad():
        losses = [fused_linear_cross_entropy(hidden, head.weight, target, head.bias, chunk_size=c) for c in (1, 7, 64)]
    expected = _reference(hidden, head.weight, target, head.bias)
    for loss in losses:
        assert_same(loss, expected, exact=False, **TOL[torch.float32], what="loss")


def test_autocast_matches_stock():
    hidden, head, target = _data(20, 8, 30, torch.float32, bias=True, ignore_every=4)
    ref_head, slim_head = head, copy.deepcopy(head)
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _reference(h_ref, ref_head.weight, target, ref_head.bias)
        actual = fused_linear_cross_entropy(h_slim, slim_head.weight, target, slim_head.bias, chunk_size=6)
    assert_same(actual, expected, exact=False, **TOL[torch.float32], what="loss")
    expected.backward()
    actual.backward()
    tol = TOL[torch.bfloat16]
    assert_same(h_slim.grad, h_ref.grad, exact=False, what="dHidden", **tol)
    assert_same(slim_head.weight.grad, ref_head.weight.grad, exact=False, what="dWeight", **tol)
    assert_same(slim_head.bias.grad, ref_head.bias.grad, exact=False, what="dBias", **tol)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint(use_reentrant):
    hidden, head, target = _data(16, 8, 12, torch.float32, bias=True, ignore_every=5)
    ref_head, slim_head = head, copy.deepcopy(head)
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    _reference(h_ref, ref_head.weight, target, ref_head.bias).backward()
    loss = torch.utils.checkpoint.checkpoint(
        lambda h: fused_linear_cross_entropy(h, slim_head.weight, target, slim_head.bias, chunk_size=5), h_slim,
        use_reentrant=use_reentrant)
    loss.backward()
    assert_same(h_slim.grad, h_ref.grad, exact=False, **TOL[torch.float32], what="dHidden")
    assert_same(slim_head.weight.grad, ref_head.weight.grad, exact=False, what="dWeight", **TOL[torch.float32])


def test_double_backward_is_refused():
    hidden, head, target = _data(6, 4, 5, torch.float64, bias=False)
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, head.weight, target)
    # (refused when the first backward runs with create_graph=True: see test_create_graph_is_refused_...)
    with pytest.raises(RuntimeError, match="once_differentiable|marked with @once_differentiable"):
        (g,) = torch.autograd.grad(loss.pow(2), h, create_graph=True)
        g.sum().backward()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(hidden=[1.0]), TypeError, "'hidden' must be a torch.Tensor"),
        (dict(hidden=torch.zeros(4, 3, dtype=torch.long)), ValueError, "'hidden' must be a floating"),
        (dict(weight=torch.zeros(5, 2)), ValueError, "'weight' must have shape"),
        (dict(weight=torch.zeros(5, 3, dtype=torch.float64)), TypeError, "'weight' has dtype"),
        (dict(bias=torch.zeros(4)), ValueError, "'bias' must have shape"),
        (dict(target=torch.zeros(4, 5)), TypeError, "'target' must hold class indices"),
        (dict(target=torch.zeros(3, dtype=torch.long)), ValueError, "'target' must have shape"),
        (dict(target=torch.tensor([0, 1, 5, 2])), IndexError, "'target' holds 5"),
        (dict(target=torch.tensor([0, -3, 1, 2])), IndexError, "'target' holds -3"),
        (dict(reduction="avg"), ValueError, "'reduction' must be"),
        (dict(label_smoothing=1.5), ValueError, "'label_smoothing' must be"),
        (dict(chunk_size=0), ValueError, "'chunk_size' must be"),
        (dict(softcap=-1.0), ValueError, "'softcap' must be"),
        (dict(ignore_index=1.0), TypeError, "'ignore_index' must be an int"),
    ],
)
def test_bad_arguments(change, error, match):
    args = dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), target=torch.tensor([0, 1, 4, -100]), bias=None)
    args.update(change)
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(**args)


@pytest.mark.slow
def test_compile_fullgraph():
    hidden, head, target = _data(24, 8, 16, torch.float32, bias=True, ignore_every=4)
    ref_head, slim_head = head, copy.deepcopy(head)
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected = _reference(h_ref, ref_head.weight, target, ref_head.bias, label_smoothing=0.1)
    fn = torch.compile(lambda h, w, t, b: fused_linear_cross_entropy(h, w, t, b, chunk_size=10, label_smoothing=0.1),
                       fullgraph=True)
    actual = fn(h_slim, slim_head.weight, target, slim_head.bias)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    expected.backward()
    actual.backward()
    tol = TOL[torch.float32]
    assert_same(h_slim.grad, h_ref.grad, exact=False, what="dHidden", **tol)
    assert_same(slim_head.weight.grad, ref_head.weight.grad, exact=False, what="dWeight", **tol)
    assert_same(slim_head.bias.grad, ref_head.bias.grad, exact=False, what="dBias", **tol)


def _stock_with_divisor(h, w, t, b, divisor, **opts):
    loss = _reference(h, w, t, b, **opts)
    return loss if divisor is None else loss / divisor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction, divisor", [("mean", None), ("sum", None), ("sum", 7), ("sum", "tensor")])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("upstream", [1.0, 0.25, -2.0])
def test_frozen_head_grad_in_forward_is_stock_bitwise(dtype, reduction, divisor, label_smoothing, softcap, upstream):
    """A frozen head's dHidden, formed in forward and scaled in backward by a power-of-two upstream gradient, is
    stock's bit for bit (one chunk: stock's matmul shapes), the loss too; ``divisor`` is HF's num_items_in_batch."""
    hidden, head, target = _data(19, 8, 33, dtype, bias=True, ignore_every=4)
    head.requires_grad_(False)
    div = torch.tensor(7) if divisor == "tensor" else divisor
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    opts = dict(reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)
    expected = _stock_with_divisor(h_ref, head.weight, target, head.bias, div, **opts)
    actual = fused_linear_cross_entropy(h_slim, head.weight, target, head.bias, chunk_size=19, divisor=div, **opts)
    assert torch.equal(actual, expected), (actual, expected)
    (expected * upstream).backward()
    (actual * upstream).backward()
    assert torch.equal(h_slim.grad, h_ref.grad), (h_slim.grad - h_ref.grad).abs().max()


@pytest.mark.parametrize("req", [(True, False, False), (True, True, False), (True, False, True)])
def test_frozen_head_backward_computes_no_logits(req):
    """Only a frozen head skips the recomputation: its backward runs no matrix product at all (one scaling), a
    trained head's recomputes its chunks' logits (two products per chunk, three with dWeight)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear):
                self.mm += 1
            return func(*args, **(kwargs or {}))

    hidden, head, target = _data(24, 8, 30, torch.float32, bias=True, ignore_every=5)
    need_h, need_w, need_b = req
    head.weight.requires_grad_(need_w)
    head.bias.requires_grad_(need_b)
    h = hidden.clone().requires_grad_(need_h)
    loss = fused_linear_cross_entropy(h, head.weight, target, head.bias, chunk_size=8)
    with Count() as count:
        loss.backward()
    assert (count.mm == 0) == (req == (True, False, False)), count.mm
    h_ref = hidden.clone().requires_grad_()
    ref_head = copy.deepcopy(head)
    _reference(h_ref, ref_head.weight, target, ref_head.bias).backward()
    _close(h.grad, h_ref.grad, "dHidden", **TOL[torch.float32])


@pytest.mark.parametrize("req", grad_combos(3)[1:])
@pytest.mark.parametrize("divisor", [3, torch.tensor(5.0)])
def test_divisor_is_stock_division(req, divisor):
    """``divisor`` divides the loss as HF's ``loss / num_items_in_batch`` does, in the recomputing backward too."""
    _compare_divisor = _data(17, 6, 21, torch.float32, bias=True, ignore_every=3)
    hidden, head, target = _compare_divisor
    need_h, need_w, need_b = req
    head.weight.requires_grad_(need_w)
    head.bias.requires_grad_(need_b)
    ref_head, slim_head = head, copy.deepcopy(head)
    h_ref, h_slim = hidden.clone().requires_grad_(need_h), hidden.clone().requires_grad_(need_h)
    expected = _stock_with_divisor(h_ref, ref_head.weight, target, ref_head.bias, divisor, reduction="sum")
    actual = fused_linear_cross_entropy(h_slim, slim_head.weight, target, slim_head.bias, reduction="sum",
                                        chunk_size=17, divisor=divisor)
    assert torch.equal(actual, expected)
    expected.backward()
    actual.backward()
    _close(h_slim.grad, h_ref.grad, "dHidden", **TOL[torch.float32])
    _close(slim_head.weight.grad, ref_head.weight.grad, "dWeight", **TOL[torch.float32])
    _close(slim_head.bias.grad, ref_head.bias.grad, "dBias", **TOL[torch.float32])


def test_divisor_must_be_a_number_or_tensor():
    with pytest.raises(TypeError, match="'divisor' must be a number"):
        fused_linear_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 3), torch.tensor([0, 1, 4, -100]), divisor="8")


def test_fp16_head_keeps_recomputing_so_a_loss_scale_prevents_underflow():
    """In fp16 the logits' gradient at an upstream of 1 (softmax / N) underflows; a loss scaler's 2**16 exists to
    prevent that, and stock forms it at the scaled value: an fp16 head recomputes in backward (bitwise stock's here,
    one chunk), as before the frozen-head path."""
    n, hs, v = 512, 16, 2048
    hidden, head, target = _data(n, hs, v, torch.float16, bias=False)
    head.requires_grad_(False)
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    assert not grad_in_forward(h_slim, head.weight, None, "mean")
    (_reference(h_ref, head.weight, target) * 2.0 ** 16).backward()
    (fused_linear_cross_entropy(h_slim, head.weight, target, chunk_size=n) * 2.0 ** 16).backward()
    assert torch.equal(h_slim.grad, h_ref.grad)


@pytest.mark.parametrize("frozen_head", [True, False])
def test_create_graph_is_refused_not_silently_first_order(frozen_head):
    """``torch.autograd.grad(loss, h, create_graph=True)`` gave a gradient that did not require grad, and a penalty
    on it was dropped from the step silently (the upstream gradient of 1 does not require grad, so
    once_differentiable marked nothing): now the error the docs promise."""
    hidden, head, target = _data(16, 8, 50, torch.float32, bias=False)
    head.requires_grad_(not frozen_head)
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, head.weight, target)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


@pytest.mark.parametrize("frozen_head", [True, False])
@pytest.mark.parametrize("form", ["float64", "shape_1x1", "requires_grad", "int64"])
def test_divisor_of_any_form_divides_as_stock(form, frozen_head):
    """A divisor that is not a 0-d fp32/integer tensor without grad (HF's DataParallel (n_gpu, 1) form, a float64
    count, one that requires grad) divides the result as stock's ``loss / divisor`` does: inside the Function a
    float64 or (1, 1) one crashed nll_loss_backward, and one that requires grad got no gradient (the review)."""
    hidden, head, target = _data(17, 6, 21, torch.float32, bias=False, ignore_every=3)
    head.requires_grad_(not frozen_head)
    divisor = {"float64": lambda: torch.tensor(50.0, dtype=torch.float64),
               "shape_1x1": lambda: torch.tensor([[50.0]]),
               "requires_grad": lambda: torch.tensor(50.0, requires_grad=True),
               "int64": lambda: torch.tensor(50)}[form]
    d_ref, d_slim = divisor(), divisor()
    h_ref, h_slim = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref_head, slim_head = head, copy.deepcopy(head)
    expected = _stock_with_divisor(h_ref, ref_head.weight, target, None, d_ref, reduction="sum")
    actual = fused_linear_cross_entropy(h_slim, slim_head.weight, target, reduction="sum", chunk_size=17,
                                        divisor=d_slim)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    assert torch.equal(h_slim.grad, h_ref.grad)
    if form == "requires_grad":
        assert torch.equal(d_slim.grad, d_ref.grad)
