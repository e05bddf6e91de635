"""Tree attention on CUDA with native grouped-query heads: no dense (q, kv) mask, no repeat_kv, the same bits for a
token in a tree and the same token decoded alone.

A pass's keys are the committed prefix, slots [0, P), which every query sees, and its own tail, slots [P, kv_len),
of which each query sees some (itself and its ancestors in a tree; itself and the tokens before it in a prefill
chunk). `TailKeys.of(visible, P)` lists each query's visible tail slots in slot order once per pass (a few small
torch operations; every layer reuses them).

A query attends over its visible keys in slot order: the prefix, then its tail keys. That sequence is the same when
the token sits in a tree (prefix T, then its ancestors) and when it is decoded alone after its ancestors were
committed (prefix T + depth). So the softmax runs over that sequence in chunks of BLOCK_N keys counted from its
start, with an online softmax whose every step is a function of one row: scores and values by tensor-core products
(rows never interact), the row maximum (exact), the row sum as one more product (p times a column of ones).

- `_prefix`: the chunks that lie wholly in the prefix, for tiles of (query, head) rows of one KV head that share
  every key load (the FlashAttention part); it leaves each row's running state (max, sum, accumulator) in float32.
- `_tail`: per query and KV head (its group of heads as the rows), the remaining chunks: the prefix's last partial
  chunk followed by the query's gathered tail keys; then it normalizes and writes the output.

The two parts continue one chain, so where a pass splits the chain (P) does not change a row's bits. They are two
kernels, so both are compiled without contraction (launch.py): with it, the PTX assembler fused `s * scale - max`
into one fma in `_prefix` (whose key mask is constant) and not in `_tail`, and a row's chain rounded differently
depending on where the pass split it (the float32 tree-node failure on an H100; tests/test_gpu_aot.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .blocks import triton
from .launch import card, launch

BLOCK_N = 64  # keys per chunk of the softmax (the chain's granularity: the same in every pass)
PREFIX_ROWS = (64, 32, 16)  # (query, head) rows per program of the prefix part: the most the card's memory allows
LOG2E = 1.4426950408889634

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _step(q, k, v, valid, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, BN: tl.constexpr):
        """One chunk of the online softmax for rows q (R, D) over keys k, values v (BN, D), valid (BN,) or (R, BN):
        returns the new (m_i, l_i, acc) of each row, from that row's values alone."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid, s * qk_scale, float("-inf"))  # (R, BN) scores in log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None]).to(v.dtype)  # (R, BN)
        ones = tl.full((BN, 16), 1.0, v.dtype)
        if IEEE:
            row_sum = tl.dot(p, ones, input_precision="ieee")
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            row_sum = tl.dot(p, ones)
            acc = tl.dot(p, v, acc * alpha[:, None])
        l_i = l_i * alpha + tl.max(row_sum, axis=1)  # every column of row_sum is the row's sum
        return m_new, l_i, acc

    # the row count and the caches' capacity are not specialized on (a capacity divisible by 16 or not would be
    # another compiled kernel; the warm-up's probe launches the kernels a model's passes will)
    @triton.jit(do_not_specialize=["M", "cap"])
    def _prefix(q_ptr, k_ptr, v_ptr, prefix_ptr, m_ptr, l_ptr, acc_ptr, M, cap, qk_scale,
                H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                IEEE: tl.constexpr):
        """Rows r = (query r // G, head kvh * G + r % G) of tile pid over the prefix's whole chunks."""
        kvh = tl.program_id(1)
        r = tl.program_id(0) * R + tl.arange(0, R)  # (R,)
        rmask = r < M * G
        qi = (r // G).to(tl.int64)
        head = kvh * G + r % G
        d = tl.arange(0, D)
        q = tl.load(q_ptr + ((qi * H + head) * D)[:, None] + d[None, :], mask=rmask[:, None], other=0.0)  # (R, D)
        whole = tl.load(prefix_ptr) // BN * BN
        kv = kvh.to(tl.int64) * cap * D
        m_i = tl.full((R,), float("-inf"), tl.float32)
        l_i = tl.zeros((R,), tl.float32)
        acc = tl.zeros((R, D), tl.float32)
        n = tl.arange(0, BN)
        for start in range(0, whole, BN):
            offs = kv + (start + n).to(tl.int64)[:, None] * D + d[None, :]  # (BN, D)
            k = tl.load(k_ptr + offs)
            v = tl.load(v_ptr + offs)
            m_i, l_i, acc = _step(q, k, v, (n < BN)[None, :], m_i, l_i, acc, qk_scale, IEEE, BN)
        state = (qi * H + head)  # (R,)
        tl.store(m_ptr + state, m_i, mask=rmask)
        tl.store(l_ptr + state, l_i, mask=rmask)
        tl.store(acc_ptr + state[:, None] * D + d[None, :], acc, mask=rmask[:, None])

    @triton.jit(do_not_specialize=["cap", "stride_g"])
    def _tail(q_ptr, k_ptr, v_ptr, prefix_ptr, gather_ptr, count_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, cap, stride_g,
              qk_scale, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
              IEEE: tl.constexpr):
        """Query qi, KV head kvh (its G heads as rows): the chunks from the prefix's last whole one on, over the
        query's key sequence (prefix slots, then its gathered tail slots), then out = acc / l."""
        qi = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, GP)
        gmask = g < G
        head = kvh * G + g
        d = tl.arange(0, D)
        state = qi * H + head  # (GP,)
        q = tl.load(q_ptr + (state * D)[:, None] + d[None, :], mask=gmask[:, None], other=0.0)  # (GP, D)
        m_i = tl.load(m_ptr + state, mask=gmask, other=0.0)
        l_i = tl.load(l_ptr + state, mask=gmask, other=0.0)
        acc = tl.load(acc_ptr + (state * D)[:, None] + d[None, :], mask=gmask[:, None], other=0.0)
        prefix = tl.load(prefix_ptr)
        end = prefix + tl.load(count_ptr + qi)  # the query's sequence: prefix + its visible tail keys
        kv = kvh.to(tl.int64) * cap * D
        n = tl.arange(0, BN)
        for start in range(prefix // BN * BN, end, BN):
            c = start + n  # (BN,) positions in the query's sequence
            valid = c < end
            tail = tl.load(gather_ptr + qi * stride_g + (c - prefix), mask=valid & (c >= prefix), other=0)
            slot = tl.where(c < prefix, c, tail).to(tl.int64)
            offs = kv + slot[:, None] * D + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _step(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, IEEE, BN)
        out = acc / l_i[:, None]
        tl.store(o_ptr + (state * D)[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


class TailKeys(NamedTuple):
    """A pass's attention pattern: every query sees slots [0, prefix); query i also sees tail slots
    gather[i, :count[i]] (in slot order)."""

    prefix: torch.Tensor  # (1,) int32 on the device: P
    gather: torch.Tensor  # (M, L) int32 slots, L = kv_len - P (the rest is padding)
    count: torch.Tensor  # (M,) int32

    @classmethod
    def of(cls, visible: torch.Tensor, prefix: int) -> "TailKeys":
        """From the pass's (M, kv_len) bool `visible`, whose first `prefix` columns are all True (the committed
        tokens: the runner's invariant)."""
        tail = visible[:, prefix:]  # (M, L) bool
        m, length = tail.shape
        device = visible.device
        count = tail.sum(dim=1, dtype=torch.int32)  # (M,)
        position = tail.cumsum(dim=1) - 1  # (M, L) index of each visible slot among the row's visible ones
        gather = torch.zeros((m, length + 1), dtype=torch.int32, device=device)  # (M, L + 1); column L: the rest
        slots = torch.arange(prefix, prefix + length, dtype=torch.int32, device=device).expand(m, length)
        gather.scatter_(1, torch.where(tail, position, length), slots)
        prefix_t = torch.full((1,), prefix, dtype=torch.int32, device=device)
        return cls(prefix_t, gather[:, :length], count)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _shared(rows: int, d: int, block_n: int, elem: int, depth: int) -> int:
    """An upper bound of the shared memory of a program of `rows` query rows pipelined `depth` deep: a chunk's
    keys and values, the rows' queries and scores (layout changes), and a chunk's keys and values per further stage
    (checked against the compiled kernels for sm_80 to sm_90 by tests/test_gpu_aot.py)."""
    return (2 * block_n * d + rows * block_n + rows * d) * elem + (depth - 1) * 2 * block_n * d * elem


def stages(rows: int, d: int, block_n: int, elem: int, max_shared: int) -> int:
    """The deepest pipelining (3, 2 or 1) whose shared memory fits a card's `max_shared`."""
    return next((depth for depth in (3, 2) if _shared(rows, d, block_n, elem, depth) <= max_shared), 1)


def tiles(d: int, block_n: int, elem: int, max_shared: int) -> tuple[int, int]:
    """(rows, stages) of the prefix part on a card: the most rows whose program fits (float32 heads of 128 do not
    at 64 rows on a 99 KB card), then the deepest pipelining that does. Rows never interact, so neither changes a
    row's bits."""
    rows = next((r for r in PREFIX_ROWS if _shared(r, d, block_n, elem, 1) <= max_shared), PREFIX_ROWS[-1])
    return rows, stages(rows, d, block_n, elem, max_shared)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: TailKeys, scale: float
           ) -> torch.Tensor:
    """q (M, H, D) rotated queries; caches (Hkv, capacity, D) -> (M, H * D) attention outputs in q's dtype."""
    block_n = BLOCK_N  # read at the call: tests shrink it to cross chunk boundaries with small caches
    m, heads, d = q.shape
    kv_heads, cap = k_cache.shape[0], k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty((m, heads * d), dtype=q.dtype, device=q.device)  # (M, H * D)
    if m == 0:
        return out
    q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and heads % kv_heads == 0
    row_max = torch.empty((m, heads), dtype=torch.float32, device=q.device)  # (M, H) running state
    row_sum = torch.empty((m, heads), dtype=torch.float32, device=q.device)
    acc = torch.empty((m, heads, d), dtype=torch.float32, device=q.device)  # (M, H, D)
    ieee = q.dtype == torch.float32
    qk_scale = float(scale) * LOG2E
    gather = keys.gather if keys.gather.shape[1] else keys.gather.new_zeros((m, 1))
    gpu, elem = card(q.device), q.element_size()
    rows, prefix_stages = tiles(d, block_n, elem, gpu.max_shared)
    launch(_prefix, (triton.cdiv(m * group, rows), kv_heads), q, k_cache, v_cache, keys.prefix, row_max, row_sum,
           acc, m, cap, qk_scale, H=heads, G=group, D=d, R=rows, BN=block_n, IEEE=ieee, num_stages=prefix_stages)
    gp = max(16, _pow2(group))
    launch(_tail, (m, kv_heads), q, k_cache, v_cache, keys.prefix, gather, keys.count, row_max, row_sum, acc, out,
           cap, gather.stride(0), qk_scale, H=heads, G=group, GP=gp, D=d, BN=block_n, IEEE=ieee,
           num_stages=stages(gp, d, block_n, elem, gpu.max_shared))
    return out
