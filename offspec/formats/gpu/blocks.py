"""ggml block decoders as Triton functions: 32 values of a (BN,) set of weight rows at a time.

`chunk(TYPE, blk, c, nmask, kmask)` returns the (BN, 32) float32 values of chunk `c` (values 32c .. 32c + 31) of the
unit whose first byte each row's `blk` points at. A unit is a ggml block (32 or 256 values; the float types: 32
values). The arithmetic is dequant.py's (the gguf package's reference decoder), so the values are bitwise the CPU
decode's: every product in it is exact in float32 (an fp16 scale of 11 significant bits times a scale of at most 7
bits times a quant of at most 6: at most 24 bits), so the one rounding of a fused multiply-add and the two of a
multiply then an add give the same bits, and the GPU compiler may fuse them freely.

Integers become floats through the exponent trick (2**23 + q read as a float32, minus 2**23: exact for
0 <= q < 2**23): an OR and an add at full rate, where a conversion instruction runs at a sixteenth of it.

IQ4_NL and IQ4_XS (the usual 70B files) are decoded from the gguf package's reference arithmetic (a value is d times
a 16-entry table's entry, exact too); the table is read out of four 32-bit words, (entry + 128) a byte each.
Adding a type: its unit and bytes in `UNITS`, a branch in `chunk`, and a check against the reference decode in
tests/test_gpu_kernels.py; a type missing here is decoded by torch into the linears' scratch once per call
(linear.py), with the same arithmetic after it.
"""

from __future__ import annotations

from typing import NamedTuple

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: nothing here is defined (linear.available() says so)
    triton = None


class Unit(NamedTuple):
    values: int  # values per unit (a ggml block; 32 for the float types)
    nbytes: int  # bytes per unit (float types: of a whole unit of 32)
    chunks: int  # chunks of 32 values per unit


UNITS = {
    "F32": Unit(32, 128, 1), "F16": Unit(32, 64, 1), "BF16": Unit(32, 64, 1),
    "Q4_0": Unit(32, 18, 1), "Q4_1": Unit(32, 20, 1), "Q5_0": Unit(32, 22, 1), "Q5_1": Unit(32, 24, 1),
    "Q8_0": Unit(32, 34, 1),
    "Q2_K": Unit(256, 84, 8), "Q3_K": Unit(256, 110, 8), "Q4_K": Unit(256, 144, 8), "Q5_K": Unit(256, 176, 8),
    "Q6_K": Unit(256, 210, 8), "IQ4_NL": Unit(32, 18, 1), "IQ4_XS": Unit(256, 136, 8),
}

FLOATS = ("F32", "F16", "BF16")


