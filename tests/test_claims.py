"""The drift test: every family the README claims engages on the installed releases, or this test names why not.

The integrations recognise upstream classes by their forwards (syntax-tree fingerprints, behavioural checks),
so a new transformers / peft / bitsandbytes / diffusers release can stop a conversion without any slimgrad
change. CI runs this file against the pinned releases (``constraints-tested.txt``), ``scripts/newest.sh``
against the newest ones, and ``benchmarks/compat_table.py`` measures the same cases in each venv for
``docs/compat.md``. Each case builds a tiny model from a config, converts it and counts the modules of the
claimed class that were converted (for the chunked loss: whether a training forward with labels returns the
stock loss and no logits). A failure names the class, the installed library version and the reason slimgrad
recorded (:func:`slimgrad._notices.class_gap`, the report's gaps, :func:`slimgrad._notices.integration_gaps`),
or says that none was recorded: a silent gap, a bug of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable

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


@dataclasses.dataclass(frozen=True)
class Engagement:
    """How many modules of one claimed class a conversion engaged, and slimgrad's reason for the rest."""

    feature: str  # the README's name for it: "RMSNorm", "gated MLP", "chunked loss", "LoRA", ...
    subject: str  # qualified class name
    library: str  # the distribution that defines the class
    engaged: int
    total: int
    why: str = ""  # empty when everything engaged

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.engaged == self.total

    def message(self) -> str:
        return (f"{self.feature} {self.subject} no longer engages on {self.library} "
                f"{library_version(self.library)}: {self.engaged} of {self.total} converted; {self.why}")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _why(cls: type, library: str, report=None) -> str:
    """What slimgrad recorded about ``cls`` (or about ``library``'s integrations), for the failure message."""
    gap = class_gap(cls)
    if gap is not None:
        return f"recorded reason: {gap.reason}"
    reported = [g for g in getattr(report, "gaps", ()) if g.subject == _qualified(cls)]
    if reported:
        return "reported gap: " + "; ".join(g.reason for g in reported)
    gaps = [g for g in integration_gaps() if g.library == library]
    if gaps:
        return "integration disabled: " + "; ".join(f"{g.subject}: {g.reason}" for g in gaps)
    return "no reason recorded (a silent gap: convert should have warned)"


def _count(feature: str, model: nn.Module, cls: type, library: str) -> Engagement:
    """Convert ``model`` and count its modules of class ``cls`` that were converted."""
    total = sum(type(m) is cls for m in model.modules())
    if not total:
        raise AssertionError(f"test set-up: the tiny model has no {cls.__qualname__}")
    converted, report = slimgrad.convert(model, report=True)
    engaged = sum(ORIGINALS.get(type(m)) is cls for m in converted.modules())
    left = [name for name, m in converted.named_modules() if type(m) is cls]
    why = "" if engaged == total else f"left: {left[:3]}; {_why(cls, library, report)}\n{report}"
    return Engagement(feature, _qualified(cls), library, engaged, total, why)


def _require(module: str, distribution: str):
    """Import ``module``; skip when its distribution is not installed (an installed one that fails to import
    is a failure: a claimed library that cannot be used)."""
    if library_version(distribution) == "not installed":
        pytest.skip(f"{distribution} is not installed")
    return importlib.import_module(module)


# --- transformers: RMSNorms, gated MLPs, activations, chunked-loss heads -------------------------------------

