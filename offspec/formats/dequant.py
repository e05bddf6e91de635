"""Decoding rows of ggml blocks with torch operations, on any device.

`dequantize(raw, type_id, cols)` turns a (R, row_bytes) uint8 tensor into the (R, cols) float32 values the
blocks stand for, with the arithmetic of the gguf package's reference decoder (gguf/quants.py), so the values
are bitwise equal to it. CUDA uses this before its matrix multiply; on a CPU it is the fallback when the
compiled kernels (kernels.py) are unavailable, and a second reference in the tests.

On a GPU each decode is a few dozen small kernels queued behind the previous layer's work. None of them may wait
for the GPU: the shift and bit-index constants are made once per device (`_const`), never copied from host data
per call (a copy from pageable host memory waits for every kernel queued before it, about 200 times a pass).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants as gguf_quants

from .ggml import KERNEL_TYPES

_CONSTANTS: dict[tuple, torch.Tensor] = {}  # (values, shape, dtype, device) -> a small constant tensor


def _const(values: tuple[int, ...], like: torch.Tensor, shape: tuple[int, ...],
           dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A small constant on like's device, made once per device (decoding itself never copies from the host)."""
    key = (values, shape, dtype, like.device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=like.device).reshape(shape)
    return found


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2k) uint8 -> (..., k) float32 from little-endian float16s (k = 1: a block's d; 2: d and dmin)."""
    return b.contiguous().view(torch.float16).float()


def _bit_index(like: torch.Tensor, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """0 .. n-1 as a constant of `shape` (bit positions)."""
    return _const(tuple(range(n)), like, shape, dtype)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) values: low nibbles first, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4) bytes of a little-endian uint32 -> (..., 32) bits as uint8."""
    word = b.to(torch.int64)
    word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24  # (...,)
    return ((word[..., None] >> _bit_index(b, 32, (32,), torch.int64)) & 1).to(torch.uint8)


def _q4_0(blk):
    d = _half(blk[..., 0:2])
    return d * (_nibbles(blk[..., 2:18]).to(torch.int8) - 8).float()


def _q4_1(blk):
    dm = _half(blk[..., 0:4])  # (..., 2): d and m, one copy for both
    d, m = dm[..., 0:1], dm[..., 1:2]
    return d * _nibbles(blk[..., 4:20]).float() + m


def _q5_0(blk):
    d = _half(blk[..., 0:2])
    q = _nibbles(blk[..., 6:22]) | (_bits32(blk[..., 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blk):
    dm = _half(blk[..., 0:4])  # (..., 2): d and m, one copy for both
    d, m = dm[..., 0:1], dm[..., 1:2]
    q = _nibbles(blk[..., 8:24]) | (_bits32(blk[..., 4:8]) << 4)
    return d * q.float() + m


def _q8_0(blk):
    return blk[..., 2:34].contiguous().view(torch.int8).float() * _half(blk[..., 0:2])


def _q2_k(blk):
    lead = blk.shape[:-1]
    scales, qs = blk[..., 0:16], blk[..., 16:80]
    dd = _half(blk[..., 80:84])[..., None]  # (..., 2, 1): d and dmin
    d, dmin = dd[..., 0:1, :], dd[..., 1:2, :]  # (..., 1, 1)
    dl = d * (scales & 0x0F).float()[..., None]  # (..., 16, 1)
    ml = dmin * (scales >> 4).float()[..., None]
    q = (qs.reshape(*lead, 2, 1, 32) >> _const((0, 2, 4, 6), blk, (4, 1))) & 3  # (..., 2, 4, 32)
    return (dl * q.reshape(*lead, 16, 16).float() - ml).reshape(*lead, 256)


def _q3_k(blk):
    lead = blk.shape[:-1]
    hmask, qs, sc = blk[..., 0:32], blk[..., 32:96], blk[..., 96:108]
    d = _half(blk[..., 108:110])[..., None]  # (..., 1, 1)
    low = (sc[..., 0:8].reshape(*lead, 1, 8) >> _const((0, 4), blk, (2, 1))).reshape(*lead, 16)
    high = (sc[..., 8:12].reshape(*lead, 1, 4) >> _const((0, 2, 4, 6), blk, (4, 1))).reshape(*lead, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = d * scales.float()[..., None]  # (..., 16, 1)
    ql = ((qs.reshape(*lead, 2, 1, 32) >> _const((0, 2, 4, 6), blk, (4, 1))) & 3).reshape(*lead, 16, 16)
    bit = _bit_index(blk, 8, (8, 1), torch.uint8)
    qh = ((hmask.reshape(*lead, 1, 32) >> bit) & 1).reshape(*lead, 16, 16) ^ 1
    q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
    return (dl * q.float()).reshape(*lead, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (..., 12) bytes -> 8 six-bit scales and 8 six-bit minimums."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q45_k(blk, five: bool):
    lead = blk.shape[:-1]
    dd = _half(blk[..., 0:4])[..., None]  # (..., 2, 1): d and dmin, one copy for both
    d, dmin = dd[..., 0:1, :], dd[..., 1:2, :]  # (..., 1, 1)
    sc, mn = _k_scale_min(blk[..., 4:16])
    ds, dm = d * sc.float()[..., None], dmin * mn.float()[..., None]  # (..., 8, 1)
    qs = blk[..., 48:176] if five else blk[..., 16:144]
    q = ((qs.reshape(*lead, 4, 1, 32) >> _const((0, 4), blk, (2, 1))) & 0x0F).reshape(*lead, 8, 32)
    if five:
        bit = _bit_index(blk, 8, (8, 1), torch.uint8)
        q = q | (((blk[..., 16:48].reshape(*lead, 1, 32) >> bit) & 1) << 4)
    return (ds * q.float() - dm).reshape(*lead, 256)


def _q6_k(blk):
    lead = blk.shape[:-1]
    ql, qh = blk[..., 0:128], blk[..., 128:192]
    scales = blk[..., 192:208].contiguous().view(torch.int8)
    d = _half(blk[..., 208:210])[..., None] * scales.float()[..., None]  # (..., 16, 1)
    lo = ((ql.reshape(*lead, 2, 1, 64) >> _const((0, 4), blk, (2, 1))) & 0x0F).reshape(*lead, 8, 32)
    hi = ((qh.reshape(*lead, 2, 1, 32) >> _const((0, 2, 4, 6), blk, (4, 1))) & 0x03).reshape(*lead, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16)
    return (d * q.float()).reshape(*lead, 256)


# --- the IQ and TQ types ---------------------------------------------------------------------------------------
# The lattice grids (rows of 8 or 4 small values) are the gguf package's own tables (gguf/quants.py), made into a
# float32 tensor once per device; the sign patterns are ksigns: 7 bits and their parity as the 8th.
KVALUES_IQ4NL = gguf_quants.IQ4_NL.kvalues  # the 16 int8 values of IQ4_NL and IQ4_XS
KVALUES_MXFP4 = gguf_quants.MXFP4.kvalues  # MXFP4's 16 values: twice the FP4 (E2M1) numbers, as int8
_GRID_TYPES = {"IQ2_XXS": gguf_quants.IQ2_XXS, "IQ2_XS": gguf_quants.IQ2_XS, "IQ2_S": gguf_quants.IQ2_S,
               "IQ3_XXS": gguf_quants.IQ3_XXS, "IQ3_S": gguf_quants.IQ3_S, "IQ1_S": gguf_quants.IQ1_S,
               "IQ1_M": gguf_quants.IQ1_M}
GRID_NAMES = tuple(_GRID_TYPES)
_TABLES: dict[tuple, torch.Tensor] = {}  # (name, device) -> a grid, ksigns or kvalues tensor


def grid_values(name: str) -> np.ndarray:
    """(entries, 8 or 4) float32: the lattice grid of IQ type `name`, as gguf's reference decoder uses it."""
    cls = _GRID_TYPES[name]
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


