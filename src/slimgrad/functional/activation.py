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

The mask is made and read by the ``relu_mask`` kernel family (:mod:`slimgrad.kernels.relu_mask`, where
the contract and the torch reference live; numba on CPU and Triton on CUDA where available): one pass
over the input for output and mask, one over the gradient and mask in backward. Channels-last and other
dense layouts go to the kernels as their contiguous permuted view, so the mask is in memory order.

Eager CPU calls run the compiled core (``slimgrad/csrc/relu_mask.cpp``) when :func:`slimgrad.csrc.for_eager`
allows it: one C++ autograd Function per call, its forward writing output and mask in the same parallel,
vectorised pass (16.25 bytes moved per fp32 element over forward and backward against stock's 20), with this
module's layouts, kept bytes, gradient strides and double backward. The Python Function below stays the
reference and the fallback (torch.compile, torch.func, ``SLIMGRAD_CORE=0``, no compiler; the in-place
negative-slope refusal), and runs the same core kernels through the registry. Why: a Python Function and its
bookkeeping cost ~55 µs a call over stock (issue 22); the core call costs ~5. For modules, the producer's
bookkeeping is lazy on the core path (:class:`LazyUseCell`): the learning hook is registered only when a
consumer keeps the output. Eager CUDA calls on tensors up to ``relu_mask.CORE_CUDA_MAX_NUMEL`` elements run
the same C++ Function with aten's kernels in place of the CPU loops (no Python in the call: small CUDA steps
are bound by host time); larger CUDA tensors run the Python Function and its Triton kernel.
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F

from slimgrad import csrc
from slimgrad.functional import _common, _layout, _shared_masks
from slimgrad.functional._common import UseCell, check_tensor, count_call, learn_from_use, mark_producer
from slimgrad.kernels import bitmask as _bitmask
from slimgrad.kernels import relu_mask

__all__ = ["relu", "leaky_relu"]

_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."
_NEGATIVE_INPLACE = (
    "In-place leakyReLu backward calculation is triggered with a negative slope which is not supported. "
    "This is caused by calling in-place forward function with a negative slope, please call out-of-place "
    "version instead. File an issue at https://github.com/pytorch/pytorch if you do require supporting "
    "in-place leakRelu backward calculation with negative slope"
)

# What backward was left: a packed mask, the output itself, or nothing (stock refuses the case).
_MASK, _OUTPUT, _REFUSE = "mask", "output", "refuse"


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes ``t`` contiguous (e.g. channels_last), or None if it already is or no
    permutation does. Packing in memory order keeps the mask's reads and writes sequential."""
    if t.is_contiguous():
        return None
    perm = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm):
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return inverse


def _masked_forward(input, slope, inplace):
    """Run the ``relu_mask`` kernel on ``input`` in its memory order (:func:`_memory_order`, parked in
    ``_PENDING.perm`` for setup_context); returns (out, packed mask)."""
    perm = _PENDING.perm = _memory_order(input)
    if perm is not None or input.is_contiguous():
        xc = input if perm is None else input.permute(perm)
        out, packed = _kernel(xc).forward(xc, slope, inplace)
        if inplace:
            return input, packed
        return (out if perm is None else _common.not_a_view(out.permute(_inverse(perm)))), packed
    # Not dense (a slice): the kernels take contiguous tensors, so work on a contiguous copy.
    xc = input.contiguous()
    out, packed = _kernel(xc).forward(xc, slope, inplace)
    if inplace:
        input.copy_(out)
        return input, packed
    return out, packed


def _kernel(xc):
    """The ``relu_mask`` kernel for an eager forward, parked in ``_PENDING.impl``: setup_context keeps it for backward
    (one registry lookup less a call)."""
    _PENDING.impl = impl = relu_mask.choose(xc)
    return impl


def _vmappable_masked_forward(input, slope):
    """Under torch.func (out of place, see ``_ReLUFunction.under_transform``): the output and the packed mask
    in logical order, with torch ops that vmap batches (no numba/Triton kernel can read a batched tensor)."""
    if slope is None:
        out = torch.relu(input)
        mask = out.le(0).logical_not_()  # stock: result <= 0 ? 0 : grad, so NaN passes
    else:
        out = torch._C._nn.leaky_relu(input, slope)
        mask = input > 0  # stock: input > 0 ? grad : grad * slope (NaN: slope)
    return out, _bitmask.pack_vmappable(mask)


