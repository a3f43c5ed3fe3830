"""The norms' compiled-core path (csrc/norms.cpp) against the Python path (``csrc.disabled()``) and stock PyTorch /
the Hugging Face reference forwards, on independent copies: outputs and every requested gradient bitwise, the
same gradient layouts, saved bytes equal to the Python path's (never above stock's), and the core actually ran.

Also the Triton RMSNorm with only the weight trainable (issue 22 §4): saved bytes never above stock's, under
``TRITON_INTERPRET=1`` (run by tests/test_triton_interpreter.py's subprocess, or directly with the variable set).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from tests._util import grad_combos, slim_copy
from torch import nn

from slimgrad import csrc
from slimgrad.functional.norms import group_norm, layer_norm, rms_norm, rms_norm_hf
from slimgrad.integrations.hf_norms import REFERENCE_FORWARDS
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.skipif(csrc.core() is None, reason="the compiled core is unavailable here (no compiler, "
                                "or SLIMGRAD_CORE=0): the Python path is what runs, tested by test_norms.py")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


# ------------------------------------------------------------------------------------------------- helpers
def _hf_class(style):
    """A module whose forward is the Hugging Face reference source of ``style`` (the text hf_norms verifies
    transformers' classes against), with slimgrad's replacement forward as a twin class."""
    forwards, extra = REFERENCE_FORWARDS[style]
    namespace = {"torch": torch}
    for src in (forwards[0], *extra.values()):
        exec(src, namespace)  # noqa: S102 - our own reference sources
    methods = {"forward": namespace["forward"], **{k: namespace[k] for k in extra}}
    eps_name = "eps" if style == "gemma" else "variance_epsilon"

    def init(self, h, eps=1e-6, dtype=None):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.empty(h, dtype=dtype).uniform_(-1.5, 1.5))
        setattr(self, eps_name, eps)

    ref = type(f"Ref{style}", (nn.Module,), {"__init__": init, **methods})

    def slim_forward(self, hidden_states):
        return rms_norm_hf(hidden_states, self.weight, getattr(self, eps_name), style)

    slim = type(f"Slim{style}", (ref,), {"forward": slim_forward})
    return ref, slim


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1.5, 1.5)


def _node_names(fn, depth=3) -> str:
    """The names of the nodes within ``depth`` of the output's: the Function's node, or the stock cast (and copy) a
    style's output ends in after it (functional/norms.py's _finish_output)."""
    if fn is None or depth == 0:
        return ""
    return type(fn).__name__ + fn.name() + "".join(_node_names(f, depth - 1) for f, _ in fn.next_functions)


def _run(module, x0, g0, rg_x, core, grad_layout=None):
    """One step on fresh copies: (output, input grad, parameter grads, saved bytes, grad_fn name)."""
    x = x0.clone(memory_format=torch.preserve_format) if x0.is_contiguous() or x0.is_contiguous(
        memory_format=torch.channels_last) else x0
    x = x.detach().requires_grad_(rg_x)
    ctx = csrc.disabled if core is False else contextlib.nullcontext
    with ctx(), SavedTensors(exclude=[module]) as counter:
        y = module(x)
    name = _node_names(y.grad_fn)
    if y.requires_grad:
        g = g0.to(y.dtype)
        if grad_layout == "transposed":
            g = g.transpose(0, 1).contiguous().transpose(0, 1)
        elif grad_layout == "expanded":
            g = g[:1].expand(g.shape)
        with ctx():
            y.backward(g)
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return y.detach(), x.grad, grads, counter.bytes, name


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} vs {b.stride()}"
    same = torch.equal(a, b) or (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    assert same, f"{what}: not bitwise equal (max diff {(a.double() - b.double()).abs().max()})"


def check_three_ways(stock, slim, x0, rg, *, grad_layout=None, core_name, stock_bytes_at_least=True):
    """stock vs core vs Python path, every tensor bitwise, saved bytes core == Python <= stock. ``core_name``: the
    node the core's call must make (or a function of ``rg`` giving it)."""
    if callable(core_name):
        core_name = core_name(rg)
    rg_x, *rg_p = rg
    params = [n for n, _ in stock.named_parameters()]
    for m in (stock, slim):
        for n, flag in zip(params, rg_p):
            getattr(m, n).requires_grad_(flag)
    g0 = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = _run(stock, x0, g0, rg_x, None, grad_layout)
    core = _run(slim, x0, g0, rg_x, True, grad_layout)
    python = _run(copy.deepcopy(slim), x0, g0, rg_x, False, grad_layout)
    if any(rg):
        assert core_name in core[4], f"the core did not run: {core[4]}"
        assert "CppNode" not in python[4]
    for i, what in enumerate(("output", "input grad")):
        _same(core[i], ref[i], f"{what} core vs stock rg={rg}")
        _same(python[i], ref[i], f"{what} python vs stock rg={rg}")
    for n, a, b, c in zip(params, core[2], python[2], ref[2]):
        _same(a, c, f"{n} grad core vs stock rg={rg}")
        _same(b, c, f"{n} grad python vs stock rg={rg}")
    assert core[3] == python[3], f"saved bytes: core {core[3]} vs python {python[3]} rg={rg}"
    if stock_bytes_at_least:
        assert core[3] <= ref[3], f"saved bytes: core {core[3]} > stock {ref[3]} rg={rg}"


