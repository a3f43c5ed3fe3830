"""peft's ``lora.Linear`` routed through :func:`slimgrad.functional.lora.lora_linear`.

The replacement reads the base layer's and the adapters' parameters and calls one autograd Function,
instead of calling ``base_layer``, ``lora_dropout``, ``lora_A`` and ``lora_B`` as modules. Everything PEFT
does differently from plain LoRA goes through PEFT's own forward, unchanged: merged or disabled adapters
(base only, and PEFT's unmerge side effect), the ``adapter_names=`` mixed batch, extra forward arguments,
and anything the Function would not reproduce bit for bit (hooks on the submodules, which a direct
parameter read would skip; adapters of mixed dtypes; dropout under autocast, where PEFT drops in the
adapters' dtype before autocast rounds). LoRA variants (DoRA and the others) and base layers other than
``nn.Linear`` / GPT-2's ``Conv1D`` / Falcon's bias-less ``FalconLinear`` are left unconverted and reported.

The replacement re-implements the plain-LoRA branch of peft's ``Linear.forward`` (and, for GPT-2's
``Conv1D`` base, that layer's forward), so it is registered only when those functions are versions slimgrad
has read (:data:`KNOWN`, by :mod:`slimgrad.integrations._fingerprint`), and re-checked at every convert:
an unknown version leaves every LoRA layer to peft, recorded as a gap (family "LoRA layer") that
``convert`` warns about; different numbers are never an outcome.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from transformers.pytorch_utils import Conv1D

from slimgrad import _notices, csrc
from slimgrad._registry import ORIGINALS, register_forward
from slimgrad.functional import _common
from slimgrad.functional._common import autocast_enabled, foreign_input, note_input_kept, own_matmul_subclass
from slimgrad.functional.dropout import POLICIES, POLICY_ATTRIBUTE, module_policy
from slimgrad.functional.lora import (
    LoraAdapter,
    LoraLinearFunction,
    _base_forward,
    adapters_apart,
    core_seeded,
    lora_linear,
    peft_graph_keeps_as_little,
)
from slimgrad.integrations._fingerprint import Verified, unknown_reason
from slimgrad.integrations._hooks import global_module_hooks, module_hooks

__all__ = ["KNOWN", "SlimLinear"]

#: function -> {fingerprint: versions it was read in}; peft 0.17 differs from 0.18 only in the LoRA-variant
#: and ``adapter_names`` branches, which run peft's own forward here.
KNOWN = {
    "lora.Linear.forward": {"4c9996dfc57f4775": "peft 0.17.0-0.17.1", "039d4360386e2022": "peft 0.18.0-0.21.2"},
    "BaseTunerLayer._cast_input_dtype": {"205581c1e8c84685": "peft 0.17.0-0.21.2"},
    "Conv1D.forward": {"0570fe82cfe0b593": "transformers 5.23.0-5.24.0"},
    "FalconLinear.forward": {"d4c23694133f449b": "transformers 4.57.6-5.24.0"},
}
_PLAIN = _common.PLAIN_TYPES
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHECK = Verified({"lora.Linear.forward": (LoraLinear, "forward"),
                   "BaseTunerLayer._cast_input_dtype": (LoraLinear, "_cast_input_dtype")},
                  KNOWN, classes=(LoraLinear,), library="peft", family="LoRA layer")


def _conv1d_reason() -> str | None:
    """Why LoRA over GPT-2's ``Conv1D`` is left to peft (its forward, read as a weight, is not known)."""
    return unknown_reason({"Conv1D.forward": Conv1D.forward}, KNOWN)


_CONV1D_REASON = _conv1d_reason()
if _CONV1D_REASON is not None:
    _notices.record_class_gap(Conv1D, library="transformers", family="LoRA layer",
                              reason=_CONV1D_REASON + "; LoRA layers over it are left to peft")


def _stock_type(module: nn.Module) -> type:
    return ORIGINALS.get(type(module), type(module))


_FALCON_MODULE = "transformers.models.falcon.modeling_falcon"
_falcon_reasons: dict = {}  # FalconLinear.forward (the function object) -> why it is not read as F.linear, or None


def _is_falcon_linear(kind: type) -> bool:
    return kind.__name__ == "FalconLinear" and kind.__module__ == _FALCON_MODULE


