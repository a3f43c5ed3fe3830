"""``dropout_seed`` in Triton (the contract is in :mod:`slimgrad.kernels.dropout`): the mask is Philox
(``tl.rand(seed, element index)``, counter-based), so backward regenerates it from the seed alone.

The seed is the int64 scalar tensor the Function drew on the device from the default CUDA generator; the
kernels load it from device memory: no ``.item()``, no host sync, no ``torch.Generator`` per call.
``torch.manual_seed`` fixes the drawn seed, and checkpointing (which restores the generator) draws it again,
so the same mask comes back. An element is kept when its uniform draw is ``>= p`` (probability ``1 - p``);
``out = x · (keep ? scale : 0)`` with stock's rounded scale, computed in fp32 and rounded once.

Element indices are 32-bit (Philox counters): tensors of 2**31 elements or more use the torch reference
(forward and backward alike, so the mask still matches).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from slimgrad.kernels.dropout import SEED_TORCH, noise_scale
from slimgrad.kernels.triton._jit import jit

__all__ = ["name", "backend", "forward", "backward", "keep_mask"]

name = backend = "triton"
_BLOCK = 1024
_MAX_NUMEL = 2**31 - _BLOCK


@jit
def _kernel(X, SEED, OUT, numel, p, scale, BLOCK: tl.constexpr, MASK_ONLY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    seed = tl.load(SEED)
    keep = tl.rand(seed, offs) >= p
    if MASK_ONLY:
        tl.store(OUT + offs, keep.to(tl.uint8), mask=mask)
    else:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        noise = tl.where(keep, scale, 0.0)
        tl.store(OUT + offs, (x * noise).to(OUT.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _scale(p: float, dtype: torch.dtype) -> float:
    return noise_scale(p, dtype)


def _launch(x, p, seed, out, mask_only=False):
    numel = x.numel()
    if numel:
        _kernel[(-(-numel // _BLOCK),)](x, seed, out, numel, float(p), _scale(float(p), x.dtype), BLOCK=_BLOCK,
                                        MASK_ONLY=mask_only)
    return out


def forward(x: torch.Tensor, p: float, seed: torch.Tensor, inplace: bool) -> torch.Tensor:
    if x.numel() >= _MAX_NUMEL:
        return SEED_TORCH.forward(x, p, seed, inplace)
    return _launch(x, p, seed, x if inplace else torch.empty_like(x))


def backward(grad: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    if grad.numel() >= _MAX_NUMEL:
        return SEED_TORCH.backward(grad, p, seed)
    return _launch(grad, p, seed, torch.empty_like(grad))


def keep_mask(like: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The uint8 keep mask (1 = kept) the kernels apply for ``seed`` (tests and diagnostics)."""
    return _launch(like, p, seed, torch.empty(like.shape, dtype=torch.uint8, device=like.device), mask_only=True)
