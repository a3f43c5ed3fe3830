"""Linear layer + cross-entropy loss computed in row chunks, so the (tokens x vocab) logits never exist.

A language model's head ``cross_entropy(linear(h, W, b).float(), t)`` is usually the largest single
allocation of a training step: stock autograd keeps the fp32 logits' log-softmax (tokens x vocab x 4 bytes,
e.g. 2 GiB for 4k tokens of a 128k vocabulary) plus, in reduced precision, the logits themselves, although
every gradient can be rebuilt from the hidden states, the weight and the targets. Here the forward walks
over row chunks and keeps nothing larger than one chunk's logits alive at a time. Where only dHidden is asked for
(a frozen head: LoRA, QLoRA) and the loss is one number, the forward forms dHidden from each chunk's
log-probabilities while it has them and keeps it instead of the hidden states (:func:`grad_in_forward`); backward
scales it. Otherwise backward recomputes each chunk's logits from the saved hidden states and forms dHidden (and
dWeight/dBias only when they require grad) chunk by chunk.

Exactness: each chunk runs stock's own kernels in stock's order (linear in the input dtype, optional
Gemma-style soft-capping in that dtype, upcast to fp32 as Hugging Face's ``ForCausalLMLoss`` does,
``log_softmax``, ``nll_loss``), and the per-row values are reduced by the same ``nll_loss``/``sum`` kernels
over all rows, so the loss is what stock computes whenever a row's logits are the same with fewer rows in
the matmul. The weight and bias gradients are sums over all rows, accumulated chunk by chunk in fp32 (then
rounded once to the parameter's dtype): a different summation order than stock's single matmul, so they
agree within fp32 rounding (and within one rounding of bf16/fp16). dHidden formed in forward is scaled by the
loss's gradient in backward: bitwise the recomputing path's where that gradient is a power of two (``loss.backward()``,
1/2**k gradient accumulation), within one rounding of hidden's dtype otherwise; an fp16 head recomputes (its
logits' gradient at an upstream of 1 would underflow: :func:`grad_in_forward`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimgrad.functional import _common

__all__ = ["FusedLinearCrossEntropyFunction", "fused_linear_cross_entropy"]

_aten = torch.ops.aten
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
# Chunks hold at least this many logits: much smaller matmuls cost more in per-call overhead than they save.
_MIN_CHUNK_ELEMENTS = 1 << 20
# and at least this many rows: each chunk reads the whole head weight (vocab x hidden) in forward and twice in
# backward, so a chunk of few rows is a matrix product bound by reading the weight: GPT-2's head (vocab 50257,
# hidden 256) over 508 tokens ran 1.76x stock's time in chunks of 21 rows (the elements floor alone), 1.13x in
# chunks of 128 (benchmarks/chunked_loss_time.py; docs/chunked_loss.md, Time).
_MIN_CHUNK_ROWS = 128


def default_chunk_size(rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk such that one chunk's logits are about as large as all the hidden states (the size
    backward keeps anyway), but never under ~1M logits or 128 rows, so that the peak stays near twice the hidden
    states while the matmuls stay large."""
    by_hidden = math.ceil(rows * hidden_size / max(vocab_size, 1))
    by_floor = max(math.ceil(_MIN_CHUNK_ELEMENTS / max(vocab_size, 1)), _MIN_CHUNK_ROWS)
    return max(1, min(rows, max(by_hidden, by_floor)))


def _chunk_logits(h, weight, bias, softcap):
    """One chunk's fp32 logits, computed as the Hugging Face head computes them; also returns the tanh
    output that soft-capping's backward reads (None without soft-capping). ``softcap``: None or (cap, in_fp32):
    capped in the linear's dtype (Gemma 2/3) or after the fp32 upcast (Beam)."""
    z = F.linear(h, weight, bias)
    t = None
    if softcap is not None:
        cap, in_fp32 = softcap
        if in_fp32:
            z = z.float()
        t = torch.tanh(z / cap)
        z = t * cap
    return z.float(), t


