"""Integrations with other libraries' module classes (transformers, peft, bitsandbytes, diffusers).

Each integration module registers replacements for that library's classes when imported. They are
imported lazily by :func:`load_available`, and only for libraries the user's process has already
imported (a model built with transformers means transformers is in ``sys.modules``), so slimgrad never
pays for or requires a library the user does not use.
"""

from __future__ import annotations

import importlib
import sys

#: library -> slimgrad integration modules to import when that library is loaded
INTEGRATIONS: dict[str, tuple[str, ...]] = {
    "transformers": ("hf_norms", "hf_mlp", "hf_loss", "hf_layer_norm_2d"),
    "peft": ("peft_lora", "peft_lora_conv"),
    "bitsandbytes": ("bnb",),
    "diffusers": ("diffusers",),
}


def load_available() -> list[str]:
    """Import the integration modules of every library already imported; returns those loaded.

    An integration module may define ``refresh()``: it is called on every load so that classes from
    model code imported since the last conversion are registered too.
    """
    loaded = []
    for library, modules in INTEGRATIONS.items():
        if library not in sys.modules:
            continue
        for name in modules:
            try:
                module = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":  # a real missing dependency, not a missing module
                    raise
                continue
            loaded.append(module)
    # Refresh after every import: one integration may import model code that another registers from.
    for module in loaded:
        refresh = getattr(module, "refresh", None)
        if refresh is not None:
            refresh()
    return [m.__name__.rsplit(".", 1)[-1] for m in loaded]
