"""Clamp-like activations (ReLU6, Hardtanh, Threshold, Hardsigmoid) that keep one bit per element.

Stock keeps a float tensor for each of them although backward only reads which elements lie in the
region where the gradient passes. The pass rules, read from aten's CPU kernels and checked bitwise by the
tests (NaN, ±inf and -0 included):

* ``hardtanh(x, lo, hi)`` (``relu6`` is ``hardtanh(x, 0, 6)``): ``hardtanh_backward`` passes the
  gradient where ``lo < x < hi``; both boundaries block. Stock keeps x (out of place) or the result (in
  place). For NaN inputs stock is not consistent: its vectorised loop computes ``(x > lo) & (x < hi)``
  (NaN blocks) while the scalar loop that finishes each contiguous run computes
  ``!(x <= lo || x >= hi)`` (NaN passes), so which NaN elements pass depends on their position and on
  how the tensor is split across threads. slimgrad applies the vectorised rule to every element (NaN
  blocks); the tests check that, and that stock's vectorised body agrees.
* ``threshold(x, th, value)``: ``threshold_backward(grad, x, th)`` gives ``x <= th ? 0 : grad``; NaN and
  +inf pass. In place, stock keeps a *clone* of the original input (its formula reads ``self``), so the
  in-place form costs stock a full copy.
* ``hardsigmoid(x)``: ``(x > -3 && x < 3) ? grad * (1/6) : 0``; NaN blocks. The factor is applied by
  stock's own ``hardsigmoid_backward`` here (so the rounding is its own), then the mask zeroes the rest.
  In place, stock keeps a clone of the input.
* ``hardswish`` is *not* here: its gradient in ``(-3, 3)`` is ``grad * (x / 3 + 0.5)``, which reads x
  itself, so no mask can replace the input stock keeps.

Bounds are compared as stock's kernels compare them (measured): in x's dtype for fp32/fp64, in fp32 for
fp16/bf16 inputs (``_bounds``). The masks are made and read by the ``range_mask`` kernel family
(:mod:`slimgrad.kernels.range_mask`: a numpy reference, and a numba kernel that packs in one pass);
backward is ``where(mask, grad, +0)`` bit for bit.

The producer/consumer rule of ``_common`` applies to hardtanh/relu6 (bounds exact in x's dtype) and to
threshold with ``value <= threshold``: when the next layer keeps this output anyway, the output is kept
instead of a mask and the pass test runs on it in backward (the output lies strictly inside the pass
region exactly where the input does). Hardsigmoid's output cannot stand in for its input (``x`` just
below 3 rounds to an output of 1 but still passes its gradient), so it always keeps the mask.

Eager CPU calls run the compiled core (``slimgrad/csrc/range_mask.cpp``) when :func:`slimgrad.csrc.for_eager`
allows it: one C++ autograd Function per call with this module's kept bytes, layouts, gradient strides and
double backward, at about stock's cost per call (the Python Function costs ~55 µs more, issue 22). Its kernels
pack the mask in one vectorised pass; fp32 hardtanh/relu6 and hardsigmoid also write the output in that pass
(stock's own op finishes the rare elements, NaN or signed zeros, whose bits stock's vectorised and scalar paths
disagree on), and hardsigmoid's backward applies stock's factor and the mask in one pass. Threshold and the
other dtypes run stock's op for the output. The Python Function stays the reference and the fallback.
"""

from __future__ import annotations

import functools
import numbers

import torch

from slimgrad import csrc
from slimgrad.functional import _common, _layout, _shared_masks
from slimgrad.functional._common import UseCell, check_tensor, count_call, learn_from_use, mark_producer
from slimgrad.functional.activation import (
    _C_APPLY,
    _PENDING,
    LazyUseCell,
    _eager,
    _finish_activation,
    _LearnHook,
    _outputs,
    _traced_inplace_on_view,
    _unwrap_if_dead,
)
from slimgrad.kernels import bitmask as _bitmask
from slimgrad.kernels import range_mask

__all__ = ["hardtanh", "hardtanh_", "relu6", "threshold", "threshold_", "hardsigmoid", "RangeMaskFunction"]

_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

