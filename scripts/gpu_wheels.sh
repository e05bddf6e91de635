#!/usr/bin/env bash
# The Python packages scripts/gpu_check.sh needs that a lent GPU machine's image lacks (KINDS.md's package list:
# gguf), as wheels in .whl/ (ignored by git; carry it with the device call: carry [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "gguf==$(python3 -c 'import gguf.metadata, importlib.metadata as m; print(m.version("gguf"))')"
ls -l .whl