def _x(shape, dtype, layout="contiguous", seed=0):
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if layout == "transposed":
        return base.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":
        wide = torch.randn((*shape[:-1], 2 * shape[-1]), generator=torch.Generator().manual_seed(seed)).to(dtype)
        return wide[..., 1:1 + shape[-1]]
    if layout == "channels_last":
        return base.contiguous(memory_format=torch.channels_last)
    return base


# ------------------------------------------------------------------------------------------------- RMSNorm
RMS_SHAPES = {"3x5x33": ((3, 5, 33), 33), "2x3x8 (3,8)": ((2, 3, 8), (3, 8)), "4x1x300": ((4, 1, 300), 300)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(RMS_SHAPES))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_rms_norm_torch_style(shape, dtype, affine):
    x_shape, normalized = RMS_SHAPES[shape]
    for eps in (None, 1e-3):
        stock = nn.RMSNorm(normalized, eps=eps, elementwise_affine=affine).to(dtype)
        _randomize(stock)
        slim = slim_copy(stock)
        for rg in grad_combos(2 if affine else 1):
            check_three_ways(stock, slim, _x(x_shape, dtype), rg, core_name="RMSNormFn")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(REFERENCE_FORWARDS))
def test_rms_norm_hf_styles(style, dtype):
    ref_cls, slim_cls = _hf_class(style)
    for h, eps in ((33, 1e-6), (8, 1e-5)):
        torch.manual_seed(0)
        ref = ref_cls(h, eps, dtype)
        slim = slim_cls(h, eps, dtype)
        slim.load_state_dict(ref.state_dict())
        for rg in grad_combos(2):
            # the references keep more (fp32 copies); ours never more, checked where stock's count is meaningful.
            # Only dX of an fp64 x in Llama/Olmo2 style saves nothing: stock's ops run (functional/norms.py
            # _apply_rms), in both paths
            stock_runs = dtype == torch.float64 and style in ("llama", "olmo2") and rg == (True, False)
            check_three_ways(ref, slim, _x((3, 5, h), dtype), rg,
                             core_name="MulBackward0" if stock_runs else "RMSNormFn")


