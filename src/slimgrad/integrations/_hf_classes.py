"""The one scan every transformers integration runs: the module classes defined in the transformers modeling
modules imported so far. Each integration filters them by name and then verifies the forward's source."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

from torch import nn

__all__ = ["import_modeling", "loaded_transformers_classes"]


def loaded_transformers_classes() -> Iterator[tuple[str, type[nn.Module]]]:
    """``(name, class)`` for every ``nn.Module`` subclass defined (not merely imported) in an imported
    ``transformers.models.*.modeling_*`` module."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("transformers.models.") or ".modeling_" not in module_name:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == module_name and issubclass(value, nn.Module):
                yield name, value


def import_modeling(families) -> None:
    """Import ``transformers.models.<family>.modeling_<family>`` for each family this transformers has, so that an
    integration registers their classes even when the user's model code is imported after slimgrad."""
    for name in families:
        try:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # a family this transformers version lacks
            continue
