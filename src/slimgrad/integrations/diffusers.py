"""diffusers' feed-forward activations (``GEGLU``, ``SwiGLU``, ``ApproximateGELU``) as slimgrad drop-ins.

``diffusers.models.attention.FeedForward`` (every transformer block of the UNets and DiTs) projects, then
applies one of these. What stock autograd keeps, per token, for a projection output of width ``2d``
(gated) or ``d`` (plain):

* ``GEGLU`` / ``SwiGLU``: ``hidden, gate = proj(x).chunk(2)``; ``hidden * act(gate)`` keeps ``gate`` and
  ``hidden`` (views of the whole projection output, 2d) *and* ``act(gate)`` (d): 1.5x the projection
  output. Kept here: the projection output only (1.0x), the activation recomputed in backward by
  :func:`slimgrad.functional.gated.gated_activation` (``act(gate) * hidden`` equals ``hidden * act(gate)``
  bit for bit, and so do both products of backward).
* ``ApproximateGELU``: ``x * sigmoid(1.702 x)`` keeps x and the sigmoid (2x); kept here: x (1x), through
  :func:`slimgrad.functional.hf_activations.quick_gelu`, the same formula.
* ``GELU`` (``F.gelu`` on the projection) already keeps only its input: left as stock.

A class is converted only when the source of its ``forward`` (and of the helper it calls) is the one read
here, compared by fingerprint (:mod:`slimgrad.integrations._fingerprint`, the rule of
:mod:`slimgrad.integrations.hf_mlp`); a class edited by a later diffusers release is left alone and
recorded as a gap (family "diffusers activation"), so ``convert`` says so. At run time the replacement
defers to diffusers' own forward wherever it would not reproduce it: deprecated extra arguments, NPU
(``torch_npu.npu_geglu``), MPS, hooks on the activation, or an activation module swapped since conversion.
"""

from __future__ import annotations

from diffusers.models import activations as _acts
from torch import nn

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, register_forward
from slimgrad.functional.gated import gated_activation
from slimgrad.functional.hf_activations import quick_gelu
from slimgrad.integrations._fingerprint import fingerprint, source_fingerprint
from slimgrad.integrations._hooks import global_module_hooks, module_hooks

__all__ = ["REFERENCE_SOURCES", "register_known"]


_DEPRECATION = ('''
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecation_message = "The `scale` argument is deprecated and will be ignored. Please remove it, as \
passing it will raise an error in the future. `scale` should directly be passed while calling the underlying \
pipeline component i.e., via `cross_attention_kwargs`."
            deprecate("scale", "1.0.0", deprecation_message)''')

#: class name -> {method: source} as read in diffusers 0.35, 0.41 and 0.42 (``diffusers/models/activations.py``)
REFERENCE_SOURCES = {
    "GEGLU": {
        "forward": '''
    def forward(self, hidden_states, *args, **kwargs) -> torch.Tensor:''' + _DEPRECATION + '''
        hidden_states = self.proj(hidden_states)
        if is_torch_npu_available():
            # using torch_npu.npu_geglu can run faster and save memory on NPU.
            return torch_npu.npu_geglu(hidden_states, dim=-1, approximate=1)[0]
        else:
            hidden_states, gate = hidden_states.chunk(2, dim=-1)
            return hidden_states * self.gelu(gate)
''',
        "gelu": '''
    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        if gate.device.type == "mps" and is_torch_version("<", "2.0.0"):
            # fp16 gelu not supported on mps before torch 2.0
            return F.gelu(gate.to(dtype=torch.float32)).to(dtype=gate.dtype)
        return F.gelu(gate)
''',
    },
    "SwiGLU": {
        "forward": '''
    def forward(self, hidden_states) -> torch.Tensor:
        hidden_states = self.proj(hidden_states)
        hidden_states, gate = hidden_states.chunk(2, dim=-1)
        return hidden_states * self.activation(gate)
''',
    },
    "ApproximateGELU": {
        "forward": '''
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return x * torch.sigmoid(1.702 * x)
''',
    },
}
_REFERENCE = {cls: {m: source_fingerprint(s) for m, s in methods.items()} for cls, methods in REFERENCE_SOURCES.items()}
#: stock class -> its forward as verified (a later monkey-patch makes the class unsupported)
_VERIFIED: dict[type, object] = {}


def _mismatch(cls: type, name: str) -> str | None:
    """None when every method of ``cls`` that slimgrad reproduces has the reference fingerprint; else why not."""
    for method, want in _REFERENCE[name].items():
        fn = getattr(cls, method, None)
        fp = fingerprint(fn) if fn is not None else None
        if fp != want:
            return (f"{name}.{method} (fingerprint {fp}) is not the one slimgrad has read and reproduces "
                    f"(read in diffusers 0.35.0, 0.41.0 and 0.42.1)")
    return None


def _matches(cls: type, name: str) -> bool:
    return _mismatch(cls, name) is None


def _changed(module: nn.Module) -> str | None:
    stock = ORIGINALS.get(type(module), type(module))
    if _VERIFIED.get(stock) is not stock.forward:
        return f"{stock.__name__}.forward was changed after slimgrad verified its source; left as stock"
    return None


def _stock_forward(self, *args, **kwargs):
    return _VERIFIED[ORIGINALS[type(self)]](self, *args, **kwargs)


def _gated(self, hidden, gate, kind):
    if hidden.shape != gate.shape or hidden.dtype != gate.dtype:
        return None
    return gated_activation(gate, hidden, kind)


def _geglu_forward(self, hidden_states, *args, **kwargs):
    if (args or kwargs.get("scale", None) is not None or _acts.is_torch_npu_available()
            or hidden_states.device.type == "mps" or global_module_hooks()):
        return _stock_forward(self, hidden_states, *args, **kwargs)
    hidden, gate = self.proj(hidden_states).chunk(2, dim=-1)
    return gated_activation(gate, hidden, "gelu")


def _swiglu_forward(self, hidden_states):
    act = self.activation
    if ORIGINALS.get(type(act), type(act)) is not nn.SiLU or module_hooks(act) or global_module_hooks():
        return _stock_forward(self, hidden_states)
    hidden, gate = self.proj(hidden_states).chunk(2, dim=-1)
    return gated_activation(gate, hidden, "silu")


def _approximate_gelu_forward(self, x):
    return quick_gelu(self.proj(x))


_FORWARDS = {"GEGLU": _geglu_forward, "SwiGLU": _swiglu_forward, "ApproximateGELU": _approximate_gelu_forward}


def _swiglu_reason(module: nn.Module) -> str | None:
    act = module.activation
    if ORIGINALS.get(type(act), type(act)) is not nn.SiLU:
        return f"activation is {type(act).__name__}, not nn.SiLU; left as stock"
    return _changed(module)


def register_known() -> list[type]:
    """Register the activation classes whose source matches :data:`REFERENCE_SOURCES`; returns those
    newly registered. A mismatch (a diffusers release that edited the class) registers nothing."""
    added = []
    for name, forward in _FORWARDS.items():
        cls = getattr(_acts, name, None)
        if cls is None or cls in _VERIFIED:
            continue
        reason = _mismatch(cls, name)
        if reason is not None:
            _notices.record_class_gap(cls, library="diffusers", family="diffusers activation", reason=reason)
            continue
        _VERIFIED[cls] = cls.forward
        register_forward(cls, forward, module=__name__,
                         unsupported_reason=_swiglu_reason if name == "SwiGLU" else _changed)
        added.append(cls)
    return added


register_known()
