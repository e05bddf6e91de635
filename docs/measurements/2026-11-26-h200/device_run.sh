#!/bin/bash
# The GPU checks of 2026-11-26, in one call of the device tool (an H200 lent for 15 minutes):
#   1. the CUDA tests (`pytest -m cuda`; PYTEST_K selects some);
#   2. the default pair's costs on the GPU, measured on its shape twins (twin_gguf.py): `offspec profile --quick`
#      with the target streamed from pinned RAM (the smallest --device-mem the placement accepts for trees of up to
#      1024 nodes), then resident; `offspec bench offload` (streamed passes of 1-1024 tokens) and `offspec bench`
#      of the target alone, streamed.
# Carried: .whl (the gguf wheel: the image lacks it), .twin (the two GGUF headers, 12 MB).
set -o pipefail
export PYTHONUNBUFFERED=1 OFFSPEC_CACHE_DIR=/tmp/oc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
D=docs/measurements/2026-11-26-h200
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# the twins and their one-time conversion run beside the tests (16 cores)
( time ( python3 $D/twin_gguf.py build .twin/target.head /tmp/t.gguf && python3 $D/twin_gguf.py build .twin/draft.head /tmp/d.gguf \
  && python3 -c "from offspec.models.sources import resolve_model as r; r('/tmp/t.gguf', 'target'); r('/tmp/d.gguf', 'draft')" ) \
  ) > $W/twins.log 2>&1 &
timeout ${TEST_S:-200} python3 -m pytest -m cuda -q -ra --timeout 150 -p no:cacheprovider tests/test_cuda.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1
wait; tr '\r' '\n' < $W/twins.log | grep -v '%' | tail -5
MIN=$(python3 - <<'PY'
import re, offspec
try:
    offspec.load("/tmp/t.gguf", "/tmp/d.gguf", device="cuda", device_mem="1KB", max_context=2048, max_budget=1024)
except offspec.OffspecError as e:
    m = re.search(r"--device-mem (\S+)", str(e)); print(m[1] if m else "none: " + str(e))
PY
)
echo "smallest --device-mem for 1024-node trees: $MIN"
M="--target /tmp/t.gguf --draft /tmp/d.gguf --max-context 2048 --max-budget 1024"
P="$M --quick --prompts 2 --passes 2"
step() { local s=$1; shift; echo "== $*"; timeout $s python3 main.py "$@" 2>&1 | tr '\r' '\n' | grep -v '%'; }
step 120 profile $P --device-mem $MIN --out $W/streamed.json && cp $W/streamed.json $OUT/
step 100 profile $P --out $W/resident.json && cp $W/resident.json $OUT/
step 90 bench offload $M --device-mem $MIN --no-accelerate --tokens 1,16,64,256,1024 --out $W/offload \
  && cp $W/offload/offload-bench.json $OUT/
step 60 bench $M --device-mem $MIN --prompts offspec/data/code_edits.jsonl --n 2 --max-new-tokens 64 --budgets ar \
  --out $W/ar && cp $W/ar/bench.json $OUT/ar-bench.json
