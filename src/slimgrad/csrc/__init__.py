"""slimgrad's compiled eager core: built on first use, cached, never required.

Why it exists: where slimgrad saves memory, a Python ``autograd.Function`` and slimgrad's per-call Python cost
45-80 µs a layer call over stock (issue 22's measurements), which on small and mid-sized steps made a converted
model 1.10-1.28x slower than stock. One C++ ``torch::autograd::Function`` per saving op, called once from the
module's forward, costs about what stock's op costs, and its one-pass kernels (mask made in the same pass as the
values) move fewer bytes than stock.

How it is built: ``pip install`` stays compiler-free. The first eager call that can use the core (or
``python -m slimgrad build``) compiles the C++ files in this directory with ``torch.utils.cpp_extension`` into a
cache directory keyed by everything the binary depends on (torch version and build, Python, platform, CPU
capability, the sources themselves), under a file lock, so two processes (pytest-xdist workers, DDP ranks) build
once and the others wait and load. A cache that fails to load is removed and rebuilt once. Where no compiler
exists, or the build fails, the Python path runs and :func:`status` (``python -m slimgrad kernels``) says why.

``SLIMGRAD_CORE=0`` (or :func:`set_enabled`/:func:`disabled`) turns the core off: every op then runs its
Python Function, the reference the core is tested against bit for bit.

CUDA tensors: the families whose core is aten's ops only (convolution, batch norm, cuDNN's where stock runs it,
average pooling, LoRA linear whose adapters do not drop) serve them too, and so does ReLU / LeakyReLU on tensors up
to 4M elements, through an aten route in place of its CPU loops (``for_eager(x, cuda=True)``): the binary is built
without nvcc, and aten dispatches on the tensors' device at run time, so the core runs the CUDA kernels the Python
Function runs, in the same order, without the Python Function's per-call host cost (45-80 µs a layer call, which
made host-bound CUDA steps 1.15-2.56x stock). ``SLIMGRAD_CORE_CUDA=0`` at start-up keeps CUDA tensors on the Python
path (the core still serves CPU ones): the switch for a GPU problem, no code change needed. The other families with
their own CPU loops (the clamp masks, dropout bits and seeds, max-pool positions, the norms) serve CPU tensors only,
and so do the gated activations, aten's ops only but served on CUDA by their Triton kernel, LoRA linear whose
adapters drop and LoRA on convolutions (their CUDA default, the "seed" dropout policy, is the Python Function's
Triton kernel; the core's seed kernel shares its Philox stream, csrc/philox.h, so a CUDA one can take its place).

CUDA kernels of its own: where torch is a CUDA build and nvcc is found (``CUDA_HOME``), the build also compiles the
``*.cu`` files (today ReLU / LeakyReLU with the 1-bit mask: one launch each way where the aten route launches four
forward and two backward, each ~40 µs of host time on the GPU machines measured; and the "seed" dropout policy's
Philox kernel, built and tested but not routed to until a GPU run has checked it against Triton's), for the GPU
architectures torch
itself was built for (PTX on the newest; ``TORCH_CUDA_ARCH_LIST`` overrides; both are in the cache key), so a core
built on a machine without a GPU (a container image) runs on any GPU torch supports. Where that build fails (an nvcc
whose CUDA version differs from torch's, say), the failure is remembered beside the cache entry, said once, and the
core is built without them: CUDA tensors then run the aten route, with the same bits. ``SLIMGRAD_CORE_NVCC=0`` skips
them. A cached core loads as it was built, with or without them (a prebuilt one is never rebuilt because nvcc
appeared or went); ``python -m slimgrad build --force`` rebuilds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

__all__ = ["core", "for_eager", "build", "status", "enabled", "set_enabled", "disabled", "cache_root", "SOURCES_DIR"]

SOURCES_DIR = Path(__file__).resolve().parent

_UNLOADED = object()
# [loaded module, None when unavailable or not yet tried]; [0] is _UNLOADED until the first core() call.
_OFF = ("0", "off", "false", "no")
_STATE = {"module": _UNLOADED, "reason": None,
          "enabled": os.environ.get("SLIMGRAD_CORE", "1").strip().lower() not in _OFF,
          "cuda": os.environ.get("SLIMGRAD_CORE_CUDA", "1").strip().lower() not in _OFF, "cuda_reason": None}
_LOCK = threading.Lock()


def _sources() -> list[Path]:
    """Every family file; ``SLIMGRAD_CORE_SOURCES=common.cpp,relu_mask.cpp`` (development only) builds a subset,
    so that work on one family recompiles two files, not all of them."""
    subset = os.environ.get("SLIMGRAD_CORE_SOURCES")
    if subset:
        names = {"common.cpp", *(n.strip() for n in subset.split(",") if n.strip())}
        return sorted(SOURCES_DIR / n for n in names)
    return sorted(SOURCES_DIR.glob("*.cpp"))


def _headers() -> list[Path]:
    return sorted(SOURCES_DIR.glob("*.h"))


def _cuda_sources() -> list[Path]:
    return sorted(SOURCES_DIR.glob("*.cu"))


def _cuda_torch() -> str | None:
    """torch's CUDA version where the core may carry its own CUDA kernels (a CUDA build of torch, the kernels' sources
    present, neither ``SLIMGRAD_CORE_CUDA=0`` nor ``SLIMGRAD_CORE_NVCC=0``), else None. Asks no GPU: the key of a core
    built without one (a container image) is the key it has on a GPU machine."""
    if (torch.version.cuda is None or not _STATE["cuda"] or not _cuda_sources()
            or os.environ.get("SLIMGRAD_CORE_NVCC", "1").strip().lower() in _OFF):
        return None
    try:
        _cuda_arch_list()
    except RuntimeError:  # nothing to build for (_why_no_cuda_kernels says so)
        return None
    return torch.version.cuda


def _nvcc() -> str | None:
    """nvcc's path (``CUDA_HOME/bin/nvcc``, as torch.utils.cpp_extension finds it), or None."""
    try:
        from torch.utils import cpp_extension

        home = cpp_extension.CUDA_HOME
    except Exception:  # noqa: BLE001 - a broken CUDA install: the aten route runs
        return None
    nvcc = Path(home) / "bin" / "nvcc" if home else None
    return str(nvcc) if nvcc is not None and nvcc.exists() else None


