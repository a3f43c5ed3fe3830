"""Convolutions against stock PyTorch: values, gradients, what is kept, peaks, dtypes, layouts, autocast."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from tests._util import FLOAT_DTYPES, assert_same, grad_combos, input_grad_as_returned, saved_bytes, slim_copy
from torch import nn

import slimgrad.functional.conv as sf
import slimgrad.nn.conv  # noqa: F401  (registers the replacements)
from slimgrad.measure import SavedTensors, peak_bytes

# (id, stock class, constructor kwargs, input shape, forward kwargs)
CASES = [
    ("c1d", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3), (2, 4, 9), {}),
    (
        "c1d_stride_pad_dil",
        nn.Conv1d,
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=2, dilation=2),
        (2, 4, 11),
        {},
    ),
    (
        "c1d_same_even",
        nn.Conv1d,
        dict(in_channels=4, out_channels=6, kernel_size=4, padding="same"),
        (2, 4, 9),
        {},
    ),
    (
        "c1d_reflect",
        nn.Conv1d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding=2, padding_mode="reflect"),
        (2, 4, 9),
        {},
    ),
    ("c1d_unbatched", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1), (4, 9), {}),
    (
        "c2d",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_tuple",
        nn.Conv2d,
        dict(
            in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)
        ),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_same",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding="same"),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_same_even_dil",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=(2, 4), padding="same", dilation=(1, 3)),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_valid",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding="valid"),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_groups_nobias",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, bias=False),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_depthwise",
        nn.Conv2d,
        dict(in_channels=4, out_channels=8, kernel_size=3, groups=4, padding=1),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_reflect",
        nn.Conv2d,
        dict(in_channels=4, out_channels=4, kernel_size=3, padding=(1, 2), groups=4, padding_mode="reflect"),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_replicate",
        nn.Conv2d,
        dict(
            in_channels=4,
            out_channels=6,
            kernel_size=3,
            stride=2,
            padding=(2, 1),
            groups=2,
            padding_mode="replicate",
        ),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_circular",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1), padding_mode="circular"),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_reflect_same_even",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=(2, 3), padding="same", padding_mode="reflect"),
        (2, 4, 7, 8),
        {},
    ),
    (
        "c2d_unbatched_circular",
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="circular"),
        (4, 7, 8),
        {},
    ),
    (
        "c3d",
        nn.Conv3d,
        dict(in_channels=3, out_channels=4, kernel_size=3, stride=(1, 2, 1), padding=1),
        (2, 3, 5, 6, 7),
        {},
    ),
    (
        "c3d_same_dil",
        nn.Conv3d,
        dict(in_channels=3, out_channels=4, kernel_size=(2, 3, 2), padding="same", dilation=(1, 1, 2)),
        (2, 3, 5, 6, 7),
        {},
    ),
    (
        "c3d_reflect",
        nn.Conv3d,
        dict(in_channels=3, out_channels=4, kernel_size=3, padding=(1, 2, 1), padding_mode="reflect"),
        (2, 3, 5, 6, 7),
        {},
    ),
    (
        "c3d_replicate",
        nn.Conv3d,
        dict(in_channels=3, out_channels=4, kernel_size=3, padding=1, padding_mode="replicate"),
        (2, 3, 5, 6, 7),
        {},
    ),
    (
        "c3d_circular",
        nn.Conv3d,
        dict(
            in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1, 1), padding_mode="circular", groups=2
        ),
        (2, 4, 5, 6, 7),
        {},
    ),
    (
        "t1d",
        nn.ConvTranspose1d,
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1),
        (2, 4, 9),
        {},
    ),
    ("t1d_unbatched", nn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3), (4, 9), {}),
    (
        "t2d",
        nn.ConvTranspose2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1),
        (2, 4, 5, 6),
        {},
    ),
    (
        "t2d_groups_dil_size",
        nn.ConvTranspose2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, groups=2, dilation=2),
        (2, 4, 5, 6),
        dict(output_size=(12, 14)),
    ),
    (
        "t2d_depthwise_nobias",
        nn.ConvTranspose2d,
        dict(in_channels=4, out_channels=4, kernel_size=(2, 3), groups=4, bias=False, stride=(2, 1)),
        (2, 4, 5, 6),
        {},
    ),
    (
        "t3d",
        nn.ConvTranspose3d,
        dict(in_channels=4, out_channels=6, kernel_size=2, stride=2),
        (4, 5, 6, 3),
        {},
    ),
    (
        "t3d_pad_op",
        nn.ConvTranspose3d,
        dict(
            in_channels=3,
            out_channels=4,
            kernel_size=3,
            stride=(2, 1, 2),
            padding=1,
            output_padding=(1, 0, 0),
        ),
        (2, 3, 4, 5, 3),
        dict(output_size=(8, 5, 5)),
    ),
]


def _bias_exact(dtype, rw):
    # With the weight trainable, dB comes from the same oneDNN call as stock (bitwise). With the weight
    # frozen, stock still runs oneDNN's weight-gradient kernel (which needs X) and takes dB from it; we
    # take dB as a plain sum over grad, equal within the summation's rounding (bitwise in fp64). In bf16
    # whether oneDNN's reduction order matches the plain sum depends on the CPU's ISA (bitwise on one
    # development machine, 1 bf16 ulp off on another), so bf16 gets the dtype's tolerance.
    return rw or dtype == torch.float64


# Sum over grad vs oneDNN's bias reduction (fp32, up to a few thousand terms): a few ulps apart.
BIAS_TOL = dict(exact=False, rtol=1e-5, atol=1e-5)


def _bias_tol(g: torch.Tensor) -> dict:
    """Two fp32 sums of one channel's gradient in different orders differ by a few ulps of the sum of the terms'
    magnitudes, not of the result: where the terms cancel (a channel summing to 0.1 from terms near 1), a fixed
    absolute 1e-5 fails (a ConvTranspose3d found by the property test: 1.3e-5 apart)."""
    magnitude = g.abs().sum([d for d in range(g.dim()) if d != 1]).max().item()
    return dict(exact=False, rtol=0, atol=16 * torch.finfo(torch.float32).eps * magnitude)


def _compare(stock, x, rx, rw, rb, fk=None, dtype=torch.float32, layout=None, exact=True):
    """Run stock and an independent slim copy on clones of x; compare outputs, grads, layouts."""
    fk = fk or {}
    slim = slim_copy(stock)
    for m in (stock, slim):
        m.weight.requires_grad_(rw)
        if m.bias is not None:
            m.bias.requires_grad_(rb)
    x1 = x.clone(memory_format=torch.preserve_format).requires_grad_(rx)
    x2 = x.clone(memory_format=torch.preserve_format).requires_grad_(rx)
    o1, o2 = stock(x1, **fk), slim(x2, **fk)
    tol = {} if exact else dict(exact=False)
    assert_same(o2, o1, what="output", **tol)
    if layout is not None:
        assert o1.is_contiguous(memory_format=layout) == o2.is_contiguous(memory_format=layout)
    assert o1.requires_grad == o2.requires_grad
    if o1.requires_grad:
        g = torch.randn(o1.shape, generator=torch.Generator().manual_seed(1)).to(o1.dtype)
        o1.backward(g)
        o2.backward(g.clone())
    assert_same(x2.grad, x1.grad, what="input grad", **tol)
    assert_same(slim.weight.grad, stock.weight.grad, what="weight grad", **tol)
    if stock.bias is not None:
        exact_b = exact and _bias_exact(dtype, rw)
        tol_b = {} if exact_b else (_bias_tol(g) if dtype == torch.float32 and o1.requires_grad
                                    else dict(exact=False))
        assert_same(slim.bias.grad, stock.bias.grad, what="bias grad", **tol_b)
    if layout is not None and rx:
        assert x1.grad.is_contiguous(memory_format=layout) == x2.grad.is_contiguous(memory_format=layout)
        assert x1.grad.stride() == x2.grad.stride()
    return stock, slim


@pytest.mark.parametrize("flags", grad_combos(3), ids=lambda f: "xwb=" + "".join(str(int(v)) for v in f))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_module_matches_stock_and_keeps_minimum(case, flags):
    _, cls, kwargs, shape, fk = case
    rx, rw, rb = flags
    torch.manual_seed(0)
    stock = cls(**kwargs)
    x = torch.randn(shape)
    stock, slim = _compare(stock, x, rx, rw, rb, fk)

    # Analytical minimum: X iff the weight needs grad (the module's parameters are not counted).
    expected = x.numel() * x.element_size() if rw else 0
    assert saved_bytes(slim, x.clone().requires_grad_(rx), **fk) == expected
    if rx and not rw:
        assert saved_bytes(stock, x.clone().requires_grad_(rx), **fk) >= x.numel() * x.element_size() > 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c[0]
        in ("c1d_reflect", "c2d", "c2d_circular", "c2d_same_even_dil", "c3d_replicate", "t2d", "t3d_pad_op")
    ],
    ids=lambda c: c[0],
)
def test_dtypes(case, dtype):
    _, cls, kwargs, shape, fk = case
    torch.manual_seed(0)
    stock = cls(**kwargs).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    for flags in [(True, False, False), (True, True, True), (False, False, True)]:
        _compare(copy.deepcopy(stock), x, *flags, fk=fk, dtype=dtype)


@pytest.mark.parametrize("rx,rw", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c[0]
        in (
            "c2d",
            "c2d_depthwise",
            "c2d_reflect",
            "c2d_circular",
            "c2d_same_even_dil",
            "c3d",
            "c3d_replicate",
            "t2d",
            "t3d_pad_op",
        )
    ],
    ids=lambda c: c[0],
)
def test_channels_last(case, rx, rw):
    _, cls, kwargs, shape, fk = case
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    torch.manual_seed(0)
    stock = cls(**kwargs).to(memory_format=layout)
    x = torch.randn(shape).contiguous(memory_format=layout)
    _compare(stock, x, rx, rw, True, fk=fk, layout=layout)


# Channels-last input, contiguous (stock-initialised) weight, frozen: dX comes from stock's own
# backward-data kernel. A transposed convolution (what the contiguous layout uses) sums in another order
# here: depthwise in fp64/bf16/fp16, 1x1 and grouped convs were up to 1 ulp off.
CL_FROZEN = [
    ("dw3x3", nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, padding=1), (2, 4, 7, 6)),
    ("1x1", nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=1), (2, 4, 7, 6)),
    (
        "grouped_strided_dil",
        nn.Conv2d,
        dict(in_channels=4, out_channels=8, kernel_size=(1, 3), stride=(2, 1), padding=(0, 2), dilation=(1, 2),
             groups=4),
        (2, 4, 7, 8),
    ),
    ("dw3d", nn.Conv3d, dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, padding=1), (2, 4, 5, 4, 5)),
    ("t2d_grouped", nn.ConvTranspose2d, dict(in_channels=4, out_channels=8, kernel_size=3, stride=2, groups=2),
     (2, 4, 5, 6)),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CL_FROZEN, ids=[c[0] for c in CL_FROZEN])
def test_channels_last_input_frozen_weight_bitwise(case, dtype):
    _, cls, kwargs, shape = case
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    torch.manual_seed(0)
    stock = cls(**kwargs).to(dtype)
    x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    _compare(stock, x, True, False, False, dtype=dtype, layout=layout)  # dX alone (dB: see _bias_exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 1, 5, 5), (2, 4, 1, 1), (2, 1, 1, 5)], ids=str)
@pytest.mark.parametrize("k", [1, 3])
def test_ambiguous_layout_input_frozen_weight_bitwise(shape, k, dtype):
    """An X contiguous in both layouts (size-1 channel or spatial dims) made channels-last, like a squeeze-
    excitation block's pooled (N, C, 1, 1) in a channels-last model: aten goes by its strides and runs the
    channels-last kernel; taking it for contiguous gave dX up to 1 bf16 ulp off (0.03) and contiguous."""
    torch.manual_seed(0)
    stock = nn.Conv2d(shape[1], 8, k, padding=k // 2).to(dtype).requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last).copy_(torch.randn(shape))
    g = torch.randn(stock(x).shape).to(dtype)
    o1, dx1 = input_grad_as_returned(stock, x, g)
    o2, dx2 = input_grad_as_returned(slim, x, g)
    assert_same(o2, o1, what="output")
    assert_same(dx2, dx1, what="input grad")
    assert dx2.stride() == dx1.stride()


def test_contiguous_pointwise_conv_input_grad_is_bitwise():
    """A 1x1 conv's dX with a frozen weight goes through convolution_backward (issue 22), stock's own
    backward-data kernel: bitwise, where the transposed convolution used before summed in another order for some
    fp32 shapes (this one: 2.4e-7)."""
    torch.manual_seed(0)
    stock = nn.Conv2d(2, 8, 1)
    x = torch.randn(2, 2, 5, 5)
    _compare(stock, x, True, False, False)
    _compare(copy.deepcopy(stock), x, True, True, True)  # weight training: stock's own single call, bitwise


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CL_FROZEN, ids=[c[0] for c in CL_FROZEN])
def test_dx_kernels_do_not_read_input_values(case, dtype):
    """The premise of the shape carriers: aten's dX-only convolution_backward and the pad backwards read their
    input's shape and layout, never its values (a NaN-filled input gives X's result, bitwise)."""
    _, cls, kwargs, shape = case
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    torch.manual_seed(0)
    m = cls(**kwargs).to(dtype)
    x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    nan = torch.full_like(x, float("nan"))
    transposed = cls is nn.ConvTranspose2d
    args = (None, list(m.stride), list(m.padding), list(m.dilation), transposed,
            list(getattr(m, "output_padding", (0,) * (len(shape) - 2))), m.groups, [True, False, False])
    g = torch.randn(m(x).shape).to(dtype)
    ref = torch.ops.aten.convolution_backward(g, x, m.weight.detach(), *args)[0]
    got = torch.ops.aten.convolution_backward(g, nan, m.weight.detach(), *args)[0]
    assert_same(got, ref, what="dX")
    assert got.stride() == ref.stride()
    if len(shape) == 4:
        for fn in (torch.ops.aten.reflection_pad2d_backward, torch.ops.aten.replication_pad2d_backward):
            gp = torch.randn(shape[:2] + (shape[2] + 2, shape[3] + 2)).to(dtype).contiguous(memory_format=layout)
            ref, got = fn(gp, x, [1, 1, 1, 1]), fn(gp, nan, [1, 1, 1, 1])
            assert_same(got, ref, what=str(fn))
            assert got.stride() == ref.stride()


@pytest.mark.parametrize("caller_holds_x", [True, False], ids=["caller-holds-x", "x-made-in-step"])
@pytest.mark.parametrize("cls", [nn.Conv2d, nn.ConvTranspose2d])
def test_channels_last_frozen_peak_not_above_stock(cls, caller_holds_x):
    """Channels-last dX without dW feeds stock's kernel X itself when the caller still holds it, else an
    uninitialised X-sized tensor in backward (where stock holds the X it kept): the step's peak is never
    above stock's, and in the second case saved bytes are 0 where stock's are X's size."""
    torch.manual_seed(0)
    stock = cls(8, 8, 3, padding=1, groups=8).to(memory_format=torch.channels_last).requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.randn(4, 8, 16, 16).contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(stock(x))

    def step(m, xi):
        (m(xi) if caller_holds_x else m(xi * 2.0)).backward(g)

    peaks = [peak_bytes(step, m, x.clone(memory_format=torch.preserve_format).requires_grad_())
             for m in (stock, slim)]
    assert peaks[1] <= peaks[0], peaks
    assert saved_bytes(slim, x.clone(memory_format=torch.preserve_format).requires_grad_()) == 0


