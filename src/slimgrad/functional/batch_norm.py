"""Batch normalisation that keeps for backward only what the requested gradients read.

Stock ``native_batch_norm`` keeps the input whenever the input or the weight needs a gradient, in every
mode. But with x̂ = (x - mean) * invstd and y = x̂ * w + b:

* training (batch statistics): dX and dW read x (to rebuild x̂) and the per-channel mean/invstd; dB reads
  nothing but dY. So x is kept only when X or W needs a gradient.
* evaluation (running statistics): dX = dY * w * invstd_running reads no input-sized tensor; dW reads x;
  dB reads nothing. So x is kept only when W needs a gradient.

Backward runs stock's own kernel (``native_batch_norm_backward``; on CUDA, in training where stock runs cuDNN,
``cudnn_batch_norm_backward``), so every gradient is bitwise what stock computes. Where x was not kept, the
kernel is handed a tensor with x's shape and strides whose *values* it only folds into the weight-gradient dot
product, which is then not requested: a view of dY itself when both are dense (so the kernel takes exactly the
code path it takes for stock), else a zero-stride stand-in (stock then takes the strided path too, as dY or x
is not dense).

Eager CPU and CUDA calls run the compiled core's ``batch_norm_forward`` (``csrc/batch_norm.cpp``): one C++ autograd
Function with these same decisions and aten's same kernels, at about stock's cost per call where the Python Function
and its checks cost tens of microseconds more. On CUDA, where stock's ``F.batch_norm`` picks cuDNN (aten's selector,
asked with the same arguments), both run cuDNN as stock does; evaluation on a channels-last CUDA x runs the Python
Function (tests/test_cuda_exact.py compares the bits with stock); ``SLIMGRAD_CORE_CUDA=0`` leaves all of CUDA to the
Python Function. Autocast, torch.compile, torch.func, tensor subclasses and other devices run the Python Function,
the reference the core is tested against bit for bit.
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format
from torch.overrides import handle_torch_function, has_torch_function_variadic

from slimgrad import csrc
from slimgrad.functional import _common

__all__ = ["BatchNormFunction", "batch_norm"]

_aten = torch.ops.aten


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``[storage_offset, storage_offset + numel)`` exactly (no gaps, no
    overlaps), i.e. any other dense layout of the same shape fits in the same memory."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _channels_last_format(t: torch.Tensor):
    """The channels-last memory format ``t`` is laid out in (which stock gives its input gradient), or
    None."""
    if t.is_contiguous():
        return None
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dim and t.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _shape_only_input(grad_out: torch.Tensor, shape, stride, x_dense: bool) -> torch.Tensor:
    """A stand-in for the input x, for backward kernels that only fold x's values into the weight
    gradient's dot product, which is not requested. It has x's strides so that the CPU kernel picks the
    same code path (contiguous / channels-last / strided) as it did for stock, which matters for the
    reduced-precision paths' rounding."""
    if x_dense and _dense(grad_out):
        # Same numel, both dense: x's layout fits exactly in dY's memory. Read only, never written.
        return grad_out.as_strided(shape, stride)
    # x or dY is not dense, so stock took the strided path as well; that path reads x through
    # TensorIterator without copying it, so a zero-stride tensor costs one element.
    return _common.standin(shape, grad_out)


def _eval_grad_input(grad_out, weight, running_var, eps, shape, stride):
    """dX = dY * invstd * w in evaluation, rounded as stock's strided CPU kernel rounds it when the
    parameters have dY's dtype: invstd = 1/sqrt(var + eps) in double, rounded once to the parameters'
    dtype, then two products each rounded to that dtype."""
    bcast = [1] * len(shape)
    bcast[1] = shape[1]
    invstd = (running_var.double() + eps).sqrt().reciprocal().to(running_var.dtype)
    dx = grad_out.new_empty_strided(shape, stride)
    torch.mul(grad_out, invstd.view(bcast), out=dx)
    if weight is not None:
        dx.mul_(weight.view(bcast))
    return dx


