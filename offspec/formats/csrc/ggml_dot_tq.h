// TQ1_0 and TQ2_0 (ternary weights, BitNet-style) in KBlock's interface (ggml_dot.h), so that ksums, ksums512,
// ktile and kwtile run them as they run the K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's
// 256 products summed in integers, then one float step per super-block (KSteps: acc = fma(isum, d * dx, acc); ggml's
// sumf += isum * (d * dy)). Included by ggml_dot.h.
//
// Both types store a digit t per weight, w = d (t - 1): TQ2_0 two bits (t in 0..3: ggml's encoder writes 0..2, and a
// 3 means 2d in its decoder and its dot product alike), TQ1_0 base-3 digits packed five (or four) to a byte. The
// kernels multiply the digits as they are (unsigned bytes: maddubs/dpbusd need no sign trick, and there are no
// sub-block scales: Scales is all ones) and take the -1 as the super-block's activation sum, subtracted from the same
// integer sum (less_xsum: isum = sum t x - sum x = sum (t - 1) x). That is the one addition to KBlock's interface:
// ksums and ksums512 call less_xsum for the types where `ternary` holds, and no other type's code changes.
// Every sum is exact: a maddubs pair sum is at most 2 * 3 * 128, and |isum| <= 256 * 3 * 128 < 2^18.
#pragma once

namespace offspec {

constexpr bool ternary(int64_t type) { return type == TQ1_0 || type == TQ2_0; }

// is less the sum of a super-block's 256 activations, given as its 8 sums per 32 (XSet::s; min_sums' pointer)
#ifdef OFFSPEC_AVX2
inline __m256i less_xsum(__m256i is, const int32_t* s8) {
  return _mm256_sub_epi32(is, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8)));
}
#else
inline int32_t less_xsum(int32_t is, const int32_t* s8) {
  for (int j = 0; j < 8; j++) is -= s8[j];
  return is;
}
#endif

#ifndef OFFSPEC_AVX2
inline int32_t isum_plain(const QVec& q, XVec xq) {  // the 32 products of one sub-block, unscaled
  int32_t s = 0;
  for (int l = 0; l < 32; l++) s += (int32_t)q.v[l] * xq[l];
  return s;
}
#endif

// The interface both ternary types share: no sub-block scales, no minimums; 32 digits of a sub-block against 32
// activations as 8 int32 lanes (AVX2) or one int32 (scalar).
struct TernaryScales {
#ifdef OFFSPEC_AVX2
  using Scales = __m256i;  // all ones (ksums passes them; the products need none)
  Scales scales(int) const { return _mm256_set1_epi16(1); }
  static __m256i isum(__m256i t, Scales, __m256i x) { return dot_us(t, x); }
#else
  using Scales = int;
  Scales scales(int j) const { return j; }
  static int32_t isum(const QVec& t, Scales, XVec xq) { return isum_plain(t, xq); }
#endif
  static constexpr bool MIN = false;
  float dmin = 0.0f;
  int min_vec() const { return 0; }  // MIN is false: never called
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

// TQ2_0 (66 bytes): qs[64], d. Sub-block j = h*4 + s covers elements h*128 + s*32 .. +32, the bits 2s, 2s+1 of the
// 32 bytes qs[h*32 ..] (ggml_decode_iq.h: dec_tq2_0), as Q2_K's quants.
template <>
struct KBlock<TQ2_0> : TernaryScales {
  static constexpr int64_t BYTES = 66;
  const uint8_t* blk;
  float d;
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p + 64)) {}
  QVec q(int j) const {  // the 32 digits of sub-block j, 0 .. 3
#ifdef OFFSPEC_AVX2
    return _mm256_and_si256(_mm256_srli_epi16(load32u(blk + (j / 4) * 32), 2 * (j % 4)), _mm256_set1_epi8(3));
#else
    QVec r;
    for (int l = 0; l < 32; l++) r.v[l] = (int8_t)((blk[(j / 4) * 32 + l] >> (2 * (j % 4))) & 3);
    return r;
#endif
  }
#ifdef OFFSPEC_AVX512
  __m512i pair(int j) const {  // sub-blocks j, j + 1 (j even): bits 2s of the 32 bytes low, bits 2s + 2 high
    const int s = j % 4;
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * s)), _mm256_set1_epi16((short)(2 * s + 2)), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32u(blk + (j / 4) * 32)), shift),
                            _mm512_set1_epi8(3));
  }
#endif
};

