"""The helpers in tests/helpers/ also run as scripts (the fault harness, the GPU interpreter), with that folder
first on sys.path: a helper named like a module a library imports (as `cuda.py` once was: torch tries
`cuda.bindings` while it starts) breaks every such script. Both checks below failed with that name."""

import importlib.util
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).parent / "helpers"
NAMES = sorted(p.stem for p in HELPERS.glob("*.py") if p.stem != "__init__")


def test_no_helper_shares_a_name_with_a_known_module():
    # torch imports `cuda` optionally, so it is not installed here and find_spec misses it: named explicitly
    known = set(sys.stdlib_module_names) | {"cuda", "triton", "torch", "transformers", "offspec", "tests"}
    clashes = [n for n in NAMES if n in known or importlib.util.find_spec(n) is not None]
    assert NAMES and clashes == [], f"rename these helpers, they shadow modules: {clashes}"


def test_the_libraries_import_with_the_helpers_first_on_the_path():
    code = (f"import sys; sys.path.insert(0, {str(HELPERS)!r}); import torch; torch.cuda.is_available(); "
            "import transformers, offspec.api, offspec.offload")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