@pytest.mark.parametrize("style", ["torch", "llama", "t5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_rms_norm_non_contiguous(style, dtype, layout):
    """Non-contiguous inputs run the aten sequence in the core; layouts and bits equal the Python path's."""
    if style == "torch":
        stock = nn.RMSNorm(24).to(dtype)
        _randomize(stock)
        slim = slim_copy(stock)
    else:
        ref_cls, slim_cls = _hf_class(style)
        stock, slim = ref_cls(24, 1e-6, dtype), slim_cls(24, 1e-6, dtype)
        slim.load_state_dict(stock.state_dict())
    for rg in grad_combos(2):
        check_three_ways(stock, slim, _x((4, 6, 24), dtype, layout), rg, core_name="RMSNormFn")


@pytest.mark.parametrize("grad_layout", ["transposed", "expanded"])
@pytest.mark.parametrize("style", ["torch", "llama", "gemma", "t5"])
def test_rms_norm_grad_layouts(style, grad_layout):
    """A contiguous x with a non-contiguous upstream gradient: the aten sequence, dX's strides as stock's."""
    dtype = torch.bfloat16
    if style == "torch":
        stock = nn.RMSNorm(16).to(dtype)
        _randomize(stock)
        slim = slim_copy(stock)
    else:
        ref_cls, slim_cls = _hf_class(style)
        stock, slim = ref_cls(16, 1e-6, dtype), slim_cls(16, 1e-6, dtype)
        slim.load_state_dict(stock.state_dict())
    for rg in [(True, False), (True, True), (False, True)]:
        check_three_ways(stock, slim, _x((4, 6, 16), dtype), rg, grad_layout=grad_layout, core_name="RMSNormFn")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("style", ["torch", "llama", "olmo2", "gemma", "t5"])
def test_rms_norm_one_pass_kernels_larger(style, threads):
    """Rows split across threads, rows of 2 .. 4099 elements (vector bodies and tails): still the Python path's
    bits (the reductions are aten's, on the same operands)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for h, rows in ((2, 64), (4099, 9), (2048, 40)):
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                if style == "torch":
                    stock = nn.RMSNorm(h).to(dtype)
                    _randomize(stock)
                    slim = slim_copy(stock)
                else:
                    ref_cls, slim_cls = _hf_class(style)
                    stock, slim = ref_cls(h, 1e-6, dtype), slim_cls(h, 1e-6, dtype)
                    slim.load_state_dict(stock.state_dict())
                for rg in [(True, False), (True, True), (False, True)]:
                    check_three_ways(stock, slim, _x((rows, h), dtype, seed=h), rg, core_name="RMSNormFn")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", ["torch", "llama", "t5"])
def test_rms_norm_weight_only_forward_peak_not_above_stock(style, dtype):
    """Only the weight trains and x needs no gradient (a norm on frozen embeddings): the one-pass forward made its
    squares, output and normalised input at once, four of x's size with x, one more than stock's expression ever
    holds (fp32: the step peaked 1x x above stock's). The squares now go first; the step's peak is at most stock's
    and the weight's gradient stock's bits."""
    from slimgrad.measure import peak_bytes

    torch.manual_seed(0)
    if style == "torch":
        ref = slim = nn.RMSNorm(256, eps=1e-6).to(dtype)
        slim = slim_copy(ref)
    else:
        ref_cls, slim_cls = _hf_class(style)
        ref, slim = ref_cls(256, 1e-6, dtype), slim_cls(256, 1e-6, dtype)
        slim.load_state_dict(ref.state_dict())
    x = torch.randn(4, 128, 256).to(dtype)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(x.clone()).float().sum().backward()
        return m.weight.grad

    for m in (ref, slim):
        step(m)
    assert torch.equal(step(slim), step(ref))
    out = slim(x.clone())
    assert "RMSNormFn" in out.grad_fn.name(), out.grad_fn.name()
    assert peak_bytes(lambda: step(slim)) <= peak_bytes(lambda: step(ref))


def test_rms_norm_functional_forms_run_the_core():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    assert "RMSNormFn" in rms_norm(x, (8,), w).grad_fn.name()
    assert "RMSNormFn" in rms_norm_hf(x, w, 1e-6, "gemma").grad_fn.name()
    y = rms_norm(x, 8, w)
    with csrc.disabled():
        y_py = rms_norm(x, 8, w)
    assert torch.equal(y, y_py) and "CppNode" not in type(y_py.grad_fn).__name__
    # errors still come from the Python path, with its messages
    with pytest.raises(RuntimeError, match="slimgrad: rms_norm: argument 'input' must end in normalized_shape"):
        rms_norm(x, (5,), w[:5])
    with pytest.raises(ValueError, match="'eps'"):
        rms_norm(x, (8,), w, eps=-1.0)


def test_autocast_runs_the_python_path():
    m = slim_copy(nn.RMSNorm(8))
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert "CppNode" not in y.grad_fn.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = slim_copy(nn.LayerNorm(8))(x)
    assert "CppNode" not in y.grad_fn.name()


def test_producer_consumer_note_on_the_core_path():
    """A norm that keeps its input marks the producer's cell (the ReLU then keeps its output next step)."""
    from slimgrad.functional import _common

    for make, x_shape in ((lambda: nn.RMSNorm(8), (3, 8)), (lambda: nn.LayerNorm(8), (3, 8)),
                          (lambda: nn.GroupNorm(2, 4), (2, 4, 3))):
        m = slim_copy(make())
        h = torch.randn(x_shape, requires_grad=True) * 1.0
        cell = _common.UseCell()
        _common.mark_producer(h, cell)
        y = m(h)
        # RMSNorm: the core's Function; layer/group norm keep what stock keeps here, so stock's node runs
        assert ("CppNode" if isinstance(m, nn.RMSNorm) else "Native") in y.grad_fn.name()
        assert cell.kept
        # only the bias trains (LayerNorm/GroupNorm): x is not kept, the cell stays unmarked
        if not isinstance(m, nn.RMSNorm):
            m.weight.requires_grad_(False)
            h2 = torch.randn(x_shape) * 1.0
            cell2 = _common.UseCell()
            _common.mark_producer(h2, cell2)
            m(h2)
            assert not cell2.kept


def test_double_backward_refused_with_the_python_message():
    from slimgrad.functional._common import double_backward_message
    from slimgrad.functional.norms import RMSNormFunction

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    y = rms_norm(x, (4,), torch.ones(4, dtype=torch.float64))
    assert "CppNode" in y.grad_fn.name()
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError) as err:
        gx.sum().backward()
    assert double_backward_message(RMSNormFunction) in str(err.value)


# -------------------------------------------------------------------------------------- LayerNorm / GroupNorm
LN = {"default": dict(normalized_shape=33), "no-bias": dict(normalized_shape=33, bias=False),
      "no-affine": dict(normalized_shape=33, elementwise_affine=False),
      "2d-shape": dict(normalized_shape=(3, 8), eps=1e-3)}


@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None),
                                               (torch.float16, None), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "fp64", "bf16", "fp16", "bf16+fp32"])
