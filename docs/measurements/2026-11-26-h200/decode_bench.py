"""What one layer's linears cost on the GPU through the torch decode path (kernels._decoded_linear), before and
after the 2026-11-26 change (no host copy per decode), the fused Triton kernels (gpu_kernels.py, where Triton is
installed: Q4_K and Q6_K), beside plain matmuls on pre-decoded bf16 weights (the floor
a fused kernel would approach), on the shapes and ggml types of the default target (Qwen2.5-Coder-1.5B Q4_K_M).
Also checks that the GPU decode is bitwise the CPU decode for every type.

    git show 0c646af~:offspec/formats/dequant.py > /tmp/dequant_before.py    # the decoder before the change
    python docs/measurements/2026-11-26-h200/decode_bench.py /tmp/dequant_before.py       # from the repo root
"""

import importlib.util
import statistics
import sys
import time

import numpy as np
import torch

sys.path[:0] = [".", "tests"]  # run from the repo root
from tiny_gguf import random_blocks  # noqa: E402

from offspec.formats import gpu_kernels, kernels  # noqa: E402
from offspec.formats.dequant import dequantize as new_decode  # noqa: E402
from offspec.formats.ggml import KERNEL_NAMES, ggml_type  # noqa: E402

spec = importlib.util.spec_from_file_location("offspec.formats.dequant_before", sys.argv[1])  # its `from .ggml`
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
# one layer of the 1.5B target: (name, rows, cols, type)
LAYER = [("q", 1536, 1536, "Q4_K"), ("k", 256, 1536, "Q4_K"), ("v", 256, 1536, "Q6_K"), ("o", 1536, 1536, "Q4_K"),
         ("gate", 8960, 1536, "Q4_K"), ("up", 8960, 1536, "Q4_K"), ("down", 1536, 8960, "Q6_K")]
# one layer of the 0.5B draft (Qwen2.5-Coder-0.5B Q4_K_M: 896 columns are not whole K-quant blocks)
DRAFT_LAYER = [("q", 896, 896, "Q5_0"), ("k", 128, 896, "Q5_0"), ("v", 128, 896, "Q8_0"), ("o", 896, 896, "Q5_0"),
               ("gate", 4864, 896, "Q5_0"), ("up", 4864, 896, "Q5_0"), ("down", 896, 4864, "Q6_K")]


def old_linear(x, raw, tid, cols):
    """kernels._decoded_linear as it was: bands into an output buffer, the old decoder."""
    rows = raw.shape[0]
    band = max(1, kernels.DECODE_CHUNK_BYTES // (4 * cols))
    y = x.new_empty((x.shape[0], rows))
    for r0 in range(0, rows, band):
        w = before.dequantize(raw[r0:r0 + band], tid, cols).to(x.dtype)
        y[:, r0:r0 + band] = x @ w.t()
    return y


def _rel(got, want):
    return float((got.float() - want).abs().max()) / float(want.abs().max())


def timed(fn, repeats=20):
    for _ in range(3):
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
        cpu = new_decode(raw, tid, 512)
        gpu = new_decode(raw.to(DEV), tid, 512).cpu()
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
        weights.append((raw, ggml_type(t).id, cols, new_decode(raw, ggml_type(t).id, cols).to(DTYPE)))
    nbytes = sum(w[0].numel() for w in weights)
    print(f"\n{DEV} {torch.cuda.get_device_name() if DEV.type == 'cuda' else ''}; one {label} layer: "
          f"{nbytes / 1e6:.1f} MB of blocks; x: {DTYPE}")
    fused = gpu_kernels.triton is not None and DEV.type == "cuda"
    print("tokens  before ms/layer  after ms/layer  bf16 matmuls ms/layer  speed-up"
          + ("  fused ms/layer  fused max rel diff" if fused else ""))
    for m in (1, 16, 64, 256):
        x = torch.randn(m, 8960, device=DEV, dtype=DTYPE)

        def run(linear):
            return lambda: [linear(x[:, :cols], raw, tid, cols) for raw, tid, cols, _ in weights]

        old = timed(run(old_linear))
        new = timed(run(lambda a, r, t, c: kernels._decoded_linear(a, r, t, c, None)))
        plain = timed(lambda: [x[:, :cols] @ w.t() for _, _, cols, w in weights])
        same = all(torch.equal(old_linear(x[:, :c], r, t, c), kernels._decoded_linear(x[:, :c], r, t, c, None))
                   for r, t, c, _ in weights)
        line = f"{m:6d}  {old * 1e3:15.2f}  {new * 1e3:14.2f}  {plain * 1e3:21.3f}  {old / new:7.2f}x"
        if fused:
            t = timed(run(gpu_kernels.linear))
            diff = max(_rel(gpu_kernels.linear(x[:, :c], r, i, c), x[:, :c].float() @ w.float().t())
                       for r, i, c, w in weights)
            line += f"  {t * 1e3:14.3f}  {diff:18.2e}"
        print(line + ("" if same else "  OUTPUTS DIFFER"))


if __name__ == "__main__":
    main()
