"""peft LoRA on convolutions (lora.Conv1d/2d) and embeddings against peft itself: bitwise outputs and
gradients, and bytes kept counted from shapes (x once in its own dtype when some A trains, ``A(x)`` when
its B trains, an 8-byte seed per dropping adapter; the frozen base nothing)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Conv2d as LoraConv2d  # noqa: E402

import slimgrad  # noqa: E402
from _util import TwoReaders, assert_same, grad_combos, two_active_adapters  # noqa: E402
from slimgrad.functional.dropout import _fill_noise, dropout_policy  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

R = 4


class Net(nn.Module):
    def __init__(self, nd=2, groups=1):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[nd]
        self.conv = conv(4, 6, 3, stride=2, padding=1, groups=groups)
        self.emb = nn.Embedding(20, 5)

    def forward(self, x):
        return self.conv(x)


def peft_net(dtype=torch.float32, adapter_dtype=None, *, nd=2, groups=1, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    net = Net(nd, groups).to(dtype)
    model = get_peft_model(net, LoraConfig(r=R, lora_alpha=8, target_modules=["conv", "emb"], lora_dropout=dropout,
                                           init_lora_weights=False))
    # a scaling that is no bf16 or fp16 number (alpha / r = 5 / 3, or rsLoRA's alpha / sqrt(r)): the core once
    # multiplied by it rounded to the model's dtype (C++'s in-place mul_(double)), which 8 / 4 = 2 hid
    model.base_model.model.conv.scaling["default"] = 5 / 3
    if adapter_dtype is not None:  # diffusers' mixed precision: fp32 adapters on a half-precision model
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(adapter_dtype)
    return model


def layer_of(model):
    return model.base_model.model.conv


class FixedNoise(nn.Module):
    """Stands in for peft's nn.Dropout in the reference: multiplies by a given noise, as F.dropout does."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise

    def forward(self, x):
        return x * self.noise


