#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a lent GPU machine that its image lacks (torch 2.11, triton 3.6 and
# transformers 5.17 are there; see the device notes' package list), prepared here where pip and the default pair are:
#   .whl/   wheels for Python 3.12, manylinux x86-64: gguf, pydantic with the pydantic-core its version pins,
#           annotated-types, typing-inspection and platformdirs (the profile schema and the cache paths need the
#           last four), each at the version installed here (pydantic 2.x);
#   .twin/  the default pair's GGUF headers (metadata, tokenizer, tensor table: a few MB each) for the shape twins
#           (scripts/gpu/twin_gguf.py build makes a file of the real size and types there, random blocks).
# Both are ignored by git; carry them with the device call: carry=[".whl", ".twin"].
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .twin
exclude="$(git rev-parse --git-path info/exclude)"
for d in /.whl/ /.twin/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
rm -f .whl/*.whl
version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
for pkg in gguf pydantic pydantic_core annotated_types typing_inspection platformdirs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pkg==$(version "$pkg")"
done
python3 - <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, "scripts/gpu")
from twin_gguf import header

from offspec.models.default_pair import DEFAULT_TARGET, DEFAULT_DRAFT, gguf_path

for spec, name in ((DEFAULT_TARGET, "target"), (DEFAULT_DRAFT, "draft")):
    path = gguf_path(spec)
    if not path.is_file():
        sys.exit(f"gpu_wheels: {path} is missing: run `python3 main.py setup` first")
    header(str(path), f".twin/{name}.head")
PY
ls -l .whl .twin
