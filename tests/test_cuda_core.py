"""CUDA only (skipped elsewhere): the compiled core on CUDA tensors (issue 22) against the Python path on CUDA.

The core serves CUDA tensors for the families whose C++ is aten's ops alone: convolution, batch norm (cuDNN where
stock runs it), average pooling, ReLU / LeakyReLU on small tensors (its aten route) and LoRA linear whose adapters
do not drop (``csrc.for_eager(x, cuda=True)``). For each, on independent copies, the core and the Python path
(``csrc.disabled()``) give the same output, every requested gradient bit for bit (strides too) and the same saved
bytes, and the core really ran where it serves the call (its node is the C++ Function's, ``CppNode<slimgrad::...>``)
and did not where it must not (dropping LoRA adapters, 3-d pooling under autocast, ``SLIMGRAD_CORE_CUDA=0``).

cuDNN runs in its deterministic mode here, and the pooling shapes avoid CUDA's atomic backward kernels (adaptive
pooling with non-divisible sizes, overlapping 3-d windows): with atomics two runs of the same kernel can round
differently, which says nothing about the core.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from tests._util import assert_same, grad_combos, saved_bytes, slim_copy
from torch import nn

import slimgrad
import slimgrad.functional.conv as sf
import slimgrad.nn.batchnorm  # noqa: F401  (registers the replacements)
import slimgrad.nn.conv  # noqa: F401
import slimgrad.nn.pooling  # noqa: F401
from slimgrad import csrc

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and csrc.core() is None,
                       reason="the compiled core is unavailable (see `python -m slimgrad kernels`)"),
    pytest.mark.skipif(not csrc.status()["cuda"], reason="SLIMGRAD_CORE_CUDA=0: the core serves CPU tensors only"),
]
DEVICE = "cuda"
LOW = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def _node(out) -> str:
    return out.grad_fn.name() if out.grad_fn is not None else ""


def _ran_core(out, family: str) -> bool:
    name = _node(out)
    return "CppNode<slimgrad::" in name and family in name


def _flags_id(flags) -> str:
    return "".join(str(int(f)) for f in flags)


def _grad_like(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return g.to(device=out.device, dtype=out.dtype)


def _step(module, x, rx, core: bool):
    """Forward and backward on a clone of x (its layout kept): (output, x.grad, saved bytes of a second forward)."""
    xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(rx)
    with csrc.disabled() if not core else _null():
        out = module(xi)
        if out.requires_grad:
            out.backward(_grad_like(out))
        kept = saved_bytes(module, x.detach().clone(memory_format=torch.preserve_format).requires_grad_(rx))
    return out, xi.grad, kept


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _core_vs_python(stock: nn.Module, x: torch.Tensor, rx: bool, family: str, expect_core: bool,
                    atomic_dx: bool = False):
    """The converted module on two independent copies, core on and off: every tensor and byte count equal.
    ``atomic_dx``: the input gradient goes through a kernel that accumulates with atomic adds (CUDA's reflection
    and replication pad backward, which torch flags as nondeterministic: stock differs from itself run to run),
    so it is compared within the dtype's rounding, not bit for bit."""
    core_m, py_m = slim_copy(stock), slim_copy(stock)
    o_c, dx_c, kept_c = _step(core_m, x, rx, True)
    o_p, dx_p, kept_p = _step(py_m, x, rx, False)
    assert_same(o_c, o_p, what="output core/python")
    assert o_c.stride() == o_p.stride(), "output strides core/python"
    if atomic_dx and dx_p is not None:
        # each atomic add rounds in the gradient's dtype; a corner element takes up to 2**3 adds in 3-d
        bound = 16 * torch.finfo(dx_p.dtype).eps * dx_p.abs().max().item()
        assert_same(dx_c, dx_p, exact=False, rtol=0, atol=bound, what="input grad core/python")
    else:
        assert_same(dx_c, dx_p, what="input grad core/python")
    if dx_c is not None:
        assert dx_c.stride() == dx_p.stride(), "input grad strides core/python"
    for (name, a), b in zip(core_m.named_parameters(), py_m.parameters(), strict=True):
        assert_same(a.grad, b.grad, what=f"{name}.grad core/python")
    for (name, a), b in zip(core_m.named_buffers(), py_m.buffers(), strict=True):
        assert_same(a, b, what=f"buffer {name} core/python")
    assert kept_c == kept_p, f"saved bytes core {kept_c} != python {kept_p}"
    if o_c.requires_grad:
        if expect_core is not None:
            assert _ran_core(o_c, family) == expect_core, (_node(o_c), expect_core)
        assert "CppNode" not in _node(o_p), _node(o_p)
    return o_c


# ----------------------------------------------------------------------------------------------------- conv

