"""Dropout that keeps an 8-byte seed for backward instead of the mask.

Stock dropout on CPU computes ``noise = bernoulli(1 - p) / (1 - p)`` in the input's dtype and returns
``input * noise``; autograd then keeps ``noise``, a tensor as large as the input. Here the noise comes from
a private generator seeded with a value drawn from the input device's default generator, and backward
regenerates it from that seed. Because the seed is drawn from the default generator, ``torch.manual_seed``
makes runs reproducible, successive calls differ, and activation checkpointing (which restores the
default generators' state before recomputing) regenerates the very same mask.

The noise is made, scaled and applied with stock's own ops in stock's order (``bernoulli_``, ``div_``,
``mul``), so wherever our mask and stock's agree the outputs are bitwise equal, and the gradient
``grad * noise`` is bitwise the one stock computes for that noise. On CUDA stock dropout runs a fused
kernel (``x * mask * scale``); ours keeps the CPU formula there, equal up to the rounding of the scale in
reduced precision.

The mask must be the same whether or not a gradient is requested: reentrant checkpointing runs the
forward without grad and recomputes it with grad. So training-mode dropout always goes through the
seeded generator, never through stock's.

Under ``torch.compile`` a ``torch.Generator`` cannot be traced, so the compiled path draws the mask from
the default generator (Inductor's RNG) and keeps it as a bool tensor (1 byte per element; stock keeps the
noise in the input's dtype).
"""

from __future__ import annotations

import warnings

import torch

from slimgrad.functional import _common
from slimgrad.functional._common import check_tensor

__all__ = ["dropout", "dropout1d", "dropout2d", "dropout3d"]

_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."

# What backward was left: the seed, a bool mask (under torch.compile), or nothing (p == 1).
_SEED, _MASK, _ZERO = "seed", "mask", "zero"


def _noise_shape(input: torch.Tensor, feature: bool) -> tuple[int, ...]:
    """Stock's ``make_feature_noise``: one draw per (sample, channel) for feature dropout."""
    if not feature:
        return tuple(input.shape)
    if input.dim() < 2:
        raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
    return tuple(input.shape[:2]) + (1,) * (input.dim() - 2)


def _empty_noise(input: torch.Tensor, feature: bool) -> torch.Tensor:
    # stock: empty_like(input) (its layout) for elementwise noise, a contiguous tensor for feature noise
    if feature:
        return torch.empty(_noise_shape(input, True), dtype=input.dtype, device=input.device)
    return torch.empty_like(input)


def _draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed from ``device``'s default generator, as an int64 scalar tensor on that device."""
    return torch.empty((), dtype=torch.int64, device=device).random_()