def _causal_lm(family: str) -> nn.Module:
    transformers = _require("transformers", "transformers")
    module_name, config_name, model_name, extra = CAUSAL_LMS[family]
    config = getattr(transformers, config_name)(**LLAMA_LIKE, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def _gpt2() -> nn.Module:
    transformers = _require("transformers", "transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _modeling(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _norm(family: str) -> Engagement:
    model = _causal_lm(family)
    return _count("RMSNorm", model, getattr(_modeling(CAUSAL_LMS[family][0]), NORM_AND_MLP[family][0]),
                  "transformers")


def _mlp(family: str) -> Engagement:
    model = _causal_lm(family)
    return _count("gated MLP", model, getattr(_modeling(CAUSAL_LMS[family][0]), NORM_AND_MLP[family][1]),
                  "transformers")


def _t5_norm() -> Engagement:
    transformers = _require("transformers", "transformers")
    model = transformers.T5EncoderModel(transformers.T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=1,
                                                              num_heads=4, vocab_size=V))
    return _count("RMSNorm", model, _modeling("t5").T5LayerNorm, "transformers")


def _hf_activation(name: str) -> Engagement:
    cls = getattr(_require("transformers.activations", "transformers"), name)
    act = cls(True) if name == "GELUActivation" else cls()  # GELUActivation(use_gelu_python=True): the formula
    return _count("activation", nn.Sequential(nn.Linear(8, 8), act), cls, "transformers")


def _gpt2_activation() -> Engagement:
    model = _gpt2()
    return _count("activation", model, type(model.transformer.h[0].mlp.act), "transformers")


def _chunked_loss(family: str) -> Engagement:
    """Engaged: a training forward with labels gives no logits and stock's loss (fp32, 1e-5)."""
    model = _gpt2() if family == "gpt2" else _causal_lm(family)
    head = type(model)
    converted, report = slimgrad.convert(copy.deepcopy(model), chunked_loss=True, report=True)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    model.train()
    converted.train()
    stock = model(input_ids=ids, labels=labels)
    out = converted(input_ids=ids, labels=labels)
    swapped = report.converted_types.get(_qualified(head), 0)
    why = ""
    if out.logits is not None or not swapped:
        logits = "None" if out.logits is None else tuple(out.logits.shape)
        why = f"logits {logits}, head converted {swapped}; {_why(head, 'transformers', report)}\n{report}"
    elif not torch.allclose(out.loss, stock.loss, rtol=1e-5, atol=1e-6):
        why = f"WRONG NUMBERS: loss {out.loss.item():.8g}, stock {stock.loss.item():.8g}"
    return Engagement("chunked loss", _qualified(head), "transformers", int(not why), 1, why)


# --- peft LoRA (over nn.Linear, GPT-2's Conv1D, nn.Conv2d), bitsandbytes, peft LoRA over bitsandbytes --------

class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


class _One(nn.Module):  # tests._util.OneLayer; this file also runs standalone (compat_table --probe)
    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def _peft_lora(base: str) -> Engagement:
    peft = _require("peft", "peft")
    from peft.tuners.lora import layer

    if base == "linear":
        model, targets, cls = _causal_lm("llama"), ["q_proj", "v_proj", "gate_proj"], layer.Linear
    elif base == "conv1d":
        model, targets, cls = _gpt2(), ["c_attn", "c_fc"], layer.Linear
    elif base == "falcon":  # Falcon-7B's bias-less FalconLinear
        transformers = _require("transformers", "transformers")
        config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                                           multi_query=True, parallel_attn=True, bias=False)
        torch.manual_seed(0)
        model, targets, cls = (transformers.FalconForCausalLM(config), ["query_key_value", "dense_h_to_4h"],
                               layer.Linear)
    else:
        model, targets, cls = _ConvNet(), ["conv", "head"], layer.Conv2d
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    return _count("LoRA", model, cls, "peft")


def _bnb_layer(bits: int) -> nn.Module:
    bnb = _require("bitsandbytes", "bitsandbytes")
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    if bits == 4:
        layer = bnb.nn.Linear4bit(64, 48, compute_dtype=torch.bfloat16, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False, threshold=0.0)
    layer.load_state_dict(ref.state_dict())
    return layer.to("cpu")  # quantizes


def _bnb_linear(bits: int) -> Engagement:
    model = _One(_bnb_layer(bits))
    return _count("quantized linear", model, type(model.proj), "bitsandbytes")


def _peft_over_bnb(bits: int) -> Engagement:
    peft = _require("peft", "peft")
    model = _One(_bnb_layer(bits))
    setattr(model, f"is_loaded_in_{bits}bit", True)  # what transformers sets; peft dispatches on it
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]))
    wrapper = type(model.base_model.model.proj)
    if wrapper.__module__ != "peft.tuners.lora.bnb":
        raise AssertionError(f"test set-up: peft wrapped the bitsandbytes layer in {wrapper}")
    return _count("LoRA", model, wrapper, "peft")


