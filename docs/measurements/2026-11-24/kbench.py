"""The kernel alone: GMAC/s of offspec's CPU kernels on random blocks, per type and activation rows (min of 15).
Run from the repository root: python docs/measurements/2026-11-24/kbench.py THREADS
(OFFSPEC_KERNEL_ISA=avx2 in the environment times the AVX2 build on a CPU with AVX-512.)"""
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_gguf import random_blocks  # noqa: E402

from offspec.formats import kernels  # noqa: E402
from offspec.formats.ggml import ggml_type  # noqa: E402

kernels.load_kernels()
ext = kernels.compiled()
print(kernels.kernel_status())
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
cases = [("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q5_0", 4864, 896), ("Q8_0", 4864, 896)]
rng = np.random.default_rng(0)
for name, N, K in cases:
    w = torch.from_numpy(random_blocks(rng, name, N, K))
    tid = ggml_type(name).id
    out = []
    for M in (1, 4, 8, 16, 32):
        x = torch.randn(M, K)
        for _ in range(3):
            ext.qgemm(x, w, tid, K)
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            ext.qgemm(x, w, tid, K)
            ts.append(time.perf_counter() - t0)
        t = min(ts)
        out.append(f"M{M} {t * 1e3:.2f}ms {M * N * K / t / 1e9:.0f}G")
    print(name, " | ".join(out), flush=True)
