"""Hugging Face RMSNorm classes: forward-only replacements that run slimgrad's RMSNorm with the class's own
casting.

transformers copies one RMSNorm per model family (140+ classes in 5.x), mostly verbatim. A class is
converted only when its ``forward`` (and, for Gemma, ``_norm``) source is one we have read and reproduce
bitwise (:data:`REFERENCE_FORWARDS`); anything else (gated norms, ``with_scale``
variants, centred or unweighted norms) is left alone. Matching by source rather than by a list of names
keeps the list honest when transformers edits a copy, and covers new copies of an identical forward.

Comparing the text broke on every cosmetic edit (a dropped annotation silently stopped conversion), so
sources are compared by :mod:`slimgrad.integrations._fingerprint`: annotations, comments, docstrings,
layout, parameter names and single-use temporaries do not matter; any change to what the code computes
does. A class named like an RMSNorm whose forward matches no reference is left to transformers and recorded
as a gap (:func:`slimgrad._notices.record_class_gap`, family "RMSNorm"), so ``convert`` says so.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register_forward
from slimgrad.functional.norms import rms_norm_hf
from slimgrad.integrations._fingerprint import fingerprint, source_fingerprint
from slimgrad.integrations._hf_classes import loaded_transformers_classes

__all__ = ["REFERENCE_FORWARDS", "VARIANT_FORWARDS", "register_loaded"]

_LLAMA = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_OLMO2 = '''
def forward(self, hidden_states) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
'''
_GEMMA_NORM = '''
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
'''
_T5 = '''
def forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states
'''

_LLAMA4 = '''
def forward(self, x):
    output = self._norm(x.float()).type_as(x)
    return output * self.weight
'''
_HELIUM = '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)
'''


def _gemma_forward(name: str) -> str:
    return f'''
def forward(self, x):
    output = self._norm(x.float())
    # Llama does x.to(float16) * w whilst {name} is (x * w).to(float16)
    # See https://github.com/huggingface/transformers/pull/29402
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
'''


#: casting style -> (forward sources, extra methods' sources) we have read and reproduce bitwise
REFERENCE_FORWARDS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "llama": ((_LLAMA,), {}),
    "olmo2": ((_OLMO2,), {}),
    "gemma": (tuple(_gemma_forward(n) for n in ("Gemma", "Gemma2", "Gemma3")), {"_norm": _GEMMA_NORM}),
    "t5": ((_T5,), {}),
}
#: other forwards that compute one of the styles: name -> (style, forward source, extra methods' sources, eps
#: attribute). Llama 4's text norm computes Llama's (its product's operands swapped: the same bits); Helium's is
#: OLMo2's with the weight cast to fp32 first, which differs only for an fp64 weight (its forward casts it too).
VARIANT_FORWARDS: dict[str, tuple[str, str, dict[str, str], str]] = {
    "llama4": ("llama", _LLAMA4, {"_norm": _GEMMA_NORM}, "eps"),
    "helium": ("olmo2", _HELIUM, {}, "variance_epsilon"),
}
_EPS_ATTRIBUTE = {"llama": "variance_epsilon", "olmo2": "variance_epsilon", "t5": "variance_epsilon", "gemma": "eps"}
#: reference (a style or a variant) -> (style, forward sources, extra methods' sources, eps attribute)
_REFERENCES = {
    **{style: (style, forwards, extra, _EPS_ATTRIBUTE[style])
       for style, (forwards, extra) in REFERENCE_FORWARDS.items()},
    **{name: (style, (forward,), extra, eps) for name, (style, forward, extra, eps) in VARIANT_FORWARDS.items()},
}
#: reference -> (fingerprints of the forwards, {extra method: fingerprint})
_REFERENCE_FINGERPRINTS = {
    ref: ({source_fingerprint(f) for f in forwards}, {k: source_fingerprint(v) for k, v in extra.items()})
    for ref, (_style, forwards, extra, _eps) in _REFERENCES.items()
}
_checked: set[type] = set()
#: stock class -> its forward as verified (a later monkey-patch leaves the class to transformers)
_VERIFIED: dict[type, object] = {}


def _check(cls: type) -> tuple[str | None, str]:
    """(reference, "") when ``cls``'s forward (and the methods it calls) match a reference, else
    (None, the reason, naming the method slimgrad does not know)."""
    forward = fingerprint(cls.forward)
    if forward is None:
        return None, f"the source of {cls.__name__}.forward cannot be read, so slimgrad cannot check it"
    matched = None
    for ref, (forwards, extra) in _REFERENCE_FINGERPRINTS.items():
        if forward not in forwards:
            continue
        if all(fingerprint(getattr(cls, name, None)) == want for name, want in extra.items()):
            return ref, ""
        matched = matched or ref
    if matched is not None:
        extra = next(iter(_REFERENCE_FINGERPRINTS[matched][1]))
        return None, (f"{cls.__name__}.forward is the {matched} one, but {cls.__name__}.{extra} is not one "
                      f"slimgrad reproduces")
    params = [p for p in inspect.signature(cls.forward).parameters.values()][1:]
    shape = " (it takes more than the hidden states)" if len(params) > 1 else ""
    return None, (f"{cls.__name__}.forward (fingerprint {forward}) is not one slimgrad reproduces{shape}; "
                  f"known: the {', '.join(_REFERENCES)} norms")


def _style_of(cls: type) -> str | None:
    """The casting style of the reference ``cls``'s forward matches, or None."""
    try:
        ref = _check(cls)[0]
    except (TypeError, ValueError, AttributeError):
        return None
    return None if ref is None else _REFERENCES[ref][0]


