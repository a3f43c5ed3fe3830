"""RMSNorm / LayerNorm / GroupNorm against stock PyTorch (bitwise), FusedAddRMSNorm and PolyNorm against
their formulas in plain PyTorch, saved bytes against the analytical minimum, and frozen weights' gradients
never computed."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._util import assert_same, grad_combos, input_grad_as_returned, laid_out, set_requires_grad, slim_copy
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from slimgrad.functional.norms import fused_add_rms_norm, group_norm, layer_norm, poly_norm, rms_norm, rms_norm_hf
from slimgrad.measure import peak_bytes, saved_bytes
from slimgrad.nn.norms import FusedAddRMSNorm, GroupNorm, LayerNorm, PolyNorm, RMSNorm

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _nbytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * torch.tensor([], dtype=dtype).element_size()


def _opmath(dtype):
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1.5, 1.5)


def compare(stock, slim, shape, rg, dtype, *, exact=True, tol=None, what=""):
    """One forward/backward on independent copies; outputs, requested grads and absent frozen grads."""
    rg_x, *rg_p = rg
    names = [n for n in ("weight", "bias") if getattr(stock, n, None) is not None]
    for m in (stock, slim):
        set_requires_grad(m, **dict(zip(names, rg_p)))
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(shape, generator=gen).to(dtype)
    xs, xm = base.clone().requires_grad_(rg_x), base.clone().requires_grad_(rg_x)
    ys, ym = stock(xs), slim(xm)
    kw = {} if exact else dict(exact=False, **(tol or {}))
    assert_same(ym, ys, what=f"{what} output", **kw)
    assert ym.requires_grad == ys.requires_grad
    if ys.requires_grad:
        g = torch.randn(ys.shape, generator=gen).to(ys.dtype)
        ys.backward(g)
        ym.backward(g.clone())
    assert_same(xm.grad, xs.grad, what=f"{what} input grad", **kw)
    for n in names:
        assert_same(getattr(slim, n).grad, getattr(stock, n).grad, what=f"{what} {n} grad", **kw)
        if not getattr(stock, n).requires_grad:
            assert getattr(slim, n).grad is None


# ---------------------------------------------------------------------------------------------- RMSNorm
RMS_OPTIONS = {
    "default": dict(normalized_shape=8),
    "2d-shape": dict(normalized_shape=(3, 8), eps=1e-5),
    "no-affine": dict(normalized_shape=8, elementwise_affine=False),
}


def rms_minimum(stock, x, rg_x, rg_w):
    """x in its own dtype + one opmath stat per row when dX is requested; when only dW is, the smaller of
    that and the normalised input x·rstd (opmath: torch.rms_norm multiplies w in opmath)."""
    rg_w = rg_w and stock.weight is not None
    if not (rg_x or rg_w):
        return 0
    rows = x.numel() // _nbytes(stock.normalized_shape, torch.uint8)
    full = _nbytes(x.shape, x.dtype) + rows * _nbytes((1,), _opmath(x.dtype))
    if not rg_x:
        return min(full, _nbytes(x.shape, _opmath(x.dtype)))
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 16), (0, 5), (3, 1)], ids=["2x4x16", "empty", "one-column"])
def test_rms_norm_never_keeps_more_than_stock(shape, dtype):
    """Every requires_grad combination, a module (Parameter weight) and the functional form with a plain-tensor
    weight (which counts when kept): never above stock's F.rms_norm, and the analytical minimum. Only-dW used to
    keep the weight tensor too (e.g. (2, 4, 16) fp32: 576 vs 512 bytes; (0, 5): 20 vs 0)."""
    h = shape[-1]
    for rg_x, rg_w, affine in [(x, w, a) for x, w in grad_combos(2) for a in (True, False) if a or not w]:
        stock = nn.RMSNorm(h, elementwise_affine=affine, dtype=dtype)
        if affine:
            stock.weight.requires_grad_(rg_w)
        slim = slim_copy(stock)
        x = torch.randn(shape).to(dtype).requires_grad_(rg_x)
        expected = rms_minimum(stock, x, rg_x, rg_w)
        assert saved_bytes(slim, x) == expected <= saved_bytes(stock, x)
        w = torch.randn(h, dtype=dtype, requires_grad=rg_w) if affine else None
        plain = expected + (_nbytes((h,), dtype) if rg_x and affine else 0)  # dX reads w, kept as stock keeps it
        ours = saved_bytes(lambda t, w=w: rms_norm(t, (h,), w), x)
        assert ours == plain <= saved_bytes(lambda t, w=w: torch.nn.functional.rms_norm(t, (h,), w), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt", list(RMS_OPTIONS))
def test_rms_norm_matches_stock(opt, dtype):
    kw = RMS_OPTIONS[opt]
    shape = (2, 3, 8)
    for rg in grad_combos(2):
        torch.manual_seed(0)
        stock = nn.RMSNorm(**kw).to(dtype)
        _randomize(stock)
        slim = slim_copy(stock)
        assert type(slim) is RMSNorm
        compare(stock, slim, shape, rg, dtype, what=f"{opt} {dtype} rg={rg}")
        x = torch.randn(shape).to(dtype).requires_grad_(rg[0])
        set_requires_grad(slim, weight=rg[1])
        set_requires_grad(stock, weight=rg[1])
        got, ref = saved_bytes(slim, x), saved_bytes(stock, x)
        assert got == rms_minimum(slim, x, *rg), (rg, got)
        assert got <= ref
        if rg[0] and dtype in (torch.bfloat16, torch.float16):
            assert got < ref  # stock keeps the fp32 upcast of x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,normalized", [((2, 3, 6), (6,)), ((2, 3, 1, 6), (6,)), ((2, 3, 4, 6), (4, 6))])
def test_rms_norm_layouts_match_stock(shape, normalized, dtype):
    """Stock's composite returns a contiguous output unless x is channels-last (so ``y.view(-1)`` works on
    a transposed input), and its input gradient has the layout of autograd's in-place sum of x's two
    gradients: ours has the same strides, values and bits, for every pair of input and gradient layouts."""
    torch.manual_seed(0)
    stock = nn.RMSNorm(normalized).to(dtype)
    _randomize(stock)
    slim = slim_copy(stock)
    values = torch.randn(shape).to(dtype)
    grad_values = torch.randn(shape).to(dtype)
    layouts = ["contiguous", "transposed"] + (["channels_last"] if len(shape) == 4 else [])
    for x_layout in layouts + ["sliced"]:
        x = laid_out(values, x_layout)
        with torch.no_grad():
            ys, ym = stock(x), slim(x)
        assert ym.stride() == ys.stride() and ym.is_contiguous() == ys.is_contiguous(), x_layout
        assert_same(ym, ys, what=x_layout)
        if x_layout == "sliced":
            continue  # input_grad_as_returned takes dense layouts
        for g_layout in layouts + ["sliced", "expanded"]:
            grad = laid_out(grad_values, g_layout)
            ys, dxs = input_grad_as_returned(stock, x, grad)
            ym, dxm = input_grad_as_returned(slim, x, grad)
            what = f"x {x_layout}, grad {g_layout}"
            assert ym.stride() == ys.stride() and dxm.stride() == dxs.stride(), what
            assert_same(ym, ys, what=what)
            assert_same(dxm, dxs, what=what)
            assert_same(slim.weight.grad, stock.weight.grad, what=what)
            stock.weight.grad = slim.weight.grad = None
    x = laid_out(values, "transposed")
    assert slim(x).view(-1).shape == stock(x).view(-1).shape  # the tester's failure: view on a copy's output


def test_rms_norm_functional_default_eps_and_errors():
    x = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(6, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, (6,), w), torch.nn.functional.rms_norm(x, (6,), w))
    with pytest.raises(RuntimeError, match="slimgrad: rms_norm: argument 'input' must end in normalized_shape"):
        rms_norm(x, (5,), w)
    with pytest.raises(RuntimeError, match="'weight'"):
        rms_norm(x, (6,), torch.ones(5))
    with pytest.raises(TypeError, match="'input'"):
        rms_norm([1.0], (1,))
    with pytest.raises(ValueError, match="'eps'"):
        rms_norm(x, (6,), w, eps=-1.0)


class CountOps(TorchDispatchMode):
    """Counts aten ops by name while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backward_ops(module, x):
    y = module(x)
    g = torch.randn_like(y)
    with CountOps() as counter:
        y.backward(g)
    return counter.ops


