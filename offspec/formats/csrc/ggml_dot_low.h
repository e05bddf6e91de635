// Q2_K and Q3_K in KBlock's interface (ggml_dot.h), so that ksums, ksums512, ktile and kwtile run them as they run
// the other K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's products summed in integers with
// its sub-block scales applied in integers, then KSteps' float steps. Included by ggml_dot.h.
//
// Both types scale every 16 weights (two scales per sub-block of 32, as Q6_K): Scales holds a sub-block's two
// scales, 8 int16 each. Every integer sum is exact: the largest maddubs pair sum is 2 * 4 * 128, and a super-block's
// |isum| < 256 * 4 * 128 * 32 = 2^22.
//
// Sub-block j = h*4 + s covers elements h*128 + s*32 .. +32; its 2-bit quants are bits 2s, 2s+1 of the 32 bytes
// qs[h*32 ..], and Q3_K's high bits are bit j of hmask[0 .. 32) (ggml_decode.h: dec_q2_k, dec_q3_k). The AVX-512
// kernels take two sub-blocks per register (ggml_dot512.h: kq2, ksigned2, kscales2).
#pragma once

namespace offspec {

#ifndef OFFSPEC_AVX2
// The scalar products of a sub-block's 32 weights with 32 activations, each half of 16 times its scale (sc: 2).
inline int32_t isum_per16(const QVec& q, XVec xq, const int16_t* sc) {
  int32_t total = 0;
  for (int half = 0; half < 2; half++) {
    int32_t part = 0;
    for (int l = half * 16; l < half * 16 + 16; l++) part += (int32_t)q.v[l] * xq[l];
    total += part * sc[half];
  }
  return total;
}
#endif

// Q2_K (84 bytes): scales[16] (per 16 weights, low nibble scale, high nibble minimum), qs[64], d, dmin;
// w = d * sc * q - dmin * m with q in [0, 3] (unsigned). The minimums are per 16, so their term
// msum = sum_g m_g * sum(x_g) takes the activations' sums per 16 (XSet::s16, ggml's Q8_K bsums; min_sums).
template <>
struct KBlock<Q2_K> {
  static constexpr int64_t BYTES = 84;
  static constexpr bool MIN = true;
  const uint8_t* blk;
  float d, dmin;
  int16_t sc16[16];  // the scales (0 .. 15), as int16 for scales() and kscales2
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p + 80)), dmin(half_at(p + 82)) {
#ifdef OFFSPEC_AVX2
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc16), _mm256_cvtepu8_epi16(low));
#else
    for (int i = 0; i < 16; i++) sc16[i] = p[i] & 0x0F;
#endif
  }
  // the 32 weights of sub-block j: q in [0, 3]
  QVec q(int j) const {
#ifdef OFFSPEC_AVX2
    return _mm256_and_si256(_mm256_srli_epi16(load32u(blk + 16 + (j / 4) * 32), 2 * (j % 4)), _mm256_set1_epi8(3));
#else
    QVec r;
    for (int l = 0; l < 32; l++) r.v[l] = (int8_t)((blk[16 + (j / 4) * 32 + l] >> (2 * (j % 4))) & 3);
    return r;
#endif
  }
#ifdef OFFSPEC_AVX2
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products
  Scales scales(int j) const { return _mm256_set_m128i(_mm_set1_epi16(sc16[2 * j + 1]), _mm_set1_epi16(sc16[2 * j])); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sv); }
  // the 16 minimums as int16 in _mm256_packs_epi32's order of two vectors of 8 (min_prod packs the sums alike)
  __m256i min_vec() const {
    const __m128i m = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)), 4),
                                    _mm_set1_epi8(0x0F));
    return _mm256_packs_epi32(_mm256_cvtepu8_epi32(m), _mm256_cvtepu8_epi32(_mm_srli_si128(m, 8)));
  }
  // m_g * sum(x_g) for the 16 groups of 16, summed in pairs into 8 int32 lanes (exact: |sum(x_g)| <= 16 * 128 fits
  // int16, so the packs do not saturate)
  static __m256i min_prod(__m256i m, const int32_t* xsum16) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum16));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum16 + 8));
    return _mm256_madd_epi16(m, _mm256_packs_epi32(lo, hi));
  }
#else
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_per16(q, xq, sc16 + 2 * j); }
  int min_vec() const { return 0; }
  int32_t min_prod(int, const int32_t* xsum16) const {
    int32_t t = 0;
    for (int g = 0; g < 16; g++) t += (int32_t)(blk[g] >> 4) * xsum16[g];
    return t;
  }
#endif
};

// Q3_K (110 bytes): hmask[32], qs[64], scales[12] (16 six-bit scales, stored + 32), d; w = d * (scale - 32) * q
// with q = low2 - (hbit ? 0 : 4) in [-4, 3] (signed: the sign trick of Q6_K), no minimums.
template <>
struct KBlock<Q3_K> {
  static constexpr int64_t BYTES = 110;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
  int16_t sc16[16];  // the scales, -32 .. 31, as int16 for scales() and kscales2
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p + 108)) {
    // scale i: the low (i < 8) or high nibble of byte i % 8, and bits 2 * (i / 4) of byte 8 + i % 4 as its bits 4-5
    const uint8_t* sc = p + 96;
#ifdef OFFSPEC_AVX2
    const __m128i m4 = _mm_set1_epi8(0x0F), b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(b8, m4), _mm_and_si128(_mm_srli_epi16(b8, 4), m4));
    uint32_t top;
    std::memcpy(&top, sc + 8, 4);
    const __m128i two = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)top), _mm_setr_epi32(0, 2, 4, 6)),
                                      _mm_set1_epi8(3));
    const __m128i s = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(two, 4)), _mm_set1_epi8(32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc16), _mm256_cvtepi8_epi16(s));
#else
    for (int i = 0; i < 16; i++) {
      const int lo = i < 8 ? (sc[i] & 0x0F) : (sc[i - 8] >> 4), hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
      sc16[i] = (int16_t)((lo | (hi << 4)) - 32);
    }
#endif
  }
  // the 32 weights of sub-block j: q in [-4, 3]
  QVec q(int j) const {
#ifdef OFFSPEC_AVX2
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load32u(blk + 32 + (j / 4) * 32), 2 * (j % 4)),
                                        _mm256_set1_epi8(3));
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(load32u(blk), j), _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
#else
    QVec r;
    for (int l = 0; l < 32; l++) {
      const int lo = (blk[32 + (j / 4) * 32 + l] >> (2 * (j % 4))) & 3, hb = (blk[l] >> j) & 1;
      r.v[l] = (int8_t)((lo | (hb << 2)) - 4);
    }
    return r;
#endif
  }
#ifdef OFFSPEC_AVX2
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products
  Scales scales(int j) const { return _mm256_set_m128i(_mm_set1_epi16(sc16[2 * j + 1]), _mm_set1_epi16(sc16[2 * j])); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
  }
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
#else
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_per16(q, xq, sc16 + 2 * j); }
  int min_vec() const { return 0; }
#endif
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

}  // namespace offspec