def _logits_grad(logp, tanh_out, start, stop, grad_nll, grad_smooth, valid, target, options, total_weight,
                 weight_dtype):
    """One chunk's gradient with respect to the linear's output, from its fp32 log-probabilities: stock's backward
    through ``(1-eps)*nll + smooth*(eps/V)``, the log-softmax, the upcast and the soft cap, step for step.
    ``grad_nll``: the nll kernel's upstream gradient; ``grad_smooth``: the smoothing term's per-row gradient (None
    without label smoothing)."""
    ignore_index, _, reduction, _, softcap = options
    low_precision = weight_dtype != torch.float32
    g_nll = grad_nll[start:stop] if reduction == "none" else grad_nll
    grad_logp = _aten.nll_loss_backward(g_nll, logp, target[start:stop], None, _REDUCTIONS[reduction], ignore_index,
                                        total_weight)
    if grad_smooth is not None:
        rows = grad_smooth[start:stop] if reduction == "none" else grad_smooth.expand(stop - start)
        rows = rows.masked_fill(~valid[start:stop], 0.0)
        grad_logp += rows[:, None]
    g = _aten._log_softmax_backward_data(grad_logp, logp, 1, torch.float32)
    del grad_logp
    if low_precision and not (softcap is not None and softcap[1]):
        g = g.to(weight_dtype)
    if softcap is not None:
        g = _aten.tanh_backward(g * softcap[0], tanh_out) / softcap[0]
        if low_precision and softcap[1]:  # capped in fp32: the upcast's backward comes after the cap's
            g = g.to(weight_dtype)
    return g


def _upstream(grad_loss, total_weight, options, vocab):
    """The nll kernel's upstream gradient and the smoothing term's (None without label smoothing), from the loss's
    gradient ``grad_loss`` (after the divisor's): stock's backward through ``(1-eps)*nll + smooth*(eps/V)``."""
    _, label_smoothing, reduction, _, _ = options
    if not label_smoothing > 0:
        return grad_loss, None
    grad_smooth = grad_loss * (label_smoothing / vocab)
    if reduction == "mean":
        grad_smooth = grad_smooth / total_weight
    return grad_loss * (1 - label_smoothing), -grad_smooth


def grad_in_forward(hidden, weight, bias, reduction) -> bool:
    """Whether the Function forms dHidden in its forward, from the log-probabilities it has at hand, and keeps that
    instead of the hidden states: only dHidden is asked for (a frozen head: LoRA, QLoRA, a frozen-embedding
    fine-tune) and the loss is one number. Backward then scales it by the loss's gradient instead of computing every
    chunk's logits again (a third vocab x hidden matrix product per token, 1.17x stock's step on GPT-2's
    vocabulary, the perf sweep of 2026-11-28), as Liger-Kernel's fused linear cross-entropy does. The bytes kept
    are the same (dHidden is hidden's size and dtype). Exactness: dHidden is formed for an upstream gradient of 1
    (after the divisor's, which the Function applies itself: HF's ``num_items_in_batch``) and multiplied by the
    real one: bitwise what computing it with the real one gives where that is a power of two (1, the 1/2**k of
    gradient accumulation, a loss scaler's 2**k: a power of two scales every rounding step exactly), within one
    rounding of the hidden states' dtype otherwise. Not in float16: there the logits' gradient at an upstream of 1
    (softmax / N) underflows into fp16's subnormals or to zero, which is what a loss scaler's 2**16 exists to prevent
    (stock forms it at the scaled value; found by the review of this change)."""
    return (reduction != "none" and torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and weight.dtype != torch.float16 and not (bias is not None and bias.requires_grad))


