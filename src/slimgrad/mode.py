"""``with slimgrad.enabled():`` — slimgrad's functional forms for every module, known or not.

``convert`` swaps modules whose exact type it knows. Models that call ``torch.nn.functional`` directly, or
use third-party modules the registry has no line for, never reach a slimgrad layer that way. Inside
``enabled()`` a :class:`torch.overrides.TorchFunctionMode` sees every torch call and reroutes the ones in
:data:`ROUTES` to their slimgrad twins, which take the same arguments and give the same results.

Why this does not recurse: torch pops the mode off its stack while ``__torch_function__`` runs, so the
torch calls a slimgrad function makes inside its forward go straight to torch. Backward runs after the
handler has returned, possibly still inside the ``with`` block, but with grad mode off, and the mode
leaves a call alone unless grad mode is on and some tensor argument requires grad (a call that nothing
will differentiate has nothing to save, and the stock op is the cheapest way to run it).

Cost: every torch call inside the block, rerouted or not, goes through one Python function
(``benchmarks/mode_overhead.py`` measures it). Converting is free at run time; prefer it where it covers
the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from slimgrad import functional as SF
from slimgrad.functional._common import in_checkpointed_forward

__all__ = ["ROUTES", "enabled", "route"]

#: stock callable (as torch passes it to ``__torch_function__``) -> slimgrad callable with its signature
ROUTES: dict[Callable, Callable] = {}

#: ``torch.nn.functional`` names whose slimgrad twin in ``slimgrad.functional`` has the same name and
#: signature. A new op family adds its names here (or calls :func:`route` for other pairs).
SAME_NAME = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "batch_norm", "layer_norm", "group_norm", "rms_norm",
    "relu", "leaky_relu", "hardtanh", "relu6", "threshold", "hardsigmoid",
    "dropout", "dropout1d", "dropout2d", "dropout3d",
    "max_pool1d", "max_pool2d", "max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
)


def route(stock: Callable, replacement: Callable) -> None:
    """Make ``enabled()`` call ``replacement(*args, **kwargs)`` where ``stock(*args, **kwargs)`` was called
    with something requiring grad. ``stock`` must be the object torch hands to ``__torch_function__``: the
    public function itself (``F.conv2d is torch.conv2d``, so one line covers both)."""
    if not callable(stock) or not callable(replacement):
        raise TypeError(f"route: 'stock' and 'replacement' must be callables, got {type(stock).__name__} and "
                        f"{type(replacement).__name__}")
    ROUTES[stock] = replacement


def _with_flag(fn: Callable, name: str, position: int) -> Callable:
    """``fn`` with its argument ``name`` (positional index ``position``) forced to True: for stock entry
    points that are flags of one slimgrad function (``relu_`` is ``relu(inplace=True)``)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) > position:
            args = args[:position] + (True,) + args[position + 1:]
        else:
            kwargs[name] = True
        return fn(*args, **kwargs)

    return call


for _name in SAME_NAME:
    route(getattr(F, _name), getattr(SF, _name))
route(torch.relu, SF.relu)
route(torch.relu_, _with_flag(SF.relu, "inplace", 1))  # also F.relu_
route(torch._C._nn.leaky_relu_, _with_flag(SF.leaky_relu, "inplace", 2))  # F.leaky_relu_
route(F.hardtanh_, SF.hardtanh_)
route(torch.threshold, SF.threshold)
route(torch.threshold_, SF.threshold_)  # also F.threshold_
for _nd in (1, 2, 3):
    route(getattr(F, f"max_pool{_nd}d_with_indices"),
          _with_flag(getattr(SF, f"max_pool{_nd}d"), "return_indices", 6))


def _requires_grad(args, kwargs) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    for a in kwargs.values():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


class _SlimgradMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        target = ROUTES.get(func)
        if (target is not None and torch.is_grad_enabled() and _requires_grad(args, kwargs)
                and not in_checkpointed_forward() and torch.autograd.forward_ad._current_level < 0):
            return target(*args, **kwargs)
        return func(*args, **kwargs)


def enabled() -> TorchFunctionMode:
    """A context manager routing the functional calls of every module (and of user code) through slimgrad's
    functional forms while it is active::

        with slimgrad.enabled():
            loss = model(x).sum()
        loss.backward()

    Same outputs and gradients as stock; what is kept for backward is what ``convert`` keeps, except that
    ReLUs always keep their 1-bit mask (the module-level "keep the output when the next layer keeps it"
    decision needs a module to remember it). Backward may run inside or outside the block.
    """
    return _SlimgradMode()
