#!/usr/bin/env bash
# peft's own LoRA tests (tests/test_custom_models.py of the installed peft release) run twice: on stock, and with
# every adapter injection converted in place by slimgrad (scripts/peft_suite_conftest.py wraps peft's
# BaseTuner.inject_adapter). Prints the counts of both runs and every test whose outcome differs; exits 1 when a
# test fails converted but not on stock.
#
#   scripts/peft_suite.sh [PYTEST ARGS...]      PYTEST ARGS replace the default selection (test ids or -k ...)
#
# Environment:
#   PEFT_SRC   where peft's sources are expected: PEFT_SRC/tests/test_custom_models.py (default /tmp/peft-<version>,
#              <version> = the installed peft). Missing: fetched as below.
#   OUT        results: OUT/{stock,converted}.{xml,log}, OUT/converted.jsonl (default /tmp/peft-suite-out)
#   MODES      "stock converted" (default), or one of them
#   PEFT_GIT_DIR  a peft clone's git directory: conftest.py is taken from it instead of from GitHub
#
# Fetch step (automatic when PEFT_SRC is missing): peft's source distribution on PyPI carries tests/ for exactly
# the installed release (`pip download --no-deps --no-binary :all: peft==<version>`); it lacks tests/__init__.py
# (the tests import each other relatively) and tests/conftest.py. The script writes an empty __init__.py and takes
# conftest.py from peft's GitHub repository at commit f5cfc88bc (2026-01-29: the file's last change in the history
# we could read, up to 0.20.1.dev0 of 2026-08-21; 0.21's tag was not in it); it adds the --regression option and
# turns transformers deprecation messages into errors. Offline: put a peft checkout's tests/conftest.py there by
# hand (git show <tag>:tests/conftest.py), or set PEFT_CONFTEST_COMMIT to another commit.
#
# The default selection is peft's LoRA tests: every test id matching "lora", less the other LoRA-like methods
# (AdaLoRA, DeLoRA, GLoRA, GraLoRA, RandLoRA, TinyLoRA, UniLoRA, VB-LoRA): 2680 tests on peft 0.21.2, about 25 min
# per run on one CPU core. Runs single-process (no xdist), OMP_NUM_THREADS=1, nice -n 10.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python}"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("peft"))')"
src="${PEFT_SRC:-/tmp/peft-$version}"
out="${OUT:-/tmp/peft-suite-out}"
modes="${MODES:-stock converted}"
conftest_commit=f5cfc88bc7adc00f66b7f4260ecc704993c4ddb2

if [ ! -f "$src/tests/test_custom_models.py" ]; then
    echo "== fetching peft $version's tests into $src"
    tmp="$(mktemp -d)"
    "$python" -m pip download -q --no-deps --no-binary :all: "peft==$version" -d "$tmp"
    mkdir -p "$src"
    tar -xzf "$tmp/peft-$version.tar.gz" -C "$src" --strip-components=1
    rm -rf "$tmp"
fi
[ -f "$src/tests/__init__.py" ] || : > "$src/tests/__init__.py"
if [ ! -f "$src/tests/conftest.py" ]; then
    commit="${PEFT_CONFTEST_COMMIT:-$conftest_commit}"
    url="https://raw.githubusercontent.com/huggingface/peft/$commit/tests/conftest.py"
    if [ -n "${PEFT_GIT_DIR:-}" ]; then
        git --git-dir="$PEFT_GIT_DIR" show "$commit:tests/conftest.py" > "$src/tests/conftest.py"
    elif ! curl -fsSL "$url" -o "$src/tests/conftest.py"; then
        echo "scripts/peft_suite.sh: could not fetch $url; put peft's tests/conftest.py into $src/tests" \
             "or set PEFT_GIT_DIR to a peft clone's git directory" >&2
        exit 2
    fi
fi
sdist_version="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$src/src/peft/__init__.py" 2>/dev/null || true)"
if [ -n "$sdist_version" ] && [ "$sdist_version" != "$version" ]; then
    echo "scripts/peft_suite.sh: $src holds peft $sdist_version's tests, peft $version is installed" >&2
    exit 2
fi

select=(tests/test_custom_models.py -k
        "lora and not (adalora or delora or glora or gralora or randlora or tinylora or unilora or vblora)")
if [ $# -gt 0 ]; then select=("$@"); fi
mkdir -p "$out"
"$python" -c 'import torch, transformers, peft, slimgrad; print("== torch", torch.__version__, "transformers",
transformers.__version__, "peft", peft.__version__, "slimgrad", slimgrad.__version__)' 2>/dev/null | grep '^=='
cd "$src"
for mode in $modes; do
    echo "== $mode run ($(date -u +%FT%TZ))"
    rm -f "$out/$mode.jsonl"
    # pyproject's addopts ask for pytest-cov: cleared; cacheprovider off: the sources may be read-only
    env PYTHONPATH="$repo/scripts${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
        SLIMGRAD_CONVERT="$([ "$mode" = converted ] && echo 1 || echo 0)" SLIMGRAD_CONVERT_LOG="$out/$mode.jsonl" \
        nice -n 10 "$python" -m pytest -p no:cacheprovider -o addopts= -p peft_suite_conftest -q -rfE \
        --junitxml="$out/$mode.xml" "${select[@]}" > "$out/$mode.log" 2>&1 || true
    tail -n 1 "$out/$mode.log"
done

"$python" - "$out" <<'EOF'
"""Compare the two junit files: counts, then every test whose outcome differs, with its first error line."""
import json
import os
import sys
import xml.etree.ElementTree as ET

out = sys.argv[1]


def outcomes(mode):
    path = os.path.join(out, f"{mode}.xml")
    if not os.path.exists(path):
        return None
    result = {}
    for case in ET.parse(path).iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        state, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state, message = {"failure": "failed"}.get(tag, tag), (node.get("message") or "").splitlines()
                message = message[0] if message else ""
                break
        result[key] = (state, message)
    return result


runs = {mode: outcomes(mode) for mode in ("stock", "converted")}
for mode, result in runs.items():
    if result is not None:
        counts = {}
        for state, _ in result.values():
            counts[state] = counts.get(state, 0) + 1
        print(f"{mode}: {len(result)} tests, " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
log = os.path.join(out, "converted.jsonl")
if os.path.exists(log):
    rows = [json.loads(line) for line in open(log)]
    lora = sum(1 for r in rows if any(".lora." in name for name in r["converted"]))
    print(f"converted run: {sum(r['injections'] for r in rows)} injections converted; "
          f"{lora} of {len(rows)} tests had peft LoRA layers converted")
stock, converted = runs["stock"], runs["converted"]
if stock is None or converted is None:
    sys.exit(0)
worse = [k for k in converted if converted[k][0] in ("failed", "error") and stock.get(k, ("?",))[0] == "passed"]
other = [k for k in converted if k in stock and converted[k][0] != stock[k][0] and k not in worse]
for title, keys in (("fail converted, pass on stock", worse), ("other differences", other)):
    print(f"{title}: {len(keys)}")
    for key in keys:
        print(f"  {key}\n    stock: {stock[key][0]} {stock[key][1][:150]}\n"
              f"    converted: {converted[key][0]} {converted[key][1][:300]}")
sys.exit(1 if worse else 0)
EOF