def _cuda_arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST`` for the build: the user's, else the architectures torch itself was built for (its
    ``sm_XY`` list, read without initialising CUDA), PTX on the newest for later GPUs."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)() or ""
    archs = sorted({int(a[3:]) for a in flags.split() if a.startswith("sm_") and a[3:].isdigit()})
    if not archs:
        raise RuntimeError(f"torch lists no CUDA architectures it was built for ({flags!r}); set TORCH_CUDA_ARCH_LIST")
    names = [f"{a // 10}.{a % 10}" for a in archs]
    return ";".join(names[:-1] + [names[-1] + "+PTX"])


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # very old torch
        return "DEFAULT"


def _flags() -> list[str]:
    """Compiler flags. ``-ffp-contract=off``: no fused multiply-adds the source does not write, so arithmetic
    rounds as stock's kernels round (bitwise equality is the contract). OpenMP: ATen's ``parallel_for`` is
    inline OpenMP in the headers; the extension resolves ``libgomp.so.1`` to the runtime torch already loaded."""
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-DNDEBUG"]
    cap = _cpu_capability()
    if cap in ("AVX2", "AVX512") and platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _key(cuda: str | None = None) -> str:
    """What the binary depends on; a change in any of it is a different cache entry. ``cuda``: the CUDA version
    the *.cu kernels are built for (:func:`_cuda_torch`; with the architectures, :func:`_cuda_arch_list`), None for a
    core without them."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(getattr(torch.version, "git_version", "")), sys.version,
                 platform.machine(), platform.system(), sysconfig.get_config_var("EXT_SUFFIX") or "",
                 str(torch._C._GLIBCXX_USE_CXX11_ABI), _cpu_capability(), " ".join(_flags())):
        h.update(part.encode())
    if cuda is not None:
        h.update(f"cuda {cuda} {_cuda_arch_list()}".encode())
    for path in _sources() + _headers() + (_cuda_sources() if cuda is not None else []):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``SLIMGRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/slimgrad``, else ``~/.cache/slimgrad``."""
    env = os.environ.get("SLIMGRAD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "slimgrad"


def _build_dir(key: str) -> Path:
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    tag = f"torch{torch.__version__.replace('+', '_')}-{py}-{platform.machine()}"
    return cache_root() / "core" / f"{tag}-{key}"


def _module_name(key: str) -> str:
    return f"slimgrad_core_{key}"


def _library_path(directory: Path, name: str) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0] if sys.platform != "win32" else ".pyd"
    for candidate in (directory / f"{name}.so", directory / f"{name}{suffix}"):
        if candidate.exists():
            return candidate
    return directory / f"{name}.so"


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock across processes (fcntl; on platforms without it, a lock directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: mkdir is atomic
        lockdir = path.with_suffix(".lockdir")
        while True:
            try:
                lockdir.mkdir()
                break
            except FileExistsError:
                time.sleep(0.5)
        try:
            yield
        finally:
            shutil.rmtree(lockdir, ignore_errors=True)
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Progress:
    """One line on stderr while the build runs (elapsed seconds), so a first call that compiles is not mistaken
    for a hang; silent when ``quiet``."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if not self.quiet:
            print("slimgrad: building its compiled core (once per torch version and machine, a few minutes; "
                  "`python -m slimgrad build` does it ahead of time) ...", file=sys.stderr, flush=True)
            if sys.stderr.isatty():
                self._thread = threading.Thread(target=self._tick, daemon=True)
                self._thread.start()
        self._t0 = time.monotonic()
        return self

    def _tick(self):
        while not self._stop.wait(1.0):
            print(f"\rslimgrad: compiling ... {time.monotonic() - self._t0:4.0f} s", end="", file=sys.stderr,
                  flush=True)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            print(file=sys.stderr)
        if not self.quiet and exc[0] is None:
            print(f"slimgrad: compiled core built in {time.monotonic() - self._t0:.0f} s", file=sys.stderr,
                  flush=True)
        return False


def _compile(directory: Path, name: str, verbose: bool, cuda: str | None = None):
    from torch.utils import cpp_extension

    if cuda is None:
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in _sources()],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SOURCES_DIR)],
            build_directory=str(directory),
            verbose=verbose,
            with_cuda=False,
        )
    # --fmad=false: no fused multiply-adds the source does not write (nvcc's -ffp-contract=off), as for the C++
    arch, old = _cuda_arch_list(), os.environ.get("TORCH_CUDA_ARCH_LIST")  # (read by cpp_extension)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in _sources() + _cuda_sources()],
            extra_cflags=[*_flags(), "-DSLIMGRAD_CUDA_KERNELS"],
            extra_cuda_cflags=["-O3", "--fmad=false"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SOURCES_DIR)],
            build_directory=str(directory),
            verbose=verbose,
            with_cuda=True,
        )
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


def _why_no_compiler() -> str | None:
    """A reason the core cannot be built here, found without trying (no C++ compiler, no ninja)."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        return f"no C++ compiler found (looked for $CXX={cxx!r}, g++, clang++)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja; slimgrad declares it as a dependency)"
    return None


