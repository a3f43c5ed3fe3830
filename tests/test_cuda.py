"""CUDA only (skipped elsewhere): a whole training step of a converted CNN and of a Llama-like model with peft
LoRA runs without a host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on none), with
the Triton kernels chosen; and the converted models' gradients track stock's.

The Triton kernel checks themselves (tests/test_triton_*.py) run compiled on CUDA in the same pytest run:
their DEVICES is ["cuda"] when CUDA is present and the interpreter is off.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimgrad
from slimgrad import kernels
from slimgrad.cases import apply_case
from slimgrad.models.cnn import resnet18

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda"


@contextlib.contextmanager
def sync_debug(mode):
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def count_syncs(fn) -> list[str]:
    """The synchronising CUDA operations ``fn`` runs (sync debug mode "warn", warnings recorded)."""
    with warnings.catch_warnings(record=True) as caught, sync_debug("warn"):
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.1), nn.Dropout(0.3),
        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.ReLU(), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 3),
    )


CNNS = {"small": (small_cnn, (4, 3, 16, 16), 3), "resnet18": (lambda: resnet18(base_width=8, num_classes=5),
                                                              (4, 3, 32, 32), 5)}


def _cnn_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("case", ["all", "input", "norm"])
@pytest.mark.parametrize("name", list(CNNS))
def test_cnn_training_step_has_no_host_sync(name, case):
    build, shape, classes = CNNS[name]
    torch.manual_seed(0)
    stock = build().to(DEVICE)
    input_grad = apply_case(stock, case)
    slim = slimgrad.convert(stock)
    x = torch.randn(shape, device=DEVICE).requires_grad_(input_grad)
    y = torch.randint(0, classes, (shape[0],), device=DEVICE)
    params = [p for p in slim.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params or [torch.zeros(1, device=DEVICE, requires_grad=True)], lr=1e-3, momentum=0.9)
    _cnn_step(slim, opt, x, y)  # warm-up: Triton compiles, cuDNN picks its algorithms
    torch.cuda.synchronize()
    for pref in ("auto", "triton"):
        with kernels.preference(pref):
            assert kernels.choose("relu_mask", x).backend == "triton"
            with sync_debug("error"):
                _cnn_step(slim, opt, x, y)
                _cnn_step(slim, opt, x, y)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(CNNS))
def test_cnn_gradients_track_stock(name):
    """Dropout off (eval mode BN off too): the converted CNN's gradients equal stock's on CUDA (cuDNN is
    deterministic enough at these sizes to compare within fp32 rounding)."""
    build, shape, classes = CNNS[name]
    torch.manual_seed(0)
    stock = build().to(DEVICE)
    for m in stock.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    slim = slimgrad.convert(stock)
    x = torch.randn(shape, device=DEVICE)
    y = torch.randint(0, classes, (shape[0],), device=DEVICE)
    xs, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.cross_entropy(stock(xs), y).backward()
    F.cross_entropy(slim(xk), y).backward()
    torch.testing.assert_close(xk.grad, xs.grad, rtol=1e-4, atol=1e-5)
    for (n, a), b in zip(slim.named_parameters(), stock.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def _llama_lora(dropout):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=DEVICE, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    return peft.get_peft_model(model, config)


def _llm_step(model, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_llm_lora_training_step_has_no_host_sync(dropout):
    """A converted Llama-like model with peft LoRA (bf16): RMSNorm, SwiGLU and LoRA (dropout by seed) run the
    Triton kernels. If transformers' own code synchronises here, slimgrad must add no synchronisation."""
    stock = _llama_lora(dropout)
    slim = slimgrad.convert(stock)
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    h = torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16)
    assert kernels.choose("rms_norm_hf", h).backend == "triton"
    assert kernels.choose("gated_activation", h).backend == "triton"
    assert kernels.choose("dropout_seed", h).backend == "triton"
    opts = {m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
            for m in (stock, slim)}
    for m in (stock, slim):
        _llm_step(m, opts[m], ids)  # warm-up
    torch.cuda.synchronize()
    stock_syncs = count_syncs(lambda: _llm_step(stock, opts[stock], ids))
    if not stock_syncs:
        with sync_debug("error"):
            _llm_step(slim, opts[slim], ids)
            _llm_step(slim, opts[slim], ids)
    else:
        slim_syncs = count_syncs(lambda: _llm_step(slim, opts[slim], ids))
        assert len(slim_syncs) <= len(stock_syncs), (slim_syncs, stock_syncs)
    torch.cuda.synchronize()


def test_llm_lora_gradients_track_stock():
    """No dropout: the converted model's LoRA gradients and loss match peft's within bf16 rounding."""
    stock = _llama_lora(0.0)
    slim = slimgrad.convert(stock)
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    losses = []
    for m in (stock, slim):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
    grads = {n: p.grad for n, p in stock.named_parameters() if p.requires_grad}
    for n, p in slim.named_parameters():
        if p.requires_grad:
            ref = grads[n].float()
            err = (p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-12)
            assert err < 5e-2, f"{n}: relative error {err:.3g}"


def test_frozen_norm_weight_has_no_dw_buffer_on_cuda():
    """Through the allocator: backward of a Llama-style RMSNorm with a frozen weight allocates dX only (no fp32
    partial-dW buffer), with a trainable weight dX plus the (SMs, H) fp32 partials."""
    from slimgrad.functional.norms import rms_norm_hf

    rows, h = 2048, 4096
    x = torch.randn(rows, h, device=DEVICE, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peaks = {}
    for trainable in (False, True):
        w = torch.ones(h, device=DEVICE, dtype=torch.bfloat16, requires_grad=trainable)
        xx = x.clone().requires_grad_()
        y = rms_norm_hf(xx, w)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(g)
        torch.cuda.synchronize()
        peaks[trainable] = torch.cuda.max_memory_allocated() - start
        assert (w.grad is not None) == trainable
    dx = rows * h * 2
    per_program = -(-rows // sms)
    programs = -(-rows // per_program)  # the kernel's grid: one program per SM, fewer when rows divide so
    assert peaks[False] == dx, peaks  # dX alone (measured so on an H100)
    assert peaks[True] >= dx + programs * h * 4, peaks


def test_peak_bytes_of_a_closure_measures_cuda():
    """``peak_bytes(lambda: step())`` names no device; on a CUDA step it must report the GPU's peak, not the
    CPU allocator's (which sees none of it: the LoRA benchmark printed 0.0 MiB before)."""
    from slimgrad.measure import peak_bytes

    torch.ones(1, device="cuda")  # CUDA in use, as in a training script
    x = torch.randn(1024, 1024, device="cuda")
    assert peak_bytes(lambda: (x * 2).sum()) >= 1024 * 1024 * 4
