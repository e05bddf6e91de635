#!/usr/bin/env bash
# Everything a new user needs: install, fetch + convert the default model pair, then chat.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
"$PY" main.py setup
exec "$PY" main.py chat "$@"