def build(*, verbose: bool = False, quiet: bool = False, force: bool = False):
    """Build (or load from the cache) the compiled core and return its module; raises with the reason on failure.

    ``force`` removes this version's cache entry first. Safe to call from several processes at once.
    A complete cached entry loads, the one with the core's CUDA kernels first (:func:`_cuda_torch`), without a
    compiler. Else the core is built, with them where nvcc is found; if that build fails, once (remembered beside the
    entry until ``force``), without them."""
    cuda = _cuda_torch()
    if not force:
        for variant in ((cuda, None) if cuda is not None else (None,)):
            module = _load_verified(variant)
            if module is not None:
                if variant is None and cuda is not None:
                    _STATE["cuda_reason"] = ("the cached core was built without them (no nvcc then); `python -m "
                                             "slimgrad build --force` rebuilds it with them where nvcc is found")
                return module
    reason = _why_no_compiler()
    if reason is not None:
        raise RuntimeError(f"slimgrad: cannot build the compiled core: {reason}")
    if cuda is not None and _nvcc() is None:
        _STATE["cuda_reason"] = _why_no_cuda_kernels()
    elif cuda is not None:
        failed = _cuda_failure_path(_key(cuda))
        if force:
            failed.unlink(missing_ok=True)
        if not failed.exists():
            try:
                return _build_one(cuda, verbose, quiet, force)
            except Exception as e:  # noqa: BLE001 - the core without its CUDA kernels; the aten route runs
                with contextlib.suppress(OSError):
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(f"{type(e).__name__}: {_first_line(e)}\n")
                _STATE["cuda_reason"] = f"{type(e).__name__}: {_first_line(e)}"
                _warn_cuda(_STATE["cuda_reason"])
        else:
            _STATE["cuda_reason"] = _read_failure(failed)
    return _build_one(None, verbose, quiet, force)


