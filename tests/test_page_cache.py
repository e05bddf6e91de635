"""Pages offspec's process would hold for nothing (issue 63): what each helper of offload/hostmem.py promises, on
real files and mappings (Linux; elsewhere they are no-ops, and these tests say so by failing loudly only on Linux).

- `drop_cached`: a file's cached pages go, a mapping's view of it keeps its values;
- `advise(view, MADV_DONTNEED)`: a read-only file mapping's resident pages go, and reading it again gives the
  file's bytes;
- a CPU process that loads a model imports no Triton (`util.device.cpu_only_imports`).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from offspec.offload.hostmem import MADV_DONTNEED, PAGE, advise, drop_cached

ROOT = Path(__file__).resolve().parent.parent
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page-cache advice is Linux's")


def _mapped_kb(path: Path) -> int:
    """KiB of `path` resident in this process's mappings (/proc/self/smaps: Rss). mincore would not do: it tells the
    page cache, which keeps a file's pages after a mapping lets them go."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                current = line.rstrip().endswith(str(path))
            elif line.startswith("Rss:") and current:
                total += int(line.split()[1])
    return total


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "weights.bin"
    payload = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    return path, payload


@linux
def test_advise_dontneed_lets_a_read_only_mappings_pages_go_and_keeps_its_bytes(data_file):
    path, payload = data_file
    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(payload.size,)))
    assert int(view.sum()) == int(payload.sum())  # every page read
    assert _mapped_kb(path) == 64 * PAGE // 1024
    advise(view, MADV_DONTNEED)
    assert _mapped_kb(path) == 0
    assert torch.equal(view, torch.from_numpy(payload))  # read again from the file


@linux
def test_drop_cached_keeps_a_mapped_views_values(data_file):
    path, payload = data_file
    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(payload.size,)))
    view[:PAGE] = 7  # a copy-on-write page: the process's own, which dropping the file's cache must not touch
    drop_cached(path)
    assert torch.all(view[:PAGE] == 7)
    assert torch.equal(view[PAGE:], torch.from_numpy(payload[PAGE:]))


@linux
def test_a_cpu_load_imports_no_triton(tiny_dirs):
    target, _ = tiny_dirs[("llama", 0)]
    code = ("import sys, offspec; g = offspec.load(sys.argv[1], 'none', dtype='float32', max_context=64, "
            "max_budget=8); g.generate('Hi', max_new_tokens=2); import json; "
            "print(json.dumps(['triton' in sys.modules, 'torch._dynamo' in sys.modules]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    triton, dynamo = json.loads(out.stdout.strip().splitlines()[-1])
    assert dynamo and not triton  # transformers' model classes imported dynamo; its Triton probe answered no