HARDTANH, THRESHOLD, HARDSIGMOID = "hardtanh", "threshold", "hardsigmoid"
_KINDS = {HARDTANH: 0, THRESHOLD: 1, HARDSIGMOID: 2}  # csrc/range_mask.cpp's Kind
_MASK, _OUTPUT = "mask", "output"


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes ``t`` contiguous (channels_last, say), or None if it already is or none
    does; packing in memory order keeps the mask's reads and writes sequential."""
    if t.is_contiguous():
        return None
    perm = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _rule(kind: str) -> str:
    return "above" if kind == THRESHOLD else "inside"


@functools.lru_cache(maxsize=256)  # eager only (traced calls keep the bounds symbolic); a tensor round trip per call
def _round(v: float | None, dtype: torch.dtype) -> float | None:
    return None if v is None else float(torch.tensor(v, dtype=dtype, device="cpu"))  # not the default device


def _bounds(kind: str, lo: float, hi: float | None, dtype: torch.dtype) -> tuple[float, float | None]:
    """The bounds as stock's backward compares them (measured, in place too): in x's dtype for fp32/fp64,
    in fp32 for half-precision x (so for bf16 x and ``max_val=0.1`` the bound is 0.1f, not bf16's
    0.10009765625; an input equal to fp16's 0.0999755859375 passes, a larger one clamped to it does not).
    Traced, the bounds stay as given: under ``dynamic=True`` they are symbolic floats, which a Python-side
    rounding would turn into an unbacked ``.item()``; ``range_mask.mask_torch`` rounds them in the graph."""
    if torch.compiler.is_compiling():
        return lo, hi
    target = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return _round(lo, target), _round(hi, target)