def _load_verified(cuda: str | None):
    """The cached core of this variant where its entry is complete (checksum), loaded; else None."""
    key = _key(cuda)
    directory, name = _build_dir(key), _module_name(key)
    if not _verified(directory, name):
        return None
    try:
        module = _import(_library_path(directory, name), name)
    except Exception:  # noqa: BLE001 - a broken entry: the build below replaces it
        return None
    _touch(directory, name)
    return _finish(module)


def _cuda_failure_path(key: str) -> Path:
    """Beside the entry, named after it (the entry's name has dots: ``torch2.13.0_cu130-...``, no suffix to swap)."""
    directory = _build_dir(key)
    return directory.parent / f"{directory.name}.cuda-failed"


def _read_failure(path: Path) -> str:
    with contextlib.suppress(OSError):
        return f"their build failed before ({path.read_text().strip()}; `python -m slimgrad build --force` retries)"
    return "their build failed before"


def _warn_cuda(reason: str) -> None:
    import warnings

    warnings.warn(f"slimgrad: the compiled core's CUDA kernels did not build ({reason}); the core is built without "
                  "them and CUDA tensors run its aten route (same numbers and bytes, more kernel launches). "
                  "`python -m slimgrad build --verbose --force` shows the compiler's output.",
                  RuntimeWarning, stacklevel=3)


def _build_one(cuda: str | None, verbose: bool, quiet: bool, force: bool):
    key = _key(cuda)
    directory, name = _build_dir(key), _module_name(key)
    if not force and _verified(directory, name):
        # a complete entry loads without the lock: a read-only cache (a container image's prebuilt core, a shared
        # SLIMGRAD_CACHE_DIR) could not open the lock file, and the core was not used at all
        _touch(directory, name)
        return _finish(_import(_library_path(directory, name), name))
    with _file_lock(directory.parent / f"{directory.name}.lock"):
        if force:
            shutil.rmtree(directory, ignore_errors=True)
        library = _library_path(directory, name)
        if library.exists():
            if _verified(directory, name):
                try:
                    return _finish(_import(library, name))
                except Exception:  # noqa: BLE001 - a broken cache entry: rebuild it once
                    pass
            # an entry without its checksum, or another's (an interrupted copy, a crash before the data reached the
            # disk): loading a truncated library killed the process with SIGBUS, so it is rebuilt, never loaded
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        with _Progress(quiet or verbose):
            module = _compile(directory, name, verbose, cuda)
        _write_checksum(directory, name)
    _prune(directory)
    return _finish(module)


#: how many builds of one torch version, Python and machine the cache keeps, the most recently used: each slimgrad
#: release (or source edit) is an entry of ~11 MB, and a development machine's cache had reached 553 MB
KEEP_BUILDS = 3


def _touch(directory: Path, name: str) -> None:
    """Mark the entry used now (its checksum file's time), for :func:`_prune`; a read-only cache stays as it is."""
    with contextlib.suppress(OSError):
        os.utime(_checksum_path(directory, name))


def _last_used(directory: Path) -> float:
    try:
        return max(p.stat().st_mtime for p in directory.iterdir())
    except (OSError, ValueError):  # gone meanwhile, or empty
        return 0.0