// TQ1_0 (54 bytes): qs[48], qh[4], d. Digit k of a byte b is the leading base-3 digit of (uint8)(b * 3^k):
// ((uint8)(b * 3^k) * 3) >> 8, that is 0 up to 85, 1 up to 170, 2 above (ggml_decode_iq.h: tq1_digit). Elements
// 0 .. 160 are digit k of qs[l] at 32k + l (sub-blocks 0 .. 4: digit j of the 32 bytes qs[0 .. 32)), 160 .. 240 digit
// k of qs[32 + l] at 160 + 16k + l, 240 .. 256 digit k of qh[l] at 240 + 4k + l. So sub-block j >= 5 is two halves of
// 16: 5 = digits 0, 1 of qs[32 .. 48), 6 = digits 2, 3, 7 = digit 4 and then qh's 4 bytes repeated with digits
// 0, 0, 0, 0, 1, 1, 1, 1, .. 3 (src and mult below: the bytes and the power of 3 of each 16-bit lane).
template <>
struct KBlock<TQ1_0> : TernaryScales {
  static constexpr int64_t BYTES = 54;
  const uint8_t* blk;
  float d;
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p + 52)) {}
#ifdef OFFSPEC_AVX2
  __m256i src(int j) const {  // the 32 bytes whose digits sub-block j holds
    if (j < 5) return load32u(blk);
    const __m128i mid = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32));
    if (j < 7) return _mm256_set_m128i(mid, mid);
    uint32_t h;
    std::memcpy(&h, blk + 48, 4);
    return _mm256_set_m128i(_mm_set1_epi32((int)h), mid);
  }
  static __m256i mult(int j) {  // 3^k of each 16-bit lane (both of its bytes take the same digit)
    constexpr short P[5] = {1, 3, 9, 27, 81};
    if (j < 5) return _mm256_set1_epi16(P[j]);
    if (j < 7) return _mm256_set_m128i(_mm_set1_epi16(P[2 * j - 9]), _mm_set1_epi16(P[2 * j - 10]));
    return _mm256_set_m128i(_mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27), _mm_set1_epi16(81));
  }
  // the digits of the bytes v (the bytes times their powers, modulo 256): (v > 85) + (v > 170), unsigned
  static __m256i digits(__m256i v) {
    const __m256i vs = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  // unsigned order as signed
    const __m256i ge1 = _mm256_cmpgt_epi8(vs, _mm256_set1_epi8(85 - 128));
    const __m256i ge2 = _mm256_cmpgt_epi8(vs, _mm256_set1_epi8(170 - 128));
    return _mm256_sub_epi8(_mm256_sub_epi8(_mm256_setzero_si256(), ge1), ge2);  // the compares' -1s counted
  }
  // bytes s times the powers p of their 16-bit lanes, modulo 256: the low byte of a lane's product is exact, the high
  // byte's is exact where the low byte is cleared first (no carry into it)
  static __m256i times(__m256i s, __m256i p) {
    const __m256i high = _mm256_set1_epi16((short)0xFF00);
    return _mm256_blendv_epi8(_mm256_mullo_epi16(s, p), _mm256_mullo_epi16(_mm256_and_si256(s, high), p), high);
  }
  QVec q(int j) const { return digits(j == 0 ? src(0) : times(src(j), mult(j))); }  // 0 .. 2
#else
  QVec q(int j) const {
    static constexpr int P[5] = {1, 3, 9, 27, 81};
    QVec r;
    for (int l = 0; l < 32; l++) {
      const int e = 32 * j + l;  // the element
      const int byte = e < 160 ? l : e < 240 ? 32 + (e - 160) % 16 : 48 + (e - 240) % 4;
      const int k = e < 160 ? j : e < 240 ? (e - 160) / 16 : (e - 240) / 4;
      r.v[l] = (int8_t)(tq1_digit(blk[byte], P[k]) + 1);
    }
    return r;
  }
#endif
#ifdef OFFSPEC_AVX512
  __m512i pair(int j) const {  // sub-blocks j, j + 1 (j even), j low
    const __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(src(j)), src(j + 1), 1);
    const __m512i p = _mm512_inserti64x4(_mm512_castsi256_si512(mult(j)), mult(j + 1), 1);
    const __m512i high = _mm512_set1_epi16((short)0xFF00);  // times(), two registers' worth
    const __m512i v = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_mullo_epi16(s, p),
                                             _mm512_mullo_epi16(_mm512_and_si512(s, high), p));
    const __m512i one = _mm512_set1_epi8(1);  // digits(): 1 above 85, 2 above 170
    const __m512i ge1 = _mm512_maskz_mov_epi8(_mm512_cmpgt_epu8_mask(v, _mm512_set1_epi8(85)), one);
    return _mm512_mask_add_epi8(ge1, _mm512_cmpgt_epu8_mask(v, _mm512_set1_epi8((char)170)), ge1, one);
  }
#endif
};

}  // namespace offspec
