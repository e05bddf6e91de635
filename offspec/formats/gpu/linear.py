"""Batch-invariant low-bit linears on CUDA: an output row's bits never depend on how many rows are computed with it.

`linear(x, [(qweight, type_id), ...], cols, bias)` computes x (M, cols) @ [W0; W1; ...]^T (+ bias) -> (M, sum N) in
x's dtype, the weights given as rows of ggml blocks (several of them: a fused q/k/v or gate/up, the bytes as they
are). One arithmetic, two ways to run it:

- few rows (M <= FUSED_MAX_ROWS: the draft, the walk, small trees): `_fused` decodes each weight tile in registers
  and multiplies it at once (one kernel per type, up to 3 weights each), split over K in `splits` parts that write
  float32 partials; `_reduce` adds them in split order, adds the bias and rounds.
- many rows: `_decode` writes each weight once into a scratch in the compute dtype (bands of SCRATCH_BYTES), then
  `_gemm` multiplies with the same K order and sums the same splits in the same order inside one program.

The arithmetic both share, per output (m, n): the weight values decoded exactly (blocks.py) and rounded to the
compute dtype; for each split s in order, a chain of 32-wide tensor-core products over its K range in increasing k,
starting from zero; the splits' sums added in order to 0.0; the bias added in float32; one rounding to the output
dtype. The split count depends on the weights' shape and the GPU's multiprocessor count, never on M. The products
use mma.sync (`DISABLE_MMA_V3` / `_V5` are set before any kernel compiles): its rows never interact, so a tile of
16 rows and one of 128 give each row the same bits (Hopper's wgmma would be chosen for the larger tiles otherwise,
and nothing promises the two instructions round alike). float32 inputs multiply in IEEE float32 (no TF32).

A ggml type with no Triton decoder (an IQ type, until blocks.py has one) is decoded once per call by torch
(dequant.py) into the same scratch, then `_gemm`: still one arithmetic at every row count.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch

from ..dequant import dequantize
from ..ggml import GGMLType, ggml_type
from .blocks import UNITS, triton

# the products' instruction: mma.sync everywhere (see above); read by Triton when it compiles, and part of its cache
# key, so it is set before the first kernel of this process compiles
os.environ["DISABLE_MMA_V3"] = "1"
os.environ["DISABLE_MMA_V5"] = "1"

FUSED_MAX_ROWS = 64  # up to this many rows the fused kernel decodes each weight once (one tile of rows)
FUSED_BN = 64  # weight rows per fused program
GEMM_BM, GEMM_BN = 128, 128  # the scratch GEMM's tile
GEMM_WARPS = 8  # two (128, 128) float32 accumulators (a split's and the total) in 256 threads' registers
REDUCE_BM, REDUCE_BN = 16, 128
DECODE_BN, DECODE_UNITS = 64, 4  # the decode kernel: weight rows x units per program
SCRATCH_BYTES = 128 * 2**20  # the largest decoded band of weight rows (the placement charges it: WORKSPACE_BYTES)
WORKSPACE_BYTES = SCRATCH_BYTES  # device memory the linears take besides their inputs and outputs (plus partials)
MAX_SPLIT = 16
PROGRAMS_PER_SM = 2  # the fused kernel's split aims at this many programs per multiprocessor
INTERPRETER_SMS = 4  # Triton's interpreter (tests): a small "GPU", so that small weights split too

if triton is not None:
    import triton.language as tl

    from .blocks import chunk

    @triton.jit
    def _x_tile(x_ptr, rm, mmask, stride_xm, kk, kmask):
        """(BM, 32) activations x[rm, kk] (0 outside the masks)."""
        return tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                       other=0.0)

    @triton.jit
    def _mma(acc, xt, w, IEEE: tl.constexpr):
        """acc (BM, BN) + xt (BM, 32) @ w (BN, 32)^T: the chained product both paths use."""
        if IEEE:
            return tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)

    @triton.jit
    def _finish(total, y_ptr, bias_ptr, rm, mmask, cols, nmask, stride_ym, HAS_BIAS: tl.constexpr):
        """Add the bias (float32) to the split-ordered sum and store it rounded to y's dtype."""
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + cols[None, :], total.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    # row counts and column offsets are not specialized on (Triton would compile a variant for M == 1 and for M a
    # multiple of 16): one compiled kernel per type and tile serves every pass
    @triton.jit(do_not_specialize=["M", "N0", "N1", "N2", "C0", "C1", "C2", "NTOT", "KS"])
    def _fused(x_ptr, w0, w1, w2, y_ptr, part_ptr, bias_ptr, M, K, row_bytes, N0, N1, N2, C0, C1, C2, NTOT, KS,
               stride_xm, stride_ym, TYPE: tl.constexpr, UNIT: tl.constexpr, UBYTES: tl.constexpr,
               CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DIRECT: tl.constexpr,
               HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """Program (m tile, n tile, split s): rows rm of x times the BN weight rows of tile n (of w0, w1 or w2, which
        land in output columns C0, C1, C2 on) over K range [s * KS, (s + 1) * KS). DIRECT (one split): the result;
        else float32 partials part (splits, M, NTOT)."""
        pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t0 = tl.cdiv(N0, BN)
        t1 = t0 + tl.cdiv(N1, BN)
        if pid_n < t0:
            w_ptr, tile, n_w, col = w0, pid_n, N0, C0
        elif pid_n < t1:
            w_ptr, tile, n_w, col = w1, pid_n - t0, N1, C1
        else:
            w_ptr, tile, n_w, col = w2, pid_n - t1, N2, C2
        rm = pid_m * BM + tl.arange(0, BM)  # (BM,)
        mmask = rm < M
        rn = tile * BN + tl.arange(0, BN)  # (BN,) rows of this weight
        nmask = rn < n_w
        rows = w_ptr + rn.to(tl.int64) * row_bytes  # (BN,) each row's first byte
        nunits = tl.cdiv(K, UNIT)
        u0 = s * (KS // UNIT)
        u1 = tl.minimum(u0 + KS // UNIT, nunits)
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN)
        for u in range(u0, u1):
            blk = rows + u * UBYTES
            for c in tl.static_range(CHUNKS):
                kk = u * UNIT + c * 32 + tl.arange(0, 32)  # (32,)
                kmask = kk < K
                w = chunk(TYPE, blk, c, nmask, kmask)  # (BN, 32) float32, exact
                acc = _mma(acc, _x_tile(x_ptr, rm, mmask, stride_xm, kk, kmask), w, IEEE)
        cols = col + rn
        if DIRECT:
            total = tl.zeros((BM, BN), dtype=tl.float32) + acc
            _finish(total, y_ptr, bias_ptr, rm, mmask, cols, nmask, stride_ym, HAS_BIAS)
        else:
            offs = (s * M + rm).to(tl.int64)[:, None] * NTOT + cols[None, :]
            tl.store(part_ptr + offs, acc, mask=mmask[:, None] & nmask[None, :])

    @triton.jit(do_not_specialize=["M", "NTOT", "SPLITS"])
    def _reduce(part_ptr, y_ptr, bias_ptr, M, NTOT, SPLITS, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
                HAS_BIAS: tl.constexpr):
        """y = (0.0 + part[0] + part[1] + ... + bias) in y's dtype: the splits in order."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mmask, nmask = rm < M, rn < NTOT
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in range(SPLITS):
            offs = (s * M + rm).to(tl.int64)[:, None] * NTOT + rn[None, :]
            total += tl.load(part_ptr + offs, mask=mmask[:, None] & nmask[None, :], other=0.0)
        _finish(total, y_ptr, bias_ptr, rm, mmask, rn, nmask, stride_ym, HAS_BIAS)

    @triton.jit(do_not_specialize=["N"])
    def _decode(w_ptr, out_ptr, N, K, row_bytes, stride_o, TYPE: tl.constexpr, UNIT: tl.constexpr,
                UBYTES: tl.constexpr, CHUNKS: tl.constexpr, BN: tl.constexpr, UNITS: tl.constexpr):
        """out (N, K) = the decoded weight rows in out's dtype (one pass over the blocks)."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = rn < N
        rows = w_ptr + rn.to(tl.int64) * row_bytes
        dst = out_ptr + rn.to(tl.int64)[:, None] * stride_o
        u0 = tl.program_id(1) * UNITS
        u1 = tl.minimum(u0 + UNITS, tl.cdiv(K, UNIT))
        for u in range(u0, u1):
            for c in tl.static_range(CHUNKS):
                kk = u * UNIT + c * 32 + tl.arange(0, 32)
                kmask = kk < K
                w = chunk(TYPE, rows + u * UBYTES, c, nmask, kmask)  # (BN, 32)
                tl.store(dst + kk[None, :], w.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])

    @triton.jit(do_not_specialize=["M", "NB", "KS", "SPLITS"])
    def _gemm(x_ptr, w_ptr, y_ptr, bias_ptr, M, NB, K, KS, SPLITS, stride_xm, stride_w, stride_ym, UNIT: tl.constexpr,
              CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """y (M, NB) = x @ w^T (+ bias), w (NB, K) decoded values: the fused kernel's splits and K order, the splits
        summed in order in registers."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mmask, nmask = rm < M, rn < NB
        rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w  # (BN, 1)
        nunits = tl.cdiv(K, UNIT)
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in range(SPLITS):
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            u0 = s * (KS // UNIT)
            u1 = tl.minimum(u0 + KS // UNIT, nunits)
            for u in range(u0, u1):
                for c in tl.static_range(CHUNKS):
                    kk = u * UNIT + c * 32 + tl.arange(0, 32)
                    kmask = kk < K
                    w = tl.load(rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # (BN, 32)
                    acc = _mma(acc, _x_tile(x_ptr, rm, mmask, stride_xm, kk, kmask), w, IEEE)
            total += acc
        _finish(total, y_ptr, bias_ptr, rm, mmask, rn, nmask, stride_ym, HAS_BIAS)


def available() -> Optional[str]:
    """None when these kernels can run, else why not."""
    return None if triton is not None else "Triton is not installed (pip install triton)"


def decodes(type_id: int) -> bool:
    """Whether blocks.py decodes this type on the GPU (others: torch, once per call, into the scratch)."""
    return _ggml(type_id).name in UNITS


@functools.lru_cache(maxsize=None)
def _ggml(type_id: int) -> GGMLType:
    return ggml_type(type_id)


def _unit(type_id: int) -> tuple[int, int, int]:
    """(values, bytes, chunks of 32) of the type's unit: its block, or 32 values of a float type; a type torch
    decodes: its block."""
    t = _ggml(type_id)
    if t.name in UNITS:
        return UNITS[t.name]
    return t.block, t.nbytes, max(1, t.block // 32)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def plan_splits(ntot: int, cols: int, type_ids: Sequence[int], sms: int) -> tuple[int, int]:
    """(splits, values per split) of a (ntot, cols) weight group: enough programs for `sms` multiprocessors in the
    fused kernel, each split a whole number of every type's units. A function of the shapes and the GPU, never of
    the row count."""
    unit = max(_unit(t)[0] for t in type_ids)  # 32 or 256: a multiple of every unit in the group
    units = -(-cols // unit)
    tiles = -(-ntot // FUSED_BN)
    want = -(-PROGRAMS_PER_SM * sms // tiles)
    splits = max(1, min(want, MAX_SPLIT, units))
    per = -(-units // splits)
    return -(-units // per), per * unit


def decode(qweight: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, row_bytes) ggml blocks -> (N, cols) values in `dtype` (exact, rounded once to dtype) into `out`."""
    n = qweight.shape[0]
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()  # rows at a fixed stride
    if out is None:
        out = torch.empty((n, cols), dtype=dtype, device=qweight.device)  # (N, cols)
    if n == 0:
        return out
    if not decodes(type_id):  # torch's exact decode, then one rounding (the hook for types blocks.py lacks)
        out.copy_(dequantize(qweight, type_id, cols))
        return out
    values, nbytes, chunks = _unit(type_id)
    grid = (triton.cdiv(n, DECODE_BN), triton.cdiv(triton.cdiv(cols, values), DECODE_UNITS))
    _decode[grid](qweight, out, n, cols, qweight.stride(0), out.stride(0), TYPE=_ggml(type_id).name, UNIT=values,
                  UBYTES=nbytes, CHUNKS=chunks, BN=DECODE_BN, UNITS=DECODE_UNITS)
    return out


def linear(x2d: torch.Tensor, weights: Sequence[tuple[torch.Tensor, int]], cols: int,
           bias: Optional[torch.Tensor] = None, rows_hint: Optional[int] = None) -> torch.Tensor:
    """x2d (M, cols) @ [W0; W1; ...]^T (+ bias (sum N,)) -> (M, sum N) in x2d's dtype; each W (N_i, row_bytes) ggml
    blocks of its type. CUDA tensors, or CPU tensors under Triton's interpreter (tests). `rows_hint`: choose the
    path as for that many rows (tests: both paths at any M; the bits are the same either way)."""
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    weights = [(w if w.stride(-1) == 1 else w.contiguous(), t) for w, t in weights]
    m, ntot = x2d.shape[0], sum(w.shape[0] for w, _ in weights)
    y = torch.empty((m, ntot), dtype=x2d.dtype, device=x2d.device)  # (M, sum N)
    if m == 0 or ntot == 0:
        return y
    type_ids = [t for _, t in weights]
    splits, ks = plan_splits(ntot, cols, type_ids, multiprocessors(x2d.device))
    ieee = x2d.dtype == torch.float32
    few = (rows_hint if rows_hint is not None else m) <= FUSED_MAX_ROWS
    if few and all(decodes(t) for t in type_ids):
        _fused_linear(x2d, weights, cols, bias, y, splits, ks, ieee)
    else:
        _scratch_linear(x2d, weights, cols, bias, y, splits, ks, ieee)
    return y


def _fused_linear(x2d, weights, cols, bias, y, splits, ks, ieee) -> None:
    m, ntot = y.shape
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    part = None if splits == 1 else torch.empty((splits, m, ntot), dtype=torch.float32, device=y.device)
    offsets, col = [], 0
    for w, _ in weights:
        offsets.append(col)
        col += w.shape[0]
    by_type: dict[int, list[int]] = {}
    for i, (_, t) in enumerate(weights):
        by_type.setdefault(t, []).append(i)
    for t, members in by_type.items():
        values, nbytes, chunks = _unit(t)
        for g in range(0, len(members), 3):  # up to 3 weights of one type per launch
            group = members[g : g + 3]
            ws = [weights[i][0] for i in group] + [weights[group[0]][0]] * (3 - len(group))
            ns = [weights[i][0].shape[0] for i in group] + [0] * (3 - len(group))
            cs = [offsets[i] for i in group] + [0] * (3 - len(group))
            tiles = sum(triton.cdiv(n, FUSED_BN) for n in ns)
            grid = (triton.cdiv(m, bm), tiles, splits)
            _fused[grid](x2d, ws[0], ws[1], ws[2], y, part if part is not None else y,
                         bias if bias is not None else y, m, cols, ws[0].stride(0), ns[0], ns[1], ns[2], cs[0], cs[1],
                         cs[2], ntot, ks, x2d.stride(0), y.stride(0), TYPE=_ggml(t).name, UNIT=values, UBYTES=nbytes,
                         CHUNKS=chunks, BM=bm, BN=FUSED_BN, DIRECT=part is None, HAS_BIAS=bias is not None,
                         IEEE=ieee)
    if part is not None:
        grid = (triton.cdiv(m, REDUCE_BM), triton.cdiv(ntot, REDUCE_BN))
        _reduce[grid](part, y, bias if bias is not None else y, m, ntot, splits, y.stride(0), BM=REDUCE_BM,
                      BN=REDUCE_BN, HAS_BIAS=bias is not None)


def _scratch_linear(x2d, weights, cols, bias, y, splits, ks, ieee) -> None:
    """Decode bands of weight rows into a scratch, then the GEMM of each band."""
    m, ntot = y.shape
    elem = x2d.element_size()
    band = max(GEMM_BN, SCRATCH_BYTES // max(1, cols * elem) // GEMM_BN * GEMM_BN)
    band = min(band, ntot)
    scratch = torch.empty((band, cols), dtype=x2d.dtype, device=x2d.device)  # (band, cols) decoded rows
    unit = max(_unit(t)[0] for t in (t for _, t in weights))
    chunks = unit // 32
    starts, col = [], 0
    for w, _ in weights:
        starts.append(col)
        col += w.shape[0]
    for b0 in range(0, ntot, band):
        b1 = min(ntot, b0 + band)
        for (w, t), c0 in zip(weights, starts):  # the weights' rows within this band
            lo, hi = max(b0, c0), min(b1, c0 + w.shape[0])
            if lo < hi:
                decode(w[lo - c0 : hi - c0], t, cols, x2d.dtype, out=scratch[lo - b0 : hi - b0])
        nb = b1 - b0
        out = y[:, b0:b1]
        grid = (triton.cdiv(m, GEMM_BM), triton.cdiv(nb, GEMM_BN))
        _gemm[grid](x2d, scratch, out, bias[b0:b1] if bias is not None else out, m, nb, cols, ks, splits,
                    x2d.stride(0), scratch.stride(0), out.stride(0), UNIT=unit, CHUNKS=chunks, BM=GEMM_BM,
                    BN=GEMM_BN, HAS_BIAS=bias is not None, IEEE=ieee, num_warps=GEMM_WARPS)