def _prune(directory: Path) -> None:
    """After a build, remove the entries of the same torch version, Python and machine beyond the
    :data:`KEEP_BUILDS` most recently used (the new one counts). Each is removed under its own build lock, taken
    without waiting: an entry another process is building is left. A process that loaded a removed library keeps
    running (the mapping outlives the file); a later one rebuilds it."""
    try:
        import fcntl
    except ImportError:  # no non-blocking lock to take: keep everything
        return
    tag = directory.name.rsplit("-", 1)[0]
    try:
        others = [d for d in directory.parent.glob(f"{tag}-*") if d.is_dir() and d != directory]
    except OSError:
        return
    others.sort(key=_last_used, reverse=True)
    for old in others[max(KEEP_BUILDS - 1, 0):]:
        lock = old.parent / f"{old.name}.lock"
        try:
            with open(lock, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # being built or checked right now
                shutil.rmtree(old, ignore_errors=True)  # (its lock file stays: a process may be waiting on it)
                fcntl.flock(f, fcntl.LOCK_UN)
        except OSError:  # a read-only cache: nothing to prune
            continue


def _checksum_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.sha256"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_checksum(directory: Path, name: str) -> None:
    """The library's sha256, written once the build is complete (to a temporary file, then renamed: a reader sees
    the whole checksum or none)."""
    target = _checksum_path(directory, name)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(_digest(_library_path(directory, name)))
    os.replace(tmp, target)


def _verified(directory: Path, name: str) -> bool:
    """Whether the cache holds a complete library: its checksum file exists and matches its contents."""
    try:
        return _checksum_path(directory, name).read_text().strip() == _digest(_library_path(directory, name))
    except OSError:
        return False


#: Python Functions the core also serves that _common._LAYERS does not name (their message is its default one)
_MORE_FUNCTIONS = ("LoraConvFunction",)


def _finish(module):
    """Hand the core what it takes from Python (the double-backward messages), once per load."""
    from slimgrad.functional import _common

    for key in (*_common._LAYERS, *_MORE_FUNCTIONS):
        module.set_double_backward_message(key, _common.double_backward_message(type(key, (), {})))
    return module


def core():
    """The loaded core module, or None where it is off or unavailable. Builds it on the first call (once per
    process); later calls cost one dict lookup."""
    module = _STATE["module"]
    if module is not _UNLOADED:
        return module if _STATE["enabled"] else None
    if not _STATE["enabled"]:
        return None
    with _LOCK:
        if _STATE["module"] is _UNLOADED:
            try:
                _STATE["module"] = build()
            except Exception as e:  # the Python path runs; `python -m slimgrad kernels` says why
                _STATE["module"], _STATE["reason"] = None, f"{type(e).__name__}: {_first_line(e)}"
                _warn(_STATE["reason"])
    return _STATE["module"] if _STATE["enabled"] else None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _warn(reason: str) -> None:
    import warnings

    warnings.warn(f"slimgrad: the compiled core is unavailable ({reason}); slimgrad's Python path runs instead "
                  "(same numbers and bytes, more time per call). `python -m slimgrad kernels` shows the status.",
                  RuntimeWarning, stacklevel=3)


def enabled() -> bool:
    """Whether eager calls may use the core (they do when it is also available)."""
    return _STATE["enabled"]


def set_enabled(flag: bool) -> None:
    """Turn the core on or off, process-wide (``SLIMGRAD_CORE=0`` at start-up is the same as off)."""
    _STATE["enabled"] = bool(flag)  # the kernel registry keys its cached choices on this flag


@contextlib.contextmanager
def disabled():
    """Run the Python path inside the block (how the tests check the fallback against the core)."""
    old = _STATE["enabled"]
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)


