"""ReLU and LeakyReLU that keep one bit per element for backward instead of a float tensor.

Stock ``relu`` keeps its float output and ``leaky_relu`` its float input, although backward only reads
their sign. Here backward gets a bit-packed mask (``ceil(numel / 8)`` bytes, see ``_bitmask``), or, when a
consumer already keeps the output anyway (the producer/consumer rule in ``_common``), the output itself,
which then costs nothing extra while a mask would.

Gradients are bitwise those of stock, NaN and infinities included:

* relu: stock computes ``threshold_backward(grad, result, 0)``, i.e. ``result <= 0 ? 0 : grad``. The
  output of relu is never negative, so ``result <= 0`` fails exactly where ``result != 0`` (NaN passes
  its gradient; -inf gives 0 and a zero gradient).
* leaky_relu: stock computes ``input > 0 ? grad : grad * negative_slope``; NaN takes the slope branch.
  The mask is ``input > 0``. When the output is kept instead, stock's own kernel runs on it with
  ``self_is_result=True``, valid for ``negative_slope >= 0`` (then ``result > 0`` iff ``input > 0``).

Cost, measured on the development CPU (8x64x56x56 fp32, 2 threads, forward + backward, median of 22,
interleaved): stock relu 0.87 ms; mask packed with numpy (``not_equal``/``greater`` into the padded
buffer, ``packbits``, ``unpackbits``) 1.81 ms; torch-only with the int64 shift-or trick 3.16 ms; naive
torch multiply-and-sum packing 4.15 ms; output kept instead of a mask 0.93 ms. Torch's bool-producing
comparisons and ``torch.where`` are the slow parts on CPU (0.7 ms and 3.3 ms here), hence numpy for the
comparison and, in backward, the gradient's bits multiplied by the 0/1 mask instead of ``torch.where``.
So CPU tensors in eager mode use numpy, everything else the torch path. Backward's mixed-dtype product
allocates one input-sized temporary, about what stock holds there (its saved output).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import torch.nn.functional as F

from slimgrad.functional import _bitmask, _common
from slimgrad.functional._common import UseCell, check_tensor, learn_from_use, mark_producer

__all__ = ["relu", "leaky_relu"]

_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."
_NEGATIVE_INPLACE = (
    "In-place leakyReLu backward calculation is triggered with a negative slope which is not supported. "
    "This is caused by calling in-place forward function with a negative slope, please call out-of-place "
    "version instead. File an issue at https://github.com/pytorch/pytorch if you do require supporting "
    "in-place leakRelu backward calculation with negative slope"
)

_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# What backward was left: a packed mask, the output itself, or nothing (stock refuses the case).
_MASK, _OUTPUT, _REFUSE = "mask", "output", "refuse"


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes ``t`` contiguous (e.g. channels_last), or None if it already is or no
    permutation does. Packing in memory order keeps the mask's reads and writes sequential."""
    if t.is_contiguous():
        return None
    perm = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _pack_mask(out: torch.Tensor, source: torch.Tensor, relu: bool, ctx) -> torch.Tensor:
    """Pack the sign mask backward needs: ``out != 0`` for relu, ``source > 0`` for leaky_relu."""
    ref = out if relu else source
    perm = _memory_order(ref)
    ctx.perm = perm
    if perm is not None:
        ref = ref.permute(perm)
    ctx.packed_shape = tuple(ref.shape)
    if torch.compiler.is_compiling():
        mask = (ref != 0) if relu else (ref > 0)
        flat = mask.reshape(-1)
        pad = _bitmask.packed_numel(flat.numel()) * 8 - flat.numel()
        flat = torch.cat([flat, flat.new_zeros(pad)])
    else:
        flat, view = _bitmask.new_padded_mask(ref.shape, ref.device)
        if ref.dtype in _NUMPY_DTYPES and _bitmask.use_numpy(ref):
            # numpy's comparisons run several times faster than torch's bool-producing ones on CPU.
            (np.not_equal if relu else np.greater)(ref.detach().numpy(), 0, out=view.numpy())
        elif relu:
            torch.ne(ref, 0, out=view)
        else:
            torch.gt(ref, 0, out=view)
    return _bitmask.pack(flat)


def _unpack_mask(packed: torch.Tensor, ctx) -> torch.Tensor:
    mask = _bitmask.unpack(packed, ctx.packed_shape)
    if ctx.perm is not None:
        inverse = [0] * len(ctx.perm)
        for i, d in enumerate(ctx.perm):
            inverse[d] = i
        mask = mask.permute(inverse)
    return mask