@pytest.mark.parametrize("make", [lambda: nn.RMSNorm(16), lambda: nn.LayerNorm(16), lambda: nn.GroupNorm(2, 4)],
                         ids=["rms", "layer", "group"])
def test_frozen_weight_gradient_never_computed(make):
    """With the weight frozen, backward runs no reduction over rows (RMSNorm: no ``sum`` down to the weight's
    shape) or asks the stock kernel for no weight gradient (LayerNorm/GroupNorm: output_mask[1] False)."""
    stock = make()
    slim = slim_copy(stock)
    slim.weight.requires_grad_(False)
    shape = (3, 4, 16) if not isinstance(stock, nn.GroupNorm) else (3, 4, 5)
    x = torch.randn(shape, requires_grad=True)
    if isinstance(stock, nn.RMSNorm):
        frozen, trained = _backward_ops(slim, x), None
        slim.weight.requires_grad_(True)
        trained = _backward_ops(slim, x)
        # the only difference: dW's product and its row reduction (sum over all but the last dim)
        assert trained.count("sum") == frozen.count("sum") + 1
        assert slim.weight.grad is not None
        return
    calls = []
    original = torch.ops.aten.native_layer_norm_backward if isinstance(stock, nn.LayerNorm) else \
        torch.ops.aten.native_group_norm_backward

    class Masks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is original:
                calls.append(list(args[-1]))
            return func(*args, **(kwargs or {}))

    x.grad = None
    y = slim(x)
    with Masks():
        y.backward(torch.randn_like(y))
    assert calls == [[True, False, True]]
    assert slim.weight.grad is None


