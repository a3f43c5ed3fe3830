"""Every module's ``forward`` wrapped for the length of one step, then put back as it was.

The audit and the estimate both need to know which module runs each op. They wrap the instances' ``forward``
rather than register hooks: slimgrad's layers (and other libraries) take stock's path when they see hooks,
which would change what is measured."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn


@contextlib.contextmanager
def forwards_wrapped(model: nn.Module, wrap: Callable[[nn.Module], Callable]):
    """``module.forward = wrap(module)`` on every module of ``model``; afterwards each module has again its own
    instance-level forward where it had one, or its class's."""
    wrapped = []
    try:
        for m in model.modules():
            wrapped.append((m, "forward" in m.__dict__, m.__dict__.get("forward")))
            m.forward = wrap(m)
        yield
    finally:
        for m, had_own, own in wrapped:
            if had_own:
                m.forward = own
            else:
                m.__dict__.pop("forward", None)