@pytest.mark.parametrize("rw", [False, True], ids=["frozen", "weight-trains"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if c[0] in ("c2d", "c2d_depthwise", "c2d_reflect", "c3d", "t2d")], ids=lambda c: c[0]
)
def test_channels_last_output_grad_on_contiguous_input(case, rw):
    """A contiguous model and input whose output gradient arrives in channels_last (diffusers' AutoencoderKL
    does this): stock runs its backward in the contiguous layout; ours must too, or dX is ~1e-6 off."""
    _, cls, kwargs, shape, fk = case
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    torch.manual_seed(0)
    stock = cls(**kwargs).requires_grad_(rw)
    slim = slim_copy(stock)
    x1 = torch.randn(shape, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    o1, o2 = stock(x1, **fk), slim(x2, **fk)
    g = torch.randn(o1.shape).contiguous(memory_format=layout)
    o1.backward(g)
    o2.backward(g)
    assert_same(x2.grad, x1.grad, what="input grad")
    assert x2.grad.stride() == x1.grad.stride()
    if rw:
        assert_same(slim.weight.grad, stock.weight.grad, what="weight grad")


def _assert_input_grad_like_stock(stock, slim, x, g):
    """Output, the input gradient as backward returns it (values and strides), stock vs converted."""
    o1, dx1 = input_grad_as_returned(stock, x, g)
    o2, dx2 = input_grad_as_returned(slim, x, g)
    assert_same(o2, o1, what="output")
    assert_same(dx2, dx1, what="input grad")
    assert dx2.stride() == dx1.stride()


@pytest.mark.parametrize("rw", [False, True], ids=["frozen", "weight-trains"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4),  # depthwise: its weight reads as contiguous too
        lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=4),
        lambda: nn.Conv2d(4, 2, 1, groups=2),
        lambda: nn.ConvTranspose2d(4, 4, 2, stride=2, groups=4),
        lambda: nn.Conv2d(4, 6, 3, padding=1),
    ],
    ids=["depthwise", "depthwise_x2", "grouped_1x1", "t_depthwise", "dense"],
)
@pytest.mark.parametrize("shape", [(2, 4, 5, 5), (1, 4, 5, 1)])
def test_channels_last_input_contiguous_output_grad(make, rw, shape):
    """A channels_last X whose output gradient arrives contiguous (a pool's backward does this): stock's
    backend runs channels_last, from X, and returns dX channels_last; ours too, with stock's bits."""
    torch.manual_seed(0)
    stock = make().requires_grad_(rw)
    slim = slim_copy(stock)
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    _assert_input_grad_like_stock(stock, slim, x, torch.randn(stock(x).shape))
    if rw:
        assert_same(slim.weight.grad, stock.weight.grad, what="weight grad")


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c[0] in ("c1d", "c2d", "c2d_reflect", "c2d_same_even_dil", "c3d_circular", "t2d", "t3d")
    ],
    ids=lambda c: c[0],
)
def test_autocast_bf16(case):
    _, cls, kwargs, shape, fk = case
    torch.manual_seed(0)
    stock = cls(**kwargs)
    x = torch.randn(shape)
    for flags in [(True, False, False), (True, True, True), (False, True, False)]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s, m = _compare(copy.deepcopy(stock), x, *flags, fk=fk, dtype=torch.bfloat16)
        if flags[1]:
            assert m.weight.grad.dtype == torch.float32


