"""The drift test: every family the README claims engages on the installed releases, or this test names why not.

The integrations recognise upstream classes by their forwards (syntax-tree fingerprints, behavioural checks),
so a new transformers / peft / bitsandbytes / diffusers release can stop a conversion without any slimgrad
change. ``scripts/newest.sh`` runs this file against the newest releases; CI runs it against the pinned ones
(``constraints-tested.txt``) and ``docs/compat.md`` against the oldest allowed ones. Each case builds a tiny
model from a config, converts it and asserts that every module of the claimed class was converted (for the
chunked loss: that a training forward with labels returns the stock loss and no logits). A failure names the
class, the installed library version and the reason slimgrad recorded (:func:`slimgrad._notices.class_gap`,
:func:`slimgrad._notices.integration_gaps`), or says that none was recorded: a silent gap, a bug of its own.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad._notices import class_gap, integration_gaps, library_version
from slimgrad._registry import ORIGINALS

V = 96
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
#: family -> (modeling module, config class, causal-LM class, extra config), the families the README names
CAUSAL_LMS = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma": ("gemma", "GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 8}),
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
}
#: family -> (RMSNorm class, gated-MLP class) claimed in that family's modeling module
NORM_AND_MLP = {
    "llama": ("LlamaRMSNorm", "LlamaMLP"), "mistral": ("MistralRMSNorm", "MistralMLP"),
    "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"), "qwen3": ("Qwen3RMSNorm", "Qwen3MLP"),
    "phi3": ("Phi3RMSNorm", "Phi3MLP"), "olmo2": ("Olmo2RMSNorm", "Olmo2MLP"),
    "gemma": ("GemmaRMSNorm", "GemmaMLP"), "gemma2": ("Gemma2RMSNorm", "Gemma2MLP"),
    "gemma3": ("Gemma3RMSNorm", "Gemma3MLP"),
}
#: transformers.activations classes the README claims ("Python-formula activations")
HF_ACTIVATIONS = ("NewGELUActivation", "QuickGELUActivation", "GELUActivation")
DIFFUSERS_ACTIVATIONS = ("GEGLU", "SwiGLU", "ApproximateGELU")


def _why(cls: type, library: str, report=None) -> str:
    """What slimgrad recorded about ``cls`` (or about ``library``'s integrations), for the failure message."""
    gap = class_gap(cls)
    if gap is not None:
        return f"recorded reason: {gap.reason}"
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    reported = [g for g in getattr(report, "gaps", ()) if g.subject == qualified]
    if reported:
        return "reported gap: " + "; ".join(g.reason for g in reported)
    gaps = [g for g in integration_gaps() if g.library == library]
    if gaps:
        return "integration disabled: " + "; ".join(f"{g.subject}: {g.reason}" for g in gaps)
    return "no reason recorded (a silent gap: convert should have warned)"


def _assert_engaged(original: nn.Module, converted: nn.Module, cls: type, library: str, report) -> None:
    before = sum(type(m) is cls for m in original.modules())
    assert before, f"test set-up: the tiny model has no {cls.__qualname__}"
    left = [name for name, m in converted.named_modules() if type(m) is cls]
    done = sum(ORIGINALS.get(type(m)) is cls for m in converted.modules())
    assert not left and done == before, (
        f"{cls.__module__}.{cls.__qualname__} no longer engages on {library} {library_version(library)}: "
        f"{done} of {before} converted (left: {left[:3]}); {_why(cls, library, report)}\n{report}")


def _converted(model: nn.Module, **options):
    return slimgrad.convert(model, report=True, **options)


# --- transformers: RMSNorms, gated MLPs, activations, chunked-loss heads -------------------------------------

def _causal_lm(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    module_name, config_name, model_name, extra = CAUSAL_LMS[family]
    config = getattr(transformers, config_name)(**LLAMA_LIKE, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def _modeling(family: str):
    name = CAUSAL_LMS[family][0] if family in CAUSAL_LMS else family
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@pytest.mark.parametrize("family", list(NORM_AND_MLP))
def test_hf_rmsnorm_and_gated_mlp_engage(family):
    model = _causal_lm(family)
    converted, report = _converted(model)
    norm_name, mlp_name = NORM_AND_MLP[family]
    for name in (norm_name, mlp_name):
        _assert_engaged(model, converted, getattr(_modeling(family), name), "transformers", report)


def test_t5_layer_norm_engages():
    transformers = pytest.importorskip("transformers")
    model = transformers.T5EncoderModel(transformers.T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=1,
                                                              num_heads=4, vocab_size=V))
    converted, report = _converted(model)
    _assert_engaged(model, converted, _modeling("t5").T5LayerNorm, "transformers", report)


@pytest.mark.parametrize("name", HF_ACTIVATIONS)
def test_hf_activation_engages(name):
    activations = pytest.importorskip("transformers.activations")
    cls = getattr(activations, name)
    model = nn.Sequential(nn.Linear(8, 8), cls(*(() if name != "GELUActivation" else (True,))))
    converted, report = _converted(model)
    _assert_engaged(model, converted, cls, "transformers", report)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_activation_engages():
    model = _gpt2()
    converted, report = _converted(model)
    _assert_engaged(model, converted, type(model.transformer.h[0].mlp.act), "transformers", report)


@pytest.mark.parametrize("family", [*CAUSAL_LMS, "gpt2"])
def test_chunked_loss_engages(family):
    model = _gpt2() if family == "gpt2" else _causal_lm(family)
    head = type(model)
    converted, report = _converted(copy.deepcopy(model), chunked_loss=True)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    model.train()
    converted.train()
    stock = model(input_ids=ids, labels=labels)
    out = converted(input_ids=ids, labels=labels)
    version = library_version("transformers")
    engaged = out.logits is None and report.converted_types.get(f"{head.__module__}.{head.__qualname__}", 0) == 1
    assert engaged, (f"chunked_loss no longer engages on {head.__module__}.{head.__qualname__} (transformers "
                     f"{version}): logits {'None' if out.logits is None else tuple(out.logits.shape)}; "
                     f"{_why(head, 'transformers', report)}\n{report}")
    torch.testing.assert_close(out.loss, stock.loss, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{head.__qualname__}: chunked loss differs from stock's: {m}")


# --- peft LoRA (over nn.Linear, GPT-2's Conv1D, nn.Conv2d) ------------------------------------------------------

class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


@pytest.mark.parametrize("base", ["linear", "conv1d", "conv2d"])
def test_peft_lora_engages(base):
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import layer

    if base == "linear":
        model, targets, cls = _causal_lm("llama"), ["q_proj", "v_proj", "gate_proj"], layer.Linear
    elif base == "conv1d":
        model, targets, cls = _gpt2(), ["c_attn", "c_fc"], layer.Linear
    else:
        model, targets, cls = _ConvNet(), ["conv", "head"], layer.Conv2d
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    converted, report = _converted(model)
    _assert_engaged(model, converted, cls, "peft", report)


# --- bitsandbytes, and peft LoRA over it -------------------------------------------------------------------------

class _One(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def _bnb_layer(bits: int) -> nn.Module:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    if bits == 4:
        layer = bnb.nn.Linear4bit(64, 48, compute_dtype=torch.bfloat16, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False, threshold=0.0)
    layer.load_state_dict(ref.state_dict())
    return layer.to("cpu")  # quantizes


@pytest.mark.parametrize("bits", [4, 8])
def test_bnb_linear_engages(bits):
    model = _One(_bnb_layer(bits))
    converted, report = _converted(model)
    _assert_engaged(model, converted, type(model.proj), "bitsandbytes", report)


@pytest.mark.parametrize("bits", [4, 8])
def test_peft_lora_over_bnb_engages(bits):
    peft = pytest.importorskip("peft")
    model = _One(_bnb_layer(bits))
    setattr(model, f"is_loaded_in_{bits}bit", True)  # what transformers sets; peft dispatches on it
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]))
    wrapper = type(model.base_model.model.proj)
    assert wrapper.__module__ == "peft.tuners.lora.bnb", f"test set-up: peft wrapped the bnb layer in {wrapper}"
    converted, report = _converted(model)
    _assert_engaged(model, converted, wrapper, "peft", report)


# --- diffusers feed-forward activations -------------------------------------------------------------------------

@pytest.mark.parametrize("name", DIFFUSERS_ACTIVATIONS)
def test_diffusers_activation_engages(name):
    activations = pytest.importorskip("diffusers.models.activations")
    cls = getattr(activations, name)
    model = nn.Sequential(cls(16, 24), nn.Linear(24, 4))
    converted, report = _converted(model)
    _assert_engaged(model, converted, cls, "diffusers", report)