# ----------------------------------------------------------------------------------- LayerNorm / GroupNorm
LN_OPTIONS = {
    "default": dict(normalized_shape=8),
    "no-bias": dict(normalized_shape=8, bias=False),
    "no-affine": dict(normalized_shape=8, elementwise_affine=False),
    "2d-shape": dict(normalized_shape=(3, 8), eps=1e-3),
}


def norm_stats_dtype(x, weight):
    """Stock native_layer/group_norm statistics: fp32 for mixed (half input, fp32 params), else x's dtype."""
    return torch.float32 if weight is not None and weight.dtype != x.dtype else x.dtype


def ln_minimum(module, x, rg):
    """x + mean + rstd (one each per row / per (sample, group)) when dX or dW is requested; nothing when
    only the bias trains."""
    rg_x, rg_w, rg_b = rg
    rg_w = rg_w and module.weight is not None
    if not (rg_x or rg_w):
        return 0
    if isinstance(module, nn.GroupNorm):
        rows = x.shape[0] * module.num_groups
    else:
        rows = x.numel() // _nbytes(module.normalized_shape, torch.uint8)
    return _nbytes(x.shape, x.dtype) + 2 * rows * _nbytes((1,), norm_stats_dtype(x, module.weight))


def _combos(module):
    has_w, has_b = module.weight is not None, getattr(module, "bias", None) is not None
    return [c for c in grad_combos(3) if (has_w or not c[1]) and (has_b or not c[2])]


@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, None), (torch.float64, None),
                                               (torch.bfloat16, None), (torch.float16, None),
                                               (torch.bfloat16, torch.float32)],
                         ids=["fp32", "fp64", "bf16", "fp16", "bf16+fp32"])
@pytest.mark.parametrize("opt", list(LN_OPTIONS) + ["group", "group-no-affine", "group-1d"])
def test_layer_group_norm_match_stock(opt, dtype, param_dtype):
    if opt.startswith("group"):
        make = {"group": lambda: nn.GroupNorm(2, 4), "group-no-affine": lambda: nn.GroupNorm(2, 4, affine=False),
                "group-1d": lambda: nn.GroupNorm(4, 4, eps=1e-3)}[opt]
        shape = (3, 4, 5, 2) if opt != "group-1d" else (3, 4)
    else:
        make = lambda: nn.LayerNorm(**LN_OPTIONS[opt])  # noqa: E731
        shape = (2, 3, 8)
    for rg in _combos(make()):
        torch.manual_seed(0)
        stock = make().to(param_dtype or dtype)
        _randomize(stock)
        slim = slim_copy(stock)
        assert type(slim) in (LayerNorm, GroupNorm)
        compare(stock, slim, shape, rg, dtype, what=f"{opt} {dtype} rg={rg}")
        for m in (stock, slim):
            set_requires_grad(m, weight=rg[1], bias=rg[2])
        x = torch.randn(shape).to(dtype).requires_grad_(rg[0])
        got, ref = saved_bytes(slim, x), saved_bytes(stock, x)
        assert got == ln_minimum(slim, x, rg), (rg, got)
        if rg == (False, False, True):
            assert got == 0 < ref


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_bias_only_backward_peak_not_above_stock(kind):
    """dY stands in for x in the bias-only backward: the kernel must not copy it (peak no higher than stock's,
    whose backward holds x)."""
    stock = nn.LayerNorm(256) if kind == "layer" else nn.GroupNorm(4, 64)
    slim = slim_copy(stock)
    shape = (64, 256) if kind == "layer" else (8, 64, 64)
    for m in (stock, slim):
        m.weight.requires_grad_(False)
    x = torch.randn(shape)
    g = torch.randn(shape)

    def step(m):
        y = m(x)
        return lambda: y.backward(g)

    back_stock, back_slim = step(stock), step(slim)
    assert peak_bytes(back_slim) <= peak_bytes(back_stock) + 4096
    assert_same(slim.bias.grad, stock.bias.grad, what="bias grad")


