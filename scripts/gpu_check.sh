#!/usr/bin/env bash
# One lent GPU session's checks, in priority order, each bounded by a timeout so that one overrun does not
# cost the rest. Results (logs and Markdown tables) go to $OUT (default /tmp/gpu-check):
#   bash scripts/gpu_check.sh
# The compiled core serves CPU tensors only, so it is not built here (SLIMGRAD_CORE=0): the CUDA path is the
# Python one, which is what these checks exercise.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" SLIMGRAD_CORE=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }
step() {  # step <name> <seconds> <command...>
  local name=$1 limit=$2; shift 2
  log "$name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 4 "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
  log "$name: rc=$rc"
}

log "machine"
{ nvidia-smi -L; $PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__)"; $PY -m pip list 2>/dev/null | grep -iE "^(bitsandbytes|diffusers|trl|triton) "; } 2>&1 | tee -a "$OUT/summary.txt"

step cuda-tests 150 $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda.py tests/test_triton_norms.py \
  tests/test_triton_max_pool.py
step estimate-probe 90 $PY scripts/gpu_estimate_probe.py
step plan-offload 60 $PY -m pytest -q -p no:cacheprovider tests/test_plan.py -k "offload or cuda"
step budget 210 $PY benchmarks/budget.py --device cuda --quick --write --out "$OUT/budget_gpu.md"
step estimate 100 $PY benchmarks/estimate_accuracy.py --device cuda --only cnn,llama --write \
  --out "$OUT/estimate_gpu.md"
step speed 100 $PY benchmarks/speed.py --device cuda --pairs 4 --only noise,cnn,llama
log "done"
