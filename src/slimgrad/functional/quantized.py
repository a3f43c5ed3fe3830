"""Linear layers over frozen quantized weights (bitsandbytes 4-bit and int8, torchao NF4) that keep only
references to the packed weight and its quantization state for backward.

A frozen quantized base only ever needs ``dX = dY · dequant(W)``: the packed weight (already resident) and
its scales. What bitsandbytes keeps instead, and why this module exists:

* ``MatMul8bitFp`` (the CPU/XPU training path) keeps its whole input ``A`` as ``ctx.A``, unconditionally,
  although nothing reads it unless the int8 weight trains, which it cannot.
* ``MatMul8bitLt`` keeps ``A`` (and int8 copies of it when the weight needs grad) in ``ctx.tensors``.
* ``matmul_4bit``'s deprecated ``[K, N]`` branch dequantizes and calls ``F.linear`` outside any Function,
  so autograd keeps the whole dequantized weight per layer.
* all of them keep their tensors as ctx attributes, where saved-tensor hooks (offloading, counting) and
  checkpointing cannot see them.

Here the input is never kept, the dequantized weight is rebuilt in backward from the packed tensors, and
every kept tensor goes through ``save_for_backward``. The forward runs bitsandbytes' own ops with the same
arguments and backward the same dequantization and matmul, so results are bitwise bitsandbytes' own.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from slimgrad.functional import _common

__all__ = ["QuantizedLinearFunction", "linear_4bit", "linear_8bit", "linear_nf4"]

_INSTALL = "pip install 'slimgrad[bnb]'"


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401
    except ImportError as e:
        raise ImportError(f"slimgrad.functional.quantized needs bitsandbytes for this function: {_INSTALL}") from e
    return bitsandbytes


class _Meta(NamedTuple):
    """What backward needs besides tensors: which dequantization, and its non-tensor parameters."""

    kind: str  # "4bit", "4bit_kn" (weight quantized as [K, N]), "int8", "nf4"
    static: tuple  # 4-bit: (shape, blocksize, quant_type, dtype, nested, blocksize2, dtype2)
    x_shape: tuple
    x_dtype: torch.dtype
    bias_dtype: torch.dtype | None


def _quant_state_tensors(qs) -> tuple:
    """The tensors of a bitsandbytes QuantState, in the order :func:`_rebuild_quant_state` reads them."""
    if qs.nested:
        return (qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code)
    return (qs.absmax, qs.code)


def _quant_state_static(qs) -> tuple:
    if qs.nested:
        return (tuple(qs.shape), qs.blocksize, qs.quant_type, qs.dtype, True, qs.state2.blocksize, qs.state2.dtype)
    return (tuple(qs.shape), qs.blocksize, qs.quant_type, qs.dtype, False, None, None)


def _rebuild_quant_state(static, tensors):
    """A QuantState over the unpacked saved tensors, so offloading hooks that moved them are honoured."""
    from bitsandbytes.functional import QuantState

    shape, blocksize, quant_type, dtype, nested, blocksize2, dtype2 = static
    if nested:
        absmax, code, offset, absmax2, code2 = tensors
        state2 = QuantState(absmax=absmax2, code=code2, blocksize=blocksize2, dtype=dtype2)
        return QuantState(absmax=absmax, shape=torch.Size(shape), code=code, blocksize=blocksize,
                          quant_type=quant_type, dtype=dtype, offset=offset, state2=state2)
    absmax, code = tensors
    return QuantState(absmax=absmax, shape=torch.Size(shape), code=code, blocksize=blocksize, quant_type=quant_type,
                      dtype=dtype)


def _gemm_4bit(x, packed, qs, bias):
    """bitsandbytes' ``MatMul4Bit.forward`` kernel call, argument for argument."""
    if not qs.nested:
        return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, qs.shape, qs.absmax, qs.blocksize, qs.quant_type,
                                                        bias=bias)
    if qs.state2.blocksize != 256:
        raise NotImplementedError("nested quantization with state2.blocksize != 256 is not supported")
    return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, qs.shape, qs.state2.absmax, qs.blocksize,
                                                    qs.quant_type, bias=bias, absmax_8bit=qs.absmax,
                                                    absmax_code=qs.state2.code, absmax_offset=qs.offset)


def _dequant_int8(cb, scb, dtype):
    """bitsandbytes' int8 row-wise dequantization, op for op (``MatMul8bitFp``/``MatMul8bitLt``)."""
    return cb.to(dtype, copy=True).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))


