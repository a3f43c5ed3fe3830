"""Convolutions (1-3d, plain and transposed) that keep only what the requested gradients read.

Stock PyTorch keeps the input X whenever X requires grad, although only the weight's gradient reads X;
with a non-zero ``padding_mode`` it keeps the padded X *and* X. Here X (unpadded) is kept only when the
weight needs grad, and the weight only when X needs grad; the padding is redone in backward.

Gradients come from the same kernels stock runs, so they are bitwise equal:
dX of a convolution is a transposed convolution of the output gradient (and dX of a transposed
convolution a plain one) rather than ``aten.convolution_backward``, which would copy a stand-in input to
an input-sized temporary; dW and dB come from ``aten.convolution_backward`` fed the weight (kept for dW where it
is a leaf, which costs nothing; else a carrier of its shape, ``_weight_carrier``).
In the channels-last layout the transposed convolution sums in another order than stock's backward-data
kernel, so there dX is ``aten.convolution_backward`` itself, fed a tensor of X's shape and layout whose
values it never reads (``_shape_carrier``: X while alive, a view of the gradient's storage, or a fresh one
where stock holds X). A pointwise (1x1) convolution takes that route in every layout: there stock's kernel is
faster than the transposed convolution (1.8x on a MobileNet shape at one thread), with the same bits; so does
every convolution on stock's CPU fallback kernels (fp64, fp16), whose transposed counterpart needs more scratch.

Eager CPU and CUDA calls run the compiled core's ``conv_forward`` (``csrc/conv.cpp``): one C++ autograd Function
with these same decisions, which costs about what stock's convolution costs per call, where the Python Function
and slimgrad's per-call checks cost tens of microseconds more (on CUDA that host time was the whole of a
host-bound step's excess over stock). Its ops are aten's, dispatched on the tensors' device, so on CUDA it runs
the cuDNN calls the Python Function runs, in the same order (``SLIMGRAD_CORE_CUDA=0`` leaves CUDA to the Python
Function). The options that do not change between calls are made into the core's ``conv_Cfg`` once (cached on
the module, or per option tuple for the functional form); a call does a few checks and one call. Batched input,
no autocast, plain tensors: everything else (autocast, an unbatched input, torch.compile, torch.func, subclasses,
other devices) runs the Python Function below, the reference the core is tested against bit for bit.

With a padding mode under autocast the Function mirrors stock's order of operations (the pad in autocast's
fp32 where stock's runs there, then the cast), and keeps X cast to autocast's dtype rather than X; a padded X
that views a larger storage is kept as a compact copy. Both copies are made outside the Function by
differentiable ops (``xc``), so double backward reaches X through them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from slimgrad import csrc

from . import _common, _transforms

__all__ = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_nd",
]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_PAD_BACKWARD = {
    "reflect": {
        1: torch.ops.aten.reflection_pad1d_backward.default,
        2: torch.ops.aten.reflection_pad2d_backward.default,
        3: torch.ops.aten.reflection_pad3d_backward.default,
    },
    "replicate": {
        1: torch.ops.aten.replication_pad1d_backward.default,
        2: torch.ops.aten.replication_pad2d_backward.default,
        3: torch.ops.aten.replication_pad3d_backward.default,
    },
}
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


_tuple = _common.int_tuple


def _groups(groups, fn: str) -> int:
    """``groups`` as stock takes it: an int (or numpy integer; TypeError otherwise), positive (RuntimeError)."""
    if isinstance(groups, bool) or not hasattr(groups, "__index__"):
        raise TypeError(f"{fn}: argument 'groups' must be int, not {type(groups).__name__}")
    groups = groups.__index__()
    if groups < 1:
        raise RuntimeError(f"{fn}: non-positive groups is not supported (argument 'groups' is {groups})")
    return groups


def _circular_pad_backward(grad: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    """Backward of ``F.pad(..., mode='circular')`` without the input.

    Stock's circular pad is a composite of slice copies, so its gradient is the reverse sequence of
    ``g[source] += g[copied region]``: one addition per element and step, as in stock, hence bitwise equal.
    """
    nd = len(pad) // 2
    g = grad  # a fresh tensor of our own: updated in place
    for i in reversed(range(nd)):
        dim = g.dim() - 1 - i
        pad_l, pad_r = pad[2 * i], pad[2 * i + 1]
        size = g.shape[dim]
        if pad_r > 0:
            g.narrow(dim, pad_l, pad_r).add_(g.narrow(dim, size - pad_r, pad_r))
        if pad_l > 0:
            g.narrow(dim, size - pad_l - pad_r, pad_l).add_(g.narrow(dim, 0, pad_l))
    for i in range(nd):
        dim = g.dim() - 1 - i
        pad_l, pad_r = pad[2 * i], pad[2 * i + 1]
        g = g.narrow(dim, pad_l, g.shape[dim] - pad_l - pad_r)
    return g.contiguous(memory_format=_common.suggest_memory_format(grad))


def conv_forward(x, weight, bias, cfg, xc=None):
    """The convolution ``cfg`` describes, with stock's ops: explicit pad (in autocast's fp32 where stock's pad
    runs there), autocast's cast, then the (transposed) convolution. What the Function (in eager and under torch.func)
    and its stock fallback compute (``xc``, the Function's copy of X, has X's values: unused here)."""
    nd, transposed, stride, padding, dilation, output_padding, groups, pad_mode, pad, cast_dtype, pad_dtype = cfg
    conv_dtype = cast_dtype or x.dtype
    if pad is not None:
        if pad_dtype is not None:
            x = x.to(pad_dtype)
        x = F.pad(x, pad, mode=pad_mode)
    if x.dtype != conv_dtype:
        x = x.to(conv_dtype)
    if transposed:
        return _CONV_T[nd](x, weight, bias, stride, padding, output_padding, groups, dilation)
    return _CONV[nd](x, weight, bias, stride, padding, dilation, groups)


_CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _format(t: torch.Tensor) -> torch.memory_format:
    """The layout aten's convolution kernels read from ``t`` (``suggest_memory_format``), fast on the common
    contiguous case (torch's Python version costs ~25 µs of symbolic guards there). A tensor contiguous in both
    layouts (size-1 channel or spatial dims: a squeeze-excitation block's pooled (N, C, 1, 1)) goes by its
    strides, as aten's choice does: made channels-last it is channels-last to aten, and its dX through the
    contiguous path was up to 1 bf16 ulp off, and contiguous where stock's is channels-last."""
    if t.is_contiguous():
        cl = _CL.get(t.dim())
        if cl is None or not t.is_contiguous(memory_format=cl):
            return torch.contiguous_format
    return suggest_memory_format(t)


def _standard_layout(t: torch.Tensor) -> bool:
    """Whether aten's kernels see ``t`` in a layout an uninitialised tensor of ``_format(t)`` reproduces (contiguous or
    channels-last). A computed weight that is another view (a parametrization returning a transpose: ``orthogonal``
    on wide conv kernels) is not: its carrier made dW through other kernels than stock's (~1e-6 off), and its dX by
    the transposed convolution read it strided where stock's backward reads a contiguous copy (the wrappers sweep)."""
    if t.is_contiguous():
        return True
    cl = _CL.get(t.dim())
    return cl is not None and t.is_contiguous(memory_format=cl)


class _ConvFunction(_common.Function):
    """One Function for every convolution kind; ``cfg`` carries the non-tensor options:
    (nd, transposed, stride, padding, dilation, output_padding, groups, pad_mode, pad, cast_dtype, pad_dtype).

    ``pad``/``pad_mode``: an explicit F.pad applied to X first (non-zero padding modes, or the zero pad
    of an asymmetric ``padding='same'``); ``cast_dtype``: autocast's dtype for the convolution, where it is not
    X's; ``pad_dtype``: the dtype stock's pad runs in where it is not X's (autocast runs the reflection and
    replication pads in fp32 on CPU), which only backward needs: the pad's gradient sums in that dtype.

    Written in functorch's split form, so this one Function serves the Python path in eager (where the compiled
    core does not run), torch.compile and torch.func (``_transforms``); ``stock`` is stock's convolution with the
    same arguments, for the transform stacks it does not serve.

    ``xc`` (None where X itself is kept): X as the convolution reads it, made outside the Function by a
    differentiable op, where what backward keeps for dW is not X itself: autocast's cast copy (stock keeps a cast
    copy too), or a compact copy of an X that views a larger storage (stock keeps its padded copy). It has X's
    values (padding copies elements, so cast-then-pad equals stock's pad-then-cast); being an input, a double
    backward reaches X through it. Its gradient is None: X gets the whole gradient.
    """

    @staticmethod
    def forward(x, weight, bias, cfg, xc):
        nd, transposed, stride, padding, dilation, output_padding, groups, pad_mode, pad, cast_dtype, pad_dtype = cfg
        xp = x if xc is None else xc
        if pad is not None:
            xp = F.pad(xp, pad, mode=pad_mode)
        if cast_dtype is not None and xp.dtype != cast_dtype:
            xp = xp.to(cast_dtype)
        w = _common.compile_distinct(weight)
        if transposed:
            out = _CONV_T[nd](xp, w, bias, stride, padding, output_padding, groups, dilation)
        else:
            out = _CONV[nd](xp, w, bias, stride, padding, dilation, groups)
        del w
        # With an explicit pad, the padded X goes out as well (dropped by the caller right after): its shape and
        # layout, which setup_context reads, are aten's pad's own (its layout rules differ by mode, and its meta
        # kernels give other strides than the CPU ones).
        return out if pad is None else (out, xp)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, cfg, xc = inputs
        transposed, pad = cfg[1], cfg[8]
        if pad is None:
            xp = x if xc is None else xc  # (a cast copy xc keeps x's layout)
        else:
            xp = output[1]
            ctx.mark_non_differentiable(xp)
            ctx.set_materialize_grads(False)  # (else backward gets a padded-X-sized zero gradient for it)
        need_x, need_w = ctx.needs_input_grad[:2]
        if need_w and xc is None:
            _common.note_input_kept(x)
        # The bias alone trainable in fp16/bf16 on CPU: dB from stock's own call (output_mask for the bias only),
        # where a sum over (N, spatial) would make an fp32 copy of dY (aten's CPU sum of a reduced float type over
        # several dims; stock sums per group on its fallback kernels, oneDNN in its weight-gradient kernel): up to
        # 2x dY above stock's step peak. Its weight (kept where it is a leaf: the caller holds it, and stock keeps
        # it) and a carrier of X's shape and layout (see _shape_carrier); stock keeps both from forward on.
        out = output if pad is None else output[0]
        cpu = x.device.type == "cpu"
        reduced_on_cpu = cpu and out.dtype in (torch.float16, torch.bfloat16)
        ctx.db_call = (not need_x and not need_w and bias is not None and ctx.needs_input_grad[2] and reduced_on_cpu
                       and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active())
        # (a computed weight in another layout is kept, as stock keeps it: no carrier reproduces what aten reads)
        keep_w = need_x or ((need_w or ctx.db_call) and (weight.is_leaf or not _standard_layout(weight)))
        ctx.save_for_backward((x if xc is None else xc) if need_w else None, weight if keep_w else None)
        ctx.cfg = cfg
        ctx.x_dtype = x.dtype
        ctx.xp_shape = tuple(xp.shape)
        ctx.w_shape = tuple(weight.shape)
        ctx.w_format = None  # the weight carrier's layout (_weight_carrier), where the weight is not kept
        ctx.has_bias = bias is not None
        ctx.x_ref = None
        ctx.carrier_dx = False
        ctx.db_in_dx_call = False
        if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
            # Under torch.func: gradients in the contiguous layout, from plain torch ops (see _transforms)
            ctx.xp_format = ctx.x_format = _transforms.TRANSFORM_LAYOUT
            return
        ctx.xp_format = _format(xp)
        ctx.x_format = _format(x) if pad is not None and need_x else ctx.xp_format
        if (need_w or ctx.db_call) and not keep_w and not torch.compiler.is_compiling():
            ctx.w_format = _format(weight)
        if ctx.db_call:
            ctx.x_ref = weakref.ref(x)
            ctx.x_stride = x.stride()
        # Channels-last dX without dW runs stock's kernels (the convolution's and the pad's backward) on tensors
        # of X's shape and layout whose values they never read: a weak reference lets backward use X itself
        # while the caller still holds it (no copy, nothing kept alive).
        # A pointwise (1x1) convolution's dX through aten's convolution_backward (a carrier of X's shape, as for
        # channels-last) rather than the transposed convolution: stock's own kernel, 1.3-1.8x faster at one
        # thread on MobileNet/ResNet 1x1 shapes (issue 22); for larger kernels the transposed convolution is the
        # faster of the two (a 3x3 64-channel conv: 11.5 against 14.9 ms), with the same bits. So does every
        # convolution stock runs on its CPU fallback kernels (fp64, fp16: no oneDNN), whose transposed counterpart
        # unfolds into other column buffers: its dX peaked 1-13.5x X above stock's (a 3-d transposed conv).
        # And every convolution where stock's kernel or the transposed convolution on dY would not run oneDNN on CPU
        # (fp32 at batch 1 with a small X, a small dY, oneDNN switched off): the slow transposed kernel unfolds dY
        # into a column buffer stock's backward never makes (up to 8x X above stock's peak).
        # A strided convolution on CPU too: oneDNN's transposed convolution on dY took a scratch 128 B larger than
        # stock's backward-data kernel (step peak +128 B, fp32/bf16 1-2d at 4x8x12x12); stock's kernel there is as
        # fast or faster (ResNet's 3x3 stride-2 convs, backward at one thread: 0.90-1.00x), with stock's bits.
        # (Stride 1, ResNet's 3x3 convs, keeps the transposed convolution: the faster one there.)
        # A trainable bias in fp16/bf16 on CPU: dB from that same call, stock's own (the bits and bytes of stock's
        # dB), where a separate sum would make an fp32 copy of dY while dX is alive (aten's CPU sum of a reduced
        # float type over several dims): it runs the carrier route. (Not on oneDNN's fused dB there: the values
        # of the carrier it reads for the dW it discards do not enter dB.)
        if need_x and not need_w and not torch.compiler.is_compiling():
            ctx.db_in_dx_call = ctx.needs_input_grad[2] and reduced_on_cpu
            ctx.carrier_dx = ((not transposed and all(k == 1 for k in ctx.w_shape[2:])) or ctx.db_in_dx_call
                              or not _standard_layout(weight)  # (stock's own call reads it as stock's does)
                              or (cpu and not transposed and any(s != 1 for s in cfg[2]))
                              or (cpu and (x.dtype not in (torch.float32, torch.bfloat16)
                                                              or not _dx_route_on_onednn(xp, weight, out, cfg))))
            if (ctx.carrier_dx or ctx.xp_format != torch.contiguous_format
                    or ctx.x_format != torch.contiguous_format):
                ctx.x_ref = weakref.ref(x)
                ctx.x_stride = x.stride()

    @staticmethod
    def stock(x, weight, bias, cfg, xc):
        return conv_forward(x, weight, bias, cfg)

    @classmethod
    def under_transform(cls, x, weight, bias, cfg, xc):
        out = _common.Function.under_transform.__func__(cls, x, weight, bias, cfg, xc)
        return out if cfg[8] is None else out[0]

    @staticmethod
    def backward(ctx, grad, _grad_xp=None):
        nd, transposed, stride, padding, dilation, output_padding, groups, pad_mode, pad, cast_dtype, pad_dtype = (
            ctx.cfg
        )
        x, weight = ctx.saved_tensors
        if grad is None:  # (an undefined output gradient, as gradcheck passes, where grads are not materialized)
            return None, None, None, None, None
        if weight is not None and weight.dtype != grad.dtype:
            # The parameter's data was replaced since forward (diffusers' layerwise casting puts fp8 storage back
            # after each forward; stock reads the new data too, and aten's backward takes the mixed dtypes): in dY's
            # dtype, the forward's (exact: the forward's values were the stored ones, cast up)
            weight = weight.to(grad.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        dx = dw = db = None
        tail = (None, None)  # cfg, xc (X gets the whole gradient)

        if need_x and need_w:
            # Both: stock's own single call (one backend pass that shares the work; measured under compile on
            # the width-8 ResNet-18 "all" case, two calls cost ~0.1x of the step).
            dx, dw, db = _convolution_backward(ctx, grad, x, weight, (True, True, need_b))
            return (_unpad_uncast(ctx, dx), dw, db if need_b else None) + tail

        if need_x and (ctx.xp_format != torch.contiguous_format or ctx.carrier_dx):
            # Channels-last X: stock's own kernel (oneDNN's channels-last backward-data kernel and its transposed
            # convolution sum in different orders: depthwise, 1x1 and grouped convs came out up to 1 ulp apart),
            # fed a tensor of X's shape and layout whose values it never reads (a zero-stride stand-in would be
            # copied to that layout): see _shape_carrier.
            xp = _shape_carrier(ctx, ctx.xp_shape, ctx.xp_format, grad)
            dx, _, db = _convolution_backward(ctx, grad, None, weight, (True, False, ctx.db_in_dx_call), xp=xp)
            del xp
            dx = _unpad_uncast(ctx, dx)
        elif need_x:
            w = weight
            g = grad
            if not g.is_contiguous():
                # Stock's backward sees a contiguous X and weight and runs in the contiguous layout whatever
                # dY's layout; our transposed conv would pick channels_last from a channels_last dY (another
                # summation order, ~1e-6 off). The copy is the one stock's kernel makes of dY.
                g = g.contiguous()
            if transposed:
                dx = _CONV[nd](g, w, None, stride, padding, dilation, groups)
                # With output_padding >= stride the plain conv yields extra trailing rows: drop them.
                for i in range(nd):
                    if dx.shape[2 + i] != ctx.xp_shape[2 + i]:
                        dx = dx.narrow(2 + i, 0, ctx.xp_shape[2 + i])
            else:
                k = ctx.w_shape[2:]
                in_sizes = ctx.xp_shape[2:]
                out_sizes = grad.shape[2:]
                extra = tuple(
                    in_sizes[i]
                    - ((out_sizes[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1) + 1)
                    for i in range(nd)
                )
                dx = _CONV_T[nd](g, w, None, stride, padding, extra, groups, dilation)
            del w, g
            dx = _unpad_uncast(ctx, dx)

        if need_w:
            _, dw, db = _convolution_backward(ctx, grad, x, weight, (False, True, need_b))
        elif need_b and db is None and ctx.db_call:
            # stock's call for dB alone (see setup_context), on carriers of X and (a computed) weight
            xp = _shape_carrier(ctx, ctx.xp_shape, ctx.xp_format, grad)
            db = _convolution_backward(ctx, grad, None, weight, (False, False, True), xp=xp)[2]
            del xp
        elif need_b and db is None:
            db = grad.sum([0] + list(range(2, grad.dim())))
        return (dx, dw, db if need_b else None) + tail


def _dx_route_on_onednn(xp, weight, out, cfg) -> bool:
    """Whether stock's convolution (on X) and the convolution that computes dX here without dW (transposed to it, on
    dY, shaped as the output) both run oneDNN: aten's own backend selector, asked with the calls' arguments. The
    answer depends only on what the key holds (sizes, dtypes, the options, the thread count, oneDNN's switch): asked
    once per key (two selector calls cost the Python path ~20 µs a call)."""
    key = (xp.shape, xp.stride(), xp.dtype, weight.shape, weight.dtype, out.shape, cfg[:7], torch.get_num_threads(),
           torch._C._get_mkldnn_enabled())
    answer = _ONEDNN_ROUTE.get(key)
    if answer is None:
        nd, transposed, stride, padding, dilation, output_padding, groups = cfg[:7]
        select = torch._C._select_conv_backend
        onednn = _onednn_backends()
        answer = (select(xp, weight, None, stride, padding, dilation, transposed, output_padding, groups,
                         None).value in onednn
                  and select(out, weight, None, stride, padding, dilation, not transposed, (0,) * nd, groups,
                             None).value in onednn)
        if len(_ONEDNN_ROUTE) >= 1024:
            _ONEDNN_ROUTE.clear()
        _ONEDNN_ROUTE[key] = answer
    return answer


_ONEDNN_ROUTE: dict = {}  # _dx_route_on_onednn's answers


@functools.cache
def _onednn_backends() -> frozenset:
    """aten's ConvBackend values Mkldnn, MkldnnTranspose, MkldnnEmpty: consecutive in its enum (torch's Python
    binding leaves MkldnnTranspose unnamed, so values, not members)."""
    backend = torch._C._ConvBackend
    return frozenset(range(backend.Mkldnn.value, backend.MkldnnEmpty.value + 1))


def _dense_strides(shape, fmt) -> tuple[int, ...]:
    """The strides ``torch.empty(shape, memory_format=fmt)`` has."""
    order = list(range(len(shape)))[::-1]  # innermost first
    if fmt in (torch.channels_last, torch.channels_last_3d):
        order = list(range(2, len(shape)))[::-1]
        order = [1] + order + [0]
    strides = [0] * len(shape)
    step = 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _shape_carrier(ctx, shape, fmt, big):
    """A tensor of ``shape``, layout ``fmt`` and ``big``'s dtype for a backward kernel that reads only its shape
    and strides (aten's dX-only ``convolution_backward``, the pad backwards): checked bitwise against stock's
    with NaN-filled carriers, and peak bytes in tests/test_conv.py.

    In order: X itself while the caller still holds it unchanged (a weak reference from forward, nothing kept);
    a view over the storage of ``big`` (the incoming gradient) where that storage is large enough; else an
    uninitialised tensor, allocated only where stock holds X (it kept X for this backward). Under a
    differentiable backward (create_graph) or torch.compile, always the latter: aten then keeps it for the
    double backward as stock keeps X."""
    # (plain tensors only: a tensor subclass may have no storage to look at)
    eager = not torch.is_grad_enabled() and not torch.compiler.is_compiling() and _plain_or_simulated(big)
    if eager:
        ref = getattr(ctx, "x_ref", None)
        x = ref() if ref is not None else None
        if (
            _plain_or_simulated(x)
            and tuple(x.shape) == shape
            and x.stride() == ctx.x_stride
            and x.dtype == big.dtype
            and x.device == big.device
            and x.untyped_storage().nbytes()
            >= (x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size()
        ):
            return x.detach()
        strides = _dense_strides(shape, fmt)
        extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
        if big.untyped_storage().nbytes() >= extent * big.element_size():
            return big.detach().as_strided(shape, strides, 0)
    return torch.empty(shape, dtype=big.dtype, device=big.device, memory_format=fmt)


def _plain_or_simulated(t) -> bool:
    """A plain tensor, or slimgrad.estimate's fake stand-in for one: the simulated step takes the carrier the real
    step takes (it allocated one, and read a frozen strided stem conv one input above the measured peak: +20-27 %
    on a ResNet stem; the review sweep)."""
    if type(t) is torch.Tensor:
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is FakeTensor


def _unpad_uncast(ctx, dxp):
    """dX from the gradient of the padded, cast X the convolution saw, as stock's autograd reverses its
    forward: to the pad's dtype, the pad's backward, back to X's dtype."""
    nd, *_, pad_mode, pad, cast_dtype, pad_dtype = ctx.cfg
    mid = pad_dtype or ctx.x_dtype
    if dxp.dtype != mid:
        dxp = dxp.to(mid)
    if pad is not None:
        dxp = _pad_backward(ctx, dxp, pad, pad_mode, nd)
    if dxp.dtype != ctx.x_dtype:
        dxp = dxp.to(ctx.x_dtype)
    return dxp


def _convolution_backward(ctx, grad, x, weight, output_mask, xp=None):
    """aten's convolution_backward for the gradients ``output_mask`` names, from the saved X, as stock's
    autograd calls it (X padded and cast as the forward did); or from ``xp``, the padded and cast X the
    convolution saw (a stand-in of its shape, for dX alone)."""
    nd, transposed, stride, padding, dilation, output_padding, groups, pad_mode, pad, cast_dtype, _ = ctx.cfg
    if xp is not None:
        pad = cast_dtype = None
    else:
        xp = x
        if cast_dtype is not None and x.dtype == cast_dtype:
            cast_dtype = None  # the Function kept the cast copy
    conv_dtype = cast_dtype or xp.dtype
    if pad is not None or cast_dtype is not None:
        # Under torch.compile, pad/cast a view of x: nodes CSE cannot merge with forward's, which the
        # partitioner would then save (the padded or cast copy) instead of redoing them from x. Only then:
        # the view pins x to the layout the trace saw, and a plain activation would lose the channels-last
        # layout Inductor gives it (a transposed copy per conv, measured on the compiled "all" step).
        xp = _distinct_view(x)
    if pad is not None:
        # Autocast off explicitly: a backward run inside an autocast region, and torch.compile's trace of
        # backward (made under the forward's autocast), would run a reflection/replication pad in fp32 and
        # hand convolution_backward an fp32 X with a bf16 weight (oneDNN refuses it; Inductor's dW was wrong).
        with _autocast_disabled(xp.device.type):
            xp = F.pad(xp, pad, mode=pad_mode)
    if xp.dtype != conv_dtype:
        xp = xp.to(conv_dtype)
    # (the op's overload itself: the packet's Python dispatch to it cost ~1 us a call)
    return torch.ops.aten.convolution_backward.default(
        grad,
        xp,
        weight if weight is not None else _weight_carrier(ctx, grad),
        [grad.shape[1]] if output_mask[2] else None,  # output channels (a transposed weight has out/groups)
        list(stride),
        list(padding),
        list(dilation),
        transposed,
        list(output_padding),
        groups,
        list(output_mask),
    )


def _weight_carrier(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The weight for a ``convolution_backward`` that computes no dX, where the weight was not kept. Kept it is
    wherever it is a leaf (the caller holds it anyway); this is for a computed weight, which stock keeps from
    forward to backward. aten reads its shape and layout only, but first makes it contiguous in the backend's
    layout: a zero-stride stand-in became a weight-sized copy plus the stand-in's element, above stock's peak.
    So in eager an uninitialised tensor in the weight's layout (the bytes stock held all along); under
    torch.compile and torch.func, the stand-in as before."""
    if ctx.w_format is None or torch.compiler.is_compiling():
        return _common.standin(ctx.w_shape, grad)
    return torch.empty(ctx.w_shape, dtype=grad.dtype, device=grad.device, memory_format=ctx.w_format)


def _distinct_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` in eager; under torch.compile a view of it, a node of its own (see _convolution_backward). Not
    ``_common.compile_distinct``'s ``as_strided``: its strides are fixed at trace time, and where Inductor's
    layout optimisation saves x channels-last (a bf16 X with an autocast reflection pad) the backward read
    the channels-last memory with contiguous strides: a wrong dW (26.6 off a largest value of 34). Not
    ``aten.alias`` either: the trace drops it, and the partitioner then saved the padded X again."""
    if torch.compiler.is_compiling():
        return x.unsqueeze(0).squeeze(0)
    return x


def _autocast_disabled(device_type: str):
    """``torch.autocast(device_type, enabled=False)``, whatever autocast's state looks like from Python (under
    torch.compile's trace of a backward it reads off while the trace applies it); none for meta tensors."""
    if device_type == "meta" or (not torch.compiler.is_compiling() and not torch.is_autocast_enabled(device_type)):
        return contextlib.nullcontext()  # (entering torch.autocast costs ~20 µs a backward)
    return torch.autocast(device_type, enabled=False)


def _pad_backward(ctx, dxp, pad, pad_mode, nd):
    """Gradient of ``F.pad(x, pad, mode)`` w.r.t. x from the padded gradient, without x. The reflection and
    replication kernels read their input's shape and layout only: a zero-stride stand-in where X is
    contiguous, else a carrier of X's layout (the kernel would copy a stand-in to it, and its gradient would
    come out contiguous where stock's follows X)."""
    if pad_mode == "constant":
        return torch.constant_pad_nd(dxp, [-p for p in pad])
    if pad_mode == "circular":
        return _circular_pad_backward(dxp, pad)
    shape = list(dxp.shape)
    for i in range(nd):
        shape[-1 - i] -= pad[2 * i] + pad[2 * i + 1]
    x_format = getattr(ctx, "x_format", torch.contiguous_format)
    if x_format == torch.contiguous_format:
        like = _common.standin(shape, dxp)
    else:
        like = _shape_carrier(ctx, tuple(shape), x_format, dxp)
    return _PAD_BACKWARD[pad_mode][nd](dxp, like, list(pad))


def stock_keeps_weight_for_free(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Stock keeps the weight even when X needs no grad (we would not). That costs nothing when the
    weight is a leaf the caller holds anyway; it costs a weight-sized tensor when it is a temporary (a
    computed weight, or autocast's cast copy).

    Never under torch.compile: there stock's conv would have inductor save a channels-last copy of the weight
    (layout optimisation), while the Function feeds the convolution a distinct view of it
    (``_common.compile_distinct``) and saves the parameter itself."""
    if torch.compiler.is_compiling():
        return False
    return x.requires_grad or (weight.is_leaf and not _common.autocast_enabled(x.device.type))


def asymmetric_same(padding, weight, dilation) -> bool:
    """Whether ``padding='same'`` needs more zeros on one side than the other (an even window extent):
    then stock pads X explicitly and keeps the padded X, more than we keep."""
    if padding != "same":
        return False
    nd = weight.dim() - 2
    dil = (dilation,) * nd if isinstance(dilation, int) else tuple(dilation)
    if len(dil) == 1:
        dil = dil * nd
    return any(dil[i] * (weight.shape[2 + i] - 1) % 2 for i in range(nd))


def conv_nd(
    x,
    weight,
    bias=None,
    stride=1,
    padding=0,
    dilation=1,
    groups=1,
    *,
    nd: int,
    transposed: bool = False,
    output_padding=0,
    padding_mode: str = "zeros",
    fn: str = "conv",
    normalised=None,
):
    """Shared entry point: normalises options, handles unbatched inputs and autocast, then applies the
    Function. ``padding_mode`` other than zeros pads X explicitly (as stock ``nn.ConvNd`` does) with
    ``padding`` given in F.pad order (``_reversed_padding_repeated_twice``).

    Where stock keeps what we would keep (the weight trains, no explicit padding), stock's functional
    runs directly: no Function, no bookkeeping beyond noting that X is kept. ``normalised``: ``options``' answer
    for these arguments, where the caller has it (a module's cache)."""
    if padding_mode == "zeros" and isinstance(x, torch.Tensor) and (
            x.is_complex() or _common.foreign_input(x) or _common.foreign_input(weight)):
        # stock's op: complex convolutions (stock's F.conv splits them into real ones, which aten's kernels take); a
        # tensor subclass input or weight (a DTensor, whose conv backward takes no plain tensor beside its gradient; a
        # __torch_function__ subclass, whose wrapped results made the Function's output a view)
        if transposed:
            return _CONV_T[nd](x, weight, bias, stride, padding, output_padding, groups, dilation)
        return _CONV[nd](x, weight, bias, stride, padding, dilation, groups)
    core = csrc.for_eager(x, cuda=True)
    if core is not None:
        cfg = _functional_core_cfg(core, x, weight, bias, stride, padding, dilation, groups, nd, transposed,
                                   output_padding, padding_mode, fn)
        if cfg is not None:
            out = core_conv(core, x, weight, bias, cfg, nd, transposed, stride, padding, output_padding, groups,
                            dilation)
            if out is not None:
                return out
    if (
        padding_mode == "zeros"
        and isinstance(weight, torch.Tensor)
        and weight.requires_grad
        and torch.is_grad_enabled()
        and isinstance(x, torch.Tensor)
        and stock_keeps_weight_for_free(x, weight)
        and not asymmetric_same(padding, weight, dilation)
    ):
        _common.note_input_kept(x)
        if transposed:
            return _CONV_T[nd](x, weight, bias, stride, padding, output_padding, groups, dilation)
        return _CONV[nd](x, weight, bias, stride, padding, dilation, groups)
    _common.check_tensor(x, "input", fn=fn)
    _common.check_tensor(weight, "weight", fn=fn)
    if bias is not None:
        _common.check_tensor(bias, "bias", fn=fn)
    groups = _groups(groups, fn)
    if x.dim() not in (nd + 1, nd + 2):
        raise RuntimeError(
            f"{fn}: Expected {nd + 1}D (unbatched) or {nd + 2}D (batched) input, "
            f"but got input of size: {list(x.shape)}"
        )
    if weight.dim() != nd + 2:
        raise RuntimeError(f"{fn}: argument 'weight' must be {nd + 2}D, got size {list(weight.shape)}")
    if normalised is None:
        normalised = options(nd, transposed, stride, padding, dilation, output_padding, padding_mode,
                             tuple(weight.shape[2:]), fn)
    stride_t, dilation_t, padding_t, output_padding_t, pad_mode, pad = normalised

    cast_dtype = pad_dtype = None
    device_type = x.device.type
    autocast = _common.autocast_dtype(device_type) is not None
    if autocast:
        if pad_mode in ("reflect", "replicate", "circular"):
            # Stock pads X (in autocast's fp32 where the pad is on its fp32 list) and autocast casts the padded X
            # for the convolution: the Function does the same, and its backward reverses it in that order.
            weight, bias = _common.autocast_lower_precision(weight, bias)
            target = _common.autocast_dtype(device_type)
            pad_dtype = _autocast_pad_dtype(x, pad_mode, nd)
            if x.is_floating_point() and (pad_dtype or x.dtype) not in (torch.float64, target):
                cast_dtype = target
        else:
            x, weight, bias = _common.autocast_lower_precision(x, weight, bias)

    unbatched = x.dim() == nd + 1
    if unbatched:
        x = x.unsqueeze(0)
    cfg = (
        nd,
        transposed,
        stride_t,
        padding_t,
        dilation_t,
        output_padding_t,
        groups,
        pad_mode,
        pad,
        cast_dtype if cast_dtype != x.dtype else None,
        pad_dtype,
    )
    if autocast or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        with _common.autocast_off(device_type):
            out = _ConvFunction.apply(x, weight, bias, cfg, _input_copy(x, weight, cfg))
    else:
        # _common.Function.apply's eager branch called directly (torch's C apply, tensors unwrapped as its
        # unwrap_dead_wrappers does), without its generic argument handling (~1-2 us a call)
        xc = _input_copy(x, weight, cfg)
        out = _C_APPLY(_ConvFunction, _unwrap_if_dead(x), _unwrap_if_dead(weight),
                       None if bias is None else _unwrap_if_dead(bias), cfg,
                       None if xc is None else _unwrap_if_dead(xc))
    if cfg[8] is not None and type(out) is tuple:  # (the eager Function's padded X: dropped here)
        out = out[0]
    return out.squeeze(0) if unbatched else out


_C_APPLY = _common._C_APPLY
_unwrap_if_dead = _common.unwrap_if_dead


def options(nd, transposed, stride, padding, dilation, output_padding, padding_mode, kernel, fn):
    """``conv_nd``'s options normalised: stride, dilation, padding and output padding as tuples of ``nd`` ints, the
    explicit pad and its mode; raises where they are invalid. A module works them out once (``nn.conv``) and
    hands them to ``conv_nd`` (~3 us a call on the Python path)."""
    if padding_mode not in _PADDING_MODES:
        raise ValueError(
            f"{fn}: argument 'padding_mode' must be one of {_PADDING_MODES}, got {padding_mode!r}"
        )

    stride_t = _tuple(stride, nd, "stride", fn)
    dilation_t = _tuple(dilation, nd, "dilation", fn)
    pad_mode = None
    pad = None
    if padding_mode != "zeros":
        if transposed:
            raise ValueError(f"{fn}: Only `zeros` padding mode is supported for ConvTranspose{nd}d")
        if not (isinstance(padding, (tuple, list)) and len(padding) == 2 * nd):
            raise ValueError(f"{fn}: with padding_mode={padding_mode!r}, 'padding' must hold {2 * nd} ints")
        pad_mode, pad = padding_mode, tuple(int(p) for p in padding)
        padding_t = (0,) * nd
    elif isinstance(padding, str):
        if transposed:
            raise TypeError(f"{fn}: argument 'padding' must be an int or a tuple of ints, got {padding!r}")
        if padding == "valid":
            padding_t = (0,) * nd
        elif padding == "same":
            if any(s != 1 for s in stride_t):
                raise RuntimeError(f"{fn}: padding='same' is not supported for strided convolutions")
            total = [dilation_t[i] * (kernel[i] - 1) for i in range(nd)]
            left = [t // 2 for t in total]
            right = [t - t // 2 for t in total]
            padding_t = tuple(left)
            if left != right:
                # As aten's _convolution_same: zero-pad the excess on the right, then symmetric padding.
                pad_mode = "constant"
                pad = [0] * (2 * nd)
                for i in range(nd):
                    pad[2 * (nd - 1 - i) + 1] = right[i] - left[i]
                pad = tuple(pad)
        else:
            raise RuntimeError(
                f"{fn}: Invalid padding string {padding!r}, argument 'padding' must be 'same' or 'valid'"
            )
    else:
        padding_t = _tuple(padding, nd, "padding", fn)
    output_padding_t = _tuple(output_padding, nd, "output_padding", fn) if transposed else (0,) * nd
    return stride_t, dilation_t, padding_t, output_padding_t, pad_mode, pad


# (device type, autocast dtype, X's dtype, pad mode, nd) -> the dtype stock's F.pad runs in under autocast
_PAD_DTYPES: dict = {}


def _autocast_pad_dtype(x: torch.Tensor, mode: str, nd: int) -> torch.dtype | None:
    """The dtype stock's ``F.pad(x, mode=mode)`` runs in under the current autocast, where it is not x's own:
    autocast's fp32 list holds reflection_pad1d/2d and replication_pad1d/2d/3d on CPU (not reflection_pad3d,
    not circular, which is slicing). Asked of autocast itself, once per device type and dtypes, on a tiny
    tensor: no list of ops to keep in step with torch."""
    if not x.is_floating_point() or mode == "circular":
        return None
    key = (x.device.type, torch.get_autocast_dtype(x.device.type), x.dtype, mode, nd)
    dtype = _PAD_DTYPES.get(key)
    if dtype is None:
        probe = torch.zeros((1, 1) + (2,) * nd, dtype=x.dtype, device=x.device)
        dtype = F.pad(probe, (1, 1) * nd, mode=mode).dtype
        if not torch.compiler.is_compiling():
            _PAD_DTYPES[key] = dtype
    return dtype if dtype != x.dtype else None


def _input_copy(x: torch.Tensor, weight: torch.Tensor, cfg) -> torch.Tensor | None:
    """The Function's ``xc``: a differentiable copy of X for the convolution to read and, when the weight
    trains, for backward to keep, where keeping X itself would cost more than stock's kept copy. None: X.

    - under autocast with X in another dtype, X cast to autocast's dtype: stock keeps its padded cast copy, and
      X itself (fp32) would be up to twice as large;
    - with an explicit pad (where stock keeps the padded X, a compact tensor of its own) and an X that views a
      storage larger than that padded copy (one chunk of a wider tensor): a compact copy of X, in X's layout.
    """
    nd, pad, cast_dtype = cfg[0], cfg[8], cfg[9]
    if cast_dtype is None and (pad is None or not weight.requires_grad):
        return None
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        return None  # under torch.func the Function keeps X itself (its tensors have no storage to check)
    if cast_dtype is not None:
        return x.to(cast_dtype)
    nbytes = _common.storage_bytes(x) if torch.is_grad_enabled() else None
    if nbytes is not None:
        if nbytes > x.numel() * x.element_size():  # (cheap test first: most inputs own their storage)
            padded = x.numel() // max(math.prod(x.shape[2:]), 1) * math.prod(
                x.shape[2 + i] + pad[2 * (nd - 1 - i)] + pad[2 * (nd - 1 - i) + 1] for i in range(nd)
            )
            if nbytes > padded * x.element_size():
                return x.clone()
    return None


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=1, fn="conv1d")


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=2, fn="conv2d")


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=3, fn="conv3d")


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=1, transposed=True,
                   output_padding=output_padding, fn="conv_transpose1d")


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=2, transposed=True,
                   output_padding=output_padding, fn="conv_transpose2d")


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return conv_nd(input, weight, bias, stride, padding, dilation, groups, nd=3, transposed=True,
                   output_padding=output_padding, fn="conv_transpose3d")


# ---------------------------------------------------------------------------------------------- compiled core

_PLAIN = _common.PLAIN_TYPES
# (nd, transposed, stride, padding, dilation, groups, output_padding, kernel size where padding is a string)
# -> the core's conv_Cfg, or False where the core does not serve those options (explicit padding)
_CORE_CFGS: dict = {}


def core_cfg(core, nd, transposed, stride, padding, dilation, groups, output_padding, padding_mode, weight, fn):
    """The core's ``conv_Cfg`` for these options, normalised as ``conv_nd`` normalises them (an explicit pad for
    a padding mode or an asymmetric ``padding='same'``), or None where ``conv_nd`` would raise (it then does)."""
    if (isinstance(groups, bool) or not hasattr(groups, "__index__") or groups.__index__() < 1
            or padding_mode not in _PADDING_MODES or (transposed and padding_mode != "zeros")):
        return None
    groups = groups.__index__()
    stride_t = _tuple(stride, nd, "stride", fn)
    dilation_t = _tuple(dilation, nd, "dilation", fn)
    output_padding_t = _tuple(output_padding, nd, "output_padding", fn) if transposed else (0,) * nd
    pad, pad_mode = [], ""
    if padding_mode != "zeros":
        if not (isinstance(padding, (tuple, list)) and len(padding) == 2 * nd):
            return None
        pad, pad_mode = [int(p) for p in padding], padding_mode
        padding_t = (0,) * nd
    elif isinstance(padding, str):
        if transposed or padding not in ("same", "valid"):
            return None
        if padding == "valid":
            padding_t = (0,) * nd
        else:
            if any(s != 1 for s in stride_t):
                return None
            total = [dilation_t[i] * (weight.shape[2 + i] - 1) for i in range(nd)]
            left = [t // 2 for t in total]
            padding_t = tuple(left)
            if any(t % 2 for t in total):
                # As aten's _convolution_same: zero-pad the excess on the right, then symmetric padding.
                pad, pad_mode = [0] * (2 * nd), "constant"
                for i in range(nd):
                    pad[2 * (nd - 1 - i) + 1] = total[i] - 2 * left[i]
    else:
        padding_t = _tuple(padding, nd, "padding", fn)
    return core.conv_Cfg(list(stride_t), list(padding_t), list(dilation_t), transposed, list(output_padding_t),
                         groups, pad, pad_mode)


def _functional_core_cfg(core, x, weight, bias, stride, padding, dilation, groups, nd, transposed, output_padding,
                         padding_mode, fn):
    """``conv_nd``'s core route: the cached ``conv_Cfg`` where the core serves this call, else None (the Python
    path then runs, and raises where the arguments are wrong)."""
    if (type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN) or x.dim() != nd + 2
            or weight.dim() != nd + 2 or isinstance(groups, bool)
            or (torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(x.device.type))):
        return None
    try:
        key = (nd, transposed, stride, padding, dilation, groups, output_padding, padding_mode,
               tuple(weight.shape[2:]) if isinstance(padding, str) else None)
        cfg = _CORE_CFGS.get(key)
    except TypeError:  # lists: unhashable
        key, cfg = None, None
    if cfg is None:
        cfg = core_cfg(core, nd, transposed, stride, padding, dilation, groups, output_padding, padding_mode, weight,
                       fn)
        # (a refusal is not remembered: groups=True is refused, and 1 == True would have found the refusal)
        if cfg is not None and key is not None and len(_CORE_CFGS) < 4096:
            _CORE_CFGS[key] = cfg
    return cfg


def core_conv(core, x, weight, bias, cfg, nd, transposed, stride, padding, output_padding, groups, dilation):
    """One convolution through the core, where it keeps less than stock; stock's op where stock keeps what we
    would (the weight trains and stock's kept weight is the caller's own leaf, no explicit pad), as ``conv_nd``
    decides. None where the Python Function must run: a trainable weight with an explicit pad and an X that
    views a larger storage (the Function keeps a compact copy of X there, ``_input_copy``)."""
    if weight.requires_grad and torch.is_grad_enabled():
        if cfg.padded:
            if x.untyped_storage().nbytes() > x.numel() * x.element_size():
                return None
        elif x.requires_grad or weight.is_leaf:
            _common.note_input_kept(x)
            if transposed:
                return _CONV_T[nd](x, weight, bias, stride, padding, output_padding, groups, dilation)
            return _CONV[nd](x, weight, bias, stride, padding, dilation, groups)
        _common.note_input_kept(x)  # the core keeps x for dW
    return core.conv_forward(x, weight, bias, cfg)
