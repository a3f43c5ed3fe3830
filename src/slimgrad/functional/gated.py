"""Gated activations ``act(gate) * up`` (SwiGLU, GeGLU) that keep only the two pre-activations.

Stock autograd keeps three tensors for ``act(gate) * up``: ``gate`` (for the activation's backward),
``act(gate)`` and ``up`` (for the product's backward). ``act(gate)`` is one cheap element-wise op away
from ``gate``, so here backward recomputes it and keeps at most ``gate`` and ``up``:

* dGate = act'(gate) * (dY * up) reads gate and up;
* dUp = dY * act(gate) reads gate only.

So both are kept when gate needs a gradient, gate alone when only up does, nothing otherwise.

Exactness: the forward runs the very ops of the reference formula (``F.silu``, ``F.gelu``, or the
Python expression of the Hugging Face activation), so outputs are bitwise equal. Backward runs the
formulas autograd runs for those ops, in autograd's order: aten's ``silu_backward`` / ``gelu_backward``
on the recomputed values for the fused kernels, and for the Python formulas (``gelu_new``,
``gelu_python``, ``quick_gelu``) the chain of per-op derivatives autograd uses, with the partial
gradients of the input summed in the order autograd's engine delivers them. Gradients are therefore
bitwise equal to stock as well (the tests check every dtype bitwise).

Kernels: on CUDA the registry's ``gated_activation`` family runs :mod:`slimgrad.kernels.triton.gated` (one
kernel forward, one backward recomputing the activation; same tensors kept; within the dtype's rounding of
stock). This torch code is the family's ``torch`` implementation and the fallback.

Compiled core (:mod:`slimgrad.csrc`, ``csrc/gated.cpp``): an eager call on CPU tensors runs one C++ autograd Function
instead of :class:`GatedFunction`, because on the small and mid-sized tensors of a LoRA step the Python Function's
per-call cost was a visible share of the layer's time. It is this module's torch code op for op (same aten ops,
order and dtypes, same tensors kept, same producer notes), so the bits and saved bytes are the Python path's (tested
in tests/test_core_gated.py). The core declines (returns None, and GatedFunction runs) under autocast,
torch.compile, torch.func, a TorchFunctionMode or a preferred Triton kernel, for tensor subclasses, CUDA tensors
(Triton's kernels run there), dtypes other than fp32/fp64/bf16/fp16, and anything :func:`_check` would reject.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic

from slimgrad import csrc
from slimgrad.functional import _common
from slimgrad.kernels import registry as _registry

__all__ = ["ACTIVATIONS", "GatedFunction", "activation_backward", "activation_forward", "gated_activation"]

_aten = torch.ops.aten

#: Activation names accepted by :func:`gated_activation`, as Hugging Face's ``ACT2FN`` keys name them:
#: silu (``nn.SiLU``, ``SiLUActivation``), gelu (exact erf GELU, ``F.gelu``), gelu_pytorch_tanh
#: (``F.gelu(approximate="tanh")``), gelu_new (``NewGELUActivation``'s Python tanh formula, also
#: ``GELUTanh(use_gelu_tanh_python=True)``), gelu_python (``GELUActivation(use_gelu_python=True)``'s erf
#: formula), quick_gelu (``QuickGELUActivation``).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_python", "quick_gelu")

# Constants exactly as transformers/activations.py computes them (math.sqrt(2.0 / math.pi), math.sqrt(2.0), and
# derivatives.yaml's erf factor 2.0 / sqrt(M_PI)), written as their literal Python floats: under
# ``torch.compile(dynamic=True)`` dynamo turns a ``math.sqrt`` result into a symbolic float, and two Functions
# using one stopped it with an internal error (lift_tracked_freevar_to_input); a literal stays a constant.

_common.register_torch_kernel("gated_activation")


def activation_forward(kind: str, x: torch.Tensor) -> torch.Tensor:
    """``act(x)`` with the reference's own ops, so the result is bitwise the reference's."""
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))
    if kind == "gelu_python":
        return x * 0.5 * (1.0 + torch.erf(x / 1.4142135623730951))
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")


def activation_backward(kind: str, grad: torch.Tensor, x: torch.Tensor, need_out: bool = False):
    """(dX, act(x) or None): the gradient autograd computes for ``activation_forward(kind, x)``, op for op.

    ``need_out`` also returns ``act(x)`` (for the gated product's dUp), reusing the recomputed
    intermediates where the formula has them.
    """
    if kind in ("silu", "gelu", "gelu_pytorch_tanh"):
        if kind == "silu":
            dx = _aten.silu_backward(grad, x)
        else:
            dx = _aten.gelu_backward(grad, x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")
        return dx, (activation_forward(kind, x) if need_out else None)
    # The formula activations below recompute the intermediates stock kept. Each temporary is made where it is
    # first needed and dropped after its last use, and fresh temporaries are updated in place (the same element-wise
    # op, so the same bits; ``1.0 + t`` as ``t + 1.0``, ``x + b`` as ``b + x``: IEEE addition and multiplication
    # commute): stock's engine frees each node's tensors as it goes, and an expression holding every intermediate
    # to its end peaked 1-3x the input above stock's step (csrc/gated.cpp's act_backward runs the same sequence).
    if kind == "gelu_new":
        # y = a * v, a = 0.5 x, v = 1 + tanh(c * (x + 0.044715 x^3)). Autograd's engine runs the node
        # created last first, so x receives d(x + b) first, then d(pow), then d(0.5 x).
        t = torch.tanh_(torch.pow(x, 3.0).mul_(0.044715).add_(x).mul_(0.7978845608028654))
        a = 0.5 * x
        ga = grad * a
        if not need_out:
            a = None
        gs = _aten.tanh_backward(ga, t).mul_(0.7978845608028654)
        del ga
        v = t.add_(1.0)
        del t
        hv = (grad * v).mul_(0.5)
        out = a * v if need_out else None
        del v, a
        dx = gs.add_((gs * 0.044715).mul_(x.pow(2.0).mul_(3.0)))  # gs + g_pow
        return dx.add_(hv), out
    if kind == "gelu_python":
        # y = a * v, a = x * 0.5, v = 1 + erf(d), d = x / sqrt(2): x receives d(d) first, then d(a).
        d = x / 1.4142135623730951
        v = torch.erf(d).add_(1.0)
        g_d = torch.exp_(d.pow(2).neg_()).mul_(1.1283791670955126)
        del d
        a = x * 0.5
        g_d.mul_(grad * a)
        if not need_out:
            a = None
        hv = (grad * v).mul_(0.5)
        out = a * v if need_out else None
        del v, a
        return g_d.div_(1.4142135623730951).add_(hv), out
    if kind == "quick_gelu":
        # y = x * s, s = sigmoid(1.702 x): x receives d(x * s) first, then d(1.702 x).
        s = torch.sigmoid_(1.702 * x)
        gx = grad * x
        d_s = _aten.sigmoid_backward.grad_input(gx, s, grad_input=gx).mul_(1.702)  # (element-wise: into gx)
        out = x * s if need_out else None
        return s.mul_(grad).add_(d_s), out  # grad * s + d_s
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")


_FUSED = ("silu", "gelu", "gelu_pytorch_tanh")  # one aten op each way (activation_backward recomputes act alone)


class GatedFunction(_common.Function):
    """``act(gate) * up`` keeping gate (and up) instead of gate, act(gate) and up.

    ``apply(gate, up, kind, impl)``: ``impl`` is the registry's kernel for the call (``gated_activation``: Triton
    on CUDA), chosen by the caller, or None for this module's torch code (always under torch.compile and
    torch.func, where vmap batches the torch code). Double backward is refused (``once_differentiable``):
    supporting it would need the recomputation to be differentiable, which is what stock does by keeping
    everything.
    """

    @staticmethod
    def forward(gate, up, kind, impl):
        if impl is not None:
            return impl.forward(gate, up, kind)
        return activation_forward(kind, gate) * up

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate, up, kind, impl = inputs
        need_gate, need_up = ctx.needs_input_grad[:2]
        ctx.kind, ctx.impl = kind, impl
        ctx.mask = (need_gate, need_up)
        ctx.wide = gate.dtype
        ctx.save_for_backward(_common.kept_input(gate) if (need_gate or need_up) else None,
                              _common.kept_input(up) if need_gate else None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors  # (narrower where kept_input chose so: widened where read)
        gate = gate.to(ctx.wide) if gate is not None else None
        need_gate, need_up = ctx.mask
        if ctx.impl is not None:
            up = up.to(ctx.wide) if up is not None else None
            d_gate, d_up = ctx.impl.backward(grad_out, gate, up, ctx.kind, need_gate, need_up)
            return d_gate, d_up, None, None
        d_gate = d_up = None
        if need_gate:
            # Stock: d(act) = dY * up (mul's backward), then the activation's backward on it.
            # For aten's activations act(gate) is made after d(act) is freed, and a widened gate freed before
            # dUp: one gate-sized tensor fewer at backward's peak (the formula GELUs reuse their intermediates).
            fused = ctx.kind in _FUSED
            d_act = grad_out * up.to(ctx.wide)
            del up  # (the last reference where checkpointing recomputed it; the compiled core frees it here too)
            d_gate, act = activation_backward(ctx.kind, d_act, gate, need_out=need_up and not fused)
            del d_act
            if need_up:
                if fused:
                    act = activation_forward(ctx.kind, gate)
                del gate
                d_up = grad_out * act
        elif need_up:
            d_up = grad_out * activation_forward(ctx.kind, gate)
        return d_gate, d_up, None, None

    @staticmethod
    def stock(gate, up, kind, impl):
        return activation_forward(kind, gate) * up

    @classmethod
    def under_transform(cls, gate, up, kind, impl):
        """The torch code (the registry's kernels cannot read functorch's wrapped tensors)."""
        return super().under_transform(gate, up, kind, None)


def _kernel(gate, kind):
    """The registry's kernel for this call, or None for the torch code (see :class:`GatedFunction`)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    impl = _common.fast_kernel("gated_activation", gate)
    return impl if impl is not None and impl.supports(gate, kind) else None


