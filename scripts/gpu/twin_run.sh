#!/bin/bash
# The GPU checks, in one run on a machine with a CUDA GPU where the default pair's weights cannot be copied (or are
# not set up): the pair is measured on its shape twins (twin_gguf.py: the real headers, random blocks of the same
# ggml types, so pass and step times are right and every acceptance figure is meaningless).
#   1. the CUDA tests (`pytest -m cuda tests/test_cuda.py`; PYTEST_K selects some);
#   2. the pair's costs on the GPU: `offspec profile --quick` with the target streamed from pinned RAM (the
#      smallest --device-mem the placement accepts for trees of up to 1024 nodes), then resident; `offspec bench
#      offload` (streamed passes of 1-1024 tokens) and `offspec bench` of the target alone, streamed.
# Before, where the pair is set up:
#   python scripts/gpu/twin_gguf.py header <cache>/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf .twin/target.head
#   python scripts/gpu/twin_gguf.py header <cache>/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf .twin/draft.head
# Then, from the repository root on the GPU machine: bash scripts/gpu/twin_run.sh 2>&1 | tee run.log
# Wheels in .whl/ (e.g. gguf, where the machine's image lacks it) are installed first; results go to $OUT.
# OFFSPEC_CUDA_KERNELS=triton in the environment runs all of it on the fused kernels.
set -o pipefail
export PYTHONUNBUFFERED=1 OFFSPEC_CACHE_DIR=${OFFSPEC_CACHE_DIR:-/tmp/offspec-twin-cache}
OUT=${OUT:-twin-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
D=scripts/gpu
W=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# the twins and their one-time conversion run beside the tests
( time ( python3 $D/twin_gguf.py build .twin/target.head $W/t.gguf && python3 $D/twin_gguf.py build .twin/draft.head $W/d.gguf \
  && python3 -c "import sys; from offspec.models.sources import resolve_model as r; r(sys.argv[1], 'target'); r(sys.argv[2], 'draft')" \
     $W/t.gguf $W/d.gguf ) ) > $W/twins.log 2>&1 &
timeout ${TEST_S:-200} python3 -m pytest -m cuda -q -ra --timeout 150 -p no:cacheprovider tests/test_cuda.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1
wait; tr '\r' '\n' < $W/twins.log | grep -v '%' | tail -5
MIN=$(python3 - "$W" <<'PY'
import re, sys, offspec
w = sys.argv[1]
try:
    offspec.load(f"{w}/t.gguf", f"{w}/d.gguf", device="cuda", device_mem="1KB", max_context=2048, max_budget=1024)
except offspec.OffspecError as e:
    m = re.search(r"--device-mem (\S+)", str(e)); print(m[1] if m else "none: " + str(e))
PY
)
echo "smallest --device-mem for 1024-node trees: $MIN"
M="--target $W/t.gguf --draft $W/d.gguf --max-context 2048 --max-budget 1024"
P="$M --quick --prompts 2 --passes 2"
step() { local s=$1; shift; echo "== $*"; timeout $s python3 main.py "$@" 2>&1 | tr '\r' '\n' | grep -v '%'; }
step 120 profile $P --device-mem $MIN --out $W/streamed.json && cp $W/streamed.json "$OUT"/
step 100 profile $P --out $W/resident.json && cp $W/resident.json "$OUT"/
step 90 bench offload $M --device-mem $MIN --no-accelerate --tokens 1,16,64,256,1024 --out $W/offload \
  && cp $W/offload/offload-bench.json "$OUT"/
step 60 bench $M --device-mem $MIN --prompts offspec/data/code_edits.jsonl --n 2 --max-new-tokens 64 --budgets ar \
  --out $W/ar && cp $W/ar/bench.json "$OUT"/ar-bench.json
