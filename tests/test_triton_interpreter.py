"""Runs the Triton kernel tests (tests/test_triton_*.py) on CPU tensors under the Triton interpreter, in a
pytest subprocess started with ``TRITON_INTERPRET=1``: the variable must be set before triton is imported
(see tests/_triton_util.py), which the suite's own process cannot guarantee."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slimgrad import csrc
from slimgrad.kernels.registry import triton_interpreting

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_triton_*.py")
               if p.name != Path(__file__).name)
# Triton checks that live beside their family's core tests (that file skips where the core is off or unavailable)
if csrc.core() is not None:
    FILES += ["tests/test_core_norms.py::test_triton_rms_norm_weight_only_keeps_no_more_than_stock"]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    if triton_interpreting():
        pytest.skip("this process already runs under the interpreter: the kernel tests run here directly")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", SLIMGRAD_KERNELS="auto")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *FILES]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (result.stdout[-6000:] + "\n" + result.stderr[-3000:]).strip()
    assert result.returncode == 0, tail
    summary = re.search(r"(\d+) passed", result.stdout)
    assert summary and int(summary.group(1)) > 0, tail
    assert "skipped" not in result.stdout.splitlines()[-1], tail  # every case ran under the interpreter


def test_interpreter_set_too_late_is_a_clear_error(monkeypatch):
    """TRITON_INTERPRET=1 set after triton was imported cannot work (triton's own functions are compiled):
    slimgrad says so instead of failing deep inside triton."""
    if triton_interpreting():
        pytest.skip("this process started under the interpreter")
    pytest.importorskip("triton")
    import torch

    from slimgrad import kernels
    from slimgrad.functional.norms import rms_norm_hf

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kernels.preference("triton"), pytest.raises(RuntimeError, match="set after triton was imported"):
        rms_norm_hf(torch.randn(2, 8), torch.ones(8))