def _relu_sign(value):
    return ~(value <= 0)


def _positive(t):
    return t > 0


def _traced_masked_forward(input, slope, inplace):
    """Under torch.compile: the output, computed from the input as stock computes it, and the planar-packed mask
    (``_bitmask.pack_planar``) in the layout ``_bitmask.planar_layout`` picks; returns (out, packed, layout).

    Nothing in the forward reads the pack, so AOTAutograd's partitioner chooses where it is made: it saves
    the pack (1 bit per element, what eager keeps) or, where the producer keeps a tensor the mask can be
    rebuilt from (a training-mode batch norm keeps its input), may rebuild it in backward as one reduction
    kernel and keep no mask at all. The output is stock's fused pass either way. Computing the output from
    the unpacked pack instead forced the pack into the forward and cost a pass over the map (measured:
    VGG-11 'input' 1.07x compiled stock's step, 1.02-1.05x with this; ResNet-18 'surgical' 1.04 -> 1.01-1.02x).
    The pack reads the output where its sign is the mask's (relu; leaky_relu with a slope >= 0): Inductor
    materialises the output for the next kernel anyway, while the input would be written out only for it."""
    # relu: NaN passes, as in stock's relu and its backward; leaky_relu's backward takes grad where the input
    # is > 0 (NaN: the slope)
    mask = _relu_sign(input) if slope is None else _positive(input)
    if slope is None:
        value = torch.where(mask, input, 0)
    else:
        value = torch.where(mask | input.isnan(), input, input * slope)
    order = _bitmask.planar_layout(input)
    # relu: value is input (> 0 or NaN) or +0; slope >= 0: value > 0 exactly where input > 0 (x * slope <= 0
    # for x <= 0, NaN stays NaN). Tagged for _shared_masks, which reads the mask from the output instead
    # of a pack where backward reads the output anyway; in place, from the written tensor, which is what the
    # other readers read (functionalized, a copy of value).
    if slope is not None and slope < 0:  # never in place (refused above)
        return value, _shared_masks.pack(_positive, input, order), order
    if inplace:
        input.copy_(value)
        value = input  # dynamo checks that a dirty tensor is returned as the same object
    return value, _shared_masks.pack(_relu_sign if slope is None else _positive, value, order), order


# The mask an eager forward hands to setup_context (``_common.EAGER_HANDOFF``, which says why it is not an output).
_PENDING = _common.EAGER_HANDOFF


def _outputs(input, out, packed, vmappable: bool):
    """What an activation Function's forward returns: in eager ``out`` alone, the mask (or None) parked in
    ``_PENDING`` for setup_context, which takes it from there when ``output`` is not a tuple; traced (torch.compile)
    and under torch.func (``vmappable``), ``(out, packed)``, an empty mask where none is kept. (Traced, a Function
    modifying a view in place may return one tensor only and save no intermediate, so traced in-place calls on
    views run out of place instead: :func:`_traced_inplace_on_view`.)"""
    if not vmappable and not torch.compiler.is_compiling():
        _PENDING.mask = packed
        return out
    return out, (input.new_empty(0, dtype=torch.uint8) if packed is None else packed)


_traced_inplace_on_view = _common.traced_inplace_on_view
_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead
_eager = _common.eager


def _keeps_mask(negative_slope, inplace: bool, keep_output: bool) -> bool:
    """Whether backward reads a packed mask (else the output, or nothing where stock refuses backward: in place
    with a negative slope)."""
    if negative_slope is None:
        return not keep_output
    if negative_slope < 0:
        return not inplace
    return not keep_output


