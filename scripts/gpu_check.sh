#!/usr/bin/env bash
# One lent GPU session's checks, in priority order, each bounded by a timeout so that one overrun does not
# cost the rest. Results (logs and Markdown tables) go to $OUT (default /tmp/gpu-check):
#   bash scripts/gpu_check.sh            (device tool: carry .devwhl, the pinned wheels the GPU image lacks)
# The compiled core is built in the background from the start; the checks that do not need it run with
# SLIMGRAD_CORE=0 meanwhile (the Python path, what CUDA ran before the core served CUDA tensors), the core's own
# CUDA checks and the speed rows after it.
set -u
OUT=${OUT:-/tmp/gpu-check}
REPO=$(pwd)
mkdir -p "$OUT"
PY=${PYTHON:-python3}
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
step() {  # step <name> <seconds> <command...>
  local name=$1 limit=$2; shift 2
  log "$name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 6 "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
  log "$name: rc=$rc"
}
existing() { for f in "$@"; do [ -e "$f" ] && printf '%s ' "$f"; done; }

# the pinned transformers / peft / bitsandbytes (and ninja, for the core's build) where the image lacks them
SITE=/tmp/site
if [ -d .devwhl ]; then
  mkdir -p $SITE && (cd $SITE && for w in "$REPO"/.devwhl/*.whl "$REPO"/.devwhl/*.zip; do
    $PY -m zipfile -e "$w" . ; done) 2>&1 | tail -2
  chmod +x $SITE/ninja-*.data/scripts/ninja 2>/dev/null && export PATH="$(echo $SITE/ninja-*.data/scripts):$PATH"
fi
export PYTHONPATH="$SITE:$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

log "machine"
{ nvidia-smi -L; $PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__)"; $PY -c "import bitsandbytes as b; print('bnb', b.__version__)";
  which g++ ninja; nproc; } 2>&1 | grep -v "kernels" | tee -a "$OUT/summary.txt"

# the core's build, in the background (MAX_JOBS: leave cores to the checks)
( t0=$(date +%s); MAX_JOBS=10 SLIMGRAD_CORE=1 timeout 300 $PY -m slimgrad build > "$OUT/core-build.log" 2>&1;
  echo "rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/core-build.log" ) &
BUILD=$!

export SLIMGRAD_CORE=0
step cuda-tests 110 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_max_pool.py \
  $(existing tests/test_cuda_exact.py tests/test_estimate_cuda_sim.py) -x -k "not slow"
step estimate-probe 70 $PY scripts/gpu_estimate_probe.py
step plan-offload 45 $PY -m pytest -q -p no:cacheprovider tests/test_plan.py -k "offload or cuda"
step budget 120 $PY benchmarks/budget.py --device cuda --quick --write --out "$OUT/budget_gpu.md"

log "waiting for the core's build"
wait $BUILD
tail -n 3 "$OUT/core-build.log" | tee -a "$OUT/summary.txt"
export SLIMGRAD_CORE=1
[ -e tests/test_cuda_core.py ] && step cuda-core 70 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_core.py -x
step speed 90 $PY benchmarks/speed.py --device cuda --pairs 3 --only noise,cnn,llama
step estimate 90 $PY benchmarks/estimate_accuracy.py --device cuda --time-limit 60 --write --out "$OUT/estimate_gpu.md"
[ -e scripts/gpu_stock_diff.py ] && step stock-diff 60 $PY scripts/gpu_stock_diff.py
log "done"
