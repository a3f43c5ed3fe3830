"""peft LoRA over torchao-quantized base weights (QLoRA the torchao way, and peft's torchao recipe).

A quantized weight is a tensor subclass whose matmuls are its own: torchao's ``NF4Tensor`` runs ``mm`` as
``linear_nf4`` (``a @ w.T``), its ``Int8Tensor`` has no ``mm``. slimgrad's LoRA Function multiplies by the base
weight in its backward (``dX = dY @ W``), so such a layer must run peft's own forward: before the fix the input
gradient over an NF4 weight was silently wrong (154 % off for a square weight) and an int8 weight raised in backward.
Found by the quantization sweep of 2026-11-28 (quant44). Compared against stock peft on independent copies, same
seeds: outputs and every gradient bitwise, and the layer reported as left stock (a gap, said once).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad._notices import reset_warned

peft = pytest.importorskip("peft")
torchao = pytest.importorskip("torchao")

from peft import LoraConfig, get_peft_model  # noqa: E402


def _nf4(t):
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:  # older torchao
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4(t)


class _Net(nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)  # 128 x 128: blocks to_nf4's defaults accept

    def forward(self, x):
        return self.lin(x)


def _peft_model(dropout, dtype=torch.float32):
    torch.manual_seed(0)
    net = _Net().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(net, LoraConfig(r=4, target_modules=["lin"], lora_dropout=dropout,
                                               init_lora_weights="gaussian"))
    for p in model.parameters():  # adapters in fp32 over a bf16 model: peft's autocast_adapter_dtype default
        if p.requires_grad:
            p.data = p.data.float()
    return model


def _to_nf4(model):
    base = model.base_model.model.lin.base_layer
    base.weight = nn.Parameter(_nf4(base.weight.detach()), requires_grad=False)
    return model


def _step(model, x0):
    model.train()
    torch.manual_seed(1)  # the same dropout mask on both sides
    x = x0.clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype))
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return y.detach(), x.grad, grads


def _assert_same(stock, slim, x0):
    ys, dxs, gs = _step(stock, x0)
    yq, dxq, gq = _step(slim, x0)
    assert torch.equal(ys, yq)
    assert torch.equal(dxs, dxq), (dxs - dxq).abs().max()
    assert gs.keys() == gq.keys()
    for n in gs:
        assert torch.equal(gs[n], gq[n]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_over_an_nf4_weight_is_peft_and_said(dropout, dtype):
    """Converted with the NF4 weight in place: the layer is left to peft, as a gap (warned), numbers peft's."""
    model = _to_nf4(_peft_model(dropout, dtype))
    stock = copy.deepcopy(model)
    reset_warned()  # (said once a process: another case may have said it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slim, report = slimgrad.convert(copy.deepcopy(model), report=True)
    assert any("NF4Tensor" in g.message() for g in report.gaps), [g.message() for g in report.gaps]
    assert any(isinstance(w.message, slimgrad.SlimgradWarning) and "NF4Tensor" in str(w.message) for w in caught)
    _assert_same(stock, slim, torch.randn(4, 128, dtype=dtype))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_quantized_after_convert_runs_peft(dropout):
    """Quantized after convert (the converted layer meets the NF4 weight at call time): peft's forward, per call."""
    model = _peft_model(dropout)
    stock = _to_nf4(copy.deepcopy(model))
    slim = _to_nf4(slimgrad.convert(copy.deepcopy(model)))
    _assert_same(stock, slim, torch.randn(4, 128))


def test_lora_over_an_int8_weight_trains_as_peft():
    """torchao's weight-only int8 applied to the base layers after get_peft_model: an ``Int8Tensor`` has no ``mm``,
    so slimgrad's backward raised where stock trains."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _peft_model(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: fqn.endswith("base_layer") and isinstance(m, nn.Linear))
    stock = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slim = slimgrad.convert(copy.deepcopy(model))
    _assert_same(stock, slim, torch.randn(4, 128))


def test_peft_torchao_lora_layer_left_stock_is_a_gap():
    """peft's TorchaoLoraLinear (what get_peft_model builds over a torchao-quantized model) is a LoRA layer no
    integration converts: a gap like DoRA's (warned, listed, strict raises), not only a skipped entry; its reason
    names what the subclass defines, not abc's bookkeeping."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    net = _Net(32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(net, Int8WeightOnlyConfig())
        try:
            model = get_peft_model(net, LoraConfig(r=4, target_modules=["lin"]))
        except TypeError as e:  # peft 0.17 with torchao 0.13 (the oldest tested set): stock itself fails
            pytest.skip(f"peft {peft.__version__} cannot build its torchao LoRA layer here: {e}")
    layer = model.base_model.model.lin
    if type(layer).__name__ != "TorchaoLoraLinear":
        pytest.skip(f"peft built a {type(layer).__name__} here")
    reset_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = slimgrad.convert(copy.deepcopy(model), report=True)
    assert any("TorchaoLoraLinear" in g.message() for g in report.gaps), [g.message() for g in report.gaps]
    assert any(isinstance(w.message, slimgrad.SlimgradWarning) for w in caught)
    assert all("_abc_impl" not in s.reason for s in report.skipped), report.skipped
    with pytest.raises(slimgrad.SlimgradGapError):
        slimgrad.convert(copy.deepcopy(model), strict=True)


def test_functional_lora_linear_refuses_a_quantized_weight():
    from slimgrad.functional.lora import LoraAdapter, lora_linear

    w = _nf4(torch.randn(128, 128))
    adapter = LoraAdapter(torch.randn(4, 128, requires_grad=True), torch.randn(128, 4, requires_grad=True))
    with pytest.raises(TypeError, match="lora_linear: 'weight' is a NF4Tensor"):
        lora_linear(torch.randn(2, 128), w, None, [adapter])
