// IQ1_S and IQ1_M in KBlock's interface (ggml_dot.h), so that ksums, ksums512, ktile and kwtile run them as they
// run the K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's products summed in integers with
// its scales applied in integers, then KSteps' float steps. Included by ggml_dot.h.
//
// Both types store each group of 8 weights as an index into a ternary lattice grid (2048 entries of 8 values in
// -1, 0, 1: the gguf package's table, ggml_decode_iq.h: grid_of), shifted by a delta of +-1/8: w = d * ls * (g + delta)
// with an odd scale ls = 2s + 1. ggml (vec_dot_iq1_s_q8_K, vec_dot_iq1_m_q8_K) sums ls * g * x and, apart, the delta
// times ls and the activations' sums, then takes sumi + sumi1 / 8 in float; that is exact, and so is the one integer
// sum here: the delta folded into the weights, q = 8 g + 8 delta = 8 g +- 1 in [-9, 9], isum = sum ls * q * x, and
// d / 8 in the float step (a power of two: exact). No interface change: the weights are signed int8 as Q6_K's, the
// scales per 32 (IQ1_S) or per 16 (IQ1_M, as Q3_K's), no minimums. Every sum is exact: a maddubs pair sum is at
// most 2 * 9 * 128, and a super-block's |isum| <= 256 * 9 * 128 * 15 < 2^23.
//
// The AVX-512 kernels (ggml_dot512.h: ksigned2) take a pair of sub-blocks (64 weights, 8 grid entries) per
// register, as magnitudes and a mask of the negative weights.
#pragma once

namespace offspec {

#ifdef OFFSPEC_AVX2
// grid entries i[0 .. 4) (8 values each) as 32 bytes: one 64-bit load each, the indices computed in general
// registers (vector-computed indices and a gather ran the AVX-512 kernel 1.1x slower: a longer chain to the loads)
inline __m256i grid8_x4(const int8_t* grid, const uint32_t* i) {
  long long w[4];
  for (int k = 0; k < 4; k++) std::memcpy(&w[k], grid + 8 * (size_t)i[k], 8);
  return _mm256_setr_epi64x(w[0], w[1], w[2], w[3]);
}
#endif

#if defined(OFFSPEC_AVX2) && !defined(OFFSPEC_AVX512)  // the AVX2 kernels: a sub-block at a time
// 8 g for ternary bytes g (-1, 0, 1): the 16-bit shift's carries into the next byte are masked off
inline __m256i times8(__m256i g) { return _mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8((char)0xF8)); }

// 8 x int32: ls * the products of 32 weights q (-9 .. 9) with x (the sign trick; exact, see the top)
inline __m256i isum_shifted(__m256i q, __m256i sv, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
}
#endif

#ifdef OFFSPEC_AVX512
inline __m512i times8(__m512i g) { return _mm512_and_si512(_mm512_slli_epi16(g, 3), _mm512_set1_epi8((char)0xF8)); }

// the 8 grid entries i[0 .. 8) of a sub-block pair as 64 bytes
inline __m512i grid8_x8(const int8_t* grid, const uint32_t* i) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(grid8_x4(grid, i)), grid8_x4(grid, i + 4), 1);
}

// the 64 weights q of a sub-block pair as magnitudes and negative lanes
inline void signed_pair(__m512i q, __m512i& mag, __mmask64& neg) {
  mag = _mm512_abs_epi8(q);
  neg = _mm512_movepi8_mask(q);
}
#endif

#ifndef OFFSPEC_AVX2
// the scalar weights 8 g + 8 delta of one grid entry
inline void shifted_entry(const int8_t* e, bool minus, int8_t* out) {
  for (int v = 0; v < 8; v++) out[v] = (int8_t)(8 * e[v] + (minus ? -1 : 1));
}
#endif

