#!/usr/bin/env bash
# One prepared check of offspec's CUDA path on a lent GPU (issues 33, 39), in at most 9 minutes on one GPU, start to
# end; what a user feels included:
#   1. `pytest -m cuda` of the CUDA kernels, layer, graphs and lossless tests (several processes), while
#      scripts/gpu_check.py --warm compiles the timed sections' Triton kernels and the default pair's GGUF twins
#      are built and converted (scripts/gpu/twin_gguf.py: the real headers, from .twin/, random blocks) beside them;
#   2. the older CUDA tests (tests/test_cuda.py: streaming, the doctor's timing checks) alone on the GPU;
#   3. scripts/gpu_check.py: `pytest -m cuda`'s failures; end to end on the twins (offspec bench ar and trees of 16 to
#      1,024 resident, the target streamed from pinned RAM, transformers' generate() of the same shapes); a kernel
#      table, the 70B slice's linears, draft-step and target pass sweeps, a streamed 70B slice's pass sweep, the
#      projection of a 70B Q4_K_M on an RTX 4090.
# Into $OUT where that is set (a lent machine: at most 8 files come back), else docs/benchmarks/: gpu-check.json
# and .md (the keys; a failed section leaves its keys null and its error in one line), gpu-check-errors.log (the
# failed sections' tracebacks), the two pytest logs, the e2e bench JSONs and logs.txt (the other logs' tails).
# With no GPU it runs the checks a CPU can (the ahead-of-time, probe, check and interpreter tests), says what it
# skipped, and exits with their status.
#
# Prepare here, where the default pair is set up: `bash scripts/gpu_wheels.sh` (the wheels the device image lacks in
# .whl/, the twins' headers in .twin/); then run(command="bash scripts/gpu_check.sh", carry=[".whl", ".twin"],
# timeout_s=590).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_SECONDS:-520}  # seconds for all of it (the issue: 9 minutes, the machine's start not counted)
OUT_DIR=${OUT:-docs/benchmarks}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
bounded() {  # bounded SECONDS CMD...: CMD under a timeout, or not at all where the budget is spent
  local s=$1; shift
  if [ "$s" -gt 5 ]; then timeout "$s" "$@"; else echo "gpu_check: no time left for $*"; return 124; fi
}

if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU here; running what a CPU can check (quick lane)"
  $PY -m pytest -q -m "not slow" -p no:cacheprovider tests/test_gpu_aot.py tests/test_gpu_probe.py \
    tests/test_gpu_check.py tests/test_gpu_kernels.py tests/test_gpu_layer.py tests/test_gpu_graphs.py \
    tests/test_gpu_planner.py
  rc=$?
  echo "gpu_check: skipped, for want of a GPU: pytest -m cuda (tests/test_cuda*.py), the end-to-end sections (offspec"
  echo "  bench on the default pair's twins resident and streamed, transformers' generate() of the same shapes), the"
  echo "  kernel table, the 70B slice's linears, the draft-step and target sweeps, the streamed 70B slice's pass"
  echo "  sweep, and gpu-check.md / gpu-check.json (nothing written). The CPU's slow checks:"
  echo "  python -m pytest -m slow tests/test_gpu_aot.py tests/test_gpu_kernels.py tests/test_gpu_layer.py"
  exit $rc
fi

if ls .whl/*.whl >/dev/null 2>&1; then  # the device image's Python 3.12 lacks these (scripts/gpu_wheels.sh)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/gpu-check.XXXX)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$WORK/environment.txt" 2>&1 || true
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$WORK/environment.txt"

TWINS=""
if [ -f .twin/target.head ] && [ -f .twin/draft.head ]; then  # built and converted beside the tests
  TWINS="$WORK/twins"; mkdir -p "$TWINS"
  ( export OFFSPEC_CACHE_DIR="$WORK/cache"
    $PY scripts/gpu/twin_gguf.py build .twin/target.head "$TWINS/t.gguf" \
    && $PY scripts/gpu/twin_gguf.py build .twin/draft.head "$TWINS/d.gguf" \
    && $PY -c "import sys; from offspec.models.sources import resolve_model as r; r(sys.argv[1], 'target'); \
r(sys.argv[2], 'draft')" "$TWINS/t.gguf" "$TWINS/d.gguf" ) > "$WORK/twins.log" 2>&1 &
  TWIN_PID=$!
else
  echo "gpu_check: no .twin/*.head (scripts/gpu_wheels.sh makes them where the pair is set up): no end-to-end sections"
fi

echo "== 1. pytest -m cuda (kernels, layer, graphs, lossless), beside the kernels' compilation =="
$PY scripts/gpu_check.py --out "$WORK" --warm --deadline 150 > "$WORK/warm.log" 2>&1 &
WARM=$!
bounded $(( $(left) - 340 )) $PY -m pytest -q -m cuda -n 6 -p no:cacheprovider tests/test_cuda_kernels.py \
  tests/test_cuda_layer.py tests/test_cuda_experts.py --junitxml="$WORK/cuda-offspec.xml" \
  > "$OUT_DIR/pytest-cuda-offspec.log" 2>&1
echo "pytest exit $?"; tail -n 15 "$OUT_DIR/pytest-cuda-offspec.log"
wait $WARM; echo "warm-up exit $?"; tail -n 3 "$WORK/warm.log"

echo "== 2. pytest -m cuda tests/test_cuda.py (alone: timing checks) =="
bounded $(( $(left) - 230 )) $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py \
  --junitxml="$WORK/cuda-streaming.xml" > "$OUT_DIR/pytest-cuda-streaming.log" 2>&1
echo "pytest exit $?"; tail -n 8 "$OUT_DIR/pytest-cuda-streaming.log"

if [ -n "$TWINS" ]; then
  wait $TWIN_PID; echo "twins exit $? ($(left) s left)"; tr '\r' '\n' < "$WORK/twins.log" | grep -v '%' | tail -n 3
  [ -f "$TWINS/t.gguf" ] || TWINS=""
fi

echo "== 3. measurements ($(left) s left) =="
OFFSPEC_CACHE_DIR="$WORK/cache" $PY scripts/gpu_check.py --out "$OUT_DIR" --work "$WORK" \
  --junit "$WORK/cuda-offspec.xml" --junit "$WORK/cuda-streaming.xml" ${TWINS:+--twins "$TWINS"} \
  --deadline $(( $(left) - 10 ))
rc=$?
cp "$WORK/e2e-bench/bench.json" "$OUT_DIR/e2e-bench.json" 2>/dev/null
cp "$WORK/e2e-offload/offload-bench.json" "$OUT_DIR/e2e-offload-bench.json" 2>/dev/null
for f in environment.txt warm.log twins.log e2e-bench.log e2e-offload.log; do
  [ -f "$WORK/$f" ] && { echo "== $f"; tr '\r' '\n' < "$WORK/$f" | grep -v '%|' | tail -n 40; }
done > "$OUT_DIR/logs.txt"
if [ "$OUT_DIR" != docs/benchmarks ]; then  # the working tree's copy too (a local GPU run commits it)
  mkdir -p docs/benchmarks && cp "$OUT_DIR"/gpu-check.md "$OUT_DIR"/gpu-check.json docs/benchmarks/ 2>/dev/null
fi
echo "gpu_check: done in $(( $(date +%s) - START )) s; wrote $OUT_DIR/gpu-check.md and gpu-check.json"
exit $rc
