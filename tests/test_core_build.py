"""The compiled core's build: on first use, cached, never racing, rebuilt when broken, optional.

Each case runs in fresh subprocesses with its own cache directory and builds only ``common.cpp``
(``SLIMGRAD_CORE_SOURCES``), so it checks the machinery in seconds, not the family files (their own tests
build those).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import slimgrad
from slimgrad import csrc

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler on this machine")

_LOAD = textwrap.dedent("""
    import slimgrad.csrc as c
    m = c.core()
    print("LOADED", m is not None, m.__file__ if m is not None else c.status()["reason"])
""")


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, SLIMGRAD_CACHE_DIR=str(cache), SLIMGRAD_CORE_SOURCES="common.cpp", OMP_NUM_THREADS="1")
    env.pop("SLIMGRAD_CORE", None)
    env.update(extra)
    return env


def _run(code: str, env: dict, **kwargs):
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def _finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, err


def test_two_processes_build_once_and_both_load(tmp_path):
    procs = [_run(_LOAD, _env(tmp_path)) for _ in range(2)]
    results = [_finish(p) for p in procs]
    for out, _ in results:
        assert "LOADED True" in out
    # one compiled, the other waited on the lock and loaded the cached build
    assert sum("building its compiled core" in err for _, err in results) == 1
    paths = {out.split()[-1] for out, _ in results}
    assert len(paths) == 1 and Path(paths.pop()).exists()
    # a third process loads from the cache without compiling
    out, err = _finish(_run(_LOAD, _env(tmp_path)))
    assert "LOADED True" in out and "building" not in err


@pytest.fixture(scope="module")
def _built_once(tmp_path_factory):
    """A cache holding one finished build, made once for the cases that start from a built entry (each builds again
    at most once itself; a build costs 15-45 s of CI on 2 cores)."""
    cache = tmp_path_factory.mktemp("built-core")
    out, _ = _finish(_run(_LOAD, _env(cache)))
    return cache, Path(out.split()[-1]).relative_to(cache)


def _built_cache(built_once, tmp_path) -> tuple[Path, str]:
    """A copy of the built cache in ``tmp_path``, and the first load's output line from it (no build)."""
    seed, library = built_once
    cache = tmp_path / "cache"
    shutil.copytree(seed, cache)
    out, err = _finish(_run(_LOAD, _env(cache)))
    assert "LOADED True" in out and "building" not in err and str(cache / library) in out, (out, err)
    return cache, out


def test_a_broken_cache_is_rebuilt(tmp_path, _built_once):
    tmp_path, out = _built_cache(_built_once, tmp_path)
    library = Path(out.split()[-1])
    library.write_bytes(b"not a shared library")
    out, err = _finish(_run(_LOAD, _env(tmp_path)))
    assert "LOADED True" in out and "building its compiled core" in err
    assert library.stat().st_size > 1000