// IQ1_S (50 bytes): d, qs[32] (the low 8 bits of 32 grid indices), qh[8] (16 bits per sub-block: the indices' top
// 3 bits, 3 per entry, then the scale s in bits 12-14 and the delta's sign in bit 15).
template <>
struct KBlock<IQ1_S> {
  static constexpr int64_t BYTES = 50;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
  const int8_t* grid;
  // grid entry k of sub-block j: bits 3k .. 3k+2 of the sub-block's word shifted straight to bits 8-10
  uint32_t index(int j, int k) const {
    const uint32_t h = u16_at(blk + 34 + 2 * j);
    return blk[2 + 4 * j + k] | ((k < 3 ? h << (8 - 3 * k) : h >> 1) & 0x700);
  }
#ifdef OFFSPEC_AVX512
  __m512i ls32;     // int32 lanes 0 .. 8: the sub-block scales 2s + 1
  __m512i delta32;  // int32 lanes 0 .. 8: the sub-block deltas, +-1 in each byte
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p) * 0.125f), grid(grid_of(IQ1_S)) {
    const __m256i qh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 34)));  // 8 words
    const __m256i s = _mm256_and_si256(_mm256_srli_epi32(qh, 12), _mm256_set1_epi32(7));
    ls32 = _mm512_castsi256_si512(_mm256_or_si256(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1)));
    const __m256i minus = _mm256_srai_epi32(_mm256_slli_epi32(qh, 16), 31);  // -1 where bit 15 is set
    delta32 = _mm512_castsi256_si512(_mm256_or_si256(minus, _mm256_set1_epi32(0x01010101)));
  }
  // sub-blocks j and j + 1 (j even): the scales (as ksums512 takes them), |q| and the mask of the negative q
  __m512i scales2(int j) const { return scales_pair(ls32, j); }  // (ggml_dot_iq3.h)
  void pair(int j, __m512i& mag, __mmask64& neg) const {
    uint32_t i[8];
    for (int k = 0; k < 8; k++) i[k] = index(j + k / 4, k % 4);
    alignas(64) static const int32_t which[4][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
                                                     {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
                                                     {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
                                                     {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
    // bytes 0-31: sub-block j's delta, 32-63: j + 1's (the lanes loaded, as scales_pair's)
    const __m512i delta = _mm512_permutexvar_epi32(_mm512_load_si512(which[j / 2]), delta32);
    signed_pair(_mm512_add_epi8(times8(grid8_x8(grid, i)), delta), mag, neg);
  }
#else
  int16_t ls[8];  // the sub-block scales 2s + 1
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p) * 0.125f), grid(grid_of(IQ1_S)) {
    for (int j = 0; j < 8; j++) ls[j] = (int16_t)(2 * ((u16_at(p + 34 + 2 * j) >> 12) & 7) + 1);
  }
  bool minus(int j) const { return (u16_at(blk + 34 + 2 * j) & 0x8000) != 0; }
#ifdef OFFSPEC_AVX2
  // the 32 weights of sub-block j: 8 g +- 1
  QVec q(int j) const {
    uint32_t i[4];
    for (int k = 0; k < 4; k++) i[k] = index(j, k);
    return _mm256_add_epi8(times8(grid8_x4(grid, i)), _mm256_set1_epi8(minus(j) ? -1 : 1));
  }
  using Scales = __m256i;  // 16 x int16: the sub-block's scale
  Scales scales(int j) const { return _mm256_set1_epi16(ls[j]); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) { return isum_shifted(q, sv, x); }
#else
  QVec q(int j) const {
    QVec r;
    for (int k = 0; k < 4; k++) shifted_entry(grid + 8 * index(j, k), minus(j), r.v + 8 * k);
    return r;
  }
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_scaled(q, xq, ls[j]); }  // (ggml_dot_iq3.h)
#endif
#endif
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

// IQ1_M (56 bytes): qs[32] (the low 8 bits of 32 grid indices), qh[16] (a nibble per entry: the index's top 3 bits
// and the delta's sign in bit 3), scales[8] (4 words: 3-bit scales per 16 weights in bits 0-11, and d's 16 bits in
// the 4 top nibbles).
template <>
struct KBlock<IQ1_M> {
  static constexpr int64_t BYTES = 56;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
  const int8_t* grid;
  // grid entry e (0 .. 32): its nibble's low 3 bits shifted straight to bits 8-10
  uint32_t index(int e) const {
    const uint32_t h = blk[32 + e / 2];
    return blk[e] | ((e % 2 ? h << 4 : h << 8) & 0x700);
  }
  static float scale_d(const uint8_t* p) {  // d, from the top nibbles of the 4 scale words
    uint16_t s[4];
    std::memcpy(s, p + 48, 8);
    const uint16_t bits = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00) | (s[3] & 0xF000));
    uint8_t h[2];
    std::memcpy(h, &bits, 2);
    return half_at(h);
  }