PAD_MODE_MODULES = [
    (mode, nd)
    for mode in ("reflect", "replicate", "circular")
    for nd in (1, 2, 3)
]


def _pad_module(mode, nd, **kw):
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1]
    return cls(4, 6, 3, padding=(1, 2, 1)[:nd], padding_mode=mode, **kw), (2, 4) + (5, 6, 4)[:nd]


@pytest.mark.parametrize("adt", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode,nd", PAD_MODE_MODULES, ids=lambda v: str(v))
def test_autocast_low_precision_input_with_padding_mode(mode, nd, xdt, adt):
    """A bf16/fp16 X under autocast with a non-zero padding mode. On CPU autocast runs reflection_pad1d/2d and
    replication_pad1d/2d/3d in fp32 (its fp32 list): stock pads an fp32 copy of X and the pad's backward sums
    in fp32 before the cast back to X's dtype; summed in X's dtype, dX was off by 1 bf16 ulp (0.0156)."""
    torch.manual_seed(0)
    stock, shape = _pad_module(mode, nd)
    x = torch.randn(shape).to(xdt)
    for flags in [(True, False, False), (True, True, True), (False, True, False)]:
        with torch.autocast("cpu", dtype=adt):
            _compare(copy.deepcopy(stock), x, *flags, dtype=adt)


@pytest.mark.parametrize("rx", [True, False], ids=["x-trains", "x-frozen"])
@pytest.mark.parametrize("mode,nd", PAD_MODE_MODULES, ids=lambda v: str(v))
def test_autocast_padding_mode_keeps_cast_copy(mode, nd, rx):
    """Under autocast with a non-zero padding mode and the weight training, stock keeps its padded bf16 copy of
    X; we keep the unpadded bf16 copy (not the fp32 X: 432 > 320 bytes for a Conv1d with pad 1), plus the
    cast weight where X needs grad, as stock. Gradients bitwise (test_autocast_bf16), X's producer not told
    that X is kept."""
    from slimgrad.functional._common import UseCell, mark_producer

    torch.manual_seed(0)
    stock, shape = _pad_module(mode, nd)
    slim = slim_copy(stock)
    x = torch.randn(shape)
    counts = []
    for m in (stock, slim):
        with SavedTensors(exclude=[m]) as c, torch.autocast("cpu", dtype=torch.bfloat16):
            m(x.clone().requires_grad_(rx))
        counts.append(c.bytes)
    expected = x.numel() * 2 + (stock.weight.numel() * 2 if rx else 0)
    assert counts[1] == expected
    assert counts[1] <= counts[0], counts
    h = x.clone().requires_grad_(True) * 1.0
    cell = UseCell()
    mark_producer(h, cell)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slim(h)
    assert not cell.kept


@pytest.mark.parametrize("rx", [True, False], ids=["x-trains", "x-frozen"])
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_padding_mode_view_input_keeps_compact_copy(mode, rx):
    """X a view of a larger tensor (one chunk of h), the weight training: stock keeps its padded copy (a compact
    tensor); keeping the view would keep h's whole storage (8192 bytes against stock's 3200). We keep a compact
    copy of X instead, and gradients stay bitwise (the copy is a differentiable clone: double backward too)."""
    torch.manual_seed(0)
    stock = nn.Conv2d(4, 6, 3, padding=1, padding_mode=mode)
    slim = slim_copy(stock)
    h = torch.randn(2, 16, 8, 8)
    counts = []
    for m in (stock, slim):
        with SavedTensors(exclude=[m]) as c:
            m(h.clone().requires_grad_(rx).chunk(4, dim=1)[0])
        counts.append(c.bytes)
    assert counts[1] == 2 * 4 * 8 * 8 * 4  # X's own elements, fp32
    assert counts[1] <= counts[0], counts
    # Values and gradients against stock on the same kind of view.
    h1, h2 = h.clone().requires_grad_(rx), h.clone().requires_grad_(rx)
    o1, o2 = stock(h1.chunk(4, dim=1)[1]), slim(h2.chunk(4, dim=1)[1])
    assert_same(o2, o1, what="output")
    g = torch.randn(o1.shape)
    o1.backward(g)
    o2.backward(g)
    assert_same(slim.weight.grad, stock.weight.grad, what="weight grad")
    assert_same(h2.grad, h1.grad, what="input grad")
    # A view that already is compact enough (the whole batch, contiguous) is kept as is.
    assert saved_bytes(slim, h[:, :4].contiguous().requires_grad_(rx)) == 2 * 4 * 8 * 8 * 4


def test_double_backward_view_input_and_autocast_copy():
    """The kept copy (compact clone of a view, autocast's cast) is an input of the Function made by a
    differentiable op, so a double backward reaches X through it: fp64 gradgradcheck through a view."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, 5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    f = lambda h, w: sf.conv_nd(h.chunk(4, dim=1)[1], w, None, padding=(1, 2, 2, 1), nd=2,
                                padding_mode="reflect")
    assert torch.autograd.gradgradcheck(f, (h, w))


@pytest.mark.parametrize("rw", [False, True], ids=["frozen", "weight-trains"])
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_channels_last_padding_mode_input_grad_layout(mode, rw):
    """Channels-last X with a padding mode: the reflection/replication pad's backward returns its gradient in
    X's layout in stock; fed a zero-stride stand-in it came out contiguous (restrided by AccumulateGrad on a
    leaf, but a non-leaf X's producer got another layout, and the step's peak was above stock's)."""
    torch.manual_seed(0)
    stock = nn.Conv2d(4, 6, 3, padding=1, padding_mode=mode).requires_grad_(rw)
    slim = slim_copy(stock)
    x = torch.randn(2, 4, 7, 6).contiguous(memory_format=torch.channels_last)
    _assert_input_grad_like_stock(stock, slim, x, torch.randn(stock(x).shape))
    big = torch.randn(4, 8, 32, 32).contiguous(memory_format=torch.channels_last)
    stock8 = nn.Conv2d(8, 8, 3, padding=1, padding_mode=mode).requires_grad_(rw)
    slim8 = slim_copy(stock8)
    g8 = torch.randn(4, 8, 32, 32)

    def step(m, xi):
        m(xi).backward(g8)

    peaks = [peak_bytes(step, m, big.clone(memory_format=torch.preserve_format).requires_grad_())
             for m in (stock8, slim8)]
    assert peaks[1] <= peaks[0], peaks


def _functional_cases():
    return [
        (F.conv1d, sf.conv1d, (2, 4, 9), (6, 4, 3), dict(stride=2, padding=1)),
        (F.conv2d, sf.conv2d, (2, 4, 7, 8), (6, 2, 3, 2), dict(padding="same", groups=2, dilation=(2, 1))),
        (F.conv2d, sf.conv2d, (4, 7, 8), (6, 4, 3, 3), dict(padding="valid")),
        (F.conv3d, sf.conv3d, (2, 3, 4, 5, 6), (4, 3, 2, 3, 2), dict(stride=(1, 2, 1), padding=(1, 0, 1))),
        (F.conv_transpose1d, sf.conv_transpose1d, (2, 4, 9), (4, 3, 3), dict(stride=2, output_padding=1)),
        (
            F.conv_transpose2d,
            sf.conv_transpose2d,
            (2, 4, 5, 6),
            (4, 3, 3, 3),
            dict(stride=2, padding=1, output_padding=1, groups=2, dilation=1),
        ),
        (F.conv_transpose3d, sf.conv_transpose3d, (2, 4, 3, 4, 5), (4, 2, 2, 2, 3), dict(stride=2)),
    ]


@pytest.mark.parametrize("flags", grad_combos(3), ids=lambda f: "xwb=" + "".join(str(int(v)) for v in f))
@pytest.mark.parametrize("case", _functional_cases(), ids=lambda c: c[0].__name__ + str(len(c[2])))
def test_functional_matches_stock_and_keeps_minimum(case, flags):
    stock_fn, slim_fn, xs, ws, kw = case
    rx, rw, rb = flags
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
    transposed = "transpose" in stock_fn.__name__
    b = torch.randn(ws[1] * kw.get("groups", 1) if transposed else ws[0], generator=gen)
    ins1 = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), flags)]
    ins2 = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), flags)]
    o1, o2 = stock_fn(*ins1, **kw), slim_fn(*ins2, **kw)
    assert_same(o2, o1, what="output")
    if o1.requires_grad:
        g = torch.randn(o1.shape, generator=gen)
        o1.backward(g)
        o2.backward(g.clone())
    for name, a, e in zip("xwb", ins2, ins1):
        assert_same(a.grad, e.grad, what=name, **({} if name != "b" or rw else BIAS_TOL))
    # W is a plain tensor here, so it counts when X needs grad; and when W trains, where stock's own op runs (it
    # keeps what we would: X, plus a reference to the caller's leaf W, free but counted here) and where the Function
    # runs (an asymmetric padding='same': stock keeps the padded X, the Function X and the leaf W dW reads).
    expected = (x.nbytes if rw else 0) + (w.nbytes if rx or rw else 0)
    args = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), flags)]
    assert saved_bytes(slim_fn, *args, **kw) == expected


