"""Dropout family against stock PyTorch: valid masks, stock's scaling bit for bit, a seed kept."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimgrad
import slimgrad.nn.dropout  # noqa: F401  (registers the replacements)
from _util import FLOAT_DTYPES, assert_same, input_grad_as_returned, laid_out, saved_bytes, slim_copy
from slimgrad.functional.dropout import dropout, dropout1d, dropout2d, dropout3d
from slimgrad.measure import SavedTensors

LEAF_MSG = "a leaf Variable that requires grad is being used in an in-place operation"
PS = [0.0, 0.1, 0.5, 0.9, 1.0]
# (ours, stock, input shape, noise shape)
KINDS = {
    "dropout": (dropout, F.dropout, (2, 3, 4, 5), (2, 3, 4, 5)),
    "dropout1d": (dropout1d, F.dropout1d, (2, 3, 5), (2, 3, 1)),
    "dropout1d-unbatched": (dropout1d, F.dropout1d, (3, 5), (3, 1)),
    "dropout2d": (dropout2d, F.dropout2d, (2, 3, 4, 5), (2, 3, 1, 1)),
    "dropout3d": (dropout3d, F.dropout3d, (2, 3, 2, 2, 3), (2, 3, 1, 1, 1)),
    "dropout3d-unbatched": (dropout3d, F.dropout3d, (3, 2, 2, 3), (3, 1, 1, 1)),
}


def nonzero_input(shape, dtype, seed=0):
    """Values away from zero, so a zero output means a dropped element."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (x + x.sign() * 0.5).to(dtype)


def scale_of(p, dtype):
    """The kept elements' factor exactly as stock makes it: a 1 from bernoulli_, then div_(1 - p)."""
    return torch.ones((), dtype=dtype).div_(1 - p) if p < 1 else torch.zeros((), dtype=dtype)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_valid_dropout_with_stock_scaling(p, dtype, kind, inplace):
    ours, stock, shape, noise_shape = KINDS[kind]
    x = nonzero_input(shape, dtype).requires_grad_()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with SavedTensors() as counter:
        out = ours(x.clone() if inplace else x, p, True, inplace)
    out.backward(g)
    if p == 0:
        assert_same(out, x.detach(), what="identity")
        assert_same(x.grad, g, what="identity grad")
        assert counter.bytes == 0
        return
    keep = out.detach() != 0
    if noise_shape != shape:  # one draw per channel, shared over the spatial dimensions
        channel_dims = sum(1 for size in noise_shape if size != 1)  # (N, C) or (C,) when unbatched
        per_channel = keep.flatten(start_dim=channel_dims)
        assert (per_channel == per_channel[..., :1]).all()
    scale = scale_of(p, dtype)
    noise = torch.where(keep, scale, torch.zeros((), dtype=dtype))
    assert_same(out, x.detach() * noise, what="output")  # bitwise stock's input * noise
    assert_same(x.grad, g * noise, what="grad")  # bitwise stock's grad * noise
    if noise_shape != shape:  # feature dropout is stock's own
        assert counter.bytes == (math.prod(noise_shape) * x.element_size() if p < 1 else x.element_size())
    else:  # the packed mask under the default policy on CPU (nothing at p == 1)
        assert counter.bytes == (0 if p == 1 else math.ceil(math.prod(shape) / 8))
    with SavedTensors() as stock_counter:
        stock(x.detach().clone().requires_grad_(), p, True, False)
    assert stock_counter.bytes == (math.prod(noise_shape) * x.element_size() if p < 1 else x.element_size())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    n = 200_000
    x = torch.ones(n, requires_grad=True)
    torch.manual_seed(123)
    rate = (dropout(x, p) != 0).double().mean().item()
    assert abs(rate - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n)
    torch.manual_seed(123)
    channels = (dropout2d(torch.ones(400, 500, 1, 1, requires_grad=True), p) != 0).double().mean().item()
    assert abs(channels - (1 - p)) < 6 * math.sqrt(p * (1 - p) / 200_000)


