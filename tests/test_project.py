"""Project hygiene that CI relies on: lint clean, and .ci/run runs exactly the README's test command."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci_command in (ROOT / "README.md").read_text()


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the dev extra")
def test_ruff_is_clean():
    result = subprocess.run(["ruff", "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