def _compiled_autograd_on() -> bool:
    """Whether torch's compiled autograd is on (``torch._dynamo.compiled_autograd._enable``): it cannot take the
    core's C++ Functions (a capsule in their saved state, ``mark_dirty`` of the in-place ones: "unhashable type" and
    an internal assert), and takes the Python Functions. Read only once dynamo is imported (no import here)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(module.compiled_autograd_enabled)


def for_eager(x: torch.Tensor, cuda: bool = False):
    """The core module when an eager call on ``x`` may run it, else None: the core is on and built, ``x`` is a
    plain CPU tensor (not a subclass: DTensor, functorch wrappers, fake tensors), and neither torch.compile nor a
    torch.func transform is tracing. Each family adds its own conditions (dtype, layout, autocast).

    ``cuda=True``: a family whose core calls aten's ops only (no loops over CPU memory) also takes a CUDA tensor,
    unless ``SLIMGRAD_CORE_CUDA=0``."""
    if (not _STATE["enabled"] or type(x) is not torch.Tensor
            or not (x.is_cpu or (cuda and x.is_cuda and _STATE["cuda"]))
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or _compiled_autograd_on()):
        return None  # checked before loading: never build or load the core inside a compile trace
    module = _STATE["module"]
    if module is _UNLOADED:
        module = core()
    return module


def status() -> dict:
    """What the core is doing here, without building it: enabled, built (in the cache), loaded, and why not.
    ``cuda_kernels``: whether the core's own CUDA kernels are in it: True, False, or None where that is not known yet
    (no core loaded or cached: a build would include them where nvcc is found); ``cuda_kernels_reason`` says why
    not (or what a build would do)."""
    cuda = _cuda_torch()
    module = _STATE["module"]
    loaded = module not in (_UNLOADED, None)
    cuda_key, plain_key = (_key(cuda) if cuda is not None else None), _key(None)  # (each reads every source)
    cached_cuda = cuda_key is not None and _verified(_build_dir(cuda_key), _module_name(cuda_key))
    cached_plain = _verified(_build_dir(plain_key), _module_name(plain_key))
    failed = cuda_key is not None and _cuda_failure_path(cuda_key).exists()
    has_cuda: bool | None
    if not _STATE["enabled"]:
        has_cuda, cuda_reason = False, "the core is off (SLIMGRAD_CORE=0)"
    elif not _STATE["cuda"]:
        has_cuda, cuda_reason = False, "SLIMGRAD_CORE_CUDA=0: CUDA tensors run the Python path"
    elif loaded:
        has_cuda = bool(module.cuda_kernels())
        cuda_reason = None if has_cuda else (_STATE["cuda_reason"] or _why_no_cuda_kernels())
    elif cached_cuda:
        has_cuda, cuda_reason = True, None
    elif cached_plain:
        has_cuda = False
        cuda_reason = (_why_no_cuda_kernels() if cuda is None else
                       "the cached core was built without them; `python -m slimgrad build --force` rebuilds it with "
                       "them where nvcc is found")
    elif cuda is None or _nvcc() is None:
        has_cuda, cuda_reason = False, _why_no_cuda_kernels()
    elif failed:
        has_cuda, cuda_reason = False, _read_failure(_cuda_failure_path(cuda_key))
    else:
        has_cuda, cuda_reason = None, "not built yet: built with the core (nvcc found)"
    key = cuda_key if (cuda_key is not None and has_cuda is not False) else plain_key
    directory, name = _build_dir(key), _module_name(key)
    reason = _STATE["reason"]
    if reason is None and not loaded and not (cached_cuda or cached_plain):
        reason = _why_no_compiler()
    return {
        "cuda_kernels": has_cuda,
        "cuda_kernels_reason": cuda_reason,
        "enabled": _STATE["enabled"],
        "cuda": _STATE["cuda"],
        "loaded": loaded,
        "cached": _library_path(directory, name).exists(),
        "cache": str(directory),
        "reason": reason,
        "sources": [p.name for p in _sources() + (_cuda_sources() if has_cuda is not False and cuda else [])],
        "flags": _flags(),
    }


def _why_no_cuda_kernels() -> str:
    """Why the core has no CUDA kernels of its own here (where :func:`_cuda_torch` or :func:`_nvcc` says no)."""
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if not _STATE["cuda"]:
        return "SLIMGRAD_CORE_CUDA=0"
    if os.environ.get("SLIMGRAD_CORE_NVCC", "1").strip().lower() in _OFF:
        return "SLIMGRAD_CORE_NVCC=0"
    try:
        _cuda_arch_list()
    except RuntimeError as e:
        return str(e)
    return "nvcc not found (set CUDA_HOME to a CUDA toolkit matching torch's CUDA version)"
