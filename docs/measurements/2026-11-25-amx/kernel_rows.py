"""One projection of a GGUF model through offspec's kernels, AVX-512 against AMX, by activation rows (the same bits).

    PYTHONPATH=. python docs/measurements/2026-11-25-amx/kernel_rows.py [--model target|draft] [TENSOR ...]

Medians of in-cache calls, ms. The kernels in use (`offspec/formats/csrc`), switched with their `set_amx`.
"""

import argparse
import statistics

import gguf
import numpy as np
import torch

from offspec.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, assembled_gguf
from offspec.formats import kernels
from offspec.profile.timing import timed

CPU = torch.device("cpu")


def median_ms(fn, repeat=20):
    fn()  # first-call allocations are not part of a call
    return statistics.median(timed(fn, CPU) for _ in range(repeat)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("target", "draft"), default="target")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("tensors", nargs="*", default=["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "output.weight"])
    args = ap.parse_args()
    assert kernels.load_kernels() is None, kernels.kernel_status()
    ext = kernels.compiled()
    reader = gguf.GGUFReader(str(assembled_gguf(DEFAULT_TARGET if args.model == "target" else DEFAULT_DRAFT)))
    print(f"kernels: {kernels.kernel_status()}, torch threads {torch.get_num_threads()}")
    for name in args.tensors:
        t = next(t for t in reader.tensors if t.name == name)
        rows, cols = int(t.shape[1]), int(t.shape[0])
        raw = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(rows, -1)
        print(f"\n{name} ({t.tensor_type.name}, {rows} x {cols})\n| rows | AVX-512 ms | AMX ms |\n|---:|---:|---:|")
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, cols)
            ext.set_amx(False)
            a = median_ms(lambda: ext.qgemm(x, raw, int(t.tensor_type), cols))
            ext.set_amx(True)
            b = median_ms(lambda: ext.qgemm(x, raw, int(t.tensor_type), cols))
            print(f"| {m} | {a:.2f} | {b:.2f} |")


if __name__ == "__main__":
    main()
