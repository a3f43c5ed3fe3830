"""Kernel family ``max_pool_positions``: max pooling that returns, with its output, the winner's position
inside each window (one small integer per output element) instead of stock's int64 flat indices, and the
backward that scatters the gradient from those positions.

Contract::

    impl.forward(x, kernel, stride, padding, dilation, ceil_mode) -> (out, positions)
    impl.backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode) -> grad_input

* ``x``: a **contiguous** floating tensor ``(*batch, *spatial)`` with ``nd = len(kernel)`` spatial dims
  (1, 2 or 3) and at least one leading dim (channels; batch optional, the leading dims are flattened).
  ``kernel``, ``stride``, ``padding``, ``dilation``: tuples of ``nd`` ints (stride already defaulted to
  kernel); ``ceil_mode``: bool. The Function has validated them the way stock does.
* ``out``: bitwise stock's ``max_poolNd`` output, contiguous. Stock's rule per window, scanned in
  row-major order over the window positions that fall inside the input: start from ``-inf`` with the
  first in-bounds position as the winner, and take an element when ``value > max or isnan(value)`` (so
  the first maximum wins ties, the *last* NaN wins, and an all ``-inf`` window reports its first
  in-bounds position); comparisons in fp32 for bf16/fp16.
* ``positions``: contiguous, ``out``'s shape, dtype
  :func:`position_dtype` ``(prod(kernel))`` (uint8 up to 256 window
  elements): the winner's index in row-major order over the *full* window (padding positions counted),
  ``sum_i k_i * prod(kernel[i+1:])`` for window offsets ``k_i``.
* ``grad_out``: contiguous, ``out``'s shape. ``grad_input``: a new contiguous tensor of ``x_shape``, zero
  except ``grad_input[winner] += grad_out[o]`` for every output ``o`` in row-major order per channel,
  accumulated in the dtype (so overlapping windows add up in stock's order: bitwise stock's
  ``max_poolNd_with_indices_backward``).

The compiled core (:mod:`slimgrad.csrc`, ``csrc/max_pool.cpp``) registers this family as backend ``core``
(priority 20, above numba's 10): 1-d, 2-d and 3-d, all four float dtypes, one parallel pass writing output and
positions, a parallel backward (per plane: zero, then scatter in stock's order). Calls it does not serve (stock
would raise) go to the torch reference, which raises stock's error.
"""

from __future__ import annotations

import math

import torch

from . import registry

__all__ = ["FAMILY", "CoreMaxPoolPositions", "TorchMaxPoolPositions", "choose", "output_size"]

FAMILY = "max_pool_positions"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)



# The family's torch reference pieces (also used by slimgrad.functional.pooling's Python Function).

aten = torch.ops.aten

_MAX_FORWARD = {
    1: torch.max_pool1d_with_indices,
    2: torch._C._nn.max_pool2d_with_indices,
    3: torch._C._nn.max_pool3d_with_indices,
}
# 1-d pooling is stock's 2-d kernel on x.unsqueeze(-2); its backward is the 2-d backward.
_MAX_BACKWARD = {2: aten.max_pool2d_with_indices_backward, 3: aten.max_pool3d_with_indices_backward}


def position_dtype(window_volume: int) -> torch.dtype:
    """Smallest integer dtype holding a position 0..window_volume-1 inside a pooling window."""
    if window_volume <= 256:
        return torch.uint8
    if window_volume <= 2**15:
        return torch.int16
    if window_volume <= 2**31:
        return torch.int32
    return torch.int64


def _window_starts(out_sizes, in_sizes, stride, padding, device, dtype):
    """Flat offset (within one channel's spatial block) of each output's window origin, and the flat
    strides of the spatial dims. The origin may lie in the padding, hence be negative."""
    nd = len(in_sizes)
    flat = [math.prod(in_sizes[i + 1:]) for i in range(nd)]
    base = None
    for i in range(nd):
        start = torch.arange(out_sizes[i], device=device, dtype=dtype).mul_(stride[i]).sub_(padding[i])
        start = start.mul_(flat[i]).reshape((-1,) + (1,) * (nd - 1 - i))
        base = start if base is None else base + start
    return base, flat


def _window_offsets(kernel, dilation, flat, device):
    """Flat offset from the window origin of each window position, in row-major kernel order."""
    offsets = torch.zeros((), dtype=torch.int64, device=device)
    for i in range(len(kernel)):
        step = torch.arange(kernel[i], device=device).mul_(dilation[i] * flat[i])
        offsets = offsets.unsqueeze(-1) + step
    return offsets.reshape(-1)


_MAX_TABLE = 1 << 22  # entries of the offset -> position table; beyond that, decode by division


