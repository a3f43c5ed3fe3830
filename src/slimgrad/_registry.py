"""The converter's registry: exact stock module type -> slimgrad replacement class.

Each replacement subclasses the stock class and overrides ``forward`` only, so converting a module is a
class swap (``module.__class__ = Replacement``): parameters, buffers, hooks and attributes stay where they
are, ``isinstance`` still holds, and reverting swaps the class back.
"""

from __future__ import annotations

from torch import nn

#: stock type -> slimgrad type
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {}
#: slimgrad type -> stock type
ORIGINALS: dict[type[nn.Module], type[nn.Module]] = {}


def register(stock: type[nn.Module]):
    """Class decorator: make ``cls`` the replacement for modules whose type is exactly ``stock``.

    ``cls`` must subclass ``stock`` and add no state of its own. It may define a classmethod
    ``unsupported_reason(module) -> str | None``; a non-None reason makes the converter leave that module
    alone and report why.
    """

    def decorate(cls):
        if not issubclass(cls, stock):
            raise TypeError(f"{cls.__name__} must subclass {stock.__name__} to replace it")
        if stock in REPLACEMENTS:
            raise ValueError(f"{stock.__name__} already has a replacement: {REPLACEMENTS[stock].__name__}")
        REPLACEMENTS[stock] = cls
        ORIGINALS[cls] = stock
        return cls

    return decorate
