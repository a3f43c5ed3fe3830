"""One registry for every fast kernel slimgrad can run: op family x device x dtype -> implementations.

Why one registry: the CPU speed work (the compiled core's C++ kernels) and the GPU work (Triton kernels) serve
the same autograd Functions. A Function asks ``choose(family, tensor)`` for an implementation and calls
it; it never imports a backend itself. Each implementation declares what it supports (devices, dtypes),
whether it can run here (its import succeeds, the core is built, ...) and a priority; the
registry picks the first that fits, in the order the preference says, and the choice is inspectable
(``table()`` and ``python -m slimgrad kernels``). This is xformers' attention dispatch, reduced.

Preference (``SLIMGRAD_KERNELS`` at import, or :func:`set_preference` / :func:`preference`):

* ``auto`` (default): the highest-priority available implementation for the family, device and dtype.
  Triton implementations are used on CUDA tensors only (on CPU the Triton interpreter is for checking,
  never for speed).
* ``torch``: only the torch implementations (today's path; how the fallback is tested).
* ``triton``: a Triton implementation wherever one exists for the family and dtype, on CUDA tensors and,
  when ``TRITON_INTERPRET=1`` is set, on CPU tensors (how tests check Triton kernels without a GPU);
  the torch implementation elsewhere.
* ``core``: the compiled core's kernel (:mod:`slimgrad.csrc`) wherever one exists, else torch. Core kernels are
  skipped while the core is disabled (``SLIMGRAD_CORE=0``, ``slimgrad.csrc.disabled()``) or cannot be built.

An unknown value, or ``triton`` when triton cannot be imported, is an error that says so.

An implementation is any object; the family fixes its interface (documented where the family's
Functions live). ``register`` takes a zero-argument ``load`` callable so that heavy work (building
the core, importing triton) happens on first use, and a failure makes the implementation unavailable, not an error.
The lookup a Function does per call is one dict access once warm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import threading
from collections.abc import Callable, Iterable

import torch

__all__ = [
    "Kernel",
    "PREFERENCES",
    "core_loader",
    "register",
    "choose",
    "choose_or_reference",
    "get_preference",
    "set_preference",
    "preference",
    "implementations",
    "families",
    "table",
    "triton_interpreting",
]

PREFERENCES = ("auto", "torch", "triton", "core")

#: Backend names with a meaning to the preference logic.
TORCH, TRITON, CORE = "torch", "triton", "core"


@dataclasses.dataclass
class Kernel:
    """One implementation of one op family.

    ``backend``: "torch", "core" or "triton" (what the preference selects on). ``devices``: device types
    it runs on ("cpu", "cuda"; a Triton kernel lists "cuda" and runs on "cpu" only under the
    interpreter). ``dtypes``: the tensor dtypes it handles. ``priority``: higher wins under "auto".
    ``load``: returns the implementation object; called once, on first use; an exception there makes the
    kernel unavailable (the reason is kept for the table).
    """

    family: str
    backend: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    load: Callable[[], object]
    priority: int = 0
    note: str = ""
    _impl: object = dataclasses.field(default=None, repr=False)
    _error: str | None = dataclasses.field(default=None, repr=False)
    _loaded: bool = dataclasses.field(default=False, repr=False)

    def implementation(self):
        """The loaded implementation, or None when it cannot run here."""
        if not self._loaded:
            self._loaded = True
            try:
                self._impl = self.load()
            except NotBuiltYet as exc:  # only described (the table): a later call loads it
                self._loaded = False
                self._error = str(exc)
                self._impl = None
            except Exception as exc:  # noqa: BLE001 - any import/build failure means "not available"
                self._error = f"{type(exc).__name__}: {exc}"
                self._impl = None
        return self._impl

    @property
    def available(self) -> bool:
        return self.implementation() is not None

    @property
    def unavailable_reason(self) -> str | None:
        self.implementation()
        return self._error

    def supports(self, device_type: str, dtype: torch.dtype) -> bool:
        if dtype not in self.dtypes:
            return False
        if device_type in self.devices:
            return True
        # Triton kernels run on CPU tensors under the interpreter.
        return self.backend == TRITON and device_type == "cpu" and triton_interpreting()


_KERNELS: dict[str, list[Kernel]] = {}
_CACHE: dict[tuple[str, str, torch.dtype, bool], object] = {}


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), which works on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _read_env() -> str:
    value = os.environ.get("SLIMGRAD_KERNELS", "auto").strip().lower() or "auto"
    _check_preference(value, source="the environment variable SLIMGRAD_KERNELS")
    return value


def _check_preference(value: str, *, source: str) -> None:
    if value == "numba":
        raise ValueError(f"slimgrad: {source} is 'numba', but slimgrad's numba kernels were replaced by its compiled "
                         f"core (one-pass C++ kernels, built on first use): use 'core' (or 'auto', the default)")
    if value not in PREFERENCES:
        raise ValueError(f"slimgrad: {source} must be one of {', '.join(PREFERENCES)}, got {value!r}")
    if value == TRITON and importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"slimgrad: {source} is 'triton' but triton is not installed "
                           f"(pip install triton, or the 'triton' extra: pip install 'slimgrad[triton]')")


_PREFERENCE = _read_env()


def get_preference() -> str:
    return _PREFERENCE


def set_preference(value: str) -> None:
    """Set the kernel preference for this process (same values as ``SLIMGRAD_KERNELS``)."""
    global _PREFERENCE
    value = str(value).strip().lower()
    _check_preference(value, source="set_preference's argument 'value'")
    _PREFERENCE = value
    _CACHE.clear()


@contextlib.contextmanager
def preference(value: str):
    """Temporarily set the kernel preference (tests: ``with preference("torch"): ...``)."""
    old = _PREFERENCE
    set_preference(value)
    try:
        yield
    finally:
        set_preference(old)


def register(family: str, backend: str, *, devices: Iterable[str], dtypes: Iterable[torch.dtype],
             load: Callable[[], object], priority: int = 0, note: str = "") -> Kernel:
    """Declare an implementation of ``family``. Registering is cheap: nothing is imported until used."""
    if backend not in (TORCH, TRITON, CORE):
        raise ValueError(f"slimgrad.kernels.register: 'backend' must be torch, triton or core, got {backend!r}")
    kernel = Kernel(family, backend, tuple(devices), tuple(dtypes), load, priority, note)
    _KERNELS.setdefault(family, []).append(kernel)
    _CACHE.clear()
    return kernel


def _candidates(family: str, device_type: str, dtype: torch.dtype) -> list[Kernel]:
    kernels = [k for k in _KERNELS.get(family, ()) if k.supports(device_type, dtype)]
    if not _core_enabled():
        kernels = [k for k in kernels if k.backend != CORE]
    pref = _PREFERENCE
    if pref == TORCH:
        kernels = [k for k in kernels if k.backend == TORCH]
    elif pref in (TRITON, CORE):
        # The preferred backend first, then torch (never another fast backend).
        kernels = [k for k in kernels if k.backend in (pref, TORCH)]
        kernels.sort(key=lambda k: (k.backend != pref, -k.priority))
        return kernels
    else:
        # auto: Triton on CUDA only; the interpreter is for checking, not speed.
        kernels = [k for k in kernels if not (k.backend == TRITON and device_type != "cuda")]
    kernels.sort(key=lambda k: -k.priority)
    return kernels


_CORE_STATE: list = []  # slimgrad.csrc's state dict, looked up once (kernels never import it at module level)


def _core_enabled() -> bool:
    if not _CORE_STATE:
        from slimgrad import csrc

        _CORE_STATE.append(csrc._STATE)
    return _CORE_STATE[0]["enabled"]


class NotBuiltYet(RuntimeError):
    """A core kernel asked about while only describing (:func:`table`), before the core was built: not an error
    that sticks (the next real call builds or loads the core)."""


_DESCRIBING = threading.local()  # (per thread: another thread's real first call must build, not be described)


@contextlib.contextmanager
def describing():
    """Inside, core kernels that would need the compiled core built first report "not built yet" instead of building
    it (``python -m slimgrad kernels`` describes; it compiled the core for minutes on a fresh install)."""
    old = getattr(_DESCRIBING, "on", False)
    _DESCRIBING.on = True
    try:
        yield
    finally:
        _DESCRIBING.on = old


def core_loader(make: Callable[[object], object]) -> Callable[[], object]:
    """A ``load`` for a core kernel: ``make(core module)``, or an error (the kernel is then unavailable) where the
    compiled core is off or could not be built."""

    def load():
        from slimgrad import csrc

        if (getattr(_DESCRIBING, "on", False) and csrc._STATE["module"] is csrc._UNLOADED and csrc.enabled()
                and not csrc.status()["cached"]):
            raise NotBuiltYet("the compiled core is not built yet (built on first use, or `python -m slimgrad build`)")
        core = csrc.core()
        if core is None:
            raise RuntimeError("the compiled core is off or unavailable (python -m slimgrad kernels says why)")
        return make(core)

    return load


def clear_cache() -> None:
    """Forget the per-(family, device, dtype) choices."""
    _CACHE.clear()


def choose_kernel(family: str, device_type: str, dtype: torch.dtype) -> Kernel | None:
    """The :class:`Kernel` that would run for ``family`` on (device type, dtype), or None."""
    for kernel in _candidates(family, device_type, dtype):
        if kernel.available:
            return kernel
    return None


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def choose(family: str, tensor: torch.Tensor):
    """The implementation object to use for ``family`` on ``tensor``'s device and dtype, or None when no
    registered implementation fits (the caller then runs its own torch code).

    A fake tensor (``slimgrad.estimate``'s simulated step) gets the Triton kernel the real tensor would get, else
    None (the torch code). Why the Triton kernel: its wrapper allocates its outputs and scratch with torch ops,
    which fake tensors simulate, and launches kernels, which are skipped for fake arguments
    (:mod:`slimgrad.kernels.triton._jit`); so the estimate sees the very allocations of the real CUDA step. The
    torch reference allocates other transients (max pooling's int64 indices: measured 5 % above a ResNet's CUDA
    peak). A compiled core kernel reads its tensors' data in C++ and cannot run on fakes: the torch code stands in
    for it (:func:`simulates_core` lets a family allocate what the core would)."""
    fake = type(tensor) is not torch.Tensor and _is_fake(tensor)
    # the core's switch is part of the key: csrc.disabled() around one call does not cost the next a lookup
    key = (family, tensor.device.type, tensor.dtype, _core_enabled(), fake)
    try:
        return _CACHE[key]
    except KeyError:
        pass
    kernel = choose_kernel(family, key[1], key[2])
    impl = None if kernel is None or (fake and kernel.backend != TRITON) else kernel.implementation()
    _CACHE[key] = impl
    return impl


def simulates_core(family: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake CPU tensor (``slimgrad.estimate``'s simulated step) whose real counterpart would
    get ``family``'s compiled-core kernel. That kernel reads data in C++ and cannot run on fakes, and the torch
    reference allocates other transients (a one-byte mask, packing temporaries): such a family hands fakes a
    stand-in that allocates what the core's kernel allocates."""
    if type(tensor) is torch.Tensor or tensor.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if not _is_fake(tensor):
        return False
    kernel = choose_kernel(family, "cpu", tensor.dtype)
    return kernel is not None and kernel.backend == CORE


def choose_or_reference(family: str, tensor: torch.Tensor, reference):
    """The family's chosen implementation for ``tensor``, or ``reference`` (its torch implementation) while
    ``torch.compile`` traces (the fast backends are eager-only) or when nothing fits."""
    if torch.compiler.is_compiling():
        return reference
    return choose(family, tensor) or reference


def implementations(family: str) -> list[Kernel]:
    return list(_KERNELS.get(family, ()))


def families() -> list[str]:
    return sorted(_KERNELS)


_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def table(devices: Iterable[str] = ("cpu", "cuda")) -> list[dict]:
    """Rows (family, device, dtype, available backends, chosen backend) under the current preference; describes
    only: a compiled core not yet built is reported so, not built (:func:`describing`)."""
    with describing():
        return _table(devices)


def _table(devices) -> list[dict]:
    rows = []
    for family in families():
        for device in devices:
            for dtype in _TABLE_DTYPES:
                fitting = [k for k in _KERNELS[family] if k.supports(device, dtype)]
                if not fitting:
                    continue
                avail = [k.backend for k in fitting if k.available]
                missing = {k.backend: k.unavailable_reason for k in fitting if not k.available}
                chosen = choose_kernel(family, device, dtype)
                rows.append({
                    "family": family,
                    "device": device,
                    "dtype": str(dtype).replace("torch.", ""),
                    "available": avail,
                    "unavailable": missing,
                    "chosen": chosen.backend if chosen else None,
                })
    return rows


def format_table(devices: Iterable[str] = ("cpu", "cuda")) -> str:
    rows = table(devices)
    lines = [f"slimgrad kernels (SLIMGRAD_KERNELS={_PREFERENCE}, TRITON_INTERPRET="
             f"{os.environ.get('TRITON_INTERPRET', '0')}, cuda available: {torch.cuda.is_available()})",
             f"{'family':<22}{'device':<8}{'dtype':<10}{'available':<24}{'chosen':<8}"]
    for r in rows:
        lines.append(f"{r['family']:<22}{r['device']:<8}{r['dtype']:<10}{','.join(r['available']) or '-':<24}"
                     f"{r['chosen'] or '-':<8}")
    reasons = {}
    for r in rows:
        for backend, why in r["unavailable"].items():
            reasons.setdefault((r["family"], backend), why)
    for (family, backend), why in sorted(reasons.items()):
        lines.append(f"  {family}/{backend} unavailable: {why}")
    return "\n".join(lines)