def test_layer_norm_functional_errors():
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="slimgrad: layer_norm: argument 'input' must end in normalized_shape"):
        layer_norm(x, (3,))
    with pytest.raises(RuntimeError, match="'bias'"):
        layer_norm(x, (4,), torch.ones(4), torch.ones(3))


@pytest.mark.parametrize("make,shape,blamed", [
    (lambda: nn.LayerNorm(5), (2, 4), "argument 'input' must end in normalized_shape \\[5\\]"),
    (lambda: nn.LayerNorm((3, 5)), (5,), "argument 'input' must end in normalized_shape \\[3, 5\\]"),
    (lambda: nn.RMSNorm(5), (2, 4), "argument 'input' must end in normalized_shape \\[5\\]"),
    (lambda: nn.GroupNorm(2, 4), (2, 6, 3), "argument 'input' must have num_channels=4 channels"),
    (lambda: nn.GroupNorm(2, 4), (2, 5, 3), "argument 'input' must have num_channels=4 channels"),
    (lambda: nn.GroupNorm(4, 4, affine=False), (2, 6, 3), "argument 'input' has 6 channels .* not divisible"),
    (lambda: nn.GroupNorm(2, 4), (4,), "argument 'input' must have at least 2 dims"),
], ids=["layer", "layer_2d", "rms", "group_channels", "group_channels_indivisible", "group_no_affine", "group_1d"])
def test_wrong_input_shape_raises_stocks_exception_type(make, shape, blamed):
    """Code that catches stock's exception keeps catching ours; ours names the argument that is wrong (the
    input, not the module's weight) and says slimgrad raised it."""
    stock = make()
    x = torch.randn(shape)
    with pytest.raises(Exception) as stock_error:
        stock(x)
    with pytest.raises(Exception) as slim_error:
        slim_copy(stock)(x)
    assert slim_error.type is stock_error.type is RuntimeError
    assert str(slim_error.value).startswith("slimgrad: ")
    assert re.search(blamed, str(slim_error.value)), str(slim_error.value)


def test_wrong_parameter_shape_raises_stocks_exception_type():
    """The functional forms: a parameter of the wrong shape is named, with stock's exception type."""
    x = torch.randn(2, 6, 3)
    for ours, theirs, args, blamed in [
        (layer_norm, F.layer_norm, ((3,), torch.ones(2)), "'weight'"),
        (rms_norm, F.rms_norm, ((3,), torch.ones(2)), "'weight'"),
        (group_norm, F.group_norm, (2, torch.ones(6), torch.ones(4)), "'bias' has 4"),
        (group_norm, F.group_norm, (2, torch.ones(6, 1)), "'weight' must be a vector"),
    ]:
        with pytest.raises(Exception) as stock_error:
            theirs(x, *args)
        with pytest.raises(Exception, match=blamed) as slim_error:
            ours(x, *args)
        assert slim_error.type is stock_error.type is RuntimeError
        assert str(slim_error.value).startswith("slimgrad: ")
    # The Hugging Face RMSNorms' ``weight * x`` raises a RuntimeError on a wrong hidden size; so does ours.
    with pytest.raises(RuntimeError, match="slimgrad: rms_norm_hf: argument 'input' must have the weight's size 4"):
        rms_norm_hf(x, torch.ones(4))


