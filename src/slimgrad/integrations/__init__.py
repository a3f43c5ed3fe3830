"""Integrations with other libraries' module classes (transformers, peft, bitsandbytes, diffusers).

Each integration module registers replacements for that library's classes when imported. They are
imported lazily by :func:`load_available`, and only for libraries the user's process has already
imported (a model built with transformers means transformers is in ``sys.modules``), so slimgrad never
pays for or requires a library the user does not use.

One broken integration breaks only itself: an upstream release that renames a helper, changes a signature
or fails to import makes that integration module fail, and :func:`load_available` then disables it (its
partial registrations undone), records an integration gap naming the library and its version
(:func:`slimgrad._notices.record_integration_gap`) and warns once; ``convert`` goes on with the others.
"""

from __future__ import annotations

import importlib
import sys

from slimgrad import _notices, _registry

#: library -> slimgrad integration modules to import when that library is loaded
INTEGRATIONS: dict[str, tuple[str, ...]] = {
    "transformers": ("hf_norms", "hf_mlp", "hf_moe", "hf_loss", "hf_layer_norm_2d"),
    "peft": ("peft_lora", "peft_lora_conv"),
    "bitsandbytes": ("bnb",),
    "diffusers": ("diffusers",),
}


#: integration module name -> the gap that disabled it (not retried in this process)
_DISABLED: dict[str, _notices.Gap] = {}


def _disable(library: str, name: str, error: BaseException, before: set) -> None:
    """Undo what module ``name`` registered before failing, record the gap and warn once."""
    for stock in set(_registry.REPLACEMENTS) - before:
        replacement = _registry.REPLACEMENTS.pop(stock)
        _registry.ORIGINALS.pop(replacement, None)
        _registry.OPTIONS.pop(stock, None)
    reason = (f"the {name} integration failed ({type(error).__name__}: {error}); modules of {library} are left "
              f"as stock")
    gap = _notices.record_integration_gap(library, name, reason)
    _DISABLED[name] = gap
    _notices.notify(gap, stacklevel=5)  # the caller of convert


def load_available() -> list[str]:
    """Import the integration modules of every library already imported; returns those loaded.

    An integration module may define ``refresh()``: it is called on every load so that classes from
    model code imported since the last conversion are registered too. An integration that fails to import
    or refresh (any exception) is disabled, recorded as a gap and warned about once; the others go on.
    """
    loaded = []
    for library, modules in INTEGRATIONS.items():
        if library not in sys.modules:
            continue
        for name in modules:
            if name in _DISABLED:
                continue
            before = set(_registry.REPLACEMENTS)
            try:
                module = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name == f"{__name__}.{name}":  # an integration this slimgrad does not ship
                    continue
                _disable(library, name, e, before)
                continue
            except Exception as e:  # noqa: BLE001 - whatever upstream changed, only this integration stops
                _disable(library, name, e, before)
                continue
            loaded.append((library, module))
    # Refresh after every import: one integration may import model code that another registers from.
    for library, module in loaded:
        refresh = getattr(module, "refresh", None)
        if refresh is None:
            continue
        name = module.__name__.rsplit(".", 1)[-1]
        before = set(_registry.REPLACEMENTS)
        try:
            refresh()
        except Exception as e:  # noqa: BLE001
            _disable(library, name, e, before)
    return [m.__name__.rsplit(".", 1)[-1] for _, m in loaded if m.__name__.rsplit(".", 1)[-1] not in _DISABLED]