def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path, _built_once):
    """Loading a truncated library (an interrupted copy of the cache) killed the process with SIGBUS: a library
    whose checksum does not match is rebuilt, never loaded."""
    tmp_path, out = _built_cache(_built_once, tmp_path)
    library = Path(out.split()[-1])
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])
    out, err = _finish(_run(_LOAD, _env(tmp_path)))
    assert "LOADED True" in out and "building its compiled core" in err
    assert library.read_bytes() != data[: len(data) // 2]


def test_a_complete_entry_loads_without_the_lock(tmp_path, _built_once):
    """A read-only cache (a container image's prebuilt core) cannot open the build lock: a complete entry loads
    without it, where the core was not used at all. (A copied cache loads as built: a prebuilt core moved in.)"""
    tmp_path, out = _built_cache(_built_once, tmp_path)
    library = Path(out.split()[-1])
    lock = library.parent.parent / f"{library.parent.name}.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()  # opening it for writing fails, as on a read-only file system
    out, err = _finish(_run(_LOAD, _env(tmp_path)))
    assert "LOADED True" in out and "building" not in err and "Python path" not in err


def test_without_a_compiler_the_python_path_runs_and_says_why(tmp_path):
    # only this interpreter's directory on PATH: python and pip's ninja, no C++ compiler
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    code = textwrap.dedent("""
        import warnings, torch, slimgrad
        from slimgrad import csrc
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert csrc.core() is None
        assert any("compiled core is unavailable" in str(x.message) for x in w), [str(x.message) for x in w]
        print("REASON", csrc.status()["reason"])
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        slim = slimgrad.convert(net)
        x = torch.randn(3, 4)
        slim(x).sum().backward()
        print("GRAD", net[0].weight.grad is None, slim[0].weight.grad is not None)
    """)
    env = _env(tmp_path / "cache", PATH=str(bindir), CXX="no-such-compiler")
    out, _ = _finish(_run(code, env))
    assert "REASON" in out and "no C++ compiler" in out
    assert "GRAD" in out
    kernels = subprocess.run([sys.executable, "-m", "slimgrad", "kernels"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert kernels.returncode == 0, kernels.stderr
    assert "unavailable: no C++ compiler" in kernels.stdout
    build = subprocess.run([sys.executable, "-m", "slimgrad", "build"], env=env, capture_output=True, text=True,
                           timeout=300)
    # one line saying why; no advice to read a compiler's output that does not exist
    assert build.returncode == 1 and "no C++ compiler" in build.stderr and "--verbose" not in build.stderr


@pytest.mark.parametrize("value", ["0", "OFF", "False"])
def test_slimgrad_core_0_never_builds(tmp_path, value):
    """Any spelling the other switches take (SLIMGRAD_CORE_CUDA lower-cases its value; this one did not, so OFF and
    False left the core on: pkg44)."""
    out, err = _finish(_run(_LOAD, _env(tmp_path, SLIMGRAD_CORE=value)))
    assert "LOADED False" in out and "building" not in err
    assert not (tmp_path / "core").exists()


def test_kernels_command_describes_without_building(tmp_path):
    """`python -m slimgrad kernels` shows the core's state; on an empty cache it compiled the whole core (383 s from
    a wheel install, pkg44) while its first line said "not built yet". It reports the core's kernels as not built,
    and a later real call still builds (the description does not stick to the kernel)."""
    code = textwrap.dedent("""
        import contextlib, io
        from slimgrad import cli, csrc
        from slimgrad.kernels import registry
        calls = []
        def stub(*a, **k):
            calls.append(1)
            raise RuntimeError("stub compile")
        csrc._compile = stub
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["kernels"])
        out = buf.getvalue()
        core_kernels = [k for ks in registry._KERNELS.values() for k in ks if k.backend == registry.CORE]
        print("RC", rc, "COMPILES", len(calls), "NOT_BUILT", out.count("not built yet"),
              "STUCK", sum(k._loaded for k in core_kernels))
    """)
    out, _ = _finish(_run(code, _env(tmp_path)))
    assert "RC 0 COMPILES 0" in out, out
    assert "STUCK 0" in out and "NOT_BUILT 0" not in out, out


def test_build_command_builds_ahead_of_time(tmp_path):
    env = _env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "slimgrad", "build"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "compiled core ready" in done.stdout
    status = subprocess.run([sys.executable, "-m", "slimgrad", "kernels"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert "compiled core: enabled" in status.stdout
    assert str(tmp_path) in status.stdout


def test_disabled_switches_eager_calls_to_the_python_path():
    import torch

    x = torch.ones(3)
    with csrc.disabled():
        assert not csrc.enabled()
        assert csrc.for_eager(x) is None
    assert csrc.enabled() == (os.environ.get("SLIMGRAD_CORE", "1") not in ("0", "off", "false", "no"))


def test_for_eager_refuses_what_the_core_does_not_serve():
    import torch

    if csrc.core() is None:
        pytest.skip(f"compiled core unavailable: {csrc.status()['reason']}")
    x = torch.ones(3)
    assert csrc.for_eager(x) is not None
    assert csrc.for_eager(torch.nn.Parameter(x)) is None  # subclasses go to the Python path
    assert csrc.for_eager(torch.ones(3, device="meta")) is None
    seen = []

    def f(t):
        seen.append(csrc.for_eager(t))
        return t.sum()

    torch.func.grad(f)(x)
    assert seen == [None]  # torch.func transforms run the Python Functions


def test_package_ships_the_sources():
    pyproject = (Path(slimgrad.__file__).parents[2] / "pyproject.toml").read_text()
    assert '"slimgrad.csrc" = ["*.cpp", "*.h", "*.cu"]' in pyproject
    assert "common.cpp" in csrc.status()["sources"]


def test_a_build_prunes_the_cache_to_the_most_recently_used_entries(tmp_path, _built_once):
    """Each release or source edit is a new entry of ~11 MB, never removed: a development cache reached 553 MB. A
    build keeps csrc.KEEP_BUILDS entries of its torch version, Python and machine (itself and the most recently
    used), and leaves other versions' entries alone."""
    tmp_path, first = _built_cache(_built_once, tmp_path)
    built = Path(first.split()[-1]).parent
    core_dir = built.parent
    tag = built.name.rsplit("-", 1)[0]
    shutil.rmtree(built)  # the next process builds again, among the entries below
    fake = {}
    for age, key in enumerate("abcdef0123456789 0123456789abcdef 1111111111111111 2222222222222222".split()):
        entry = core_dir / f"{tag}-{key}"
        entry.mkdir()
        (entry / f"slimgrad_core_{key}.so").write_bytes(b"not a library")
        os.utime(entry / f"slimgrad_core_{key}.so", (1e9 - age * 1e6, 1e9 - age * 1e6))
        fake[key] = entry
    other = core_dir / "torch1.0.0-py30-x86_64-3333333333333333"  # another torch version: not this build's to prune
    other.mkdir()
    out, err = _finish(_run(_LOAD, _env(tmp_path)))
    assert "LOADED True" in out and "building its compiled core" in err
    kept = sorted(d.name for d in core_dir.iterdir() if d.is_dir())
    assert len([k for k in kept if k.startswith(tag)]) == csrc.KEEP_BUILDS
    assert fake["abcdef0123456789"].exists() and fake["0123456789abcdef"].exists()  # the two most recently used
    assert not fake["1111111111111111"].exists() and not fake["2222222222222222"].exists()
    assert other.exists()


# ------------------------------------------------------------------------------------- the core's own CUDA kernels
# (built with nvcc for a CUDA torch with a GPU: tests/test_cuda_core.py checks them on one; here the machinery)


def test_cuda_kernels_are_not_wanted_on_a_cpu_torch_and_status_says_why(monkeypatch):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    monkeypatch.setitem(csrc._STATE, "enabled", True)  # (the suite also runs with SLIMGRAD_CORE=0)
    assert csrc._cuda_torch() is None
    status = csrc.status()
    assert status["cuda_kernels"] is False and status["cuda_kernels_reason"] == "torch is a CPU build"
    assert not any(s.endswith(".cu") for s in status["sources"])


def test_the_cuda_build_passes_nvcc_its_sources_flags_and_architectures(monkeypatch, tmp_path):
    """With CUDA wanted, the build compiles the *.cu files with the family files, defines SLIMGRAD_CUDA_KERNELS for
    the C++ side, and sets TORCH_CUDA_ARCH_LIST for the build only; the cache key is another entry."""
    from torch.utils import cpp_extension

    seen = {}

    def load(**kwargs):
        seen.update(kwargs, arch=os.environ.get("TORCH_CUDA_ARCH_LIST"))
        return "module"

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(csrc, "_cuda_arch_list", lambda: "9.0+PTX")
    assert csrc._compile(tmp_path, "m", False, "13.0") == "module"
    assert seen["with_cuda"] is True and seen["arch"] == "9.0+PTX"
    assert "-DSLIMGRAD_CUDA_KERNELS" in seen["extra_cflags"] and "--fmad=false" in seen["extra_cuda_cflags"]
    assert any(s.endswith("relu_mask_cuda.cu") for s in seen["sources"])
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
    seen.clear()
    csrc._compile(tmp_path, "m", False, None)
    assert seen["with_cuda"] is False and not any(s.endswith(".cu") for s in seen["sources"])
    assert csrc._key("13.0") != csrc._key(None)


def test_a_failed_cuda_build_falls_back_once_remembered_until_forced(monkeypatch, tmp_path):
    """An nvcc that cannot build the kernels (another CUDA version than torch's, an unknown architecture) must not
    cost the core, nor a failed build in every process: the core is built without them, the failure is written
    beside the cache entry and said once, later processes skip the attempt, ``force`` retries."""
    monkeypatch.setenv("SLIMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(csrc, "_cuda_torch", lambda: "13.0")
    monkeypatch.setattr(csrc, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(csrc, "_cuda_arch_list", lambda: "9.0+PTX")
    monkeypatch.setattr(csrc, "_why_no_compiler", lambda: None)
    monkeypatch.setitem(csrc._STATE, "cuda_reason", None)
    calls = []

    def build_one(cuda, verbose, quiet, force):
        calls.append(cuda)
        if cuda is not None:
            raise RuntimeError("nvcc fatal   : Unsupported gpu architecture 'compute_120'")
        return "core without its CUDA kernels"

    monkeypatch.setattr(csrc, "_build_one", build_one)
    with pytest.warns(RuntimeWarning, match="CUDA kernels did not build .*Unsupported gpu architecture"):
        assert csrc.build() == "core without its CUDA kernels"
    assert calls == ["13.0", None]
    marker = csrc._cuda_failure_path(csrc._key("13.0"))
    assert marker.exists() and "Unsupported gpu" in marker.read_text()
    calls.clear()
    assert csrc.build() == "core without its CUDA kernels" and calls == [None]  # not tried again
    assert "failed before" in csrc._STATE["cuda_reason"] and "--force" in csrc._STATE["cuda_reason"]
    calls.clear()
    with pytest.warns(RuntimeWarning, match="CUDA kernels did not build"):
        csrc.build(force=True)
    assert calls == ["13.0", None]


def test_cuda_architectures_are_torchs_own_and_in_the_key(monkeypatch):
    """The kernels are built for the architectures torch itself was built for (read without a GPU, so a core built
    in a container image without one runs on any GPU torch supports; numeric order, PTX on the newest), or the
    user's TORCH_CUDA_ARCH_LIST; either is in the cache key (two machines' GPUs sharing a cache once got one key:
    review44)."""
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_100 sm_75 sm_80 sm_86 sm_90 sm_120 compute_120",
                        raising=False)
    assert csrc._cuda_arch_list() == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    key_all = csrc._key("13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert csrc._cuda_arch_list() == "8.0"
    key_80 = csrc._key("13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert len({key_all, key_80, csrc._key("13.0"), csrc._key(None)}) == 4


def test_a_cuda_failure_marker_is_its_entrys_alone(monkeypatch, tmp_path):
    """The marker sits beside its own entry: an entry's name has dots (torch2.13.0_...), and Path.with_suffix mapped
    every key to one file, so one failed CUDA build turned the kernels off for every other entry (review44)."""
    monkeypatch.setenv("SLIMGRAD_CACHE_DIR", str(tmp_path))
    a, b = csrc._cuda_failure_path("aaaaaaaaaaaaaaaa"), csrc._cuda_failure_path("bbbbbbbbbbbbbbbb")
    assert a != b and a.parent == b.parent == csrc._build_dir("aaaaaaaaaaaaaaaa").parent
    assert a.name == csrc._build_dir("aaaaaaaaaaaaaaaa").name + ".cuda-failed"


_CUDA_HOST = textwrap.dedent("""
    import torch
    from slimgrad import csrc
    torch.version.cuda = "13.0"  # a CUDA build of torch, nvcc found, a GPU machine: simulated
    csrc._nvcc = lambda: "/usr/local/cuda/bin/nvcc"
    csrc._cuda_arch_list = lambda: "9.0+PTX"
    compiles = []
    def stub(directory, name, verbose, cuda=None):
        compiles.append(cuda)
        raise RuntimeError("stub: no compiling in this test")
    csrc._compile = stub
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = csrc.core()
    print("LOADED", m is not None, "COMPILES", compiles, "KERNELS", csrc.status()["cuda_kernels"])
    print("REASON", csrc.status()["cuda_kernels_reason"])
""")


def test_a_core_prebuilt_without_nvcc_loads_on_a_gpu_host_with_nvcc(tmp_path, _built_once):
    """A container image's core, built where no nvcc was (no CUDA kernels), loads as built on a machine that has
    nvcc: no compile at the first call of every fresh container (review44), and status says how to get them."""
    cache, _ = _built_cache(_built_once, tmp_path)
    out, _ = _finish(_run(_CUDA_HOST, _env(cache)))
    assert "LOADED True COMPILES [] KERNELS False" in out, out
    assert "build --force" in out, out


def test_status_and_cli_say_what_the_cuda_kernels_are_in_each_state(monkeypatch, tmp_path, capsys):
    """The `kernels` line: not claimed "built in" for a core not built yet, nor an aten route for a process whose CUDA
    tensors run the Python path (review44)."""
    from slimgrad import cli

    monkeypatch.setenv("SLIMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(csrc._STATE, "module", csrc._UNLOADED)
    monkeypatch.setitem(csrc._STATE, "cuda_reason", None)
    monkeypatch.setitem(csrc._STATE, "enabled", True)  # (the suite also runs with SLIMGRAD_CORE=0)
    monkeypatch.setitem(csrc._STATE, "cuda", True)
    monkeypatch.setattr(csrc, "_cuda_torch", lambda: "13.0")
    monkeypatch.setattr(csrc, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(csrc, "_cuda_arch_list", lambda: "9.0+PTX")
    status = csrc.status()
    assert status["cuda_kernels"] is None and "not built yet" in status["cuda_kernels_reason"]
    assert "built in" not in cli._cuda_kernels_words(status)
    monkeypatch.setitem(csrc._STATE, "cuda", False)
    words = cli._cuda_kernels_words(csrc.status())
    assert "SLIMGRAD_CORE_CUDA=0" in words and "aten route" not in words
    monkeypatch.setitem(csrc._STATE, "cuda", True)
    monkeypatch.setitem(csrc._STATE, "enabled", False)
    words = cli._cuda_kernels_words(csrc.status())
    assert "SLIMGRAD_CORE=0" in words and "built in" not in words


def test_a_prebuilt_core_loads_where_no_compiler_is(tmp_path, _built_once):
    """A runtime image with the cache of a build image and no g++: the complete entry loads (the build checked for a
    compiler before it looked in the cache, so the prebuilt core was never used there)."""
    cache, _ = _built_cache(_built_once, tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    out, err = _finish(_run(_LOAD, _env(cache, PATH=str(bindir), CXX="no-such-compiler")))
    assert "LOADED True" in out and "no C++ compiler" not in err, (out, err)