def _falcon_reason(base: nn.Module) -> str | None:
    """Why a LoRA layer over Falcon's ``FalconLinear`` is left to peft, or None where its forward is F.linear's.

    ``FalconLinear`` computes ``input @ weight.T``, then adds the bias. Without a bias that is what
    ``F.linear(x, weight)`` runs (aten's linear is ``matmul(input, weight.t())`` when there is no bias): the same
    numbers on every device and dtype. With a bias, ``F.linear`` adds it inside the product (addmm), which rounds
    differently in bf16/fp16, so those layers stay peft's. The forward is checked against the versions read
    (:data:`KNOWN`), again whenever the function object changes (patched)."""
    forward = type(base).forward
    if forward not in _falcon_reasons:
        _falcon_reasons[forward] = unknown_reason({"FalconLinear.forward": forward}, KNOWN)
    reason = _falcon_reasons[forward]
    if reason is not None:
        return reason + "; LoRA layers over it are left to peft"
    if base.bias is not None:
        return ("base layer is FalconLinear with a bias, which it adds after the product (x @ W.T + b): F.linear "
                "would round it differently in bf16/fp16, so the layer is left to peft")
    return None


def _has_hooks(module: nn.Module) -> bool:
    """Hooks the fused forward would skip on ``module``: its forward and backward hooks, accelerate's ``_hf_hook``
    (global module hooks: checked once a call, in the forwards); said once a process where found (the checked path's
    check: the fast path's ``_hooked`` hands over to it)."""
    if not (module_hooks(module) or getattr(module, "_hf_hook", None) is not None):
        return False
    _notices.notify(_HOOKED, stacklevel=5)
    return True


_HOOKED = ("slimgrad: a peft LoRA layer's base layer or adapter carries hooks (a forward or backward hook, "
           "accelerate's offload hook): such a layer runs peft's own forward, so that they fire (peft's memory for it)")


def _unsupported(module: LoraLinear) -> str | None:
    return _CHECK.reason() or _unsupported_layer(module)


def _unsupported_layer(module: LoraLinear) -> str | None:
    base = module.base_layer
    if _is_falcon_linear(_stock_type(base)):
        reason = _falcon_reason(base)
        if reason is not None:
            return reason
    elif _stock_type(base) not in (nn.Linear, Conv1D):
        return f"base layer is {type(base).__name__}, not nn.Linear, transformers' Conv1D or a bias-less FalconLinear"
    if _stock_type(base) is Conv1D and _CONV1D_REASON is not None:
        return _CONV1D_REASON
    if (_stock_type(base) is Conv1D) != bool(module.fan_in_fan_out):
        return "fan_in_fan_out does not match the base layer's weight layout"
    weight = base._parameters.get("weight")
    if own_matmul_subclass(weight):  # (checked each call too: a model quantized after convert)
        return (f"base layer's weight is a {type(weight).__name__}, a tensor subclass with matmuls of its own (a "
                f"quantized weight, e.g. torchao's), which slimgrad's LoRA backward cannot multiply by: PEFT's own "
                f"forward runs")
    return variant_reason(module)


def variant_reason(module: nn.Module) -> str | None:
    """Why a LoRA layer with LoRA-variant adapters (DoRA, ...) is left to peft, or None: their forward is peft's
    own (this module's layers and the bitsandbytes wrappers alike)."""
    variants = getattr(module, "lora_variant", None)
    if not variants:
        return None
    names = ", ".join(f"{k}: {type(v).__name__}" for k, v in variants.items())
    return f"LoRA variant adapters ({names}) run PEFT's own forward"


def _dropout_p(module: nn.Module) -> float | None:
    """The dropout probability PEFT's dropout module would apply now, or None for a module we don't know."""
    kind = _stock_type(module)
    if kind is nn.Identity:
        return 0.0
    if kind is nn.Dropout and not module.inplace:
        return module.p if module.training else 0.0
    return None


def _adapters(self: LoraLinear, x: torch.Tensor):
    """The active adapters as LoraAdapter tuples, or None where PEFT's forward must run instead."""
    adapters = []
    for name in self.active_adapters:
        if name not in self.lora_A.keys():
            continue
        if name in self.lora_variant:
            return None
        lora_a, lora_b, drop = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if _stock_type(lora_a) is not nn.Linear or _stock_type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return None
        if _has_hooks(lora_a) or _has_hooks(lora_b) or _has_hooks(drop):
            return None
        p = _dropout_p(drop)
        if p is None or (p > 0 and autocast_enabled(x.device.type)):
            return None
        adapters.append(LoraAdapter(lora_a.weight, lora_b.weight, self.scaling[name], p, lora_b.bias))
    dtypes = {t.dtype for a in adapters for t in (a.A, a.B)}
    if len(dtypes) > 1:
        return None
    return adapters


def _hooked(module: nn.Module) -> bool:
    """_has_hooks without nn.Module.__getattr__'s miss for ``_hf_hook`` (accelerate sets it as a plain attribute)."""
    return module_hooks(module) or "_hf_hook" in module.__dict__