@pytest.mark.parametrize("opt", list(LN))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_layer_norm(opt, dtype, param_dtype, layout):
    stock = nn.LayerNorm(**LN[opt]).to(param_dtype or dtype)
    _randomize(stock)
    slim = slim_copy(stock)
    shape = (4, 5, 33) if opt != "2d-shape" else (4, 3, 8)
    n_params = len(list(stock.parameters()))
    has_b = stock.bias is not None
    combos = [c for c in grad_combos(3) if (n_params or not (c[1] or c[2])) and (has_b or not c[2])]
    for rg in combos:
        rg = rg[:1 + n_params]
        check_three_ways(stock, slim, _x(shape, dtype, layout), rg, core_name=_layer_node)


def _layer_node(rg):
    """Where x or the weight needs a gradient stock keeps what slimgrad would (x, mean, rstd): the core runs stock's
    op and node there, its own Function only for a bias-only backward."""
    return "NativeLayerNormBackward0" if rg[0] or (len(rg) > 1 and rg[1]) else "LayerNormFn"


def _group_node(rg):
    """As :func:`_layer_node`; every x here is plain contiguous (a dW-only call on channels-last keeps the Function:
    see test_group_norm_channels_last)."""
    return "NativeGroupNormBackward0" if rg[0] or (len(rg) > 1 and rg[1]) else "GroupNormFn"


GN = {"group": ((2, 8), (3, 8, 5, 4)), "group-1d": ((4, 4), (3, 4)), "group-3d": ((3, 6), (2, 6, 3, 2, 2)),
      "instance-like": ((8, 8), (2, 8, 5, 4))}


@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None),
                                               (torch.float16, None), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "fp64", "bf16", "fp16", "bf16+fp32"])
