"""What a user's code may still hold of a model that :func:`slimgrad.convert` copied.

``convert`` works on a deep copy unless told ``inplace=True``. Two things made before it do not follow the copy,
and neither fails: an optimizer built from the original's parameters steps tensors that never get a gradient
(training silently changes nothing), and ``Module.compile()`` is dropped by the copy (torch's ``__getstate__``
removes it), so the converted model runs eagerly. Both are said, never guessed around: slimgrad cannot know the
optimizer, nor the arguments ``compile`` was given.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakTensorKeyDictionary

from ._notices import notify

__all__ = ["note_copy"]

#: parameters of models convert copied (while those models live) -> the path of one module holding them
_COPIED_AWAY = WeakTensorKeyDictionary()
_HOOK = None
_CHECKED = weakref.WeakKeyDictionary()  # optimizer -> the copy count its gradients were last looked at under
_COPIES = [0]  # copies convert made so far: an optimizer is looked at once after each


def _compiled_paths(model: nn.Module) -> list[str]:
    return [path or "(the model itself)" for path, module in model.named_modules()
            if module.__dict__.get("_compiled_call_impl") is not None]


def note_copy(model: nn.Module) -> None:
    """``model`` was deep-copied by convert: say what the copy drops, and watch for an optimizer left on it."""
    global _HOOK
    compiled = _compiled_paths(model)
    if compiled:
        notify(f"slimgrad: convert returned a converted copy of the model (inplace=False), and torch does not copy "
               f"Module.compile(): {', '.join(compiled[:3])}{' ...' if len(compiled) > 3 else ''} was compiled, its "
               f"copy runs eagerly. Call .compile() on the model convert returns (with the same arguments), or "
               f"convert with inplace=True, which keeps the compiled call", stacklevel=4)
    _COPIES[0] += 1
    for path, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                _COPIED_AWAY[param] = path
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """At an optimizer's first step after each copying convert (once: its cost is one look at its parameters), warn
    where it steps only parameters convert copied away and none of them has a non-zero gradient. A step given a
    closure (LBFGS) computes its gradients inside the step: it is looked at the next time, if ever."""
    if not len(_COPIED_AWAY) or _CHECKED.get(optimizer) == _COPIES[0]:
        return
    if any(callable(a) for a in args if a is not optimizer) or callable(kwargs.get("closure")):  # (args hold self)
        return
    _CHECKED[optimizer] = _COPIES[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    copied = next((_COPIED_AWAY[p] for p in params if p in _COPIED_AWAY), None)
    if copied is None:
        return
    for param in params:
        grad = param.grad
        # (a gradient zeroed by zero_grad(set_to_none=False) before convert trains nothing either)
        if grad is not None and (param not in _COPIED_AWAY or bool(grad.any())):
            return  # something is trained: whatever else it holds is the user's business
    notify(f"slimgrad: this {type(optimizer).__name__} steps parameters of the model as it was before "
           f"slimgrad.convert (e.g. in '{copied or '(the model itself)'}'), and none of them has a gradient: convert "
           f"returned a copy (inplace=False) with parameters of its own, which is what trains, so this step changes "
           f"nothing. Build the optimizer from the converted model's parameters, or convert with inplace=True "
           f"(which keeps every Parameter object)", stacklevel=4)
