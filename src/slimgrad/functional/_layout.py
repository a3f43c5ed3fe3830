"""The memory layout stock's element-wise backward gives a gradient, and a cheap way to give ours the same.

Stock computes many input gradients with one element-wise aten kernel (``hardtanh_backward(grad, x)``,
``grad * noise``...). Such a kernel's output layout is chosen by TensorIterator from its operands' strides,
the first operand deciding and later ones only breaking ties. slimgrad computes the same values from a
packed mask in the mask's memory order, which is the input's layout; where the incoming gradient is laid
out otherwise (a contiguous gradient from a pool's backward into a channels_last activation), our
gradient had the input's layout and stock's the gradient's. Layout is not cosmetic: the layer before
then reduces in another order (an eval BatchNorm2d's bias gradient differs by ~1e-7).

:func:`binary_strides` replays TensorIterator's choice (``fast_set_up``, ``reorder_dimensions``,
``allocate_or_resize_outputs`` of aten's TensorIterator.cpp) in Python for two same-shape operands; the
tests check it against aten's kernels on random layouts (permuted, sliced, expanded, size-1 dims). Meta
tensors cannot stand in: their Python meta kernels choose differently in tie cases. :func:`conform` then
returns the tensor itself when its layout already agrees, a free restrided view when only the strides of
size-1 dimensions differ, and a copy only where the layouts truly differ.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["binary_strides", "like_strides", "conform", "channels_last_like"]


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _channels_last_strides(shape) -> tuple[int, ...]:
    # c10's get_channels_last_strides_2d (sizes N, C, H, W)
    c = 1
    w = shape[1]
    h = w * shape[3]
    n = h * shape[2]
    return (n, c, h, w)


def _is_contiguous(shape, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _is_channels_last(shape, strides) -> bool:
    # c10's is_channels_last_strides_2d_s4 as TensorImpl::is_contiguous(ChannelsLast) computes it
    if len(shape) != 4:
        return False
    expected = 1
    for d in (1, 3, 2, 0):
        size = shape[d]
        if size != 1:
            if strides[d] != expected:
                return False
            expected *= size
    return True


def _is_non_overlapping_and_dense(shape, strides) -> bool:
    if len(shape) == 1:
        return shape[0] < 2 or strides[0] == 1
    order = sorted(range(len(shape)), key=lambda d: (strides[d], shape[d]))
    expected = 1
    for d in order:
        if shape[d] == 1:
            continue
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def binary_strides(shape: tuple[int, ...], first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a new output TensorIterator allocates for a binary element-wise op whose inputs,
    in this order, have ``shape`` and these strides (same dtype). Cached in eager; traced (compiled
    autograd over an eager forward), computed directly, as dynamo would not trace the cache."""
    if torch.compiler.is_compiling():
        return _binary_strides(shape, first, second)
    return _cached_binary_strides(tuple(shape), tuple(first), tuple(second))


def _binary_strides(shape, first, second):
    shape, ops = tuple(shape), (tuple(first), tuple(second))
    ndim = len(shape)
    if ndim == 0 or any(s == 0 for s in shape):
        return _contiguous_strides(shape)
    # fast_set_up
    if all(_is_contiguous(shape, s) for s in ops):
        return _contiguous_strides(shape)
    if all(_is_channels_last(shape, s) for s in ops):
        return _channels_last_strides(shape)
    if all(_is_non_overlapping_and_dense(shape, s) for s in ops) and ops[0] == ops[1]:
        return ops[0]
    # reorder_dimensions: perm[0] is the fastest-moving dimension
    if ndim == 1:
        return (1,)
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0, d1):
        for s in ops:
            s0, s1 = s[d0], s[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    # allocate_or_resize_outputs
    if perm == list(range(ndim - 1, -1, -1)):
        return _contiguous_strides(shape)
    strides = [0] * ndim
    step = 1
    for d in perm:
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


_cached_binary_strides = functools.lru_cache(maxsize=1024)(_binary_strides)


def like_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``torch.empty_like(t)`` (and of ``t.clone()``): t's own when it is dense, else
    aten's dense strides in t's order (asked of a meta tensor: ``empty_like`` is one C++ function for all
    devices)."""
    if t.is_contiguous() or _is_non_overlapping_and_dense(tuple(t.shape), t.stride()):
        return tuple(t.stride())
    return tuple(torch.empty_like(t, device="meta").stride())


def conform(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t`` with these (dense) strides: itself if it has them, a view if only size-1 dimensions' strides
    differ (same memory order), else a copy."""
    if t.stride() == tuple(strides):
        return t
    if all(size == 1 or a == b for size, a, b in zip(t.shape, t.stride(), strides)):
        return t.as_strided(t.shape, strides)
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def channels_last_like(t: torch.Tensor) -> bool:
    """Whether ``Tensor::suggest_memory_format()`` calls ``t`` channels-last (2d or 3d): c10's
    ``is_channels_last_strides_2d/3d``, which read the strides' order (a slice of a channels-last tensor
    counts) and settle ambiguous size-1 cases for contiguous. ``_common.suggest_memory_format`` asks for a
    dense channels-last tensor instead, which differs on slices."""
    if t.dim() not in (4, 5):
        return False
    order = (1, 3, 2, 0) if t.dim() == 4 else (1, 4, 3, 2, 0)
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    smallest = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < smallest:
            return False
        if d == 0 and smallest == strides[1]:
            return False
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True