class QuantizedLinearFunction(_common.Function):
    """``y = x · dequant(W)ᵀ + b`` for a frozen quantized W.

    ``tensors`` are the packed weight followed by its state tensors (4-bit: absmax, code and, nested,
    offset, nested absmax and code; int8: the int8 rows and their fp32 scales; NF4: the NF4Tensor). They are
    saved (as references: they are the module's own) only when dX is requested; the input never is.
    ``spec`` carries the non-tensor parameters: ``(kind, static, int8_threshold, int8_training, lt_state)``.
    In functorch's form (nothing but the output to hand to ``setup_context``), so the one Function serves
    eager calls, torch.compile and torch.func (:mod:`slimgrad.functional._transforms`).
    """

    @staticmethod
    def forward(x, bias, spec, *tensors):
        kind, static, threshold, training, lt_state = spec
        if kind in ("4bit", "4bit_kn"):
            packed, qs = tensors[0], _rebuild_quant_state(static, tensors[1:])
            if kind == "4bit":
                out = _gemm_4bit(x, packed, qs, bias)
            else:  # matmul_4bit's deprecated branch, inside the Function so the dequantized copy is not kept
                w = _bnb().functional.dequantize_4bit(packed, qs).to(x.dtype)
                out = F.linear(x, w.t(), bias)
        elif kind == "int8":
            cb, scb = tensors
            if training:  # MatMul8bitFp
                out = F.linear(x, _dequant_int8(cb, scb, x.dtype), bias)
            else:  # MatMul8bitLt, fast path (the int8 weight is frozen)
                a = x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x
                ca, sca, outlier_cols = _bnb().functional.int8_vectorwise_quant(a.to(torch.float16),
                                                                                threshold=threshold)
                if threshold > 0.0:
                    if lt_state is not None:
                        lt_state.idx = outlier_cols
                    out, _ = torch.ops.bitsandbytes.int8_mixed_scaled_mm(a, ca, cb, sca, scb, outlier_cols, bias)
                else:
                    out = torch.ops.bitsandbytes.int8_scaled_mm.default(ca, cb, sca, scb, bias=bias, dtype=a.dtype)
                if x.dim() == 3:
                    out = out.reshape(*x.shape[:-1], cb.shape[0])
        elif kind == "nf4":
            out = F.linear(x, tensors[0].to(x.dtype))
        else:
            raise ValueError(f"QuantizedLinearFunction: unknown kind {kind!r}")
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, spec, *tensors = inputs
        ctx.meta = _Meta(spec[0], spec[1], tuple(x.shape), x.dtype, None if bias is None else bias.dtype)
        # References only: the packed weight and its state are the module's own tensors.
        ctx.save_for_backward(*(tensors if ctx.needs_input_grad[0] else ()))

    @staticmethod
    def stock(x, bias, spec, *tensors):
        """bitsandbytes' computation with differentiable torch ops, what runs under transforms the Function
        does not serve: bitsandbytes' own autograd Functions have no functorch form (they are refused under
        any transform), so the weight is dequantized as its backward does and ``F.linear`` applies it (the
        int8 inference kernel, ``int8_training=False``, rounds otherwise: this is its training path's math)."""
        kind, static = spec[0], spec[1]
        if kind in ("4bit", "4bit_kn"):
            w = _bnb().functional.dequantize_4bit(tensors[0], _rebuild_quant_state(static, tensors[1:])).to(x.dtype)
            return F.linear(x, w.t() if kind == "4bit_kn" else w, bias)
        if kind == "int8":
            return F.linear(x, _dequant_int8(tensors[0], tensors[1], x.dtype), bias)
        return F.linear(x, tensors[0].to(x.dtype), bias)  # nf4: torchao's LinearNF4

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        meta = ctx.meta
        saved = ctx.saved_tensors
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dbias = None
        if need_bias:
            # bitsandbytes sums over dim 0 only; autograd then sums a 3-D input's remaining leading dim. Doing
            # the same keeps the bias gradient bitwise bitsandbytes'.
            dbias = grad.sum(0, dtype=meta.bias_dtype)
        if need_x:
            # (the dequantized weight as a temporary, as bitsandbytes' backward has it: freed by the cast before the
            # product where the dtypes differ; held in a name, an fp32 weight stayed alive beside its bf16 copy through
            # the product, 1.09x stock's backward peak on one layer)
            if meta.kind == "4bit":
                dx = torch.matmul(grad, _bnb().functional.dequantize_4bit(
                    saved[0], _rebuild_quant_state(meta.static, saved[1:])).to(grad.dtype))
            elif meta.kind == "4bit_kn":
                dx = torch.matmul(grad, _bnb().functional.dequantize_4bit(
                    saved[0], _rebuild_quant_state(meta.static, saved[1:])).to(meta.x_dtype).t())
            elif meta.kind == "int8":
                g = grad.reshape(-1, grad.shape[-1]).contiguous() if grad.dim() == 3 else grad
                dx = torch.matmul(g.to(meta.x_dtype), _dequant_int8(saved[0], saved[1], meta.x_dtype))
                dx = dx.view(meta.x_shape)
            else:  # nf4: torchao's LinearNF4.backward
                dx = grad @ saved[0].to(grad.dtype)
        return (dx, dbias, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def _check_x(x, fn):
    _common.check_tensor(x, "x", fn=fn)
    if not x.is_floating_point():
        raise TypeError(f"{fn}: 'x' must be a floating-point tensor, got {x.dtype}")


def linear_4bit(x: torch.Tensor, weight: torch.Tensor, quant_state, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bitsandbytes.matmul_4bit(x, weight, quant_state, bias=bias)`` keeping only references to the packed
    weight and its state for backward (stock keeps them out of reach of saved-tensor hooks, and its
    deprecated ``[K, N]`` branch keeps a whole dequantized weight)."""
    fn = "linear_4bit"
    _bnb()
    _check_x(x, fn)
    _common.check_tensor(weight, "weight", fn=fn)
    if quant_state is None or not hasattr(quant_state, "absmax"):
        raise ValueError(f"{fn}: 'quant_state' must be the weight's bitsandbytes QuantState, got {quant_state!r}")
    if len(quant_state.shape) != 2:
        raise ValueError(f"{fn}: 'quant_state.shape' must be 2-D [N, K], got {list(quant_state.shape)}")
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError(f"{fn}: 'weight' is repacked for CPU inference (packing_format_for_cpu); bitsandbytes "
                         "only uses that layout without gradients")
    if quant_state.nested and quant_state.state2.blocksize != 256:
        raise NotImplementedError(f"{fn}: nested quantization with state2.blocksize != 256 is not supported")
    k = x.shape[-1]
    kind = "4bit_kn" if k == quant_state.shape[0] and k != quant_state.shape[1] else "4bit"
    spec = (kind, _quant_state_static(quant_state), 0.0, True, None)
    tensors = (weight.view(-1, 1), *_quant_state_tensors(quant_state))
    if type(x) is torch.Tensor and _common.eager():
        # Function.apply's eager branch called directly (torch's C apply, tensors unwrapped as it does), without its
        # generic argument handling (~1 us a call; a 4-bit layer's forward costs ~8 us more than bitsandbytes' own)
        return _C_APPLY(QuantizedLinearFunction, _unwrap_if_dead(x), None if bias is None else _unwrap_if_dead(bias),
                        spec, *[_unwrap_if_dead(t) for t in tensors])
    return QuantizedLinearFunction.apply(x, bias, spec, *tensors)


def linear_8bit(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None = None, *,
                threshold: float = 0.0, training: bool = True, state=None) -> torch.Tensor:
    """``bitsandbytes.matmul`` over a frozen int8 weight (rows ``cb`` [out, in] int8, scales ``scb`` [out]),
    keeping nothing of ``x``. ``training=True`` is bitsandbytes' CPU/XPU training kernel (dequantize, then
    ``F.linear``); ``training=False`` its int8 kernel with outlier ``threshold``. ``state`` (a MatmulLtState)
    gets its ``idx`` updated as bitsandbytes does."""
    fn = "linear_8bit"
    _bnb()
    _check_x(x, fn)
    _common.check_tensor(cb, "cb", fn=fn)
    _common.check_tensor(scb, "scb", fn=fn)
    if cb.dtype != torch.int8 or cb.dim() != 2:
        raise ValueError(f"{fn}: 'cb' must be a 2-D int8 tensor [out, in], got {cb.dtype} {tuple(cb.shape)}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"{fn}: 'scb' must hold one scale per row of 'cb' ({cb.shape[0]}), got {tuple(scb.shape)}")
    if cb.requires_grad:
        raise ValueError(f"{fn}: 'cb' is an int8 weight and cannot train")
    spec = ("int8", None, float(threshold), bool(training), state)
    return QuantizedLinearFunction.apply(x, bias, spec, cb, scb)


def _nf4_class():
    """torchao's NF4Tensor class (its module moved between releases), or None without torchao."""
    for name in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
        try:
            return importlib.import_module(name).NF4Tensor
        except ImportError:
            continue
    return None


def linear_nf4(x: torch.Tensor, weight) -> torch.Tensor:
    """torchao's ``linear_nf4(x, weight)`` for an ``NF4Tensor`` weight through the same Function as the
    bitsandbytes layers. torchao 0.18's own ``LinearNF4`` already keeps only the weight, through
    ``save_for_backward``, so this changes nothing kept; it exists so one code path serves both."""
    fn = "linear_nf4"
    _check_x(x, fn)
    NF4Tensor = _nf4_class()
    if NF4Tensor is None:
        raise ImportError(f"{fn} needs torchao: pip install torchao")
    if not isinstance(weight, NF4Tensor):
        raise TypeError(f"{fn}: 'weight' must be a torchao NF4Tensor, got {type(weight).__name__}")
    return QuantizedLinearFunction.apply(x, None, ("nf4", None, 0.0, True, None), weight)


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead
