"""diffusers' GEGLU / SwiGLU / ApproximateGELU (and FeedForward built from them) against stock: bitwise
outputs and gradients for every requires_grad combination and dtype, bytes kept from shapes."""

from __future__ import annotations

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers.models.activations import GEGLU, GELU, ApproximateGELU, SwiGLU  # noqa: E402
from diffusers.models.attention import FeedForward  # noqa: E402

import slimgrad  # noqa: E402
from _util import FLOAT_DTYPES, assert_same, grad_combos  # noqa: E402
from slimgrad._registry import REPLACEMENTS  # noqa: E402
from slimgrad.measure import SavedTensors  # noqa: E402

TOKENS, DIM_IN, DIM_OUT = (2, 5), 8, 6


def _swap(module):
    slimgrad.integrations.load_available()
    twin = copy.deepcopy(module)
    twin.__class__ = REPLACEMENTS[type(module)]
    return twin


def _step(module, x, grad_seed=1):
    with SavedTensors(exclude=[module]) as kept:
        out = module(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    if out.requires_grad:
        out.backward(g)
    return out, kept.bytes


def _bytes(n, dtype):
    return n * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("cls", [GEGLU, SwiGLU, ApproximateGELU])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("need_x,need_w,need_b", grad_combos(3))
def test_matches_stock_and_keeps_the_minimum(cls, dtype, need_x, need_w, need_b):
    torch.manual_seed(0)
    stock = cls(DIM_IN, DIM_OUT).to(dtype)
    stock.proj.weight.requires_grad_(need_w)
    stock.proj.bias.requires_grad_(need_b)
    slim = _swap(stock)
    base = torch.randn(*TOKENS, DIM_IN).to(dtype)
    xs, xm = base.clone().requires_grad_(need_x), base.clone().requires_grad_(need_x)
    ys, kept_stock = _step(stock, xs)
    ym, kept_slim = _step(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    for name in ("weight", "bias"):
        assert_same(getattr(slim.proj, name).grad, getattr(stock.proj, name).grad, what=f"{name} grad")
    rows = TOKENS[0] * TOKENS[1]
    width = 2 * DIM_OUT if cls is not ApproximateGELU else DIM_OUT  # the projection output
    anything = need_x or need_w or need_b
    # slimgrad: the projection output (gate and hidden, or the activation's input) whenever anything needs
    # grad, plus x for the weight's gradient
    expected = (_bytes(rows * width, dtype) if anything else 0) + (_bytes(rows * DIM_IN, dtype) if need_w else 0)
    assert kept_slim == expected
    # stock also keeps act(gate) (d), or ApproximateGELU's sigmoid (d): a third / a half more
    if anything:
        assert kept_stock == expected + _bytes(rows * DIM_OUT, dtype)


@pytest.mark.parametrize("activation_fn", ["geglu", "swiglu", "gelu-approximate", "gelu"])
def test_feed_forward_converts(activation_fn):
    torch.manual_seed(0)
    stock = FeedForward(DIM_IN, mult=2, activation_fn=activation_fn, dropout=0.0).to(torch.bfloat16)
    slim = slimgrad.convert(stock)
    act_stock, act_slim = stock.net[0], slim.net[0]
    if isinstance(act_stock, GELU):
        assert type(act_slim) is GELU  # F.gelu keeps only its input already: nothing to convert
    else:
        assert type(act_slim) is REPLACEMENTS[type(act_stock)]
    base = torch.randn(*TOKENS, DIM_IN, dtype=torch.bfloat16)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    ys, kept_stock = _step(stock, xs)
    ym, kept_slim = _step(slim, xm)
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    for (n, ps), pm in zip(stock.named_parameters(), slim.parameters()):
        assert_same(pm.grad, ps.grad, what=n)
    if not isinstance(act_stock, GELU):
        assert kept_slim < kept_stock


def test_deprecated_scale_argument_runs_diffusers_forward():
    stock = GEGLU(DIM_IN, DIM_OUT)
    slim = _swap(stock)
    x = torch.randn(3, DIM_IN, requires_grad=True)
    with pytest.warns(FutureWarning):
        ym = slim(x, scale=1.0)
    assert_same(ym, stock(x), what="output")


def test_autocast_matches_stock():
    torch.manual_seed(0)
    stock = GEGLU(DIM_IN, DIM_OUT)
    slim = _swap(stock)
    base = torch.randn(*TOKENS, DIM_IN)
    xs, xm = base.clone().requires_grad_(), base.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, _ = _step(stock, xs)
        ym, _ = _step(slim, xm)
    assert ym.dtype == torch.bfloat16
    assert_same(ym, ys, what="output")
    assert_same(xm.grad, xs.grad, what="input grad")
    assert_same(slim.proj.weight.grad, stock.proj.weight.grad, what="weight grad")


def test_edited_class_is_left_alone(monkeypatch):
    slimgrad.integrations.load_available()
    monkeypatch.setattr(ApproximateGELU, "forward", lambda self, x: self.proj(x))
    model, report = slimgrad.convert(torch.nn.Sequential(ApproximateGELU(4, 4)), report=True)
    assert type(model[0]) is ApproximateGELU
    assert "changed after slimgrad verified its source" in str(report)


def test_swiglu_with_another_activation_is_left_alone():
    m = SwiGLU(4, 4)
    m.activation = torch.nn.GELU()
    model, report = slimgrad.convert(torch.nn.Sequential(m), report=True)
    assert type(model[0]) is SwiGLU
    assert "not nn.SiLU" in str(report)


# ------------------------------------------------------------------ wrappers installed on the instance (hooks)

def _small_cnn(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU(),
                               torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1)
                               ).to(dtype).requires_grad_(False)


def _input_step(model, dtype=torch.bfloat16):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    with SavedTensors(exclude=[model]) as kept:
        out = model(x)
    out.float().pow(2).sum().backward()
    return out, x.grad, kept.bytes


@pytest.mark.parametrize("order", ["convert-then-hooks", "hooks-then-convert"])
def test_layerwise_casting_with_converted_convs(order):
    """diffusers' enable_layerwise_casting (fp8 storage, bf16 compute): it puts fp8 data back into each parameter
    after every forward, which stock's backward reads (aten's backward takes the mixed dtypes) and the converted
    conv's backward refused; and, installed before convert, its wrapper called the stock forward it had captured,
    so the swapped classes never ran (stock's bytes, silently). Now both orders give stock's bits and slimgrad's
    bytes."""
    from diffusers.hooks import apply_layerwise_casting

    cast = dict(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, skip_modules_pattern=("1",))
    stock = _small_cnn()
    apply_layerwise_casting(stock, **cast)
    plain = slimgrad.convert(_small_cnn())
    slim = _small_cnn()
    if order == "convert-then-hooks":
        slimgrad.convert(slim, inplace=True)
        apply_layerwise_casting(slim, **cast)
    else:
        apply_layerwise_casting(slim, **cast)
        slimgrad.convert(slim, inplace=True)
    out_s, gx_s, kept_s = _input_step(stock)
    out_k, gx_k, kept_k = _input_step(slim)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="input grad")
    # the convolutions' weights are fp8-rounded, so not plain's values; its bytes, though
    assert kept_k == _input_step(plain)[2] < kept_s
    assert slim[0].weight.dtype == torch.float8_e4m3fn