def test_group_norm_channels_last():
    """channels_last input. Where dX is not requested, stock torch 2.13 segfaults (its channels-last CPU
    backward writes dX unconditionally), so those cases are compared with stock on a contiguous copy of x."""
    for rg in grad_combos(3):
        stock = nn.GroupNorm(2, 8)
        _randomize(stock)
        slim = slim_copy(stock)
        for m in (stock, slim):
            set_requires_grad(m, weight=rg[1], bias=rg[2])
        base = torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last)
        xm = base.clone().requires_grad_(rg[0])
        ym = slim(xm)
        with torch.set_grad_enabled(rg[0]):
            ys = stock(base.clone().requires_grad_(rg[0]))
        assert_same(ym, ys, what=f"output rg={rg}")
        if not ym.requires_grad:
            continue
        # contiguous x and mean/rstd from the contiguous forward (1-ulp apart): fp32 tolerance
        kw = {} if rg[0] else dict(exact=False, rtol=1e-5, atol=1e-6)
        xs = (base if rg[0] else base.contiguous()).clone().requires_grad_(rg[0])
        ys = stock(xs)
        g = torch.randn_like(ys)
        ys.backward(g)
        ym.backward(g.clone())
        assert_same(xm.grad, xs.grad, what=f"input grad rg={rg}")
        assert_same(slim.bias.grad, stock.bias.grad, what=f"bias grad rg={rg}", **kw)
        assert_same(slim.weight.grad, stock.weight.grad, what=f"weight grad rg={rg}", **kw)


# ------------------------------------------------------------------------------------------ FusedAddRMSNorm
def _llama_reference(s, weight, eps):
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype)


