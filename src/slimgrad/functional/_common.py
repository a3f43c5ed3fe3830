"""Small helpers shared by every autograd Function in slimgrad.

They exist so that each op family takes the same decisions the same way: how a backward kernel is fed a
tensor whose values it never reads, how autocast is mirrored, and how double backward is refused.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading

import torch
from torch._C import _functions
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "Function",
    "once_differentiable",
    "standin",
    "autocast_dtype",
    "autocast_enabled",
    "autocast_lower_precision",
    "autocast_off",
    "check_tensor",
    "compact",
    "storage_bytes",
    "UseCell",
    "learn_from_use",
    "count_call",
    "mark_producer",
    "note_input_kept",
    "fast_kernel",
    "register_torch_kernel",
]


# Which user-facing layers run each Function, and how to keep them out of a model: named in the errors a
# Function raises for what it does not support (double backward), so that the user knows slimgrad is the
# cause and what to exclude.
_LAYERS = {
    "BatchNormFunction": ("batch norm", "exclude=[nn.BatchNorm2d] (or BatchNorm1d/3d)"),
    "MaxPoolFunction": ("max pooling", "exclude=[nn.MaxPool2d] (or MaxPool1d/3d)"),
    "AvgPoolFunction": ("average pooling", "exclude=[nn.AvgPool2d, nn.AdaptiveAvgPool2d] (or the 1d/3d ones)"),
    "RMSNormFunction": ("RMSNorm", "exclude=[nn.RMSNorm] (or the Hugging Face RMSNorm class)"),
    "LayerNormFunction": ("LayerNorm", "exclude=[nn.LayerNorm]"),
    "GroupNormFunction": ("GroupNorm", "exclude=[nn.GroupNorm]"),
    "FusedAddRMSNormFunction": ("FusedAddRMSNorm", "no slimgrad.nn.FusedAddRMSNorm in the model"),
    "PolyNormFunction": ("PolyNorm", "no slimgrad.nn.PolyNorm in the model"),
    "LoraLinearFunction": ("LoRA linear", "exclude=[peft.tuners.lora.Linear]"),
    "GatedFunction": ("gated MLP activation", "exclude=[<the model's MLP class, e.g. LlamaMLP>]"),
    "FormulaActivationFunction": ("formula activation", "exclude=[<the activation class, e.g. NewGELUActivation>]"),
    "ClampedSwiGLUFunction": ("GPT-OSS experts' clamped SwiGLU", "exclude=[<the experts class, e.g. GptOssExperts>]"),
    "FusedLinearCrossEntropyFunction": ("chunked linear + cross-entropy loss", "chunked_loss=False"),
}


def double_backward_message(cls) -> str:
    """The error for double backward through ``cls``: which slimgrad layer refuses it, and how to run that
    part with stock layers."""
    layer, how = _LAYERS.get(cls.__name__, (cls.__name__, "exclude=[<its module type or path>]"))
    return (
        f"slimgrad: {layer} ({cls.__name__}, once_differentiable) does not support double backward (a gradient "
        f"of a gradient, e.g. torch.autograd.grad(..., create_graph=True) and then backward through it, as "
        f"gradient penalties do): "
        f"it keeps only what a single backward reads. Keep these layers stock with convert's {how}, or "
        f"slimgrad.revert(model) / leave `with slimgrad.enabled():` for this computation."
    )


def once_differentiable(fn, cls=None):
    """``torch.autograd.function.once_differentiable`` whose double-backward error names the slimgrad layer
    (torch's says only "trying to differentiate twice a function that was marked with @once_differentiable").
    """

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if not torch.is_grad_enabled():
            # A backward without create_graph, the common case: nothing to turn off, nothing to refuse (the
            # no_grad context cost 1.6 us a backward on the host-bound CUDA path).
            return fn(ctx, *args)
        owner = cls if cls is not None else getattr(ctx, "_forward_cls", type(ctx))
        if getattr(owner, "refuse_create_graph", False) and not torch.compiler.is_compiling():
            # A Function whose result depends on its saved inputs at second order (the chunked loss: the softmax's
            # Hessian), usually the graph's root: there no incoming gradient requires grad, so the error node below
            # was never attached and a gradient penalty's term was dropped silently (the review of 2026-11-28)
            raise RuntimeError(double_backward_message(owner))
        with torch.no_grad():
            outputs = fn(ctx, *args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return outputs
        outputs_ = outputs if isinstance(outputs, tuple) else (outputs,)
        # The incoming gradients that require grad go through the error node too (and are dropped after it):
        # torch's version connects the node to detached copies only, so torch.autograd.grad(penalty, x), which
        # runs only the nodes on a path to x, never reached it and returned None (allow_unused) or "appears to
        # not have been used in the graph" instead of this error.
        upstream = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        err_fn = _functions.DelayedError(double_backward_message(owner), len(outputs_) + len(upstream))

        def fake_requires_grad(var):
            if var is not None:
                var = var.detach()
                var.requires_grad = True
            return var

        results = err_fn(*[fake_requires_grad(v) for v in outputs_], *upstream)
        return tuple(results[: len(outputs_)]) if isinstance(outputs, tuple) else results[0]

    wrapper._slimgrad_once = True
    return wrapper


_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def serves_batched_grads(backward):
    """``backward`` that also takes autograd's batched gradients (``torch.autograd.grad(...,
    is_grads_batched=True)``, hence ``torch.autograd.functional.jacobian(vectorize=True)`` and ``hessian``):
    legacy-vmap BatchedTensors, on which the families' kernels cannot run (bit views of the gradient, the core's
    kernels reading its data, out= and in-place forms). It runs ``backward`` once per batch entry on plain
    tensors and batches the results again, which is what legacy vmap's own fallback does for an op without a
    batching rule. The check is one C call per gradient, in eager only."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.compiler.is_compiling():  # (traced backwards never see a BatchedTensor; dynamo cannot call it)
            for g in grads:
                if g is not None and _is_legacy_batched(g):
                    return _per_batch_entry(backward, ctx, grads)
        return backward(ctx, *grads)

    return wrapper