def _stat_dtype(input: torch.Tensor, running_mean: torch.Tensor | None) -> torch.dtype:
    """The dtype of ``native_batch_norm``'s (empty, unread) statistics in evaluation: on CUDA the input's
    accumulation type, elsewhere the running statistics' dtype."""
    if input.is_cuda:
        return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    return input.dtype if running_mean is None else running_mean.dtype


def _stock_uses_cudnn(input, weight, bias, running_mean, running_var, training, eps) -> bool:
    """Whether stock's ``torch.batch_norm`` runs cuDNN for these arguments (aten's own selector decides; it
    needs the weight and bias, and reads only whether the running statistics are defined)."""
    if weight is None or bias is None:
        return False
    running_mean = weight if running_mean is None else running_mean
    running_var = weight if running_var is None else running_var
    backend = torch._C._select_batch_norm_backend(input, weight, bias, running_mean, running_var, training, eps)
    return backend == torch._C._BatchNormBackend.Cudnn


def _cudnn_forward(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``cudnn_batch_norm`` on the operands ``_batch_norm_impl_index`` hands it (the same copies, if any)."""
    memory_format = torch.contiguous_format if input.is_contiguous() else suggest_memory_format(input)
    return torch.cudnn_batch_norm(
        input.contiguous(memory_format=memory_format), weight.contiguous(), bias.contiguous(),
        None if running_mean is None else running_mean.contiguous(),
        None if running_var is None else running_var.contiguous(), training, momentum, eps,
    )


def _cudnn_grad_bias(grad_out, ctx, _x, weight, _bias, running_mean, running_var, save_mean, save_invstd, reserve):
    """dB = sum(dY) from stock's kernel, ``cudnn_batch_norm_backward`` (which computes dX and dW as well, as it
    does for stock). Its x operand is dY itself, laid out as stock lays x out for it: dB does not read x, and
    dX/dW, which do, are dropped."""
    grad_out = grad_out.contiguous(memory_format=ctx.cudnn_format)
    return _aten.cudnn_batch_norm_backward.default(grad_out, grad_out, weight, running_mean, running_var, save_mean,
                                           save_invstd, ctx.eps, reserve)[2]


class BatchNormFunction(_common.Function):
    """``native_batch_norm`` with a backward that keeps x only where a requested gradient reads it.

    On CUDA, where stock's ``torch.batch_norm`` picks cuDNN (aten's selector, asked with the same arguments),
    forward runs ``cudnn_batch_norm`` instead, on the operands stock hands it: native's reductions and affine step
    round differently (scripts/gpu_stock_diff.py). Evaluation's backward is ``native_batch_norm_backward`` there
    too (stock's derivative for cuDNN in evaluation); training's (only dB reaches it) is ``cudnn_batch_norm_backward``.

    Running statistics are updated in place by the forward kernel, exactly as in stock. Double backward
    is refused (``once_differentiable``): stock's double backward needs x and the saved statistics in
    every case, which is what this Function exists to avoid keeping.

    ``apply(input, weight, bias, running_mean, running_var, training, momentum, eps, transformed)`` returns
    the output in evaluation, and ``native_batch_norm``'s ``(output, save_mean, save_invstd)`` in training: the
    batch statistics are outputs so that ``setup_context`` can keep them (evaluation reads the running ones, and
    two more outputs would cost about 1 µs a call). ``transformed`` is True only under torch.func
    (``under_transform``), where dX is contiguous whatever x's layout (stock's there); forward cannot tell, as
    under ``grad`` it runs on plain tensors with no transform active.
    """

    @staticmethod
    def forward(input, weight, bias, running_mean, running_var, training, momentum, eps, transformed):
        if input.is_cuda and not transformed and not torch.compiler.is_compiling():
            cudnn = _stock_uses_cudnn(input, weight, bias, running_mean, running_var, training, eps)
        else:
            cudnn = False
        if cudnn:
            # Stock's kernel (cuDNN), so output, statistics and running statistics are stock's bits (traced, both
            # decompose to the same ops; under torch.func stock runs native too). Training
            # returns cuDNN's reserve as a fourth output: its backward (dB, the one gradient this Function
            # computes in training without keeping x) reads it.
            result = _cudnn_forward(input, weight, bias, running_mean, running_var, training, momentum, eps)
            return result if training else result[0]
        # torch's binding of aten's op: ~3 us a call less than torch.ops.aten's packet (its Python dispatch)
        result = torch.native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
        return result if training else result[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, running_mean, running_var, training, momentum, eps, transformed = inputs
        reserve = None
        if training:
            save_mean, save_invstd = output[1], output[2]
            if len(output) == 4:  # cuDNN's forward (CUDA), whose backward reads its reserve
                reserve = output[3]
                ctx.mark_non_differentiable(reserve)
            ctx.mark_non_differentiable(save_mean, save_invstd)
            # No zero gradients for the statistics (C-sized tensors made before each backward otherwise).
            ctx.set_materialize_grads(False)
            ctx.stat_dtype = save_mean.dtype
        else:
            save_mean = save_invstd = None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = need_w and weight is not None
        need_b = need_b and bias is not None
        ctx.mask = (need_x, need_w, need_b)
        ctx.training = training
        ctx.eps = eps
        ctx.x_shape = input.shape
        ctx.x_stride = input.stride()
        ctx.x_dense = _dense(input)
        # Under torch.func the gradient is contiguous whatever x's layout (stock's there: TRANSFORM_LAYOUT).
        ctx.x_format = None if transformed else _channels_last_format(input)
        ctx.transformed = transformed
        if not (need_x or need_w or need_b):
            return
        # dW always reads x; in training dX reads it as well (through x̂ and the batch statistics).
        keep_x = need_w or (training and need_x)
        if keep_x:
            _common.note_input_kept(input)
        bias_as_stats = training and not keep_x
        # cuDNN's training backward (only dB is requested here) reads its own statistics and reserve: C-sized
        # statistics, and a reserve cuDNN sizes for itself (stock keeps both, and x).
        ctx.cudnn = reserve is not None
        if ctx.cudnn:
            # The layout cuDNN got x in (stock hands it dY in that layout).
            ctx.cudnn_format = torch.contiguous_format if input.is_contiguous() else suggest_memory_format(input)
            ctx.save_for_backward(None, weight, None, running_mean, running_var, save_mean, save_invstd, reserve)
            return
        ctx.save_for_backward(
            input if keep_x else None,
            weight,
            # A parameter (not counted), only read where the statistics' values do not matter.
            bias if bias_as_stats else None,
            # Evaluation reads the running statistics (parameters' peers: buffers, not counted).
            running_mean if not training else None,
            running_var if not training else None,
            save_mean if training and keep_x else None,
            save_invstd if training and keep_x else None,
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_stats):
        need_x, need_w, need_b = ctx.mask
        if not (need_x or need_w or need_b):
            return (None,) * 9
        if ctx.cudnn:
            return (None, None, _cudnn_grad_bias(grad_out, ctx, *ctx.saved_tensors)) + (None,) * 6
        x, weight, bias, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
        standin = x is None
        # Evaluation, channels-last x, non-dense dY (e.g. ``sum().backward()``): stock's strided kernel
        # lays dX out like x, but fed a zero-stride stand-in it would lay it out contiguously. Compute dX
        # directly there (same rounding when the parameters have dY's dtype) instead of restriding it.
        # On CUDA the stand-in would also turn stock's separate dX pass into the fused kernel where dB is
        # requested: dX gets its own call there (the elementwise kernel stock runs; contiguous, as stock's).
        direct_dx = (
            need_x and standin and not ctx.training and ctx.x_format is not None
            and not (ctx.x_dense and _dense(grad_out))
            and (running_var.dtype == grad_out.dtype or not grad_out.is_cpu)
        )
        dx = dw = db = None
        if direct_dx and grad_out.is_cpu:
            dx = _eval_grad_input(grad_out, weight, running_var, ctx.eps, ctx.x_shape, ctx.x_stride)
        elif direct_dx:
            empty = grad_out.new_empty(0, dtype=_stat_dtype(grad_out, running_mean))
            # (not restrided: CUDA's evaluation kernel writes dX into a contiguous tensor whatever x's layout,
            # ``at::empty(input.sizes())`` in batch_norm_elementwise_backward_eval, and so does stock's)
            dx = _aten.native_batch_norm_backward.default(
                grad_out, _shape_only_input(grad_out, ctx.x_shape, ctx.x_stride, ctx.x_dense), weight,
                running_mean, running_var, empty, empty, False, ctx.eps, [True, False, False],
            )[0]
        if need_w or need_b or (need_x and not direct_dx):
            if standin:
                x = _shape_only_input(grad_out, ctx.x_shape, ctx.x_stride, ctx.x_dense)
            if ctx.training and save_mean is None:
                # Only dB = sum(dY) is requested, but the kernel still reads per-channel statistics for
                # the unrequested dX/dW terms. Any C-sized tensor of the statistics' dtype will do: the
                # bias has that dtype in every combination the kernel accepts, and costs no allocation.
                if bias.dtype == ctx.stat_dtype and bias.is_contiguous():
                    save_mean = save_invstd = bias.detach()
                else:
                    save_mean = save_invstd = grad_out.new_zeros(ctx.x_shape[1], dtype=ctx.stat_dtype)
            if not ctx.training and save_mean is None and (ctx.transformed or not grad_out.is_cpu):
                # CUDA's kernel and vmap's batching rule assert that the (unused in evaluation) batch statistics are
                # defined (the CPU kernel takes None: one allocation less a call).
                save_mean = save_invstd = grad_out.new_empty(0, dtype=_stat_dtype(grad_out, running_mean))
            kdx, dw, db = _aten.native_batch_norm_backward.default(
                grad_out,
                x,
                weight,
                running_mean,
                running_var,
                save_mean,
                save_invstd,
                ctx.training,
                ctx.eps,
                [need_x and not direct_dx, need_w, need_b],
            )
            if need_x and not direct_dx:
                dx = kdx
                if (standin and ctx.x_format is not None and dx.stride() != ctx.x_stride
                        and (grad_out.is_cpu or ctx.training)):
                    # Mixed precision in the case above: restride (AccumulateGrad would copy anyway). Not CUDA's
                    # evaluation: its kernel's dX is contiguous for any x, stock's too.
                    dx = dx.contiguous(memory_format=ctx.x_format)
        return (dx if need_x else None, dw if need_w else None, db if need_b else None,
                None, None, None, None, None, None)

    @classmethod
    def under_transform(cls, *args):
        if any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in args[1:5]):
            # vmap over stacked weights or statistics (torch.func's ensembling recipe, stack_module_state): vmap's
            # rule for batch norm then returns a view made inside the Function, which autograd forbids changing in
            # place (a ResNet's ReLU(inplace=True) or `y += identity` raised where stock runs; the param sweep).
            # Stock's op there: its numbers and its memory
            return cls.stock(*args)
        return super().under_transform(*args[:-1], True)

    @staticmethod
    def stock(input, weight, bias, running_mean, running_var, training, momentum, eps, transformed):
        """Stock's batch norm, shaped like ``apply``'s result (no statistics)."""
        out = torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        return (out, None, None) if training else out


def _check_features(name: str, t: torch.Tensor | None, num_features: int) -> None:
    if t is not None and t.numel() != num_features:
        raise RuntimeError(f"{name} should contain {num_features} elements not {t.numel()}")


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.batch_norm``: same outputs, gradients and in-place running-stat
    updates, keeping for backward only what the requested gradients read (see the module docstring).

    Where stock keeps what we would keep (the weight trains, or batch statistics with X needing grad: x
    is read either way), stock's functional runs directly, with no Function around it."""
    if (
        torch.is_grad_enabled()
        and isinstance(input, torch.Tensor)
        and ((weight is not None and weight.requires_grad) or (training and input.requires_grad))
    ):
        _common.note_input_kept(input)
        return torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training,
                                              momentum, eps)
    # (Under autocast too: batch norm is on none of autocast's lists, so its tensors arrive as they are, and the
    # Python Function there cost input-only loops under CPU bf16 autocast 1.4-2.1x stock's step; the input-only sweep.)
    # (CUDA too, where stock runs cuDNN as well: the core runs cuDNN there as stock does, with no Python Function
    # in the call. Evaluation on a channels-last CUDA x stays with the Python Function: its direct dX there is
    # CUDA's kernel, the core's is rounded as stock's CPU kernel rounds it)
    core = csrc.for_eager(input, cuda=True)
    if (core is not None and type(weight) in _PLAIN_OR_NONE and type(bias) in _PLAIN_OR_NONE
            and type(running_mean) in _PLAIN_OR_NONE and type(running_var) in _PLAIN_OR_NONE
            and input.dim() >= 2 and input.numel() != 0
            and not (input.is_cuda and not training and _channels_last_format(input) is not None)):
        _check_arguments(input, running_mean, running_var, weight, bias, training, eps)
        cudnn = input.is_cuda and _stock_uses_cudnn(input, weight, bias, running_mean, running_var, training, eps)
        return core.batch_norm_forward(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                       cudnn)
    if has_torch_function_variadic(input, running_mean, running_var, weight, bias):
        return handle_torch_function(
            batch_norm, (input, running_mean, running_var, weight, bias), input, running_mean,
            running_var, weight=weight, bias=bias, training=training, momentum=momentum, eps=eps,
        )
    _common.check_tensor(input, "input", fn="batch_norm")
    if input.dim() < 2 or input.numel() == 0:
        # Stock's own error for too few dims, and its special case for empty inputs (nothing to keep).
        return torch.nn.functional.batch_norm(
            input, running_mean, running_var, weight, bias, training, momentum, eps
        )
    _check_arguments(input, running_mean, running_var, weight, bias, training, eps)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        out = BatchNormFunction.apply(input, weight, bias, running_mean, running_var, training, momentum, eps, False)
    else:
        # _common.Function.apply's eager branch, called directly: its generic argument handling cost ~2 µs a call on
        # the Python path. Tensors unwrapped as its unwrap_dead_wrappers does.
        out = _C_APPLY(BatchNormFunction, _unwrap_if_dead(input), _unwrap(weight), _unwrap(bias),
                       _unwrap(running_mean), _unwrap(running_var), training, momentum, eps, False)
    return out[0] if training else out


_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, type(None))
_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead


def _unwrap(t):
    return t if t is None else _unwrap_if_dead(t)


def _check_arguments(input, running_mean, running_var, weight, bias, training, eps) -> None:
    """The checks stock's ``F.batch_norm`` and ``torch.batch_norm`` make before the kernel (the kernel itself does
    not check, and reads out of bounds on a mismatch), with stock's messages."""
    if training:
        torch.nn.functional._verify_batch_size(input.size())
    if training and eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif eps < 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    num_features = input.shape[1]
    if running_mean is not None:
        _check_features("running_mean", running_mean, num_features)
    elif not training:
        raise RuntimeError("running_mean must be defined in evaluation mode")
    if running_var is not None:
        _check_features("running_var", running_var, num_features)
    elif not training:
        raise RuntimeError("running_var must be defined in evaluation mode")
    _check_features("weight", weight, num_features)
    _check_features("bias", bias, num_features)