@pytest.mark.parametrize("use_ds", [False, True], ids=["no-ds", "ds"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_add_rms_norm(dtype, use_ds):
    """Same as Llama RMSNorm on the explicit sum (bitwise: the same ops), including ds_out = None."""
    for rg in grad_combos(3):
        torch.manual_seed(0)
        mod = FusedAddRMSNorm(8).to(dtype)
        _randomize(mod)
        w_ref = copy.deepcopy(mod.weight).requires_grad_(rg[2])
        mod.weight.requires_grad_(rg[2])
        x0, r0 = torch.randn(2, 3, 8).to(dtype), torch.randn(2, 3, 8).to(dtype)
        xs, rs = x0.clone().requires_grad_(rg[0]), r0.clone().requires_grad_(rg[1])
        xm, rm = x0.clone().requires_grad_(rg[0]), r0.clone().requires_grad_(rg[1])
        s_ref = xs + rs
        y_ref = _llama_reference(s_ref, w_ref, mod.eps)
        y, s = mod(xm, rm)
        assert_same(y, y_ref, what="y")
        assert_same(s, s_ref, what="s")
        if not y_ref.requires_grad:
            assert not y.requires_grad
            continue
        gy, gs = torch.randn_like(y), torch.randn_like(s)
        both = use_ds and s_ref.requires_grad
        outs_ref, outs = ([y_ref, s_ref], [y, s]) if both else ([y_ref], [y])
        torch.autograd.backward(outs_ref, [gy, gs][:len(outs_ref)])
        torch.autograd.backward(outs, [gy.clone(), gs.clone()][:len(outs)])
        # bf16: the norm's two fp32 terms are summed, cast, then ds_out added, in both (bitwise). fp32: no cast,
        # so autograd adds the three terms reaching s in its own order: equal within 1-2 fp32 ulps.
        kw = dict(exact=False, rtol=1e-6, atol=1e-6) if both and dtype == torch.float32 else {}
        assert_same(xm.grad, xs.grad, what="dx", **kw)
        assert_same(rm.grad, rs.grad, what="dr", **kw)
        assert_same(mod.weight.grad, w_ref.grad, what="dw")
        if not rg[2]:
            assert mod.weight.grad is None
    x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    kept = saved_bytes(mod, x, torch.randn(4, 8, dtype=dtype))
    assert kept == _nbytes((4, 8), dtype) + 4 * 4  # s + one fp32 rstd per row


def test_fused_add_rms_norm_only_s_used():
    """Backward through s alone (the norm's output unused): grad_out is None inside the Function."""
    mod = FusedAddRMSNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    r = torch.randn(2, 8, requires_grad=True)
    _, s = mod(x, r)
    g = torch.randn_like(s)
    s.backward(g)
    assert torch.equal(x.grad, g) and torch.equal(r.grad, g)
    assert mod.weight.grad is None
    with pytest.raises(ValueError, match="'residual'"):
        fused_add_rms_norm(x, torch.randn(3, 8), mod.weight)


# ----------------------------------------------------------------------------------------------- PolyNorm
def _poly_reference(x, w, b, eps):
    xf = x.to(_opmath(x.dtype))

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    w = w.to(xf.dtype)
    out = w[0] * norm(xf.pow(3)) + w[1] * norm(xf.pow(2)) + w[2] * norm(xf)
    if b is not None:
        out = out + b.to(xf.dtype)
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_poly_norm(dtype):
    """Forward is the reference's op sequence (bitwise); backward is the analytic gradient, equal within
    fp32 summation-order rounding (rtol 1e-5 fp32, fp64 1e-12; bf16 within one bf16 ulp of the result)."""
    tol = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]
    for rg in grad_combos(3):
        torch.manual_seed(0)
        mod = PolyNorm().to(dtype)
        _randomize(mod)
        w_ref = copy.deepcopy(mod.weight).requires_grad_(rg[1])
        b_ref = copy.deepcopy(mod.bias).requires_grad_(rg[2])
        set_requires_grad(mod, weight=rg[1], bias=rg[2])
        x0 = (torch.randn(3, 5, 16) * 0.7).to(dtype)
        xs, xm = x0.clone().requires_grad_(rg[0]), x0.clone().requires_grad_(rg[0])
        y_ref, y = _poly_reference(xs, w_ref, b_ref, mod.eps), mod(xm)
        assert_same(y, y_ref, what="y")
        if y_ref.requires_grad:
            g = torch.randn_like(y)
            y_ref.backward(g)
            y.backward(g.clone())
        assert_same(xm.grad, xs.grad, exact=False, **tol, what="dx")
        assert_same(mod.weight.grad, w_ref.grad, exact=False, **tol, what="dw")
        assert_same(mod.bias.grad, b_ref.grad, exact=False, **tol, what="db")
        x = x0.clone().requires_grad_(rg[0])
        kept = saved_bytes(mod, x)
        rows = 15
        expect = _nbytes(x0.shape, dtype) + 3 * rows * _nbytes((1,), _opmath(dtype)) if (rg[0] or rg[1]) else 0
        assert kept == expect, (rg, kept)
        ref_kept = saved_bytes(lambda t, w=w_ref, b=b_ref, e=mod.eps: _poly_reference(t, w, b, e), x,
                               exclude=[w_ref, b_ref])
        assert kept <= ref_kept


def test_poly_norm_errors():
    with pytest.raises(ValueError, match="'weight'"):
        poly_norm(torch.randn(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="'bias'"):
        poly_norm(torch.randn(2, 4), torch.ones(3), torch.ones(2))



@pytest.mark.parametrize("case", ["params", "input"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("kind", ["fused", "poly"])
def test_fused_add_and_poly_norm_under_torch_func(kind, transform, case):
    """FusedAddRMSNorm and PolyNorm run their own Function under grad and vmap(grad): the gradients (per sample
    under vmap) equal eager slimgrad's on the same samples, bitwise (the Function's backward, not the formula's
    autograd, which differs by an ulp), and the graph keeps what eager keeps for the same batch (s or x plus fp32
    per-row statistics: less than the formula keeps for PolyNorm; FusedAddRMSNorm saves there in reduced precision,
    not tested here). Under the "stock" policy the formula runs instead: the same gradients within rounding."""
    from torch.func import functional_call, grad, vmap

    from slimgrad.functional import _transforms
    from slimgrad.measure import graph_saved_bytes

    torch.manual_seed(0)
    mod = FusedAddRMSNorm(8) if kind == "fused" else PolyNorm()
    _randomize(mod)
    x, r = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    params = {k: v.detach() for k, v in mod.named_parameters()}

    def run(m, p, xi, ri):
        out = functional_call(m, p, (xi, ri) if kind == "fused" else (xi,))
        return out if kind == "fused" else (out,)

    def loss(p, xi, ri):
        outs = run(mod, p, xi.unsqueeze(0), ri.unsqueeze(0))
        kept.append(graph_saved_bytes(*outs, exclude=[mod]))
        return sum((o * (i + 1.5)).square().sum() for i, o in enumerate(outs))

    argnums = 0 if case == "params" else 1
    got = {}
    for policy in ("save", "stock"):
        kept = []
        with _transforms.func_policy(policy):
            if transform == "vmap":
                got[policy] = vmap(grad(loss, argnums=argnums), in_dims=(None, 0, 0))(params, x, r)
            else:
                got[policy] = grad(loss, argnums=argnums)(params, x[0].clone(), r[0].clone())
        got[policy + " bytes"] = kept[-1]
    samples = range(4) if transform == "vmap" else range(1)
    for i in samples:
        m = copy.deepcopy(mod).requires_grad_(case == "params")
        xi = x[i:i + 1].clone().requires_grad_(case == "input")
        outs = run(m, dict(m.named_parameters()), xi, r[i:i + 1])
        sum((o * (j + 1.5)).square().sum() for j, o in enumerate(outs)).backward()
        for policy, exact in (("save", True), ("stock", False)):
            if case == "params":
                for k, p in m.named_parameters():
                    g = got[policy][k][i] if transform == "vmap" else got[policy][k]
                    assert_same(g, p.grad, exact=exact, rtol=1e-5, atol=1e-5, what=f"{policy} d{k}")
            else:
                g = got[policy][i] if transform == "vmap" else got[policy]
                assert_same(g, xi.grad[0], exact=exact, rtol=1e-5, atol=1e-5, what=f"{policy} dx")
    batch = x if transform == "vmap" else x[:1]
    eager = copy.deepcopy(mod).requires_grad_(case == "params")
    args = (batch.clone().requires_grad_(case == "input"),) + ((r[:batch.shape[0]].clone(),) if kind == "fused" else ())
    assert got["save bytes"] == saved_bytes(eager, *args)
    if kind == "poly":
        assert got["save bytes"] < got["stock bytes"]


# ------------------------------------------------------------------------- shapes, checkpoint, compile, gradcheck
@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), h=st.integers(1, 33),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), rg=st.sampled_from(grad_combos(3)),
       kind=st.sampled_from(["rms", "layer"]))
def test_shapes_hypothesis(lead, h, dtype, rg, kind):
    shape = (*lead, h)
    stock = (nn.RMSNorm(h) if kind == "rms" else nn.LayerNorm(h)).to(dtype)
    _randomize(stock)
    slim = slim_copy(stock)
    rg = rg if kind == "layer" else rg[:2]
    compare(stock, slim, shape, rg, dtype, what=f"{kind} {shape} {dtype} rg={rg}")


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("kind", ["rms", "layer", "group", "poly", "fused"])
def test_checkpoint(kind, reentrant):
    torch.manual_seed(0)
    mod = {"rms": lambda: RMSNorm(8), "layer": lambda: LayerNorm(8), "group": lambda: GroupNorm(2, 4),
           "poly": lambda: PolyNorm(), "fused": lambda: FusedAddRMSNorm(8)}[kind]()
    _randomize(mod)
    twin = copy.deepcopy(mod)
    x0 = torch.randn(3, 4, 8)
    run = (lambda m, t: m(t, t * 0.5)[0]) if kind == "fused" else (lambda m, t: m(t))
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya = torch.utils.checkpoint.checkpoint(run, mod, xa, use_reentrant=reentrant)
    yb = run(twin, xb)
    assert_same(ya, yb, what="output")
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g.clone())
    assert_same(xa.grad, xb.grad, what="dx")
    assert_same(mod.weight.grad, twin.weight.grad, what="dw")


