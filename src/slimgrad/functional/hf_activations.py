"""Hugging Face's Python-formula activations, keeping only their input for backward.

transformers writes some activations as Python expressions (``NewGELUActivation``,
``GELUTanh(use_gelu_tanh_python=True)``, ``GELUActivation(use_gelu_python=True)``,
``QuickGELUActivation``). Stock autograd then keeps every intermediate the expression's ops save
(measured): ``gelu_new`` keeps ``x``, ``0.5 x``, ``tanh(.)`` and ``1 + tanh(.)`` (4x the input);
``gelu_python`` keeps ``x / sqrt(2)``, ``0.5 x`` and ``1 + erf(.)`` (3x); ``quick_gelu`` keeps ``x`` and
``sigmoid(1.702 x)`` (2x). Backward only needs ``x`` (1x):
here the forward runs the same expression (bitwise the same output) and backward recomputes the
intermediates and applies autograd's per-op derivatives in autograd's order (bitwise the same gradient;
see :mod:`slimgrad.functional.gated`).

The fused activations (``F.silu``, ``F.gelu``) already keep only their input in stock PyTorch, so
:func:`fused_activation` runs stock's op, except where the input's producer noted that its values are exactly
those of a narrower dtype (a bitsandbytes 4-bit layer's fp32 output in QLoRA, ``_common.kept_input``): there the
same Function keeps the input in that dtype, half the bytes, with the same bits out (its backward is aten's
``gelu_backward`` / ``silu_backward`` on the input cast back). That is the activation of GPT-NeoX/Pythia's,
Falcon's and StarCoder2's MLPs when LoRA targets the attention only.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from slimgrad.functional import _common
from slimgrad.functional.gated import activation_backward, activation_forward

__all__ = ["FORMULA_ACTIVATIONS", "FormulaActivationFunction", "fused_activation", "gelu_new", "gelu_python",
           "quick_gelu"]

#: The Python-formula activations this module wraps (names as transformers' ``ACT2FN`` keys).
FORMULA_ACTIVATIONS = ("gelu_new", "gelu_python", "quick_gelu")


class FormulaActivationFunction(_common.Function):
    """One of :data:`FORMULA_ACTIVATIONS`, keeping its input (only when it needs a gradient; in the narrower dtype
    its producer noted it holds exactly, see ``_common.kept_input``).

    Double backward is refused (``once_differentiable``).
    """

    @staticmethod
    def forward(input, kind):
        return activation_forward(kind, input)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, kind = inputs
        ctx.kind, ctx.wide = kind, input.dtype
        if ctx.needs_input_grad[0]:
            # (in bf16 where its producer noted bf16 values: a 4-bit layer's fp32 output in QLoRA, _common)
            ctx.save_for_backward(_common.kept_input(input))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        dx, _ = activation_backward(ctx.kind, grad_out, x.to(ctx.wide))
        return dx, None

    @staticmethod
    def stock(input, kind):
        return activation_forward(kind, input)


def _apply(input: torch.Tensor, kind: str, public) -> torch.Tensor:
    if has_torch_function_unary(input):
        return handle_torch_function(public, (input,), input)
    _common.check_tensor(input, "input", fn=kind)
    if not input.is_floating_point():
        raise TypeError(f"{kind}: 'input' must be a floating-point tensor, got {input.dtype}")
    return FormulaActivationFunction.apply(input, kind)


def fused_activation(input: torch.Tensor, kind: str) -> torch.Tensor:
    """``F.silu`` / ``F.gelu`` (``kind``: "silu", "gelu", "gelu_pytorch_tanh"): stock's op, which keeps only the
    input; through :class:`FormulaActivationFunction` where that input is noted as holding narrower values
    exactly and needs a gradient, so the input is kept in the narrower dtype. The lookup is skipped while no
    producer noted anything (``_common._NARROWER`` empty: every model without bitsandbytes layers)."""
    if (not torch.compiler.is_compiling() and _common._NARROWER and torch.is_grad_enabled()
            and isinstance(input, torch.Tensor) and input.requires_grad and not has_torch_function_unary(input)
            and _common.exactly_narrower(input) is not None):
        return FormulaActivationFunction.apply(input, kind)
    return activation_forward(kind, input)


def gelu_new(input: torch.Tensor) -> torch.Tensor:
    """``NewGELUActivation`` (``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``): same output and
    gradient, keeping only ``input``."""
    return _apply(input, "gelu_new", gelu_new)


def gelu_python(input: torch.Tensor) -> torch.Tensor:
    """``GELUActivation(use_gelu_python=True)`` (``x 0.5 (1 + erf(x / sqrt(2)))``): same output and
    gradient, keeping only ``input``."""
    return _apply(input, "gelu_python", gelu_python)


def quick_gelu(input: torch.Tensor) -> torch.Tensor:
    """``QuickGELUActivation`` (``x sigmoid(1.702 x)``): same output and gradient, keeping only
    ``input``."""
    return _apply(input, "quick_gelu", quick_gelu)