class _ReLUFunction(_common.Function):
    """relu (``negative_slope is None``) and leaky_relu, keeping a packed mask or the output."""

    @staticmethod
    def forward(ctx, input, negative_slope, inplace, keep_output, use):
        ctx.use = use  # (module, UseCell) when called by a module: see _common.learn_from_use
        relu = negative_slope is None
        ctx.negative_slope = negative_slope
        if inplace:
            # Return ``input`` itself: torch.compile checks that a dirty tensor is returned as the same object.
            if relu:
                torch.relu_(input)
            else:
                torch._C._nn.leaky_relu_(input, negative_slope)
            out = input
            ctx.mark_dirty(input)
        elif relu:
            out = torch.relu(input)
        else:
            out = torch._C._nn.leaky_relu(input, negative_slope)
        if not ctx.needs_input_grad[0]:
            ctx.mode = _REFUSE
            return out
        if not relu and inplace and negative_slope < 0:
            # Stock refuses this in backward (the sign of the input is lost); so do we, keeping nothing.
            ctx.mode = _REFUSE
        elif keep_output and (relu or negative_slope >= 0):
            ctx.mode = _OUTPUT
            ctx.save_for_backward(out)
        else:
            ctx.mode = _MASK
            # After an in-place leaky_relu with slope >= 0 the output has the input's sign.
            ctx.save_for_backward(_pack_mask(out, out if inplace else input, relu, ctx))
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.mode == _REFUSE:
            raise RuntimeError(_NEGATIVE_INPLACE)
        (saved,) = ctx.saved_tensors
        if ctx.use is not None:
            learn_from_use(*ctx.use)
        slope = ctx.negative_slope
        if ctx.mode == _OUTPUT:
            if slope is None:
                return torch.ops.aten.threshold_backward(grad, saved, 0), None, None, None, None
            return torch.ops.aten.leaky_relu_backward(grad, saved, slope, True), None, None, None, None
        mask = _unpack_mask(saved, ctx)
        if slope is None:
            if grad.requires_grad:  # double backward: stay differentiable in grad
                return torch.where(mask, grad, 0), None, None, None, None
            # Multiplying the gradient's bits by 0/1 is where(mask, grad, +0) bit for bit, and much
            # faster on CPU than torch.where with a bool condition.
            bits = grad.view(_SAME_SIZE_INT[grad.element_size()])
            return (bits * mask).view(grad.dtype), None, None, None, None
        # Stock's own kernel, reading the 0/1 mask where it would read the input's sign.
        grad_input = torch.ops.aten.leaky_relu_backward(grad, mask.view(torch.uint8), slope, False)
        return grad_input, None, None, None, None


def _check_slope(negative_slope) -> float:
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"leaky_relu: argument 'negative_slope' must be a real number, got "
                        f"{type(negative_slope).__name__}")
    return float(negative_slope)


def _apply(input, negative_slope, inplace, keep_output, fn, use=None):
    """Run stock where no gradient will be asked of us; otherwise our Function."""
    check_tensor(input, "input", fn=fn)
    if not (torch.is_grad_enabled() and input.requires_grad):
        if negative_slope is None:
            return F.relu(input, inplace=inplace)
        return F.leaky_relu(input, negative_slope, inplace=inplace)
    if inplace and input.is_leaf:
        raise RuntimeError(_LEAF_INPLACE)
    return _ReLUFunction.apply(input, negative_slope, bool(inplace), bool(keep_output), use)


def relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu`` that keeps a 1-bit mask for backward instead of the float output."""
    return _apply(input, None, inplace, False, "relu")


def leaky_relu(input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False) -> torch.Tensor:
    """``F.leaky_relu`` that keeps a 1-bit mask for backward instead of the float input."""
    return _apply(input, _check_slope(negative_slope), inplace, False, "leaky_relu")


class _LearnHook:
    """Gradient hook on a stock-run output: folds the call's UseCell into the module, as backward would."""

    __slots__ = ("module", "cell")

    def __init__(self, module, cell):
        self.module, self.cell = module, cell

    def __call__(self, grad_outputs):
        learn_from_use(self.module, self.cell)


def _module_forward(module, input, negative_slope):
    """Shared by the ReLU/LeakyReLU modules: keep the output instead of a mask when a consumer kept this
    module's output during the previous step (then it is shared, not extra); see the producer/consumer
    rule in ``_common``."""
    keep_output = getattr(module, "_slimgrad_output_kept", False)
    cell = UseCell()
    if (
        keep_output
        and (negative_slope is None or (module.inplace and negative_slope >= 0))
        and isinstance(input, torch.Tensor)
        and input.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        # Stock keeps the output here too (relu, and in-place leaky_relu with a non-negative slope), so
        # stock's op runs directly. A gradient hook stands in for our backward's learn_from_use, so that
        # the decision is revisited when the consumer stops keeping the output (a node pre-hook: cheaper than
        # a tensor hook).
        if negative_slope is None:
            out = F.relu(input, inplace=module.inplace)
        else:
            out = F.leaky_relu(input, negative_slope, inplace=True)
        out.grad_fn.register_prehook(_LearnHook(module, cell))
        mark_producer(out, cell)
        return out
    out = _apply(input, negative_slope, module.inplace, keep_output, type(module).__name__, use=(module, cell))
    if out.requires_grad:
        mark_producer(out, cell)
    return out