class _ReLUFunction(_common.Function):
    """relu (``negative_slope is None``) and leaky_relu, keeping a packed mask or the output.

    ``apply(input, negative_slope, inplace, keep_output, use, vmappable)`` returns ``(output, packed mask)``
    (an empty mask where the output or nothing is kept), in eager the output alone (``_outputs``).
    ``use`` is (module, UseCell) when a module calls it (``_common.learn_from_use``); ``vmappable`` (set by
    :meth:`under_transform` only) makes forward and backward plain torch ops in the logical order, which vmap
    batches. In eager, forward and backward run the
    ``relu_mask`` kernels in the input's memory order; under torch.compile, the planar format.
    """

    @staticmethod
    def forward(input, negative_slope, inplace, keep_output, use, vmappable):
        if _keeps_mask(negative_slope, inplace, keep_output):
            if vmappable:
                return _vmappable_masked_forward(input, negative_slope)
            if torch.compiler.is_compiling():
                return _traced_masked_forward(input, negative_slope, inplace)[:2]
            out, _PENDING.mask = _masked_forward(input, negative_slope, inplace)
            return out  # eager: the mask goes to setup_context through _PENDING (see _outputs)
        if inplace:
            if negative_slope is None:
                torch.relu_(input)
            else:
                torch._C._nn.leaky_relu_(input, negative_slope)
            out = input  # torch.compile checks that a dirty tensor is returned as the same object
        elif negative_slope is None:
            out = torch.relu(input)
        else:
            out = torch._C._nn.leaky_relu(input, negative_slope)
        return _outputs(input, out, None, vmappable)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, negative_slope, inplace, keep_output, use, vmappable = inputs
        if type(output) is tuple:  # traced or under torch.func
            out, packed = output
            ctx.mark_non_differentiable(packed)
            keeps_mask = _keeps_mask(negative_slope, inplace, keep_output)
        else:  # eager: the mask, if any, comes through _PENDING (see _outputs)
            out, packed = output, _PENDING.mask
            _PENDING.mask = None
            keeps_mask = packed is not None
        if inplace:
            ctx.mark_dirty(input)
        ctx.use = use  # (module, UseCell) when called by a module: see _common.learn_from_use
        ctx.negative_slope = negative_slope
        relu = negative_slope is None
        if not ctx.needs_input_grad[0] or not (relu or negative_slope >= 0 or not inplace):
            # Nothing asked, or stock refuses backward (in place with a negative slope: the input's sign is lost).
            ctx.mode = _REFUSE
            return
        planar = torch.compiler.is_compiling()
        # x's strides, from which backward works out stock's gradient layout (_stock_grad_strides)
        ctx.x_strides = None if vmappable or planar else input.stride()
        ctx.result_operand = relu and not inplace
        if not keeps_mask:
            ctx.mode = _OUTPUT
            ctx.save_for_backward(out)
            return
        ctx.mode = _MASK
        ctx.vmappable = vmappable
        if vmappable:
            ctx.shape = tuple(input.shape)
        else:
            ctx.planar = planar
            if planar:
                ctx.order = _bitmask.planar_layout(input)
            else:
                ctx.perm = _PENDING.perm  # the order _masked_forward packed in
                ctx.impl, _PENDING.impl = _PENDING.impl, None  # and the kernel it packed with
        ctx.save_for_backward(packed)

    @staticmethod
    def backward(ctx, grad, *_grad_packed):
        if ctx.mode == _REFUSE:
            raise RuntimeError(_NEGATIVE_INPLACE)
        gi = _input_grad(ctx, grad)
        if ctx.x_strides is not None:
            strides = (_stock_grad_strides if torch.compiler.is_compiling() else _cached_stock_grad_strides)(
                grad.shape, ctx.x_strides, grad.stride(), ctx.result_operand)
            gi = _layout.conform(gi, strides)
        return gi, None, None, None, None, None

    @staticmethod
    def stock(input, negative_slope, inplace, keep_output, use, vmappable):
        """Stock's op, as ``(output, None)`` (apply's pair)."""
        if negative_slope is None:
            return F.relu(input, inplace=inplace), None
        return F.leaky_relu(input, negative_slope, inplace=inplace), None

    @classmethod
    def under_transform(cls, input, negative_slope, inplace, keep_output, use, vmappable):
        """Out of place (vmap's generated rule cannot return a dirtied input), copied into ``input`` outside the
        Function so that only the mask stays; the module's learning runs from a node pre-hook (``_LearnHook``).
        In place with the output kept (stock keeps its result, the input's own memory, which is what
        keep_output keeps) or a negative slope (refused by stock's backward), stock runs."""
        keep_output = keep_output and (negative_slope is None or negative_slope >= 0)
        if inplace and (keep_output or (negative_slope is not None and negative_slope < 0)):
            return cls.stock(input, negative_slope, inplace, keep_output, use, vmappable)
        out, packed = super().under_transform(input, negative_slope, False, keep_output, None, True)
        return _finish_activation(input, out, inplace, use), packed


