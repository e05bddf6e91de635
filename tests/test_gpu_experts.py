"""The grouped routed experts on CUDA (offspec/formats/gpu/experts.py) computed on a CPU by Triton's interpreter, in a
process of its own (this file as a script: `TRITON_INTERPRET=1 python tests/test_gpu_experts.py NAME:ARG:ARG ...`, its
matrix product made row-invariant as the GPU's, tests/helpers/interpreter.py):

- every routed expert's rows of a grouped launch equal `linear()` of that expert's rows alone, bit for bit, in
  float32 and bfloat16, for experts of 1 row and of many, gate and up in one launch, with biases;
- a (token, expert) row has the same bits routed alone and with 40 other tokens;
- the grouped FFN equals QExperts' per-expert loop (formats/experts.py: its torch path, each projection a `linear()`)
  bit for bit, SiLU and gpt-oss's clamped SwiGLU with biases, and a token's output row is its own alone.

Where Triton is not installed the tests skip. The launches' resources and arithmetic: tests/test_gpu_aot.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (pip install triton; a dev dependency on Linux x86-64)")
# (type, cols): the K-quants' 512 columns are 2 units of 256, split in 2 on the interpreter's pretend card
SHAPES = {"Q4_K": 512, "Q5_K": 512, "Q6_K": 512, "Q8_0": 128, "MXFP4": 128}


def interpret(*checks: str, timeout: float = 1200) -> list:
    """Each check ("name:arg:arg") run in one process of its own under the interpreter: their results."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, *checks], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_grouped(results):
    for r in results:
        assert r["splits"] > 1, r  # the K splits are summed in order in each grouped program
        assert all(r["same"].values()), r


@needs_triton
def test_a_grouped_launch_gives_each_expert_the_bits_of_its_own_linear():
    """MXFP4 (gpt-oss's experts) in float32 and bfloat16 (the K-quants and Q8_0: the slow test)."""
    _check_grouped(interpret("grouped:MXFP4:float32", "grouped:MXFP4:bfloat16"))


@pytest.mark.slow
@needs_triton
def test_every_expert_type_gives_the_bits_of_its_own_linear():
    _check_grouped(interpret(*(f"grouped:{t}:{d}" for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
                               for d in ("float32", "bfloat16"))))


@needs_triton
def test_a_token_routed_alone_or_with_40_others_has_the_same_bits():
    for r in interpret("alone:Q4_K:bfloat16", "alone:MXFP4:float32"):
        assert all(r.values()), r


@needs_triton
def test_the_grouped_ffn_equals_the_per_expert_loop_bit_for_bit():
    """SiLU on Q8_0 experts, gpt-oss's clamped SwiGLU with biases on MXFP4 ones (bfloat16; K-quants: slow)."""
    for r in interpret("ffn:silu-q8_0:bfloat16", "ffn:gpt-oss-mxfp4:bfloat16"):
        assert r["same"] and r["alone"], r


@pytest.mark.slow
@needs_triton
def test_the_grouped_ffn_of_k_quants_equals_the_per_expert_loop():
    for r in interpret("ffn:silu-kquant:float32", "ffn:silu-kquant:bfloat16", "ffn:gpt-oss-mxfp4:float32"):
        assert r["same"] and r["alone"], r


def test_the_grouped_path_declines_experts_it_cannot_group():
    """layer_ffn leaves QExperts' loop the experts it cannot run grouped: an interleaved (CPU) layout, one expert's
    projection of another type than the others' (nothing launches: no Triton needed)."""
    import torch
    from torch import nn

    from offspec.formats import experts as fe
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import experts as gx
    from offspec.formats.modules import QLinear

    q8, q4 = ggml_type("Q8_0").id, ggml_type("Q4_0").id

    def layer(down_types):
        cpu = torch.device("cpu")
        return fe.QExperts([fe.QExpert(QLinear(q8, 64, 32, False, cpu), QLinear(q8, 64, 32, False, cpu),
                                       QLinear(t, 32, 64, False, cpu)) for t in down_types], nn.SiLU())

    x, index, weights = torch.zeros(2, 64), torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2)  # (T, H), (T, k) x2
    counts = torch.tensor([2, 2])  # (E,)
    assert gx.layer_ffn(layer([q8, q4]), x, [0, 1], counts, index, weights) is None
    interleaved = layer([q8, q8])
    interleaved.experts[1].up_proj.interleaved = True
    assert gx.layer_ffn(interleaved, x, [0, 1], counts, index, weights) is None
    assert gx.layer_ffn(interleaved, x, [], counts, index, weights) is None


# --- the checks, run under the interpreter ---------------------------------------------------------------------
def _setup():
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import triton  # noqa: F401  (the interpreter is set up once Triton is imported)
    from helpers.interpreter import use_row_invariant_dot

    use_row_invariant_dot()


