"""The compiled core's convolution and batch norm (csrc/conv.cpp, csrc/batch_norm.cpp) against the Python path
(``csrc.disabled()``) and stock PyTorch, on independent copies: the same bits (outputs, every requested gradient,
their strides, running statistics) and the same saved bytes, and the core actually ran where it serves the call."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from tests._util import FLOAT_DTYPES, assert_same, grad_combos, slim_copy
from torch import nn

import slimgrad.functional.conv as sf
import slimgrad.nn.batchnorm  # noqa: F401  (registers the replacements)
import slimgrad.nn.conv  # noqa: F401
from slimgrad import csrc
from slimgrad.functional import _common
from slimgrad.functional.batch_norm import batch_norm
from slimgrad.measure import SavedTensors, saved_bytes

pytestmark = pytest.mark.skipif(csrc.core() is None, reason="the compiled core is unavailable here "
                                f"({csrc.status()['reason']}): the Python path runs, tested elsewhere")

COMBOS = grad_combos(3)


def _ids(flags):
    return "xwb=" + "".join(str(int(v)) for v in flags)


def _ran_core(out) -> bool:
    return out.grad_fn is not None and "CppNode" in out.grad_fn.name()


def _ran_python(out) -> bool:
    return out.grad_fn is not None and "CppNode" not in out.grad_fn.name()


# ----------------------------------------------------------------------------------------------------- conv

# (id, stock class, constructor kwargs, input shape, forward kwargs)
CONV = [
    ("c1d_stride_pad_dil", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=2,
                                           dilation=2), (2, 4, 11), {}),
    ("c1d_1x1", nn.Conv1d, dict(in_channels=6, out_channels=4, kernel_size=1), (2, 6, 9), {}),
    ("c2d", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1), (2, 4, 7, 8), {}),
    ("c2d_tuple", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0),
                                  dilation=(1, 2)), (2, 4, 7, 8), {}),
    ("c2d_same", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding="same"), (2, 4, 7, 8), {}),
    ("c2d_same_even", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(2, 4), padding="same",
                                      dilation=(1, 3)), (2, 4, 7, 8), {}),
    ("c2d_valid", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding="valid"), (2, 4, 7, 8), {}),
    ("c2d_groups_nobias", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, bias=False),
     (2, 4, 7, 8), {}),
    ("c2d_depthwise", nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=3, groups=4, padding=1),
     (2, 4, 7, 8), {}),
    ("c2d_1x1", nn.Conv2d, dict(in_channels=8, out_channels=3, kernel_size=1), (2, 8, 6, 7), {}),
    ("c2d_1x1_stride_groups", nn.Conv2d, dict(in_channels=8, out_channels=4, kernel_size=1, stride=2, groups=2),
     (2, 8, 7, 7), {}),
    ("c1d_reflect", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=2, padding_mode="reflect"),
     (2, 4, 9), {}),
    ("c1d_circular_1x1", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=1, padding=1,
                                         padding_mode="circular"), (2, 4, 9), {}),
    ("c2d_reflect_same_even", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(2, 3), padding="same",
                                              padding_mode="reflect"), (2, 4, 7, 8), {}),
    ("c2d_replicate_1x1", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=1, padding=1,
                                          padding_mode="replicate"), (2, 4, 7, 8), {}),
    ("c2d_reflect", nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=(1, 2), groups=4,
                                    padding_mode="reflect"), (2, 4, 7, 8), {}),
    ("c2d_replicate", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=(2, 1),
                                      groups=2, padding_mode="replicate"), (2, 4, 7, 8), {}),
    ("c2d_circular", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1),
                                     padding_mode="circular"), (2, 4, 7, 8), {}),
    ("c2d_unbatched", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1), (4, 7, 8), {}),
    ("c3d", nn.Conv3d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=(1, 2, 1), padding=1),
     (2, 3, 5, 6, 7), {}),
    ("c3d_1x1", nn.Conv3d, dict(in_channels=4, out_channels=2, kernel_size=1), (2, 4, 3, 4, 5), {}),
    ("c3d_replicate", nn.Conv3d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=1,
                                      padding_mode="replicate"), (2, 3, 5, 6, 7), {}),
    ("c3d_reflect", nn.Conv3d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=(1, 2, 1),
                                    padding_mode="reflect"), (2, 3, 5, 6, 7), {}),
    ("c3d_circular", nn.Conv3d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1, 1),
                                     padding_mode="circular", groups=2), (2, 4, 5, 6, 7), {}),
    ("t1d", nn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1,
                                     output_padding=1), (2, 4, 9), {}),
    ("t2d", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1,
                                     output_padding=1), (2, 4, 5, 6), {}),
    ("t2d_1x1", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=1, stride=2, output_padding=1),
     (2, 4, 5, 6), {}),
    ("t2d_groups_dil_size", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2,
                                                     padding=1, groups=2, dilation=2), (2, 4, 5, 6),
     dict(output_size=(12, 14))),
    ("t2d_depthwise_nobias", nn.ConvTranspose2d, dict(in_channels=4, out_channels=4, kernel_size=(2, 3), groups=4,
                                                      bias=False, stride=(2, 1)), (2, 4, 5, 6), {}),
    ("t3d_pad_op", nn.ConvTranspose3d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=(2, 1, 2),
                                            padding=1, output_padding=(1, 0, 0)), (2, 3, 4, 5, 3), {}),
]
_BY_ID = {c[0]: c for c in CONV}


def _core_serves(case, rx, rw) -> bool:
    """Whether the converted module's call runs the core (else the Python Function: an unbatched input; or
    stock's op where stock keeps what we keep: a trainable leaf weight and no explicit pad)."""
    cid, cls, kwargs, shape, fk = case
    dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2,
            nn.ConvTranspose3d: 3}[cls]
    padded = kwargs.get("padding_mode", "zeros") != "zeros" or cid == "c2d_same_even"
    return len(shape) == dims + 2 and (padded or not rw)


