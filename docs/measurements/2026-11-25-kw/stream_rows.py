"""Every K-quant block weight of the default target (788 MB: more than a cache holds) through the kernels at M
activation rows, as a pass streams them: ms per sweep, AVX-512 and AMX (the kernels' `set_amx`; the same bits).

    PYTHONPATH=. python docs/measurements/2026-11-25-kw/stream_rows.py [M ...]
"""

import statistics
import sys
import time

import gguf
import numpy as np
import torch

from offspec.models.default_pair import DEFAULT_TARGET, assembled_gguf
from offspec.formats import kernels

K_QUANTS = (12, 13, 14)  # Q4_K, Q5_K, Q6_K


def main():
    assert kernels.load_kernels() is None, kernels.kernel_status()
    ext = kernels.compiled()
    reader = gguf.GGUFReader(str(assembled_gguf(DEFAULT_TARGET)))
    weights = [(torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(int(t.shape[1]), -1).clone(),
                int(t.tensor_type), int(t.shape[0]))
               for t in reader.tensors if t.name.startswith("blk.") and int(t.tensor_type) in K_QUANTS]
    print(f"{len(weights)} tensors, {sum(w.numel() for w, _, _ in weights) / 1e6:.0f} MB; {kernels.kernel_status()}")
    acts = {}

    def sweep(m):
        for w, type_id, cols in weights:
            ext.qgemm(acts.setdefault((m, cols), torch.randn(m, cols)), w, type_id, cols)

    print("| rows | AVX-512 ms | AMX ms |\n|---:|---:|---:|")
    for m in [int(a) for a in sys.argv[1:]] or (1, 2, 3, 4, 5, 6, 7, 8, 16):
        times = {False: [], True: []}
        for _ in range(5):  # the two paths in turn, so a slow spell of the VM costs both
            for amx in times:
                ext.set_amx(amx)
                start = time.perf_counter()
                sweep(m)
                times[amx].append(time.perf_counter() - start)
        ext.set_amx(True)
        print(f"| {m} | {statistics.median(times[False]) * 1e3:.1f} | {statistics.median(times[True]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