def _blocks(rng, name, rows, cols):
    import torch
    from helpers.tiny_gguf import random_blocks

    return torch.from_numpy(random_blocks(rng, name, rows, cols))  # (rows, row_bytes) uint8


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def check_grouped(type_name: str, dtype_name: str) -> dict:
    """Experts of 1, 0, 5 and 17 rows (tiles of 64 rows), then of 1 and 3 (tiles of 16): gate and up (2 parts) with
    biases, and one part without, against linear() of each expert's rows alone."""
    import numpy as np
    import torch

    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import experts as gx
    from offspec.formats.gpu import linear as gl

    dtype, t = getattr(torch, dtype_name), ggml_type(type_name)
    cols, n = SHAPES[type_name], 64
    rng = np.random.default_rng(3)
    same = {}
    for counts in ([1, 0, 5, 17], [1, 3]):
        e = len(counts)
        parts = [[_blocks(rng, type_name, n, cols) for _ in range(e)] for _ in range(2)]  # (n, row_bytes) each
        biases = [[torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(e)] for _ in range(2)]
        x = torch.from_numpy(rng.standard_normal((sum(counts), cols)).astype(np.float32)).to(dtype)  # (R, cols)
        both = gx.grouped_linear(x, counts, parts, t.id, cols, biases)  # (R, 2n)
        one = gx.grouped_linear(x, counts, parts[:1], t.id, cols)  # (R, n)
        start = 0
        for i, c in enumerate(counts):
            rows = x[start : start + c]  # (c, cols)
            for p in range(2):
                want = gl.linear(rows, [(parts[p][i], t.id)], cols, biases[p][i].to(dtype))  # (c, n)
                same[f"{counts}/{i}/part{p}"] = _same(both[start : start + c, p * n : (p + 1) * n], want)
            same[f"{counts}/{i}/nobias"] = _same(one[start : start + c], gl.linear(rows, [(parts[0][i], t.id)], cols))
            start += c
    return {"same": same, "splits": gl.plan_splits(n, cols, [t.id], gl.multiprocessors(torch.device("cpu")))[0]}


def check_alone(type_name: str, dtype_name: str) -> dict:
    """Token 0's row through expert 1: routed alone, and as the 7th of 41 rows of expert 1 after 3 rows of expert 0."""
    import numpy as np
    import torch

    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import experts as gx

    dtype, t = getattr(torch, dtype_name), ggml_type(type_name)
    cols, n = SHAPES[type_name], 64
    rng = np.random.default_rng(4)
    ws = [_blocks(rng, type_name, n, cols) for _ in range(2)]
    x = torch.from_numpy(rng.standard_normal((44, cols)).astype(np.float32)).to(dtype)  # (44, cols)
    alone = gx.grouped_linear(x[9:10], [1], [ws[1:]], t.id, cols)  # (1, n)
    crowd = gx.grouped_linear(x, [3, 41], [ws], t.id, cols)  # (44, n): row 9 is expert 1's 7th
    few = gx.grouped_linear(x[:12], [3, 9], [ws], t.id, cols)  # (12, n): tiles of 16 rows
    return {"crowd": _same(crowd[9:10], alone), "few": _same(few[9:10], alone)}


FFN = {"silu-q8_0": (("Q8_0", "Q8_0", "Q8_0"), 64, 64, None),
       "gpt-oss-mxfp4": (("MXFP4", "MXFP4", "MXFP4"), 64, 64, (1.702, 7.0)),
       "silu-kquant": (("Q4_K", "Q4_K", "Q6_K"), 256, 256, None)}


def check_ffn(family: str, dtype_name: str) -> dict:
    """QExperts' forward (its torch loop, each QLinear a linear() of the Triton kernels) against experts_ffn: 6
    experts, 12 tokens, top 3 (the top-k order not the experts' order), and token 5 alone."""
    import numpy as np
    import torch
    from torch import nn

    from offspec.formats import experts as fe
    from offspec.formats import kernels
    from offspec.formats.ggml import ggml_type
    from offspec.formats.gpu import experts as gx
    from offspec.formats.gpu import linear as gl
    from offspec.formats.modules import QLinear

    names, hidden, inter, swiglu = FFN[family]
    types = tuple(ggml_type(nm).id for nm in names)
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(5)
    made = []
    for _ in range(6):
        trio = []
        for tid, nm, (cols, rows) in zip(types, names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            q = QLinear(tid, cols, rows, swiglu is not None, torch.device("cpu"))
            q.qweight = _blocks(rng, nm, rows, cols)  # (rows, row_bytes)
            if swiglu is not None:
                q.bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32) * 0.1)  # (rows,)
            trio.append(q)
        made.append(fe.QExpert(*trio))
    layer = fe.QExperts(made, nn.SiLU() if swiglu is None else None, swiglu)
    # QExperts' loop on CUDA: no compiled CPU call, each QLinear through linear()
    kernels.compiled = lambda: None
    kernels.linear = lambda x, qweight, type_id, cols, bias=None: gl.linear(x, [(qweight, type_id)], cols, bias)

    tokens, k = 12, 3
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).to(dtype)  # (T, H)
    index = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])  # (T, k) in no particular order
    weights = torch.softmax(torch.randn(tokens, k), dim=-1).to(dtype)  # (T, k)
    want = layer(x, index, weights)  # (T, H)

    def grouped(xx, ii, ww):  # as QExperts' forward calls it on CUDA
        counts = torch.bincount(ii.reshape(-1), minlength=6)  # (E,)
        return gx.layer_ffn(layer, xx, counts.nonzero().reshape(-1).tolist(), counts, ii, ww)

    got = grouped(x, index, weights)
    alone = grouped(x[5:6], index[5:6], weights[5:6])
    return {"same": _same(got, want), "alone": _same(alone, got[5:6]),
            "max_diff": float((got.float() - want.float()).abs().max())}


def main(argv: list[str]) -> None:
    _setup()
    checks = {"grouped": check_grouped, "alone": check_alone, "ffn": check_ffn}
    print(json.dumps([checks[name](*args) for name, *args in (a.split(":") for a in argv)]))


if __name__ == "__main__":
    main(sys.argv[1:])