def test_a_deep_copy_of_a_diffusers_hooked_model_is_refused_with_the_remedy():
    """convert's default deep copy of a model with diffusers hooks would run the original's layers (the hooks'
    closures), or fail to pickle (group offload): refused, naming the module and what to do."""
    from diffusers.hooks import apply_layerwise_casting

    model = _small_cnn()
    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"diffusers hooks.*inplace=True"):
        slimgrad.convert(model)
    assert type(model[0]) is torch.nn.Conv2d  # untouched


def test_accelerate_hooks_reach_the_converted_forward_and_revert():
    """accelerate's add_hook_to_module (device_map dispatch, cpu_offload) keeps the class forward bound as
    _old_forward: convert re-points it to the converted forward (else stock ran, silently), revert points it back."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    stock = _small_cnn(torch.float32)
    slim = _small_cnn(torch.float32)
    for m in slim.modules():
        accelerate_hooks.add_hook_to_module(m, accelerate_hooks.ModelHook())
    slimgrad.convert(slim, inplace=True)
    assert slim[0]._old_forward.__func__ is type(slim[0]).forward
    out_s, gx_s, kept_s = _input_step(stock, torch.float32)
    out_k, gx_k, kept_k = _input_step(slim, torch.float32)
    assert_same(out_k, out_s, what="output")
    assert_same(gx_k, gx_s, what="input grad")
    assert kept_k < kept_s
    slimgrad.revert(slim)
    assert type(slim[0]) is torch.nn.Conv2d and slim[0]._old_forward.__func__ is torch.nn.Conv2d.forward
    assert _input_step(slim, torch.float32)[2] == kept_s


def test_an_instance_forward_convert_cannot_reach_is_reported_and_left_stock():
    model = _small_cnn(torch.float32)
    model[0].forward = lambda x: torch.nn.functional.conv2d(x, model[0].weight, model[0].bias, padding=1)
    slim, report = slimgrad.convert(model, inplace=True, report=True)
    assert type(slim[0]) is torch.nn.Conv2d and type(slim[3]) is not torch.nn.Conv2d
    (skipped,) = [s for s in report.skipped if s.path == "0"]
    assert "forward is replaced on the instance" in skipped.reason
