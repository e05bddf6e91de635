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

import torch

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


_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
           "Q3_K": _q3_k, "Q4_K": lambda b: _q45_k(b, False), "Q5_K": lambda b: _q45_k(b, True), "Q6_K": _q6_k}


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
