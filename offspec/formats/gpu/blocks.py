"""ggml block decoders as Triton functions: 32 values of a (BN,) set of weight rows at a time.

`chunk(TYPE, blk, c, nmask, kmask, table)` returns the (BN, 32) float32 values of chunk `c` (values 32c .. 32c + 31)
of the unit whose first byte each row's `blk` points at. A unit is a ggml block (32 or 256 values; the float types: 32
values). The arithmetic is dequant.py's (the gguf package's reference decoder), so the values are bitwise the CPU
decode's: every product in it is exact in float32 (an fp16 scale of 11 significant bits times a scale of at most 7
bits times a quant of at most 6: at most 24 bits), so the one rounding of a fused multiply-add and the two of a
multiply then an add give the same bits, and the GPU compiler may fuse them freely.

Integers become floats through the exponent trick (2**23 + q read as a float32, minus 2**23: exact for
0 <= q < 2**23): an OR and an add at full rate, where a conversion instruction runs at a sixteenth of it.

IQ4_NL and IQ4_XS (the usual 70B files) are decoded from the gguf package's reference arithmetic (a value is d times
a 16-entry table's entry, exact too); the table is read out of four 32-bit words, (entry + 128) a byte each. MXFP4
(gpt-oss's experts) is IQ4_NL's kind: its own table (twice the FP4 numbers, at most 12: 4 bits) the same way, and for
d an E8M0 exponent, 2**(e - 128) built from its float bits as gguf builds it (e < 2: a subnormal); a power of 2 times
the entry is exact wherever it is finite.

The lattice types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: a 70B in IQ2 is what a 24 GB card runs)
index gguf's grids, rows of 8 or 4 small values, 256 to 2,048 rows: 1 to 16 KB as int8. They reach the kernel as a
pointer argument `table` (linear.lattice: a device tensor made once), and each value is gathered from it per lane, a
byte through the L1 cache. Constants would not do: a 2,048-row table written as selects is thousands of instructions
per value, and a register-resident table does not fit a thread's 255 registers. Gathered from global memory, the
grids take neither shared memory nor registers beyond the row index (the decoded tiles change layout through shared
memory on the way to the tensor cores, 4 KB a chunk in bfloat16: linear.tiles), and every configuration is compiled
for every card's limits by tests/test_gpu_aot.py. The sign patterns (gguf's ksigns: seven bits and their parity) are
computed, not read. The products are exact as above: IQ2's d * (0.5 + s) / 4 (11 x 5 significant bits) times a grid
value of at most 43 (6 bits), IQ3_XXS's d * (0.5 + s) / 2 times at most 62, IQ3_S's d * (1 + 2s) times at most 15,
IQ1's d * (2s + 1) (11 x 4) times grid + delta (-1, 0 or 1 plus +-1/8: 4 bits). TQ1_0 and TQ2_0 are d times -1, 0
or 1 (TQ2_0: or 2).

Adding a type: its unit and bytes in `UNITS`, a branch in `chunk`, and a check against the reference decode in
tests/test_gpu_kernels.py (which also checks that every type of ggml.KERNEL_NAMES has one).
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
    "IQ1_S": Unit(256, 50, 8), "IQ1_M": Unit(256, 56, 8), "IQ2_XXS": Unit(256, 66, 8), "IQ2_XS": Unit(256, 74, 8),
    "IQ2_S": Unit(256, 82, 8), "IQ3_XXS": Unit(256, 98, 8), "IQ3_S": Unit(256, 110, 8), "TQ1_0": Unit(256, 54, 8),
    "TQ2_0": Unit(256, 66, 8), "MXFP4": Unit(32, 17, 1),
}
# the lattice types: their grid's values per row (gguf's tables, reaching the kernels as a small device tensor)
GRID_WIDTH = {"IQ1_S": 8, "IQ1_M": 8, "IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8, "IQ3_XXS": 4, "IQ3_S": 4}

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
    def _table16(q, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
        """A 16-entry int8 table at q (0 .. 15, any integer tensor) as float32: (entry + 128) is a byte of one of
        four words, W0 entries 0-3, W1 4-7, W2 8-11, W3 12-15."""
        qq = q.to(tl.int64)
        lo = tl.where(qq < 4, tl.full([1, 1], W0, tl.int64), tl.full([1, 1], W1, tl.int64))
        hi = tl.where(qq < 12, tl.full([1, 1], W2, tl.int64), tl.full([1, 1], W3, tl.int64))
        word = tl.where(qq < 8, lo, hi)
        return _num((word >> ((qq & 3) * 8)) & 255) - 128.0

    @triton.jit
    def _iq4(q):
        """IQ4_NL's table (gguf: IQ4_NL.kvalues) at q as float32."""
        return _table16(q, 0x3F2D1801, 0x766A5D4F, 0xA6998D81, 0xF1D9C5B5)

    @triton.jit
    def _mxfp4(q):
        """MXFP4's table (gguf: MXFP4.kvalues, 0 .. 12 and -0 .. -12 as int8) at q as float32: entry 8 is an integer
        0, so +0.0 (a sign bit would make it -0.0, and d * -0.0 not gguf's)."""
        return _table16(q, 0x83828180, 0x8C888684, 0x7D7E7F80, 0x74787A7C)

    @triton.jit
    def _e8m0_half(e):
        """MXFP4's E8M0 exponents e (BN,) uint8 -> 2**(e - 128) as float32 (BN,), gguf's bits: e < 2 the subnormal
        0x00200000 << e, else the exponent field e - 1 (e = 255: 2**127)."""
        e32 = e.to(tl.int32)
        return tl.where(e32 < 2, (e32 + 1) << 21, (e32 - 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _u16(blk, offset, nmask):
        """(BN,) little-endian uint16 at blk + offset, as uint32."""
        return _byte(blk, offset, nmask).to(tl.uint32) | (_byte(blk, offset + 1, nmask).to(tl.uint32) << 8)

    @triton.jit
    def _each(blk, offset, c32, nmask):
        """(BN, 32): byte blk[offset] of each row, read for every value of the chunk (a row's lanes read one address:
        a broadcast load). Cheaper in registers than a (BN,) byte broadcast to the chunk: IQ1_S's 64-row bfloat16
        tiles took 255 registers and spilled 64 B on sm_89 that way, 180 and none this way."""
        return _bytes(blk, offset, c32 * 0, nmask)

    @triton.jit
    def _u16s(blk, offset, word, nmask):
        """(BN, 32) little-endian uint16 words blk[:, offset + 2 * word] (word (32,): each value's word), as uint32."""
        lo = _bytes(blk, offset, 2 * word, nmask).to(tl.uint32)
        return lo | (_bytes(blk, offset + 1, 2 * word, nmask).to(tl.uint32) << 8)

    @triton.jit
    def _lattice(table, row, WIDTH: tl.constexpr, c32):
        """(BN, 32) float32: value c32 % WIDTH of grid row `row` (BN, 32) for each value, gathered from the type's
        grid (gguf's table: rows of WIDTH int8 values, read as bytes; int8 v as v + 128, as Q8_0's)."""
        v = tl.load(table + row.to(tl.int32) * WIDTH + (c32 % WIDTH)[None, :])
        return _num(v ^ 0x80) - 128.0

    @triton.jit
    def _ksign(index, c32):
        """(BN, 32): bit c32 % 8 of gguf's ksigns[index] (index (BN, 32) uint32, < 128: a value's group of 8's sign
        index): index's seven bits, then their parity."""
        p = index ^ (index >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        return ((index | ((p & 1) << 7)) >> (c32 % 8).to(tl.uint32)[None, :]) & 1

    @triton.jit
    def _signed(v, negative):
        """v, negated where `negative` (0 or 1) is 1: gguf's product with -1.0 or 1.0, exact (the sign bit)."""
        return (v.to(tl.uint32, bitcast=True) ^ (negative.to(tl.uint32) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _iq2_scales(blk, offset, c: tl.constexpr, d, c32, nmask):
        """IQ2_XS / IQ2_S: (BN, 32) d * (0.5 + s) * 0.25, s the nibble of the byte at offset + c for each 16 values of
        chunk c: the product of d (11 significant bits) and 0.5 + s (5 bits) is exact, and so is its quarter."""
        s = (_each(blk, offset + c, c32, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
        return d[:, None] * (_num(s) + 0.5) * 0.25

    @triton.jit
    def _pow3(e):
        """3**e for e (32,) in 0 .. 4."""
        return tl.where(e < 2, tl.where(e < 1, 1, 3), tl.where(e < 3, 9, tl.where(e < 4, 27, 81)))

    @triton.jit
    def _tq1(blk, offset, power, nmask):
        """TQ1_0: (BN, 32) trits -1, 0, 1 from bytes blk[offset] (offset (32,): per value): trit e (0-4) of a byte is
        ((byte * 3**e mod 256) * 3 >> 8) - 1, as gguf computes it (its uint8 products wrap); power: 3**e."""
        q = (_bytes(blk, 0, offset, nmask).to(tl.int32) * power) & 255
        return _num((q * 3) >> 8) - 1.0

    @triton.jit
    def chunk(TYPE: tl.constexpr, blk, c: tl.constexpr, nmask, kmask, table):
        """(BN, 32) float32: values 32c .. 32c + 31 of the unit at blk (BN,) (uint8 pointers), 0 where a row is
        outside nmask (BN,) or (float types) a value outside kmask (32,); `table`: the lattice types' grid (uint8
        pointer: GRID_WIDTH int8 values a row, linear.lattice), unused by the others."""
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
        elif TYPE == "MXFP4":  # an exponent e, 16 bytes: low nibbles are values 0-15, high 16-31; 2**(e-128) * table[q]
            q = (_bytes(blk, 1, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = _e8m0_half(_byte(blk, 0, nmask))[:, None] * _mxfp4(q)
        elif TYPE == "IQ4_XS":  # d, 16 high scale bits, 4 bytes of low scale nibbles, 8 x 16 bytes of nibbles
            low = (_byte(blk, 4 + c // 2, nmask) >> (4 * (c % 2))) & 15
            high = ((_byte(blk, 2 + c // 4, nmask) >> (2 * (c % 4))) & 3)  # scales_h (uint16): bits 2c, 2c + 1
            dl = _f16(blk, nmask) * (_num(low | (high << 4)) - 32.0)  # (BN,)
            q = (_bytes(blk, 8 + 16 * c, c32 % 16, nmask) >> (4 * (c32 // 16)).to(tl.uint8)[None, :]) & 15
            w = dl[:, None] * _iq4(q)
        elif TYPE == "IQ2_XXS":  # d; per 32 values 4 grid rows (a byte each), a word: 4 x 7 sign bits, a scale
            aux = _u32(blk, 6 + 8 * c, nmask)  # (BN,)
            db = _f16(blk, nmask) * (_num(aux >> 28) + 0.5) * 0.25  # exact: 11 x 5 significant bits, times 2**-2
            g = _lattice(table, _bytes(blk, 2 + 8 * c, c32 // 8, nmask), 8, c32)  # 8, 25 or 43
            index = (aux[:, None] >> (7 * (c32 // 8)).to(tl.uint32)[None, :]) & 127
            w = _signed(db[:, None] * g, _ksign(index, c32))  # 22 bits: exact
        elif TYPE == "IQ2_XS":  # d; 32 words (9-bit grid row, 7-bit sign index) per 8 values; a scale per 16
            words = _u16s(blk, 2 + 8 * c, c32 // 8, nmask)  # (BN, 32)
            db = _iq2_scales(blk, 66, c, _f16(blk, nmask), c32, nmask)
            g = _lattice(table, words & 511, 8, c32)
            w = _signed(db * g, _ksign(words >> 9, c32))
        elif TYPE == "IQ2_S":  # d; 32 low bytes of grid rows, 32 sign bytes, 8 bytes of 2 high bits, 8 of scales
            high = (_each(blk, 66 + c, c32, nmask) >> (2 * (c32 // 8)).to(tl.uint8)[None, :]) & 3
            row = _bytes(blk, 2 + 4 * c, c32 // 8, nmask).to(tl.int32) | (high.to(tl.int32) << 8)
            negative = (_bytes(blk, 34 + 4 * c, c32 // 8, nmask) >> (c32 % 8).to(tl.uint8)[None, :]) & 1
            w = _signed(_iq2_scales(blk, 74, c, _f16(blk, nmask), c32, nmask) * _lattice(table, row, 8, c32), negative)
        elif TYPE == "IQ3_XXS":  # d; 64 grid rows (a byte per 4 values), per 32 values a word of signs and scale
            aux = _u32(blk, 66 + 4 * c, nmask)  # (BN,)
            db = _f16(blk, nmask) * (_num(aux >> 28) + 0.5) * 0.5  # exact: 11 x 5 significant bits, times 2**-1
            g = _lattice(table, _bytes(blk, 2 + 8 * c, c32 // 4, nmask), 4, c32)  # 4 .. 62
            index = (aux[:, None] >> (7 * (c32 // 8)).to(tl.uint32)[None, :]) & 127
            w = _signed(db[:, None] * g, _ksign(index, c32))  # 22 bits: exact
        elif TYPE == "IQ3_S":  # d; 64 low bytes of grid rows, 8 bytes of ninth bits, 32 sign bytes, 4 of scales
            high = (_each(blk, 66 + c, c32, nmask) >> (c32 // 4).to(tl.uint8)[None, :]) & 1
            row = _bytes(blk, 2 + 8 * c, c32 // 4, nmask).to(tl.int32) | (high.to(tl.int32) << 8)
            negative = (_bytes(blk, 74 + 4 * c, c32 // 8, nmask) >> (c32 % 8).to(tl.uint8)[None, :]) & 1
            s = (_each(blk, 106 + c // 2, c32, nmask) >> (4 * (c % 2))) & 15
            db = _f16(blk, nmask)[:, None] * _num(1 + 2 * s)  # d * (1 + 2s): 11 x 5 significant bits
            w = _signed(db * _lattice(table, row, 4, c32), negative)  # grid 1 .. 15: 20 bits
        elif TYPE == "IQ1_S":  # d; 32 low bytes of grid rows; per 32 values a word: 4 x 3 high bits, scale, delta
            qh = _u16s(blk, 34 + 2 * c, c32 * 0, nmask)  # (BN, 32): the chunk's word, for every value (see _each)
            high = (qh >> (3 * (c32 // 8)).to(tl.uint32)[None, :]) & 7
            row = _bytes(blk, 2 + 4 * c, c32 // 8, nmask).to(tl.int32) | (high.to(tl.int32) << 8)
            dl = _f16(blk, nmask)[:, None] * _num(2 * ((qh >> 12) & 7) + 1)  # 11 x 4 significant bits
            delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
            w = dl * (_lattice(table, row, 8, c32) + delta)  # -1, 0, 1 +-1/8: 4 bits; 19 in all
        elif TYPE == "IQ1_M":  # 32 low bytes of grid rows, 16 of (3 high bits, delta) nibbles, 4 words of scales
            dbits = (_byte(blk, 49, nmask) >> 4).to(tl.uint16)  # d: the top nibbles of the 4 words, lowest first
            for i in tl.static_range(1, 4):
                dbits = dbits | ((_byte(blk, 49 + 2 * i, nmask) >> 4).to(tl.uint16) << (4 * i))
            d = dbits.to(tl.float16, bitcast=True).to(tl.float32)
            sw = _u16(blk, 48 + 2 * (c // 2), nmask)  # (BN,) the word of scales 2c and 2c + 1 (3 bits each)
            s0 = (sw >> (6 * (c % 2))) & 7
            s1 = (sw >> (6 * (c % 2) + 3)) & 7
            dl = _halves(c32, d * _num(2 * s0 + 1), d * _num(2 * s1 + 1))  # a scale per 16 values
            nib = (_bytes(blk, 32 + 2 * c, c32 // 16, nmask) >> (4 * ((c32 // 8) % 2)).to(tl.uint8)[None, :]) & 15
            row = _bytes(blk, 4 * c, c32 // 8, nmask).to(tl.int32) | ((nib & 7).to(tl.int32) << 8)
            delta = tl.where((nib & 8) == 0, 0.125, -0.125)
            w = dl * (_lattice(table, row, 8, c32) + delta)  # as IQ1_S: exact
        elif TYPE == "TQ1_0":  # 48 bytes of 5 trits, 4 of 4 trits, d: value i of byte b is trit i of b's base-3 digits
            if c < 5:  # bytes 0-31, digit c
                t = _tq1(blk, c32, (1, 3, 9, 27, 81)[c], nmask)
            elif c < 7:  # bytes 32-47, digits 2(c - 5) and 2(c - 5) + 1
                t = _tq1(blk, 32 + c32 % 16, _pow3(2 * (c - 5) + c32 // 16)[None, :], nmask)
            else:  # bytes 32-47 digit 4, then bytes 48-51 digits 0-3
                t = _tq1(blk, tl.where(c32 < 16, 32 + c32, 48 + c32 % 4),
                         _pow3(tl.where(c32 < 16, 4, (c32 - 16) // 4))[None, :], nmask)
            w = _f16(blk + 52, nmask)[:, None] * t
        elif TYPE == "TQ2_0":  # 64 bytes of 2-bit values (q - 1), d
            q = (_bytes(blk, 32 * (c // 4), c32, nmask) >> (2 * (c % 4))) & 3
            w = _f16(blk + 64, nmask)[:, None] * (_num(q) - 1.0)
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
