"""Quantizing float weights into ggml's 2- and 3-bit K-quant blocks (Q2_K, Q3_K), numpy only.

The gguf package only decodes these types; this module writes them, so a low-bit copy of a layer can be made from
the layer's own float weights. A (rows, cols) float32 weight becomes (rows, cols / 256 * nbytes) uint8, the bytes
of a GGUF tensor, decodable by `gguf.dequantize` and by offspec's kernels. Each super-block of 256 values is 16
sub-blocks of 16; value i of a super-block is quant i, with quants packed four to a byte as
`qs[32 * h + l] = q[128 h + l] | q[128 h + 32 + l] << 2 | q[128 h + 64 + l] << 4 | q[128 h + 96 + l] << 6`.

- Q2_K, 84 bytes: scales[16] (sub-block j: low nibble a, high nibble b), qs[64] (2-bit q in 0..3), fp16 d,
  fp16 dmin. Value = (d * a_j) * q - (dmin * b_j).
- Q3_K, 110 bytes: hmask[32] (bit i // 32 of byte i % 32: the high bit of quant i), qs[64] (its low 2 bits),
  scales[12] (6-bit codes c_j = sc_j + 32: low nibbles of c_0..7 in bytes 0..7, of c_8..15 in their high nibbles,
  the top 2 bits of c_j at bit 2 (j // 4) of byte 8 + j % 4), fp16 d. Value = (d * sc_j) * q, q = low + 4 * high - 4
  in -4..3, sc_j in -32..31.

The search, for every sub-block of the tensor at once (as ggml's make_qx_quants / make_qkx2_quants): candidate
inverse scales around nmax / max (Q3_K: -(4 + 0.1 k) / signed max-magnitude value, k = -9..9; Q2_K: (2.5 + 0.1 k) /
(max - min), k = 0..15, and 3 / (max - min)); each gives round-to-nearest quants, then the weighted least-squares
scale (Q2_K: scale and min, the min kept <= 0) for those quants; the candidate of least weighted squared error wins.
The 16 sub-block scales (and mins) are then coded against an fp16 super-block scale (the largest near code 15, or
-32 for Q3_K's signed scales; see below), and every quant is assigned again, to the nearest of its codes under the
scale (and min) actually stored.

Weights of the squared error: importance[col] * sqrt(sigma2 + x^2), sigma2 the mean square of the super-block, as
ggml's imatrix path (its reference without one uses x^2 for Q3_K, |x| for Q2_K). The x^2 term favours the large
weights, which matter most to a layer's output; sigma2 keeps the small ones from being ignored. Without
`importance` every column weighs 1. The super-block scale is searched the same way (candidates around the plain
one, a least-squares refit of each), each sub-block scale's error weighted by sum(w q^2) of its quants, each min's
by sum(w) of its sub-block.
"""

from __future__ import annotations

import numpy as np

QK = 256  # values per super-block
SUB = 16  # values per sub-block
TYPES = {"Q2_K": 84, "Q3_K": 110}  # bytes per super-block
_CHUNK = 2048  # super-blocks searched together (bounds the temporaries to a few MiB)
_EPS = 1e-15  # a sub-block whose largest magnitude is below this is all zeros
_LIMIT = 5e5  # larger values would overflow Q2_K's fp16 dmin (max 65504 = 15 codes of 4367)