def _backward_peak(module, x, g, **fk):
    out = module(x, **fk)
    return peak_bytes(lambda: out.backward(g))


def _step_peak(module, x, g, **fk):
    return peak_bytes(lambda: module(x, **fk).backward(g))


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("rx,rw", [(True, False), (True, True), (False, True)])
def test_peak_not_above_stock(mode, rx, rw):
    torch.manual_seed(0)
    stock = nn.Conv2d(8, 8, 3, padding=1, padding_mode=mode)
    slim = slim_copy(stock)
    for m in (stock, slim):
        m.weight.requires_grad_(rw)
    x = torch.randn(4, 8, 32, 32)
    g = torch.randn(4, 8, 32, 32)
    slack = 0  # (dW without dX reads the kept weight: no weight-sized copy of a stand-in)
    # Backward alone: with a zero padding mode, equal to stock (no input-sized stand-in is materialised).
    # With another mode, dW re-pads the kept X in backward (stock keeps the padded X from forward), so
    # compare the whole step, where slimgrad is lower: stock holds X and padded X across the step.
    measure = _backward_peak if mode == "zeros" or not rw else _step_peak
    p_stock = measure(stock, x.clone().requires_grad_(rx), g)
    p_slim = measure(slim, x.clone().requires_grad_(rx), g)
    assert p_slim <= p_stock + slack, (p_slim, p_stock)
    if mode != "zeros" and not rw:
        assert _step_peak(slim, x.clone().requires_grad_(rx), g) < _step_peak(
            stock, x.clone().requires_grad_(rx), g
        )