# (id, stock class, constructor kwargs, input shape)
CONV = [
    ("c1d", nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=2, dilation=2),
     (2, 4, 11)),
    ("c2d", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1), (2, 4, 9, 8)),
    ("c2d_1x1", nn.Conv2d, dict(in_channels=8, out_channels=4, kernel_size=1), (2, 8, 6, 7)),
    ("c2d_depthwise", nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=3, groups=4, padding=1),
     (2, 4, 7, 8)),
    ("c2d_same_even", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=(2, 4), padding="same",
                                      dilation=(1, 3)), (2, 4, 7, 8)),
    ("c2d_reflect", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=(1, 2),
                                    padding_mode="reflect"), (2, 4, 7, 8)),
    ("c2d_circular", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1),
                                     padding_mode="circular"), (2, 4, 7, 8)),
    ("c3d", nn.Conv3d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=(1, 2, 1), padding=1),
     (2, 3, 5, 6, 7)),
    ("c3d_replicate", nn.Conv3d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=1,
                                      padding_mode="replicate"), (2, 3, 5, 6, 7)),
    ("t2d", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1,
                                     output_padding=1), (2, 4, 5, 6)),
    ("t2d_1x1_groups", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=1, stride=2, groups=2),
     (2, 4, 5, 6)),
    ("t3d", nn.ConvTranspose3d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=(2, 1, 2), padding=1,
                                     output_padding=(1, 0, 0)), (2, 3, 4, 5, 3)),
]
_CONV = {c[0]: c for c in CONV}


def _conv_case(cid, flags, dtype, layout=None, weight_layout=None):
    _, cls, kwargs, shape = _CONV[cid]
    rx, rw, rb = flags
    torch.manual_seed(0)
    stock = cls(**kwargs).to(device=DEVICE, dtype=dtype)
    if weight_layout is not None:
        stock = stock.to(memory_format=weight_layout)
    stock.weight.requires_grad_(rw)
    if stock.bias is not None:
        stock.bias.requires_grad_(rb)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    padded = kwargs.get("padding_mode", "zeros") != "zeros" or cid == "c2d_same_even"
    # the core serves a frozen weight, or any weight with an explicit pad; a trainable weight without one runs
    # stock's op (both paths: stock keeps what slimgrad would)
    atomic = kwargs.get("padding_mode") in ("reflect", "replicate")  # (their CUDA backward adds atomically)
    out = _core_vs_python(stock, x, rx, "Conv", expect_core=padded or not rw, atomic_dx=atomic)
    if layout is not None:
        assert out.is_contiguous(memory_format=layout) == stock(x).is_contiguous(memory_format=layout)


@pytest.mark.parametrize("flags", grad_combos(3), ids=_flags_id)
@pytest.mark.parametrize("cid", list(_CONV))
def test_conv_fp32_every_combo(cid, flags):
    _conv_case(cid, flags, torch.float32)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("flags", [(True, False, False), (True, False, True), (False, False, True),
                                   (True, True, True)], ids=_flags_id)
@pytest.mark.parametrize("cid", list(_CONV))
def test_conv_half_precision(cid, flags, dtype):
    _conv_case(cid, flags, dtype)


CL = ["c2d", "c2d_1x1", "c2d_depthwise", "c2d_same_even", "c2d_reflect", "c3d", "c3d_replicate", "t2d", "t3d"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [(True, False, False), (True, False, True), (False, True, True)], ids=_flags_id)
@pytest.mark.parametrize("weight_cl", [False, True], ids=["w_contig", "w_cl"])
@pytest.mark.parametrize("cid", CL)
def test_conv_channels_last(cid, weight_cl, flags, dtype):
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}[len(_CONV[cid][3])]
    _conv_case(cid, flags, dtype, layout=layout, weight_layout=layout if weight_cl else None)


