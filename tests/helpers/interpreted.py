"""Run a check of tests/helpers/gpu_interp.py in a process of its own under Triton's interpreter (TRITON_INTERPRET=1
must be set before Triton is imported) and return its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "gpu_interp.py"


def interpret(*args: str, timeout: float = 1200):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
