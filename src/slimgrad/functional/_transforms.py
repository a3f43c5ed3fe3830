"""What a slimgrad Function runs under a ``torch.func`` transform (grad, vmap, jacrev, jvp, ...).

Each op family has one Python autograd Function, written in functorch's form: ``forward`` takes no ``ctx``,
``setup_context(ctx, inputs, output)`` decides from ``ctx.needs_input_grad`` what to keep, and ``backward``
reads it. That one Function serves eager calls (where the compiled core does not), torch.compile and the
transforms alike. In eager, :meth:`slimgrad.functional._common.Function.apply` calls torch's C ``apply``
directly, which runs the split form at the ctx form's cost (measured: 4.3 µs against 4.1 µs a call; torch's
Python ``apply`` binds default arguments for the split form, ~14 µs), so families always pass every argument.

Under a transform, a Function runs its ``under_transform`` (by default torch's own ``apply``, which hands it to
functorch; ``generate_vmap_rule`` lets vmap batch forward, setup_context and backward in one call), where the
active transform stack is one the Functions serve: any number of vmap levels and at most one reverse-mode level
(the backwards are ``once_differentiable``, and no Function defines ``jvp``, which torch.compile's dynamo
refuses). Elsewhere, or under :func:`set_func_policy` ``("stock")``, the Function's ``stock`` runs: stock's
computation with the Function's arguments (stock's numbers, stock's memory). A Function with neither is refused
with a message that says what to do.

Why a policy: functorch runs a custom Function through Python machinery that builds classes per call (~0.35 ms
of host time a layer call under ``grad``, ~0.7 ms under ``vmap(grad)``, measured), so a user may prefer stock's
computation there.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["func_policy", "get_func_policy", "set_func_policy", "run_under_transform", "serves_transforms",
           "TRANSFORM_LAYOUT"]

_POLICIES = ("save", "stock")
_POLICY = ["save"]

# The layout the backwards give gradients under torch.func: contiguous, whatever the input's layout. Stock's
# gradients come out contiguous there (measured: a channels-last conv input's gradient under grad), a
# per-sample view under vmap has no memory format of its own (vmap answers ``is_contiguous`` only for the
# contiguous format), and vmap's batching rules refuse channels-last ``out=`` buffers. Bitwise stock's for
# channels-last batches under grad and vmap(grad) (tests/test_func_bytes.py).
TRANSFORM_LAYOUT = torch.contiguous_format


def set_func_policy(value: str) -> None:
    """What slimgrad's layers run under torch.func transforms, process-wide: ``"save"`` (default) their own
    Functions, which keep what the eager layers keep, at functorch's cost of a custom autograd Function
    (measured ~0.35 ms of host time per layer call under ``grad``, ~0.7 ms under ``vmap(grad)``); ``"stock"``
    stock's computation, stock's memory and speed."""
    if value not in _POLICIES:
        raise ValueError(f"slimgrad: set_func_policy's argument 'value' must be one of {_POLICIES}, got {value!r}")
    _POLICY[0] = value


def get_func_policy() -> str:
    return _POLICY[0]


@contextlib.contextmanager
def func_policy(value: str):
    """Temporarily set :func:`set_func_policy`'s process-wide policy."""
    old = _POLICY[0]
    set_func_policy(value)
    try:
        yield
    finally:
        _POLICY[0] = old


def serves_transforms(cls) -> bool:
    """Whether ``cls`` is written in functorch's form (it defines ``setup_context``)."""
    return torch.autograd.function._is_setup_context_defined(cls.setup_context)


def _stack_is_served() -> bool:
    """Whether the active transforms are ones the Functions support: any number of vmap levels and at most one
    reverse-mode (grad/vjp/jacrev) level, no forward-mode (jvp) or functionalize level."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    grads = 0
    for interpreter in retrieve_all_functorch_interpreters():
        key = interpreter.key()
        if key == TransformType.Grad:
            grads += 1
        elif key != TransformType.Vmap:
            return False
    return grads <= 1


def run_under_transform(cls, args, kwargs):
    """What ``cls.apply(*args, **kwargs)`` runs under a torch.func transform: the Function itself where it
    serves this stack, else its stock computation, else a clear refusal."""
    if _POLICY[0] == "save" and serves_transforms(cls) and _stack_is_served():
        return cls.under_transform(*args, **kwargs)
    stock = cls.stock
    if stock is None:
        raise RuntimeError(
            f"slimgrad: {cls.__name__} does not support torch.func transforms (grad, vmap, jacrev, "
            f"functional_call under a transform, ...). Run this part with stock layers "
            f"(slimgrad.revert(model), or outside `with slimgrad.enabled():`)."
        )
    return stock(*args, **kwargs)