def test_seed_reproducible_and_calls_differ():
    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(7)
    a, b = dropout(x, 0.5), dropout(x, 0.5)
    torch.manual_seed(7)
    c = dropout(x, 0.5)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)
    # without grad the very same mask (reentrant checkpointing relies on it)
    torch.manual_seed(7)
    with torch.no_grad():
        d = dropout(x, 0.5)
    assert torch.equal(a, d)


def test_saved_bytes_large():
    x = torch.randn(8, 64, 28, 28, requires_grad=True)
    assert saved_bytes(dropout, x, 0.5) == x.numel() // 8  # one bit per element (policy "auto" on CPU)
    assert saved_bytes(dropout, x, 0.5, policy="seed") == 8  # one int64 seed
    assert saved_bytes(F.dropout, x, 0.5) == x.numel() * 4
    assert saved_bytes(dropout2d, x, 0.5) == 8 * 64 * 4  # stock's own
    assert saved_bytes(F.dropout2d, x, 0.5) == 8 * 64 * 4


def test_layout_like_stock():
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    assert dropout(x, 0.5).stride() == F.dropout(x, 0.5).stride()


@pytest.mark.parametrize("fn,shape", [(dropout, (2, 3)), (dropout1d, (2, 3, 4)), (dropout2d, (2, 3, 4, 5)),
                                      (dropout3d, (2, 3, 2, 2, 2))])
def test_eval_is_identity_and_keeps_nothing(fn, shape):
    x = torch.randn(shape, requires_grad=True)
    assert fn(x, 0.5, training=False) is x
    assert fn(x, 0.0) is x
    assert saved_bytes(fn, x, 0.5, training=False) == 0


def test_modules_train_and_eval():
    for stock in (nn.Dropout(0.3), nn.Dropout1d(0.3), nn.Dropout2d(0.3), nn.Dropout3d(0.3)):
        slim = slim_copy(stock)
        shape = {nn.Dropout: (4, 6), nn.Dropout1d: (4, 6, 5), nn.Dropout2d: (4, 6, 3, 3),
                 nn.Dropout3d: (4, 6, 2, 2, 2)}[type(stock)]
        x = nonzero_input(shape, torch.float32).requires_grad_()
        feature = type(stock) is not nn.Dropout
        assert saved_bytes(slim, x) == (4 * 6 * 4 if feature else math.ceil(x.numel() / 8))
        out = slim(x)
        keep = out != 0
        assert_same(out, x * torch.where(keep, scale_of(0.3, torch.float32), 0.0), what=type(stock).__name__)
        slim.eval()
        assert slim(x) is x
    with pytest.raises(RuntimeError, match=LEAF_MSG):
        slim_copy(nn.Dropout(0.5, inplace=True))(torch.randn(3, requires_grad=True))


def test_validation_like_stock():
    x = torch.randn(2, 3, 4)
    for fn, ref in ((dropout, F.dropout), (dropout1d, F.dropout1d), (dropout2d, F.dropout2d),
                    (dropout3d, F.dropout3d)):
        for p in (-0.1, 1.5):
            message = f"dropout probability has to be between 0 and 1, but got {p}"
            with pytest.raises(ValueError, match=message):
                ref(x, p)
            with pytest.raises(ValueError, match=message):
                fn(x, p)
    for fn in (dropout1d, F.dropout1d):
        with pytest.raises(RuntimeError, match="dropout1d: Expected 2D or 3D input, but received a 4D input"):
            fn(torch.randn(1, 2, 3, 4))
    for fn in (dropout2d, F.dropout2d):
        with pytest.warns(UserWarning, match="Received a 3D input to dropout2d"):
            fn(torch.randn(2, 3, 4))
        with pytest.warns(UserWarning, match="Received a 1-D input to dropout2d"), \
                pytest.raises(RuntimeError, match="Feature dropout requires at least 2 dimensions"):
            fn(torch.randn(3, requires_grad=True))
    for fn in (dropout3d, F.dropout3d):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fn(torch.randn(2, 3, 4, 5))  # unbatched: no warning
        with pytest.warns(UserWarning, match="Received a 3-D input to dropout3d"):
            fn(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="argument 'input'"):
        dropout([1.0, 2.0])
    with pytest.raises(RuntimeError, match=LEAF_MSG):
        dropout(torch.randn(3, requires_grad=True), 0.5, inplace=True)


