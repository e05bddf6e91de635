"""What one layer's linears cost on the GPU: the torch decode path (kernels._decoded_linear), the fused Triton
kernels (offspec/formats/gpu_kernels.py, where Triton and CUDA are there: Q4_K, Q6_K, Q5_0, Q8_0), and plain matmuls
on pre-decoded bf16 weights (the floor a fused kernel would approach), on the shapes and ggml types of one layer of
the default target (Qwen2.5-Coder-1.5B Q4_K_M) and of the default draft (0.5B). Random blocks: no model is needed.
Also checks that the GPU decode is bitwise the CPU decode for every type, and the fused kernels' largest relative
difference from the float32 product. On a machine without CUDA it runs on the CPU in float32 (a smoke test).

    python scripts/gpu/decode_bench.py

docs/gpu.md has an H200's figures (the torch path only: the fused kernels had not run on a GPU yet).
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's offspec, and the tests' block generator
from helpers.tiny_gguf import random_blocks  # noqa: E402

from offspec.formats import gpu_kernels, kernels  # noqa: E402
from offspec.formats.dequant import dequantize as decode  # noqa: E402
from offspec.formats.ggml import KERNEL_NAMES, ggml_type  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
REPEATS = 20 if DEV.type == "cuda" else 2  # a CPU run only checks that it works
# one layer of the 1.5B target: (name, rows, cols, type)
LAYER = [("q", 1536, 1536, "Q4_K"), ("k", 256, 1536, "Q4_K"), ("v", 256, 1536, "Q6_K"), ("o", 1536, 1536, "Q4_K"),
         ("gate", 8960, 1536, "Q4_K"), ("up", 8960, 1536, "Q4_K"), ("down", 1536, 8960, "Q6_K")]
# one layer of the 0.5B draft (Qwen2.5-Coder-0.5B Q4_K_M: 896 columns are not whole K-quant blocks)
DRAFT_LAYER = [("q", 896, 896, "Q5_0"), ("k", 128, 896, "Q5_0"), ("v", 128, 896, "Q8_0"), ("o", 896, 896, "Q5_0"),
               ("gate", 4864, 896, "Q5_0"), ("up", 4864, 896, "Q5_0"), ("down", 896, 4864, "Q6_K")]


def _rel(got, want):
    return float((got.float() - want).abs().max()) / float(want.abs().max())


def timed(fn, repeats=REPEATS):
    for _ in range(min(3, repeats)):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()  # the layer's queued work, all of it
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    rng = np.random.default_rng(0)
    bad = []
    for name in KERNEL_NAMES:
        raw = torch.from_numpy(random_blocks(rng, name, 64, 512))
        tid = ggml_type(name).id
        cpu = decode(raw, tid, 512)
        gpu = decode(raw.to(DEV), tid, 512).cpu()
        if not torch.equal(cpu.view(torch.int32), gpu.view(torch.int32)):
            bad.append(name)
    print(f"GPU decode bitwise = CPU decode for {len(KERNEL_NAMES) - len(bad)}/{len(KERNEL_NAMES)} types"
          + (f"; DIFFER: {bad}" if bad else ""))
    for label, layer in (("target", LAYER), ("draft", DRAFT_LAYER)):
        measure(label, layer, rng)


def measure(label, layer, rng):
    weights = []
    for _, rows, cols, t in layer:
        raw = torch.from_numpy(random_blocks(rng, t, rows, cols)).to(DEV)
        weights.append((raw, ggml_type(t).id, cols, decode(raw, ggml_type(t).id, cols).to(DTYPE)))
    nbytes = sum(w[0].numel() for w in weights)
    print(f"\n{DEV} {torch.cuda.get_device_name() if DEV.type == 'cuda' else ''}; one {label} layer: "
          f"{nbytes / 1e6:.1f} MB of blocks; x: {DTYPE}")
    fused = gpu_kernels.triton is not None and DEV.type == "cuda"
    print("tokens  torch decode ms/layer  matmuls on decoded ms/layer  decode / matmuls"
          + ("  fused ms/layer  fused max rel diff" if fused else ""))
    for m in (1, 16, 64, 256):
        x = torch.randn(m, 8960, device=DEV, dtype=DTYPE)

        def run(linear):
            return lambda: [linear(x[:, :cols], raw, tid, cols) for raw, tid, cols, _ in weights]

        decoded = timed(run(lambda a, r, t, c: kernels._decoded_linear(a, r, t, c, None)))
        plain = timed(lambda: [x[:, :cols] @ w.t() for _, _, cols, w in weights])
        line = f"{m:6d}  {decoded * 1e3:22.2f}  {plain * 1e3:27.3f}  {decoded / plain:15.1f}x"
        if fused:
            t = timed(run(gpu_kernels.linear))
            diff = max(_rel(gpu_kernels.linear(x[:, :c], r, i, c), x[:, :c].float() @ w.float().t())
                       for r, i, c, w in weights)
            line += f"  {t * 1e3:14.3f}  {diff:18.2e}"
        print(line)


if __name__ == "__main__":
    main()