if triton is not None:
    @triton.jit
    def _f16(ptr, mask):
        """Little-endian float16 at ptr (per lane) -> float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _num(q):
        """Small non-negative integers (q < 2**23) -> float32, exactly."""
        return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _bytes(blk, offset, c32, nmask):
        """(BN, 32) bytes blk[:, offset + c32] of the rows in nmask (0 elsewhere)."""
        return tl.load(blk[:, None] + offset + c32[None, :], mask=nmask[:, None], other=0)

    @triton.jit
    def _byte(blk, offset, nmask):
        return tl.load(blk + offset, mask=nmask, other=0)

    @triton.jit
    def _u32(blk, offset, nmask):
        """(BN,) little-endian uint32 at blk + offset."""
        w = _byte(blk, offset, nmask).to(tl.uint32)
        w = w | (_byte(blk, offset + 1, nmask).to(tl.uint32) << 8)
        w = w | (_byte(blk, offset + 2, nmask).to(tl.uint32) << 16)
        return w | (_byte(blk, offset + 3, nmask).to(tl.uint32) << 24)

    @triton.jit
    def _halves(c32, lo, hi):
        """(BN, 32): lo (BN,) for values 0-15 of a chunk, hi (BN,) for 16-31 (sub-blocks of 16)."""
        return tl.where(c32[None, :] < 16, lo[:, None], hi[:, None])

    @triton.jit
    def _k_scale_min(blk, j: tl.constexpr, nmask):
        """Q4_K / Q5_K: sub-block j's six-bit scale and minimum from the 12 bytes at blk + 4, as float32 (BN,)."""
        if j < 4:
            sc = _byte(blk, 4 + j, nmask) & 63
            mn = _byte(blk, 8 + j, nmask) & 63
        else:
            md = _byte(blk, 8 + j, nmask)
            sc = (md & 15) | ((_byte(blk, j, nmask) >> 6) << 4)
            mn = (md >> 4) | ((_byte(blk, 4 + j, nmask) >> 6) << 4)
        return _num(sc), _num(mn)

    @triton.jit
    def _q3_scale(blk, i: tl.constexpr, nmask):
        """Q3_K: sub-block i's signed six-bit scale (-32 .. 31) as float32 (BN,), from the 12 bytes at blk + 96."""
        low = (_byte(blk, 96 + i % 8, nmask) >> (4 * (i // 8))) & 15
        high = (_byte(blk, 104 + i % 4, nmask) >> (2 * (i // 4))) & 3
        return _num(low | (high << 4)) - 32.0

    @triton.jit
    def _iq4(q):
        """IQ4_NL's table (gguf: IQ4_NL.kvalues) at q (0 .. 15, any integer tensor) as float32: (entry + 128) is a
        byte of one of four words, entries 0-3, 4-7, 8-11, 12-15."""
        qq = q.to(tl.int64)
        lo = tl.where(qq < 4, tl.full([1, 1], 0x3F2D1801, tl.int64), tl.full([1, 1], 0x766A5D4F, tl.int64))
        hi = tl.where(qq < 12, tl.full([1, 1], 0xA6998D81, tl.int64), tl.full([1, 1], 0xF1D9C5B5, tl.int64))
        word = tl.where(qq < 8, lo, hi)
        return _num((word >> ((qq & 3) * 8)) & 255) - 128.0

    @triton.jit
    def chunk(TYPE: tl.constexpr, blk, c: tl.constexpr, nmask, kmask):
        """(BN, 32) float32: values 32c .. 32c + 31 of the unit at blk (BN,) (uint8 pointers), 0 where a row is
        outside nmask (BN,) or (float types) a value outside kmask (32,)."""
        c32 = tl.arange(0, 32)
        if TYPE == "F32":
            w = tl.load(blk.to(tl.pointer_type(tl.float32))[:, None] + c32[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
        elif TYPE == "F16":
            w = tl.load(blk.to(tl.pointer_type(tl.float16))[:, None] + c32[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        elif TYPE == "BF16":
            w = tl.load(blk.to(tl.pointer_type(tl.bfloat16))[:, None] + c32[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        elif TYPE == "Q4_0":  # d, 16 bytes: low nibbles are values 0-15, high 16-31; d * (q - 8)
            q = (_bytes(blk, 2, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = _f16(blk, nmask)[:, None] * (_num(q) - 8.0)
        elif TYPE == "Q4_1":  # d, m, 16 bytes of nibbles; d * q + m
            q = (_bytes(blk, 4, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = _f16(blk, nmask)[:, None] * _num(q) + _f16(blk + 2, nmask)[:, None]
        elif TYPE == "Q5_0":  # d, 32 fifth bits, 16 bytes of nibbles; d * (q - 16)
            qh = _u32(blk, 2, nmask)  # (BN,) bit i: value i's fifth bit
            q = ((_bytes(blk, 6, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15).to(tl.uint32)
            q = q | (((qh[:, None] >> c32.to(tl.uint32)[None, :]) & 1) << 4)
            w = _f16(blk, nmask)[:, None] * (_num(q) - 16.0)
        elif TYPE == "Q5_1":  # d, m, 32 fifth bits, 16 bytes of nibbles; d * q + m
            qh = _u32(blk, 4, nmask)
            q = ((_bytes(blk, 8, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15).to(tl.uint32)
            q = q | (((qh[:, None] >> c32.to(tl.uint32)[None, :]) & 1) << 4)
            w = _f16(blk, nmask)[:, None] * _num(q) + _f16(blk + 2, nmask)[:, None]
        elif TYPE == "Q8_0":  # d, 32 int8; q * d
            q = _bytes(blk, 2, c32, nmask) ^ 0x80  # int8 v as v + 128
            w = (_num(q) - 128.0) * _f16(blk, nmask)[:, None]
        elif TYPE == "Q2_K":  # 16 scale bytes, 64 bytes of 2-bit quants, d, dmin; dl * q - ml per 16 values
            q = (_bytes(blk, 16 + (c // 4) * 32, c32, nmask) >> (2 * (c % 4))) & 3
            s0 = _byte(blk, 2 * c, nmask)
            s1 = _byte(blk, 2 * c + 1, nmask)
            d = _f16(blk + 80, nmask)
            dmin = _f16(blk + 82, nmask)
            dl = _halves(c32, d * _num(s0 & 15), d * _num(s1 & 15))
            ml = _halves(c32, dmin * _num(s0 >> 4), dmin * _num(s1 >> 4))
            w = dl * _num(q) - ml
        elif TYPE == "Q3_K":  # 32 bytes of high bits (inverted), 64 of 2-bit quants, 12 of scales, d
            ql = (_bytes(blk, 32 + (c // 4) * 32, c32, nmask) >> (2 * (c % 4))) & 3
            hbit = (_bytes(blk, 0, c32, nmask) >> c) & 1
            d = _f16(blk + 108, nmask)
            dl = _halves(c32, d * _q3_scale(blk, 2 * c, nmask), d * _q3_scale(blk, 2 * c + 1, nmask))
            w = dl * (_num(ql | (hbit << 2)) - 4.0)  # ql - 4 * (1 - hbit)
        elif TYPE == "Q4_K" or TYPE == "Q5_K":  # d, dmin, 12 bytes of scales, (Q5_K: 32 of fifth bits,) nibbles
            sc, mn = _k_scale_min(blk, c, nmask)
            ds = _f16(blk, nmask) * sc
            dm = _f16(blk + 2, nmask) * mn
            if TYPE == "Q4_K":
                q = (_bytes(blk, 16 + (c // 2) * 32, c32, nmask) >> (4 * (c % 2))) & 15
            else:
                q = (_bytes(blk, 48 + (c // 2) * 32, c32, nmask) >> (4 * (c % 2))) & 15
                q = q | (((_bytes(blk, 16, c32, nmask) >> c) & 1) << 4)
            w = ds[:, None] * _num(q) - dm[:, None]
        elif TYPE == "IQ4_NL":  # d, 16 bytes: low nibbles are values 0-15, high 16-31; d * table[q]
            q = (_bytes(blk, 2, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = _f16(blk, nmask)[:, None] * _iq4(q)
        elif TYPE == "IQ4_XS":  # d, 16 high scale bits, 4 bytes of low scale nibbles, 8 x 16 bytes of nibbles
            low = (_byte(blk, 4 + c // 2, nmask) >> (4 * (c % 2))) & 15
            high = ((_byte(blk, 2 + c // 4, nmask) >> (2 * (c % 4))) & 3)  # scales_h (uint16): bits 2c, 2c + 1
            dl = _f16(blk, nmask) * (_num(low | (high << 4)) - 32.0)  # (BN,)
            q = (_bytes(blk, 8 + 16 * c, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = dl[:, None] * _iq4(q)
        else:
            tl.static_assert(TYPE == "Q6_K", "offspec: no GPU decoder for this ggml type")
            # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values), d
            h: tl.constexpr = c // 4
            r: tl.constexpr = c % 4
            lo = (_bytes(blk, h * 64 + (r % 2) * 32, c32, nmask) >> (4 * (r // 2))) & 15
            hi = (_bytes(blk, 128 + h * 32, c32, nmask) >> (2 * r)) & 3
            d = _f16(blk + 208, nmask)
            s0 = _num(_byte(blk, 192 + 2 * c, nmask) ^ 0x80) - 128.0
            s1 = _num(_byte(blk, 193 + 2 * c, nmask) ^ 0x80) - 128.0
            w = _halves(c32, d * s0, d * s1) * (_num(lo | (hi << 4)) - 32.0)
        return w