def _per_batch_entry(backward, ctx, grads):
    """``backward`` over the entries of the current legacy-vmap level's batch (see serves_batched_grads). The
    nesting is stepped down around the calls, so that gradients batched at outer levels too (nested batched
    backward) are unbatched level by level by the same wrapper."""
    level = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    # Removing the level from a gradient batched there gives its entries along dim 0 (batch_size is read only
    # for one that is not, which it expands).
    physical = [None if g is None or not _is_legacy_batched(g) else torch._remove_batch_dim(g, level, 1, 0)
                for g in grads]
    size = max(p.shape[0] for p in physical if p is not None)
    physical = [p if p is None or p.shape[0] == size else p.expand(size, *p.shape[1:]) for p in physical]
    torch._C._vmapmode_decrement_nesting()
    try:
        entries = [backward(ctx, *[g if p is None else p[b].clone() for g, p in zip(grads, physical)])
                   for b in range(size)]
    finally:
        torch._C._vmapmode_increment_nesting()
    single = not isinstance(entries[0], tuple)
    columns = zip(*([e] if single else e for e in entries))
    out = tuple(None if c[0] is None else torch._add_batch_dim(torch.stack(c), 0, level) for c in columns)
    return out[0] if single else out


def _is_torch_once_differentiable(backward) -> bool:
    code = getattr(backward, "__code__", None)
    return (
        hasattr(backward, "__wrapped__")
        and code is not None
        and code.co_name == "wrapper"
        and code.co_filename == torch.autograd.function.once_differentiable.__code__.co_filename
    )


# torch's Function.apply, called with the class explicitly rather than through ``super()``: when a graph break
# falls inside a Function's forward, dynamo resumes in this frame and cannot rebuild a ``super()`` object
# ("AutogradFunctionVariable() is not a constant", an internal error instead of running the Function eagerly).
_AUTOGRAD_APPLY = torch.autograd.Function.apply.__func__