def _make_forward(ref: str):
    style, _, _, eps_attribute = _REFERENCES[ref]
    if ref == "helium":

        def forward(self, hidden_states):
            weight = self.weight
            if weight.dtype == torch.float64:  # Helium's product is in fp32 whatever the weight (OLMo2's: promoted)
                weight = weight.to(torch.float32)
            return rms_norm_hf(hidden_states, weight, getattr(self, eps_attribute), style)
    else:

        def forward(self, hidden_states):
            return rms_norm_hf(hidden_states, self.weight, getattr(self, eps_attribute), style)

    forward.__doc__ = f"RMSNorm with {style}-style casting, keeping the input and one fp32 statistic per row."
    return forward


def _unsupported_reason(module: nn.Module) -> str | None:
    stock = ORIGINALS.get(type(module), type(module))
    if _VERIFIED.get(stock) is not stock.forward:
        return f"{stock.__name__}.forward was changed after slimgrad verified it; left as stock"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return "weight is not a 1-d parameter over the hidden size; left as stock"
    return None


_FORWARDS = {ref: _make_forward(ref) for ref in _REFERENCES}


def register_loaded() -> list[type]:
    """Register every RMSNorm-like class of the transformers modeling modules imported so far whose
    forward matches a reference; returns the classes newly registered. Cheap to call again."""
    added = []
    for name, cls in loaded_transformers_classes():
        claimed = "RMSNorm" in name or name == "T5LayerNorm"
        # T5's norm copied under another name (MT5LayerNorm, UMT5LayerNorm, LongT5LayerNorm, Pop2Piano's, Udop's,
        # ...): converted where its forward matches a reference, as any RMSNorm; a LayerNorm that does not match is
        # a LayerNorm, no gap
        if cls in _checked or not (claimed or name.endswith("LayerNorm")):
            continue
        _checked.add(cls)
        if cls in REPLACEMENTS:
            continue
        try:
            ref, reason = _check(cls)
        except (TypeError, ValueError, AttributeError) as e:
            ref, reason = None, f"slimgrad could not read {cls.__name__}.forward ({type(e).__name__}: {e})"
        if ref is None:
            if claimed:
                _notices.record_class_gap(cls, library="transformers", family="RMSNorm", reason=reason)
            continue
        _VERIFIED[cls] = cls.forward
        register_forward(cls, _FORWARDS[ref], module=__name__, unsupported_reason=_unsupported_reason)
        added.append(cls)
    return added


register_loaded()
refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert
