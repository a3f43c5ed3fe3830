"""The compiled core's dropout and LoRA linear against the Python path and stock, on independent copies with the
same seed: the same output and gradient bits (and strides), the same generator state after the call, the same
saved bytes as the Python path, and the core actually running (a C++ autograd node)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from tests._util import FLOAT_DTYPES, assert_same, laid_out
from torch import nn

import slimgrad
from slimgrad import csrc
from slimgrad.functional.dropout import dropout
from slimgrad.kernels import dropout as dropout_kernels
from slimgrad.kernels import registry
from slimgrad.measure import SavedTensors

pytestmark = pytest.mark.skipif(csrc.core() is None, reason="the compiled core is unavailable here "
                                f"({csrc.status()['reason']}): only the Python path runs")

LAYOUTS = ["contiguous", "channels_last", "transposed", "sliced"]


def bits(t):
    """A tensor's bits (NaN payloads included)."""
    if t is None:
        return None
    t = t.detach()
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else getattr(torch, f"int{8 * t.element_size()}"))


def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: not bitwise equal"
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != {b.stride()}"


def is_core(t) -> bool:
    return t.grad_fn is not None and "CppNode" in t.grad_fn.name()


def run(fn, x0, grad, *, requires_grad, inplace, seed=3):
    """One call of ``fn`` on a fresh copy of ``x0``: (output, input gradient, saved bytes, rng state after,
    whether the core's node made the output)."""
    leaf = x0.clone().requires_grad_(requires_grad)
    x = leaf * 1 if (inplace and requires_grad) else leaf  # in place on a leaf that requires grad is an error
    torch.manual_seed(seed)
    with SavedTensors() as kept:
        out = fn(x)
    state = torch.get_rng_state()
    core = is_core(out)
    if requires_grad and out.requires_grad:
        out.backward(grad)
    return out, leaf.grad, kept.bytes, state, core


# ------------------------------------------------------------------------------------------------------- dropout

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "nograd"])
@pytest.mark.parametrize("form", ["module", "functional"])
def test_dropout_core_is_python_is_stock(dtype, p, layout, inplace, requires_grad, form):
    values = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    values[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x0 = laid_out(values.to(dtype), layout)
    grad = laid_out(torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(1)).to(dtype), "transposed")
    stock_mod = nn.Dropout(p, inplace=inplace)
    slim_mod = slimgrad.convert(copy.deepcopy(stock_mod))
    ours = slim_mod if form == "module" else (lambda t: dropout(t, p, True, inplace))
    stock = run(stock_mod, x0, grad, requires_grad=requires_grad, inplace=inplace)
    core = run(ours, x0, grad, requires_grad=requires_grad, inplace=inplace)
    with csrc.disabled():
        python = run(ours, x0, grad, requires_grad=requires_grad, inplace=inplace)
    for name, got in (("core", core), ("python", python)):
        same(got[0], stock[0], f"{name} output")
        same(got[1], stock[1], f"{name} grad")
        assert torch.equal(got[3], stock[3]), f"{name}: generator state after the call differs from stock's"
    assert core[2] == python[2], "saved bytes"
    assert core[4] == (requires_grad and p > 0), "the core's C++ node made the output"
    assert not python[4]
    if requires_grad and 0 < p < 1:
        assert core[2] == (x0.numel() + 7) // 8


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dropout_eval_is_identity(dtype):
    x = torch.randn(4, 6).to(dtype).requires_grad_()
    mod = slimgrad.convert(nn.Dropout(0.5)).eval()
    assert mod(x) is x and dropout(x, 0.5, training=False) is x


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dropout_double_backward(p):
    """Differentiable in grad, as the Python Function and stock."""
    results = []
    for mode in ("stock", "core", "python"):
        x = torch.randn(3, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64).requires_grad_()
        torch.manual_seed(4)
        fn = F.dropout if mode == "stock" else dropout
        if mode == "python":
            with csrc.disabled():
                y = fn(x, p)
        else:
            y = fn(x, p)
            if mode == "core":
                assert is_core(y)
        (gx,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), x)
        results.append((y, gx, ggx))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            same(a, b, "double backward")


