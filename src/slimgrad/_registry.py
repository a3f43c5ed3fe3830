"""The converter's registry: exact stock module type -> slimgrad replacement class.

Each replacement subclasses the stock class and overrides ``forward`` only, so converting a module is a
class swap (``module.__class__ = Replacement``): parameters, buffers, hooks and attributes stay where they
are, ``isinstance`` still holds, and reverting swaps the class back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

#: stock type -> slimgrad type
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {}
#: slimgrad type -> stock type
ORIGINALS: dict[type[nn.Module], type[nn.Module]] = {}
#: stock type -> name of the ``convert`` option that must be True for it to be replaced
OPTIONS: dict[type[nn.Module], str] = {}


def register(stock: type[nn.Module], *, option: str | None = None):
    """Class decorator: make ``cls`` the replacement for modules whose type is exactly ``stock``.

    ``cls`` must subclass ``stock`` and add no state of its own. It may define a classmethod
    ``unsupported_reason(module) -> str | None``; a non-None reason makes the converter leave that module
    alone and report why. With ``option="name"``, only ``convert(..., name=True)`` swaps it in (for
    replacements that change a documented contract, such as returning the loss without logits).
    """

    def decorate(cls):
        if not issubclass(cls, stock):
            raise TypeError(f"{cls.__name__} must subclass {stock.__name__} to replace it")
        if stock in REPLACEMENTS:
            raise ValueError(f"{stock.__name__} already has a replacement: {REPLACEMENTS[stock].__name__}")
        REPLACEMENTS[stock] = cls
        ORIGINALS[cls] = stock
        if option is not None:
            OPTIONS[stock] = option
        return cls

    return decorate


def register_forward(stock: type[nn.Module], forward: Callable, *, module: str,
                     unsupported_reason: Callable | None = None, option: str | None = None) -> type[nn.Module]:
    """Build and register a replacement for ``stock`` whose only change is ``forward``.

    For families with many stock classes that share one forward (every Hugging Face RMSNorm, say). The
    class is named ``Slim<Stock>`` and published in ``module``'s namespace so pickling finds it.
    ``unsupported_reason(module) -> str | None`` as for :func:`register`. Registering a stock class twice
    returns the existing replacement.
    """
    if stock in REPLACEMENTS:
        return REPLACEMENTS[stock]
    attrs = {"forward": forward, "__module__": module, "__qualname__": f"Slim{stock.__name__}",
             "__doc__": f"slimgrad's drop-in for {stock.__module__}.{stock.__name__} (forward only)."}
    if unsupported_reason is not None:
        attrs["unsupported_reason"] = classmethod(lambda cls, m: unsupported_reason(m))
    cls = type(f"Slim{stock.__name__}", (stock,), attrs)
    register(stock, option=option)(cls)
    setattr(sys.modules[module], cls.__name__, cls)
    return cls