def _layout(shape):
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape))


def _run(module, x, rx, fk, g_seed=1, core=True):
    """Forward and backward of `module` on a clone of x; returns (output, x.grad)."""
    x = x.clone(memory_format=torch.preserve_format).requires_grad_(rx)
    ctx = csrc.disabled() if not core else _nullcontext()
    with ctx:
        out = module(x, **fk)
        if out.requires_grad:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).to(out.dtype)
            out.backward(g)
    return out, x.grad


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _conv_three(stock, x, flags, fk, *, dtype, layout=None):
    """Stock, the core and the Python path on independent copies; every tensor compared; returns the modules."""
    rx, rw, rb = flags
    core_m, py_m = slim_copy(stock), slim_copy(stock)
    for m in (stock, core_m, py_m):
        m.weight.requires_grad_(rw)
        if m.bias is not None:
            m.bias.requires_grad_(rb)
    o_s, dx_s = _run(stock, x, rx, fk)
    o_c, dx_c = _run(core_m, x, rx, fk)
    o_p, dx_p = _run(py_m, x, rx, fk, core=False)
    # core == Python path, bit for bit, strides included
    assert_same(o_c, o_p, what="output core/python")
    assert o_c.stride() == o_p.stride()
    assert_same(dx_c, dx_p, what="input grad core/python")
    if dx_c is not None:
        assert dx_c.stride() == dx_p.stride(), "input grad strides core/python"
    assert_same(core_m.weight.grad, py_m.weight.grad, what="weight grad core/python")
    if stock.bias is not None:
        assert_same(core_m.bias.grad, py_m.bias.grad, what="bias grad core/python")
    # == stock: bitwise, but dB with the weight frozen (a plain sum where stock's oneDNN kernel reduces: see
    # tests/test_conv.py::_bias_exact)
    assert_same(o_c, o_s, what="output core/stock")
    assert_same(dx_c, dx_s, what="input grad core/stock")
    if dx_c is not None:
        assert dx_c.stride() == dx_s.stride(), "input grad strides core/stock"
    assert_same(core_m.weight.grad, stock.weight.grad, what="weight grad core/stock")
    if stock.bias is not None:
        exact = rw or dtype == torch.float64
        tol = {} if exact else (dict(exact=False, rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                else dict(exact=False))
        assert_same(core_m.bias.grad, stock.bias.grad, what="bias grad core/stock", **tol)
    if layout is not None:
        assert o_c.is_contiguous(memory_format=layout) == o_s.is_contiguous(memory_format=layout)
    return core_m, py_m, o_c


@pytest.mark.parametrize("flags", COMBOS, ids=_ids)
@pytest.mark.parametrize("case", CONV, ids=[c[0] for c in CONV])
def test_conv_core_python_stock_every_combo(case, flags):
    _, cls, kwargs, shape, fk = case
    rx, rw, rb = flags
    torch.manual_seed(0)
    stock = cls(**kwargs)
    x = torch.randn(shape)
    core_m, py_m, out = _conv_three(stock, x, flags, fk, dtype=torch.float32)
    if out.requires_grad and _core_serves(case, rx, rw):
        assert _ran_core(out), out.grad_fn
    elif out.requires_grad and len(shape) == out.dim() - 1:
        assert _ran_python(out), out.grad_fn  # unbatched
    # saved bytes: the core's == the Python path's == the analytical minimum (X iff the weight trains)
    expected = x.numel() * x.element_size() if rw else 0
    xs = x.clone().requires_grad_(rx)
    assert saved_bytes(core_m, xs, **fk) == expected
    with csrc.disabled():
        assert saved_bytes(py_m, x.clone().requires_grad_(rx), **fk) == expected


DTYPE_CASES = ["c1d_1x1", "c1d_reflect", "c2d", "c2d_depthwise", "c2d_1x1", "c2d_reflect", "c2d_circular",
               "c2d_same_even", "c3d", "c3d_replicate", "t2d", "t3d_pad_op"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("cid", DTYPE_CASES)
def test_conv_dtypes(cid, dtype):
    _, cls, kwargs, shape, fk = _BY_ID[cid]
    torch.manual_seed(0)
    stock = cls(**kwargs).to(dtype)
    x = torch.randn(shape).to(dtype)
    for flags in [(True, False, False), (True, False, True), (False, False, True), (True, True, True)]:
        _conv_three(copy.deepcopy(stock), x, flags, fk, dtype=dtype)


CL_CASES = ["c2d", "c2d_depthwise", "c2d_1x1", "c2d_1x1_stride_groups", "c2d_same", "c2d_same_even", "c2d_reflect",
            "c2d_replicate", "c2d_circular", "c2d_replicate_1x1", "c3d", "c3d_1x1", "c3d_replicate", "c3d_reflect",
            "t2d", "t2d_1x1", "t3d_pad_op"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("flags", [(True, False, False), (True, False, True), (False, True, True)], ids=_ids)
@pytest.mark.parametrize("weight_cl", [False, True], ids=["w_contig", "w_cl"])
@pytest.mark.parametrize("cid", CL_CASES)
def test_conv_channels_last(cid, weight_cl, flags, dtype):
    _, cls, kwargs, shape, fk = _BY_ID[cid]
    layout = _layout(shape)
    torch.manual_seed(0)
    stock = cls(**kwargs).to(dtype)
    if weight_cl:
        stock = stock.to(memory_format=layout)
    x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    _, _, out = _conv_three(stock, x, flags, fk, dtype=dtype, layout=layout)
    if _core_serves(_BY_ID[cid], flags[0], flags[1]):
        assert _ran_core(out)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,cin,cout,stride,groups", [
    ((2, 24, 9, 9), 24, 6, 1, 1),  # MobileNet's projection
    ((2, 6, 9, 9), 6, 24, 1, 1),  # its expansion
    ((2, 16, 9, 9), 16, 32, 2, 1),  # a ResNet downsample
    ((2, 16, 5, 5), 16, 16, 1, 4),
])
def test_pointwise_input_grad_bitwise(shape, cin, cout, stride, groups, dtype):
    """1x1 convolutions' dX through aten's convolution_backward (issue 22's fix; the transposed convolution was
    slower and, in fp32, up to 1 ulp off stock): bitwise stock on the core and the Python path, every layout."""
    torch.manual_seed(0)
    stock = nn.Conv2d(cin, cout, 1, stride=stride, groups=groups, bias=False).to(dtype)
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
        _, _, out = _conv_three(copy.deepcopy(stock), x, (True, False, False), {}, dtype=dtype)
        assert _ran_core(out)


def test_pointwise_input_grad_when_x_is_gone():
    """dX of a 1x1 conv whose input nobody holds any more (a carrier is allocated, as stock holds X there) and
    whose gradient's storage is too small to view: still bitwise stock."""
    torch.manual_seed(0)
    stock = nn.Conv2d(16, 4, 1, bias=False).requires_grad_(False)
    slim = slim_copy(stock)
    w = torch.randn(2, 16, 5, 5)
    outs, grads = [], []
    for m in (stock, slim):
        leaf = w.clone().requires_grad_()
        out = m(leaf * 2)  # the product is freed after forward for slim (nothing keeps it)
        out.backward(torch.ones_like(out) * 0.5)
        outs.append(out)
        grads.append(leaf.grad)
    assert _ran_core(outs[1])
    assert_same(grads[1], grads[0], what="input grad")


def test_functional_forms_run_the_core():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 8, requires_grad=True)
    w = torch.randn(6, 4, 3, 3)
    b = torch.randn(6, requires_grad=True)
    for fn, st_fn, kw in [(sf.conv2d, F.conv2d, dict(stride=2, padding=1)),
                          (sf.conv2d, F.conv2d, dict(padding="same", dilation=2)),
                          (sf.conv2d, F.conv2d, dict(padding=[1, 0], stride=[1, 2]))]:
        outs = []
        for f, mode in ((fn, "core"), (fn, "python"), (st_fn, "stock")):
            xi, bi = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
            with csrc.disabled() if mode == "python" else _nullcontext():
                out = f(xi, w, bi, **kw)
                out.backward(torch.ones_like(out))
            if mode == "core":
                assert _ran_core(out)
            outs.append((out, xi.grad, bi.grad))
        for i, what in enumerate(("output", "input grad")):
            assert_same(outs[0][i], outs[1][i], what=what)
            assert_same(outs[0][i], outs[2][i], what=what)
        assert_same(outs[0][2], outs[1][2], what="bias grad")
    xt = torch.randn(2, 6, 4, 5, requires_grad=True)
    out = sf.conv_transpose2d(xt, torch.randn(6, 2, 3, 3), None, stride=2, padding=1, output_padding=1, groups=2)
    assert _ran_core(out)
    assert out.shape == F.conv_transpose2d(xt, torch.randn(6, 2, 3, 3), None, 2, 1, 1, 2).shape