def _pack(x: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    """The packed pass mask of x, in x's memory order (a dense layout goes to the kernel as its contiguous
    permuted view; a non-dense one, a slice, as a contiguous copy); the order is parked in ``_PENDING.perm``
    for setup_context."""
    lo, hi = _bounds(kind, lo, hi, x.dtype)
    perm = _PENDING.perm = _memory_order(x)
    xc = x.permute(perm) if perm is not None else x.contiguous()
    _PENDING.impl = impl = range_mask.choose(xc)  # kept by setup_context for backward: one registry lookup less
    return impl.pack(xc, _rule(kind), lo, hi)


def _pack_traced(x: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    """Traced: the planar format (_bitmask.planar_layout), which Inductor fuses into the producing kernel."""
    lo, hi = _bounds(kind, lo, hi, x.dtype)
    rule = _rule(kind)
    return _shared_masks.pack(lambda t: range_mask.mask_torch(t, rule, lo, hi), x, _bitmask.planar_layout(x))


def _select(grad: torch.Tensor, packed: torch.Tensor, ctx, hardsigmoid: bool = False) -> torch.Tensor:
    """``mask ? grad : +0`` through the kernel family, in the mask's memory order (``hardsigmoid``: stock's factor
    applied first). A tensor of ours, made here (the contiguous copy of a gradient in another order, or the
    factor's result), is overwritten in place by the family's ``select_into`` where the kernel has one (the torch
    reference): one gradient-sized tensor made, as stock's backward makes."""
    perm = ctx.perm
    g = grad if perm is None else grad.permute(perm)
    # the forward's kernel; traced (compiled autograd over an eager forward), the registry's answer there
    compiling = torch.compiler.is_compiling()
    impl = range_mask.choose(g) if compiling else ctx.impl
    select_into = getattr(impl, "select_into", None)
    if (perm is not None and select_into is not None and not compiling and ctx.x_strides is not None
            and not g.is_contiguous()):
        # The gradient is not in the mask's order: written straight into stock's layout with the mask read
        # permuted, not through a contiguous copy of the gradient and a copy back into stock's layout.
        out = torch.empty_strided(grad.shape, _stock_grad_strides(ctx.kind, grad, ctx.x_strides),
                                  dtype=grad.dtype, device=grad.device)
        source = _hardsigmoid_factor(grad, out=out) if hardsigmoid else grad
        return select_into(source, packed, ctx.packed_shape, _inverse(perm), out)
    gc = g.contiguous()
    owned = gc is not g
    if hardsigmoid:
        gc = _hardsigmoid_factor(gc, out=gc if owned and not compiling else None)
        owned = True
    if select_into is not None and owned and not compiling:
        g = select_into(gc, packed, gc.shape, tuple(range(gc.dim())), gc)  # in place, the mask's own order
    else:
        g = impl.select(gc, packed)
    return g if perm is None else g.permute(_inverse(perm))


def _inverse(perm):
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return inverse


def _unpack(packed: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.planar:
        return _shared_masks.unpack(packed, ctx.packed_shape, ctx.order)
    mask = _bitmask.unpack(packed, ctx.packed_shape)
    return mask if ctx.perm is None else mask.permute(_inverse(ctx.perm))


def _stock(input, kind, lo, hi, value, inplace):
    if kind == HARDTANH:
        return torch._C._nn.hardtanh_(input, lo, hi) if inplace else torch._C._nn.hardtanh(input, lo, hi)
    if kind == THRESHOLD:
        return torch.threshold_(input, lo, value) if inplace else torch.threshold(input, lo, value)
    return torch._C._nn.hardsigmoid_(input) if inplace else torch._C._nn.hardsigmoid(input)


class RangeMaskFunction(_common.Function):
    """hardtanh / threshold / hardsigmoid, keeping a packed pass mask (or the output, see the module doc).

    ``apply(input, kind, lo, hi, value, inplace, keep_output, use, vmappable)`` returns ``(output, packed
    mask)`` (empty where the output is kept), in eager the output alone (``activation._outputs``).
    ``lo``/``hi``: the bounds of the pass region (``hi`` unused for threshold); ``value``: threshold's
    replacement value; ``use``: (module, UseCell) for the producer/consumer rule; ``vmappable`` (set by
    :meth:`under_transform` only): plain torch ops in logical order, which vmap
    batches. Double backward is supported (backward is linear in the gradient).
    """

    @staticmethod
    def forward(input, kind, lo, hi, value, inplace, keep_output, use, vmappable):
        if keep_output:
            out = _stock(input, kind, lo, hi, value, inplace)
            return _outputs(input, input if inplace else out, None, vmappable)
        if vmappable:
            out = _stock(input, kind, lo, hi, value, False)
            mask = range_mask.mask_torch(input, _rule(kind), *_bounds(kind, lo, hi, input.dtype))
            return out, _bitmask.pack_vmappable(mask)
        if not torch.compiler.is_compiling():
            packed = _pack(input, kind, lo, hi)  # before an in-place op overwrites the input
            out = _stock(input, kind, lo, hi, value, inplace)
        elif output_can_stand_in(kind, lo, hi, value, input.dtype):
            # Traced: stock's op, then the pack read from its output (same pass region), which Inductor has
            # materialized for the next kernel anyway; nothing in the forward reads the pack, so the
            # partitioner saves it or, where the producer keeps a tensor it can be rebuilt from, may rebuild
            # it in backward (see activation._traced_masked_forward).
            out = _stock(input, kind, lo, hi, value, inplace)
            packed = _pack_traced(out, kind, lo, hi)
        else:
            packed = _pack_traced(input, kind, lo, hi)
            out = _stock(input, kind, lo, hi, value, inplace)
        # torch.compile checks that a dirty tensor is returned as the same object
        return _outputs(input, input if inplace else out, packed, vmappable)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, kind, lo, hi, value, inplace, keep_output, use, vmappable = inputs
        if type(output) is tuple:  # traced or under torch.func
            out, packed = output
            ctx.mark_non_differentiable(packed)
        else:  # eager: the mask, if any, comes through activation._PENDING (see activation._outputs)
            out, packed = output, _PENDING.mask
            _PENDING.mask = None
        if inplace:
            ctx.mark_dirty(input)
        if not ctx.needs_input_grad[0]:
            return
        ctx.use = use
        ctx.kind, ctx.lo, ctx.hi = kind, lo, hi
        ctx.vmappable = vmappable
        planar = ctx.planar = torch.compiler.is_compiling()
        ctx.x_strides = None if vmappable or planar else _stock_operand_strides(input, kind, inplace)
        if keep_output:
            ctx.mode = _OUTPUT
            ctx.save_for_backward(out)
            return
        ctx.mode = _MASK
        if vmappable:
            ctx.shape = tuple(input.shape)
        elif planar:  # how the forward packed (_pack_traced): from the output where it can stand in
            x = out if output_can_stand_in(kind, lo, hi, value, input.dtype) else input
            ctx.perm, ctx.packed_shape, ctx.order = None, tuple(x.shape), _bitmask.planar_layout(x)
        else:  # in _pack's memory order, by _pack's kernel
            perm = ctx.perm = _PENDING.perm
            ctx.impl, _PENDING.impl = _PENDING.impl, None
            ctx.packed_shape = tuple(input.shape) if perm is None else tuple(input.shape[d] for d in perm)
        ctx.save_for_backward(packed)

    @staticmethod
    def backward(ctx, grad, *_grad_packed):
        dx = _input_grad(ctx, grad)
        if ctx.x_strides is not None:
            dx = _layout.conform(dx, _stock_grad_strides(ctx.kind, grad, ctx.x_strides))
        return dx, None, None, None, None, None, None, None, None

    @staticmethod
    def stock(input, kind, lo, hi, value, inplace, keep_output, use, vmappable):
        """Stock's op, as ``(output, None)`` (apply's pair)."""
        return _stock(input, kind, lo, hi, value, inplace), None

    @classmethod
    def under_transform(cls, input, kind, lo, hi, value, inplace, keep_output, use, vmappable):
        """Out of place (vmap's generated rule cannot return a dirtied input), copied into ``input`` outside the
        Function so that only the mask stays; the module's learning runs from a node pre-hook. In place with
        the output kept, stock runs (it keeps its result, the input's own memory, which is what keep_output
        keeps)."""
        if inplace and keep_output:
            return cls.stock(input, kind, lo, hi, value, inplace, keep_output, use, vmappable)
        out, packed = super().under_transform(input, kind, lo, hi, value, False, keep_output, None, True)
        return _finish_activation(input, out, inplace, use), packed


def _input_grad(ctx, grad):
    """RangeMaskFunction's input gradient (values; the layout is fixed by the caller)."""
    (saved,) = ctx.saved_tensors
    if ctx.use is not None:
        learn_from_use(*ctx.use)
    if ctx.mode == _OUTPUT and ctx.kind == THRESHOLD:
        dx = torch.ops.aten.threshold_backward(grad, saved, ctx.lo)
        return dx
    if ctx.mode == _MASK and not (ctx.vmappable or ctx.planar or grad.requires_grad):
        # the kernel family's select (hardsigmoid's factor applied there, into a tensor of ours)
        return _select(grad, saved, ctx, hardsigmoid=ctx.kind == HARDSIGMOID)
    if ctx.kind == HARDSIGMOID:
        grad = _hardsigmoid_factor(grad)
    if ctx.mode == _MASK and ctx.vmappable:
        return torch.where(_bitmask.unpack_vmappable(saved, ctx.shape), grad, 0)
    if ctx.mode == _MASK and ctx.planar:
        return torch.where(_unpack(saved, ctx), grad, 0)
    if ctx.mode == _OUTPUT or grad.requires_grad:
        # Output kept (not stock's hardtanh_backward: its NaN rule depends on the element's position,
        # see the module doc), or double backward (stay differentiable in grad): a torch mask.
        mask = (range_mask.mask_torch(saved, _rule(ctx.kind), *_bounds(ctx.kind, ctx.lo, ctx.hi, saved.dtype))
                if ctx.mode == _OUTPUT else _unpack(saved, ctx))
        if grad.requires_grad or ctx.vmappable:
            return torch.where(mask, grad, 0)
        bits = grad.view(_SAME_SIZE_INT[grad.element_size()])
        # (where on the bits: a product would widen the bool mask to a full-size integer copy on CPU; the core's
        # backward, csrc/range_mask.cpp, runs the same ops, so the estimate's fakes need no branch of their own)
        return torch.where(mask, bits, 0).view(grad.dtype)
    return _select(grad, saved, ctx)


def _hardsigmoid_factor(grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stock's kernel applies hardsigmoid's factor (a zero stand-in lies inside the pass region everywhere);
    ``out``: into it (grad itself, element for element, is allowed)."""
    zero = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
    if out is None:
        return torch.ops.aten.hardsigmoid_backward(grad, zero)
    return torch.ops.aten.hardsigmoid_backward.grad_input(grad, zero, grad_input=out)


def _stock_operand_strides(input: torch.Tensor, kind: str, inplace: bool) -> tuple[int, ...]:
    """The strides of the tensor stock's backward reads besides the gradient: x (or, in place, hardtanh's
    result, which is x), or for in-place threshold/hardsigmoid the clone of x stock keeps."""
    if inplace and kind != HARDTANH:
        return _layout.like_strides(input)
    return tuple(input.stride())


def _stock_grad_strides(kind: str, grad: torch.Tensor, x_strides) -> tuple[int, ...]:
    """The layout of stock's input gradient: TensorIterator's choice for ``hardtanh_backward(grad, x)``,
    ``hardsigmoid_backward(grad, x)`` (the gradient's layout leads) or ``threshold_backward(grad, x)``
    (whose iterator takes x first, so x's layout leads)."""
    if kind == THRESHOLD:
        return _layout.binary_strides(tuple(grad.shape), x_strides, grad.stride())
    return _layout.binary_strides(tuple(grad.shape), grad.stride(), x_strides)


def _real(v, name: str, fn: str) -> float:
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_complex():
        return float(v.item())  # a 0-d tensor, which stock takes as a number
    if not isinstance(v, numbers.Real):  # (a bool is a number to stock: True is 1.0)
        raise TypeError(f"{fn}: argument '{name}' must be a real number, got {type(v).__name__}")
    return float(v)


def output_can_stand_in(kind: str, lo: float, hi: float | None, value: float | None, dtype: torch.dtype) -> bool:
    """Whether the pass test on the output gives stock's gradient (see the module doc). For hardtanh that
    needs bounds exact in x's dtype (else a clamped result, rounded, can land inside them)."""
    if kind == HARDTANH:
        if torch.compiler.is_compiling():
            return _plainly_exact(lo, dtype) and _plainly_exact(hi, dtype)
        return _round(lo, dtype) == lo and _round(hi, dtype) == hi
    return kind == THRESHOLD and value <= lo


_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _plainly_exact(v: float, dtype: torch.dtype) -> bool:
    """A sufficient test that ``v`` is exact in ``dtype``, in arithmetic a symbolic float (``dynamic=True``)
    can guard on: a multiple of 2**-f below 2**(m-f) in magnitude has at most m significant bits. It covers
    the bounds people use (0, 6, +-1, halves); a bound it misses only keeps the mask instead of the output."""
    bits = _SIGNIFICAND_BITS.get(dtype)
    if bits is None:
        return False
    scaled = v * float(2 ** (bits // 2))
    return abs(scaled) < float(2 ** bits) and float(int(scaled)) == scaled


def apply(input, kind, lo, hi=None, value=None, inplace=False, keep_output=False, use=None, fn=None):
    """Stock where no gradient will be asked of us; otherwise :class:`RangeMaskFunction`."""
    check_tensor(input, "input", fn=fn or kind)
    if not (torch.is_grad_enabled() and input.requires_grad) or _common.foreign_input(input):
        return _stock(input, kind, lo, hi, value, inplace)
    if inplace and input.is_leaf:
        raise RuntimeError(_LEAF_INPLACE)
    if not inplace and _common.input_smaller_than_mask(input):
        return _stock(input, kind, lo, hi, value, False)  # stock keeps x: a broadcast view's small storage
    keep_output = bool(keep_output) and output_can_stand_in(kind, lo, hi, value, input.dtype)
    core = csrc.for_eager(input)
    if core is not None:
        out = core.range_mask_apply(input, _KINDS[kind], lo, 0.0 if hi is None else hi,
                                    0.0 if value is None else value, bool(inplace), keep_output)
        if out is not None:
            if use is not None:
                # The core's backward does not call back into Python: a node pre-hook folds the call's UseCell
                # into the module when its gradient arrives, as RangeMaskFunction's backward does.
                out.grad_fn.register_prehook(_LearnHook(*use))
            return out
    if inplace and _traced_inplace_on_view(input):
        out = RangeMaskFunction.apply(input, kind, lo, hi, value, False, keep_output, use, False)[0]
        return input.copy_(out)
    out = RangeMaskFunction.apply(input, kind, lo, hi, value, bool(inplace), keep_output, use, False)
    return out if type(out) is not tuple else out[0]  # eager: the output alone (see activation._outputs)


def hardtanh(input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> torch.Tensor:
    """``F.hardtanh`` keeping a 1-bit mask of ``min_val < x < max_val`` for backward (NaN blocks)."""
    lo, hi = _real(min_val, "min_val", "hardtanh"), _real(max_val, "max_val", "hardtanh")
    if lo > hi:
        raise ValueError("min_val cannot be greater than max_val")  # stock's message, word for word
    return apply(input, HARDTANH, lo, hi, inplace=inplace, fn="hardtanh")


def hardtanh_(input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    """``F.hardtanh_``: :func:`hardtanh` in place. As stock's builtin, it takes ``min_val > max_val`` (every element
    becomes ``max_val``, no gradient passes), which only ``F.hardtanh`` refuses."""
    lo, hi = _real(min_val, "min_val", "hardtanh_"), _real(max_val, "max_val", "hardtanh_")
    return apply(input, HARDTANH, lo, hi, inplace=True, fn="hardtanh_")


def relu6(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu6`` (``hardtanh(x, 0, 6)``) keeping a 1-bit mask for backward."""
    return apply(input, HARDTANH, 0.0, 6.0, inplace=inplace, fn="relu6")


def _threshold(input, th, value, inplace):
    th, value = _real(th, "threshold", "threshold"), _real(value, "value", "threshold")
    return apply(input, THRESHOLD, th, None, value, inplace=inplace, fn="threshold")


def threshold(input: torch.Tensor, threshold: float, value: float, inplace: bool = False) -> torch.Tensor:
    """``F.threshold`` keeping a 1-bit mask of ``not x <= threshold`` for backward (stock keeps x, and in
    place a clone of it)."""
    return _threshold(input, threshold, value, inplace)


def threshold_(input: torch.Tensor, threshold: float, value: float) -> torch.Tensor:
    """``F.threshold_``: :func:`threshold` in place."""
    return _threshold(input, threshold, value, True)


def hardsigmoid(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.hardsigmoid`` keeping a 1-bit mask of ``-3 < x < 3`` for backward."""
    return apply(input, HARDSIGMOID, -3.0, 3.0, inplace=inplace, fn="hardsigmoid")


def module_forward(module, input, kind, lo, hi=None, value=None):
    """Shared by the modules: keep the output instead of a mask when a consumer kept this module's output
    during the previous step (the producer/consumer rule in ``_common``)."""
    keep_output = module.__dict__.get("_slimgrad_output_kept", False)  # no nn.Module.__getattr__ miss
    if (not getattr(module, "inplace", False) and type(input) is torch.Tensor and input.requires_grad
            and torch.is_grad_enabled()):
        count_call(module)  # stock's op keeps its input (in place: its result): output only if every call's is kept
    if keep_output and _common.in_checkpointed_forward():
        # a checkpointed region keeps the mask, the default: its recomputation, after another backward may have
        # published a new decision, must save what its forward saved
        keep_output = False
    if not keep_output and type(input) is torch.Tensor and input.requires_grad and torch.is_grad_enabled():
        # The common case in one call, with the producer's bookkeeping made lazy (activation.LazyUseCell: the
        # learning hook is registered only if a consumer keeps the output): the compiled core, else, in eager,
        # the Python Function (CUDA's path, where the core does not serve).
        inplace = bool(module.inplace)
        if inplace and input.is_leaf:
            raise RuntimeError(_LEAF_INPLACE)
        if not inplace and _common.input_smaller_than_mask(input):
            return _stock(input, kind, lo, hi, value, False)
        core = csrc.for_eager(input)
        if core is not None:
            out = core.range_mask_apply(input, _KINDS[kind], lo, 0.0 if hi is None else hi,
                                        0.0 if value is None else value, inplace, False)
            if out is not None:
                if output_can_stand_in(kind, lo, hi, value, input.dtype):
                    mark_producer(out, LazyUseCell(module, out.grad_fn))
                return out
        if _eager():
            out = _C_APPLY(RangeMaskFunction, _unwrap_if_dead(input), kind, lo, hi, value, inplace, False, None,
                           False)
            if output_can_stand_in(kind, lo, hi, value, input.dtype):
                mark_producer(out, LazyUseCell(module, out.grad_fn))
            return out
    cell = UseCell()
    out = apply(input, kind, lo, hi, value, module.inplace, keep_output, use=(module, cell),
                fn=type(module).__name__)
    if out.requires_grad and output_can_stand_in(kind, lo, hi, value, input.dtype):
        mark_producer(out, cell)
    return out