@pytest.mark.parametrize("kind", [nn.Dropout1d, nn.Dropout2d, nn.Dropout3d])
def test_feature_dropout_stays_stock(kind):
    """Feature dropout is stock's own op on every path (nothing input-sized to save)."""
    shape = {nn.Dropout1d: (2, 3, 5), nn.Dropout2d: (2, 3, 4, 5), nn.Dropout3d: (2, 3, 2, 2, 3)}[kind]
    x0 = torch.randn(shape)
    stock = run(kind(0.4), x0, torch.ones(shape), requires_grad=True, inplace=False)
    core = run(slimgrad.convert(kind(0.4)), x0, torch.ones(shape), requires_grad=True, inplace=False)
    same(core[0], stock[0], "output")
    same(core[1], stock[1], "grad")
    assert torch.equal(core[3], stock[3])


def test_dropout_leaf_inplace_error_and_policy_seed_runs_python():
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        dropout(x, 0.5, True, True)
    assert not is_core(dropout(x * 1, 0.5, policy="seed"))
    assert is_core(dropout(x * 1, 0.5, policy="bits"))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 16, 17, 31, 100003])
def test_dropout_bits_kernel_contract(dtype, numel):
    """The core's dropout_bits kernels (backend "core", chosen over numba) against the torch reference."""
    impl = dropout_kernels.choose_bits(torch.empty(1, dtype=dtype))
    assert impl.name == "core"
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    keep = (torch.rand(numel, generator=torch.Generator().manual_seed(1)) > 0.3).to(torch.uint8)
    scale = dropout_kernels.noise_scale(0.3, dtype)
    out, packed = impl.forward(x, keep, scale, False)
    ref_out, ref_packed = dropout_kernels.BITS_TORCH.forward(x, keep, scale, False)
    same(out, ref_out, "forward")
    assert torch.equal(packed, ref_packed)
    g = torch.randn(numel).to(dtype)
    same(impl.backward(g, packed, scale), dropout_kernels.BITS_TORCH.backward(g, packed, scale), "backward")
    buf = torch.empty_like(g)
    assert impl.backward(g, packed, scale, buf) is buf
    y = x.clone()
    assert impl.forward(y, keep, scale, True)[0] is y
    same(y, ref_out, "in place")


def test_core_kernel_registered_above_numba():
    kernels = {k.backend: k for k in registry.implementations(dropout_kernels.BITS)}
    assert kernels["core"].priority == 20 and all(k.priority < 20 for k in kernels.values() if k.backend != "core")
    with csrc.disabled():
        assert dropout_kernels.choose_bits(torch.empty(1)).name != "core"


# ---------------------------------------------------------------------------------------------------------- LoRA

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402
from tests._util import OneLayer  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from slimgrad.functional.lora import LoraAdapter, lora_linear  # noqa: E402

IN, OUT, R = 12, 10, 4


def peft_model(dtype, *, conv1d=False, dropout=0.0, adapters=1, lora_bias=False, upcast=True):
    torch.manual_seed(0)
    layer = Conv1D(OUT, IN) if conv1d else nn.Linear(IN, OUT)
    with torch.no_grad():
        for t in layer.parameters():
            t.normal_(0, 0.3)
    model = get_peft_model(OneLayer(layer.to(dtype)),
                           LoraConfig(r=R, lora_alpha=8, target_modules=["proj"], lora_dropout=dropout,
                                      init_lora_weights=False, fan_in_fan_out=conv1d, lora_bias=lora_bias),
                           autocast_adapter_dtype=upcast)
    for k in range(1, adapters):
        model.add_adapter(f"extra{k}", LoraConfig(r=R + k, lora_alpha=4, target_modules=["proj"],
                                                  lora_dropout=dropout, init_lora_weights=False,
                                                  fan_in_fan_out=conv1d, lora_bias=lora_bias))
    if adapters > 1:
        names = ["default"] + [f"extra{k}" for k in range(1, adapters)]
        for m in model.modules():
            if isinstance(m, LoraLinear):
                m.set_adapter(names)
                for name in names:  # set_adapter leaves only the active ones trainable: all of them here
                    m.lora_A[name].weight.requires_grad_(True)
                    m.lora_B[name].weight.requires_grad_(True)
    return model


