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
  :func:`slimgrad.functional.pooling.position_dtype` ``(prod(kernel))`` (uint8 up to 256 window
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

import torch

from . import registry

__all__ = ["FAMILY", "CoreMaxPoolPositions", "TorchMaxPoolPositions", "choose", "output_size"]

FAMILY = "max_pool_positions"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class TorchMaxPoolPositions:
    """Reference: stock's ``max_poolNd_with_indices`` forward, positions derived from its indices; backward
    rebuilds stock's int64 indices and runs stock's backward kernel."""

    name = "torch"

    @staticmethod
    def forward(x, kernel, stride, padding, dilation, ceil_mode):
        from slimgrad.functional import pooling as P

        nd = len(kernel)
        out, indices = P._MAX_FORWARD[nd](x, kernel, stride, padding, dilation, ceil_mode)
        dtype = P.position_dtype(_prod(kernel))
        pos = P._positions_from_indices(indices, tuple(x.shape[-nd:]), kernel, stride, padding, dilation, dtype,
                                        in_place=True)
        return out, pos

    @staticmethod
    def backward(grad_out, positions, x_shape, kernel, stride, padding, dilation, ceil_mode):
        from slimgrad.functional import pooling as P

        nd = len(kernel)
        shape = tuple(x_shape)
        indices = P._indices_from_positions(positions, shape[-nd:], kernel, stride, padding, dilation)
        if nd == 1:
            shape = shape[:-1] + (1, shape[-1])
            grad_out, indices = grad_out.unsqueeze(-2), indices.unsqueeze(-2)
            kernel, stride, padding, dilation = (1,) + kernel, (1,) + stride, (0,) + padding, (1,) + dilation
        op = P._MAX_BACKWARD[max(nd, 2)]
        grad = op(grad_out, P.standin(shape, grad_out), kernel, stride, padding, dilation, ceil_mode, indices)
        return grad.squeeze(-2) if nd == 1 else grad


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


def _load_core():
    from slimgrad import csrc

    core = csrc.core()
    if core is None:
        raise RuntimeError("the compiled core is unavailable (python -m slimgrad kernels says why)")
    return CoreMaxPoolPositions(core)


registry.register(FAMILY, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20, load=_load_core,
                  note="compiled core: output and positions in one parallel pass, parallel scatter backward")


def choose(x: torch.Tensor):
    return registry.choose_or_reference(FAMILY, x, TORCH_IMPL)