class Function(torch.autograd.Function):
    """Base of slimgrad's autograd Functions: one per op family, in functorch's ``forward``/``setup_context``
    form (``slimgrad.functional._transforms`` says why and what runs under torch.func).

    ``stock``: a staticmethod taking exactly ``apply``'s arguments and computing what stock PyTorch computes
    (stock's memory), run under transform stacks the Function does not serve or under
    ``set_func_policy("stock")``. ``under_transform``: what runs under the transforms it serves (torch's
    ``apply``; a family overrides it where, say, an in-place call must run out of place there).
    Double-backward refusals (``once_differentiable``) get an error naming the layer.
    """

    stock = None
    generate_vmap_rule = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A backward decorated with torch's ``once_differentiable`` gets slimgrad's, whose error says which
        # layer refuses double backward and how to exclude it (every Function, without editing each one).
        backward = cls.__dict__.get("backward")
        fn = backward.__func__ if isinstance(backward, staticmethod) else backward
        if fn is not None and _is_torch_once_differentiable(fn):
            fn = once_differentiable(fn.__wrapped__, cls)
        if fn is not None:
            cls.backward = staticmethod(serves_batched_grads(fn))

    @classmethod
    def under_transform(cls, *args, **kwargs):
        return _AUTOGRAD_APPLY(cls, *args, **kwargs)

    @classmethod
    def apply(cls, *args, **kwargs):
        if torch.compiler.is_compiling():
            if torch.compiler.is_exporting() and cls.stock is not None:
                # torch.export: stock's ops. Strict export traced the Function's forward without its backward
                # (the exported module gave no gradients), and an exported graph is for running the model elsewhere,
                # where slimgrad's savings for backward only cost time (the inference graph packed ReLU masks)
                return cls.stock(*args, **kwargs)
            return _AUTOGRAD_APPLY(cls, *args, **kwargs)
        if torch._C._are_functorch_transforms_active():
            # Under torch.func (grad, vmap, jacrev, ...). One C call decides it, so eager calls pay nothing more.
            from slimgrad.functional._transforms import run_under_transform

            return run_under_transform(cls, args, kwargs)
        if kwargs:
            return _AUTOGRAD_APPLY(cls, *args, **kwargs)
        # torch's C apply, skipping the Python one's default-argument binding for the setup_context form
        # (~10 µs a call): every family passes all of its arguments positionally.
        return _C_APPLY(cls, *_unwrap_dead_wrappers(args))


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_unwrap_dead_wrappers = torch._functorch.utils.unwrap_dead_wrappers
# One tensor, unwrapped where it is a functorch wrapper that outlived its transform (what unwrap_dead_wrappers does
# to each argument): for the families whose eager calls go to _C_APPLY themselves (see eager()).
unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def eager() -> bool:
    """Whether ``Function.apply`` takes its eager branch (not traced, no torch.func transform). There a family's
    hot path may call ``_C_APPLY(cls, unwrap_if_dead(x), ...)`` itself, as that branch does, without its generic
    argument handling (~1-2 µs a call)."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


# What an eager forward hands to its setup_context beside its outputs (a mask, a seed, the order it packed in):
# autograd refuses a Function that modifies a view in place and returns more than one tensor, and each extra
# output costs time (~7 µs a forward and backward call for ReLU's mask, measured on tiny tensors: the engine wraps
# and marks it). forward and setup_context run back to back on one thread inside ``apply``, so one slot per
# thread serves; each family uses its own attribute names and clears what it takes.
EAGER_HANDOFF = threading.local()


def traced_inplace_on_view(input: torch.Tensor) -> bool:
    """Whether an in-place call is traced by torch.compile: there the family runs out of place and copies into the
    input (functionalization makes stock's in-place op the same). A Function modifying a view in place may return
    one tensor only and save nothing made in forward; one modifying a graph input in place (a module compiled
    alone, or after a graph break) had its input gradient passed through unmasked (ReLU(inplace=True) on
    [-1, -0.5, 0.5, 1]: [1, 1, 1, 1] where stock gives [0, 0, 1, 1]), and dynamo cannot tell a graph input from an
    intermediate while tracing. So every traced in-place call does (the name stays from the views' case)."""
    return torch.compiler.is_compiling()


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``torch._prims_common.suggest_memory_format`` for strided tensors, traceable in a Function's backward
    under torch.compile (dynamo's strict mode there refuses reading ``t.layout``, which torch's reads)."""
    if t.is_contiguous():
        return torch.contiguous_format
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dim and t.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def compile_distinct(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself in eager; under torch.compile a view of it, a node of its own in the traced graph.

    Inductor's layout optimisation (always on for CPU with mkldnn, a heuristic on CUDA) rewrites a graph input
    that feeds a convolution into a channels-last copy, and when the same input is also saved for backward
    the forward graph returns that copy as the saved value: every frozen conv weight then costs a weight-sized
    activation (measured: 0.66 MiB on a width-8 ResNet-18 at 4x3x64², 35x what eager keeps). Feeding the
    convolution a view instead confines the copy to the forward; the saved value stays the parameter itself.
    """
    if torch.compiler.is_compiling():
        return t.as_strided(t.shape, t.stride())
    return t


def standin(shape, like: torch.Tensor) -> torch.Tensor:
    """A zero-stride tensor of ``shape`` and ``like``'s dtype that allocates nothing.

    Backward kernels take the input (or weight) tensor even when they only read its shape. Feeding them
    this instead of the real tensor lets a Function skip saving the real one without allocating an
    input-sized placeholder. Only pass it where the kernel provably never reads the values (tests check
    the gradients bitwise against stock PyTorch) and never calls ``.contiguous()`` on it (tests check
    peak bytes).

    It is a read-only view of ``like``'s first element (detached: no gradient flows into ``like`` through it)
    rather than a fresh element: where stock reads the input its caller holds anyway, a one-element allocation put
    our peak one element above stock's (average pooling: +8 B in fp64, measured). A fresh element only where ``like``
    has none, or under torch.func or torch.compile, whose tensors would batch or trace the view.
    """
    if like.numel() > 0 and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        return like.detach().as_strided(shape, (0,) * len(shape), like.storage_offset())
    return torch.empty((), dtype=like.dtype, device=like.device).expand(shape)


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types autocast does not know (``meta``:
    torch raises there, while stock layers run on meta tensors for shape propagation and meta init)."""
    if device_type == "meta":
        return False
    return torch.is_autocast_enabled(device_type)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower-precision dtype autocast would use on ``device_type``, or None when it is off."""
    if not autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_lower_precision(*tensors: torch.Tensor | None):
    """Cast floating tensors the way autocast casts the inputs of ops on its lower-precision list
    (convolutions, linear). Returns the tensors unchanged when autocast is off.

    The cast happens outside our Function, as a differentiable ``.to``, exactly like stock autocast, so
    the gradient of an fp32 parameter comes back in fp32 and the Function itself sees one dtype.
    """
    first = next(t for t in tensors if t is not None)
    dtype = autocast_dtype(first.device.type)
    if dtype is None:
        return tensors
    # autocast's cached cast where the compiled core can call it (a trainable fp32 leaf cast once per region, shared
    # by every call in it, so several forwards' gradients meet at the one cast as stock's do); else a plain .to(),
    # the same per call (csrc/common.cpp)
    from slimgrad import csrc

    plain = first.data if type(first) is torch.nn.Parameter else first  # (for_eager takes plain tensors only)
    core = csrc.for_eager(plain, cuda=True)
    return tuple(
        t if t is None or not t.is_floating_point() or t.dtype == torch.float64
        else core.autocast_cached_cast(t, dtype) if core is not None and type(t) in _CACHEABLE
        else t.to(dtype)
        for t in tensors
    )


_CACHEABLE = (torch.Tensor, torch.nn.Parameter)


def autocast_off(device_type: str):
    """A context that disables autocast for ``device_type`` when it is on (a no-op otherwise), so the ops
    inside a Function run in the dtypes we already chose."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def storage_bytes(x: torch.Tensor) -> int | None:
    """Bytes of the storage behind ``x``, or None where there is none to read: meta tensors, tensor subclasses
    (DTensor, wrappers), functorch's wrapped tensors under torch.func, and traced tensors. A fake tensor
    (``slimgrad.estimate``'s simulated step) has its real tensor's storage size: answered, so that the simulated
    step takes the branch the real one takes (a compact copy of a view of a wider tensor)."""
    if (x.device.type == "meta" or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or (type(x) is not torch.Tensor and not _is_fake_tensor(x))):
        return None
    return x.untyped_storage().nbytes()


def input_smaller_than_mask(x: torch.Tensor) -> bool:
    """Whether stock, keeping ``x`` itself, keeps fewer bytes than a 1-bit mask of every element would take: a
    broadcast view (``expand``: zero strides) shares a storage smaller than its logical size, and keeping that
    view costs only its storage. The mask activations whose stock op keeps the input run stock's op there, so
    they never keep more than stock. A contiguous input (the common case) answers at once."""
    if x.is_contiguous():
        return False
    nbytes = storage_bytes(x)
    return nbytes is not None and nbytes * 8 <= x.numel()


#: qualified-name prefixes of the pack hooks torch.utils.checkpoint's non-reentrant form (selective checkpointing
#: and transformers' ``gradient_checkpointing_enable`` included) installs around a checkpointed forward and its
#: recomputation
_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def in_checkpointed_forward() -> bool:
    """Whether a non-reentrant checkpoint's forward (or its recomputation in backward) is running, in eager.

    A recomputation must save what the forward saved (checkpoint checks it, selective checkpointing replays the
    forward's ops): inside such a region the mode runs stock's ops (the recomputation runs outside the mode) and
    the activation modules do not apply a decision learned in between (``learn_from_use``: another backward may
    have ended since the forward). Under torch.compile there is no such region to see (dynamo cannot call this
    builtin: ``fullgraph=True`` broke inside ``slimgrad.enabled()``), and no recomputation replays eager's ops."""
    if torch.compiler.is_compiling():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(_CHECKPOINT_HOOKS)


def _is_fake_tensor(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def compact(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a compact copy of it where ``x`` is a view whose storage holds more than ``x`` (a chunk of a
    fused projection, BERT's pooler reading ``hidden[:, 0]``): keeping the view for backward would pin the
    whole base, where stock, keeping a computed tensor of ``x``'s size there (a cast or padded copy, a
    normalized output), keeps only that. Dense layouts (channels_last, transposes) are kept as they are."""
    nbytes = storage_bytes(x)
    if nbytes is None or nbytes <= x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.preserve_format)


#: an eager call's plain tensor types (the families' hot paths test `type(t) in PLAIN_TYPES`)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def foreign_input(x) -> bool:
    """Whether an eager call's input is a tensor subclass the mask families leave to stock's op: a DTensor, a jagged
    NestedTensor, a ``__torch_function__`` subclass (their kernels read plain storage, returned plain tensors, and
    crashed or segfaulted on wrappers without one: subclass44). Fake tensors (``slimgrad.estimate``), torch.compile's
    and torch.func's tensors are not: they take the families' own routes."""
    if type(x) in PLAIN_TYPES or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if _is_fake_tensor(x):
        return False
    from slimgrad import _notices  # (said once a process per type: a saving that does not engage says so)

    _notices.notify(f"slimgrad: a {type(x).__name__} (a tensor subclass) reaches layers that keep less for plain "
                    f"tensors; stock's op runs there for it (stock's bytes, no saving; README Limits)", stacklevel=4)
    return True


def own_matmul_subclass(t) -> bool:
    """Whether ``t`` is a tensor subclass whose matmuls are its own: torchao's quantized weights (``NF4Tensor`` runs
    ``mm`` as ``linear_nf4``, i.e. ``a @ w.T``; ``Int8Tensor`` has no ``mm``). A Function that multiplies by the
    weight in its backward (LoRA's base term: ``dX = dY @ W``) gives a wrong gradient or raises on them, so such a
    weight takes the library's own forward. DTensor's matmuls are plain ones on shards, and fake tensors (the
    estimate's, dynamo's) are no wrapper subclasses: neither is one."""
    if t is None:
        return False
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return False
    from torch.distributed.tensor import DTensor

    return not isinstance(t, DTensor)


def check_tensor(value, name: str, *, fn: str) -> None:
    """Raise a TypeError naming the argument when ``value`` is not a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(value).__name__}")


def _index(value, name: str, nd: int, fn: str) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # ints and what stock's argument parser takes as one (numpy integers)
        except TypeError:
            pass
    raise TypeError(f"{fn}: argument '{name}' must be an int or a tuple of {nd} ints, got {value!r}")


def int_tuple(value, nd: int, name: str, fn: str) -> tuple[int, ...]:
    """A size argument (stride, padding, kernel size, ...) spread to ``nd`` ints as aten spreads it: an int or a
    sequence of 1 or ``nd`` ints, where an int is anything with ``__index__`` but a bool (numpy integers, as stock
    takes them). The errors are of stock's types: TypeError for a value of the wrong kind, RuntimeError for the
    wrong number of values."""
    if not isinstance(value, (tuple, list, torch.Size)):
        return (_index(value, name, nd, fn),) * nd
    values = tuple(_index(v, name, nd, fn) for v in value)
    if len(values) == 1:
        return values * nd
    if len(values) != nd:
        raise RuntimeError(f"{fn}: expected {name} to be a single integer value or a list of {nd} values, but got "
                           f"{name}={list(values)}")
    return values


def check_flag(value, name: str, *, fn: str) -> bool:
    """A bool argument as stock's parser takes it, numpy's bool too (a TypeError for anything else: "no" was read as
    True)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{fn}: argument '{name}' must be bool, not {type(value).__name__}")


def plain_sizes(*values) -> bool:
    """Whether pooling's size arguments are ints or sequences of ints (not bools, not floats): the core's option
    caches key on the values, where 2.0 == 2 and True == 1 would find another call's options."""
    for v in values:
        if v is None or type(v) is int:
            continue
        if type(v) in (tuple, list) and all(type(e) is int for e in v):
            continue
        return False
    return True


# The producer/consumer rule. An activation (a ReLU module, say) can keep either a small mask or its
# output; keeping the output is free when a consumer keeps that same tensor anyway (the next conv whose
# weight trains keeps its input), while a mask would then be extra. Whether a consumer keeps it is only
# known after the producer's forward, so the producer decides from what it learned in the previous step:
#
# - each call of the producer gets a :class:`UseCell`, attached to its output tensor (``mark_producer``);
# - a consumer that saves that tensor for backward marks the cell (``note_input_kept``);
# - the producer's backward counts its kept cells into the module (``learn_from_use``) and queues a callback that
#   publishes the result as ``module._slimgrad_output_kept`` once the whole backward pass is over: any kept call
#   for ReLU (whose stock op keeps its output), every call for the families whose stock op keeps its input
#   (``count_call``).
#
# Publishing only at the end of backward keeps the decision fixed while checkpointing recomputes the
# forward inside backward (non-reentrant checkpointing insists that the recomputation saves the same
# tensors), and a module called several times per forward (torchvision reuses ``self.relu``) keeps its
# output when any of its uses is kept (ReLU) or all are (the others). Gradients are exact either way; only the bytes
# kept differ.
_PRODUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class UseCell:
    """Whether a consumer kept the output of one call of a producer, as the producer made it."""

    __slots__ = ("kept", "version")

    def __init__(self):
        self.kept = False
        self.version = -1


def mark_producer(output: torch.Tensor, cell: UseCell) -> None:
    """Attach ``cell`` to ``output`` so that a consumer saving ``output`` can mark it."""
    if not torch.compiler.is_compiling():
        cell.version = output._version
        _PRODUCERS[output] = cell


def not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where ``t`` is a view (a kernel's result permuted back to the input's layout), a tensor on its
    storage with its sizes and strides that autograd does not take for a view: a custom Function's output that is a
    view cannot be modified in place afterwards (``out += residual`` in a channels-last block), where stock's can
    (csrc/common.h's ``not_a_view``). Eager plain tensors only: traced and fake ones are returned as they are."""
    if not t._is_view() or type(t) is not torch.Tensor or torch.compiler.is_compiling():
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def note_input_kept(x: torch.Tensor) -> None:
    """Called by a Function that saves its input ``x`` for backward: marks x's producer cell, if any.

    Only while ``x`` is still what the producer returned: a consumer that keeps it after an in-place change
    (``y = act(h); y.mul_(2); conv(y)``) keeps another value, from which the producer's gradient cannot be
    read, and a producer that kept its output instead of a mask would then fail autograd's version check in
    backward where stock (keeping its input) runs, or, under saved-tensor hooks that skip that check
    (``save_on_cpu`` on CPU), give a wrong gradient."""
    # Producers mark only outputs that require grad (and that flag cannot be cleared on a non-leaf), so an x that
    # does not is nobody's: skip the weak-dictionary lookup (~1 µs a call on the compiled core's path).
    if torch.compiler.is_compiling() or not x.requires_grad or not _PRODUCERS:
        return
    cell = _PRODUCERS.get(x)
    if cell is None and x._is_view():
        cell = _through_backward_hook(x)
    if cell is not None and x._version == cell.version:
        cell.kept = True


def _through_backward_hook(x: torch.Tensor):
    """The producer cell of the tensor a full backward hook passed on as ``x``: ``register_full_backward_hook`` (and
    its pre-hook, and the global ones) hands a module's inputs, or its outputs, through ``BackwardHookFunction``,
    whose outputs are new tensor objects viewing the same values. A ReLU whose consumer kept that alias kept its
    1-bit mask besides, more than stock every step (the wrappers sweep). None unless ``x`` is exactly its base."""
    fn = x.grad_fn
    if fn is None or type(fn).__name__ != "BackwardHookFunctionBackward":
        return None
    base = x._base
    if (base is None or base.shape != x.shape or base.stride() != x.stride()
            or base.storage_offset() != x.storage_offset()):
        return None
    return _PRODUCERS.get(base)


def learn_from_use(producer, cell: UseCell) -> None:
    """Called from the producer's backward: fold this call's cell into what the next forward will use."""
    if torch.compiler.is_compiling():
        return
    # Plain attributes, written to the instance dict: nn.Module.__setattr__'s parameter/buffer/module
    # checks cost ~10 µs a write, several times per call.
    state = producer.__dict__
    task = torch._C._current_graph_task_id()
    if state.get("_slimgrad_task") != task:
        state["_slimgrad_task"] = task
        state["_slimgrad_uses_kept"] = 0

        def publish():
            kept, calls = state["_slimgrad_uses_kept"], state.pop("_slimgrad_calls", None)
            state["_slimgrad_output_kept"] = kept > 0 if calls is None else kept >= calls

        torch.autograd.Variable._execution_engine.queue_callback(publish)
    if cell.kept:
        state["_slimgrad_uses_kept"] += 1


def count_call(producer) -> None:
    """Called by each call, with a gradient, of a producer whose stock op keeps its *input* (LeakyReLU, the clamp
    family): the module then keeps its output only when every call's output was kept by a consumer (counted here
    against the kept calls :func:`learn_from_use` sees), not when any was. Where a consumer did not keep one call's
    output, keeping it is a whole tensor stock does not keep whenever the input is alive anyway (one LeakyReLU used
    twice: 32 KiB against stock's 24 KiB, every step; the cached-decisions sweep), while a mask is one bit an
    element. ReLU's stock op keeps its output, and so do the in-place forms (their result): any kept call is enough
    there (no count)."""
    if torch.compiler.is_compiling():
        return
    state = producer.__dict__
    state["_slimgrad_calls"] = state.get("_slimgrad_calls", 0) + 1


# Exactly narrower values. bitsandbytes' 4-bit layers compute in the compute dtype (bf16 in QLoRA) and return
# the result cast up to the input's dtype (fp32 where peft's prepare_model_for_kbit_training made the hidden states
# fp32): every value of that fp32 tensor is a bf16 value. A consumer that keeps such a tensor (a gated MLP keeps
# gate and up, its largest activations) can keep it in bf16 and cast it back in backward, bit for bit the same
# values, in half the bytes. The producer notes the fact on its output (``note_exactly_narrower``); it holds only
# while the tensor is unchanged since (its version counter), and only in eager mode (a weak reference per tensor).
_NARROWER: WeakIdKeyDictionary = WeakIdKeyDictionary()
_WIDENS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float64),
           (torch.float16, torch.float64)}


def note_exactly_narrower(wide: torch.Tensor, narrow_dtype: torch.dtype) -> None:
    """Record that ``wide`` holds only values of ``narrow_dtype`` (it was cast up from one)."""
    if (narrow_dtype, wide.dtype) in _WIDENS and not torch.compiler.is_compiling():
        _NARROWER[wide] = (narrow_dtype, wide._version)


def exactly_narrower(t: torch.Tensor) -> torch.dtype | None:
    """The narrower dtype ``t``'s values are exactly representable in (as noted by its producer), or None."""
    if torch.compiler.is_compiling() or not _NARROWER:
        return None
    noted = _NARROWER.get(t)
    if noted is None or noted[1] != t._version:
        return None
    return noted[0]


def kept_input(x: torch.Tensor) -> torch.Tensor:
    """What a Function that saves its input ``x`` keeps: x itself (noting it for its producer), or, where x's
    producer noted that x's values are exactly those of a narrower dtype, x in that dtype: half the bytes, and
    backward's cast back (``x.to(ctx's dtype)``) gives x's values bit for bit. Not under torch.func, whose
    transforms must see what is kept (the note is eager-only anyway)."""
    narrow = exactly_narrower(x)
    if narrow is None or torch._C._are_functorch_transforms_active():
        note_input_kept(x)
        return x
    return x.to(narrow)


_KERNELS: list = [None]  # slimgrad.kernels, once imported (fast_kernel)


def fast_kernel(family: str, tensor: torch.Tensor):
    """The non-torch implementation :mod:`slimgrad.kernels` chose for ``family`` on ``tensor`` (a Triton or
    numba kernel module/object), or None when the Function's own torch code should run: the torch backend
    was chosen, nothing fits, or we are being traced by torch.compile (which generates its own fused
    kernels from the torch code and cannot trace a deferred Triton launch)."""
    if torch.compiler.is_compiling():
        return None
    kernels = _KERNELS[0]
    if kernels is None:  # imported on first use, not at this module's import
        from slimgrad import kernels

        _KERNELS[0] = kernels
    impl = kernels.choose(family, tensor)
    return None if impl is None or getattr(impl, "backend", "torch") == "torch" else impl


class TorchKernel:
    """The registry entry standing for a Function's own torch code (``backend == "torch"``)."""

    backend = "torch"

    def __init__(self, family: str):
        self.family = family

    def __repr__(self):
        return f"TorchKernel({self.family!r})"


_ALL_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def register_torch_kernel(family: str, *, priority: int = 0, devices=("cpu", "cuda", "xpu", "mps"),
                          dtypes=_ALL_FLOATS) -> None:
    """Register a Function's torch code as the ``torch`` implementation of ``family`` (the fallback the
    registry lists and ``SLIMGRAD_KERNELS=torch`` selects)."""
    from slimgrad.kernels import registry

    if any(k.backend == registry.TORCH for k in registry.implementations(family)):
        return
    impl = TorchKernel(family)
    registry.register(family, registry.TORCH, devices=devices, dtypes=dtypes, load=lambda: impl, priority=priority)