#ifdef OFFSPEC_AVX512
  explicit KBlock(const uint8_t* p) : blk(p), d(scale_d(p) * 0.125f), grid(grid_of(IQ1_M)) {}
  // sub-blocks j and j + 1 (j even): their 4 scales per 16, all in scale word j / 2 (bits 0-11), 8 lanes each
  __m512i scales2(int j) const {
    alignas(64) static const int16_t shift[32] = {0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3,
                                                  6, 6, 6, 6, 6, 6, 6, 6, 9, 9, 9, 9, 9, 9, 9, 9};
    const __m512i word = _mm512_set1_epi16((short)u16_at(blk + 48 + j));
    const __m512i s = _mm512_and_si512(_mm512_srlv_epi16(word, _mm512_load_si512(shift)), _mm512_set1_epi16(7));
    return _mm512_or_si512(_mm512_slli_epi16(s, 1), _mm512_set1_epi16(1));
  }
  void pair(int j, __m512i& mag, __mmask64& neg) const {
    // the deltas' signs: 128-bit lane L (entries 4j + 2L, + 1) tests bits 3 and 7 of qh byte 2j + L
    const __m512i spread = _mm512_set_epi64(0x0303030303030303LL, 0x0303030303030303LL, 0x0202020202020202LL,
                                            0x0202020202020202LL, 0x0101010101010101LL, 0x0101010101010101LL, 0, 0);
    const long long b3 = 0x0808080808080808LL, b7 = (long long)0x8080808080808080ULL;
    const __m512i bit = _mm512_set_epi64(b7, b3, b7, b3, b7, b3, b7, b3);
    const __m512i qh = _mm512_shuffle_epi8(_mm512_set1_epi32((int)u32_at(blk + 32 + 2 * j)), spread);
    uint32_t i[8];
    for (int k = 0; k < 8; k++) i[k] = index(4 * j + k);
    const __m512i plus = _mm512_add_epi8(times8(grid8_x8(grid, i)), _mm512_set1_epi8(1));  // 8 g + 1
    signed_pair(_mm512_mask_sub_epi8(plus, _mm512_test_epi8_mask(qh, bit), plus, _mm512_set1_epi8(2)), mag, neg);
  }
#else
  int16_t sc16[16];  // the scales per 16 weights, 2s + 1
  explicit KBlock(const uint8_t* p) : blk(p), d(scale_d(p) * 0.125f), grid(grid_of(IQ1_M)) {
    for (int g = 0; g < 16; g++) sc16[g] = (int16_t)(2 * ((u16_at(p + 48 + 2 * (g / 4)) >> (3 * (g % 4))) & 7) + 1);
  }
#ifdef OFFSPEC_AVX2
  QVec q(int j) const {
    uint32_t i[4];
    for (int k = 0; k < 4; k++) i[k] = index(4 * j + k);
    // bytes 0-15 test bits 3 and 7 of qh byte 2j, bytes 16-31 those of byte 2j + 1: -1 where the delta is negative
    const __m256i spread = _mm256_setr_epi64x(0, 0, 0x0101010101010101LL, 0x0101010101010101LL);
    const __m256i bit = _mm256_setr_epi64x(0x0808080808080808LL, (long long)0x8080808080808080ULL,
                                           0x0808080808080808LL, (long long)0x8080808080808080ULL);
    const __m256i qh = _mm256_shuffle_epi8(_mm256_set1_epi16((short)u16_at(blk + 32 + 2 * j)), spread);
    const __m256i minus = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
    return _mm256_add_epi8(times8(grid8_x4(grid, i)), _mm256_or_si256(minus, _mm256_set1_epi8(1)));
  }
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products
  Scales scales(int j) const { return _mm256_set_m128i(_mm_set1_epi16(sc16[2 * j + 1]), _mm_set1_epi16(sc16[2 * j])); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) { return isum_shifted(q, sv, x); }
#else
  bool minus(int e) const { return (blk[32 + e / 2] >> (4 * (e % 2))) & 8; }  // entry e's delta is -1/8
  QVec q(int j) const {
    QVec r;
    for (int k = 0; k < 4; k++) shifted_entry(grid + 8 * index(4 * j + k), minus(4 * j + k), r.v + 8 * k);
    return r;
  }
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_per16(q, xq, sc16 + 2 * j); }
#endif
#endif
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

}  // namespace offspec
