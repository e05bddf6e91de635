"""A GGUF's shape twin: the real file's header (metadata, tokenizer, tensor table) and random weights of the same
ggml types, with block scales set so the weights are finite and of a model's magnitude (|w| ~ 0.02).

For a machine the real weights cannot reach (a lent GPU whose uploads are capped far below the pair's 1.6 GB): pass
and draft-step times depend on the shapes and the formats alone, so a twin measures them exactly; its outputs (and
any acceptance) mean nothing. `twin_run.sh` uses it.

    python scripts/gpu/twin_gguf.py header REAL.gguf OUT.head      # where the GGUF is: header bytes + size (6 MB)
    python scripts/gpu/twin_gguf.py build OUT.head TWIN.gguf       # there: the twin, of the real file's size
"""

import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

# block bytes and where each type's fp16 scales sit: (block size, [(byte offset, value)])
SCALES = {
    "Q4_K": (144, [(0, 1e-4), (2, 7.5e-4)]),  # d, dmin: w = d*sc*q - dmin*m, sc, m 6-bit, q 4-bit
    "Q6_K": (210, [(208, 2e-5)]),  # d at the end: w = d * int8 scale * (q - 32)
    "Q5_0": (22, [(0, 2e-3)]),  # w = d * (q - 16)
    "Q8_0": (34, [(0, 3e-4)]),  # w = d * int8
}


def header(real: str, out: str) -> None:
    reader = GGUFReader(real)
    size = Path(real).stat().st_size
    with open(real, "rb") as f:
        head = f.read(reader.data_offset)
    Path(out).write_bytes(struct.pack("<Q", size) + head)


def build(head_path: str, out: str) -> None:
    blob = Path(head_path).read_bytes()
    size, head = struct.unpack("<Q", blob[:8])[0], blob[8:]
    with open(out, "wb") as f:
        f.write(head)
        f.truncate(size)
    reader = GGUFReader(out)
    data = np.memmap(out, dtype=np.uint8, mode="r+")
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        kind, start, n = t.tensor_type.name, int(t.data_offset), int(t.n_bytes)
        view = data[start:start + n]
        if kind == "F32":
            values = np.ones(n // 4, np.float32) if t.name.endswith("norm.weight") else \
                rng.normal(0, 0.02, n // 4).astype(np.float32)
            view[:] = values.view(np.uint8)
            continue
        if kind not in SCALES:
            raise SystemExit(f"{t.name}: no twin rule for {kind}")
        block, scales = SCALES[kind]
        view[:] = rng.integers(0, 256, n, dtype=np.uint8)
        blocks = view.reshape(-1, block)
        for offset, value in scales:
            blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    data.flush()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("header", "build"):
        raise SystemExit(__doc__)
    {"header": header, "build": build}[sys.argv[1]](*sys.argv[2:])
