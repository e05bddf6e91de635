"""Time one projection (the 1.5B target's gate/up: 8960 x 1536) through offspec's CPU kernels and torch's.

    python scripts/kernel_bench.py [--rows 1,4,16,64] [--repeat 20] [--stat median|min]

offspec: the target's own Q4_K gate weight (and its Q4_1, Q8_0 re-encodings: --quant int4 / int8; IQ4_XS, IQ4_NL and
MXFP4 as random valid blocks of the same shape: gguf has no IQ quantizer, and the kernels' time does not depend on the
values);
torch: float32 F.linear,
`_weight_int8pack_mm` (int8, a scale per row) and `_weight_int4pack_mm_for_cpu` (int4, group 32), on random
weights of the same shape. Medians in ms (--stat min: the fastest run, steadier on a busy machine), the threads torch
uses (torch.get_num_threads()).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def median_ms(fn, repeat: int, stat: str = "median") -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return (min(times) if stat == "min" else statistics.median(times)) * 1e3


def main() -> None:
    import gguf

    from offspec.formats import kernels
    from offspec.formats.ggml import ggml_type
    from offspec.models.default_pair import DEFAULT_TARGET, assembled_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    args = ap.parse_args()
    path = assembled_gguf(DEFAULT_TARGET)
    if path is None:
        raise SystemExit("run `offspec setup` first (the default target's GGUF)")
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
    out, cols = int(t.shape[1]), int(t.shape[0])
    q4k = torch.from_numpy(np.ascontiguousarray(t.data)).view(torch.uint8).reshape(out, -1)
    w = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type)).float().reshape(out, cols)
    weights = {"Q4_K (GGUF)": (q4k, ggml_type("Q4_K").id)}
    for name in ("Q4_1", "Q8_0"):  # what --quant int4 / int8 store
        blocks = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[name])
        weights[name] = (torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8), ggml_type(name).id)
    rng = np.random.default_rng(0)
    for name in ("IQ4_XS", "IQ4_NL"):
        t = ggml_type(name)
        blocks = rng.integers(0, 256, (out, cols // t.block, t.nbytes), dtype=np.uint8)  # indices and scales
        blocks[..., 0:2] = np.full((out, cols // t.block), 0.001, np.float16).view(np.uint8).reshape(out, -1, 2)
        weights[name + " (random)"] = (torch.from_numpy(blocks.reshape(out, -1)), t.id)
    t = ggml_type("MXFP4")
    blocks = rng.integers(0, 256, (out, cols // t.block, t.nbytes), dtype=np.uint8)  # indices
    blocks[..., 0] = 118  # the E8M0 exponent: 2**-10, weights of at most 0.012
    weights["MXFP4 (random)"] = (torch.from_numpy(blocks.reshape(out, -1)), t.id)
    kernels.load_kernels()
    print(f"kernels: {kernels.kernel_status()}; torch threads {torch.get_num_threads()}; weight {out}x{cols}")
    # torch's weight-only kernels on the same float weight
    scales8 = w.abs().amax(1) / 127
    w8 = torch.round(w / scales8[:, None]).to(torch.int8)
    int4 = None
    try:
        g = 32
        wg = w.reshape(out, cols // g, g)
        lo, hi = wg.amin(2), wg.amax(2)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = lo + 8 * scale
        q = torch.clamp(torch.round((wg - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32).reshape(out, cols)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale, zero], 2).transpose(0, 1).contiguous()  # (cols/g, out, 2)
        int4 = (packed, sz)
    except Exception as exc:  # another torch version
        print(f"torch int4pack unavailable: {exc}")
    print("| rows | " + " | ".join(weights) + " | f32 F.linear | torch int8pack | torch int4pack g32 |")
    print("|---|" + "---|" * (len(weights) + 3))
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, cols)
        def timed(fn):
            return median_ms(fn, args.repeat, args.stat)

        cells = [timed(lambda: kernels.linear(x, qw, tid, cols)) for qw, tid in weights.values()]
        cells.append(timed(lambda: F.linear(x, w)))
        cells.append(timed(lambda: torch._weight_int8pack_mm(x, w8, scales8)))
        if int4 is not None:
            cells.append(timed(lambda: torch._weight_int4pack_mm_for_cpu(x, int4[0], 32, int4[1])))
        print(f"| {m} | " + " | ".join(f"{c:.2f}" for c in cells) + (" |" if int4 is not None else " | - |"))


if __name__ == "__main__":
    main()
