#!/usr/bin/env bash
# Install offspec and its dependencies into the current Python environment.
# torch: an installed torch is kept; otherwise torch 2.13.0 is installed first (on a CPU-only machine
# with the local CPU build this never pulls CUDA packages, because every later range admits 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip --version >/dev/null 2>&1 || { echo "error: $PY has no pip; install pip first" >&2; exit 2; }
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev]"