def lora_layer(model):
    return next(m for m in model.modules() if isinstance(m, LoraLinear))


def set_grads(model, combo):
    rg_w, rg_b, rg_a, rg_bb = combo
    layer = lora_layer(model)
    layer.base_layer.weight.requires_grad_(rg_w)
    layer.base_layer.bias.requires_grad_(rg_b)
    for name in layer.lora_A:
        layer.lora_A[name].weight.requires_grad_(rg_a)
        layer.lora_B[name].weight.requires_grad_(rg_bb)
        if layer.lora_B[name].bias is not None:
            layer.lora_B[name].bias.requires_grad_(rg_bb)


def lora_step(model, x0, rg_x, seed=7):
    x = x0.clone().requires_grad_(rg_x)
    torch.manual_seed(seed)
    with SavedTensors(exclude=[model]) as kept:
        out = model(x)
    state = torch.get_rng_state()
    # the output's node and the ones feeding it (several dropping adapters on an uncast x: one Function each, added
    # as peft adds them; functional/lora.py's adapters_apart)
    names = " ".join([out.grad_fn.name()] + [f.name() for f, _ in out.grad_fn.next_functions if f is not None]
                     ) if out.grad_fn is not None else ""
    if out.requires_grad:
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    grads = [p.grad for p in model.parameters()]
    return out, x.grad, grads, kept.bytes, state, names


def compare_lora(stock, slim, x0, rg_x, *, exact_vs_stock=True):
    s = lora_step(stock, x0, rg_x)
    c = lora_step(slim, x0, rg_x)
    for p in slim.parameters():
        p.grad = None
    with csrc.disabled():
        py = lora_step(slim, x0, rg_x)
    same(c[0], py[0], "core vs python output")
    same(c[1], py[1], "core vs python x.grad")
    for a, b in zip(c[2], py[2], strict=True):
        same(a, b, "core vs python parameter grad")
    assert c[3] == py[3], "saved bytes core vs python"
    assert torch.equal(c[4], py[4]) and torch.equal(c[4], s[4]), "generator state after the call"
    assert_same(c[0], s[0], what="output vs peft")
    assert_same(c[1], s[1], exact=exact_vs_stock, what="x.grad vs peft")
    for a, b in zip(c[2], s[2], strict=True):
        assert_same(a, b, what="parameter grad vs peft")
    return c, py, s


@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("combo", list(itertools.product([False, True], repeat=5)),
                         ids=lambda c: "".join("xWbAB"[i] if f else "-" for i, f in enumerate(c)))