def test_double_backward_refused():
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    y = rms_norm(x, (4,), torch.ones(4, dtype=torch.float64))
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|differentiable"):
        gx.sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_compile_fullgraph(kind):
    torch._dynamo.reset()
    stock = nn.RMSNorm(16) if kind == "rms" else nn.LayerNorm(16)
    _randomize(stock)
    slim = slim_copy(stock)
    compiled = torch.compile(slim, fullgraph=True)
    x0 = torch.randn(4, 16)
    xs, xm = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ys, ym = stock(xs), compiled(xm)
    torch.testing.assert_close(ym, ys)  # inductor may fuse the element-wise ops differently
    g = torch.randn_like(ys)
    ys.backward(g)
    ym.backward(g.clone())
    torch.testing.assert_close(xm.grad, xs.grad)
    torch.testing.assert_close(slim.weight.grad, stock.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("need_x", [False, True])
def test_rms_norm_on_a_view_keeps_no_more_than_stock(dtype, need_x):
    """Input one half of a wider tensor (a head of a fused projection). Where only the weight trains stock
    keeps the normalised input, compact; keeping x (a view) would pin the whole wider tensor: slimgrad then
    keeps the normalised input too. Values and gradients equal stock's."""
    from slimgrad.measure import SavedTensors

    torch.manual_seed(0)
    stock = nn.RMSNorm(64).to(dtype)
    slim = slim_copy(stock)
    wide = torch.randn(8, 16, 128, dtype=dtype)
    results = []
    for module in (stock, slim):
        h = wide.clone().requires_grad_(need_x)
        x = h[..., :64]
        with SavedTensors(exclude=[module]) as counter:
            y = module(x)
        y.float().square().sum().backward()
        results.append((y, h.grad, module.weight.grad, counter.bytes))
    (ys, hs, ws, bs), (yg, hg, wg, bg) = results
    assert bg <= bs, (bg, bs)
    assert_same(yg, ys)
    assert_same(wg, ws)
    if need_x:
        assert_same(hg, hs)


@pytest.mark.parametrize("weight_trains", [False, True])
def test_group_norm_batch_one_with_a_small_batch_stride(weight_trains):
    """diffusers' attention block hands group norm a batch-1 map made by transposing (N, HW, C): strides
    (32, 1, 256, 32), channels-last to ``is_contiguous(channels_last)`` (it ignores the size-1 batch) but not
    to torch's stride rule; ``native_group_norm`` refused it after conversion ("Expected X.is_contiguous(
    memory_format)"). Output, gradients and layouts equal stock's."""
    torch.manual_seed(0)
    stock = nn.GroupNorm(8, 32).requires_grad_(weight_trains)
    slim = slim_copy(stock)
    base = torch.randn(1, 64, 32)
    results = []
    for module in (stock, slim):
        x = base.clone().transpose(1, 2).view(1, 32, 8, 8).requires_grad_()
        y = module(x)
        y.square().sum().backward()
        results.append((y, x.grad, [p.grad for p in module.parameters()]))
    (ys, gs, ps), (yg, gg, pg) = results
    assert_same(yg, ys)
    assert yg.stride() == ys.stride()
    assert_same(gg, gs)
    for a, b in zip(pg, ps):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("weight_trains", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["torch", "llama"])
def test_rms_norm_of_a_fused_projections_slice_keeps_no_more_than_stock(kind, dtype, weight_trains, core):
    """q split from a fused qkv projection (a view of a 3x wider storage), x needing its gradient: a bf16/fp16 x was
    kept as the view, pinning the whole base (1.49x stock's bytes, which keeps fp32 copies of x's own size); now a
    compact copy there. An fp32 x stays the view, as stock keeps it (found by this stop's aliasing sweep)."""
    import slimgrad
    from slimgrad import csrc
    from slimgrad.measure import SavedTensors

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    if kind == "torch":
        stock = nn.RMSNorm(64, dtype=dtype)
    else:
        llama = pytest.importorskip("transformers.models.llama.modeling_llama")
        stock = llama.LlamaRMSNorm(64).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(-1.5, 1.5)
    stock.weight.requires_grad_(weight_trains)
    slim = slimgrad.convert(copy.deepcopy(stock))
    qkv0 = torch.randn(4, 16, 192, dtype=dtype, generator=torch.Generator().manual_seed(0))
    results = []
    for module in (stock, slim):
        qkv = qkv0.clone().requires_grad_()
        with contextlib.nullcontext() if core else csrc.disabled(), SavedTensors(exclude=[module]) as kept:
            out = module(qkv[..., :64])
        with contextlib.nullcontext() if core else csrc.disabled():
            out.float().square().sum().backward()
        results.append((out.detach(), qkv.grad, module.weight.grad, kept.bytes))
    (out_s, dx_s, dw_s, bytes_s), (out_c, dx_c, dw_c, bytes_c) = results
    assert torch.equal(out_c, out_s) and torch.equal(dx_c, dx_s)
    assert (dw_s is None and dw_c is None) or torch.equal(dw_c, dw_s)
    assert bytes_c <= bytes_s
    if dtype != torch.float32:  # a compact bf16/fp16 copy of q and fp32 rstd, not the qkv base
        assert bytes_c <= qkv0[..., :64].numel() * qkv0.element_size() + 4 * 16 * 4