def test_conv_functional_and_autocast():
    """The functional form runs the core on CUDA; under CUDA autocast the Python Function runs (no core)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 8, device=DEVICE)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    b = torch.randn(6, device=DEVICE)
    results = []
    for core in (True, False):
        xi, bi = x.clone().requires_grad_(), b.clone().requires_grad_()
        with csrc.disabled() if not core else _null():
            out = sf.conv2d(xi, w, bi, stride=2, padding=1)
            out.backward(_grad_like(out))
        assert _ran_core(out, "Conv") == core, _node(out)
        results.append((out, xi.grad, bi.grad))
    for a, b_ in zip(*results, strict=True):
        assert_same(a, b_, what="functional conv core/python")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = sf.conv2d(x.clone().requires_grad_(), w, None, padding=1)
    assert out.dtype == torch.bfloat16 and not _ran_core(out, "Conv"), _node(out)


# ----------------------------------------------------------------------------------------------- batch norm

# (class, input shape, affine): 2-d input (BatchNorm1d on (N, C)) and no affine parameters are cases stock's
# selector never hands to cuDNN
BN = [(nn.BatchNorm1d, (6, 4), True), (nn.BatchNorm1d, (6, 4, 5), True), (nn.BatchNorm2d, (4, 4, 5, 6), True),
      (nn.BatchNorm3d, (2, 4, 3, 4, 5), True), (nn.BatchNorm2d, (4, 4, 5, 6), False)]


def _bn_expect_core(stock, x, rx, rw, training):
    """Whether the converted module's call runs the core: where stock keeps what slimgrad would (a trainable
    weight, or batch statistics with x needing grad) stock's functional runs; elsewhere the core, which runs cuDNN
    where stock's ``torch.batch_norm`` does (torch's own selector) and aten's native kernels elsewhere. None (not
    asserted): evaluation on a channels-last x, which functional/batch_norm.py leaves to the Python Function on
    CUDA (its direct dX rounds as stock's CPU kernel)."""
    if rw or (training and rx):
        return False
    if not training and x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return None
    return True


def _stock_runs_cudnn(stock, x, training) -> bool:
    mean = stock.running_mean if stock.running_mean is not None else stock.weight
    var = stock.running_var if stock.running_var is not None else stock.weight
    return (stock.weight is not None and torch._C._select_batch_norm_backend(
        x, stock.weight, stock.bias, mean, var, training, stock.eps) == torch._C._BatchNormBackend.Cudnn)


def _bn_case(cls, shape, affine, flags, training, dtype, param_dtype=None, layout=None):
    rx, rw, rb = flags
    torch.manual_seed(0)
    stock = cls(shape[1], affine=affine).to(device=DEVICE, dtype=param_dtype or dtype)
    with torch.no_grad():
        if affine:
            stock.weight.normal_(1, 0.2)
            stock.bias.normal_(0, 0.2)
        stock.running_mean.normal_(0, 0.3)
        stock.running_var.uniform_(0.5, 1.5)
    if affine:
        stock.weight.requires_grad_(rw)
        stock.bias.requires_grad_(rb)
    stock.train(training)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    expect = _bn_expect_core(stock, x, rx, rw and affine, training)
    _core_vs_python(stock, x, rx, "BatchNorm", expect_core=expect)
    return expect


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("flags", grad_combos(3), ids=_flags_id)
@pytest.mark.parametrize("cls,shape,affine", BN, ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_batch_norm_fp32_every_combo(cls, shape, affine, flags, training):
    _bn_case(cls, shape, affine, flags, training, torch.float32)


@pytest.mark.parametrize("param_dtype", [None, torch.float32], ids=["same", "fp32_params"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("flags", [(True, False, False), (True, False, True), (False, False, True)],
                         ids=_flags_id)
def test_batch_norm_half_precision(flags, training, dtype, param_dtype):
    _bn_case(nn.BatchNorm2d, (4, 4, 5, 6), True, flags, training, dtype, param_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("flags", [(True, False, False), (True, False, True), (False, False, True)],
                         ids=_flags_id)
def test_batch_norm_channels_last(flags, training, dtype):
    _bn_case(nn.BatchNorm2d, (4, 4, 5, 6), True, flags, training, dtype, layout=torch.channels_last)


def test_batch_norm_core_serves_cuda():
    """The cases above where the core serves a CUDA call exist, with stock's cuDNN (a 4-d affine input, in
    evaluation and in training with only the bias trainable) and without it (a 2-d input, no affine parameters,
    bf16), so the comparisons above did compare the core with the Python path on both of its CUDA routes."""
    cases = [(nn.BatchNorm1d, (6, 4), True, (True, False, False), False, torch.float32, False),
             (nn.BatchNorm2d, (4, 4, 5, 6), False, (True, False, False), False, torch.float32, False),
             (nn.BatchNorm2d, (4, 4, 5, 6), True, (True, False, True), False, torch.bfloat16, False),
             (nn.BatchNorm2d, (4, 4, 5, 6), True, (True, False, True), False, torch.float32, True),
             (nn.BatchNorm2d, (4, 4, 5, 6), True, (False, False, True), True, torch.float32, True)]
    for cls, shape, affine, flags, training, dtype, cudnn in cases:
        stock = cls(shape[1], affine=affine).to(DEVICE, dtype).train(training)
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        assert _stock_runs_cudnn(stock, x, training) == cudnn, (cls, shape, dtype, training)
        assert _bn_case(cls, shape, affine, flags, training, dtype) is True, (cls, shape, dtype, training)


def test_batch_norm_cudnn_training_core_keeps_what_the_python_path_keeps():
    """Training with only dB on cuDNN: the core keeps cuDNN's statistics and reserve (C-sized, and what cuDNN
    sizes for itself), never x, and dB is stock's bit for bit."""
    torch.manual_seed(0)
    stock = nn.BatchNorm2d(8).to(DEVICE).train()
    stock.weight.requires_grad_(False)
    x = torch.randn(4, 8, 6, 5, device=DEVICE)
    assert _stock_runs_cudnn(stock, x, True)
    slim = slim_copy(stock)
    out = slim(x)
    assert _ran_core(out, "BatchNorm"), _node(out)
    g = _grad_like(out)
    out.backward(g)
    stock(x).backward(g)
    assert_same(slim.bias.grad, stock.bias.grad, what="bias grad core/stock")
    reserve = torch._C._get_cudnn_batch_norm_reserve_space_size(x, True)
    assert saved_bytes(slim, x) <= 2 * 8 * 4 + reserve
    assert saved_bytes(stock, x) >= x.numel() * x.element_size()


# ---------------------------------------------------------------------------------------------- ReLU / leaky

RELU = {"relu": lambda: nn.ReLU(), "relu_inplace": lambda: nn.ReLU(inplace=True),
        "leaky": lambda: nn.LeakyReLU(0.1), "leaky_inplace": lambda: nn.LeakyReLU(0.2, inplace=True)}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _relu_input(shape, dtype, layout):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3
    x.view(-1)[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.0])
    x = x.to(device=DEVICE, dtype=dtype)
    return x if layout is None else x.contiguous(memory_format=layout)


def _relu_run(module, x, g, core: bool):
    from slimgrad.measure import SavedTensors

    xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    with csrc.disabled() if not core else _null():
        h = xi * 1.0  # a non-leaf, so that the in-place modules may run
        with SavedTensors() as counter:
            out = module(h)
        node = _node(out)
        out.backward(g)
    return out.detach(), xi.grad, counter.bytes, node


def _same_bits(a, b, what):
    """Bitwise, signed zeros included (NaN positions equal; payloads not compared)."""
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != {b.stride()}"
    nan = torch.isnan(b)
    assert torch.equal(torch.isnan(a), nan), f"{what}: NaN positions"
    assert torch.equal(a.view(_INT[a.element_size()])[~nan], b.view(_INT[b.element_size()])[~nan]), what


@pytest.mark.parametrize("layout", [None, torch.channels_last], ids=["contig", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW], ids=str)
@pytest.mark.parametrize("rid", list(RELU))
def test_relu_core_on_cuda(rid, dtype, layout):
    """Small CUDA tensors run the core's aten route (one C++ Function): output, input gradient (strides too) and
    saved bytes (the 1-bit mask) equal to the Python path's Triton kernel and to stock, NaN, ±inf and ±0 included."""
    x = _relu_input((4, 6, 5, 7), dtype, layout)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(device=DEVICE, dtype=dtype)
    stock = RELU[rid]()
    y_s, dx_s, _, _ = _relu_run(stock, x, g, True)
    y_c, dx_c, kept_c, node_c = _relu_run(slim_copy(stock), x, g, True)
    y_p, dx_p, kept_p, node_p = _relu_run(slim_copy(stock), x, g, False)
    assert "CppNode<slimgrad::" in node_c and "ReluMask" in node_c, node_c
    assert "CppNode" not in node_p, node_p
    for (a, b), what in (((y_c, y_p), "output core/python"), ((dx_c, dx_p), "input grad core/python"),
                         ((y_c, y_s), "output core/stock"), ((dx_c, dx_s), "input grad core/stock")):
        _same_bits(a, b, what)
    assert kept_c == kept_p == (x.numel() + 7) // 8, (kept_c, kept_p)


def test_relu_large_cuda_tensors_run_the_triton_kernel(monkeypatch):
    """Above CORE_CUDA_MAX_NUMEL the Python Function (one-pass Triton kernel) runs; the bits agree either way."""
    from slimgrad.kernels import relu_mask

    x = _relu_input((2, 4, 8, 8), torch.float32, None)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), device="cpu").to(DEVICE)
    small = _relu_run(slim_copy(nn.ReLU()), x, g, True)
    monkeypatch.setattr(relu_mask, "CORE_CUDA_MAX_NUMEL", x.numel() - 1)
    large = _relu_run(slim_copy(nn.ReLU()), x, g, True)
    assert "CppNode" in small[3] and "CppNode" not in large[3], (small[3], large[3])
    _same_bits(small[0], large[0], "output")
    _same_bits(small[1], large[1], "input grad")
    assert small[2] == large[2]


# The core's own CUDA kernels (csrc/relu_mask_cuda.cu, built with nvcc where a CUDA toolkit is found): one launch
# each way where the aten route launches four forward and two backward.


def _has_cuda_kernels() -> bool:
    return bool(csrc.core().cuda_kernels())


def test_core_cuda_kernels_build_where_nvcc_is_found():
    """Where torch's CUDA, a GPU and nvcc are all here, the core carries its CUDA kernels (else status says why)."""
    if csrc._cuda_torch() is None or csrc._nvcc() is None:
        pytest.skip(f"not built here: {csrc.status()['cuda_kernels_reason']}")
    assert _has_cuda_kernels(), csrc.status()["cuda_kernels_reason"]
    assert "relu_mask_cuda.cu" in csrc.status()["sources"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [1, 7, 8, 31, 33, 255, 257, 8191, 21001])
@pytest.mark.parametrize("rid", ["relu", "leaky", "relu_inplace"])
def test_relu_core_on_cuda_odd_sizes(rid, numel, dtype):
    """Sizes around the kernels' byte, warp and block boundaries (the mask's last byte partly filled, several
    blocks): output, gradient and kept bytes as stock's and the Python path's, bit for bit."""
    x = _relu_input((numel,), dtype, None) if numel >= 8 else (torch.randn(numel) * 3).to(DEVICE, dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(device=DEVICE, dtype=dtype)
    stock = RELU[rid]()
    y_s, dx_s, _, _ = _relu_run(stock, x, g, True)
    y_c, dx_c, kept_c, node_c = _relu_run(slim_copy(stock), x, g, True)
    y_p, dx_p, kept_p, _ = _relu_run(slim_copy(stock), x, g, False)
    assert "CppNode<slimgrad::" in node_c, node_c
    for (a, b), what in (((y_c, y_s), "output core/stock"), ((dx_c, dx_s), "input grad core/stock"),
                         ((y_c, y_p), "output core/python"), ((dx_c, dx_p), "input grad core/python")):
        _same_bits(a, b, what)
    assert kept_c == kept_p == (numel + 7) // 8


def _cuda_kernels_run(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


@pytest.mark.parametrize("rid", ["relu", "leaky", "relu_inplace"])
def test_relu_cuda_kernels_launch_once_each_way(rid):
    """The point of the kernels: forward and backward are one launch each (the aten route: four and two)."""
    if not _has_cuda_kernels():
        pytest.skip(f"the core's CUDA kernels are not built here: {csrc.status()['cuda_kernels_reason']}")
    x = _relu_input((4, 6, 5, 7), torch.float32, None)
    module = slim_copy(RELU[rid]())
    leaf = x.detach().clone().requires_grad_()
    h = leaf * 1.0
    out = []
    forward = _cuda_kernels_run(lambda: out.append(module(h)))
    assert len(forward) == 1 and "relu_mask_forward" in forward[0], forward
    g = torch.ones_like(out[0])
    backward = _cuda_kernels_run(lambda: torch.autograd.grad(out[0], leaf, g))  # (with the product's backward)
    ours = [k for k in backward if "relu_mask_backward" in k]
    route = [k for k in backward if "bitwise_and" in k or "threshold" in k or "leaky_relu" in k]
    assert len(ours) == 1 and not route, backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 7, 255, 257, 21001])
@pytest.mark.parametrize("seed_value", [0, -1, 2**40 + 12345, -(2**63)])
def test_dropout_seed_cuda_kernel_is_the_philox_mask(seed_value, numel, dtype):
    """The core's CUDA seed kernel (csrc/dropout_seed_cuda.cu; LoRA does not route to it yet): the mask is the torch
    reference's ``philox_keep`` and Triton's, the values x * scale rounded once, in place too, one launch."""
    from slimgrad.kernels import dropout as dk

    if not _has_cuda_kernels():
        pytest.skip(f"the core's CUDA kernels are not built here: {csrc.status()['cuda_kernels_reason']}")
    p = 0.3
    x = (torch.rand(numel, generator=torch.Generator().manual_seed(numel)) + 0.5).to(dtype)  # no zeros
    seed = torch.tensor(seed_value, dtype=torch.int64)
    expected = dk.SEED_TORCH.forward(x, p, seed, False)
    core = csrc.core()
    xc, sc = x.to(DEVICE), seed.to(DEVICE)
    kernels = _cuda_kernels_run(lambda: core.dropout_seed_forward(xc, p, sc, False))
    assert len(kernels) == 1 and "dropout_seed" in kernels[0], kernels
    out = core.dropout_seed_forward(xc, p, sc, False)
    _same_bits(out.cpu(), expected, "forward")
    _same_bits(core.dropout_seed_backward(xc, p, sc).cpu(), expected, "backward")
    inplace = xc.clone()
    assert core.dropout_seed_forward(inplace, p, sc, True).data_ptr() == inplace.data_ptr()
    _same_bits(inplace.cpu(), expected, "in place")
    assert torch.equal((out.cpu() != 0), dk.philox_keep((numel,), p, seed))
    if dtype != torch.float64:  # Triton's kernel, the Python path's on CUDA: the same mask
        pytest.importorskip("triton")
        from slimgrad.kernels.triton import dropout as td

        assert torch.equal(td.keep_mask(xc, p, sc).bool().cpu(), dk.philox_keep((numel,), p, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("need", [(True, True, True), (False, True, True), (True, False, True)],
                         ids=["all", "adapters", "x-and-B"])
def test_lora_seed_dropout_through_the_core_on_cuda(need, dtype, monkeypatch):
    """``SLIMGRAD_CORE_CUDA_SEED=1`` (off by default until this passes on a GPU): LoRA whose adapters drop under the
    seed policy runs the core's C++ Function with its CUDA Philox kernel, bit for bit the Python Function with
    Triton's kernel (the switch off), the same saved bytes and generator state."""
    from slimgrad.functional import lora as lora_module
    from slimgrad.functional.dropout import dropout_policy
    from slimgrad.functional.lora import LoraAdapter, lora_linear
    from slimgrad.measure import SavedTensors

    if not _has_cuda_kernels():
        pytest.skip(f"the core's CUDA kernels are not built here: {csrc.status()['cuda_kernels_reason']}")
    g0 = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 5, 40, generator=g0).to(DEVICE, dtype)
    W = torch.randn(24, 40, generator=g0).to(DEVICE, dtype)
    A0, B0 = (torch.randn(8, 40, generator=g0) * 0.3).to(DEVICE), (torch.randn(24, 8, generator=g0) * 0.3).to(DEVICE)
    gy = torch.randn(3, 5, 24, generator=g0).to(DEVICE, dtype)
    runs = []
    for switch in (True, False):
        monkeypatch.setattr(lora_module, "_CUDA_SEED", switch)
        x, A, B = (t.clone().requires_grad_(q) for t, q in zip((x0, A0, B0), need))
        torch.manual_seed(3)
        with dropout_policy("seed"), SavedTensors() as kept:
            out = lora_linear(x, W, None, [LoraAdapter(A, B, 2.0, 0.25)], cast_input=True)
        state = torch.cuda.get_rng_state()
        node = out.grad_fn.name()
        out.backward(gy)
        runs.append((out.detach(), [t.grad for t in (x, A, B)], kept.bytes, state, node))
    (out_c, grads_c, kept_c, state_c, node_c), (out_p, grads_p, kept_p, state_p, node_p) = runs
    assert "CppNode" in node_c and "CppNode" not in node_p, (node_c, node_p)
    _same_bits(out_c, out_p, "output")
    for a, b in zip(grads_c, grads_p):
        assert (a is None) == (b is None)
        if a is not None:
            _same_bits(a, b, "gradient")
    assert kept_c == kept_p and torch.equal(state_c, state_p)


# -------------------------------------------------------------------------------------------------- avg pool

# (id, stock module, input shape); 3-d windows do not overlap and adaptive sizes divide the input's: CUDA's
# backward kernels are atomic otherwise
POOL = [
    ("avg1d", nn.AvgPool1d(3, stride=2, padding=1), (2, 3, 9)),
    ("avg2d", nn.AvgPool2d(3, stride=2, padding=1), (2, 3, 9, 8)),
    ("avg2d_ceil_nopad", nn.AvgPool2d((2, 3), stride=(2, 1), ceil_mode=True, count_include_pad=False), (2, 3, 7, 8)),
    ("avg2d_divisor", nn.AvgPool2d(2, divisor_override=3), (2, 3, 6, 8)),
    ("avg3d", nn.AvgPool3d(2), (2, 3, 4, 6, 4)),
    ("adaptive1d", nn.AdaptiveAvgPool1d(3), (2, 3, 9)),
    ("adaptive2d", nn.AdaptiveAvgPool2d((3, 2)), (2, 3, 6, 8)),
    ("adaptive3d", nn.AdaptiveAvgPool3d(2), (2, 3, 4, 6, 4)),
]
_POOL = {p[0]: p for p in POOL}


def _pool_case(pid, dtype, layout=None, autocast=None):
    _, stock, shape = _POOL[pid]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    # 3-d pooling under CPU autocast runs in fp32 (its fp32 list): the Python path's cast; CUDA's autocast leaves it
    expect_core = not (autocast is not None and len(shape) == 5 and dtype in LOW and DEVICE == "cpu")
    # adaptive 1-2d pooling with a channels_last gradient: stock's op on both paths (pooling.
    # _adaptive_grad_needs_input: the gradient's layout needs an input-sized tensor, which stock keeps anyway)
    expect_core = expect_core and not (pid.startswith("adaptive") and len(shape) < 5 and layout is not None)
    with torch.autocast(DEVICE, dtype=autocast) if autocast is not None else _null():
        _core_vs_python(stock, x, True, "AvgPool", expect_core=expect_core)
        for rx in (False,):  # no gradient wanted: stock's op in both
            _core_vs_python(stock, x, rx, "AvgPool", expect_core=False)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("pid", list(_POOL))
def test_avg_pool(pid, dtype):
    _pool_case(pid, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pid", ["avg2d", "avg2d_ceil_nopad", "adaptive2d"])
def test_avg_pool_channels_last(pid, dtype):
    _pool_case(pid, dtype, layout=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pid", ["avg2d", "avg3d", "adaptive2d"])
def test_avg_pool_under_autocast(pid, dtype):
    _pool_case(pid, dtype, autocast=torch.bfloat16)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("pid", ["avg3d", "adaptive3d", "avg2d"])
def test_avg_pool_under_autocast_vs_stock(pid, core):
    """Under CUDA autocast stock's 3-d average pooling stays in bf16 (only CPU autocast's fp32 list holds it): the
    same output dtype, values and input gradient on either path (the Python path cast to fp32 on every device)."""
    _, stock, shape = _POOL[pid]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=torch.bfloat16)
    results = []
    for m in (slim_copy(stock), stock):
        xi = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16), csrc.disabled() if not core else _null():
            out = m(xi)
        out.float().backward(_grad_like(out.float()))
        results.append((out, xi.grad))
    expect = core and not (DEVICE == "cpu" and len(shape) == 5)  # (CPU autocast: the Python path's fp32 cast)
    assert _ran_core(results[0][0], "AvgPool") == expect, _node(results[0][0])
    assert_same(results[0][0], results[1][0], what="output slimgrad/stock")
    assert_same(results[0][1], results[1][1], what="input grad slimgrad/stock")


# ------------------------------------------------------------------------------------------------------ LoRA

IN, OUT, R = 16, 12, 4


def _peft_model(dtype, dropout):
    peft = pytest.importorskip("peft")
    from tests._util import OneLayer

    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT)
    with torch.no_grad():
        for t in layer.parameters():
            t.normal_(0, 0.3)
    config = peft.LoraConfig(r=R, lora_alpha=8, target_modules=["proj"], lora_dropout=dropout,
                             init_lora_weights=False)
    return peft.get_peft_model(OneLayer(layer.to(dtype)), config).to(DEVICE)


def _lora_layer(model):
    from peft.tuners.lora.layer import Linear as LoraLinear

    return next(m for m in model.modules() if isinstance(m, LoraLinear))


def _lora_step(model, x0, rx, core):
    x = x0.clone().requires_grad_(rx)
    for p in model.parameters():
        p.grad = None
    with csrc.disabled() if not core else _null():
        out = model(x)
        node = _node(out)
        if out.requires_grad:
            out.backward(_grad_like(out))
        kept = saved_bytes(model, x0.clone().requires_grad_(rx))
    return out, x.grad, [p.grad for p in model.parameters()], kept, node


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("combo", grad_combos(4), ids=lambda c: "".join("xWAB"[i] if f else "-" for i, f in
                                                                        enumerate(c)))
@pytest.mark.parametrize("mode", ["no_dropout", "dropout_eval", "dropout_train"])
def test_peft_lora(mode, combo, dtype):
    """peft's LoRA on a bf16/fp16 base upcasts its adapters to fp32 (peft's default): the layer casts x, the
    core's case; an fp32 base without dropout runs stock's ops (nothing to save). Dropout in training stays with
    the Python Function on CUDA (the "seed" policy); in evaluation it is off and the core runs."""
    rx, rw, ra, rb = combo
    stock = _peft_model(dtype, 0.0 if mode == "no_dropout" else 0.25)
    if mode == "dropout_eval":
        stock.eval()
    layer = _lora_layer(stock)
    layer.base_layer.weight.requires_grad_(rw)
    layer.base_layer.bias.requires_grad_(False)
    layer.lora_A["default"].weight.requires_grad_(ra)
    layer.lora_B["default"].weight.requires_grad_(rb)
    core_m = slimgrad.convert(copy.deepcopy(stock))
    py_m = slimgrad.convert(copy.deepcopy(stock))
    x0 = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=dtype)
    torch.manual_seed(7)
    c = _lora_step(core_m, x0, rx, True)
    torch.manual_seed(7)
    p = _lora_step(py_m, x0, rx, False)
    assert_same(c[0], p[0], what="output core/python")
    assert_same(c[1], p[1], what="x.grad core/python")
    for a, b in zip(c[2], p[2], strict=True):
        assert_same(a, b, what="parameter grad core/python")
    assert c[3] == p[3], f"saved bytes core {c[3]} != python {p[3]}"
    function_runs = dtype != torch.float32 or mode == "dropout_train"
    if c[0].requires_grad and function_runs:
        expect = mode != "dropout_train"
        assert ("CppNode" in c[4] and "LoraLinearFunction" in c[4]) == expect, c[4]
        assert "CppNode" not in p[4], p[4]


def test_lora_functional_dropout_one_runs_the_core():
    """p = 1 (aten's product with zero, no draw) runs the core on CUDA; 0 < p < 1 does not."""
    from slimgrad.functional.lora import LoraAdapter, lora_linear

    torch.manual_seed(0)
    x = torch.randn(4, IN, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device=DEVICE, dtype=torch.bfloat16)
    a = LoraAdapter(torch.randn(R, IN, device=DEVICE).requires_grad_(), torch.randn(OUT, R, device=DEVICE), 0.5,
                    1.0)
    results = []
    for core in (True, False):
        xi = x.clone().requires_grad_()
        A = a.A.detach().clone().requires_grad_()
        with csrc.disabled() if not core else _null():
            out = lora_linear(xi, w, None, [a._replace(A=A)])
            out.backward(_grad_like(out))
        assert ("CppNode" in _node(out)) == core, _node(out)
        results.append((out, xi.grad, A.grad))
    for u, v in zip(*results, strict=True):
        assert_same(u, v, what="lora p=1 core/python")
    out = lora_linear(x.clone().requires_grad_(), w, None, [a._replace(dropout=0.3)], dropout_policy="bits")
    assert "CppNode" not in _node(out), _node(out)


# ---------------------------------------------------------------------------------------------------- switch

_SWITCH = """
import torch, slimgrad
from slimgrad import csrc
from torch import nn
conv = slimgrad.convert(nn.Conv2d(3, 4, 3).requires_grad_(False))
names = []
for device in ("cpu", "cuda"):
    m = conv.to(device)
    out = m(torch.randn(1, 3, 6, 6, device=device, requires_grad=True))
    names.append(out.grad_fn.name())
print(csrc.status()["cuda"], "CppNode" in names[0], "CppNode" in names[1])
"""


def test_env_switch():
    """``SLIMGRAD_CORE_CUDA=0`` keeps CUDA tensors on the Python path and CPU tensors on the core (its default, on,
    is what every test above runs under)."""
    env = dict(os.environ, SLIMGRAD_CORE_CUDA="0")
    run = subprocess.run([sys.executable, "-c", _SWITCH], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "False True False", run.stdout


# ------------------------------------------------------------------------------------------- against stock

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("which", ["conv3x3", "conv1x1", "conv_depthwise", "conv_transpose", "bn_eval", "avg_pool"])
def test_core_vs_stock_on_cuda(which, layout, dtype):
    """The core's output and input gradient against stock's on CUDA (frozen weights, x trains: the rows the core
    serves in a host-bound step), bit for bit. slimgrad's convolution dX (contiguous, kernel > 1x1) is the
    transposed convolution where stock runs cuDNN's backward-data call (the same cuDNN operation), or, for a
    depthwise fp32 convolution, aten's CUDA depthwise kernel (a different one: this case says whether they agree);
    its batch norm runs the core (aten's native kernels) only where stock's does not pick cuDNN. A failure here is
    the Python path's as well (the tests above), not the core's."""
    torch.manual_seed(0)
    stock = {"conv3x3": lambda: nn.Conv2d(8, 16, 3, padding=1), "conv1x1": lambda: nn.Conv2d(8, 16, 1),
             "conv_depthwise": lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8),
             "conv_transpose": lambda: nn.ConvTranspose2d(8, 4, 2, stride=2), "bn_eval": lambda: nn.BatchNorm2d(8),
             "avg_pool": lambda: nn.AvgPool2d(3, stride=2, padding=1)}[which]()
    stock = stock.to(device=DEVICE, dtype=dtype).eval().requires_grad_(False)
    if which == "bn_eval":
        with torch.no_grad():
            stock.weight.normal_(1, 0.2)
            stock.bias.normal_(0, 0.2)
            stock.running_mean.normal_(0, 0.3)
            stock.running_var.uniform_(0.5, 1.5)
    x = torch.randn(4, 8, 12, 10, generator=torch.Generator().manual_seed(2)).to(device=DEVICE, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        stock = stock.to(memory_format=torch.channels_last)
    slim = slim_copy(stock)
    results = []
    for m in (slim, stock):
        xi = x.clone(memory_format=torch.preserve_format).requires_grad_()
        out = m(xi)
        out.backward(_grad_like(out))
        results.append((out, xi.grad))
    if which != "bn_eval":  # (batch norm: the core where stock runs aten's native kernels, else stock's cuDNN)
        assert _ran_core(results[0][0], "AvgPool" if which == "avg_pool" else "Conv"), _node(results[0][0])
    assert_same(results[0][0], results[1][0], what=f"{which} output core/stock")
    assert_same(results[0][1], results[1][1], what=f"{which} input grad core/stock")
    assert results[0][1].stride() == results[1][1].stride(), "input grad strides core/stock"
