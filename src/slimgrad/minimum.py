"""The analytical minimum a module must keep for the gradients requested of it.

The rules are written from the maths of each backward, independently of slimgrad's layers, so the audit
can show how far stock PyTorch, and slimgrad itself, are from the floor. A rule sees one call of a module
(the module, its inputs, its output, which of them require grad) and returns what that call's backward
must read, as :class:`Need` records:

* a **plain** need: one of the module's own input or output tensors, kept as it is (``tensor``). A tensor
  several modules need (the ``x`` that q, k and v projections share) costs once in a model total.
* a **derivable** need: bytes that are free when every tensor of one of the alternatives in ``derive`` is
  kept anyway (a ReLU's 1-bit mask is ``y > 0`` of a kept output; a gated MLP's product is recomputed from
  its kept gate and up), and cost ``nbytes`` otherwise.
* an **internal** need: bytes derived inside the module (per-row statistics, pooling positions, seeds,
  LoRA's rank-r ``A(x)``).

What "minimum" means, precisely (see ``docs/audit.md``): element-wise functions of kept tensors are free
to recompute (masks, activations, casts to a narrower dtype); anything a reduction or matrix product
produced (statistics, argmax positions, projections) costs its size. Nothing is recomputed across module
boundaries beyond that, no compression, no re-running of the forward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ._registry import ORIGINALS, REPLACEMENTS

__all__ = ["Need", "minimum_bytes", "minimum_needs", "rule_for"]


@dataclasses.dataclass
class Need:
    """One thing a call's backward must read: see the module docstring for the three kinds."""

    what: str
    nbytes: int
    tensor: torch.Tensor | None = None
    derive: tuple[tuple[torch.Tensor, ...], ...] = ()
    derived: int = 0  # cost when one alternative of ``derive`` is kept


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _needs(p) -> bool:
    return isinstance(p, torch.Tensor) and p.requires_grad


def _keep(t: torch.Tensor, what: str = "input") -> Need:
    return Need(what, _nbytes(t), tensor=t)