@pytest.mark.parametrize("opt", list(GN))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_group_norm(opt, dtype, param_dtype, affine):
    (groups, channels), shape = GN[opt]
    stock = nn.GroupNorm(groups, channels, eps=1e-4, affine=affine).to(param_dtype or dtype)
    _randomize(stock)
    slim = slim_copy(stock)
    for rg in grad_combos(3 if affine else 1):
        check_three_ways(stock, slim, _x(shape, dtype), rg, core_name=_group_node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_group_norm_channels_last(dtype):
    """channels_last x: where dX is requested, stock runs (bitwise); where it is not, stock's channels-last kernel
    crashes (torch 2.13), so core vs Python path only (both use the contiguous kernel there)."""
    stock = nn.GroupNorm(2, 8).to(dtype)
    _randomize(stock)
    slim = slim_copy(stock)
    x0 = _x((2, 8, 3, 3), dtype, "channels_last")
    for rg in grad_combos(3):
        if rg[0]:
            check_three_ways(stock, slim, x0, rg, core_name="NativeGroupNormBackward0")
            continue
        for m in (slim,):
            m.weight.requires_grad_(rg[1])
            m.bias.requires_grad_(rg[2])
        g0 = torch.randn(x0.shape, dtype=torch.float64)
        core = _run(slim, x0, g0, False, True)
        python = _run(copy.deepcopy(slim), x0, g0, False, False)
        for a, b in zip(core[:2] + tuple(core[2]), python[:2] + tuple(python[2])):
            _same(a, b, f"channels_last rg={rg}")
        assert core[3] == python[3]


def test_group_norm_batch_one_small_batch_stride():
    """diffusers' batch-1 map with strides (32, 1, 256, 32): the Python path's memory-format rule."""
    stock = nn.GroupNorm(8, 32)
    slim = slim_copy(stock)
    x0 = torch.randn(1, 64, 32).transpose(1, 2).view(1, 32, 8, 8)
    for rg in [(True, True, True), (True, False, False)]:
        check_three_ways(stock, slim, x0, rg, core_name=_group_node)


def test_functional_layer_group_norm_run_the_core():
    x = torch.randn(2, 4, 6, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6)
    assert "NativeLayerNormBackward0" in layer_norm(x, (6,), w, b).grad_fn.name()
    assert "NativeGroupNormBackward0" in group_norm(x, 2, torch.randn(4), None).grad_fn.name()
    b.requires_grad_(True)  # bias only: the core's Function, which keeps nothing input-sized
    assert "LayerNormFn" in layer_norm(x.detach(), (6,), w.detach(), b).grad_fn.name()
    assert "GroupNormFn" in group_norm(x.detach(), 2, None, torch.randn(4, requires_grad=True)).grad_fn.name()
    with pytest.raises(RuntimeError, match="slimgrad: group_norm: argument 'input' has 4 channels"):
        group_norm(x, 3)


# ------------------------------------------------------------------------------------ Triton, only dW (§4)
@pytest.mark.skipif(not __import__("slimgrad.kernels.registry", fromlist=["x"]).triton_interpreting(),
                    reason="needs TRITON_INTERPRET=1 from the process start (tests/test_triton_interpreter.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("h", [4, 33, 256])
def test_triton_rms_norm_weight_only_keeps_no_more_than_stock(dtype, h):
    """Only the weight trains: the Triton path keeps the normalised input where stock does (never more than
    stock at any hidden size), and the gradient agrees with the torch path's."""
    pytest.importorskip("triton")
    from slimgrad import kernels

    for style in ("torch", *REFERENCE_FORWARDS):
        if style == "torch":
            stock = nn.RMSNorm(h).to(dtype)
            _randomize(stock)
            slim = slim_copy(stock)
        else:
            ref_cls, slim_cls = _hf_class(style)
            stock, slim = ref_cls(h, 1e-6, dtype), slim_cls(h, 1e-6, dtype)
            slim.load_state_dict(stock.state_dict())
        x0 = _x((6, h), dtype)
        g0 = torch.randn(x0.shape, dtype=torch.float64)
        for m in (stock, slim):
            m.weight.requires_grad_(True)
        ref = _run(stock, x0, g0, False, None)
        with kernels.preference("triton"):
            got = _run(slim, x0, g0, False, False)
        assert got[3] <= ref[3], f"{style}: Triton keeps {got[3]} bytes, stock {ref[3]}"
        tol = dict(rtol=0.05, atol=0.05) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[2][0].double(), ref[2][0].double(), **tol)
