"""Whole models: a converted ResNet-like CNN trains step for step like stock and keeps less in every case."""

import copy

import pytest
import torch

import slimgrad
from slimgrad.cases import CASES, apply_case, training_step
from slimgrad.models import build_model
from slimgrad.models.cnn import resnet18


def _pair(case, **kw):
    torch.manual_seed(0)
    stock = resnet18(num_classes=5, base_width=8, **kw)
    input_grad = apply_case(stock, case)
    return stock, slimgrad.convert(stock), input_grad


def _assert_same_grads(stock, slim, xa, xb, input_grad):
    if input_grad:
        assert torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(stock.named_parameters(), slim.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("case", CASES)
def test_resnet_trains_three_sgd_steps_like_stock(case):
    stock, slim, input_grad = _pair(case)
    opt_a = torch.optim.SGD(stock.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(slim.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        target = torch.randint(0, 5, (4,), generator=gen)
        xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
        la = torch.nn.functional.cross_entropy(stock(xa), target)
        lb = torch.nn.functional.cross_entropy(slim(xb), target)
        assert torch.equal(la, lb)
        opt_a.zero_grad()
        opt_b.zero_grad()
        la.backward()
        lb.backward()
        _assert_same_grads(stock, slim, xa, xb, input_grad)
        opt_a.step()
        opt_b.step()
    for a, b in zip(stock.state_dict().values(), slim.state_dict().values()):
        assert torch.equal(a, b)


def _kept(model, x, input_grad):
    training_step(model, x, input_grad)  # warm-up, as in training
    with slimgrad.SavedTensors(exclude=[model]) as counter:
        out = model(x.detach().requires_grad_(input_grad))
    out.sum().backward()
    return counter.bytes


@pytest.mark.parametrize("case", CASES)
def test_resnet_keeps_no_more_than_stock_in_any_case(case):
    stock, slim, input_grad = _pair(case)
    x = torch.randn(2, 3, 64, 64)
    s, g = _kept(stock, x, input_grad), _kept(slim, x, input_grad)
    assert g <= s, (case, s, g)
    if case == "input-bn-eval":
        assert g <= 0.05 * s, (s, g)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "vgg11"])
def test_other_models_match_stock_and_keep_less(name):
    torch.manual_seed(0)
    kw = {"base_width": 8} if name.startswith("resnet") else {"width_scale": 0.125}
    stock = build_model(name, num_classes=3, **kw)
    apply_case(stock, "input-bn-eval")
    slim = slimgrad.convert(stock)
    x = torch.randn(2, 3, 64, 64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock.eval()
    slim.eval()
    ya, yb = stock(a), slim(b)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert _kept(copy.deepcopy(slim), x, True) < _kept(copy.deepcopy(stock), x, True)


@pytest.mark.parametrize("case", ["input", "norm", "all"])
def test_convnext_converts_its_own_channels_first_norm(case):
    """The in-repo ConvNeXt's LayerNorm2d (the stem's and the downsampling norms) overrode forward as
    ``super().forward`` of the permuted map, so convert left it stock and said so; written as transformers'
    LayerNorm2d is, it is converted, bitwise stock, keeping no more."""
    from slimgrad.models.cnn import LayerNorm2d, convnext

    torch.manual_seed(0)
    stock = convnext(num_classes=5, base_width=8)
    input_grad = apply_case(stock, case)
    slim, report = slimgrad.convert(stock, report=True)
    norms = [m for m in slim.modules() if isinstance(m, LayerNorm2d)]
    assert norms and all(type(m) is not LayerNorm2d for m in norms), report
    assert not [g for g in report.gaps if "LayerNorm2d" in g.message()]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    ya, yb = stock(xa), slim(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    _assert_same_grads(stock, slim, xa, xb, input_grad)
    assert _kept(slim, x, input_grad) <= _kept(stock, x, input_grad)