def _positions_from_indices(indices, in_sizes, kernel, stride, padding, dilation, dtype, in_place,
                            vmappable=False):
    """Window-local position (row-major over the kernel) of each flat argmax index.

    ``vmappable``: look the table up by indexing instead of ``torch.take`` (which vmap has no batching rule
    for), as ``MaxPoolFunction`` does under torch.func.

    Large temporaries cost more than arithmetic here (each fresh big allocation is paid in page faults),
    so the common path allocates only the small result: the offset from the window origin is formed in
    place in ``indices`` when the caller does not return them, then mapped to a position by a table.
    """
    nd = len(in_sizes)
    out_sizes = indices.shape[-nd:]
    base, flat = _window_starts(out_sizes, in_sizes, stride, padding, indices.device, torch.int64)
    # Offsets from the window origin are unique per window position unless a window's extent exceeds
    # the input in some inner dim (tiny inputs), where two positions can share an offset.
    unique = all((kernel[i] - 1) * dilation[i] < in_sizes[i] for i in range(1, nd))
    extent = sum((kernel[i] - 1) * dilation[i] * flat[i] for i in range(nd)) + 1
    if unique and extent <= _MAX_TABLE:
        offsets = _window_offsets(kernel, dilation, flat, indices.device)
        table = torch.zeros(extent, dtype=dtype, device=indices.device)
        table[offsets] = torch.arange(offsets.numel(), device=indices.device).to(dtype)
        off = indices.sub_(base) if in_place else indices - base
        return table[off] if vmappable else torch.take(table, off)
    mult = [math.prod(kernel[i + 1:]) for i in range(nd)]
    pos = None
    for i in range(nd):
        coord = torch.div(indices, flat[i], rounding_mode="floor")
        if i > 0:
            coord = coord.remainder_(in_sizes[i])
        start = torch.arange(out_sizes[i], device=indices.device).mul_(stride[i]).sub_(padding[i])
        k = coord.sub_(start.reshape((-1,) + (1,) * (nd - 1 - i))).div_(dilation[i], rounding_mode="floor")
        pos = k.mul_(mult[i]) if pos is None else pos.add_(k, alpha=mult[i])
    return pos.to(dtype)


_TABLE_VOLUME = 2**16  # window volumes up to which indices are rebuilt by a table of window offsets


def _indices_from_positions(pos, in_sizes, kernel, stride, padding, dilation):
    """Stock's flat int64 argmax indices, rebuilt from window-local positions.

    index = origin + sum_i k_i * dilation_i * flat_i, with pos = sum_i k_i * mult_i. For windows of up to
    ``_TABLE_VOLUME`` positions the window offsets are a small int64 table, looked up by position (an int32 copy
    of narrower positions is the only temporary besides the int64 result). Larger windows extract the digits
    in the positions' dtype: dilation_last * pos removes the last digit's term, the others are added in.
    """
    nd = len(in_sizes)
    out_sizes = pos.shape[-nd:]
    base, flat = _window_starts(out_sizes, in_sizes, stride, padding, pos.device, torch.int64)
    volume = _prod(kernel)
    if volume <= _TABLE_VOLUME:
        offsets = _window_offsets(kernel, dilation, flat, pos.device)
        index = pos if pos.dtype in (torch.int32, torch.int64) else pos.to(torch.int32)
        idx = torch.index_select(offsets, 0, index.reshape(-1))
        del index
        return idx.view(pos.shape).add_(base)
    mult = [math.prod(kernel[i + 1:]) for i in range(nd)]
    idx = pos.to(torch.int64)
    if dilation[-1] != 1:
        idx.mul_(dilation[-1])
    for i in range(nd - 1):
        digit = torch.div(pos, mult[i], rounding_mode="floor")
        if i > 0:
            digit.remainder_(kernel[i])
        # in int64 (same dtype: aten adds a narrower tensor through a full int64 copy of it anyway)
        idx.add_(digit.to(torch.int64), alpha=dilation[i] * flat[i] - dilation[-1] * mult[i])
        del digit
    return idx.add_(base)


_CHUNKS = 4  # pieces the index rebuild of backward is split into (along the leading dims), when it can be


