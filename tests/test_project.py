"""Project hygiene that CI relies on: lint clean, .ci/run runs exactly the README's test command, that command
installs pinned releases of every direct dependency, the floors in pyproject.toml are the releases the oldest set
pins, the README's version table says what the constraints files say, and the licence is the declared one."""

import ast
import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: floors pyproject declares without a venv that tests them (the README says so): only torch 2.13.0 is tested here
UNTESTED_FLOORS = {"torch", "pytest"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: pathlib.Path) -> dict[str, str]:
    """name -> version of every ``name==version`` line of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not a name==version pin"
            pins[_normal(name)] = version
    return pins


def _requirements():
    """The packaging Requirements of pyproject's dependencies and dev extra (what the test command installs)."""
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [requirements.Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci_command in (ROOT / "README.md").read_text()
    assert "-c constraints-tested.txt -e '.[dev]'" in ci_command, "CI must install the tested pins"


def test_the_test_command_pins_every_direct_dependency():
    pins = _pins(ROOT / "constraints-tested.txt")
    for requirement in _requirements():
        name = _normal(requirement.name)
        assert name in pins, f"constraints-tested.txt does not pin {requirement.name}: a new release could turn CI red"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"constraints-tested.txt pins {name}=={pins[name]}, outside pyproject's {requirement}"


def _imported_top_level_modules() -> set[str]:
    """Top-level modules the test files import: import statements and ``pytest.importorskip("name")``."""
    modules = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                modules.add(node.args[0].value.split(".")[0])
    return modules - set(sys.stdlib_module_names)


def test_every_installed_library_the_tests_import_is_pinned():
    pins = _pins(ROOT / "constraints-tested.txt")
    distributions = importlib.metadata.packages_distributions()
    unpinned = {module: dist for module in _imported_top_level_modules() for dist in distributions.get(module, ())
                if _normal(dist) not in pins and _normal(dist) != "slimgrad"}
    assert not unpinned, f"tests import {unpinned} (module: distribution), which constraints-tested.txt does not pin"


def test_floors_are_the_oldest_tested_releases():
    pins = _pins(ROOT / "constraints-oldest.txt")
    for requirement in _requirements():
        name = _normal(requirement.name)
        assert name in pins, f"constraints-oldest.txt does not pin {requirement.name}"
        floors = [s.version for s in requirement.specifier if s.operator == ">="]
        if floors and name not in UNTESTED_FLOORS:
            assert pins[name] == floors[0], (f"pyproject allows {requirement} but the oldest set tests {name}=="
                                             f"{pins[name]}: the floor must be a tested release")


def test_readme_version_table_matches_the_constraints_files():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Supported versions"):]
    oldest, tested = _pins(ROOT / "constraints-oldest.txt"), _pins(ROOT / "constraints-tested.txt")
    for library in ("transformers", "peft", "bitsandbytes", "diffusers", "trl", "accelerate", "torchao", "torch"):
        row = re.search(rf"^\| {library} \| ([^|]+) \| ([^|]+) \|", table, re.MULTILINE)
        assert row, f"README's Supported versions table has no {library} row"
        assert row.group(1).strip() == oldest[library], f"README oldest {library} != constraints-oldest.txt"
        assert row.group(2).strip() == tested[library], f"README pinned {library} != constraints-tested.txt"


def test_license_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    licence = (ROOT / "LICENSE").read_text()
    # an SPDX string (setuptools warns that the table form stops building in 2027)
    assert project["license"] == "MIT" and licence.startswith("MIT License"), (project["license"], licence[:40])
    assert project["license-files"] == ["LICENSE"]


def test_newest_script_runs_the_drift_test():
    script = (ROOT / "scripts/newest.sh").read_text()
    assert "-c constraints.txt" in script and "tests/test_claims.py" in script


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the dev extra")
def test_ruff_is_clean():
    result = subprocess.run(["ruff", "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
