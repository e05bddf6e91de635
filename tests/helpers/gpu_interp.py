"""Checks of offspec's CUDA kernels (offspec/formats/gpu) on CPU tensors, run by Triton's interpreter.

    TRITON_INTERPRET=1 python tests/helpers/gpu_interp.py CHECK [ARGS...]

prints one JSON line of results (tests/test_gpu_kernels.py and tests/test_gpu_layer.py assert on them;
scripts/gpu_check.sh runs them where there is no GPU). The interpreter must be chosen before Triton is imported, hence
a process of its own. Its matrix product is replaced by one whose rounding depends on the row alone (helpers/
interpreter.py), as the GPU's is.

- decode TYPES:                     each type's GPU decode against dequant.py, gguf's reference and the compiled
                                    CPU kernels' decode, bit for bit (float32), and rounded to bfloat16 as torch rounds
- linear TYPES DTYPE ROWS COLS Ms:  each row of every M and of every tiling (16 rows, 64 rows with the K splits as
                                    programs, 64 with the splits in a program) against the same rows at the largest M,
                                    bit for bit, and the products against an exact reference
- group DTYPE:                      a q/k/v-like group of three weights of three types in one call (a K-quant and
                                    two lattice types, each launch with its own grid): invariant rows
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from helpers.interpreter import use_row_invariant_dot  # noqa: E402
from helpers.tiny_gguf import random_blocks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IQ_BYTES = {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}  # (block, bytes); d (fp16) first in both


def blocks(rng: np.random.Generator, name: str, rows: int, cols: int) -> torch.Tensor:
    """(rows, row_bytes) random valid blocks (small positive fp16 scales) of any type the kernels take."""
    if name in IQ_BYTES:
        block, nbytes = IQ_BYTES[name]
        raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, (rows, cols // block)) * 0.005).astype(np.float16)
        raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
        return torch.from_numpy(raw.reshape(rows, -1))
    return torch.from_numpy(random_blocks(rng, name, rows, cols))


def reference(raw: torch.Tensor, name: str, cols: int) -> torch.Tensor:
    """gguf's reference decode: (rows, cols) float32."""
    import gguf

    qt = gguf.GGMLQuantizationType[name]
    data = raw.numpy()
    if name in ("F32", "F16", "BF16"):
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": None}[name]
        if dtype is None:  # bfloat16 bits
            return (torch.from_numpy(data.copy()).view(torch.int16).reshape(raw.shape[0], cols).view(torch.bfloat16)
                    .float())
        return torch.from_numpy(data.view(dtype).astype(np.float32).reshape(raw.shape[0], cols))
    return torch.from_numpy(gguf.dequantize(data, qt).astype(np.float32).reshape(raw.shape[0], cols))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def check_decode(types: list[str]) -> list[dict]:
    from offspec.formats import kernels
    from offspec.formats.dequant import dequantize
    from offspec.formats.ggml import KERNEL_TYPES, ggml_type
    from offspec.formats.gpu import linear as gl

    rng = np.random.default_rng(0)
    cpu = kernels.compiled() is not None
    out = []
    for name in types:
        rows, cols = 70, 512  # a full tile of 64 weight rows and a partial one; 2 units of 256
        raw = blocks(rng, name, rows, cols)
        tid = ggml_type(name).id
        got = gl.decode(raw, tid, cols, torch.float32)
        ref = reference(raw, name, cols)
        row = {"type": name, "gguf": same_bits(got, ref), "finite": bool(torch.isfinite(got).all()),
               "bf16": same_bits(gl.decode(raw, tid, cols, torch.bfloat16), ref.to(torch.bfloat16))}
        if tid in KERNEL_TYPES:
            row["dequant"] = same_bits(got, dequantize(raw, tid, cols))
            if cpu:
                row["cpu_kernels"] = same_bits(got, kernels.dequantize_rows(raw, tid, cols))
        if name == "MXFP4":  # every exponent: 0 and 1 subnormal, 255 2**127 (its larger entries overflow, as gguf's)
            edges = raw.clone().reshape(rows, -1, 17)  # (rows, blocks, bytes)
            edges[:, :, 0] = (torch.arange(edges.shape[0] * edges.shape[1]) % 256).reshape(rows, -1).to(torch.uint8)
            edges = edges.reshape(rows, -1)
            with np.errstate(over="ignore"):
                want = reference(edges, name, cols)
            row["edges"] = same_bits(gl.decode(edges, tid, cols, torch.float32), want)
        out.append(row)
    return out


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ w^T + bias in float64 from the operands as the kernels round them."""
    return x.double() @ w.to(x.dtype).double().T + bias.double()


def check_linear(types: list[str], dtype_name: str, rows: int, cols: int, ms: list[int]) -> list[dict]:
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(1)
    out = []
    for name in types:
        raw = blocks(rng, name, rows, cols)
        tid = ggml_type(name).id
        w = reference(raw, name, cols)  # (rows, cols) float32
        bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32)).to(dtype)
        top = max(ms)
        x = torch.from_numpy(rng.standard_normal((top, cols)).astype(np.float32)).to(dtype)
        y = torch.full((top, rows), float("nan"), dtype=dtype)
        y.copy_(gl.linear(x, [(raw, tid)], cols, bias))  # (top, rows): the reference rows
        exact = _exact(x, w, bias)
        err = float((y.double() - exact).norm() / exact.norm())
        same = {}
        # every tiling (linear.py) at every M up to GRID_SPLIT_ROWS, against the rows of the largest M (tiles of 64
        # rows, the splits in each program); above it the tilings of fewer rows are the same compiled kernels on a
        # larger grid (M is not specialized on), and cost the interpreter minutes
        for m in ms:
            for path, hint in (("few", 1), ("grid", gl.GRID_SPLIT_ROWS), ("many", 10**6)):
                if m <= gl.GRID_SPLIT_ROWS:
                    same[f"{path}{m}"] = same_bits(gl.linear(x[:m], [(raw, tid)], cols, bias, rows_hint=hint), y[:m])
        out.append({"type": name, "rel_err": err, "finite": bool(torch.isfinite(y).all()), "same": same,
                    "splits": gl.plan_splits(rows, cols, [tid], gl.multiprocessors(x.device))[0]})
    return out


def check_group(dtype_name: str) -> dict:
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import linear as gl

    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(2)
    cols = 512
    spec = [("Q4_K", 128), ("IQ2_XXS", 64), ("IQ3_S", 64)]  # a q, k, v of a small attention
    raws = [blocks(rng, name, n, cols) for name, n in spec]
    weights = [(raw, ggml_type(name).id) for raw, (name, _) in zip(raws, spec)]
    w = torch.cat([reference(raw, name, cols) for raw, (name, _) in zip(raws, spec)])  # (256, cols)
    bias = torch.from_numpy(rng.standard_normal(w.shape[0]).astype(np.float32)).to(dtype)
    x = torch.from_numpy(rng.standard_normal((80, cols)).astype(np.float32)).to(dtype)
    y = gl.linear(x, weights, cols, bias)  # (80, 256): tiles of 64 rows
    exact = _exact(x, w, bias)
    same = {m: same_bits(gl.linear(x[:m], weights, cols, bias), y[:m]) for m in (1, 5, 33)}
    return {"rel_err": float((y.double() - exact).norm() / exact.norm()), "same": same}


def main(argv: list[str]) -> None:
    import triton  # noqa: F401  (the interpreter is set up once Triton is imported)

    use_row_invariant_dot()
    check, args = argv[0], argv[1:]
    if check == "decode":
        result = check_decode(args[0].split(","))
    elif check == "linear":
        ms = [int(m) for m in args[4].split(",")]
        result = check_linear(args[0].split(","), args[1], int(args[2]), int(args[3]), ms)
    elif check == "group":
        result = check_group(args[0])
    else:
        from helpers import gpu_layer_checks  # the layer's checks (tests/test_gpu_layer.py)

        result = gpu_layer_checks.run(check, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