def _diffusers_activation(name: str) -> Engagement:
    cls = getattr(_require("diffusers.models.activations", "diffusers"), name)
    return _count("activation", nn.Sequential(cls(16, 24), nn.Linear(24, 4)), cls, "diffusers")


#: MoE family -> (config class, causal-LM class, experts class, extra config): transformers 5's fused experts
MOE_LMS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralExperts", {"num_local_experts": 4}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeExperts",
                  {"num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32}),
}


def _moe(family: str) -> Engagement:
    transformers = _require("transformers", "transformers")
    config_name, model_name, experts_name, extra = MOE_LMS[family]
    cls = getattr(_modeling(family), experts_name, None)
    if cls is None or importlib.util.find_spec("transformers.integrations.moe") is None:
        pytest.skip(f"transformers {library_version('transformers')} has no fused experts class (each expert is an "
                    f"MLP module of its own there); the README claims MoE experts for transformers 5")
    config = getattr(transformers, config_name)(**LLAMA_LIKE, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _count("MoE experts", getattr(transformers, model_name)(config), cls, "transformers")


#: case id -> what it measures; the README's claims, one tiny model each
CASES: dict[str, Callable[[], Engagement]] = {
    **{f"rmsnorm-{f}": (lambda f=f: _norm(f)) for f in NORM_AND_MLP},
    "rmsnorm-t5": _t5_norm,
    **{f"mlp-{f}": (lambda f=f: _mlp(f)) for f in NORM_AND_MLP},
    **{f"hf-act-{n}": (lambda n=n: _hf_activation(n)) for n in HF_ACTIVATIONS},
    "hf-act-gpt2": _gpt2_activation,
    **{f"chunked-{f}": (lambda f=f: _chunked_loss(f)) for f in [*CAUSAL_LMS, "gpt2"]},
    **{f"lora-{b}": (lambda b=b: _peft_lora(b)) for b in ("linear", "conv1d", "falcon", "conv2d")},
    **{f"bnb-{b}bit": (lambda b=b: _bnb_linear(b)) for b in (4, 8)},
    **{f"lora-bnb-{b}bit": (lambda b=b: _peft_over_bnb(b)) for b in (4, 8)},
    **{f"diffusers-{n}": (lambda n=n: _diffusers_activation(n)) for n in DIFFUSERS_ACTIVATIONS},
    **{f"moe-{f}": (lambda f=f: _moe(f)) for f in MOE_LMS},
}


@pytest.mark.parametrize("case", list(CASES))
def test_claimed_family_engages(case):
    result = CASES[case]()
    assert result.ok, result.message()


_DRIFTED = '''
import sys

import transformers
from transformers.models.llama import modeling_llama


def forward(self, hidden_states):  # a plausible next release: another formula, other numbers
    variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * (variance + self.variance_epsilon).rsqrt()).to(hidden_states.dtype)


modeling_llama.LlamaRMSNorm.forward = forward  # before slimgrad first sees the class, as an upstream edit would be

import importlib.util

spec = importlib.util.spec_from_file_location("claims", sys.argv[1])
claims = sys.modules["claims"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claims)
result = claims.CASES["rmsnorm-llama"]()
print(result.ok)
print(result.message().splitlines()[0])
'''


def test_a_family_that_stops_engaging_fails_naming_the_cause(tmp_path):
    """The drift test's own check: an upstream forward slimgrad does not know makes the case fail with the class,
    the library version and slimgrad's recorded reason (run in a fresh process, as a new release would be)."""
    import subprocess
    import sys

    _require("transformers", "transformers")
    script = tmp_path / "drifted.py"
    script.write_text(_DRIFTED)
    out = subprocess.run([sys.executable, str(script), __file__], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, message = out.stdout.strip().splitlines()[-2:]
    assert ok == "False", f"a changed LlamaRMSNorm.forward still counted as engaged: {message}"
    assert "LlamaRMSNorm" in message and f"transformers {library_version('transformers')}" in message, message
    assert "no reason recorded" not in message and ("recorded reason" in message or "reported gap" in message), message
