"""Batch-invariant low-bit linears on CUDA: an output row's bits never depend on how many rows are computed with it.

`linear(x, [(qweight, type_id), ...], cols, bias)` computes x (M, cols) @ [W0; W1; ...]^T (+ bias) -> (M, sum N) in
x's dtype, the weights given as rows of ggml blocks (several of them: a fused q/k/v or gate/up, the bytes as they
are). One kernel, `_fused`, for every row count: each program decodes its (BN x 32) weight tiles in registers
(blocks.py) and multiplies them at once. What changes with the row count is only how it is tiled and launched:

- rows per program (`Tiles.bm`): 16 up to 16 rows, 64 above (more rows share each decoded weight tile);
- the split over K (`plan_splits`: a function of the weights' shape and the GPU, never of M): up to
  GRID_SPLIT_ROWS rows the splits run side by side (one program each, float32 partials, then `_reduce` adds them
  in split order); above it each program runs its splits one after the other and adds them in the same order.

The arithmetic every row goes through, whichever way it is tiled: the weight values decoded exactly (blocks.py)
and rounded to the compute dtype; for each split s in order, a chain of 32-wide tensor-core products over its K
range in increasing k, starting from zero; the splits' sums added in order to 0.0; the bias added in float32; one
rounding to the output dtype. The products use mma.sync (launch.py sets `DISABLE_MMA_V3` / `_V5` before any kernel
compiles: Hopper's wgmma and Blackwell's tcgen05 work on whole warp groups, and nothing promises they round a row
as mma.sync does), whose rows never interact, and every tiling feeds it the same operand layout (each decodes the
weights from the same bytes, and Triton lays the operands out by the narrowest load they come from: the K order
inside each instruction is then the same too; on the H100 a scratch of bf16 values against the bytes gave two
layouts, and rows that differed). Contraction is off (launch.py): every multiply and add rounds as
written. float32 inputs multiply in IEEE float32 (no TF32). tests/test_gpu_aot.py compiles the launches of 1, 17,
64 and 1,024 rows for sm_80 to sm_90 and compares what they compute.

Every type offspec computes with (ggml.KERNEL_NAMES) has its decoder in blocks.py; the lattice types (IQ1-IQ3) read
their grid from a small device tensor (`lattice`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..dequant import grid_values
from ..ggml import GGMLType, ggml_type
from .blocks import GRID_WIDTH, UNITS, triton
from .launch import Card, card, launch

FEW_ROWS = 16  # up to this many rows: programs of 16 rows; above: of 64
GRID_SPLIT_ROWS = 64  # up to this many rows the K splits run as programs of their own (float32 partials)
PLAN_BN = 64  # weight rows per program: the split plan's unit (every tiling uses it)
REDUCE_BM, REDUCE_BN = 16, 128
DECODE_BN, DECODE_UNITS = 64, 4  # the decode kernel: weight rows x units per program
MAX_SPLIT = 16
PROGRAMS_PER_SM = 2  # the split aims at this many programs per multiprocessor (at few rows)


@dataclass(frozen=True)
class Tiles:
    """How `_fused` is tiled and launched for a row count on a card."""

    bm: int  # rows of x per program
    bn: int  # weight rows per program
    warps: int
    stages: int  # Triton's software pipelining depth (each stage holds a unit's x tiles in shared memory)


def tiles(rows: int, dtype: torch.dtype, chunks: int, gpu: Card) -> Tiles:
    """The tiling of `rows` rows of x in `dtype` against a type of `chunks` 32-value chunks per unit on `gpu`: the
    row tile from the row count, the pipelining depth the largest whose shared memory fits the card (an estimate
    of what Triton allocates: the x tiles of a unit per stage, the accumulator's layout change; the compiled
    kernels also stage weight bytes, and the lattice types their decoded tiles for the layout change: on sm_89 at
    16 rows Q4_K takes 32 KB and IQ2_XXS 52 KB in bfloat16, IQ1_S 72 KB in float32, at 64 rows Q4_K 40 KB and
    IQ2_XXS 52 KB in bfloat16; every configuration is checked against each card, sm_80 to sm_90, by
    tests/test_gpu_aot.py)."""
    bm = 16 if rows <= FEW_ROWS else 64
    elem = torch.empty((), dtype=dtype).element_size()
    stages = 1
    for depth in (3, 2):
        if depth * chunks * bm * 32 * elem + bm * PLAN_BN * 4 <= gpu.max_shared:
            stages = depth
            break
    return Tiles(bm, PLAN_BN, 8 if dtype == torch.float32 and bm > 16 else 4, stages)


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
        """acc (BM, BN) + xt (BM, 32) @ w (BN, 32)^T."""
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

    @triton.jit
    def _splits(x_ptr, rows, table, rm, mmask, nmask, stride_xm, K, KS, s_lo, s_hi, TYPE: tl.constexpr,
                UNIT: tl.constexpr, UBYTES: tl.constexpr, CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                IEEE: tl.constexpr):
        """The splits s_lo .. s_hi - 1 of K (KS wide) of rows rm of x times the BN weight rows at `rows` (each row's
        first byte): each split a chain of 32-wide products from zero over its K range, the splits' sums added in
        order from zero -> (BM, BN) float32. Every kernel's rows go through this one arithmetic."""
        nunits = tl.cdiv(K, UNIT)
        total = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN) the splits' sums, in order
        for s in range(s_lo, s_hi):
            acc = tl.zeros((BM, BN), dtype=tl.float32)  # (BM, BN) this split's chain
            u0 = s * (KS // UNIT)
            u1 = tl.minimum(u0 + KS // UNIT, nunits)
            for u in range(u0, u1):
                blk = rows + u * UBYTES
                for c in tl.static_range(CHUNKS):
                    kk = u * UNIT + c * 32 + tl.arange(0, 32)  # (32,)
                    kmask = kk < K
                    w = chunk(TYPE, blk, c, nmask, kmask, table)  # (BN, 32) float32, exact
                    acc = _mma(acc, _x_tile(x_ptr, rm, mmask, stride_xm, kk, kmask), w, IEEE)
            total += acc
        return total

    # row counts, column offsets and the split plan are not specialized on (Triton would compile a variant for a
    # value of 1 and for multiples of 16): the same compiled kernel for every pass of a tiling
    @triton.jit(do_not_specialize=["M", "N0", "N1", "N2", "C0", "C1", "C2", "NTOT", "KS", "SPLITS"])
    def _fused(x_ptr, w0, w1, w2, table, y_ptr, part_ptr, bias_ptr, M, K, row_bytes, N0, N1, N2, C0, C1, C2, NTOT, KS,
               SPLITS, stride_xm, stride_ym, TYPE: tl.constexpr, UNIT: tl.constexpr, UBYTES: tl.constexpr,
               CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GRID_SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """Program (m tile, n tile, split): rows rm of x times the BN weight rows of tile n (of w0, w1 or w2, which
        land in output columns C0, C1, C2 on), split s over K range [s * KS, (s + 1) * KS). GRID_SPLIT: split
        program_id(2) alone, into float32 partials part (SPLITS, M, NTOT); else every split in order, the result."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
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
        if GRID_SPLIT:
            s_lo = tl.program_id(2)
            s_hi = s_lo + 1
        else:
            s_lo = 0
            s_hi = SPLITS
        total = _splits(x_ptr, rows, table, rm, mmask, nmask, stride_xm, K, KS, s_lo, s_hi, TYPE, UNIT, UBYTES, CHUNKS,
                        BM, BN, IEEE)  # (BM, BN)
        cols = col + rn
        if GRID_SPLIT:
            offs = (s_lo * M + rm).to(tl.int64)[:, None] * NTOT + cols[None, :]
            tl.store(part_ptr + offs, total, mask=mmask[:, None] & nmask[None, :])
        else:
            _finish(total, y_ptr, bias_ptr, rm, mmask, cols, nmask, stride_ym, HAS_BIAS)

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
    def _decode(w_ptr, table, out_ptr, N, K, row_bytes, stride_o, TYPE: tl.constexpr, UNIT: tl.constexpr,
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
                w = chunk(TYPE, rows + u * UBYTES, c, nmask, kmask, table)  # (BN, 32)
                tl.store(dst + kk[None, :], w.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


_LATTICES: dict[tuple, torch.Tensor] = {}  # (type name, device) -> its lattice grid for `chunk`


def lattice(type_name: str, like: torch.Tensor) -> torch.Tensor:
    """The lattice grid `chunk` reads for an IQ1/IQ2/IQ3 type, on like's device: gguf's table (rows of GRID_WIDTH
    values, 1-16 KB) as the bytes of its int8 values, made once per device (a launch never copies it again, and a
    CUDA graph's warm-up call makes it before the capture); for any other type `like` itself, never read."""
    if type_name not in GRID_WIDTH:
        return like
    key = (type_name, like.device)
    found = _LATTICES.get(key)
    if found is None:
        values = grid_values(type_name)  # (rows, GRID_WIDTH) float32 small integers
        assert values.shape[1] == GRID_WIDTH[type_name], (type_name, values.shape)
        found = _LATTICES[key] = torch.from_numpy(values.astype(np.int8).reshape(-1)).view(torch.uint8).to(like.device)
    return found


def available() -> Optional[str]:
    """None when these kernels can run, else why not."""
    return None if triton is not None else "Triton is not installed (pip install triton)"


@functools.lru_cache(maxsize=None)
def _ggml(type_id: int) -> GGMLType:
    return ggml_type(type_id)


def _unit(type_id: int) -> tuple[int, int, int]:
    """(values, bytes, chunks of 32) of the type's unit: its block, or 32 values of a float type."""
    return UNITS[_ggml(type_id).name]


def multiprocessors(device: torch.device) -> int:
    return card(device).sms


def plan_splits(ntot: int, cols: int, type_ids: Sequence[int], sms: int) -> tuple[int, int]:
    """(splits, values per split) of a (ntot, cols) weight group: enough programs for `sms` multiprocessors at few
    rows, each split a whole number of every type's units. A function of the shapes and the GPU, never of the row
    count."""
    unit = max(_unit(t)[0] for t in type_ids)  # 32 or 256: a multiple of every unit in the group
    units = -(-cols // unit)
    tiles_n = -(-ntot // PLAN_BN)
    want = -(-PROGRAMS_PER_SM * sms // tiles_n)
    splits = max(1, min(want, MAX_SPLIT, units))
    per = -(-units // splits)
    return -(-units // per), per * unit


def decode(qweight: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, row_bytes) ggml blocks -> (N, cols) values in `dtype` (exact, rounded once to dtype)."""
    n = qweight.shape[0]
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()  # rows at a fixed stride
    out = torch.empty((n, cols), dtype=dtype, device=qweight.device)  # (N, cols)
    if n == 0:
        return out
    values, nbytes, chunks = _unit(type_id)
    grid = (triton.cdiv(n, DECODE_BN), triton.cdiv(triton.cdiv(cols, values), DECODE_UNITS))
    name = _ggml(type_id).name
    launch(_decode, grid, qweight, lattice(name, qweight), out, n, cols, qweight.stride(0), out.stride(0), TYPE=name,
           UNIT=values, UBYTES=nbytes, CHUNKS=chunks, BN=DECODE_BN, UNITS=DECODE_UNITS)
    return out


def linear(x2d: torch.Tensor, weights: Sequence[tuple[torch.Tensor, int]], cols: int,
           bias: Optional[torch.Tensor] = None, rows_hint: Optional[int] = None) -> torch.Tensor:
    """x2d (M, cols) @ [W0; W1; ...]^T (+ bias (sum N,)) -> (M, sum N) in x2d's dtype; each W (N_i, row_bytes) ggml
    blocks of its type. CUDA tensors, or CPU tensors under Triton's interpreter (tests). `rows_hint`: tile as for
    that many rows (tests: every tiling at any M; the bits are the same either way)."""
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    weights = [(w if w.stride(-1) == 1 else w.contiguous(), t) for w, t in weights]
    m, ntot = x2d.shape[0], sum(w.shape[0] for w, _ in weights)
    y = torch.empty((m, ntot), dtype=x2d.dtype, device=x2d.device)  # (M, sum N)
    if m == 0 or ntot == 0:
        return y
    gpu = card(x2d.device)
    splits, ks = plan_splits(ntot, cols, [t for _, t in weights], gpu.sms)
    rows = rows_hint if rows_hint is not None else m
    part = None  # the splits side by side: (splits, M, sum N) float32 partials
    if splits > 1 and rows <= GRID_SPLIT_ROWS:
        part = torch.empty((splits, m, ntot), dtype=torch.float32, device=y.device)
    offsets = [0]
    for w, _ in weights:
        offsets.append(offsets[-1] + w.shape[0])
    by_type: dict[int, list[int]] = {}
    for i, (_, t) in enumerate(weights):
        by_type.setdefault(t, []).append(i)
    for t, members in by_type.items():
        for g in range(0, len(members), 3):  # up to 3 weights of one type per launch
            group = members[g : g + 3]
            _launch_fused(x2d, [weights[i][0] for i in group], _ggml(t).name, _unit(t), cols, bias, y, part,
                          [offsets[i] for i in group], splits, ks, rows, gpu)
    if part is not None:
        grid = (triton.cdiv(m, REDUCE_BM), triton.cdiv(ntot, REDUCE_BN))
        launch(_reduce, grid, part, y, bias if bias is not None else y, m, ntot, splits, y.stride(0), BM=REDUCE_BM,
               BN=REDUCE_BN, HAS_BIAS=bias is not None)
    return y


def _launch_fused(x2d, ws, type_name, unit, cols, bias, y, part, starts, splits, ks, rows, gpu) -> None:
    """One `_fused` launch over up to 3 weights of one type, landing in y's columns starts[i] on; the splits side
    by side into `part` where it is given, else one after the other in each program."""
    m, ntot = y.shape
    values, nbytes, chunks = unit
    tile = tiles(rows, x2d.dtype, chunks, gpu)
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    cs = list(starts) + [0] * (3 - len(ws))
    ws = list(ws) + [ws[0]] * (3 - len(ws))
    grid_split = part is not None
    grid = (triton.cdiv(m, tile.bm), sum(triton.cdiv(n, tile.bn) for n in ns), splits if grid_split else 1)
    launch(_fused, grid, x2d, ws[0], ws[1], ws[2], lattice(type_name, ws[0]), y, part if grid_split else y,
           bias if bias is not None else y, m, cols, ws[0].stride(0), ns[0], ns[1], ns[2], cs[0], cs[1], cs[2], ntot,
           ks, splits, x2d.stride(0), y.stride(0), TYPE=type_name, UNIT=values, UBYTES=nbytes, CHUNKS=chunks,
           BM=tile.bm, BN=tile.bn, GRID_SPLIT=grid_split, HAS_BIAS=bias is not None, IEEE=x2d.dtype == torch.float32,
           num_warps=tile.warps, num_stages=tile.stages)