@pytest.mark.parametrize("p", [0.3, 1.0])
@pytest.mark.parametrize("fn", [dropout, dropout2d])
def test_double_backward(fn, p):
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)

    def seeded(t):
        torch.manual_seed(0)  # the same mask on every call gradgradcheck makes
        return fn(t, p)

    torch.autograd.gradcheck(seeded, (x,))
    torch.autograd.gradgradcheck(seeded, (x,))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("module", [nn.Dropout(0.4), nn.Dropout2d(0.4)], ids=repr)
def test_checkpoint_regenerates_the_same_mask(module, reentrant):
    lin1, lin2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 2, 1)
    net = nn.Sequential(lin1, slim_copy(module), lin2)
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    torch.manual_seed(0)
    y_ref = net(x)
    y_ref.sum().backward()
    expected = [t.grad.clone() for t in (x, lin1.weight, lin2.weight)]
    for t in (x, lin1.weight, lin2.weight):
        t.grad = None
    torch.manual_seed(0)
    y = checkpoint(net, x, use_reentrant=reentrant)
    y.sum().backward()
    assert_same(y, y_ref, what="output")
    for got, want in zip((x.grad, lin1.weight.grad, lin2.weight.grad), expected):
        assert_same(got, want, what="grad")


@pytest.mark.slow
@pytest.mark.parametrize("stock", [nn.Dropout(0.3), nn.Dropout2d(0.3)], ids=repr)
def test_compile_fullgraph(stock):
    torch._dynamo.reset()
    slim = torch.compile(slim_copy(stock), fullgraph=True)
    x = nonzero_input((4, 6, 3, 3), torch.float32).requires_grad_()
    g = torch.randn(4, 6, 3, 3)
    out = slim(x)
    out.backward(g)
    keep = out.detach() != 0
    noise = torch.where(keep, scale_of(0.3, torch.float32), 0.0)
    assert_same(out, x.detach() * noise, what="output")
    assert_same(x.grad, g * noise, what="grad")
    assert 0 < keep.float().mean() < 1


