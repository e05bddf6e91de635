"""The fused CUDA kernels (offspec/formats/gpu_kernels.py, Triton) computed on a CPU by Triton's interpreter: the
same products as the exact decode, for every shape edge (no rows, rows past a tile, a partial weight tile), in
float32. The interpreter's bfloat16 `tl.dot` returns garbage (Triton 3.9: even for two plain tiles), so bfloat16 is
checked on a GPU (tests/test_cuda.py). The interpreter must be chosen before Triton is imported, so the check runs
in a fresh process. Where Triton is not installed (a dev dependency on Linux x86-64) the test says so and skips."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offspec import OffspecError

ROOT = Path(__file__).parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")

CHECK = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import numpy as np, torch
from helpers.tiny_gguf import random_blocks
from offspec.formats import gpu_kernels
from offspec.formats.dequant import dequantize
from offspec.formats.ggml import ggml_type
rng = np.random.default_rng(0)
out = []
for name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
    rows, cols = 70, 512  # 70: one full tile of 64 weight rows and a partial one
    raw = torch.from_numpy(random_blocks(rng, name, rows, cols))
    tid = ggml_type(name).id
    w = dequantize(raw, tid, cols)  # (rows, cols) float32, exact
    bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32))
    assert gpu_kernels.handles(tid)
    for m in (0, 1, 3, 17):  # 17: past one 16-row activation tile
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
        got = gpu_kernels.linear(x, raw, tid, cols, bias)
        exact = x.double() @ w.double().T + bias.double()
        f32 = float((got.double() - exact).abs().max()) / max(1.0, float(exact.abs().max())) if m else 0.0
        out.append({"type": name, "m": m, "shape": list(got.shape), "dtype": str(got.dtype), "f32_rel": f32})
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_triton
def test_the_fused_kernels_compute_the_exact_products_in_triton_s_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 16
    for r in results:
        assert r["shape"] == [r["m"], 70] and r["dtype"] == "torch.float32", r
        assert r["f32_rel"] < 1e-6, r  # float32 products of the exact values


def test_the_switch_is_checked_in_one_line(monkeypatch):
    from offspec.formats import gpu_kernels

    monkeypatch.setenv(gpu_kernels.VARIABLE, "cuda")
    with pytest.raises(OffspecError, match="use torch .* or triton"):
        gpu_kernels.wanted()
    monkeypatch.setenv(gpu_kernels.VARIABLE, "triton")
    monkeypatch.setattr(gpu_kernels, "triton", None)
    gpu_kernels._wanted.cache_clear()
    with pytest.raises(OffspecError, match="Triton is not installed"):
        gpu_kernels.wanted()
    gpu_kernels._wanted.cache_clear()
    monkeypatch.delenv(gpu_kernels.VARIABLE)
    assert gpu_kernels.wanted() is False  # the default: the torch decode path