#: ACTIVATIONS' codes in the compiled core (``gated``'s ``kind``).
_KIND_CODE = {kind: i for i, kind in enumerate(ACTIVATIONS)}
_is_compiling = torch.compiler.is_compiling
_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def _core(gate):
    """The compiled core for an eager call on ``gate``, or None (see the module docstring): the core must be on,
    built and fit ``gate`` (``csrc.for_eager``: CPU only), no Triton kernel be preferred (the Triton tests run under
    the interpreter on CPU tensors, through GatedFunction) and no TorchFunctionMode be active."""
    if _is_compiling():
        return None  # before for_eager, which would load (build) the core inside the trace on a first call
    core = csrc.for_eager(gate)
    if core is None or _registry.get_preference() == _registry.TRITON or _torch_function_mode_enabled():
        return None
    return core


def _check(gate, up, activation):
    fn = "gated_activation"
    _common.check_tensor(gate, "gate", fn=fn)
    _common.check_tensor(up, "up", fn=fn)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: 'activation' must be one of {ACTIVATIONS}, got {activation!r}")
    if not gate.is_floating_point():
        raise TypeError(f"{fn}: 'gate' must be a floating-point tensor, got {gate.dtype}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"{fn}: 'up' must have gate's shape, dtype and device ({tuple(gate.shape)}, "
                         f"{gate.dtype}, {gate.device}), got ({tuple(up.shape)}, {up.dtype}, {up.device})")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` with the output and gradients of the stock expression, keeping for backward
    only ``gate`` (and ``up`` when gate needs a gradient). ``activation``: one of :data:`ACTIVATIONS`.

    ``gate`` and ``up`` must have the same shape, dtype and device (they are the two projections of one
    input in every gated MLP); broadcasting or type promotion would change what backward must keep.
    """
    if has_torch_function_variadic(gate, up):
        return handle_torch_function(gated_activation, (gate, up), gate, up, activation=activation)
    core = _core(gate)
    if core is not None and type(activation) is str and activation in _KIND_CODE:
        noted = _common._NARROWER  # (empty unless a bitsandbytes 4-bit layer ran: no lookups then)
        out = core.gated(gate, up, _KIND_CODE[activation], _common.note_input_kept if _common._PRODUCERS else None,
                         _common.exactly_narrower(gate) if noted else None,
                         _common.exactly_narrower(up) if noted else None)
        if out is not None:
            return out
    _check(gate, up, activation)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return GatedFunction.apply(gate, up, activation, None)  # the torch code (see _kernel)
    # Eager: _common.Function.apply's eager branch called directly (torch's C apply, the tensors unwrapped as its
    # unwrap_dead_wrappers does), without its generic argument handling: ~2 µs a call on the Python path (CUDA's).
    return _C_APPLY(GatedFunction, _unwrap_if_dead(gate), _unwrap_if_dead(up), activation, _kernel(gate, activation))


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead
