"""The legacy types' kernels streaming weights from memory (600 MB of random blocks of the draft's shapes, one call
per matrix, 2 threads), this checkout's kernels against another checkout's, for one instruction set; each output
is checked to be bitwise the same.

    git worktree add /tmp/before <commit>
    PYTHONPATH=.:tests python docs/measurements/2026-11-25-draft/stream_legacy.py /tmp/before/offspec/formats/csrc auto
    PYTHONPATH=.:tests python docs/measurements/2026-11-25-draft/stream_legacy.py /tmp/before/offspec/formats/csrc avx2
"""

import hashlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.cpp_extension import load

from offspec.formats import kernels
from offspec.formats.ggml import ggml_type
from tiny_gguf import random_blocks

SHAPES = (("Q5_0", 4864, 896, 1), ("Q8_0", 4864, 896, 1), ("Q4_0", 4864, 896, 1), ("Q5_0", 4864, 896, 4))


def build(csrc: Path, flags: list[str]):
    name = hashlib.sha256(f"{csrc.resolve()} {flags}".encode()).hexdigest()[:10]
    directory = Path(f"/tmp/offspec-stream-legacy-{name}")
    directory.mkdir(exist_ok=True)
    return load(f"sl_{name}", [str(csrc / "ggml_cpu.cpp")], extra_include_paths=[str(csrc)],
                extra_cflags=["-O3", "-ffp-contract=off", *flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(directory))


def main():
    flags = kernels._simd_flags(sys.argv[2])
    builds = {"before": build(Path(sys.argv[1]), flags), "this": build(kernels.CSRC, flags)}
    rng = np.random.default_rng(0)
    torch.set_num_threads(2)
    for type_name, rows, cols, m in SHAPES:
        weights = [torch.from_numpy(random_blocks(rng, type_name, rows, cols)) for _ in range(600_000_000 // (rows * cols))]
        x, tid = torch.randn(m, cols), ggml_type(type_name).id
        seconds = {}
        for _ in range(5):
            for name, ext in builds.items():
                t0 = time.perf_counter()
                for w in weights:
                    ext.qgemm(x, w, tid, cols)
                seconds.setdefault(name, []).append((time.perf_counter() - t0) / len(weights))
        a, b = (ext.qgemm(x, weights[0], tid, cols) for ext in builds.values())
        assert torch.equal(a, b)
        size = weights[0].numel()
        print(sys.argv[2], type_name, f"{rows}x{cols}", f"rows {m}:", "  ".join(
            f"{name} {size / statistics.median(s) / 1e9:.1f} GB/s" for name, s in seconds.items()))


if __name__ == "__main__":
    main()