class FusedLinearCrossEntropyFunction(_common.Function):
    """``cross_entropy(linear(hidden, weight, bias).float(), target)`` over row chunks, divided by ``divisor``
    where one is given (Hugging Face's ``num_items_in_batch``: ``loss / divisor``, as ``ForCausalLMLoss``).

    hidden is (N, H), target (N,). Returns ``(loss, total_weight)``, the loss normaliser (a 0-d tensor) that
    backward reads; with ``grad_now`` (:func:`grad_in_forward`) ``(loss, total_weight, dhidden)``, dHidden formed
    in forward for an upstream gradient of 1 and kept instead of the hidden states. Otherwise it keeps the hidden
    states, the targets and the normaliser, and only when some gradient is requested. Double backward is refused: it
    would need the full softmax, which this Function exists not to keep. Under torch.func stock's computation runs
    (:meth:`stock`): the chunk loop writes into preallocated buffers, which vmap cannot batch.
    """

    # create_graph=True is refused when backward runs (_common.once_differentiable): the loss is the graph's root, so
    # no incoming gradient requires grad, and the usual delayed error never met a gradient penalty's term
    refuse_create_graph = True

    @staticmethod
    def forward(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size, softcap, divisor,
                grad_now):
        n, vocab = hidden.shape[0], weight.shape[0]
        options = (ignore_index, label_smoothing, reduction, chunk_size, softcap)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        picked = hidden.new_empty((n, 1), dtype=torch.float32)
        smooth = hidden.new_empty((n,), dtype=torch.float32) if label_smoothing > 0 else None
        # The per-row log-probabilities of the targets, reduced by stock's nll_loss kernel (same order, same
        # normaliser): ignored rows get the private ignore value -1, valid rows class 0 of ``picked``.
        nll_target = torch.where(valid, torch.zeros_like(target), torch.full_like(target, -1))
        dh = None
        if grad_now:
            # the normaliser before the loop (the kernel's own count of the valid rows), and the upstream gradient of
            # a loss whose own gradient is 1: stock's DivBackward of the divisor, then the smoothing's split
            total_weight = _aten.nll_loss_forward(picked.new_zeros((n, 1)), nll_target, None,
                                                  _REDUCTIONS[reduction], -1)[1]
            one = torch.ones((), dtype=torch.float32, device=hidden.device)
            grad_nll, grad_smooth = _upstream(one if divisor is None else one / divisor, total_weight, options,
                                              vocab)
            dh = torch.empty_like(hidden)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            logits, tanh_out = _chunk_logits(hidden[start:stop], weight, bias, softcap)
            logp = torch.log_softmax(logits, 1)
            del logits
            picked[start:stop] = logp.gather(1, safe_target[start:stop, None])
            if smooth is not None:
                smooth[start:stop] = logp.sum(1)
            if dh is not None:
                g = _logits_grad(logp, tanh_out, start, stop, grad_nll, grad_smooth, valid, target, options,
                                 total_weight, weight.dtype)
                del logp, tanh_out
                torch.mm(g, weight, out=dh[start:stop])
                del g
            else:
                del logp, tanh_out
        loss, total_weight = _aten.nll_loss_forward(picked, nll_target, None, _REDUCTIONS[reduction], -1)
        if smooth is not None:
            # Stock's label-smoothing composite, on the same per-row values.
            smooth_loss = (-smooth).masked_fill_(~valid, 0.0)
            if reduction == "mean":
                smooth_loss = smooth_loss.sum() / valid.sum()
            elif reduction == "sum":
                smooth_loss = smooth_loss.sum()
            loss = (1 - label_smoothing) * loss + smooth_loss * (label_smoothing / vocab)
        if divisor is not None:
            loss = loss / divisor
        return (loss, total_weight) if dh is None else (loss, total_weight, dh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size, softcap, divisor, \
            grad_now = inputs
        total_weight = output[1]
        ctx.mark_non_differentiable(*output[1:])
        if not torch.compiler.is_compiling():  # None for its gradient, not a zero allocated each backward
            ctx._materialize_non_diff_grads = False
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        need_b = need_b and bias is not None
        ctx.mask = (need_h, need_w, need_b)
        ctx.options = (ignore_index, label_smoothing, reduction, chunk_size, softcap)
        ctx.divisor = divisor
        ctx.grad_now = len(output) == 3
        if ctx.grad_now:
            ctx.save_for_backward(output[2])  # dHidden for an upstream gradient of 1: all that backward reads
        elif need_h or need_w or need_b:
            _common.note_input_kept(hidden)
            ctx.save_for_backward(hidden, weight, bias, target, total_weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *_grad_non_differentiable):
        need_h, need_w, need_b = ctx.mask
        if not (need_h or need_w or need_b):
            return (None,) * 11
        if ctx.grad_now:
            (dh,) = ctx.saved_tensors
            return dh * grad_loss, None, None, None, None, None, None, None, None, None, None
        hidden, weight, bias, target, total_weight = ctx.saved_tensors
        options = ctx.options
        chunk_size, softcap = options[3], options[4]
        n = hidden.shape[0]
        low_precision = weight.dtype != torch.float32
        if ctx.divisor is not None:
            grad_loss = grad_loss / ctx.divisor  # stock's DivBackward of ``loss / num_items_in_batch``
        grad_nll, grad_smooth = _upstream(grad_loss, total_weight, options, weight.shape[0])
        valid = target != options[0] if grad_smooth is not None else None

        # dh is made after the first chunk's softmax temporaries are gone: with one chunk (short inputs) it would
        # otherwise sit beside them at the step's peak, one hidden-states tensor above stock's, whose input
        # gradient comes only after its softmax backward (found with gradient checkpointing and a frozen head).
        dh = None
        acc_dtype = torch.float32
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            logits, tanh_out = _chunk_logits(h, weight, bias, softcap)
            logp = torch.log_softmax(logits, 1)
            del logits
            g = _logits_grad(logp, tanh_out, start, stop, grad_nll, grad_smooth, valid, target, options,
                             total_weight, weight.dtype)
            del logp, tanh_out
            if need_h:
                if dh is None:
                    dh = torch.empty_like(hidden)
                torch.mm(g, weight, out=dh[start:stop])
            if need_w or need_b:
                g32 = g.float() if low_precision else g
                if need_w:
                    dw.addmm_(g32.t(), h.float() if low_precision else h)
                if need_b:
                    db += g32.sum(0)
                del g32
            del g
        if need_h and dh is None:  # no rows
            dh = torch.empty_like(hidden)
        if dw is not None and low_precision:
            dw = dw.to(weight.dtype)
        if db is not None and db.dtype != bias.dtype:
            db = db.to(bias.dtype)
        return dh, dw, None, db, None, None, None, None, None, None, None

    @staticmethod
    def stock(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size, softcap, divisor,
              grad_now):
        """Stock's computation: the whole logits, Hugging Face's head and loss."""
        logits = F.linear(hidden, weight, bias)
        if softcap is not None:
            cap, in_fp32 = softcap
            logits = torch.tanh((logits.float() if in_fp32 else logits) / cap) * cap
        loss = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss if divisor is None else loss / divisor

    @classmethod
    def under_transform(cls, *args):
        return cls.stock(*args)


def _check(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size, softcap):
    fn = "fused_linear_cross_entropy"
    _common.check_tensor(hidden, "hidden", fn=fn)
    _common.check_tensor(weight, "weight", fn=fn)
    _common.check_tensor(target, "target", fn=fn)
    if bias is not None:
        _common.check_tensor(bias, "bias", fn=fn)
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"{fn}: 'hidden' must be a floating tensor of shape (..., hidden_size), got "
                         f"{hidden.dtype} of shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{fn}: 'weight' must have shape (vocab_size, {hidden.shape[-1]}) to match 'hidden' "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{fn}: 'bias' must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{fn}: '{name}' has dtype {t.dtype} but 'hidden' has {hidden.dtype}; linear needs "
                            f"one dtype (cast them, or run under torch.autocast)")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"{fn}: 'target' must hold class indices (an integer tensor), got {target.dtype}; "
                        f"class probabilities are not supported")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{fn}: 'target' must have shape {tuple(hidden.shape[:-1])} (hidden's shape without "
                         f"its last dimension), got {tuple(target.shape)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: 'reduction' must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: 'ignore_index' must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: 'label_smoothing' must be a float in [0, 1], got {label_smoothing!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{fn}: 'chunk_size' must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"{fn}: 'softcap' must be a positive number or None, got {softcap!r}")
    # meta and fake tensors (slimgrad.estimate) have no values to check
    if not torch.compiler.is_compiling() and target.device.type != "meta" and not _is_fake(target):
        bad = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
        if bool(bad.any()):
            value = target[bad].flatten()[0].item()
            raise IndexError(f"{fn}: 'target' holds {value}, outside [0, {weight.shape[0]}) and not "
                             f"ignore_index={ignore_index}")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return type(t) is not torch.Tensor and is_fake(t)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    softcap: float | None = None,
    softcap_in_fp32: bool = False,
    divisor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` without materialising the
    logits (see the module docstring for what is kept and how exact it is); ``/ divisor`` where one is given
    (Hugging Face's ``num_items_in_batch`` with ``reduction="sum"``), inside the Function so that a frozen head's
    input gradient, formed in forward (:func:`grad_in_forward`), divides as stock's backward does.

    ``hidden`` is (..., H) and ``target`` has hidden's leading shape; ``reduction="none"`` returns fp32
    losses of target's shape. ``softcap`` applies Gemma's ``tanh(z / softcap) * softcap`` to the logits (in
    the linear's dtype, as Gemma's heads do; ``softcap_in_fp32=True``: after the upcast, as Beam's) before the loss.
    ``chunk_size`` is rows per chunk; None picks
    chunks whose logits are about the size of ``hidden``. Under autocast the linear runs in autocast's
    lower-precision dtype, as stock ``F.linear`` would.
    """
    _check(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size, softcap)
    if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, (int, float, torch.Tensor))):
        raise TypeError(f"fused_linear_cross_entropy: 'divisor' must be a number, a tensor or None, got "
                        f"{type(divisor).__name__}")
    hidden, weight, bias = _common.autocast_lower_precision(hidden, weight, bias)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(h2.shape[0], h2.shape[1], weight.shape[0])
        if chunk_size >= h2.shape[0] > 1 and not (weight.requires_grad or (bias is not None and bias.requires_grad)):
            # One chunk over every row holds stock's three vocab-wide temporaries in backward, and the kept hidden
            # states besides: one hidden-states tensor above stock's peak with a frozen head (the mixed-precision
            # sweep; measured on transformers 4.57's reentrant checkpointing). Two chunks halve the temporaries. (A
            # trained head's single chunk runs stock's forward: hf_loss._logits_cost_less.)
            chunk_size = -(-h2.shape[0] // 2)
    # The divisor goes inside the Function as a number, or a 0-d fp32/integer tensor on hidden's device that needs no
    # gradient (HF's num_items_in_batch); anything else divides the result, as before (a float64 or (1, 1) tensor, the
    # Trainer's DataParallel form, crashed nll_loss_backward, and one that requires grad got none; the review)
    inner = divisor
    if isinstance(divisor, torch.Tensor) and (
            divisor.dim() != 0 or divisor.requires_grad or divisor.device != hidden.device
            or not (divisor.dtype == torch.float32 or not (divisor.is_floating_point() or divisor.is_complex()))):
        inner = None
    with _common.autocast_off(hidden.device.type):
        loss = FusedLinearCrossEntropyFunction.apply(
            h2, weight, t1, bias, ignore_index, float(label_smoothing), reduction, chunk_size,
            None if softcap is None else (float(softcap), bool(softcap_in_fp32)), inner,
            # (a divisor outside makes the upstream gradient 1/divisor: the recomputing path, stock's bits)
            grad_in_forward(h2, weight, bias, reduction) and (divisor is None or inner is not None),
        )
        if type(loss) is tuple:  # (loss, total_weight[, dh]); stock's computation (under torch.func) returns the loss
            loss = loss[0]
    if divisor is not None and inner is None:
        loss = loss / divisor
    return loss.view(target.shape) if reduction == "none" else loss