@pytest.mark.parametrize("cls,shape", [(nn.ConvTranspose2d, (4, 8, 16, 16)), (nn.Conv3d, (2, 4, 8, 8, 8))])
def test_backward_peak_not_above_stock_other_kinds(cls, shape):
    torch.manual_seed(0)
    stock = cls(shape[1], 8, 3, padding=1)
    slim = slim_copy(stock)
    x = torch.randn(shape)
    g = torch.randn_like(stock(x))
    for rx, rw in [(True, False), (True, True), (False, True)]:
        for m in (stock, slim):
            m.weight.requires_grad_(rw)
        slack = 0
        p_stock = _backward_peak(stock, x.clone().requires_grad_(rx), g)
        p_slim = _backward_peak(slim, x.clone().requires_grad_(rx), g)
        assert p_slim <= p_stock + slack, (rx, rw, p_slim, p_stock)


def _step_measures(m, x0, rx, g):
    """Saved bytes of a forward and peak bytes of a forward+backward step (the loss upcasts, as a mixed-precision
    loss does), then the gradients, from fresh clones of x0."""
    for p in m.parameters():
        p.grad = None
    kept = saved_bytes(m, x0.clone().requires_grad_(rx))

    def step(xi):
        (m(xi).float() * g).sum().backward()

    for p in m.parameters():
        p.grad = None
    peak = peak_bytes(step, x0.clone().requires_grad_(rx))
    for p in m.parameters():
        p.grad = None
    x = x0.clone().requires_grad_(rx)
    step(x)
    return kept, peak, x.grad, [p.grad for p in m.parameters()]


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("rb", [True, False], ids=["bias-trains", "bias-frozen"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["reflect", "circular", "replicate"])
@pytest.mark.parametrize("nd,layout", [(1, None), (2, None), (2, torch.channels_last), (3, None),
                                       (3, torch.channels_last_3d)], ids=lambda v: str(v))
def test_padding_mode_weight_grad_without_input_grad_peak_not_above_stock(nd, layout, mode, dtype, rb, core):
    """A padding mode, X needing no grad, the weight trainable: dW came from aten's convolution_backward fed a
    zero-stride one-element stand-in for the weight, which aten makes contiguous: a weight-sized copy plus the
    element above stock's step peak (Conv2d fp64 538632 -> 547856 B, core and Python path). The weight is a leaf
    the caller holds, so it is kept (costing nothing) and passed: saved and peak bytes at most stock's, gradients
    stock's bits, on both paths."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    torch.manual_seed(0)
    stock = getattr(nn, f"Conv{nd}d")(8, 16, 3, padding=1, padding_mode=mode).to(dtype)
    stock.bias.requires_grad_(rb)
    slim = slim_copy(stock)
    x0, g = _sweep_input_and_grad(stock, nd, layout, dtype)
    with contextlib.nullcontext() if core else csrc.disabled():
        (k0, p0, _, grads0), (k1, p1, _, grads1) = (_step_measures(m, x0, False, g) for m in (stock, slim))
        assert _ran_core_or_python(slim, x0, core)
    for a, b in zip(grads1, grads0):
        assert_same(a, b, what="parameter grad")
    assert k1 <= k0, (k1, k0)
    assert p1 <= p0, (p1, p0)


def _sweep_input_and_grad(stock, nd, layout, dtype):
    """The module sweep's input for an ``nd``-d conv (in ``layout`` where given) and a fixed fp32 upstream gradient
    of stock's output shape."""
    shape = {1: (4, 8, 48), 2: (4, 8, 12, 12), 3: (2, 8, 6, 6, 6)}[nd]
    x0 = torch.randn(shape).to(dtype)
    if layout is not None:
        x0 = x0.contiguous(memory_format=layout)
    return x0, torch.randn(stock(x0).shape, generator=torch.Generator().manual_seed(1))


def _ran_core_or_python(m, x, core) -> bool:
    """Whether m's forward on x ran the compiled core (core) or slimgrad's Python Function (not core)."""
    name = m(x).grad_fn.name()
    return ("CppNode" in name) == core and "Convolution" not in name


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("groups,cout", [(8, 8), (1, 16)], ids=["depthwise", "dense"])
@pytest.mark.parametrize("nd,layout", [(1, None), (2, None), (2, torch.channels_last), (3, None)],
                         ids=lambda v: str(v))
def test_low_precision_bias_grad_with_frozen_weight_peak_not_above_stock(nd, layout, groups, cout, dtype, core):
    """X and the bias trainable, the weight frozen, fp16/bf16 on CPU: dB was a separate sum over dY, which aten's
    CPU sum of a reduced float type over several dims makes through an fp32 copy of dY, while dX is alive: the
    step peaked above stock (depthwise Conv2d fp16 46080 -> 46136 B here, +56; 2x dY's bytes where the step's peak
    is backward's). dB now comes from stock's own convolution_backward call, with dX (X's shape carried): dX and dB
    stock's bits, saved and peak bytes at most stock's, on both paths."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    torch.manual_seed(0)
    stock = getattr(nn, f"Conv{nd}d")(8, cout, 3, padding=1, groups=groups).to(dtype).requires_grad_(False)
    stock.bias.requires_grad_(True)
    slim = slim_copy(stock)
    x0, g = _sweep_input_and_grad(stock, nd, layout, dtype)
    with contextlib.nullcontext() if core else csrc.disabled():
        (k0, p0, dx0, grads0), (k1, p1, dx1, grads1) = (_step_measures(m, x0, True, g) for m in (stock, slim))
        assert _ran_core_or_python(slim, x0.clone().requires_grad_(), core)
    assert_same(dx1, dx0, what="dX")
    assert_same(grads1[1], grads0[1], what="dB")
    assert k1 <= k0, (k1, k0)
    assert p1 <= p0, (p1, p0)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("held", [True, False], ids=["x-held", "x-temporary"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("groups,cout", [(8, 8), (1, 16)], ids=["depthwise", "dense"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("nd,layout", [(1, None), (2, None), (2, torch.channels_last), (3, None)],
                         ids=lambda v: str(v))
def test_low_precision_bias_alone_trainable_peak_not_above_stock(nd, layout, transposed, groups, cout, dtype, held,
                                                                core):
    """The bias alone trainable (X and the weight frozen), fp16/bf16 on CPU, the loss in the output's dtype: dB was
    a sum over (N, spatial), which aten's CPU sum of a reduced float type over several dims makes through an fp32
    copy of dY, above stock's step peak (depthwise Conv2d fp16 here 36916 B against stock's 20756, +16160; 1-3d,
    transposed too). dB now comes from stock's own convolution_backward, output_mask for the bias only, fed the kept
    leaf weight and a carrier of X's shape (X while the caller holds it, else the gradient's storage or a fresh
    tensor: stock keeps X): dB stock's bits, saved and peak bytes at most stock's, on both paths."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    torch.manual_seed(0)
    cls = getattr(nn, f"{'ConvTranspose' if transposed else 'Conv'}{nd}d")
    stock = cls(8, cout, 3, padding=1, groups=groups).to(dtype).requires_grad_(False)
    stock.bias.requires_grad_(True)
    slim = slim_copy(stock)
    x0, g = _sweep_input_and_grad(stock, nd, layout, dtype)
    g = g.to(dtype)

    def measures(m):
        def step(xi):
            (m(xi if held else xi * 1) * g).sum().backward()  # (xi * 1: an X only the convolution holds)

        m.bias.grad = None
        kept = saved_bytes(m, x0.clone())
        peak = peak_bytes(step, x0.clone())
        m.bias.grad = None
        step(x0.clone())
        return kept, peak, m.bias.grad

    with contextlib.nullcontext() if core else csrc.disabled():
        (k0, p0, db0), (k1, p1, db1) = measures(stock), measures(slim)
        assert _ran_core_or_python(slim, x0, core)
    assert_same(db1, db0, what="dB")
    assert k1 <= k0, (k1, k0)
    assert p1 <= p0, (p1, p0)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_strided_input_grad_with_frozen_weight_peak_not_above_stock(nd, dtype, core):
    """A stride-2 convolution, the weight frozen, X needing grad: dX through oneDNN's transposed convolution on dY
    took a scratch 128 B larger than stock's backward-data kernel (Conv2d fp32 4x8x12x12: step peak 83104 against
    stock's 82976). Strided convolutions on CPU now run stock's kernel on a carrier of X's shape: dX stock's bits,
    saved and peak bytes at most stock's, on both paths."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    shape = (4, 8) + (12,) * nd
    torch.manual_seed(0)
    stock = getattr(nn, f"Conv{nd}d")(8, 16, 3, stride=2, padding=1).to(dtype).requires_grad_(False)
    slim = slim_copy(stock)
    x0 = torch.randn(shape).to(dtype)

    def measures(m):
        def step(xi):
            m(xi).sum().backward()

        kept = saved_bytes(m, x0.clone().requires_grad_())
        peak = peak_bytes(step, x0.clone().requires_grad_())
        x = x0.clone().requires_grad_()
        step(x)
        return kept, peak, x.grad

    with contextlib.nullcontext() if core else csrc.disabled():
        (k0, p0, dx0), (k1, p1, dx1) = measures(stock), measures(slim)
        assert _ran_core_or_python(slim, x0.clone().requires_grad_(), core)
    assert_same(dx1, dx0, what="dX")
    assert k1 <= k0, (k1, k0)
    assert p1 <= p0, (p1, p0)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_computed_weight_grad_without_input_grad_peak_not_above_stock(mode, core):
    """A computed (non-leaf) weight, X needing no grad: stock keeps the weight from forward to backward; slimgrad
    keeps neither and feeds dW's convolution_backward an uninitialised carrier of the weight's shape (the stand-in
    it fed before was copied by aten to a weight-sized tensor plus the stand-in's element, above stock's peak)."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    torch.manual_seed(0)
    w0 = torch.randn(16, 8, 3, 3, dtype=torch.float64)
    x = torch.randn(4, 8, 12, 12, dtype=torch.float64)
    g = torch.randn(4, 16, 12, 12, dtype=torch.float64)
    pad = (1, 1, 1, 1)

    def stock(xi, w):
        return F.conv2d(F.pad(xi, pad, mode="reflect") if mode != "zeros" else xi, w, None, 1, 0 if mode != "zeros"
                        else 1)

    def slim(xi, w):
        return sf.conv_nd(xi, w, None, 1, pad if mode != "zeros" else 1, 1, 1, nd=2, padding_mode=mode)

    def step(fn, w_leaf):
        (fn(x, w_leaf * 1.0) * g).sum().backward()  # a computed weight, alive only where the convolution keeps it

    with contextlib.nullcontext() if core else csrc.disabled():
        peaks, grads = [], []
        for fn in (stock, slim):
            w_leaf = w0.clone().requires_grad_()
            peaks.append(peak_bytes(step, fn, w_leaf))
            w_leaf.grad = None
            step(fn, w_leaf)
            grads.append(w_leaf.grad)
    assert_same(grads[1], grads[0], what="dW")
    assert peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("cls,shape,stride", [(nn.Conv2d, (2, 8, 24, 24), 1), (nn.Conv2d, (2, 8, 24, 24), 2),
                                              (nn.ConvTranspose2d, (2, 8, 24, 24), 1),
                                              (nn.ConvTranspose3d, (2, 4, 6, 12, 12), 1)])
