"""The compatibility table: which claimed families engage on which library releases (docs/compat.md).

Each ``--venv NAME=PATH`` is a virtual environment with slimgrad installed (editable, from this checkout) next to
one set of library releases: the oldest ``pyproject.toml`` allows (``constraints-oldest.txt``), the pinned
ones CI runs (``constraints-tested.txt``), the newest (``scripts/newest.sh``). In each, a probe (this file with
``--probe``, run by that venv's Python) runs every case of ``tests/test_claims.py`` (the drift test: one tiny
model per family the README claims) and reports engaged / total per case and the installed versions. The table
is printed and, unless ``--no-write``, written into docs/compat.md's marked section with the command that
made it.

    python benchmarks/compat_table.py --venv oldest=/work/venvs/oldest --venv pinned=.venv \\
        --venv newest=/tmp/slimgrad-newest
    python benchmarks/compat_table.py --venv pinned=.venv --census   # also the chunked-loss head census

``--census`` also runs ``benchmarks/chunked_census.py`` in each venv (every ``*ForCausalLM`` /
``*LMHeadModel`` of the installed transformers built tiny and converted; minutes per venv).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _docs import write_section  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPAT_MD = ROOT / "docs" / "compat.md"
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "diffusers", "trl", "accelerate", "torchao")
#: where the README claims each case's family, for the table's first column
FEATURES = {"rmsnorm": "RMSNorm", "mlp": "gated MLP", "hf-act": "transformers activation",
            "chunked": "chunked loss", "lora": "peft LoRA", "bnb": "bitsandbytes linear",
            "lora-bnb": "peft LoRA over bitsandbytes", "diffusers": "diffusers activation", "moe": "MoE experts"}


def probe() -> dict:
    """Run every drift-test case in this interpreter; versions and one result per case (JSON-able)."""
    import importlib.util
    import logging
    import warnings

    import pytest
    import torch

    from slimgrad._notices import library_version

    spec = importlib.util.spec_from_file_location("slimgrad_test_claims", ROOT / "tests" / "test_claims.py")
    test_claims = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(test_claims)

    torch.set_num_threads(1)
    logging.getLogger("slimgrad").setLevel(logging.ERROR)
    results = {}
    for case, run in test_claims.CASES.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = run()
            results[case] = {"engaged": r.engaged, "total": r.total, "subject": r.subject,
                             "why": r.why.splitlines()[0] if r.why else ""}
        except pytest.skip.Exception as e:
            results[case] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - a broken case is a result to publish, not a crash
            results[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
    return {"versions": {lib: library_version(lib) for lib in LIBRARIES}, "python": platform.python_version(),
            "results": results}


def _run_probe(python: pathlib.Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(python), str(pathlib.Path(__file__).resolve()), "--probe"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"compat_table: the probe failed in {python}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_census(python: pathlib.Path) -> str:
    """'engaged of heads' from benchmarks/chunked_census.py in that venv."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(python), str(ROOT / "benchmarks" / "chunked_census.py"), "--no-progress"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=3600)
    heads = re.search(r"(\d+) head classes", out.stdout)
    engaged = re.search(r"\| engaged[^|]*\| (\d+) \|", out.stdout)
    if out.returncode != 0 or not heads or not engaged:
        return f"census failed ({out.stderr.strip().splitlines()[-1][:80] if out.stderr.strip() else 'no output'})"
    return f"{engaged.group(1)} of {heads.group(1)}"


def _cell(result: dict) -> str:
    if "skipped" in result:
        return "not installed" if "not installed" in result["skipped"] else f"skipped: {result['skipped'][:60]}"
    if "error" in result:
        return f"**error**: {result['error'][:80]}"
    mark = "yes" if result["engaged"] == result["total"] and result["total"] else "**NO**"
    return f"{mark} {result['engaged']}/{result['total']}"


def _feature(case: str) -> str:
    for prefix in sorted(FEATURES, key=len, reverse=True):
        if case.startswith(prefix + "-"):
            return FEATURES[prefix]
    return case


def render(names: list[str], probes: list[dict], census: list[str] | None, command: str) -> str:
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    lines = ["## The table", "",
             "Cells: modules converted / modules of that class in the case's tiny model (chunked loss: 1/1 when a",
             "training forward with labels returns no logits and stock's loss). A **NO** is a claimed family that",
             "does not engage on those releases; `convert` warns about it, and the reason is listed below.", "",
             f"Made by: `{command}`  ", f"Date: {datetime.date.today().isoformat()}; machine: {machine}; "
             f"Python {probes[0]['python']}.", "",
             "### Releases", "", "| library | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for lib in LIBRARIES:
        lines.append(f"| {lib} | " + " | ".join(p["versions"].get(lib, "?") for p in probes) + " |")
    if census is not None:
        lines.append("| chunked-loss heads engaged (census) | " + " | ".join(census) + " |")
    same = [(a, b) for i, (a, pa) in enumerate(zip(names, probes)) for b, pb in zip(names[i + 1:], probes[i + 1:])
            if pa["versions"] == pb["versions"]]
    if same:
        lines += [""] + [f"`{b}` has the same releases as `{a}` today: the newest releases are the pinned ones."
                         for a, b in same]
    lines += ["", "### Families engaged", "", "| feature | case (class) | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for case in probes[0]["results"]:
        subject = next((p["results"][case].get("subject") for p in probes if p["results"].get(case, {}).get("subject")),
                       "")
        # transformers' class names are unique; peft and bitsandbytes reuse Linear: keep the module's last part
        short = ".".join(subject.split(".")[-1 if subject.startswith("transformers.") else -2:]) or case
        cells = [_cell(p["results"].get(case, {"error": "case missing"})) for p in probes]
        lines.append(f"| {_feature(case)} | {case} (`{short}`) | " + " | ".join(cells) + " |")
    reasons = [(n, case, p["results"][case]) for n, p in zip(names, probes) for case in p["results"]
               if p["results"][case].get("why") or p["results"][case].get("error")]
    if reasons:
        lines += ["", "### Why not", ""]
        for n, case, r in reasons:
            lines.append(f"- {n}, {case}: {r.get('why') or r.get('error')}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", action="append", default=[], metavar="NAME=PATH",
                        help="a virtual environment to probe (repeat; columns in this order)")
    parser.add_argument("--census", action="store_true", help="also run benchmarks/chunked_census.py in each venv")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/compat.md alone")
    parser.add_argument("--output", type=pathlib.Path, default=COMPAT_MD)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return
    if not args.venv:
        parser.error("give at least one --venv NAME=PATH")
    names, probes, census = [], [], [] if args.census else None
    for spec in args.venv:
        name, sep, path = spec.partition("=")
        python = pathlib.Path(path) / "bin" / "python"
        if not sep or not python.exists():
            parser.error(f"--venv {spec!r}: expected NAME=PATH of a virtual environment with bin/python")
        print(f"probing {name} ({path}) ...", file=sys.stderr, flush=True)
        names.append(name)
        probes.append(_run_probe(python))
        if census is not None:
            earlier = next((c for p, c in zip(probes, census) if p["versions"] == probes[-1]["versions"]), None)
            print(f"census in {name} ...", file=sys.stderr, flush=True)
            census.append(earlier if earlier is not None else _run_census(python))  # same releases: same census
    command = "python benchmarks/compat_table.py " + " ".join(f"--venv {v}" for v in args.venv)
    command += " --census" if args.census else ""
    text = render(names, probes, census, command)
    print(text)
    if not args.no_write:  # only the marked section: the prose around it in docs/compat.md is hand-written
        write_section("compat-table", text.rstrip("\n"), args.output)
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