def _first(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


# -- rules: (module, x, y, x_grad) -> list[Need] -----------------------------------------------------------


def _weight_reads_input(m, x, y, x_grad):
    """Linear, Conv*, ConvTranspose*, GPT-2's Conv1D: dW = f(dY, X); dX reads only W; dB nothing."""
    return [_keep(x)] if _needs(getattr(m, "weight", None)) else []


def _nothing(m, x, y, x_grad):
    return []


def _stat_size(x: torch.Tensor) -> int:
    """Bytes of one statistic: fp32, or the input's dtype where that is narrower (CPU kernels keep bf16
    statistics for bf16 inputs; a lower bound must not assume more)."""
    return min(4, x.element_size())


def _batch_norm(m, x, y, x_grad):
    channels = x.shape[1] if x.dim() > 1 else x.shape[0]
    stats = Need("stats", 2 * channels * _stat_size(x))  # mean and invstd per channel
    batch_stats = m.training or not m.track_running_stats
    w_grad = _needs(m.weight)
    if batch_stats:
        return [_keep(x), stats] if (x_grad or w_grad) else []
    return [_keep(x)] if w_grad else []  # eval: dX = dY·w·invstd_running reads no activation


def _rows(x: torch.Tensor, normalized_dims: int) -> int:
    return math.prod(x.shape[: x.dim() - normalized_dims]) if x.dim() > normalized_dims else 1


def _affine_norm(x, x_grad, w_grad, b_grad, groups_stats: int, xhat_itemsize: int) -> list[Need]:
    """LayerNorm/GroupNorm: dX reads x, mean, rstd (and w); dW reads x̂ (= x, mean, rstd); dB nothing."""
    stats = Need("stats", 2 * groups_stats * _stat_size(x))
    if x_grad:
        return [_keep(x), stats]
    if w_grad:  # x̂ alone, or x plus the statistics when x is kept anyway
        return [Need("normalized input", min(x.numel() * xhat_itemsize, _nbytes(x) + stats.nbytes),
                     derive=((x,),), derived=stats.nbytes)]
    return []


def _layer_norm(m, x, y, x_grad):
    """Also the channels-first LayerNorms (ConvNeXt's and the LayerNorm2d copies): statistics per position,
    over the normalized shape wherever it sits in the input."""
    groups = x.numel() // max(1, math.prod(m.normalized_shape))
    return _affine_norm(x, x_grad, _needs(m.weight), _needs(m.bias), groups, x.element_size())


def _group_norm(m, x, y, x_grad):
    return _affine_norm(x, x_grad, _needs(m.weight), _needs(m.bias), x.shape[0] * m.num_groups if x.dim() > 1
                        else m.num_groups, x.element_size())


def _rms(x, x_grad, w_grad, normalized_dims, compute_itemsize, xhat_itemsize, stat_itemsize) -> list[Need]:
    """RMSNorm: dX reads x, rstd (and w); dW reads x̂ = x·rstd. One statistic per row, in the compute dtype;
    a norm that computes in fp32 reads x only in fp32 (an fp64 input's fp32 copy is what its backward
    reads)."""
    rstd = Need("stats", _rows(x, normalized_dims) * stat_itemsize)
    if not (x_grad or w_grad):
        return []
    x_cost = x.numel() * min(x.element_size(), compute_itemsize)
    if x_grad:
        kept = _keep(x) if x_cost == _nbytes(x) else Need("input (compute dtype)", x_cost, derive=((x,),))
        return [kept, rstd]
    return [Need("normalized input", min(x.numel() * xhat_itemsize, x_cost + rstd.nbytes), derive=((x,),),
                 derived=rstd.nbytes)]


def _torch_rms_norm(m, x, y, x_grad):
    dims = len(m.normalized_shape)
    return _rms(x, x_grad, _needs(m.weight), dims, x.element_size(), x.element_size(), _stat_size(x))


_STYLES: dict[type, str | None] = {}


def _hf_rms_style(m) -> str | None:
    """The casting style slimgrad's converter recognised in this RMSNorm class's forward source (cached)."""
    kind = _stock(type(m))
    if kind not in _STYLES:
        try:
            from .integrations import hf_norms
        except ImportError:  # transformers missing
            return None
        _STYLES[kind] = hf_norms._style_of(kind)
    return _STYLES[kind]


def _hf_rms_norm(m, x, y, x_grad):
    style = _hf_rms_style(m)
    if style is None:
        return None
    w = getattr(m, "weight", None)
    xhat = {"llama": x.element_size(), "olmo2": 4, "gemma": 4,
            "t5": w.element_size() if w is not None and w.dtype in (torch.float16, torch.bfloat16) else 4}[style]
    compute = x.element_size() if style == "t5" else 4
    return _rms(x, x_grad, _needs(w), 1, compute, xhat, 4)


def _mask(m, x, y, x_grad):
    """ReLU, LeakyReLU, ReLU6, Hardtanh, Threshold, Hardsigmoid: dX = dY·[x in the linear range] (times a
    constant slope), one bit per element, an element-wise function of x (and of y: free when either is
    kept)."""
    if not x_grad:
        return []
    return [Need("mask", math.ceil(x.numel() / 8), derive=((x,), (y,)) if y is not None else ((x,),))]


def _reads_input(m, x, y, x_grad):
    """SiLU, GELU and the transformers GELUs: dX = dY·act'(x), which reads x (not recoverable from y)."""
    return [_keep(x)] if x_grad else []


def _reads_output(m, x, y, x_grad):
    """Tanh, Sigmoid: dX is a function of y (or of x)."""
    if not x_grad or y is None:
        return []
    return [Need("output", _nbytes(y), derive=((x,), (y,)))]


def _dropout(m, x, y, x_grad):
    active = x_grad and m.training and 0 < m.p < 1
    return [Need("seed", 8)] if active else []  # the mask, regenerated from a seed


def _max_pool(m, x, y, x_grad):
    if not x_grad:
        return []
    out = _first(y)
    window = math.prod(_tuple(m.kernel_size, x.dim() - 2 if x.dim() > 2 else 1))
    itemsize = 1 if window <= 256 else 2 if window <= 2**15 else 4
    return [Need("positions", out.numel() * itemsize)]  # argmax inside each window (a reduction)


def _embedding(m, x, y, x_grad):
    return [_keep(x, "indices")] if _needs(m.weight) else []


def _quantized_linear(m, x, y, x_grad):
    """bitsandbytes 4/8-bit linear: the quantized weight is frozen; dX reads only it."""
    return [_keep(x)] if _needs(getattr(m, "weight", None)) else []


# -- composite rules: a module whose children's work the rule accounts for as one unit -------------------


@dataclasses.dataclass
class _LinearLike:
    """What one projection of a composite (Linear, Conv1D, a convolution, LoRA over any of them, a quantized
    base) needs."""

    trainable: bool  # any parameter of it trains (so gradients flow back through its input's producer)
    input_need: Callable[[torch.Tensor], Need | None]  # what its dW / adapters' dA read of its input
    internal: Callable[[int, bool], list[Need]]  # (output positions, input needs grad) -> its own internals
    out_features: int


def _out_features(m: nn.Module) -> int:
    m = getattr(m, "base_layer", m)
    return (getattr(m, "out_features", None) or getattr(m, "out_channels", None)
            or m.weight.shape[-1])  # Conv1D keeps W as [in, out]


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: other libraries' linear layers: GPT-2's Conv1D (x @ W + b), Falcon's FalconLinear (x @ W.T, then + b)
_LINEAR_NAMES = ("transformers.pytorch_utils.Conv1D", "transformers.models.falcon.modeling_falcon.FalconLinear")


def _linear_like(m: nn.Module) -> _LinearLike | None:
    kind = _stock(type(m))
    name = _qualname(kind)
    if (kind is nn.Linear or kind in _CONVS or name in _LINEAR_NAMES or name.startswith("bitsandbytes.")):
        reads = _needs(getattr(m, "weight", None))
        return _LinearLike(any(p.requires_grad for p in m.parameters()),
                           lambda x: _keep(x) if reads else None, lambda positions, g: [], _out_features(m))
    if name.startswith("peft.tuners.lora.") and hasattr(m, "lora_A") and hasattr(m, "base_layer"):
        return _lora_like(m)
    return None


def _active_adapters(m) -> list[str] | None:
    if getattr(m, "merged", False) or getattr(m, "disable_adapters", False):
        return []
    if getattr(m, "lora_variant", None):
        return None  # DoRA and the other variants: no rule
    return [a for a in m.active_adapters if a in m.lora_A.keys()]


def _lora_like(m) -> _LinearLike | None:
    """A LoRA layer ``base(x) + B(A(dropout(x))) * s`` (linear or convolution): dW reads x; dA reads
    dropout(x) in A's dtype (x and a seed); dB reads A(dropout(x)), r values per output position; dX reads
    parameters and the dropout mask (a seed)."""
    base = _linear_like(m.base_layer)
    adapters = _active_adapters(m)
    if base is None or adapters is None:
        return None
    specs = []
    for name in adapters:
        a, b, drop = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
        if not (_stock(type(a)) is _stock(type(b)) and _stock(type(a)) in (nn.Linear, *_CONVS)):
            return None
        p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
        specs.append((a, b, p))
    trainable = base.trainable or any(p.requires_grad for a, b, _ in specs for p in (*a.parameters(),
                                                                                     *b.parameters()))

    def input_need(x):
        plain = base.input_need(x)
        if plain is not None:
            return plain
        sizes = [a.weight.element_size() for a, _, _ in specs if _needs(a.weight)]
        if not sizes:
            return None
        if max(sizes) >= x.element_size():  # an upcast of x is exact: x itself
            return _keep(x)
        return Need("input (adapter dtype)", x.numel() * max(sizes), derive=((x,),))

    def internal(positions, x_grad):
        needs = []
        for a, b, p in specs:
            if _needs(b.weight):
                needs.append(Need("A(x)", positions * a.weight.shape[0] * a.weight.element_size()))
            if 0 < p < 1 and (x_grad or _needs(a.weight)):
                needs.append(Need("seed", 8))
        return needs

    return _LinearLike(trainable, input_need, internal, base.out_features)


def _positions(y: torch.Tensor | None, x: torch.Tensor, out_features: int, conv: bool) -> int:
    """Output positions (rows of a linear layer, N·spatial of a convolution)."""
    if y is not None:
        return y.numel() // max(1, out_features)
    return _rows(x, 1) if not conv else x.numel() // max(1, x.shape[1])


def _lora(m, x, y, x_grad):
    spec = _lora_like(m)
    if spec is None:
        return None
    need = spec.input_need(x)
    conv = _stock(type(m.base_layer)) in _CONVS
    return ([need] if need is not None else []) + spec.internal(_positions(y, x, spec.out_features, conv), x_grad)


def _gated_mlp(m, x, y, x_grad):
    """``down(act(gate(x)) * up(x))`` (or ``gate, up = gate_up(x).chunk(2)``): dGate reads gate and up, dUp
    reads gate (act(gate) is element-wise), down's dW reads the product, an element-wise function of gate and
    up (free when both are kept)."""
    from .integrations import hf_mlp

    layout = hf_mlp._MLP_LAYOUT.get(_stock(type(m)))
    if layout is None:
        return None
    fused = layout[0] == "fused"
    *ins, down_proj = [getattr(m, name) for name in layout[2]]
    specs = [_linear_like(p) for p in [*ins, down_proj]]
    if any(s is None for s in specs):
        return None
    *in_specs, down = specs
    gate_spec, up_spec = (in_specs[0], in_specs[0]) if fused else in_specs
    width = specs[0].out_features // (2 if fused else 1)
    inner = torch.empty((), dtype=x.dtype).expand(*x.shape[:-1], width)  # shape and dtype of gate, up, product
    need_gate = x_grad or gate_spec.trainable  # dGate reads gate and up
    need_up = x_grad or up_spec.trainable  # dUp reads gate
    keep_gate, keep_up = need_gate or need_up, need_gate
    needs = []
    x_need = next((n for n in (s.input_need(x) for s in in_specs) if n is not None), None)
    if x_need is not None:
        needs.append(x_need)
    for s in in_specs:
        needs += s.internal(_rows(x, 1), x_grad)
    needs += [Need("gate", _nbytes(inner))] if keep_gate else []
    needs += [Need("up", _nbytes(inner))] if keep_up else []
    product = down.input_need(inner)
    if product is not None and not (keep_gate and keep_up):
        needs.append(Need("product", product.nbytes))
    needs += down.internal(_rows(x, 1), keep_gate)
    return needs


def _moe_experts(m, x, y, x_grad):
    """transformers 5's MoE experts with the default gate (``act_fn(gate) * up`` in ``_apply_gate``), called on
    the flattened hidden states (N, H) of which each row goes to ``num_experts_per_tok`` experts: S = N * k routed
    pairs. Per pair, as a gated MLP: dGate reads gate and up, dUp reads gate (when x or the first projection needs
    a gradient); the second projection's dW reads the product (free when gate and up are kept); the first's reads
    the routed x (the module's input, kept once). The routing weights' gradient reads each pair's expert output
    (S, H): counted whenever x needs a gradient, since the routing weights are a function of x in every MoE block
    (the rule sees the hidden states only). Index bookkeeping (the routing's sort and offsets) is not counted."""
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    k = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or not k or x.dim() != 2:
        return None
    width = gate_up.shape[-1 if getattr(m, "is_transposed", False) else -2] // 2
    pairs = x.shape[0] * k
    inner = pairs * width * x.element_size()
    keep = x_grad or gate_up.requires_grad
    needs = [_keep(x)] if gate_up.requires_grad else []
    needs += [Need("gate", inner), Need("up", inner)] if keep else []
    if down.requires_grad and not keep:
        needs.append(Need("product", inner))
    if x_grad:
        needs.append(Need("expert outputs (routing weights' gradient)", pairs * x.shape[-1] * x.element_size()))
    return needs


def _projected_activation(m, x, y, x_grad):
    """diffusers' GEGLU / SwiGLU (``h, g = proj(x).chunk(2); h * act(g)``) and ApproximateGELU
    (``p = proj(x); p * sigmoid(1.702 p)``): the backward of the element-wise part reads the projection's
    output (both halves), needed when anything before it needs a gradient; the projection's own dW reads x."""
    spec = _linear_like(m.proj)
    if spec is None:
        return None
    out = torch.empty((), dtype=x.dtype).expand(*x.shape[:-1], _out_features(m.proj))
    need = spec.input_need(x)
    needs = ([need] if need is not None else []) + spec.internal(_rows(x, 1), x_grad)
    if x_grad or spec.trainable:
        needs.append(Need("projection", _nbytes(out)))
    return needs


# -- lookup -------------------------------------------------------------------------------------------------

_RULES: dict[type, Callable] = {
    **dict.fromkeys((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                     nn.Linear), _weight_reads_input),
    **dict.fromkeys((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm), _batch_norm),
    **dict.fromkeys((nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.Threshold, nn.Hardsigmoid), _mask),
    **dict.fromkeys((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), _dropout),
    **dict.fromkeys((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), _max_pool),
    **dict.fromkeys((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                     nn.AdaptiveAvgPool3d, nn.Identity, nn.Flatten, nn.Unflatten), _nothing),
    **dict.fromkeys((nn.SiLU, nn.GELU, nn.Mish, nn.Hardswish), _reads_input),
    **dict.fromkeys((nn.Tanh, nn.Sigmoid), _reads_output),
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
    nn.RMSNorm: _torch_rms_norm,
    nn.Embedding: _embedding,
}

#: rules for other libraries' classes, by qualified name (so the libraries need not be imported here)
_NAMED_RULES: dict[str, Callable] = {
    "transformers.pytorch_utils.Conv1D": _weight_reads_input,
    "transformers.models.falcon.modeling_falcon.FalconLinear": _weight_reads_input,
    "transformers.activations.GELUActivation": _reads_input,
    "transformers.activations.GELUTanh": _reads_input,
    "transformers.activations.NewGELUActivation": _reads_input,
    "transformers.activations.QuickGELUActivation": _reads_input,
    "transformers.activations.SiLUActivation": _reads_input,
    "transformers.models.convnext.modeling_convnext.ConvNextLayerNorm": _layer_norm,
    "peft.tuners.lora.layer.Linear": _lora,
    "peft.tuners.lora.layer.Conv1d": _lora,
    "peft.tuners.lora.layer.Conv2d": _lora,
    "peft.tuners.lora.layer.Conv3d": _lora,
    "diffusers.models.activations.GEGLU": _projected_activation,
    "diffusers.models.activations.SwiGLU": _projected_activation,
    "diffusers.models.activations.ApproximateGELU": _projected_activation,
    "peft.tuners.lora.bnb.Linear4bit": _lora,
    "peft.tuners.lora.bnb.Linear8bitLt": _lora,
    "bitsandbytes.nn.modules.Linear4bit": _quantized_linear,
    "bitsandbytes.nn.modules.LinearFP4": _quantized_linear,
    "bitsandbytes.nn.modules.LinearNF4": _quantized_linear,
    "bitsandbytes.nn.modules.Linear8bitLt": _quantized_linear,
}


def _stock(kind: type) -> type:
    return ORIGINALS.get(kind, kind)


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def rule_for(module: nn.Module) -> Callable | None:
    """The rule for ``module``'s exact type (slimgrad's replacements use their stock type's rule), or None.

    Subclasses get their base's rule only when they do not override ``forward``: a subclass may compute
    something else. Hugging Face RMSNorms and gated MLPs are recognised as slimgrad's converter recognises
    them (by the source of their forward), so exactly the classes slimgrad converts have rules.
    """
    kind = _stock(type(module))
    rule = _RULES.get(kind) or _NAMED_RULES.get(_qualname(kind))
    if rule is _lora:
        return rule if _lora_like(module) is not None else None
    if rule is _projected_activation:
        proj = getattr(module, "proj", None)
        return rule if isinstance(proj, nn.Module) and _linear_like(proj) is not None else None
    if rule is not None:
        return rule
    replacement = REPLACEMENTS.get(kind)
    if replacement is not None and replacement.__module__ == "slimgrad.integrations.hf_layer_norm_2d":
        return _layer_norm  # channels-first LayerNorms, recognised by slimgrad's converter by their source
    for base in kind.__mro__[1:]:
        base_rule = _RULES.get(base)
        if base_rule is not None:
            return base_rule if kind.forward is base.forward else None
    if _qualname(kind).startswith("transformers.models."):
        # (T5's norm under other names, MT5LayerNorm, ...: where the forward matches, as the converter's hf_norms)
        if ("RMSNorm" in kind.__name__ or kind.__name__.endswith("LayerNorm")) and _hf_rms_style(module) is not None:
            return _hf_rms_norm
        try:
            from .integrations import hf_mlp
        except ImportError:
            return None
        replacement = REPLACEMENTS.get(kind)
        if replacement is not None and replacement.__module__ == "slimgrad.integrations.hf_moe":
            return _moe_experts  # experts with transformers' default gate, as slimgrad's converter registers them
        layout = hf_mlp._MLP_LAYOUT.get(kind)
        if layout is not None:
            children = [getattr(module, n, None) for n in layout[2]]
            if all(isinstance(c, nn.Module) and _linear_like(c) is not None for c in children):
                return _gated_mlp
    return None


def minimum_needs(module: nn.Module, inputs: tuple, output) -> list[Need] | None:
    """What one call of ``module`` (``inputs`` positional, ``output`` returned) must keep for the gradients
    requested of it, or None when the module has no rule (an unknown type, or a composite whose parts are
    of unknown types)."""
    rule = rule_for(module)
    x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
    if rule is None or x is None:
        return None
    return rule(module, x, _first(output), x.requires_grad)


def minimum_bytes(module: nn.Module, inputs: tuple, output) -> int | None:
    """Bytes one call of ``module`` needs kept when nothing else in the model keeps any of its tensors, or
    None for a module without a rule."""
    needs = minimum_needs(module, inputs, output)
    return None if needs is None else sum(n.nbytes for n in needs)