def quantize_k(values: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """A float (rows, cols) weight -> (rows, row_bytes) uint8 blocks of Q2_K or Q3_K (cols a multiple of 256).

    `importance`: optional (cols,) non-negative weight of each input column (an imatrix), scaling that column's
    squared error in the scale search."""
    if type_name not in TYPES:
        raise ValueError(f"quantize_k writes {sorted(TYPES)}, not {type_name!r}: pick one of those")
    x = np.asarray(values)
    if x.ndim != 2:
        raise ValueError(f"quantize_k takes a (rows, cols) weight, got shape {x.shape}: reshape it to 2 dims")
    rows, cols = x.shape
    if cols % QK or cols == 0:
        raise ValueError(f"{type_name} rows need a positive multiple of {QK} columns, got {cols}: pad or keep it float")
    x = np.ascontiguousarray(x, dtype=np.float32)  # (rows, cols) float32
    if not np.isfinite(x).all():
        raise ValueError(f"the weight has {int((~np.isfinite(x)).sum())} inf/NaN values: fix the weight first")
    if np.abs(x).max(initial=0.0) > _LIMIT:
        raise ValueError(f"the weight has values above {_LIMIT:g} in magnitude, beyond fp16 block scales: rescale it")
    per_row = cols // QK
    if importance is None:
        imp = np.ones((per_row, QK), np.float32)  # (per_row, 256) float32
    else:
        imp = np.asarray(importance, dtype=np.float32)
        if imp.shape != (cols,):
            raise ValueError(f"importance must have shape ({cols},), one weight per column, got {imp.shape}")
        if not np.isfinite(imp).all() or (imp < 0).any():
            raise ValueError("importance must be finite and non-negative: clip or fix the imatrix")
        imp = imp.reshape(per_row, QK)  # (per_row, 256) float32
    blocks = x.reshape(-1, QK)  # (n_blocks, 256) float32
    n_blocks = blocks.shape[0]
    out = np.empty((n_blocks, TYPES[type_name]), np.uint8)  # (n_blocks, nbytes) uint8
    encode = _q2_k if type_name == "Q2_K" else _q3_k
    for start in range(0, n_blocks, _CHUNK):
        stop = min(start + _CHUNK, n_blocks)
        xb = blocks[start:stop]  # (n, 256) float32
        sigma2 = (xb * xb).mean(axis=1, keepdims=True)  # (n, 1) float32
        w = imp[np.arange(start, stop) % per_row] * np.sqrt(sigma2 + xb * xb)  # (n, 256) float32
        out[start:stop] = encode(xb.reshape(-1, SUB, SUB), w.reshape(-1, SUB, SUB))
    return out.reshape(rows, per_row * TYPES[type_name])


def _fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Super-block scales -> (their fp16 bytes (n, 2) uint8, the float32 values a decoder reads back (n,))."""
    h = v.astype(np.float16)  # (n,) float16
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _code_scales(v: np.ndarray, wt: np.ndarray, target: int, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """(n, 16) sub-block scales (or mins) and their error weights -> (fp16 bytes (n, 2), decoded super-block scale
    (n,) float32, codes (n, 16) int32 in lo..hi). Candidates map the largest-magnitude one to about `target`; for
    each candidate's codes the least-squares super-block scale; the least weighted squared error wins."""
    top = np.take_along_axis(v, np.abs(v).argmax(axis=1)[:, None], axis=1)[:, 0]  # (n,) signed
    live = top != 0
    inv = np.where(live, 1.0 / np.where(live, top, 1.0), 0.0)[:, None]  # (n, 1) float64
    vv = (wt * v * v).sum(axis=1)  # (n,)
    d = top / target  # (n,) the plain choice: the largest maps to `target` exactly
    codes = np.clip(np.rint(v * (target * inv)), lo, hi)  # (n, 16)
    err = (wt * (v - d[:, None] * codes) ** 2).sum(axis=1)  # (n,)
    step = 0.1 if target > 0 else -0.1
    for k in range(-9, 10):
        c = np.clip(np.rint(v * ((target + step * k) * inv)), lo, hi)  # (n, 16)
        num, den = (wt * v * c).sum(axis=1), (wt * c * c).sum(axis=1)
        ok = den > 0
        e = np.where(ok, vv - num * num / np.where(ok, den, 1.0), np.inf)
        better = e < err
        d = np.where(better, num / np.where(ok, den, 1.0), d)
        codes = np.where(better[:, None], c, codes)
        err = np.where(better, e, err)
    d_bytes, d16 = _fp16(d)
    return d_bytes, d16, codes.astype(np.int32)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) quants in 0..3 -> (n, 64) uint8, four to a byte as the layout above."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # (n, half, shift, 32) uint8
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(q << shifts, axis=2).reshape(-1, 64)