def _finish_activation(input, out, inplace, use):
    """After an activation Function ran out of place under torch.func: the producer/consumer hook on the output
    (``use``: (module, UseCell)), and the in-place form written back into ``input``."""
    if use is not None and out.grad_fn is not None:
        out.grad_fn.register_prehook(_LearnHook(*use))
    if inplace:
        return input.copy_(out)
    return out


def _stock_grad_strides(shape, x_strides, grad_strides, result_operand: bool):
    """The strides of stock's input gradient (``threshold_backward(grad, result)`` / ``leaky_relu_backward(grad,
    x)``: TensorIterator takes the result or x first, so its layout leads and the gradient's breaks ties, size-1
    dimensions), from x's strides; ``result_operand``: stock reads relu's out-of-place result, laid out as the unary
    op lays it. One cached call in eager: the same inputs come back every step."""
    operand = _layout.binary_strides(shape, x_strides, x_strides) if result_operand else x_strides
    return _layout.binary_strides(shape, operand, grad_strides)


_cached_stock_grad_strides = functools.lru_cache(maxsize=1024)(_stock_grad_strides)


def _input_grad(ctx, grad):
    """_ReLUFunction's input gradient (values; the caller fixes the layout)."""
    (saved,) = ctx.saved_tensors
    if ctx.use is not None:
        learn_from_use(*ctx.use)
    slope = ctx.negative_slope
    if ctx.mode == _OUTPUT:
        if slope is None:
            return torch.ops.aten.threshold_backward(grad, saved, 0)
        return torch.ops.aten.leaky_relu_backward(grad, saved, slope, True)
    if ctx.vmappable:
        mask = _bitmask.unpack_vmappable(saved, ctx.shape)
        return torch.where(mask, grad, 0) if slope is None else torch.where(mask, grad, grad * slope)
    if ctx.planar:
        mask = _shared_masks.unpack(saved, grad.shape, ctx.order)
        return torch.where(mask, grad, 0 if slope is None else grad * slope)
    perm = ctx.perm
    g = grad if perm is None else grad.permute(perm)
    if grad.requires_grad:  # double backward: stay differentiable in grad
        mask = _bitmask.unpack(saved, g.shape)
        if slope is None:
            gi = torch.where(mask, g, 0)
        else:
            gi = torch.where(mask, g, g * slope)
    else:
        if not g.is_contiguous():
            g = g.contiguous()
        # the forward's kernel; traced (compiled autograd over an eager forward), the registry's answer there
        gi = (relu_mask.choose(g) if torch.compiler.is_compiling() else ctx.impl).backward(g, saved, slope)
    if perm is not None:
        gi = gi.permute(_inverse(perm))
    return gi


def _core_for(input):
    """The core module where an eager ReLU / LeakyReLU call on ``input`` runs it (csrc.for_eager), else None."""
    return csrc.for_eager(input, cuda=relu_mask.core_serves_cuda(input))


def _check_slope(negative_slope) -> float:
    if isinstance(negative_slope, torch.Tensor) and negative_slope.dim() == 0 and not negative_slope.is_complex():
        return float(negative_slope.item())  # a 0-d tensor, which stock takes as a number
    if not isinstance(negative_slope, numbers.Real):  # (a bool is a number to stock: True is 1.0)
        raise TypeError(f"leaky_relu: argument 'negative_slope' must be a real number, got "
                        f"{type(negative_slope).__name__}")
    return float(negative_slope)