def test_computed_weight_keeps_x_and_tells_its_producer():
    """A weight that trains but is not a leaf (a computed weight: stock would keep it too, an extra tensor): with
    a frozen X the core keeps X alone; with an X that a producer made (producers mark only outputs that require
    grad) it notes X for that producer (the producer/consumer rule)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6)
    produced = x.clone().requires_grad_() * 1.0
    cell = _common.UseCell()
    _common.mark_producer(produced, cell)
    base = torch.randn(6, 4, 3, 3, requires_grad=True)
    sf.conv2d(produced, base * 1.5, None, padding=1)  # X and the weight train: stock's op, X noted for its producer
    assert cell.kept
    base.grad = None
    out = sf.conv2d(x, base * 1.5, None, padding=1)
    assert _ran_core(out)
    out.backward(torch.ones_like(out))
    base2 = base.detach().clone().requires_grad_()
    ref = F.conv2d(x, base2 * 1.5, None, padding=1)
    ref.backward(torch.ones_like(ref))
    assert_same(base.grad, base2.grad, what="weight grad")
    assert saved_bytes(lambda: sf.conv2d(x, base * 1.5, None, padding=1)) == x.numel() * x.element_size()


def test_conv_double_backward_core_matches_stock():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    for kernel in (3, 1):
        wk = w[:, :, :kernel, :kernel].contiguous()
        results = []
        for mode in ("core", "python", "stock"):
            xi = x.detach().clone().requires_grad_()
            with csrc.disabled() if mode == "python" else _nullcontext():
                out = (F.conv2d if mode == "stock" else sf.conv2d)(xi, wk, None, padding=kernel // 2)
                if mode == "core":
                    assert _ran_core(out)
                (gx,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
                (ggx,) = torch.autograd.grad(gx.square().sum(), xi)
            results.append((gx, ggx))
        for i in range(2):
            assert_same(results[0][i], results[1][i], what=f"order {i + 1} core/python")
            assert_same(results[0][i], results[2][i], what=f"order {i + 1} core/stock")
    assert torch.autograd.gradgradcheck(lambda t: sf.conv2d(t, w, None, padding=1), (x,))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "same_even"])
def test_conv_padding_mode_double_backward_core_matches_stock(mode):
    torch.manual_seed(0)
    kw = dict(padding="same") if mode == "same_even" else dict(padding=1, padding_mode=mode)
    stock = nn.Conv2d(3, 4, 2 if mode == "same_even" else 3, **kw).double()
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64)
    for rw in (False, True):
        results = []
        for mode_ in ("core", "python", "stock"):
            m = copy.deepcopy(stock) if mode_ == "stock" else slim_copy(stock)
            m.weight.requires_grad_(rw)
            xi = x.clone().requires_grad_()
            with csrc.disabled() if mode_ == "python" else _nullcontext():
                out = m(xi)
                if mode_ == "core":
                    assert _ran_core(out)
                (gx,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
                (ggx,) = torch.autograd.grad(gx.square().sum(), xi)
            results.append((out, gx, ggx))
        for i in range(3):
            assert_same(results[0][i], results[1][i], what=f"{i} core/python")
            assert_same(results[0][i], results[2][i], what=f"{i} core/stock")


@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_conv_padding_mode_view_input_trainable_weight_keeps_compact_copy(mode):
    """X a chunk of a wider tensor, trainable weight, a pad: the Python Function keeps a compact copy of X (stock
    keeps its padded copy); the core leaves that call to it, with the same bits and bytes."""
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    wide = torch.randn(2, 9, 6, 6)
    x = wide[:, :3]
    core_m, py_m = slim_copy(stock), slim_copy(stock)
    results = []
    for m, mode_ in ((stock, "stock"), (core_m, "core"), (py_m, "python")):
        with csrc.disabled() if mode_ == "python" else _nullcontext():
            out = m(x)
            out.backward(torch.ones_like(out))
        if mode_ == "core":
            assert _ran_python(out)
        results.append((out, m.weight.grad, m.bias.grad))
    for i in range(3):
        assert_same(results[1][i], results[2][i], what=f"{i} core/python")
        assert_same(results[1][i], results[0][i], what=f"{i} core/stock")
    assert saved_bytes(core_m, x) == x.numel() * x.element_size()


def test_conv_module_copies_and_pickles_after_a_call():
    """The module's cached core options are dropped by deepcopy and torch.save (remade on the next call)."""
    import io

    torch.manual_seed(0)
    slim = slim_copy(nn.Conv2d(3, 4, 3).requires_grad_(False))
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    y = slim(x)
    assert _ran_core(y)
    twin = copy.deepcopy(slim)
    buf = io.BytesIO()
    torch.save(slim, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (twin, loaded, copy.copy(slim)):
        out = m(x)
        assert _ran_core(out)
        assert_same(out, y)


def test_conv_module_options_changed_after_first_call():
    """The module's cached options are remade when an option attribute is replaced."""
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.randn(1, 3, 8, 8)
    assert_same(slim(x), stock(x))
    for m in (stock, slim):
        m.stride = (2, 2)
        m.padding = (0, 0)
    assert_same(slim(x), stock(x))


@pytest.mark.parametrize("attr,index,value", [("padding", 0, 0), ("stride", 0, 2), ("dilation", 1, 2),
                                               ("output_padding", 0, 1)])
def test_conv_list_option_changed_in_place_is_seen(attr, index, value):
    """A list option (stock's forward passes it on) changed in place between calls: the old options ran on the core's
    route (the cache matched the module's own list against itself; 9x9 where stock gave 7x9)."""
    torch.manual_seed(0)
    transposed = attr == "output_padding"
    stock = (nn.ConvTranspose2d(3, 4, 3, stride=2) if transposed else nn.Conv2d(3, 4, 3, padding=1))
    stock.requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.randn(2, 3, 5 if transposed else 9, 9, requires_grad=True)
    for m in (stock, slim):
        setattr(m, attr, [0, 0] if transposed else [1, 1])
        m(x)
        getattr(m, attr)[index] = value
    out = slim(x)
    assert _ran_core(out)
    assert_same(out, stock(x))


# ----------------------------------------------------------------------------------------------- batch norm

BN_SHAPES = {
    "1d-2D": (nn.BatchNorm1d, (6, 3)),
    "1d-3D": (nn.BatchNorm1d, (4, 3, 5)),
    "2d": (nn.BatchNorm2d, (3, 3, 4, 5)),
    "3d": (nn.BatchNorm3d, (2, 3, 3, 4, 2)),
}
BN_OPTIONS = {
    "default": {},
    "affine=False": {"affine": False},
    "momentum=None": {"momentum": None},
    "untracked": {"track_running_stats": False},
}


def _bn_modules(cls, c, *, train, dtype, **options):
    torch.manual_seed(0)
    stock = cls(c, **options).to(dtype)
    with torch.no_grad():
        if stock.affine:
            stock.weight.uniform_(0.5, 1.5)
            stock.bias.uniform_(-0.5, 0.5)
        if stock.track_running_stats:
            stock.running_mean.uniform_(-0.5, 0.5)
            stock.running_var.uniform_(0.5, 2.0)
    stock.train(train)
    return stock, slim_copy(stock), slim_copy(stock)


def _bn_compare(stock, core_m, py_m, shape, flags, *, dtype, memory_format=None, grad="dense", steps=2):
    rx, rw, rb = flags
    for m in (stock, core_m, py_m):
        if m.affine:
            m.weight.requires_grad_(rw)
            m.bias.requires_grad_(rb)
    ran = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        base = torch.randn(shape, generator=gen).to(dtype)
        g = torch.randn(shape, generator=gen).to(dtype)
        if memory_format is not None:
            base = base.contiguous(memory_format=memory_format)
        results = []
        for m, mode in ((stock, "stock"), (core_m, "core"), (py_m, "python")):
            x = base.clone(memory_format=torch.preserve_format).requires_grad_(rx)
            with csrc.disabled() if mode == "python" else _nullcontext():
                out = m(x)
                if out.requires_grad:
                    (out.sum() if grad == "sum" else out).backward(None if grad == "sum" else g)
            if mode == "core":
                ran.append(_ran_core(out))
            results.append((out, x.grad))
        (o_s, dx_s), (o_c, dx_c), (o_p, dx_p) = results
        for other, name in ((o_p, "python"), (o_s, "stock")):
            assert_same(o_c, other, what=f"step {step} output core/{name}")
            assert o_c.stride() == other.stride()
        for other, name in ((dx_p, "python"), (dx_s, "stock")):
            assert_same(dx_c, other, what=f"step {step} input grad core/{name}")
            if dx_c is not None:
                assert dx_c.stride() == other.stride(), f"input grad strides core/{name}"
        for pname in ("weight", "bias"):
            p_c = getattr(core_m, pname)
            if p_c is not None:
                assert_same(p_c.grad, getattr(py_m, pname).grad, what=f"{pname} grad core/python")
                assert_same(p_c.grad, getattr(stock, pname).grad, what=f"{pname} grad core/stock")
        for bname in ("running_mean", "running_var", "num_batches_tracked"):
            assert_same(getattr(core_m, bname), getattr(py_m, bname), what=f"{bname} core/python")
            assert_same(getattr(core_m, bname), getattr(stock, bname), what=f"{bname} core/stock")
    return ran


def _bn_core_serves(module, flags) -> bool:
    """Where the converted module runs the core: stock's op runs where it keeps what we keep (the weight
    trains, or batch statistics with X needing grad)."""
    rx, rw, rb = flags
    batch_stats = module.training or not module.track_running_stats
    return not ((rw and module.affine) or (batch_stats and rx))


@pytest.mark.parametrize("flags", COMBOS, ids=_ids)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("opt", list(BN_OPTIONS))
@pytest.mark.parametrize("shape_id", list(BN_SHAPES))
def test_bn_core_python_stock_every_combo(shape_id, opt, train, flags):
    cls, shape = BN_SHAPES[shape_id]
    stock, core_m, py_m = _bn_modules(cls, shape[1], train=train, dtype=torch.float32, **BN_OPTIONS[opt])
    if not stock.affine and (flags[1] or flags[2]):
        pytest.skip("no parameters")
    ran = _bn_compare(stock, core_m, py_m, shape, flags, dtype=torch.float32)
    if any(flags) and _bn_core_serves(stock, flags):
        assert all(ran)
    x = torch.randn(shape)
    with csrc.disabled():
        expected = saved_bytes(py_m, x.clone().requires_grad_(flags[0]))
    assert saved_bytes(core_m, x.clone().requires_grad_(flags[0])) == expected
    if not _bn_core_serves(stock, flags) or not flags[0]:
        return
    # what the Python path keeps here: nothing input-sized (dX in evaluation reads the running statistics)
    assert expected == 0


@pytest.mark.parametrize("grad", ["dense", "sum"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("param_dtype", [None, torch.float32], ids=["params_like_x", "params_fp32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_bn_dtypes_and_layouts(dtype, param_dtype, train, grad):
    if param_dtype is not None and dtype in (torch.float32, torch.float64):
        pytest.skip("fp32 parameters with a reduced-precision input only (stock refuses other mixes)")
    for cls, shape, fmt in ((nn.BatchNorm2d, (3, 4, 5, 6), None), (nn.BatchNorm2d, (3, 4, 5, 6), torch.channels_last),
                            (nn.BatchNorm3d, (2, 4, 3, 2, 3), torch.channels_last_3d),
                            (nn.BatchNorm1d, (5, 4, 7), None)):
        stock, core_m, py_m = _bn_modules(cls, shape[1], train=train, dtype=param_dtype or dtype)
        for flags in ((True, False, False), (True, False, True), (False, False, True)):
            ran = _bn_compare(copy.deepcopy(stock), copy.deepcopy(core_m), copy.deepcopy(py_m), shape, flags,
                              dtype=dtype, memory_format=fmt, grad=grad, steps=1)
            if _bn_core_serves(stock, flags):
                assert all(ran)


def test_bn_functional_runs_the_core_and_refuses_double_backward_alike():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, requires_grad=True)
    rm, rv = torch.zeros(3), torch.ones(3)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    out = batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)
    assert _ran_core(out)
    ref = F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)
    assert_same(out, ref)
    messages = []
    for mode in ("core", "python"):
        with csrc.disabled() if mode == "python" else _nullcontext():
            xi = x.detach().clone().requires_grad_()
            y = batch_norm(xi, rm, rv, w, b, False, 0.1, 1e-5)
            (gx,) = torch.autograd.grad(y.square().sum(), xi, create_graph=True)
            with pytest.raises(RuntimeError) as err:
                gx.sum().backward()
            messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "BatchNormFunction" in messages[0]


def test_bn_training_bias_only_keeps_nothing_and_updates_stats():
    stock, core_m, py_m = _bn_modules(nn.BatchNorm2d, 4, train=True, dtype=torch.float32)
    ran = _bn_compare(stock, core_m, py_m, (3, 4, 5, 5), (False, False, True), dtype=torch.float32, steps=3)
    assert all(ran)
    assert saved_bytes(core_m, torch.randn(3, 4, 5, 5)) == 0


def test_conv_bn_checkpoint_through_the_core():
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    stock.requires_grad_(False)
    slim = copy.deepcopy(stock)
    for i in (0, 1, 3):
        slim[i] = slim_copy(stock[i])
    x = torch.randn(2, 3, 6, 6)
    for reentrant in (True, False):
        grads = []
        for m in (stock, slim):
            xi = x.clone().requires_grad_()
            out = torch.utils.checkpoint.checkpoint(m, xi, use_reentrant=reentrant)
            out.backward(torch.ones_like(out))
            grads.append(xi.grad)
        assert_same(grads[1], grads[0])


def test_padding_same_follows_a_replaced_weight_of_another_kernel_size():
    """The core's cached conv options held the 'same' padding worked out from the first weight's kernel; a weight of
    another size (surgery, load_state_dict(assign=True)) convolved with the old padding: 8x8 -> 6x6 (the state-change
    sweep). Frozen weight: the core's route."""
    torch.manual_seed(0)
    stock = nn.Conv2d(4, 4, 3, padding="same")
    slim = slimgrad.convert(stock)
    x = torch.randn(2, 4, 8, 8)
    for k in (3, 5, 4):
        w = torch.randn(4, 4, k, k)
        for m in (stock, slim):
            m.weight = nn.Parameter(w.clone(), requires_grad=False)
            m.kernel_size = (k, k)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = stock(xa), slim(xb)
        assert a.shape == b.shape == x.shape and torch.equal(a, b), k
        a.square().sum().backward()
        b.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad), k


_AUTOCAST_LAYERS = {
    "conv3x3": lambda: nn.Conv2d(4, 6, 3, padding=1),
    "conv1x1": lambda: nn.Conv2d(4, 6, 1),
    "conv_s2_g2": lambda: nn.Conv2d(4, 8, 3, stride=2, groups=2),
    "conv_t": lambda: nn.ConvTranspose2d(4, 6, 3, stride=2),
    "conv1d": lambda: nn.Conv1d(4, 6, 3),
    "bn_eval": lambda: nn.BatchNorm2d(4).eval(),
    "bn_train": lambda: nn.BatchNorm2d(4),
}


@pytest.mark.parametrize("layer", list(_AUTOCAST_LAYERS))
@pytest.mark.parametrize("req", grad_combos(3)[1:])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_core_runs_conv_and_batch_norm_under_autocast(layer, req, channels_last, x_dtype):
    """Under CPU bf16 autocast the converted conv (zeros padding: the tensors cast as autocast casts them) and batch
    norm run the core, not the Python Function (1.4-2.1x stock's step on input-only loops under autocast, the
    input-only sweep of 2026-11-28): stock's numbers (strides too), the Python path's, and no more bytes than stock."""
    base = _AUTOCAST_LAYERS[layer]()
    if isinstance(base, nn.BatchNorm2d):
        with torch.no_grad():
            base.running_mean.uniform_(-1, 1)
            base.running_var.uniform_(0.5, 2)
    need_x, need_w, need_b = req
    x0 = torch.randn(2, 4, 9) if layer == "conv1d" else torch.randn(2, 4, 9, 9)
    x0 = x0.to(x_dtype)
    if channels_last and x0.dim() == 4:
        x0 = x0.to(memory_format=torch.channels_last)
    results = []
    for route in ("stock", "core", "python"):
        m = copy.deepcopy(base) if route == "stock" else slim_copy(base)
        m.weight.requires_grad_(need_w)
        m.bias.requires_grad_(need_b)
        x = x0.clone().requires_grad_(need_x)
        with (csrc.disabled() if route == "python" else contextlib.nullcontext()):
            with SavedTensors(exclude=[m]) as kept:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = m(x)
            if route == "core" and not (need_w and isinstance(m, nn.BatchNorm2d)):
                assert type(y.grad_fn).__name__ in ("CppFunction", "ConvolutionBackward0",
                                                    "NativeBatchNormBackward0"), type(y.grad_fn).__name__
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
        results.append((y, x.grad, m.weight.grad, m.bias.grad, kept.bytes))
    stock, *slim = results
    for got in slim:
        for a, b, what in zip(got[:4], stock[:4], ("output", "dX", "dW", "dB")):
            if what == "dB" and isinstance(base, (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d)) and not need_w:
                if a is not None:  # the documented frozen-weight conv bias gradient: a sum (README, Exactness)
                    torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-5)
                continue
            assert_same(a, b, what=what)
            if a is not None:
                assert a.stride() == b.stride(), what
        assert got[4] <= stock[4], (got[4], stock[4])