def _q3_k(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 16, 16) values and error weights -> (n, 110) Q3_K blocks."""
    n = x.shape[0]
    idx = np.abs(x).argmax(axis=2)[..., None]
    peak = np.take_along_axis(x, idx, axis=2)[..., 0]  # (n, 16) float32, the signed largest-magnitude value
    live = np.abs(peak) > _EPS
    inv = np.where(live, 1.0 / np.where(live, peak, 1.0), 0.0).astype(np.float32)[..., None]  # (n, 16, 1)
    wx = w * x  # (n, 16, 16) float32
    scale = -peak / 4  # (n, 16) float32: the fallback when every weight of a sub-block is 0
    best = np.full(peak.shape, -1.0)  # (n, 16) float64, the error removed: sum(wxl)^2 / sum(wll)
    best_sll = np.zeros(peak.shape)  # (n, 16) sum(w q^2) of the winner: how much its scale's error costs
    for k in range(-9, 10):
        q = np.clip(np.rint(-(4 + 0.1 * k) * inv * x), -4, 3)  # (n, 16, 16) float32
        sxl = (wx * q).sum(axis=2, dtype=np.float64)  # (n, 16)
        sll = (w * q * q).sum(axis=2, dtype=np.float64)  # (n, 16)
        ok = sll > 0
        gain = np.where(ok, sxl * sxl / np.where(ok, sll, 1.0), -1.0)
        better = gain > best
        scale = np.where(better, sxl / np.where(ok, sll, 1.0), scale)
        best, best_sll = np.where(better, gain, best), np.where(better, sll, best_sll)
    scale = np.where(live, scale, 0.0)
    d_bytes, d, codes = _code_scales(scale, best_sll, -32, -32, 31)
    s = (d[:, None] * codes.astype(np.float32))[..., None]  # (n, 16, 1) float32, the decoded sub-block scales
    q = np.where(s != 0, np.clip(np.rint(x / np.where(s == 0, 1, s)), -4, 3), 0).astype(np.int32)  # (n, 16, 16)
    lq = (q + 4).reshape(n, QK)  # (n, 256) in 0..7
    hbit = (lq >> 2).astype(np.uint8).reshape(n, 8, 32)  # (n, bit, byte)
    hmask = np.bitwise_or.reduce(hbit << np.arange(8, dtype=np.uint8)[:, None], axis=1)  # (n, 32) uint8
    c = (codes + 32).astype(np.uint8)  # (n, 16) 6-bit codes
    low = (c[:, :8] & 0xF) | ((c[:, 8:] & 0xF) << 4)  # (n, 8) uint8
    high = (c >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]  # (n, j // 4, j % 4)
    high = np.bitwise_or.reduce(high, axis=1)  # (n, 4) uint8
    return np.concatenate([hmask, _pack_2bit(lq & 3), low, high, d_bytes], axis=1)


def _q2_k(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 16, 16) values and error weights -> (n, 84) Q2_K blocks."""
    n = x.shape[0]
    lo = np.minimum(x.min(axis=2), 0.0)  # (n, 16) float32, the min (never above 0: mins are stored >= 0)
    span = x.max(axis=2) - lo  # (n, 16) float32
    live = span > _EPS
    inv = np.where(live, 1.0 / np.where(live, span, 1.0), 0.0).astype(np.float32)[..., None]  # (n, 16, 1)
    sw = w.sum(axis=2, dtype=np.float64)  # (n, 16)
    wx = w * x  # (n, 16, 16) float32
    swx = wx.sum(axis=2, dtype=np.float64)
    swxx = (wx * x).sum(axis=2, dtype=np.float64)
    shifted = x - lo[..., None]  # (n, 16, 16) float32
    # the first candidate: 3 / span as is, no refit
    q = np.clip(np.rint(3 * inv * shifted), 0, 3)
    scale, mn = span / 3, lo  # (n, 16) each
    r = scale[..., None] * q + mn[..., None] - x
    best = (w * r * r).sum(axis=2, dtype=np.float64)  # (n, 16) weighted squared error
    best_swll = (w * q * q).sum(axis=2, dtype=np.float64)  # (n, 16) sum(w q^2): how much the scale's error costs
    for k in range(16):
        q = np.clip(np.rint((2.5 + 0.1 * k) * inv * shifted), 0, 3)  # (n, 16, 16) float32
        swl = (w * q).sum(axis=2, dtype=np.float64)
        swll = (w * q * q).sum(axis=2, dtype=np.float64)
        swxl = (wx * q).sum(axis=2, dtype=np.float64)
        det = sw * swll - swl * swl
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        a = (sw * swxl - swx * swl) / safe
        m = (swll * swx - swl * swxl) / safe
        clamp = m > 0  # a positive min cannot be stored: fit the scale alone
        a = np.where(clamp, swxl / np.where(swll > 0, swll, 1.0), a)
        m = np.where(clamp, 0.0, m)
        err = a * a * swll + m * m * sw + swxx + 2 * a * m * swl - 2 * a * swxl - 2 * m * swx
        better = ok & (a > 0) & (err < best)
        scale, mn, best = np.where(better, a, scale), np.where(better, m, mn), np.where(better, err, best)
        best_swll = np.where(better, swll, best_swll)
    scale = np.where(live, scale, 0.0)  # (n, 16) >= 0
    mins = -mn  # (n, 16) >= 0
    d_bytes, d, a_code = _code_scales(scale, best_swll, 15, 0, 15)
    m_bytes, dmin, b_code = _code_scales(mins, sw, 15, 0, 15)
    a_code, b_code = a_code.astype(np.uint8), b_code.astype(np.uint8)  # (n, 16) each, 4-bit codes
    s = (d[:, None] * a_code.astype(np.float32))[..., None]  # (n, 16, 1) float32, decoded as gguf does
    ml = (dmin[:, None] * b_code.astype(np.float32))[..., None]  # (n, 16, 1) float32
    q = np.where(s > 0, np.clip(np.rint((x + ml) / np.where(s > 0, s, 1)), 0, 3), 0)  # (n, 16, 16)
    return np.concatenate([a_code | (b_code << 4), _pack_2bit(q.reshape(n, QK)), d_bytes, m_bytes], axis=1)