def _apply(input, negative_slope, inplace, keep_output, fn, use=None):
    """Run stock where no gradient will be asked of us; otherwise our Function."""
    check_tensor(input, "input", fn=fn)
    if not (torch.is_grad_enabled() and input.requires_grad) or _common.foreign_input(input):
        if negative_slope is None:
            return F.relu(input, inplace=inplace)
        return F.leaky_relu(input, negative_slope, inplace=inplace)
    if inplace and input.is_leaf:
        raise RuntimeError(_LEAF_INPLACE)
    if negative_slope is not None and not inplace and _common.input_smaller_than_mask(input):
        return F.leaky_relu(input, negative_slope)  # stock keeps x: a broadcast view's small storage
    core = _core_for(input)
    if core is not None:
        out = core.relu_mask_apply(input, negative_slope, bool(inplace), bool(keep_output))
        if out is not None:
            if use is not None:
                # The core's backward does not call back into Python: a node pre-hook folds the call's UseCell
                # into the module when its gradient arrives, as _ReLUFunction's backward does.
                out.grad_fn.register_prehook(_LearnHook(*use))
            return out
    if inplace and _traced_inplace_on_view(input):
        if negative_slope is not None and negative_slope < 0:
            return F.leaky_relu(input, negative_slope, inplace=True)  # stock refuses its backward, as we do
        return input.copy_(_ReLUFunction.apply(input, negative_slope, False, bool(keep_output), use, False)[0])
    out = _ReLUFunction.apply(input, negative_slope, bool(inplace), bool(keep_output), use, False)
    return out if type(out) is not tuple else out[0]  # eager: the output alone (see _outputs)


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


class LazyUseCell(UseCell):
    """The UseCell of a core call that kept a mask (the module's output was not kept last step): the pre-hook
    that reports the use to the module (``_LearnHook``) is registered only when a consumer marks the cell
    kept (``note_input_kept``), the one case in which the module's decision can change. A call nobody keeps
    then costs no hook and no ``learn_from_use`` in backward (measured ~6 µs of a ~30 µs tiny ReLU step),
    and the decision comes out as the eager rule's: the OR over the step's calls, published after backward."""

    __slots__ = ("_kept", "module", "node")

    def __init__(self, module, node):
        self.module, self.node = module, node
        super().__init__()

    @property
    def kept(self):
        return self._kept

    @kept.setter
    def kept(self, value):
        if value and not getattr(self, "_kept", False):
            # The hook holds a cell that is always kept, not this one: this one holds the node, and a node that
            # holds (through its hook) what holds it is a cycle through C++ that Python's collector cannot see:
            # a forward whose graph got no backward (a validation pass with grad on, an output turned into
            # bytes) leaked its graph, saved tensors included, every call.
            self.node.register_prehook(_LearnHook(self.module, _ALWAYS_KEPT))
            self.node = None  # (nothing more to register)
        self._kept = value


_ALWAYS_KEPT = UseCell()
_ALWAYS_KEPT.kept = True


def _module_forward(module, input, negative_slope):
    """Shared by the ReLU/LeakyReLU modules: keep the output instead of a mask when a consumer kept this
    module's output during the previous step (then it is shared, not extra); see the producer/consumer
    rule in ``_common``."""
    keep_output = module.__dict__.get("_slimgrad_output_kept", False)  # no nn.Module.__getattr__ miss
    if (negative_slope is not None and not module.inplace and type(input) is torch.Tensor and input.requires_grad
            and torch.is_grad_enabled()):
        count_call(module)  # stock's leaky_relu keeps its input (in place: its result): output only if every call's
    if keep_output and _common.in_checkpointed_forward():
        # a checkpointed region keeps the mask, the default: its recomputation, after another backward may have
        # published a new decision, must save what its forward saved
        keep_output = False
    if not keep_output and type(input) is torch.Tensor and input.requires_grad and torch.is_grad_enabled():
        # The common case in one call, with the producer's bookkeeping made lazy (LazyUseCell): the compiled core,
        # else, in eager, the Python Function (CUDA's path, where the core does not serve).
        inplace = bool(module.inplace)
        if inplace and input.is_leaf:
            raise RuntimeError(_LEAF_INPLACE)
        if negative_slope is not None and not inplace and _common.input_smaller_than_mask(input):
            return F.leaky_relu(input, negative_slope)
        core = _core_for(input)
        if core is not None:
            out = core.relu_mask_apply(input, negative_slope, inplace, False)
            if out is not None:
                mark_producer(out, LazyUseCell(module, out.grad_fn))
                return out
        if _eager():
            out = _C_APPLY(_ReLUFunction, _unwrap_if_dead(input), negative_slope, inplace, False, None, False)
            mark_producer(out, LazyUseCell(module, out.grad_fn))
            return out
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