def _fill_noise(noise: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator(device=noise.device)
    generator.manual_seed(int(seed.item()))
    noise.bernoulli_(1 - p, generator=generator)
    return noise.div_(1 - p)


def _apply_noise(input, noise, inplace):
    return input.mul_(noise) if inplace else input * noise


class _DropoutFunction(_common.Function):
    """Dropout (``feature=False``) and feature dropout for 0 < p <= 1 in training mode."""

    @staticmethod
    def forward(ctx, input, p, feature, inplace):
        ctx.p = p
        if p == 1:
            # stock multiplies by a zero scalar, drawing nothing
            ctx.mode = _ZERO
            out = _apply_noise(input, torch.zeros((), dtype=input.dtype, device=input.device), inplace)
        elif torch.compiler.is_compiling():
            ctx.mode = _MASK
            noise = _empty_noise(input, feature).bernoulli_(1 - p)
            ctx.save_for_backward(noise.to(torch.bool))
            out = _apply_noise(input, noise.div_(1 - p), inplace)
        else:
            ctx.mode = _SEED
            seed = _draw_seed(input.device)
            noise = _fill_noise(_empty_noise(input, feature), p, seed)
            ctx.noise_shape, ctx.noise_stride = tuple(noise.shape), noise.stride()
            ctx.save_for_backward(seed)
            out = _apply_noise(input, noise, inplace)
        if inplace:
            ctx.mark_dirty(input)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.mode == _ZERO:
            return grad * torch.zeros((), dtype=grad.dtype, device=grad.device), None, None, None
        (saved,) = ctx.saved_tensors
        if ctx.mode == _MASK:
            noise = saved.to(grad.dtype).div_(1 - ctx.p)
        else:
            noise = torch.empty_strided(
                ctx.noise_shape, ctx.noise_stride, dtype=grad.dtype, device=grad.device
            )
            noise = _fill_noise(noise, ctx.p, saved)
        return grad * noise, None, None, None


def _dropout_impl(input, p, training, inplace, feature):
    """Stock's ``_dropout_impl`` with the seeded noise: identity for p == 0, eval mode or empty input."""
    if p == 0 or not training or input.numel() == 0:
        return input  # stock returns the input itself here, before checking a feature input's rank
    if feature:
        _noise_shape(input, True)  # the rank check, before anything is drawn or modified
    if torch.is_grad_enabled() and input.requires_grad:
        if inplace and input.is_leaf:
            raise RuntimeError(_LEAF_INPLACE)
        return _DropoutFunction.apply(input, float(p), bool(feature), bool(inplace))
    # No gradient: the same noise all the same (checkpoint recomputes this call with grad).
    if p == 1:
        return _apply_noise(input, torch.zeros((), dtype=input.dtype, device=input.device), inplace)
    if torch.compiler.is_compiling():
        return _apply_noise(input, _empty_noise(input, feature).bernoulli_(1 - p).div_(1 - p), inplace)
    noise = _fill_noise(_empty_noise(input, feature), p, _draw_seed(input.device))
    return _apply_noise(input, noise, inplace)


def _check(input, p, fn):
    check_tensor(input, "input", fn=fn)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` keeping an 8-byte seed for backward instead of an input-sized mask."""
    _check(input, p, "dropout")
    return _dropout_impl(input, p, training, inplace, feature=False)


def dropout1d(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout1d`` keeping a seed instead of the mask; 2-D input is one unbatched sample."""
    _check(input, p, "dropout1d")
    inp_dim = input.dim()
    if inp_dim not in (2, 3):
        raise RuntimeError(
            f"dropout1d: Expected 2D or 3D input, but received a {inp_dim}D input. "
            "Note that dropout1d exists to provide channel-wise dropout on inputs with 1 "
            "spatial dimension, a channel dimension, and an optional batch dimension "
            "(i.e. 2D or 3D inputs)."
        )
    return _unbatched(input, p, training, inplace, batched=inp_dim == 3)


def dropout2d(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout2d`` keeping a seed instead of the mask. Like stock, a 3-D input is read as (N, C, L),
    with the same deprecation warnings."""
    _check(input, p, "dropout2d")
    inp_dim = input.dim()
    if inp_dim not in (3, 4):
        warnings.warn(
            f"dropout2d: Received a {inp_dim}-D input to dropout2d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout2d "
            "exists to provide channel-wise dropout on inputs with 2 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 3D or 4D inputs).",
            stacklevel=2,
        )
    if inp_dim == 3:
        warnings.warn(
            "dropout2d: Received a 3D input to dropout2d and assuming that channel-wise "
            "1D dropout behavior is desired - input is interpreted as shape (N, C, L), where C "
            "is the channel dim. This behavior will change in a future release to interpret the "
            "input as one without a batch dimension, i.e. shape (C, H, W). To maintain the 1D "
            "channel-wise dropout behavior, please switch to using dropout1d instead.",
            stacklevel=2,
        )
    return _dropout_impl(input, p, training, inplace, feature=True)


def dropout3d(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout3d`` keeping a seed instead of the mask; like stock, a non-5-D input is one unbatched
    sample (with a deprecation warning unless it is 4-D)."""
    _check(input, p, "dropout3d")
    inp_dim = input.dim()
    if inp_dim not in (4, 5):
        warnings.warn(
            f"dropout3d: Received a {inp_dim}-D input to dropout3d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior "
            "and silence this warning, please use dropout instead. Note that dropout3d "
            "exists to provide channel-wise dropout on inputs with 3 spatial dimensions, "
            "a channel dimension, and an optional batch dimension (i.e. 4D or 5D inputs).",
            stacklevel=2,
        )
    return _unbatched(input, p, training, inplace, batched=inp_dim == 5)


def _unbatched(input, p, training, inplace, batched):
    """Stock's handling of inputs without a batch dimension: add one, drop it again."""
    if not batched:
        input = input.unsqueeze_(0) if inplace else input.unsqueeze(0)
    result = _dropout_impl(input, p, training, inplace, feature=True)
    if not batched:
        result = result.squeeze_(0) if inplace else result.squeeze(0)
    return result

