"""BatchNorm1d/2d/3d against stock PyTorch: bitwise outputs, gradients and running statistics, and the
analytical minimum of saved bytes, for every mode, option and requires_grad combination."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._util import assert_same, grad_combos, set_requires_grad, slim_copy
from torch import nn

from slimgrad.functional.batch_norm import batch_norm
from slimgrad.measure import peak_bytes, saved_bytes
from slimgrad.nn.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d

SHAPES = {
    "1d-2D": (nn.BatchNorm1d, (6, 3)),
    "1d-3D": (nn.BatchNorm1d, (4, 3, 5)),
    "2d": (nn.BatchNorm2d, (3, 3, 4, 5)),
    "3d": (nn.BatchNorm3d, (2, 3, 3, 4, 2)),
}
OPTIONS = {
    "default": {},
    "affine=False": {"affine": False},
    "momentum=None": {"momentum": None},
    "momentum=0.3": {"momentum": 0.3},
    "untracked": {"track_running_stats": False},
    "eps": {"eps": 1e-2},
}


def make_pair(stock_cls, num_features, *, train=True, dtype=torch.float32, seed=0, **options):
    """A stock module with non-trivial parameters and running statistics, and an independent slim copy."""
    torch.manual_seed(seed)
    stock = stock_cls(num_features, **options).to(dtype)
    with torch.no_grad():
        if stock.affine:
            stock.weight.uniform_(0.5, 1.5)
            stock.bias.uniform_(-0.5, 0.5)
        if stock.track_running_stats:
            stock.running_mean.uniform_(-0.5, 0.5)
            stock.running_var.uniform_(0.5, 2.0)
    stock.train(train)
    return stock, slim_copy(stock)


def grad_combos_for(affine: bool):
    return [c for c in grad_combos(3) if affine or not (c[1] or c[2])]


def expected_saved_bytes(module, x, rg_x, rg_w, rg_b):
    """The analytical minimum, from shapes: x plus per-channel mean and invstd when batch statistics are
    used and X or W needs a gradient; x alone in eval when W needs one; nothing otherwise."""
    rg_w = rg_w and module.affine
    batch_stats = module.training or not module.track_running_stats
    x_bytes = x.numel() * x.element_size()
    if batch_stats and (rg_x or rg_w):
        stat_dtype = module.weight.dtype if module.affine else (
            torch.float32 if x.dtype in (torch.bfloat16, torch.float16) and module.running_mean is not None
            and module.running_mean.dtype == torch.float32 else x.dtype)
        stat_size = torch.tensor([], dtype=stat_dtype).element_size()
        return x_bytes + 2 * x.shape[1] * stat_size
    if not batch_stats and rg_w:
        return x_bytes
    return 0


def compare_steps(stock, slim, shape, rg, *, dtype=torch.float32, steps=3, memory_format=None,
                  grad_format=None, what=""):
    """Run `steps` forward/backward steps on both modules with equal, independent inputs; compare all."""
    rg_x, rg_w, rg_b = rg
    for m in (stock, slim):
        set_requires_grad(m, weight=rg_w, bias=rg_b)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        base = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        g = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        if memory_format is not None:
            base = base.contiguous(memory_format=memory_format)
        if grad_format is not None:
            g = g.contiguous(memory_format=grad_format)
        xs = base.clone(memory_format=torch.preserve_format)
        xm = base.clone(memory_format=torch.preserve_format)
        xs.requires_grad_(rg_x)
        xm.requires_grad_(rg_x)
        ys, ym = stock(xs), slim(xm)
        w = f"{what} step {step}"
        assert_same(ym, ys, what=f"{w} output")
        assert ym.stride() == ys.stride(), f"{w} output strides"
        if ys.requires_grad:
            assert ym.requires_grad
            ys.backward(g.clone(memory_format=torch.preserve_format))
            ym.backward(g.clone(memory_format=torch.preserve_format))
        else:
            assert not ym.requires_grad
        assert_same(xm.grad, xs.grad, what=f"{w} input grad")
        if xs.grad is not None:
            assert xm.grad.stride() == xs.grad.stride(), f"{w} input grad strides"
        for name in ("weight", "bias"):
            p_s, p_m = getattr(stock, name), getattr(slim, name)
            if p_s is not None:
                assert_same(p_m.grad, p_s.grad, what=f"{w} {name} grad")
                if not p_s.requires_grad:
                    assert p_m.grad is None
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_same(getattr(slim, name), getattr(stock, name), what=f"{w} {name}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("opt", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("shape_id", list(SHAPES))
def test_matches_stock_every_combo(shape_id, opt, train):
    stock_cls, shape = SHAPES[shape_id]
    options = OPTIONS[opt]
    for rg in grad_combos_for(options.get("affine", True)):
        stock, slim = make_pair(stock_cls, shape[1], train=train, **options)
        assert type(slim).__name__ == stock_cls.__name__ and type(slim) is not stock_cls
        compare_steps(stock, slim, shape, rg, what=f"{shape_id} {opt} train={train} rg={rg}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("opt", ["default", "affine=False", "untracked"])
@pytest.mark.parametrize(
    "dtype,param_dtype",
    [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None), (torch.float16, None),
     (torch.bfloat16, torch.float32)],
    ids=["fp32", "fp64", "bf16", "fp16", "bf16+fp32"],
)
def test_saved_bytes_are_the_minimum(dtype, param_dtype, opt, train):
    shape = (4, 6, 5, 7)
    options = OPTIONS[opt]
    for rg in grad_combos_for(options.get("affine", True)):
        stock, slim = make_pair(nn.BatchNorm2d, shape[1], train=train, dtype=param_dtype or dtype,
                                **options)
        for m in (stock, slim):
            set_requires_grad(m, weight=rg[1], bias=rg[2])
        x = torch.randn(shape, dtype=dtype).requires_grad_(rg[0])
        got = saved_bytes(slim, x)
        assert got == expected_saved_bytes(slim, x, *rg), f"{dtype} {opt} train={train} rg={rg}"
        stock_bytes = saved_bytes(stock, x)
        assert got <= stock_bytes
        batch_stats = train or not stock.track_running_stats
        frozen_weight_eval = not batch_stats and not rg[1] and (rg[0] or rg[2])
        bias_only = stock.affine and rg == (False, False, True)
        if frozen_weight_eval or bias_only:
            assert got == 0 and stock_bytes >= x.numel() * x.element_size(), (rg, got, stock_bytes)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "dtype,param_dtype",
    [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None), (torch.float16, None),
     (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],
    ids=["fp32", "fp64", "bf16", "fp16", "bf16+fp32", "fp16+fp32"],
)
def test_dtypes(dtype, param_dtype, train):
    """Reduced precision, including the mixed case autocast produces (bf16 activations, fp32 BN)."""
    for shape_id in ("1d-2D", "2d", "3d"):
        stock_cls, shape = SHAPES[shape_id]
        for rg in [(True, True, True), (True, False, False), (False, False, True), (False, True, False)]:
            stock, slim = make_pair(stock_cls, shape[1], train=train, dtype=param_dtype or dtype)
            compare_steps(stock, slim, shape, rg, dtype=dtype, what=f"{shape_id} {dtype} rg={rg}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast(input_dtype, train):
    """batch_norm is on neither of CPU autocast's lists: it runs in its input's dtype, like stock."""
    for rg in [(True, True, True), (True, False, False), (False, False, True)]:
        stock, slim = make_pair(nn.BatchNorm2d, 4, train=train)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compare_steps(stock, slim, (3, 4, 5, 5), rg, dtype=input_dtype, what=f"autocast rg={rg}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "stock_cls,shape,fmt,grad_fmt",
    [
        (nn.BatchNorm2d, (3, 16, 4, 5), torch.channels_last, None),
        (nn.BatchNorm2d, (3, 16, 4, 5), torch.channels_last, torch.channels_last),
        (nn.BatchNorm2d, (3, 16, 4, 5), None, torch.channels_last),
        (nn.BatchNorm3d, (2, 16, 3, 4, 2), torch.channels_last_3d, torch.channels_last_3d),
        (nn.BatchNorm3d, (2, 16, 3, 4, 2), torch.channels_last_3d, None),
    ],
    ids=["cl-x", "cl-both", "cl-grad", "cl3d-both", "cl3d-x"],
)
def test_channels_last(stock_cls, shape, fmt, grad_fmt, dtype, train):
    for rg in [(True, True, True), (True, False, False), (False, False, True), (False, True, False)]:
        # bf16 activations run against fp32 parameters (the mixed kernels)
        stock, slim = make_pair(stock_cls, shape[1], train=train)
        compare_steps(stock, slim, shape, rg, dtype=dtype, memory_format=fmt, grad_format=grad_fmt,
                      what=f"fmt={fmt} grad={grad_fmt} rg={rg}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("upstream", ["expanded", "transposed-x"])
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float16, None), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "fp16", "bf16+fp32"])
def test_odd_layouts_gradient_layout(dtype, param_dtype, upstream, fmt, train):
    """Non-dense upstream gradients (sum().backward()) and non-dense inputs take the strided kernel path;
    the raw input gradient (autograd.grad, no AccumulateGrad restriding) has stock's values and layout."""
    for rg in [(True, False, False), (True, False, True), (True, True, True)]:
        stock, slim = make_pair(nn.BatchNorm2d, 4, train=train, dtype=param_dtype or dtype)
        for m in (stock, slim):
            set_requires_grad(m, weight=rg[1], bias=rg[2])
        base = torch.randn(3, 4, 5, 6).to(dtype).contiguous(memory_format=fmt)
        if upstream == "transposed-x":
            base = torch.randn(3, 4, 6, 5).to(dtype).transpose(2, 3)
        results = []
        for m in (stock, slim):
            leaf = base.clone().requires_grad_()
            x = leaf.as_strided(base.shape, base.stride()) if upstream == "transposed-x" else leaf * 1
            y = m(x)
            g = torch.ones((), dtype=dtype).expand(y.shape) if upstream == "expanded" else torch.randn(
                y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            params = [p for p in (m.weight, m.bias) if p.requires_grad]
            results.append((y, torch.autograd.grad(y, [x, *params], g)))
        (ys, gs), (ym, gm) = results
        assert_same(ym, ys, what="output")
        for a, b in zip(gm, gs):
            assert_same(a, b, what=f"grad rg={rg}")
            assert a.stride() == b.stride(), f"grad strides {a.stride()} != {b.stride()} rg={rg}"


def _backward_peak(module, x, g):
    y = module(x)
    peak = peak_bytes(lambda: y.backward(g))
    return peak


@pytest.mark.parametrize(
    "case,train,rg,fmt",
    [
        ("eval frozen weight", False, (True, False, False), None),
        ("eval frozen weight, mismatched grad format", False, (True, False, False), "grad-cl"),
        ("eval bias only", False, (False, False, True), None),
        ("train bias only", True, (False, False, True), None),
        ("train all", True, (True, True, True), None),
        ("train input only", True, (True, False, False), None),
        ("eval expanded grad, channels_last", False, (True, False, False), "expanded-cl"),
    ],
)
def test_backward_peak_not_above_stock(case, train, rg, fmt):
    shape = (4, 8, 32, 32)
    stock, slim = make_pair(nn.BatchNorm2d, shape[1], train=train)
    peaks = []
    for m in (stock, slim):
        set_requires_grad(m, weight=rg[1], bias=rg[2])
        x = torch.randn(shape)
        g = torch.randn(shape)
        if fmt == "grad-cl":
            g = g.contiguous(memory_format=torch.channels_last)
        if fmt == "expanded-cl":
            x = x.contiguous(memory_format=torch.channels_last)
            g = torch.ones(()).expand(shape)
        x.requires_grad_(rg[0])
        peaks.append(_backward_peak(m, x, g))
    assert peaks[1] <= peaks[0], f"{case}: slim {peaks[1]} > stock {peaks[0]}"


@settings(max_examples=15, deadline=None)
@given(
    dims=st.integers(0, 3),
    batch=st.integers(1, 4),
    channels=st.integers(1, 5),
    spatial=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    train=st.booleans(),
    affine=st.booleans(),
    track=st.booleans(),
    momentum=st.sampled_from([None, 0.1, 0.7]),
    rg=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_property(dims, batch, channels, spatial, train, affine, track, momentum, rg):
    # dims 0: BatchNorm1d on (N, C); 1: BatchNorm1d on (N, C, L); 2: BatchNorm2d; 3: BatchNorm3d
    stock_cls = [nn.BatchNorm1d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims]
    shape = (batch, channels, *spatial[:dims])
    if (train or not track) and shape[0] * (torch.Size(shape).numel() // (shape[0] * channels)) == 1:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            make_pair(stock_cls, channels, train=train, affine=affine, track_running_stats=track,
                      momentum=momentum)[1](torch.randn(shape))
        return
    stock, slim = make_pair(stock_cls, channels, train=train, affine=affine, track_running_stats=track,
                            momentum=momentum)
    compare_steps(stock, slim, shape, rg, steps=2, what=f"{shape} {rg}")
    x = torch.randn(shape).requires_grad_(rg[0])
    set_requires_grad(slim, weight=rg[1], bias=rg[2])
    assert saved_bytes(slim, x) == expected_saved_bytes(slim, x, *rg)


def test_double_backward_is_refused_clearly():
    _, slim = make_pair(nn.BatchNorm2d, 3, train=False, dtype=torch.float64)
    slim.weight.requires_grad_(False)  # eval with a frozen weight: our Function runs (keeps no x)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(slim(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


def test_stock_runs_where_it_keeps_what_we_keep():
    """Training with X needing grad (x is read either way): stock's own op runs, double backward included."""
    stock, slim = make_pair(nn.BatchNorm2d, 3, train=True, dtype=torch.float64)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    grads = []
    for m in (stock, slim):
        xi = x.clone().requires_grad_()
        out = m(xi)
        assert type(out.grad_fn).__name__ == "NativeBatchNormBackward0"
        (dx,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        grads.append(torch.autograd.grad(dx.pow(2).sum(), xi)[0])
    assert_same(grads[1], grads[0], what="double backward")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_checkpoint(reentrant, train):
    """Checkpointing reruns forward, so running statistics move twice: in stock too, equally."""
    from torch.utils.checkpoint import checkpoint

    # Reentrant checkpointing needs an input that requires grad to backpropagate at all.
    combos = [(True, True, True), (True, False, False), (True, False, True)]
    for rg in combos if reentrant else [*combos, (False, False, True), (False, True, False)]:
        stock, slim = make_pair(nn.BatchNorm2d, 3, train=train)
        outs = []
        for m in (stock, slim):
            set_requires_grad(m, weight=rg[1], bias=rg[2])
            torch.manual_seed(5)
            x = torch.randn(4, 3, 5, 5, requires_grad=rg[0])
            w = torch.randn(4, 3, 5, 5)
            y = checkpoint(lambda t, m=m: m(t) * 2, x, use_reentrant=reentrant)
            (y * w).sum().backward()
            outs.append((y, x.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var,
                         m.num_batches_tracked))
        for a, b in zip(outs[1], outs[0]):
            assert_same(a, b, what=f"checkpoint rg={rg}")


def test_functional_matches_stock_and_updates_in_place():
    x = torch.randn(4, 3, 5)
    rm, rv = torch.rand(3), torch.rand(3) + 0.5
    w, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    rm2, rv2, w2, b2 = rm.clone(), rv.clone(), w.detach().clone().requires_grad_(), b.detach().clone()
    b2.requires_grad_()
    x2 = x.clone().requires_grad_()
    x.requires_grad_()
    ys = F.batch_norm(x, rm, rv, w, b, True, 0.2, 1e-4)
    ym = batch_norm(x2, rm2, rv2, w2, b2, True, 0.2, 1e-4)
    assert_same(ym, ys)
    assert_same(rm2, rm)
    assert_same(rv2, rv)
    g = torch.randn_like(ys)
    ys.backward(g)
    ym.backward(g)
    for a, b_ in [(x2.grad, x.grad), (w2.grad, w.grad), (b2.grad, b.grad)]:
        assert_same(a, b_)
    # no running statistics at all, training
    assert_same(batch_norm(x2, None, None, training=True), F.batch_norm(x, None, None, training=True))
    # empty input takes stock's special case
    e = torch.randn(0, 3, 4)
    assert_same(batch_norm(e, rm2, rv2, w2, b2, False), F.batch_norm(e, rm, rv, w, b, False))


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((torch.zeros(4), torch.ones(3)), {}),
        ((torch.zeros(3), torch.ones(4)), {}),
        ((torch.zeros(3), torch.ones(3), torch.ones(4)), {}),
        ((torch.zeros(3), torch.ones(3), None, torch.ones(2)), {}),
        ((None, None), {"training": False}),
        ((torch.zeros(3), None), {"training": False}),
        ((None, None), {"training": True, "eps": 0.0}),
        ((torch.zeros(3), torch.ones(3)), {"eps": -1.0}),
    ],
)
def test_functional_bad_arguments_same_error_as_stock(args, kwargs):
    x = torch.randn(4, 3, 5)
    with pytest.raises(Exception) as stock_err:
        F.batch_norm(x, *args, **kwargs)
    with pytest.raises(type(stock_err.value)) as ours:
        batch_norm(x, *args, **kwargs)
    assert str(ours.value) == str(stock_err.value)


def test_functional_batch_of_one_same_error_as_stock():
    x = torch.randn(1, 3)
    with pytest.raises(ValueError) as stock_err:
        F.batch_norm(x, None, None, training=True)
    with pytest.raises(ValueError) as ours:
        batch_norm(x, None, None, training=True)
    assert str(ours.value) == str(stock_err.value)


@pytest.mark.parametrize(
    "stock_cls,shape",
    [(nn.BatchNorm1d, (2, 3, 4, 5)), (nn.BatchNorm2d, (2, 3, 4)), (nn.BatchNorm3d, (2, 3, 4, 5)),
     (nn.BatchNorm2d, (2, 3, 4, 5, 6))],
)
def test_module_wrong_input_dim_same_error_as_stock(stock_cls, shape):
    stock, slim = make_pair(stock_cls, 3)
    x = torch.randn(shape)
    with pytest.raises(ValueError) as stock_err:
        stock(x)
    with pytest.raises(ValueError) as ours:
        slim(x)
    assert str(ours.value) == str(stock_err.value)
    assert_same(slim.num_batches_tracked, stock.num_batches_tracked)


def test_registered_classes():
    from slimgrad._registry import FACADE, REPLACEMENTS

    assert REPLACEMENTS[nn.BatchNorm1d] is BatchNorm1d
    assert REPLACEMENTS[nn.BatchNorm2d] is BatchNorm2d
    assert REPLACEMENTS[nn.BatchNorm3d] is BatchNorm3d
    for cls in (BatchNorm1d, BatchNorm2d, BatchNorm3d):
        assert set(vars(cls)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__",
                                 "__static_attributes__"} == {"forward", *FACADE}


@pytest.mark.slow
def test_compile_fullgraph_train():
    """Inductor decomposes batch norm into its own fused code, for stock as for us: the compiled slim
    module is bitwise equal to the compiled stock module, and within fp32 rounding of eager stock."""
    stock, slim = make_pair(nn.BatchNorm2d, 4, train=True)
    stock_eager = copy.deepcopy(stock)
    compiled_stock = torch.compile(stock, fullgraph=True)
    compiled_slim = torch.compile(slim, fullgraph=True)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        base = torch.randn(3, 4, 5, 5, generator=gen)
        g = torch.randn(3, 4, 5, 5, generator=gen)
        xs, xm, xe = (base.clone().requires_grad_() for _ in range(3))
        ys, ym, ye = compiled_stock(xs), compiled_slim(xm), stock_eager(xe)
        for y in (ys, ym, ye):
            y.backward(g)
        assert_same(ym, ys, what="compiled output")
        assert_same(ym, ye, exact=False, what="compiled output vs eager")
        assert_same(xm.grad, xs.grad, what="compiled input grad")
        assert_same(xm.grad, xe.grad, exact=False, what="compiled input grad vs eager")
        for name in ("weight", "bias"):
            assert_same(getattr(slim, name).grad, getattr(stock, name).grad, what=f"compiled {name} grad")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_same(getattr(slim, name), getattr(stock, name), what=f"compiled {name}")
            assert_same(getattr(slim, name), getattr(stock_eager, name), exact=False,
                        what=f"compiled {name} vs eager")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("combo", grad_combos(3),
                         ids=lambda c: "".join("xwb"[i] if f else "-" for i, f in enumerate(c)))
def test_sync_batch_norm_without_a_process_group_is_batch_norm(combo, training):
    """SyncBatchNorm computes F.batch_norm except when it synchronises (training under an initialised process group,
    GPU only): converted, it keeps what BatchNorm2d keeps (it was not converted and not reported, found by the
    distributed sweep: a frozen eval SyncBatchNorm kept its input); bitwise stock's."""
    from tests._util import run_step

    need_x, need_w, need_b = combo
    torch.manual_seed(0)
    stock = nn.SyncBatchNorm(6).train(training)
    stock.weight.data.uniform_(0.5, 1.5)
    stock.running_mean.normal_()
    stock.running_var.uniform_(0.5, 2)
    set_requires_grad(stock, weight=need_w, bias=need_b)
    slim = slim_copy(stock)
    assert type(slim).__qualname__ == "SyncBatchNorm" and type(slim) is not nn.SyncBatchNorm
    plain = slim_copy(nn.BatchNorm2d(6).train(training))
    plain.load_state_dict(stock.state_dict())
    set_requires_grad(plain, weight=need_w, bias=need_b)
    from slimgrad.measure import SavedTensors

    results = []
    for module in (stock, slim, plain):
        x = torch.randn(4, 6, 5, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(need_x)
        with SavedTensors(exclude=[module]) as kept:
            out, gx = run_step(module, x)
        results.append((out, gx, kept.bytes, module.weight.grad, module.running_mean.clone()))
    (o_s, g_s, k_s, w_s, r_s), (o_k, g_k, k_k, w_k, r_k), (_, _, k_p, _, _) = results
    assert_same(o_k, o_s, what="output")
    assert_same(g_k, g_s, what="x.grad")
    assert_same(w_k, w_s, what="weight.grad")
    assert_same(r_k, r_s, what="running_mean")
    assert k_k == k_p <= k_s