def test_frozen_weight_on_stocks_fallback_kernels(cls, shape, stride, dtype, core):
    """fp16 and fp64 convolutions run stock's CPU fallback kernels (no oneDNN), whose transposed counterpart
    unfolds into other column buffers: dX through it peaked 1-13.5x X above stock's. dX now comes from stock's
    own backward kernel (X's shape carried), bitwise, and the step's peak is at most stock's."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    torch.manual_seed(0)
    stock = cls(shape[1], shape[1], 3, padding=1, stride=stride).to(dtype).requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.randn(shape).to(dtype)

    def step(m, xi):
        y = m(xi)
        (xi + y if y.shape == xi.shape else y).float().square().sum().backward()
        return xi.grad

    with contextlib.nullcontext() if core else csrc.disabled():
        grads = [step(m, x.clone().requires_grad_()) for m in (stock, slim)]
        peaks = [peak_bytes(step, m, x.clone().requires_grad_()) for m in (stock, slim)]
    assert_same(grads[1], grads[0], what="dX")
    assert peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("case", ["batch1_small_x", "small_dy", "small_dx_transposed", "onednn_off", "onednn_off_3d"])
def test_frozen_weight_where_onednn_does_not_run(case, core):
    """fp32 where stock's kernel or the transposed convolution on dY is not oneDNN's (batch 1 with a small X; a
    small dY, 64 -> 3 channels; oneDNN switched off): the slow transposed kernel unfolded dY into a column buffer
    stock's backward never makes, up to 8x X above stock's peak. dX now comes from stock's own backward kernel
    wherever aten's selector says either call would leave oneDNN: bitwise, and the step's peak is stock's."""
    from slimgrad import csrc

    if core and csrc.core() is None:
        pytest.skip("the compiled core is unavailable here")
    cls, cin, cout, shape = {
        "batch1_small_x": (nn.Conv2d, 16, 32, (1, 16, 16, 16)),
        "small_dy": (nn.Conv2d, 64, 3, (1, 64, 32, 32)),
        "small_dx_transposed": (nn.ConvTranspose2d, 64, 3, (1, 64, 8, 8)),
        "onednn_off": (nn.Conv2d, 16, 32, (4, 16, 16, 16)),
        "onednn_off_3d": (nn.Conv3d, 8, 8, (2, 8, 6, 8, 8)),
    }[case]
    torch.manual_seed(0)
    stock = cls(cin, cout, 3, padding=1).requires_grad_(False)
    slim = slim_copy(stock)
    x = torch.randn(shape)

    def step(m, xi):
        m(xi).square().sum().backward()
        return xi.grad

    onednn = torch.backends.mkldnn.flags(enabled=not case.startswith("onednn_off"))
    with onednn, contextlib.nullcontext() if core else csrc.disabled():
        grads = [step(m, x.clone().requires_grad_()) for m in (stock, slim)]
        peaks = [peak_bytes(step, m, x.clone().requires_grad_()) for m in (stock, slim)]
    assert_same(grads[1], grads[0], what="dX")
    assert peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize(
    "fn,xs,ws,kw",
    [
        (
            sf.conv_nd,
            (2, 2, 5, 6),
            (3, 2, 3, 3),
            dict(stride=1, padding=(1, 2, 2, 1), nd=2, padding_mode="reflect"),
        ),
        (
            sf.conv_nd,
            (2, 2, 5, 6),
            (3, 2, 3, 3),
            dict(stride=2, padding=(1, 1, 2, 1), nd=2, padding_mode="circular"),
        ),
        (sf.conv_nd, (2, 2, 5), (3, 2, 3), dict(padding=(1, 1), nd=1, padding_mode="replicate")),
        (sf.conv2d, (2, 2, 5, 6), (4, 1, 2, 3), dict(padding="same", dilation=(1, 2), groups=2)),
        (sf.conv_transpose2d, (2, 2, 4, 5), (2, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
        (sf.conv_transpose1d, (2, 2, 4), (2, 3, 2), dict(output_padding=1, dilation=2)),
    ],
)
def test_double_backward(fn, xs, ws, kw):
    """Backward is built from differentiable ops, so second derivatives are exact (fp64 gradgradcheck)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(xs, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(ws, dtype=torch.float64, generator=gen, requires_grad=True)
    nb = ws[1] if fn is sf.conv_transpose2d or fn is sf.conv_transpose1d else ws[0]
    b = torch.randn(nb, dtype=torch.float64, generator=gen, requires_grad=True)
    f = lambda x, w, b: fn(x, w, b, **kw)
    assert torch.autograd.gradgradcheck(f, (x, w, b))
    # Only X differentiable (W not kept for dW) and only W (X kept, W replaced by a stand-in).
    assert torch.autograd.gradgradcheck(lambda x: f(x, w.detach(), None), (x,))
    assert torch.autograd.gradgradcheck(lambda w: f(x.detach(), w, b.detach()), (w,))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
def test_double_backward_padding_mode_against_stock(mode, autocast):
    """A gradient penalty through a conv whose input and weight both need grad. With a padding mode the second
    derivative w.r.t. X has two paths (through dW, which read the padded X, and through the output): stock
    meets them at its padded X and runs the pad's backward once; ours recomputes the pad inside backward, so
    each path runs the pad's backward and they meet at X. Equal up to that summation order, documented in
    README's Exactness list: fp32 1 ulp of the largest value (0.0039 of 6.4e4), bf16 autocast within 1 bf16 ulp
    of it (144 of 6.5e4; the path through dW runs in bf16, where stock's joins fp32 before the pad); the weight's
    second derivative and the zero padding mode are bitwise."""
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    slim = slim_copy(stock)
    x = torch.randn(2, 3, 6, 6)
    r = torch.randn(2, 4, 6, 6)
    out = []
    for m in (stock, slim):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(xi)
        gx, gw = torch.autograd.grad((y.float() * r).pow(3).sum(), [xi, m.weight], create_graph=True)
        (gx.square().sum() + gw.float().square().sum()).backward()
        out.append((xi.grad, m.weight.grad))
    (dx1, dw1), (dx2, dw2) = out
    assert_same(dw2, dw1, what="d/dweight")
    if mode == "zeros":
        assert_same(dx2, dx1, what="d/dx")
    else:
        eps = torch.finfo(torch.bfloat16 if autocast else torch.float32).eps  # 1 ulp of the largest value <= eps * it
        assert (dx2 - dx1).abs().max() <= eps * dx1.abs().max(), (dx2 - dx1).abs().max()


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_double_backward_channels_last(mode):
    """Channels-last dX runs aten's convolution_backward on a carrier of X's layout (an uninitialised tensor
    under create_graph): second derivatives are still exact (fp64 gradgradcheck)."""
    gen = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64, generator=gen).contiguous(memory_format=cl).requires_grad_()
    w = torch.randn(4, 1, 3, 3, dtype=torch.float64, generator=gen).requires_grad_()
    pad = (1, 1, 1, 1) if mode != "zeros" else 1
    f = lambda x, w: sf.conv_nd(x, w, None, padding=pad, groups=4, nd=2, padding_mode=mode)
    assert torch.autograd.gradgradcheck(lambda x: f(x, w.detach()), (x,))
    assert torch.autograd.gradgradcheck(f, (x, w))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Tanh(), nn.Conv2d(4, 2, 3)
    )
    slim = copy.deepcopy(stock)
    slim[0], slim[2] = slim_copy(stock[0]), slim_copy(stock[2])
    slim[0].weight.requires_grad_(False)
    stock[0].weight.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    checkpoint(stock, x1, use_reentrant=use_reentrant).sum().backward()
    checkpoint(slim, x2, use_reentrant=use_reentrant).sum().backward()
    assert_same(x2.grad, x1.grad, what="x")
    for (n, a), b in zip(slim.named_parameters(), stock.parameters()):
        assert_same(a.grad, b.grad, what=n, **({} if n != "0.bias" else BIAS_TOL))


_BAD_CONV_CALLS = {
    "padding='full'": dict(padding="full"),
    "padding='same' with stride 2": dict(padding="same", stride=2),
    "stride of 3 values": dict(stride=(1, 2, 3)),
    "stride=1.5": dict(stride=1.5),
    "groups=0": dict(groups=0),
    "groups=True": dict(groups=True),
}


@pytest.mark.parametrize("case", list(_BAD_CONV_CALLS))
def test_bad_arguments_raise_stocks_error_type_naming_the_argument(case):
    """A user's ``except`` written for stock must catch slimgrad's error: ValueError was raised where stock raises
    RuntimeError (groups=0, a bad padding string, a wrong-length stride) or TypeError (stride=1.5, groups=True)
    (the errors sweep)."""
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3)
    kwargs = _BAD_CONV_CALLS[case]
    with pytest.raises(Exception) as stock:
        F.conv2d(x, w, **kwargs)
    with pytest.raises(stock.type) as ours:
        sf.conv2d(x, w, **kwargs)
    assert next(iter(kwargs)) in str(ours.value)


def test_numpy_integer_options_run_as_stock():
    """Stock takes anything with __index__ (numpy integers) for sizes and groups; converted conv and pooling raised
    (the errors sweep)."""
    import numpy as np

    torch.manual_seed(0)
    for make in (lambda: nn.Conv2d(4, 4, 3, stride=np.int64(2), padding=np.int64(1), groups=np.int64(2)),
                 lambda: nn.MaxPool2d(np.int64(2)), lambda: nn.AvgPool2d(np.int64(2), stride=np.int32(1))):
        stock = make()
        slim = slim_copy(stock)
        x1 = torch.randn(2, 4, 8, 8, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        assert_same(slim(x2), stock(x1), what="output")
        stock(x1).sum().backward()
        slim(x2).sum().backward()
        assert_same(x2.grad, x1.grad, what="x")


def test_complex_convolution_under_the_mode_runs_stock():
    x = torch.randn(1, 2, 5, 5, dtype=torch.cfloat)
    w = torch.randn(3, 2, 3, 3, dtype=torch.cfloat)
    with slimgrad.enabled():
        got = F.conv2d(x, w)
    assert torch.equal(got, F.conv2d(x, w))


def test_conv_transpose_rejects_non_zero_padding_mode_like_stock():
    m = nn.ConvTranspose2d(2, 3, 3)
    m.padding_mode = "reflect"
    with pytest.raises(ValueError, match="zeros"):
        slim_copy(m)(torch.randn(1, 2, 4, 4))


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @st.composite
    def _conv_setup(draw):
        nd = draw(st.integers(1, 3))
        transposed = draw(st.booleans())
        groups = draw(st.sampled_from([1, 2]))
        cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
        k = tuple(draw(st.integers(1, 3)) for _ in range(nd))
        stride = tuple(draw(st.integers(1, 2)) for _ in range(nd))
        dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
        padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
        spatial = tuple(draw(st.integers(3, 6)) for _ in range(nd))
        kw = dict(
            in_channels=cin,
            out_channels=cout,
            kernel_size=k,
            stride=stride,
            dilation=dilation,
            groups=groups,
            bias=draw(st.booleans()),
        )
        if transposed:
            cls = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][nd - 1]
            kw["padding"] = tuple(min(p, d * (kk - 1)) for p, d, kk in zip(padding, dilation, k))
            kw["output_padding"] = tuple(
                draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation)
            )
        else:
            cls = [nn.Conv1d, nn.Conv2d, nn.Conv3d][nd - 1]
            mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
            kw["padding_mode"] = mode
            if mode == "zeros" and draw(st.booleans()):
                kw["padding"] = "same"
                kw["stride"] = (1,) * nd
            else:
                kw["padding"] = tuple(min(p, s - 1) for p, s in zip(padding, spatial))
            eff = [d * (kk - 1) + 1 for d, kk in zip(dilation, k)]
            spatial = tuple(max(s, e) for s, e in zip(spatial, eff))
        flags = tuple(draw(st.booleans()) for _ in range(3))
        batch = draw(st.sampled_from([(), (2,)]))
        return cls, kw, batch + (cin,) + spatial, flags

    @settings(max_examples=25, deadline=None)
    @given(_conv_setup())
    def test_property_random_options(setup):
        cls, kw, shape, (rx, rw, rb) = setup
        torch.manual_seed(0)
        stock = cls(**kw)
        x = torch.randn(shape)
        # output_padding >= stride (allowed when dilation > stride): a plain conv of the gradient yields
        # extra trailing rows that we drop, where stock's oneDNN call sizes its output exactly; the kept
        # values agree to fp32 rounding (1 ulp seen), not bitwise.
        exact = all(op < s for op, s in zip(kw.get("output_padding", ()), kw["stride"]))
        _compare(stock, x, rx, rw, rb, exact=exact)
        expected = x.nbytes if rw else 0
        assert saved_bytes(slim_copy(stock), x.clone().requires_grad_(rx)) == expected


@pytest.mark.slow
def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    slim = slim_copy(stock)
    stock.weight.requires_grad_(False)
    slim.weight.requires_grad_(False)
    compiled = torch.compile(slim, fullgraph=True)
    x = torch.randn(2, 3, 8, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    o1, o2 = stock(x1), compiled(x2)
    torch.testing.assert_close(o2, o1)
    g = torch.randn_like(o1)
    o1.backward(g)
    o2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(slim.bias.grad, stock.bias.grad)
    assert slim.weight.grad is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_torch_compile_autocast_bf16_input_padding_mode_weight_grad(mode):
    """Compiled, a bf16 X under autocast with a reflection/replication pad and the weight training: Inductor's
    layout optimisation saves X channels-last, which the backward's trace-time ``as_strided`` view read with
    contiguous strides (dW 26.6 off a largest value of 34). Compiled gradients now match eager stock's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    slim = slim_copy(stock)
    compiled = torch.compile(slim, fullgraph=True)
    x = torch.randn(2, 3, 8, 8).to(torch.bfloat16)
    grads = []
    for m, owner in ((stock, stock), (compiled, slim)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        y.float().sum().backward()
        grads.append((xi.grad, owner.weight.grad, owner.bias.grad))
    for what, a, e in zip(("input grad", "weight grad", "bias grad"), grads[1], grads[0]):
        assert_same(a, e, exact=False, what=what)


@pytest.mark.parametrize("rx", [False, True])
def test_trainable_weight_runs_stock_op(rx):
    """Where stock keeps what we would keep (weight trains, zeros padding), stock's op runs: no Function,
    and the producer of X is told that X is kept."""
    from slimgrad.functional._common import UseCell, mark_producer

    conv = nn.Conv2d(3, 4, 3, padding=1)
    slim = slim_copy(conv)
    x = torch.randn(2, 3, 5, 5, requires_grad=rx)
    h = x * 1.0 if rx else x
    cell = UseCell()
    if rx:
        mark_producer(h, cell)
    out = slim(h)
    assert type(out.grad_fn).__name__ == "ConvolutionBackward0"
    assert cell.kept == rx
    assert_same(out, conv(h), what="output")
    slim.weight.requires_grad_(False)
    if rx:
        assert type(slim(h).grad_fn).__name__ != "ConvolutionBackward0"  # our Function: X not kept
    reflect = slim_copy(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"))
    assert type(reflect(h).grad_fn).__name__ != "ConvolutionBackward0"  # stock would keep the padded X too