def run(model, x, grad_seed=1):
    with SavedTensors(exclude=[model]) as kept:
        out = model(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(g)
    return out, kept.bytes


def compare_grads(stock, slim):
    for (n, ps), pm in zip(stock.named_parameters(), slim.parameters()):
        assert_same(pm.grad, ps.grad, what=n)


def _x(dtype, nd=2, rg=True, seed=3):
    shape = (2, 4, 9, 7) if nd == 2 else (2, 4, 11)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(rg)


def _bytes(numel, dtype):
    return numel * torch.empty((), dtype=dtype).element_size()


# peft upcasts adapters on a half-precision model to fp32 by default; "bf16" keeps them in bf16
CASTS = [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
         (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtype,adapter_dtype", CASTS, ids=["fp32", "bf16+fp32", "fp16+fp32", "bf16"])
@pytest.mark.parametrize("rg_x,rg_a,rg_b", grad_combos(3))
@pytest.mark.parametrize("dropout,policy", [(0.0, "bits"), (0.1, "bits"), (0.1, "seed")])
def test_matches_peft_and_keeps_the_minimum(dtype, adapter_dtype, rg_x, rg_a, rg_b, dropout, policy):
    if not (rg_x or rg_a or rg_b):
        pytest.skip("nothing to differentiate")
    stock = peft_net(dtype, adapter_dtype, dropout=dropout)
    layer = layer_of(stock)
    layer.lora_A["default"].weight.requires_grad_(rg_a)
    layer.lora_B["default"].weight.requires_grad_(rg_b)
    real = copy.deepcopy(stock)  # peft with its own nn.Dropout
    slim = slimgrad.convert(stock)
    assert type(layer_of(slim)).__module__ == "slimgrad.integrations.peft_lora_conv"
    xs, xm = _x(dtype, rg=rg_x), _x(dtype, rg=rg_x)
    a_dtype = layer.lora_A["default"].weight.dtype
    # x frozen, not cast, read by this layer alone: peft's own forward runs (its nn.Dropout's draw, under either
    # policy) and keeps what peft keeps, the dropped copy, where the Function would keep x and a mask
    # (functional/lora.py's read_alone_last_time)
    alone = bool(dropout) and not rg_x and rg_a and dtype == a_dtype
    if dropout and policy == "seed" and not alone:
        # the noise slimgrad's Function draws after manual_seed(7): a seed from the default generator
        torch.manual_seed(7)
        seed = torch.empty(1, dtype=torch.int64).random_()
        layer.lora_dropout["default"] = FixedNoise(_fill_noise(torch.empty(xs.shape, dtype=a_dtype), dropout, seed[0]))
    torch.manual_seed(7)  # "bits": the very mask peft's nn.Dropout draws after this
    ys, _ = run(stock, xs)
    torch.manual_seed(7)
    with dropout_policy(policy):
        ym, kept_slim = run(slim, xm)
    if alone:
        # peft's forward over the converted submodules (lora_A / lora_B convs keep no more than stock's, a frozen
        # one nothing); under "seed" its converted nn.Dropout draws its own mask, as that policy does everywhere
        assert kept_slim <= run(real, _x(dtype, rg=rg_x))[1]
        if policy == "seed":
            return
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="x.grad")
    compare_grads(stock, slim)
    if alone:
        return
    t_numel = 2 * R * 5 * 4  # A(x): stride 2, padding 1 on 9 x 7
    mask = (8 if policy == "seed" else (xs.numel() + 7) // 8) if dropout and (rg_x or rg_a) else 0
    expected = (_bytes(xs.numel(), dtype) if rg_a else 0) + (_bytes(t_numel, a_dtype) if rg_b else 0) + mask
    assert kept_slim == expected
    _, kept_stock = run(real, _x(dtype, rg=rg_x))
    assert kept_slim <= kept_stock


@pytest.mark.parametrize("module_policy, global_policy", [("seed", "bits"), ("bits", "seed")])
def test_convert_dropout_option_reaches_lora_conv(module_policy, global_policy):
    """``convert(model, dropout=...)`` sets the LoRA conv layers' dropout policy (they followed the
    process-wide one): the bytes kept are the module policy's; "bits" still draws peft's very mask."""
    stock = peft_net(torch.float32, None, dropout=0.1)
    slim = slimgrad.convert(stock, dropout=module_policy)
    xs, xm = _x(torch.float32), _x(torch.float32)
    torch.manual_seed(7)
    with dropout_policy(global_policy):
        ym, kept_slim = run(slim, xm)
    t_numel = 2 * R * 5 * 4
    mask = 8 if module_policy == "seed" else (xs.numel() + 7) // 8
    assert kept_slim == _bytes(xs.numel(), torch.float32) + _bytes(t_numel, torch.float32) + mask
    if module_policy == "bits":
        torch.manual_seed(7)
        ys, _ = run(stock, xs)
        assert_same(ym, ys, what="output")
        assert_same(xm.grad, xs.grad, what="x.grad")
        compare_grads(stock, slim)


@pytest.mark.parametrize("nd,groups", [(1, 1), (2, 2)])
def test_conv1d_and_grouped(nd, groups):
    stock = peft_net(torch.bfloat16, torch.float32, nd=nd, groups=groups)
    slim = slimgrad.convert(stock)
    xs, xm = _x(torch.bfloat16, nd), _x(torch.bfloat16, nd)
    ys, kept_stock = run(stock, xs)
    ym, kept_slim = run(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="x.grad")
    compare_grads(stock, slim)
    assert kept_slim < kept_stock  # no fp32 copy of x


def test_channels_last():
    stock = peft_net(torch.bfloat16, torch.float32).to(memory_format=torch.channels_last)
    slim = slimgrad.convert(stock)
    xs = _x(torch.bfloat16).detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    xm = xs.detach().clone().requires_grad_()
    ys, _ = run(stock, xs)
    ym, _ = run(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="x.grad")
    compare_grads(stock, slim)


def test_two_adapters():
    stock = peft_net(torch.bfloat16, torch.float32)
    stock.add_adapter("second", LoraConfig(r=R, target_modules=["conv"], init_lora_weights=False))
    stock.base_model.set_adapter(["default", "second"])
    for n, p in stock.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
    slim = slimgrad.convert(stock)
    xs, xm = _x(torch.bfloat16), _x(torch.bfloat16)
    ys, _ = run(stock, xs)
    ym, _ = run(slim, xm)
    assert_same(ym, ys, what="output")
    # two adapters' input gradients are summed in autograd's order; x's gradient is bf16 after that sum
    assert_same(xm.grad, xs.grad, exact=False, rtol=1e-2, atol=1e-2, what="x.grad")
    compare_grads(stock, slim)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_several_dropping_adapters_on_a_shared_input(dtype, core):
    """Two LoRA convs reading one x, two dropping adapters active in each ("bits": peft's masks): peft's graph hands
    x one gradient per adapter, then the base conv's, and autograd adds the other conv's between them; with fp32
    (uncast) adapters each runs a Function of its own, in that order (pre-summed they were ~5e-7 off in fp32).
    Bitwise, and never more kept than peft."""
    from slimgrad import csrc

    torch.manual_seed(0)
    reader = TwoReaders(lambda: nn.Conv2d(4, 6, 3, padding=1)).to(dtype)
    stock = two_active_adapters(reader, R, second_dropout=0.2)
    slim = slimgrad.convert(stock)
    results = []
    with contextlib.nullcontext() if core else csrc.disabled(), dropout_policy("bits"):
        for model in (slim, stock):
            x = _x(dtype)
            torch.manual_seed(7)
            y, kept = run(model, x)
            results.append((y, x.grad, kept))
    (ym, gm, kept_m), (ys, gs, kept_s) = results
    assert_same(ym, ys, what="output")
    assert_same(gm, gs, what="x.grad")
    compare_grads(stock, slim)
    assert 0 < kept_m < kept_s


def test_disabled_adapters_run_peft_forward():
    stock = peft_net()
    slim = slimgrad.convert(stock)
    x = _x(torch.float32)
    with slim.disable_adapter():
        assert_same(slim(x), layer_of(stock).base_layer(x), what="disabled adapters: the base alone")


def test_embedding_lora_is_already_minimal():
    """peft's lora.Embedding keeps the indices (for dA) and A[ids] (for dB); its frozen base nothing."""
    stock = peft_net()
    slim = slimgrad.convert(stock)
    ids = torch.randint(0, 20, (3, 7))
    for model in (stock, slim):
        emb = model.base_model.model.emb
        with SavedTensors(exclude=[model]) as kept:
            out = emb(ids)
        out.sum().backward()
        assert kept.bytes == ids.numel() * 8 + ids.numel() * R * 4
    assert_same(slim.base_model.model.emb.lora_embedding_A["default"].grad,
                stock.base_model.model.emb.lora_embedding_A["default"].grad, what="A grad")


def test_lora_conv2d_is_registered():
    slimgrad.integrations.load_available()
    from slimgrad._registry import REPLACEMENTS

    assert LoraConv2d in REPLACEMENTS
    m = copy.deepcopy(peft_net())
    assert type(layer_of(slimgrad.convert(m))) is REPLACEMENTS[LoraConv2d]


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_compile_fullgraph(dropout):
    torch._dynamo.reset()
    stock = peft_net(torch.bfloat16, torch.float32, dropout=dropout)
    slim = slimgrad.convert(stock)
    compiled = torch.compile(layer_of(slim), fullgraph=True)
    xs, xm = _x(torch.bfloat16), _x(torch.bfloat16)
    ym = compiled(xm)
    ym.float().sum().backward()
    if dropout == 0:  # the same numbers as peft (compiled rounding may differ in the last bit)
        ys = layer_of(stock)(xs)
        ys.float().sum().backward()
        assert_same(ym, ys, exact=False, what="output")
        assert_same(xm.grad, xs.grad, exact=False, rtol=2e-2, atol=2e-2, what="x.grad")
    else:
        assert xm.grad is not None and torch.isfinite(xm.grad).all()


def test_peak_not_above_peft_with_dropout():
    """Intermediates are freed after their last use, so keeping less does not cost a higher peak."""
    from slimgrad.measure import peak_bytes

    stock = peft_net(dropout=0.1)
    slim = slimgrad.convert(stock)
    x0 = torch.randn(4, 4, 16, 16)

    def step(model):
        x = x0.clone().requires_grad_()
        model(x).sum().backward()

    peaks = [peak_bytes(step, m) for m in (stock, slim)]
    assert peaks[1] <= peaks[0]


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_adapters_only_peak_not_above_peft(dtype, channels_last):
    """The LoRA case itself (x and the base frozen, the adapters training, dropout): the core's backward frees dY
    after its last reader (the scaling product), as stock's engine does, not at the end of the layer's backward:
    one dY fewer when the adapters' weight gradients run (fp32 at this size: 150600 B against peft's 138260
    before, 120404 after; fp16 139528 against 115912 before). The Python path cannot drop the engine's
    reference."""
    from slimgrad import csrc
    from slimgrad.measure import peak_bytes

    if not csrc.enabled() or csrc.core() is None:
        pytest.skip("the core's backward frees dY after its last reader; the Python path cannot (README Limits)")
    torch.manual_seed(0)
    base = nn.Conv2d(8, 16, 3, padding=1, bias=False)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = base

        def forward(self, x):
            return self.layer(x)

    stock = get_peft_model(Wrap(), LoraConfig(r=4, lora_alpha=8, target_modules=["layer"], lora_dropout=0.1,
                                              init_lora_weights=False)).to(dtype)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1)).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 16, 12, 12, generator=torch.Generator().manual_seed(2))

    def step(model):
        torch.manual_seed(5)
        (model(x).float() * g).sum().backward()

    for m in (slim, stock):  # (a first call's one-time allocations out of the measured one)
        step(m)
        for p in m.parameters():
            p.grad = None
    got, ref = peak_bytes(step, slim), peak_bytes(step, stock)
    # fp16/fp64 run the slow conv, whose forward scratch for lora_A sets the peak: the dropped input is alive there
    # in both (stock keeps it, slimgrad drops it after the call), and slimgrad's packed mask beside it (1 bit an
    # element of x, drawn before the call that reads the dropped input)
    mask = (x.numel() + 7) // 8 if dtype != torch.float32 else 0
    assert got <= ref + mask, (got, ref, mask)
    grads = {}
    for m in (stock, slim):
        for p in m.parameters():
            p.grad = None
        step(m)
        grads[m] = [(n, p.grad) for n, p in m.named_parameters() if p.grad is not None]
    assert [n for n, _ in grads[slim]] == [n for n, _ in grads[stock]] and grads[slim]
    for (n, a), (_, b) in zip(grads[slim], grads[stock]):
        assert_same(a, b, what=n)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_input_gradient_of_a_transposed_input_is_laid_out_as_peft(dtype, core):
    """x a transposed view (wav2vec2's feature extractor: conv, LayerNorm over channels via transpose, GELU, conv)
    with adapter dropout: the input gradient comes back in the layout of peft's `grad * noise` (contiguous), not in
    x's; x's layout had sent GELU's backward down another kernel (2e-7 apart in fp32, upstream of the layer)."""
    from slimgrad import csrc

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.act = nn.Conv1d(16, 16, 3, stride=2, bias=False), nn.GELU()

        def forward(self, leaf):
            x = self.act(leaf.transpose(1, 2))
            x.register_hook(lambda g: seen.append((g.clone(), g.stride())))
            return self.layer(x)

    torch.manual_seed(0)
    stock = get_peft_model(Chain().to(dtype), LoraConfig(r=R, lora_alpha=8, target_modules=["layer"],
                                                         lora_dropout=0.1, init_lora_weights=False)).train()
    slim = slimgrad.convert(stock)
    base = torch.randn(2, 31, 16).to(dtype)
    results = []
    with contextlib.nullcontext() if core else csrc.disabled():
        for model in (stock, slim):
            seen = []
            leaf = base.clone().requires_grad_()
            torch.manual_seed(7)
            y = model(leaf)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(dtype))
            results.append((leaf.grad, seen[0]))
    (ls, (gs, ss)), (lm, (gm, sm)) = results
    assert sm == ss, (sm, ss)
    assert_same(gm, gs, what="gradient at the layer's input")
    assert_same(lm, ls, what="leaf gradient (through GELU)")
    compare_grads(stock, slim)