def test_lora_core_is_python_is_peft(combo, dtype, dropout_p):
    """Every requires_grad combination of x / base weight / base bias / A / B; bf16 and fp16 bases with the
    adapters upcast to fp32 (peft's default)."""
    rg_x, *rest = combo
    stock = peft_model(dtype, dropout=dropout_p)
    set_grads(stock, rest)
    slim = slimgrad.convert(copy.deepcopy(stock), include=[LoraLinear])
    x0 = torch.randn(3, 2, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    c, _, s = compare_lora(stock, slim, x0, rg_x)
    cast = dtype != torch.float32 and dtype != torch.float64  # adapters upcast: the Function runs
    _, rg_w, _, rg_a, _ = combo
    if 0 < dropout_p < 1 and not cast and rg_a and not (rg_x or rg_w):
        # x frozen and read by this layer alone: peft's own forward keeps the dropped x, where the Function would
        # keep x and a 1-bit mask (functional/lora.py's read_alone_last_time)
        assert "LoraLinearFunction" not in c[5] and c[3] == s[3], c[5]
    elif any(combo) and (dropout_p > 0 or cast):
        assert "CppNode" in c[5] and "LoraLinearFunction" in c[5], c[5]


def compare_seeded(slim, x0, rg_x):
    """The "seed" policy: the core (Philox kernels) against the Python Function (the torch reference's Philox
    noise): the same bits, saved bytes and generator state; the mask is not peft's, so no comparison with it."""
    c = lora_step(slim, x0, rg_x)
    for p in slim.parameters():
        p.grad = None
    with csrc.disabled():
        py = lora_step(slim, x0, rg_x)
    for p in slim.parameters():
        p.grad = None
    same(c[0], py[0], "core vs python output")
    same(c[1], py[1], "core vs python x.grad")
    for a, b in zip(c[2], py[2], strict=True):
        same(a, b, "core vs python parameter grad")
    assert c[3] == py[3], "saved bytes core vs python"
    assert torch.equal(c[4], py[4]), "generator state after the call"
    return c, py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("combo", list(itertools.product([False, True], repeat=5)),
                         ids=lambda c: "".join("xWbAB"[i] if f else "-" for i, f in enumerate(c)))
def test_lora_seed_policy_core_is_python(combo, dtype):
    """Every requires_grad combination under ``convert(..., dropout="seed")``: the core's C++ Function runs (one
    seed per dropping adapter kept, 8 bytes, where dX or dA reads the mask) and equals the Python Function."""
    rg_x, *rest = combo
    model = peft_model(dtype, dropout=0.25)
    set_grads(model, rest)
    slim = slimgrad.convert(model, include=[LoraLinear], dropout="seed")
    x0 = torch.randn(3, 2, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    c, _ = compare_seeded(slim, x0, rg_x)
    _, rg_w, _, rg_a, _ = combo
    if dtype == torch.float32 and rg_a and not (rg_x or rg_w):
        # x frozen and read by this layer alone: peft's own forward keeps the dropped x, no more than the Function's
        # x and seed (functional/lora.py's read_alone_last_time), as under the "bits" policy
        assert "CppNode" not in c[5], c[5]
    elif any(combo):
        assert "CppNode" in c[5], c[5]
        assert (c[0] != lora_step(slim, x0, rg_x, seed=8)[0]).any()  # another seed, another mask


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("adapters", [1, 3])
@pytest.mark.parametrize("dtype,upcast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16-fp32-adapters", "bf16"])
def test_lora_seed_policy_core_options(conv1d, adapters, dtype, upcast):
    model = peft_model(dtype, conv1d=conv1d, dropout=0.1, adapters=adapters, lora_bias=True, upcast=upcast)
    slim = slimgrad.convert(model, include=[LoraLinear], dropout="seed")
    x0 = torch.randn(3, 2, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    compare_seeded(slim, x0, True)


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("adapters", [1, 3])
@pytest.mark.parametrize("lora_bias", [False, True])
@pytest.mark.parametrize("dtype,upcast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16-fp32-adapters", "bf16"])
def test_lora_core_options(conv1d, adapters, lora_bias, dtype, upcast):
    """fan_in_fan_out (GPT-2's Conv1D), several active adapters, B's bias, adapters in the base dtype."""
    stock = peft_model(dtype, conv1d=conv1d, dropout=0.1, adapters=adapters, lora_bias=lora_bias, upcast=upcast)
    slim = slimgrad.convert(copy.deepcopy(stock), include=[LoraLinear])
    x0 = torch.randn(3, 2, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    # several adapters: their input gradients reach x in peft's order (one pre-summed cast gradient where the adapters
    # read a cast copy, one gradient each where they read x itself)
    c, _, _ = compare_lora(stock, slim, x0, True)
    layer = lora_layer(slim)
    if len({layer.lora_A[n].weight.dtype for n in layer.lora_A}) == 1:  # mixed (peft upcasts added ones): peft's
        assert "LoraLinearFunction" in c[5] and "CppNode" in c[5]


def test_lora_functional_core_and_errors():
    x = torch.randn(3, IN, requires_grad=True)
    w = torch.randn(OUT, IN)
    a = LoraAdapter(torch.randn(R, IN, requires_grad=True), torch.randn(OUT, R, requires_grad=True), 2.0, 0.2)
    messages = []
    for core in (True, False):
        with csrc.disabled() if not core else torch.enable_grad():
            out = lora_linear(x, w, None, [a])
            assert ("CppNode" in out.grad_fn.name()) == core
            v = torch.ones_like(out, requires_grad=True)
            (gx,) = torch.autograd.grad(out, x, v, create_graph=True)
            with pytest.raises(RuntimeError, match="LoRA linear.*does not support double backward") as err:
                gx.sum().backward()
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "CppNode" in lora_linear(x, w, None, [a], dropout_policy="seed").grad_fn.name()  # Philox kernels
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "CppNode" not in lora_linear(x, w, None, [a._replace(dropout=0.0)]).grad_fn.name()


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("weight", [True, False], ids=["base", "adapters-only"])
def test_lora_input_gradient_is_not_a_view(weight, core):
    """x's gradient goes to autograd as a tensor of its own, not a view of the 2-D product: a view keeps its base,
    and autograd adds another consumer's gradient of x (a QLoRA wrapper's 4-bit base) into the first one it gets
    in place only when that is its storage's sole user; else it allocates an x-sized sum (stock's dropout hands
    it a fresh tensor there). The values are the view's."""
    from slimgrad.functional.lora import LoraLinearFunction

    x = torch.randn(3, 2, IN, requires_grad=True)
    w = torch.randn(OUT, IN) if weight else None
    A, B = torch.randn(R, IN, requires_grad=True), torch.randn(OUT, R, requires_grad=True)
    grads = []
    for p in (0.0, 0.3):
        torch.manual_seed(0)
        if core:
            out = csrc.core().lora_linear_apply([x, w, None, A, B, None], False, True, [0.5], [p])[0]
            assert "CppNode" in out.grad_fn.name()
        else:
            out = LoraLinearFunction.apply(x, w, None, False, True, (0.5,), (p,), None, A, B, None)[0]
        node = out.grad_fn  # the C++ node is callable, the Python Function's node has apply (its backward)
        outs = node(torch.ones_like(out)) if callable(node) else node.apply(torch.ones_like(out))
        # with a base weight the core hands x two gradients (the adapters', then the base layer's: in stock's
        # order, see lora.cpp), each its own tensor
        parts = [outs[0], outs[-1]] if core and weight else [outs[0]]
        for gx in parts:
            assert gx.shape == x.shape and gx.is_contiguous() and not gx._is_view(), p
        grads.append(parts[0] + parts[1] if len(parts) == 2 else parts[0])
    torch.manual_seed(0)  # the Python Function's view, through autograd, for the values
    out = LoraLinearFunction.apply(x, w, None, False, True, (0.5,), (0.3,), None, A, B, None)[0]
    out.backward(torch.ones_like(out))
    same(grads[1], x.grad, "x.grad")


def test_lora_no_grad_and_eval():
    stock = peft_model(torch.bfloat16, dropout=0.3)
    slim = slimgrad.convert(copy.deepcopy(stock), include=[LoraLinear])
    x0 = torch.randn(3, 2, IN).to(torch.bfloat16)
    for train in (True, False):
        stock.train(train)
        slim.train(train)
        with torch.no_grad():
            torch.manual_seed(5)
            ref = stock(x0)
            ref_state = torch.get_rng_state()
            torch.manual_seed(5)
            got = slim(x0)
            assert torch.equal(torch.get_rng_state(), ref_state)
        same(got, ref, "no-grad output")


@pytest.mark.parametrize("layout", ["transposed", "sliced", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_functional_layouts(layout, dtype):
    """x in a non-contiguous layout (the dropout mask in x's memory order) or a view into a larger storage
    (kept as a compact copy): core and Python path agree bit for bit and keep the same bytes."""
    values = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)).to(dtype)
    A = torch.randn(R, IN, generator=torch.Generator().manual_seed(2))
    B = torch.randn(OUT, R, generator=torch.Generator().manual_seed(3))
    results = []
    for core in (True, False):
        if layout == "chunk":
            leaf = torch.cat([values, values], -1).requires_grad_()
            x = leaf[..., :IN]
        else:
            leaf = laid_out(values, layout).detach().requires_grad_()
            x = leaf
        a = LoraAdapter(A.clone().requires_grad_(), B.clone().requires_grad_(), 0.5, 0.3)
        torch.manual_seed(9)
        with csrc.disabled() if not core else torch.enable_grad(), SavedTensors() as kept:
            out = lora_linear(x, w, None, [a])
            assert ("CppNode" in out.grad_fn.name()) == core
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype))
        results.append((out, leaf.grad, a.A.grad, a.B.grad, kept.bytes))
    for k in range(4):
        same(results[0][k], results[1][k], f"output/grads {k}")
    assert results[0][4] == results[1][4]
