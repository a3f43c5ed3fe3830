#!/usr/bin/env bash
# Try the newest releases: a fresh venv with torch pinned (constraints.txt) and every other dependency of the dev
# extra at the newest release pip finds, then the drift test (tests/test_claims.py: does every family the README
# claims still engage?) and the integration tests. CI runs the pinned releases (constraints-tested.txt); this is
# the view of what users installing today get. Exits non-zero when a test fails; the drift test's message names
# the class, the library version and slimgrad's reason.
#
#   scripts/newest.sh [VENV [PYTEST ARGS...]]   VENV defaults to /tmp/slimgrad-newest (recreated each run);
#                                               PYTEST ARGS replace the default test files
#   scripts/newest.sh /tmp/slimgrad-newest tests/test_claims.py      # the drift test alone (~30 s)
#
# Afterwards: python benchmarks/compat_table.py --venv newest=VENV ... updates docs/compat.md; if all is green,
# (. VENV/bin/activate && pip freeze --exclude-editable) is a candidate for constraints-tested.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-/tmp/slimgrad-newest}"
shift || true
tests=(tests/test_claims.py tests/test_upstream_drift.py tests/test_gaps.py tests/test_integrations.py tests/test_hf_norms.py tests/test_hf_mlp.py tests/test_hf_moe.py tests/test_hf_loss.py
       tests/test_lora.py tests/test_bnb.py tests/test_diffusers.py tests/test_trainer.py tests/test_hf_models.py)
if [ $# -gt 0 ]; then tests=("$@"); fi
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "scripts/newest.sh: $venv exists and is not a virtual environment; give another path" >&2
    exit 2
fi
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0
pip install -q --upgrade --upgrade-strategy eager -c constraints.txt -e '.[dev]'
echo "== installed (newest releases, torch pinned)"
python - <<'PY'
from slimgrad._notices import library_version
for lib in ("torch", "transformers", "peft", "bitsandbytes", "diffusers", "trl", "accelerate", "torchao", "triton"):
    print(f"{lib:14s}{library_version(lib)}")
PY
echo "== drift test and integration tests"
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider "${tests[@]}"