def _active_plain_adapters(d: dict, layer_type: type):
    """The active adapters of a peft LoRA layer read straight from its ``__dict__`` and its submodules'
    ``_modules``/``_parameters`` (peft's properties and nn.Module.__getattr__ cost ~10 us a layer more), for the fast
    forwards (LoRA linear, LoRA conv, bitsandbytes' LoRA layers): ``(a, b, A, B, B's bias, scaling, p)`` each, or
    None where one is not plain — A or B not a stock ``layer_type``, a bias on A, a hook on A, B or the dropout, a
    dropout slimgrad does not reproduce, tensor-subclass weights, or adapters of different dtypes (the checked path
    decides then)."""
    active = d.get("_active_adapter")
    if active is None:
        return None
    modules = d["_modules"]
    lora_a, lora_b, drops = modules["lora_A"]._modules, modules["lora_B"]._modules, modules["lora_dropout"]._modules
    scaling = d["scaling"]
    adapters, dtype = [], None
    for name in (active,) if isinstance(active, str) else active:
        a = lora_a.get(name)
        if a is None:
            continue
        b, drop = lora_b[name], drops[name]
        if (_stock_type(a) is not layer_type or _stock_type(b) is not layer_type
                or a._parameters.get("bias") is not None):
            return None
        if _hooked(a) or _hooked(b) or _hooked(drop):
            return None
        p = _dropout_p(drop)
        # (.get: a module parametrized after convert has no "weight" parameter: the checked path, or peft's, runs)
        A, B = a._parameters.get("weight"), b._parameters.get("weight")
        if p is None or type(A) not in _PLAIN or type(B) not in _PLAIN:
            return None
        dtype = A.dtype if dtype is None else dtype
        if A.dtype != dtype or B.dtype != dtype:
            return None
        adapters.append((a, b, A, B, b._parameters.get("bias"), float(scaling[name]), float(p)))
    return adapters


