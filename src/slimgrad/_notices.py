"""What slimgrad could not do that a user asked for, and how it says so.

Upstream libraries change every few weeks. An integration that cannot engage (a forward slimgrad no longer
recognises, an import that fails, a loss function it cannot reproduce) must never be silent: it records a
:class:`Gap` here, and :func:`slimgrad.convert` warns about every gap that concerns the model it converts,
once per (subject, reason), at WARNING level on the ``slimgrad`` logger and as a :class:`SlimgradWarning`
(so ``-W error`` and ``pytest.warns`` see it); ``convert(strict=True)`` raises :class:`SlimgradGapError`
instead.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import warnings

__all__ = ["Gap", "SlimgradGapError", "SlimgradWarning", "class_gap", "integration_gaps", "library_version",
           "forget_integration_gap", "notify", "notify_all", "record_class_gap", "record_integration_gap"]

log = logging.getLogger("slimgrad")


class SlimgradWarning(UserWarning):
    """A feature the user asked for (a conversion, ``chunked_loss``) does not engage, and why."""


class SlimgradGapError(RuntimeError):
    """Raised instead of a :class:`SlimgradWarning` under ``convert(strict=True)``."""


@dataclasses.dataclass(frozen=True)
class Gap:
    """One thing slimgrad left to upstream, with the reason and the library version it was seen on."""

    library: str  # distribution name: "transformers", "peft", "bitsandbytes", "diffusers"
    version: str  # the installed version, or "not installed"
    subject: str  # qualified class name, or the integration module's name
    family: str  # what the user would call it: "RMSNorm", "gated MLP", "LoRA layer", "chunked_loss", ...
    reason: str

    def message(self) -> str:
        return (f"slimgrad: {self.family} {self.subject} is left as stock ({self.library} {self.version}): "
                f"{self.reason}")


def library_version(library: str) -> str:
    """The installed version of distribution ``library`` (``"not installed"`` when it is not)."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


#: stock class -> why slimgrad does not replace it (a claimed family it could not verify)
_CLASS_GAPS: dict[type, Gap] = {}
#: integration module name -> why it is disabled (import error, missing attribute, changed signature)
_INTEGRATION_GAPS: dict[str, Gap] = {}
#: (subject, reason) pairs already warned about in this process
_WARNED: set[tuple[str, str]] = set()


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def record_class_gap(cls: type, *, library: str, family: str, reason: str) -> Gap:
    """Remember that ``cls`` (of a family slimgrad claims) is left to upstream, and why."""
    gap = Gap(library, library_version(library), _qualified(cls), family, reason)
    _CLASS_GAPS[cls] = gap
    return gap


def forget_class_gap(cls: type) -> None:
    """``cls`` was registered after all (a later check passed)."""
    _CLASS_GAPS.pop(cls, None)


def class_gap(cls: type) -> Gap | None:
    return _CLASS_GAPS.get(cls)


def record_integration_gap(library: str, integration: str, reason: str) -> Gap:
    """Remember that a whole integration is disabled (it failed to import or to register)."""
    gap = Gap(library, library_version(library), integration, "integration", reason)
    _INTEGRATION_GAPS[integration] = gap
    return gap


def forget_integration_gap(integration: str) -> None:
    """``integration`` works after all (tests, a later successful load)."""
    _INTEGRATION_GAPS.pop(integration, None)


def integration_gaps() -> list[Gap]:
    return list(_INTEGRATION_GAPS.values())


def notify(gap: Gap | str, *, strict: bool = False, stacklevel: int = 3) -> None:
    """Warn about ``gap`` once per process (WARNING log + :class:`SlimgradWarning`), or raise under strict."""
    message = gap.message() if isinstance(gap, Gap) else gap
    if strict:
        raise SlimgradGapError(message + " (convert(strict=True) turns this warning into an error)")
    key = (gap.subject, gap.reason) if isinstance(gap, Gap) else (message, "")
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning("%s", message)
    warnings.warn(message, SlimgradWarning, stacklevel=stacklevel)


def notify_all(gaps: list[Gap], *, strict: bool = False, stacklevel: int = 4) -> None:
    """:func:`notify` each of ``gaps``; under ``strict``, one :class:`SlimgradGapError` naming them all (so a
    user fixing the first learns of the others at once)."""
    if strict and gaps:
        lines = list(dict.fromkeys(g.message() for g in gaps))
        raise SlimgradGapError("\n".join(lines) + "\n(convert(strict=True) turns these warnings into an error; "
                               "strict=False converts what it can and warns)")
    for gap in gaps:
        notify(gap, stacklevel=stacklevel)


def reset_warned() -> None:
    """Forget which gaps were already warned about (tests)."""
    _WARNED.clear()