def scatter_backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode,
                     memory_format=torch.contiguous_format, chunked=True):
    """Stock's ``max_poolNd_with_indices_backward`` on the int64 indices rebuilt from ``positions``.

    ``chunked``: the planes (leading dims; for a channels-last layout, the batch) are handed to stock's kernel
    in up to ``_CHUNKS`` pieces, each with its own indices, written into slices of one gradient buffer: stock's
    kernel zeroes and fills each plane on its own, in the same order either way (bitwise the same gradient), and
    only a piece's int64 indices exist at a time. Stock keeps the full int64 indices through its backward, and
    the positions stay saved during ours, so whole indices would peak above stock's by the positions. Not under
    torch.func or tracing (out= variants), nor for a single plane (``chunked=False``, or nothing to split: then
    the indices are whole and the positions' bytes remain above stock's).

    ``memory_format``: the gradient's (stock's: the input's suggested format).
    """
    nd = len(kernel)
    in_sizes = tuple(x_shape)[-nd:]
    shape = tuple(x_shape)
    if nd == 1:  # stock's 2-d kernel on x.unsqueeze(-2); the positions' geometry stays 1-d
        shape = shape[:-1] + (1, shape[-1])
        grad_out, positions = grad_out.unsqueeze(-2), positions.unsqueeze(-2)
        kernel2, stride2, padding2, dilation2 = (1,) + kernel, (1,) + stride, (0,) + padding, (1,) + dilation
    else:
        kernel2, stride2, padding2, dilation2 = kernel, stride, padding, dilation
    op = _MAX_BACKWARD[max(nd, 2)]
    nd2 = max(nd, 2)
    lead = len(shape) - nd2
    channels_last = memory_format != torch.contiguous_format
    # the planes to split: the leading dims flattened (contiguous), or the batch (channels last)
    rows = shape[0] if channels_last else _prod(shape[:lead])
    pieces = min(_CHUNKS, rows) if chunked and not torch.compiler.is_compiling() else 1
    if channels_last and lead != 2:  # an unbatched input in a permuted layout: left whole
        pieces = 1
    if pieces <= 1:
        indices = _indices_from_positions(positions, in_sizes, kernel, stride, padding, dilation)
        if not channels_last:
            # backward reads only the input's shape: a one-element stand-in expanded to it
            standin = torch.empty((), dtype=grad_out.dtype, device=grad_out.device).expand(shape)
            grad = op.default(grad_out, standin, kernel2, stride2, padding2, dilation2, ceil_mode, indices)
        else:
            grad = _into_buffer(op, grad_out, indices, shape, memory_format, kernel2, stride2, padding2, dilation2,
                                ceil_mode)
        return grad.squeeze(-2) if nd == 1 else grad
    if not channels_last:
        grad_out = grad_out.reshape((rows,) + tuple(grad_out.shape[lead:]))
        positions = positions.reshape((rows,) + tuple(positions.shape[lead:]))
        grad = torch.empty((rows,) + shape[lead:], dtype=grad_out.dtype, device=grad_out.device)
    else:
        grad = torch.empty(shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=memory_format)
    step = -(-rows // pieces)
    for start in range(0, rows, step):
        piece = slice(start, min(start + step, rows))
        buf = grad[piece]
        indices = _indices_from_positions(positions[piece], in_sizes, kernel, stride, padding, dilation)
        # The kernels never read the input's values (they zero the buffer, then scatter) and pick their loop
        # from its suggested format: the buffer itself serves as the input.
        op.grad_input(grad_out[piece], buf, kernel2, stride2, padding2, dilation2, ceil_mode, indices,
                      grad_input=buf)
        del indices, buf
    if not channels_last:
        grad = grad.view(shape)
    return grad.squeeze(-2) if nd == 1 else grad


def _into_buffer(op, grad_out, indices, shape, memory_format, kernel, stride, padding, dilation, ceil_mode):
    """Stock's backward into a buffer of ``memory_format``: the kernels pick their channels-last or contiguous
    loop from the *input* argument's suggested format, and never read its values, so the buffer serves as it."""
    buffer = torch.empty(shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=memory_format)
    return op.grad_input(grad_out, buffer, kernel, stride, padding, dilation, ceil_mode, indices,
                         grad_input=buffer)


class TorchMaxPoolPositions:
    """Reference: stock's ``max_poolNd_with_indices`` forward, positions derived from its indices; backward
    rebuilds stock's int64 indices and runs stock's backward kernel."""

    name = "torch"

    @staticmethod
    def forward(x, kernel, stride, padding, dilation, ceil_mode):
        nd = len(kernel)
        out, indices = _MAX_FORWARD[nd](x, kernel, stride, padding, dilation, ceil_mode)
        dtype = position_dtype(_prod(kernel))
        pos = _positions_from_indices(indices, tuple(x.shape[-nd:]), kernel, stride, padding, dilation, dtype,
                                        in_place=True)
        return out, pos

    @staticmethod
    def backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode):
        return scatter_backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode)


def output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Stock's ``pooling_output_shape`` for one spatial dimension (shared by the fast backends)."""
    numerator = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = numerator // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


TORCH_IMPL = TorchMaxPoolPositions()

registry.register(FAMILY, registry.TORCH, devices=("cpu", "cuda"), dtypes=_FLOATS, load=lambda: TORCH_IMPL,
                  note="stock kernels, positions derived from indices (reference)")


class CoreMaxPoolPositions:
    """The compiled core's one-pass kernels (``csrc/max_pool.cpp``) under this family's contract; the torch
    reference serves what they decline (invalid arguments: stock's errors)."""

    name = "core"

    def __init__(self, core):
        self._forward = core.max_pool_positions_forward
        self._backward = core.max_pool_positions_backward

    def forward(self, x, kernel, stride, padding, dilation, ceil_mode):
        result = self._forward(x, list(kernel), list(stride), list(padding), list(dilation), bool(ceil_mode))
        if result is None:
            return TORCH_IMPL.forward(x, kernel, stride, padding, dilation, ceil_mode)
        return result

    def backward(self, grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode):
        grad = self._backward(grad_out, positions, list(x_shape), list(kernel), list(stride), list(padding),
                              list(dilation), bool(ceil_mode))
        if grad is None:
            return TORCH_IMPL.backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode)
        return grad



registry.register(FAMILY, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20,
                  load=registry.core_loader(CoreMaxPoolPositions),
                  note="compiled core: output and positions in one parallel pass, parallel scatter backward")


def choose(x: torch.Tensor):
    return registry.choose_or_reference(FAMILY, x, TORCH_IMPL)