class _Shrink(nn.Module):
    def forward(self, w):
        return w * 0.9


@pytest.mark.parametrize("layer", ["linear", "conv2d"])
@pytest.mark.parametrize("target", ["lora_A", "lora_B", "base_layer"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_parametrized_after_convert_runs_as_peft(layer, target, dropout):
    """A LoRA submodule parametrized after convert (weight_norm, a custom parametrization) has no "weight" parameter:
    the fast paths read ``_parameters["weight"]`` and raised KeyError where peft runs (the wrappers sweep)."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8)) if layer == "linear" else nn.Sequential(nn.Conv2d(3, 4, 3))
    stock = get_peft_model(inner, LoraConfig(r=2, target_modules=["0"], lora_dropout=dropout))
    slim = slimgrad.convert(copy.deepcopy(stock))
    x = torch.randn(2, 8) if layer == "linear" else torch.randn(2, 3, 5, 5)
    results = []
    for model in (stock, slim):
        lay = model.base_model.model[0]
        module = {"lora_A": lay.lora_A["default"], "lora_B": lay.lora_B["default"],
                  "base_layer": lay.base_layer}[target]
        if target == "base_layer":
            parametrizations.weight_norm(module)
        else:
            parametrize.register_parametrization(module, "weight", _Shrink())
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)
        y = model(xi)
        y.sum().backward()
        results.append((y, xi.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert_same(y1, y0, what="output")
    assert_same(gx1, gx0, what="dX")
    assert g0.keys() == g1.keys()
    for name, g in g0.items():
        assert_same(g1[name], g, what=name)