def _table(name: str, like: torch.Tensor) -> torch.Tensor:
    key = (name, like.device)
    found = _TABLES.get(key)
    if found is None:
        if name == "ksigns":  # (128,) uint8
            values = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.uint8)
        elif name == "kvalues":  # (16,) float32
            values = np.array(KVALUES_IQ4NL, dtype=np.float32)
        elif name == "kvalues_mxfp4":  # (16,) float32
            values = np.array(KVALUES_MXFP4, dtype=np.float32)
        else:
            values = grid_values(name)
        found = _TABLES[key] = torch.from_numpy(values).to(like.device)
    return found


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4k) bytes -> (..., k) int64: little-endian uint32 words."""
    w = b.reshape(*b.shape[:-1], -1, 4).to(torch.int64)
    return w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2k) bytes -> (..., k) int64: little-endian uint16 words."""
    w = b.reshape(*b.shape[:-1], -1, 2).to(torch.int64)
    return w[..., 0] | w[..., 1] << 8


def _bits8(b: torch.Tensor) -> torch.Tensor:
    """(...,) bytes -> (..., 8) their bits, lowest first, as uint8."""
    return (b[..., None] >> _bit_index(b, 8, (8,), torch.uint8)) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """bits (uint8 0/1) -> +1.0 / -1.0 (float32)."""
    return 1.0 - 2.0 * bits.float()