def _fast_forward(self: LoraLinear, x: torch.Tensor):
    """An eager plain-LoRA forward after the checks of the path below, read straight from the module's
    ``__dict__`` and its submodules' ``_modules``/``_parameters`` (nn.Module.__getattr__ cost ~5 us a call on the
    Python path, CUDA's with dropout), or None where anything is unusual (the checked path decides then). Whether
    the base layer is supported is cached in the module's ``__dict__`` per base layer type.

    Then, as ``lora_linear`` would: stock's ops where no adapter drops and none casts x; the compiled core (one C++
    autograd Function, :mod:`slimgrad.functional.lora`) for an eager CPU call, or a CUDA one whose adapters do not
    drop (the core's dropout is CPU loops); else the Python Function through torch's C apply (CUDA's "seed"
    policy, a core that is off), with ``lora_linear``'s argument checks."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or autocast_enabled("cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type)):  # (device.type: ~1 us)
        return None
    d = self.__dict__
    if d.get("_disable_adapters") or d.get("merged_adapters") or d.get("lora_variant") or not _CHECK.still_known():
        return None
    modules = d["_modules"]
    base = modules["base_layer"]
    plan = d.get("_slimgrad_core_plan")
    if plan is None or plan[0] is not type(base):
        falcon = _is_falcon_linear(_stock_type(base))
        plan = d["_slimgrad_core_plan"] = (type(base), _unsupported_layer(self) is None, _stock_type(base) is Conv1D,
                                           type(base).forward if falcon else None)
    if not plan[1] or _hooked(base):
        return None
    weight, bias = base._parameters.get("weight"), base._parameters.get("bias")
    if plan[3] is not None and (bias is not None or type(base).forward is not plan[3]):
        return None  # a FalconLinear given a bias, or its forward patched, since: _forward checks it again
    device = x.device
    if type(weight) not in _PLAIN or weight.device != device or weight.dtype not in _FLOATS:
        return None
    found = _active_plain_adapters(d, nn.Linear)
    if found is None:
        return None
    tensors, scalings, ps, adapters = [x, weight, bias], [], [], []
    dtype = found[0][2].dtype if found else None
    for _, _, A, B, bb, s, p in found:
        if A.device != device or B.device != device:
            return None
        tensors += [A, B, bb]
        scalings.append(s)
        ps.append(p)
        adapters.append((A, B, bb))
    cast = d.get("cast_input_dtype_enabled", True)
    policy = d.get(POLICY_ATTRIBUTE)
    core = csrc.for_eager(x, cuda=True)
    seeded = core_seeded(x, ps, policy)
    if core is None or seeded is None:
        # The Python Function's route (lora_linear's): its argument checks first, where it would raise
        if (weight.dim() != 2 or (policy is not None and policy not in POLICIES)
                or any(A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0] for A, B, _ in adapters)
                or not all(0.0 <= p <= 1.0 for p in ps)):
            return None
        core = None
    if not any(p > 0 for p in ps) and not (cast and adapters and x.dtype != dtype):
        # no dropout, no cast: stock's ops (what stock keeps is what we would keep), as lora_linear runs them
        if torch.is_grad_enabled() and (weight.requires_grad or any(A.requires_grad for A, _, _ in adapters)):
            note_input_kept(x)
        result = _base_forward(x, weight, bias, plan[2])
        for (A, B, bb), s in zip(adapters, scalings):
            result = result + F.linear(F.linear(x, A), B, bb) * s
        return result
    if len(adapters) > 1 and adapters_apart(x, len(adapters), ps, cast, dtype, policy):
        return None  # one Function per adapter, as lora_linear runs them (adapters_apart says why)
    if core is None:
        # _common.Function.apply's eager branch called directly (torch's C apply, tensors unwrapped as its
        # unwrap_dead_wrappers does), without its generic argument handling (~2 us a call for LoRA's arguments)
        x = _unwrap_if_dead(x)  # (then once more, for the base layer's part of dX: LoraLinearFunction.backward)
        return _C_APPLY(LoraLinearFunction, x, *[t if t is None else _unwrap_if_dead(t) for t in tensors[1:3]],
                        plan[2], bool(cast), tuple(scalings), tuple(ps), policy,
                        *[t if t is None else _unwrap_if_dead(t) for t in tensors[3:]], x)[0]
    out, x_kept = core.lora_linear_apply(tensors, plan[2], bool(cast), scalings, ps, seeded)
    if x_kept:
        note_input_kept(x)
    return out


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead


def _peft_keeps_as_little(self: LoraLinear, x: torch.Tensor) -> bool:
    """Whether peft's own forward keeps no more than one Function would (functional.lora's
    peft_graph_keeps_as_little): x frozen and read by this layer alone, one dropping adapter, the base frozen. Read
    from the module's dicts, parameters of any tensor type: the estimate's fake ones take the real step's route."""
    d = self.__dict__
    active = d.get("_active_adapter")
    modules = d["_modules"]
    lora_a = modules["lora_A"]._modules
    names = [n for n in ((active,) if isinstance(active, str) else active or ()) if n in lora_a]
    if len(names) != 1:
        return False
    a, drop = lora_a[names[0]], modules["lora_dropout"]._modules[names[0]]
    p = _dropout_p(drop)
    A, weight = a._parameters.get("weight"), modules["base_layer"]._parameters.get("weight")
    return (p is not None and A is not None and weight is not None
            and peft_graph_keeps_as_little(d, x, weight, A, p, d.get("cast_input_dtype_enabled", True)))


def _forward(self: LoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's ``Linear.forward`` in one Function where it is plain LoRA; PEFT's own forward elsewhere (and wherever a
    global module hook would miss the submodules the Function does not call: integrations/_hooks.py)."""
    if global_module_hooks() or foreign_input(x):  # (a DTensor or NestedTensor input: peft's forward, subclass44)
        return LoraLinear.forward(self, x, *args, **kwargs)
    if not args and not kwargs and isinstance(x, torch.Tensor):
        # (any tensor type: the estimate's fake tensors must take the route the real step takes)
        if not x.requires_grad and _peft_keeps_as_little(self, x):
            return LoraLinear.forward(self, x)
        if type(x) is torch.Tensor and (out := _fast_forward(self, x)) is not None:
            return out
    base = self.base_layer
    adapters = None
    if (not args and not kwargs and not self.disable_adapters and not self.merged and isinstance(x, torch.Tensor)
            and not _has_hooks(base) and _CHECK.still_known() and _unsupported_layer(self) is None):
        adapters = _adapters(self, x)
    if adapters is None:
        return LoraLinear.forward(self, x, *args, **kwargs)
    return lora_linear(x, base.weight, base.bias, adapters, fan_in_fan_out=_stock_type(base) is Conv1D,
                       cast_input=getattr(self, "cast_input_dtype_enabled", True),
                       dropout_policy=module_policy(self))


if _CHECK.reason() is None:
    SlimLinear = register_forward(LoraLinear, _forward, module=__name__, unsupported_reason=_unsupported)
else:  # left to peft, recorded as a gap by the check
    __all__ = ["KNOWN"]


def refresh() -> None:
    """Re-check peft's functions (called by :func:`slimgrad.integrations.load_available` on every convert):
    one patched since import makes its layers gaps, left to peft."""
    _CHECK.reason()