@pytest.mark.slow
@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor-rng", "fallback_random"])
def test_compiled_dropout_and_lora_dropout_draw_compiled_stocks_masks(fallback_random):
    """Under torch.compile the masks are compiled stock's under the same seed: Inductor's own draw by default, and
    with ``torch._inductor.config.fallback_random`` eager's kernel, as compiled stock then runs. Both draw through
    aten.native_dropout, the op stock's dropout traces to; a rand_like written out drew Inductor's mask in the
    second case too (a compile sweep: LoRA losses 1e-3 relative off, LoRA gradients unrelated)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 8))
    stock = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_dropout=0.2, target_modules=["2"],
                                                      init_lora_weights=False))
    slim = slimgrad.convert(stock)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    results = []
    with torch._inductor.config.patch(fallback_random=fallback_random):
        for model in (stock, slim):
            torch._dynamo.reset()
            torch.manual_seed(7)
            out = torch.compile(model, fullgraph=True)(x)
            out.square().sum().backward()
            results.append((out.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (out_s, grads_s), (out_k, grads_k) = results
    assert_same(out_k, out_s, what="output")
    for gk, gs in zip(grads_k, grads_s, strict=True):
        assert_same(gk, gs, what="grad")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_bits_policy_is_stock_bitwise(dtype, layout, inplace):
    """Policy "bits" draws stock's mask from the default generator: output and gradient are stock's."""
    base = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    base[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    if layout == "channels_last":
        base = base.contiguous(memory_format=torch.channels_last)
    g = torch.randn(2, 3, 4, 6 if layout != "sliced" else 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (F.dropout, lambda t, p, training, inplace: dropout(t, p, training, inplace, policy="bits")):
        leaf = base.clone().requires_grad_()
        x = leaf[..., ::2] if layout == "sliced" else leaf
        torch.manual_seed(3)
        with SavedTensors() as counter:
            out = fn(x * 1.0 if inplace else x, 0.3, True, inplace)
        out.backward(g)
        results.append((out, leaf.grad, counter.bytes))
    (so, sg, sb), (mo, mg, mb) = results
    assert_same(mo, so, what="output")
    assert_same(mg, sg, what="grad")
    assert mb == math.ceil(so.numel() / 8) and sb >= so.numel() * so.element_size()


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 1, 5)])  # size 1: TensorIterator's tie-breaking
def test_input_grad_layout_matches_stock(inplace, shape):
    """Stock's gradient is ``grad * noise``, laid out after the incoming gradient first: ours has the same
    strides (and, policy "bits", the same bits) for every pair of input and gradient layouts."""
    values = nonzero_input(shape, torch.float32)
    grad_values = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    stock = nn.Dropout(0.3, inplace=inplace)
    for x_layout in ("contiguous", "channels_last", "transposed"):
        x = laid_out(values, x_layout)
        for g_layout in ("contiguous", "channels_last", "transposed", "sliced", "expanded"):
            grad = laid_out(grad_values, g_layout)
            ys, dxs = input_grad_as_returned(stock, x, grad, seed=3)
            for policy in ("bits", "seed"):
                ym, dxm = input_grad_as_returned(functools.partial(dropout, p=0.3, inplace=inplace, policy=policy),
                                                 x, grad, seed=3)
                what = f"{policy}: x {x_layout}, grad {g_layout}"
                assert dxm.stride() == dxs.stride() and ym.stride() == ys.stride(), what
                if policy == "bits":
                    assert_same(ym, ys, what=what)
                    assert_same(dxm, dxs, what=what)


def test_policy_option_and_errors():
    from slimgrad import convert
    from slimgrad.functional.dropout import dropout_policy, get_dropout_policy

    x = torch.randn(64, requires_grad=True)
    model = convert(nn.Sequential(nn.Dropout(0.5)), dropout="seed")
    assert saved_bytes(model, x) == 8
    assert saved_bytes(convert(nn.Sequential(nn.Dropout(0.5)), dropout="bits"), x) == 8  # 64 bits
    with dropout_policy("seed"):
        assert get_dropout_policy() == "seed"
        assert saved_bytes(dropout, x, 0.5) == 8
        assert saved_bytes(dropout, x, 0.5, policy="bits") == 8
    assert get_dropout_policy() == "auto"
    with pytest.raises(ValueError, match="convert's argument 'dropout'"):
        convert(nn.Dropout(), dropout="mask")
    with pytest.raises(ValueError, match="'policy'"):
        dropout(x, 0.5, policy="never")


@pytest.mark.parametrize("policy", ["bits", "seed"])
def test_checkpoint_same_mask_under_each_policy(policy):
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for use_ckpt in (False, True):
        torch.manual_seed(5)
        f = lambda t: dropout(lin(t), 0.4, policy=policy)  # noqa: E731
        out = checkpoint(f, x, use_reentrant=False) if use_ckpt else f(x)
        grads.append(torch.autograd.grad(out.sum(), x)[0])
    assert_same(grads[1], grads[0], what="grad")


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("policy", ["bits", "seed"])
def test_inplace_on_a_view_of_an_activation(policy, core):
    """In-place dropout on a view of a non-leaf (MobileNetV2's classifier drops its pooled view in place): the
    Python Function returns one tensor there (autograd refuses a second output from a Function that modifies a
    view in place; it failed before, on every device the compiled core does not serve). "bits" gives stock's
    output and gradient bitwise; "seed" the same numbers as its own out-of-place call with the same seed."""
    import contextlib

    from slimgrad import csrc

    results = []
    slim = functools.partial(dropout, policy=policy)
    runs = [(F.dropout, True) if policy == "bits" else (slim, False), (slim, True)]
    for fn, inplace in runs:
        leaf = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
        h = leaf * 2
        view = h[:, :, 0]
        torch.manual_seed(1)
        with contextlib.nullcontext() if core else csrc.disabled():
            out = fn(view, 0.3, True, inplace)
            if inplace:
                assert out is view
                total = h
            else:
                total = torch.cat([out.unsqueeze(-1), h[:, :, 1:]], -1)
            total.backward(torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(2)))
        results.append((out.detach().clone(), leaf.grad))
    (ro, rg), (mo, mg) = results
    assert_same(mo, ro, what="output")
    assert_same(mg, rg, what="grad")


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_no_gradient_runs_stocks_op_and_peaks_as_stock(dtype, inplace, core):
    """A dropout whose input needs no gradient (before a trainable conv: a segmentation head's pattern): nothing is
    kept, so stock's op runs; the packed mask made beside stock's noise had put the step's peak 1 bit an element
    above stock's. Outputs, gradients and the generator's state are stock's."""
    from slimgrad import csrc
    from slimgrad.measure import peak_bytes

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Dropout(0.1, inplace=inplace), nn.Conv2d(16, 3, 1)).to(dtype).train()
    slim = slimgrad.convert(stock)
    x = torch.randn(4, 16, 16, 16).to(dtype)
    results = []
    with contextlib.nullcontext() if core else csrc.disabled():
        for model in (stock, slim):
            def step(model=model):
                torch.manual_seed(5)
                out = model(x.clone())
                out.float().sum().backward()
                return out

            step()  # (warm-up: one-time allocations)
            peak = peak_bytes(step)
            model.zero_grad(set_to_none=True)
            out = step()
            results.append((out, [p.grad for p in model.parameters()], torch.rand(1), peak))
    (ys, gs, rs, peak_stock), (ym, gm, rm, peak_slim) = results
    assert_same(ym, ys, what="output")
    for a, b in zip(gm, gs):
        assert_same(a, b, what="grad")
    assert torch.equal(rm, rs)  # the same draws from the generator
    assert peak_slim <= peak_stock, (peak_slim, peak_stock)


@pytest.mark.parametrize("p", [1 - 1e-5, 1 - 1e-7])
@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("policy", ["bits", "seed"])
def test_fp16_scale_rounded_to_inf_drops_to_zero_as_stock(p, core, policy):
    """fp16 rounds 1 / (1 - p) to inf for p > 1 - 1/65504: stock's noise (bernoulli_ then div_) is 0 at dropped
    elements, a 0/1 mask times the scale gave 0 * inf = NaN (the degenerate-shapes sweep). bits: stock's own draw,
    so stock's bits; seed: its own mask, so the dropped elements are 0 and the kept ones x * inf, as stock's."""
    from slimgrad import csrc

    x = torch.randn(4, 17, generator=torch.Generator().manual_seed(0)).half()
    with contextlib.nullcontext() if core else csrc.disabled():
        torch.manual_seed(3)
        xs = x.clone().requires_grad_()
        ys = F.dropout(xs, p)
        torch.manual_seed(3)
        xg = x.clone().requires_grad_()
        yg = dropout(xg, p, policy=policy)
        g = torch.ones_like(ys)
        ys.backward(g)
        yg.backward(g)
    if policy == "bits":
        assert_same(yg, ys)
        assert_same(xg.grad, xs.grad)
    dropped = yg == 0
    assert not yg.isnan().any() and not xg.grad.isnan().any()
    assert bool(((yg.abs() == math.inf) | dropped).all())
    assert torch.equal(xg.grad == 0, dropped)


@pytest.mark.parametrize("shape, dtype", [((1,), torch.float32), ((1,), torch.float16), ((3,), torch.bfloat16),
                                          ((2, 1), torch.float16)])
def test_seed_policy_keeps_no_more_than_stock_on_tiny_tensors(shape, dtype):
    """The seed's 8 bytes were more than stock's noise on a tensor of under 8 bytes (4 B for one fp32 element; the
    degenerate-shapes sweep): such a call runs the bits policy."""
    x = torch.randn(shape).to(dtype)
    with SavedTensors() as stock_kept:
        F.dropout(x.clone().requires_grad_(), 0.5)
    with SavedTensors() as kept:
        dropout(x.clone().requires_grad_(), 0.5, policy="seed")
    assert kept.bytes <= stock_kept.bytes, (kept.records, stock_kept.records)