def _ksign_bits(words: torch.Tensor) -> torch.Tensor:
    """(..., 8) int64 words whose bits 0-27 are 4 seven-bit sign indices -> (..., 8, 4, 8) sign bits."""
    idx = (words[..., None] >> _const((0, 7, 14, 21), words, (4,), torch.int64)) & 0x7F  # (..., 8, 4)
    return _bits8(_table("ksigns", words)[idx])


def _iq4_nl(blk):
    d = _half(blk[..., 0:2])
    return d * _table("kvalues", blk)[_nibbles(blk[..., 2:18]).long()]


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """(...,) uint8 E8M0 exponents -> (...,) float32 2**(e - 128), built from its bits as ggml and gguf do: e < 2 is
    a subnormal (0x00200000 << e), else the exponent field e - 1 (e = 255: 2**127, never infinity)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, (e + 1) << 21, (e - 1) << 23).view(torch.float32)


def _mxfp4(blk):
    d = _e8m0_half(blk[..., 0:1])  # (..., 1)
    return d * _table("kvalues_mxfp4", blk)[_nibbles(blk[..., 1:17]).long()]


def _iq4_xs(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])  # (..., 1)
    sh = _u16(blk[..., 2:4])  # (..., 1)
    sl = (blk[..., 4:8].reshape(*lead, 4, 1) >> _const((0, 4), blk, (2,))).reshape(*lead, 8) & 0x0F
    high = (sh >> _const(tuple(range(0, 16, 2)), blk, (8,), torch.int64)) & 3  # (..., 8)
    scales = (sl.to(torch.int64) | high << 4) - 32
    dl = (d * scales.float())[..., None]  # (..., 8, 1)
    q = _nibbles(blk[..., 8:136].reshape(*lead, 8, 16)).long()  # (..., 8, 32)
    return (dl * _table("kvalues", blk)[q]).reshape(*lead, 256)


def _iq2_xxs(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])[..., None]  # (..., 1, 1)
    groups = blk[..., 2:66].reshape(*lead, 8, 8)  # 4 grid indices, then a word of signs and the scale
    aux = _u32(groups[..., 4:8])[..., 0]  # (..., 8)
    db = (d * (0.5 + (aux >> 28).float()[..., None]) * 0.25)[..., None]  # (..., 8, 1, 1)
    grid = _table("IQ2_XXS", blk)[groups[..., 0:4].long()]  # (..., 8, 4, 8)
    return (db * grid * _signs(_ksign_bits(aux))).reshape(*lead, 256)


def _iq2_xs(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])  # (..., 1)
    qs = _u16(blk[..., 2:66])  # (..., 32): 9-bit grid index, 7-bit sign index
    sc = (blk[..., 66:74].reshape(*lead, 8, 1) >> _const((0, 4), blk, (2,))).reshape(*lead, 16) & 0x0F
    db = (d * (0.5 + sc.float()) * 0.25)[..., None, None]  # (..., 16, 1, 1)
    grid = _table("IQ2_XS", blk)[qs & 511].reshape(*lead, 16, 2, 8)
    signs = _bits8(_table("ksigns", blk)[qs >> 9]).reshape(*lead, 16, 2, 8)
    return (db * grid * _signs(signs)).reshape(*lead, 256)


def _iq2_s(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])  # (..., 1)
    qs, signs, qh, sc = blk[..., 2:34], blk[..., 34:66], blk[..., 66:74], blk[..., 74:82]
    sc = (sc.reshape(*lead, 8, 1) >> _const((0, 4), blk, (2,))).reshape(*lead, 16) & 0x0F
    db = (d * (0.5 + sc.float()) * 0.25)[..., None, None]  # (..., 16, 1, 1)
    high = ((qh.reshape(*lead, 8, 1) >> _const((0, 2, 4, 6), blk, (4,))) & 3).reshape(*lead, 32)
    grid = _table("IQ2_S", blk)[qs.long() | high.long() << 8].reshape(*lead, 16, 2, 8)
    return (db * grid * _signs(_bits8(signs).reshape(*lead, 16, 2, 8))).reshape(*lead, 256)


def _iq3_xxs(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])[..., None]  # (..., 1, 1)
    aux = _u32(blk[..., 66:98])  # (..., 8)
    db = (d * (0.5 + (aux >> 28).float()[..., None]) * 0.5)[..., None]  # (..., 8, 1, 1)
    grid = _table("IQ3_XXS", blk)[blk[..., 2:66].long()].reshape(*lead, 8, 4, 8)
    return (db * grid * _signs(_ksign_bits(aux))).reshape(*lead, 256)


def _iq3_s(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])  # (..., 1)
    qs, qh, signs, sc = blk[..., 2:66], blk[..., 66:74], blk[..., 74:106], blk[..., 106:110]
    sc = (sc.reshape(*lead, 4, 1) >> _const((0, 4), blk, (2,))).reshape(*lead, 8) & 0x0F
    db = (d * (1 + 2 * sc).float())[..., None, None]  # (..., 8, 1, 1)
    index = qs.long() | _bits8(qh).reshape(*lead, 64).long() << 8
    grid = _table("IQ3_S", blk)[index].reshape(*lead, 8, 4, 8)
    return (db * grid * _signs(_bits8(signs).reshape(*lead, 8, 4, 8))).reshape(*lead, 256)


def _iq1_s(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 0:2])[..., None]  # (..., 1, 1)
    qh = _u16(blk[..., 34:50])  # (..., 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()[..., None])[..., None]  # (..., 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).float()[..., None, None]  # (..., 8, 1, 1)
    high = (qh[..., None] >> _const((0, 3, 6, 9), blk, (4,), torch.int64)) & 7  # (..., 8, 4)
    index = blk[..., 2:34].reshape(*lead, 8, 4).long() | high << 8
    return (dl * (_table("IQ1_S", blk)[index] + delta)).reshape(*lead, 256)


def _iq1_m(blk):
    lead = blk.shape[:-1]
    qs, qh, sc = blk[..., 0:32], blk[..., 32:48], blk[..., 48:56]
    top = sc[..., 1::2] & 0xF0  # (..., 4): the top nibbles of the 4 scale words hold d's 16 bits
    d = _half(torch.stack([(top[..., 0] >> 4) | top[..., 1], (top[..., 2] >> 4) | top[..., 3]], -1))  # (..., 1)
    words = _u16(sc)  # (..., 4)
    scales = ((words[..., None] >> _const((0, 3, 6, 9), blk, (4,), torch.int64)) & 7).reshape(*lead, 16)
    dl = (d[..., None] * (2 * scales + 1).float()[..., None]).reshape(*lead, 8, 2, 1, 1)  # a scale per 16
    nib = (qh.reshape(*lead, 16, 1) >> _const((0, 4), blk, (2,))).reshape(*lead, 32)  # (..., 32)
    index = qs.long() | (nib & 7).long() << 8
    delta = torch.where((nib & 8) == 0, 0.125, -0.125).float().reshape(*lead, 8, 2, 2, 1)
    grid = _table("IQ1_M", blk)[index].reshape(*lead, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(*lead, 256)


def _tq1_0(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 52:54])  # (..., 1)
    pow3 = _const((1, 3, 9, 27, 81), blk, (5, 1))
    q0 = (blk[..., 0:32].reshape(*lead, 1, 32) * pow3).reshape(*lead, 160)  # uint8 products wrap, as in gguf
    q1 = (blk[..., 32:48].reshape(*lead, 1, 16) * pow3).reshape(*lead, 80)
    q2 = (blk[..., 48:52].reshape(*lead, 1, 4) * pow3[:4]).reshape(*lead, 16)
    q = torch.cat([q0, q1, q2], dim=-1).to(torch.int32)
    return d * (((q * 3) >> 8) - 1).float()


def _tq2_0(blk):
    lead = blk.shape[:-1]
    d = _half(blk[..., 64:66])  # (..., 1)
    q = (blk[..., 0:64].reshape(*lead, 2, 1, 32) >> _const((0, 2, 4, 6), blk, (4, 1))) & 3  # (..., 2, 4, 32)
    return d * (q.reshape(*lead, 256).to(torch.int8) - 1).float()


_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
           "Q3_K": _q3_k, "Q4_K": lambda b: _q45_k(b, False), "Q5_K": lambda b: _q45_k(b, True), "Q6_K": _q6_k,
           "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s,
           "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0,
           "MXFP4": _mxfp4}


def dequantize(raw: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """(R, row_bytes) uint8 -> (R, cols) float32, bitwise equal to gguf's reference decoder."""
    t = KERNEL_TYPES[type_id]
    rows = raw.shape[0]
    if t.name == "F32":
        return raw.contiguous().view(torch.float32).reshape(rows, cols)
    if t.name == "F16":
        return raw.contiguous().view(torch.float16).reshape(rows, cols).float()
    if t.name == "BF16":
        return raw.contiguous().view(torch.bfloat16).reshape(rows, cols).float()
    blocks = raw.reshape(rows, cols // t.block, t.nbytes)  # (R, blocks per row, bytes per block)
    return _BLOCKS[t.name](blocks).reshape(rows, cols)
