"""A mixture's routed experts on CUDA in a few launches: each projection of every routed expert in one grouped
launch, with the bits `linear()` gives each expert's rows alone.

`grouped_linear(x, counts, parts, type_id, cols, biases)`: x (R, cols) holds the routed experts' rows one expert
after the other (`counts[i]` rows of routed expert i), and each part p (up to MAX_PARTS: an expert's gate and up)
gives every routed expert's (N, row_bytes) ggml blocks; the result (R, PARTS * N) has rows
x[o_i : o_i + counts[i]] @ W_{p,i}^T in part p's columns. The experts' blocks stay where they are (offspec keeps
each expert's gate, up and down together: a QLinear's `qweight`, a view into a layer payload or an expert cache
slot, offspec/offload/experts.py): the launch reads them through a (PARTS, E) table of their addresses. One
program is (row tile of one expert, BN weight rows of one part): the row map (tiles, 3) names each tile's expert and
rows, made on the host from the counts (QExperts knows them on the host already: it picks its experts there); the
table and the map reach the device in one int64 copy a launch.

The arithmetic of a row is `linear._fused`'s, term for term: the same decoders (blocks.py), the same tiles (Tiles
and the split plan of that weight alone: `plan_splits(N, cols, [type])`, never of the row count), the splits in
order inside each program (`linear()`'s path above GRID_SPLIT_ROWS rows; at fewer rows it runs them as programs of
their own and `_reduce` adds them in the same order from 0.0: the same sums), the bias added in float32, one
rounding. So a (token, expert) row has the bits `linear()` gives it alone, whether 1 or 40 tokens went to that
expert (tests/test_gpu_experts.py; tests/test_gpu_aot.py compares the compiled arithmetic with linear's).

`experts_ffn(...)`: a layer's routed experts as QExperts' per-expert loop computes them (formats/experts.py), in 2 or
3 grouped launches and a few torch steps: the (token, k) pairs sorted by expert (stable: tokens ascending within an
expert, as `nonzero` gives them), gate and up grouped (one launch where they have one type and shape), the
activation (QExperts' own `_glu` over all the rows at once: torch's elementwise kernels compute each element alone
on CUDA; on a CPU, where a thread's range ends off a vector's width its tail takes the scalar path: tensors of up
to 32,768 values run in one range, the tests' sizes), down grouped, each row times
its routing weight in the dtype, and each token's contributions added to 0 in ascending expert order (the order of
QExperts' `index_add_` per expert): a gather and an add per slot of the top k, no atomics. `layer_ffn(layer, ...)`
runs a QExperts layer's routed experts so where they can be grouped (their blocks on x's device, one type a
projection), else returns None and QExperts' loop runs them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .blocks import triton
from .launch import card, launch
from .linear import _ggml, _unit, lattice, plan_splits, tiles

MAX_PARTS = 2  # weights per expert in one launch (gate and up)
ROW_FIELDS = 3  # the row map's fields per tile: routed expert, first row, end of the expert's rows


if triton is not None:
    import triton.language as tl

    from .linear import _finish, _splits

    # the expert count, row counts and the split plan are not specialized on: one compiled kernel for every pass
    @triton.jit(do_not_specialize=["E", "N", "NTOT", "KS", "SPLITS"])
    def _grouped(x_ptr, addr_ptr, table, y_ptr, bias_ptr, E, K, row_bytes, N, NTOT, KS, SPLITS, stride_xm, stride_ym,
                 PARTS: tl.constexpr, TYPE: tl.constexpr, UNIT: tl.constexpr, UBYTES: tl.constexpr,
                 CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IEEE: tl.constexpr):
        """Program (tile t, n tile): rows [r0, r1) of routed expert e (the row map's tile t, BM rows at most) times
        the BN weight rows of tile n of part p (its blocks at addr[p, e]), into y's columns p * N on; every split of
        K in order, as linear._fused's programs that run them in order. addr: (PARTS * E,) the blocks' addresses,
        then the row map, ROW_FIELDS a tile."""
        pid_t, pid_n = tl.program_id(0), tl.program_id(1)
        map_ptr = addr_ptr + PARTS * E + 3 * pid_t
        e = tl.load(map_ptr)
        r0 = tl.load(map_ptr + 1)
        r1 = tl.load(map_ptr + 2)
        per_part = tl.cdiv(N, BN)
        part = pid_n // per_part
        tile = pid_n - part * per_part
        w_ptr = tl.load(addr_ptr + part * E + e).to(tl.pointer_type(tl.uint8))  # this expert's part's blocks
        rm = r0 + tl.arange(0, BM)  # (BM,) rows of x and y
        mmask = rm < r1
        rn = tile * BN + tl.arange(0, BN)  # (BN,) rows of this weight
        nmask = rn < N
        rows = w_ptr + rn.to(tl.int64) * row_bytes  # (BN,) each row's first byte
        total = _splits(x_ptr, rows, table, rm, mmask, nmask, stride_xm, K, KS, 0, SPLITS, TYPE, UNIT, UBYTES, CHUNKS,
                        BM, BN, IEEE)  # (BM, BN) every split in order, as linear._fused's programs that run them so
        _finish(total, y_ptr, bias_ptr + e.to(tl.int64) * NTOT, rm, mmask, part * N + rn, nmask, stride_ym, HAS_BIAS)


def row_map(counts: Sequence[int], bm: int) -> list[int]:
    """The row map's fields, flat: per tile of at most `bm` rows of one expert (routed expert i, first row, end of
    expert i's rows), experts in order; experts without rows have no tile."""
    out, start = [], 0
    for i, n in enumerate(counts):
        end = start + int(n)
        out += [v for r0 in range(start, end, bm) for v in (i, r0, end)]
        start = end
    return out


def grouped_linear(x: torch.Tensor, counts: Sequence[int], parts: Sequence[Sequence[torch.Tensor]], type_id: int,
                   cols: int, biases: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> torch.Tensor:
    """x (R, cols), rows grouped by routed expert (`counts[i]` rows of expert i, R = sum), times each expert's
    weights -> (R, len(parts) * N) in x's dtype. parts[p][i]: routed expert i's (N, row_bytes) blocks of part p,
    every one of `type_id`; biases[p][i] (N,) its bias or None. Row r of expert i, part p equals
    linear(x[r:r+1], [(parts[p][i], type_id)], cols, biases[p][i]) bit for bit."""
    assert 1 <= len(parts) <= MAX_PARTS and all(len(p) == len(counts) for p in parts), (len(parts), len(counts))
    x = x if x.stride(-1) == 1 else x.contiguous()
    ws = [[w if w.stride(-1) == 1 else w.contiguous() for w in p] for p in parts]
    n, row_bytes = ws[0][0].shape
    assert all(w.shape == (n, row_bytes) and w.stride(0) == row_bytes for p in ws for w in p), "one weight shape"
    r, e = x.shape[0], len(counts)
    assert sum(int(c) for c in counts) == r, (sum(counts), r)
    ntot = len(ws) * n
    y = torch.empty((r, ntot), dtype=x.dtype, device=x.device)  # (R, PARTS * N)
    if r == 0 or n == 0:
        return y
    gpu = card(x.device)
    splits, ks = plan_splits(n, cols, [type_id], gpu.sms)  # the plan of one expert's weight, as linear() makes it
    values, nbytes, chunks = _unit(type_id)
    tile = tiles(max(int(c) for c in counts), x.dtype, chunks, gpu)
    fields = row_map(counts, tile.bm)
    # (PARTS * E + tiles * 3,) the blocks' addresses, then the row map: one copy to the device
    addrs = torch.tensor([w.data_ptr() for p in ws for w in p] + fields, dtype=torch.int64).to(x.device)
    bias = y
    if biases is not None:
        # (E, PARTS * N) in x's dtype, as QLinear passes its bias: one copy and one cast whatever E
        bias = torch.cat([biases[p][i] for i in range(e) for p in range(len(ws))]).view(e, ntot).to(x.dtype)
    name = _ggml(type_id).name
    grid = (len(fields) // ROW_FIELDS, len(ws) * triton.cdiv(n, tile.bn))
    launch(_grouped, grid, x, addrs, lattice(name, ws[0][0]), y, bias, e, cols, row_bytes, n, ntot, ks, splits,
           x.stride(0), y.stride(0), PARTS=len(ws), TYPE=name, UNIT=values, UBYTES=nbytes, CHUNKS=chunks, BM=tile.bm,
           BN=tile.bn, HAS_BIAS=biases is not None, IEEE=x.dtype == torch.float32, num_warps=tile.warps,
           num_stages=tile.stages)
    return y


def experts_ffn(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, routed: Sequence[int],
                counts: Sequence[int], weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                types: tuple[int, int, int], glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                biases: Optional[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None) -> torch.Tensor:
    """x (T, H) through the routed experts -> (T, H), as QExperts' per-expert loop: `routed` the experts with rows,
    ascending, `counts[i]` the pairs routed to routed[i], weights[i] its (gate, up, down) blocks of `types`,
    biases[i] their biases (gpt-oss) or None; `glu(gate, up)` the activation (QExperts._glu)."""
    t, k = top_k_index.shape
    hidden = x.shape[1]
    inter = weights[0][0].shape[0]
    flat = top_k_index.reshape(-1)  # (T * k,) pair j = token j // k, slot j % k
    order = torch.sort(flat, stable=True).indices  # (R,) the pairs by expert, tokens ascending within one
    xs = x[order // k]  # (R, H) each pair's token's row
    gates, ups, downs = ([w[j] for w in weights] for j in range(3))
    bg, bu, bd = ([b[j] for b in biases] for j in range(3)) if biases is not None else (None, None, None)
    if types[0] == types[1] and gates[0].shape == ups[0].shape:  # gate and up in one launch
        gu = grouped_linear(xs, counts, [gates, ups], types[0], hidden, None if biases is None else [bg, bu])
        gate, up = gu[:, :inter], gu[:, inter:]  # (R, I) each
    else:
        gate = grouped_linear(xs, counts, [gates], types[0], hidden, None if biases is None else [bg])  # (R, I)
        up = grouped_linear(xs, counts, [ups], types[1], hidden, None if biases is None else [bu])  # (R, I)
    y = grouped_linear(glu(gate, up), counts, [downs], types[2], inter, None if biases is None else [bd])  # (R, H)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)  # (R, H) each pair's weighted output
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)  # (T * k,) each pair's row in y
    slots = rank.view(t, k).sort(dim=1).values  # (T, k) a token's rows in ascending expert order
    out = torch.zeros((t, hidden), dtype=x.dtype, device=x.device)  # (T, H)
    for j in range(k):  # 0 + the first expert's + the next one's ...: QExperts' index_add_ per expert, in order
        out = out + y[slots[:, j]]
    return out


def layer_ffn(layer, x: torch.Tensor, routed: Sequence[int], counts: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> Optional[torch.Tensor]:
    """A QExperts layer's routed FFN grouped (its forward's `routed` experts, ascending, and `counts` (E,) the pairs
    routed to each), or None where it does not apply: an expert's blocks not on x's device (read through host memory
    from an expert cache), an interleaved (CPU) layout, or a projection of more than one type or shape."""
    trios = [(layer.experts[e].gate_proj, layer.experts[e].up_proj, layer.experts[e].down_proj) for e in routed]
    if not trios:
        return None
    first = trios[0]
    for trio in trios:
        for m, f in zip(trio, first):
            if m.interleaved or m.type_id != f.type_id or m.qweight.device != x.device or m.qweight.shape != \
                    f.qweight.shape:
                return None
    biases = [tuple(m.bias.detach() for m in trio) for trio in trios] if layer.swiglu is not None else None
    return experts_ffn(x, top_k_index, top_k_weights, routed, [int(counts[e]) for e in routed],
                       [tuple(m.qweight for m in trio) for trio in trios], tuple(m.type_id for m in first),
                       layer._glu, biases)
