// IQ3_XXS and IQ3_S in KBlock's interface (ggml_dot.h), so that ksums, ksums512, ktile and kwtile run them as they
// run the K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's products summed in integers with
// its sub-block scales applied in integers, then KSteps' float steps (d * dx per super-block). Included by
// ggml_dot.h.
//
// Both types store each group of 4 weights as an index into a lattice grid of 4 small positive values (the gguf
// package's table, ggml_decode_iq.h: grid_of) and a sign bit per weight; a sub-block of 32 has one odd scale
// ls = 2 s + 1. The weight is d * ls * (+-grid value), IQ3_XXS's times 1/4 (folded into d: exact, a power of two),
// so a sub-block's integer sum is ls * sum(+-g * x), as ggml's vec_dot_iq3_xxs_q8_K / vec_dot_iq3_s_q8_K sum it.
// Every sum is exact: |g| <= 62 (IQ3_XXS; IQ3_S 15), a maddubs pair sum is at most 2 * 62 * 128 < 2^15, and a
// super-block's |isum| <= 256 * 62 * 128 * 31 < 2^26.
//
// The AVX-512 kernels (ggml_dot512.h: ksigned2) take a pair of sub-blocks (64 weights) per register, as
// magnitudes |g| and a mask of the negative ones; KBlock's constructor decodes the whole super-block's grid values
// there with 16-bit permutes of a nibble-coded grid (grid4_x32): IQ3_XXS's one-row products ran 1.6x faster than
// with the 64 entries loaded one by one (ggml's way), the 16 of a sub-block pair assembled from 32-bit loads.
#pragma once

#include <algorithm>

namespace offspec {

#ifdef OFFSPEC_AVX2
// IQ3_XXS's 32 sign bytes of a super-block from its 8 words aux_j: byte 4j + l = ksigns(bits 7l .. 7l+6 of aux_j),
// the 7 stored signs and their parity as the 8th (ggml_decode_iq.h: ksigns): the 4 fields moved into bytes, then
// the parity of each byte's two nibbles looked up (a byte shuffle each) and xored.
inline __m256i iq3xxs_sign_bytes(const uint8_t* aux) {
  const __m256i a = load32u(aux);
  const __m256i f01 = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7F)),
                                      _mm256_and_si256(_mm256_slli_epi32(a, 1), _mm256_set1_epi32(0x7F00)));
  const __m256i f23 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(a, 2), _mm256_set1_epi32(0x7F0000)),
                                      _mm256_and_si256(_mm256_slli_epi32(a, 3), _mm256_set1_epi32(0x7F000000)));
  const __m256i f = _mm256_or_si256(f01, f23);  // 32 bytes of 7 sign bits
  const __m256i parity = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0,
                                          0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i top = _mm256_xor_si256(_mm256_shuffle_epi8(parity, _mm256_and_si256(f, nib)),
                                       _mm256_shuffle_epi8(parity, _mm256_and_si256(_mm256_srli_epi16(f, 4), nib)));
  return _mm256_or_si256(f, top);
}
#endif

#ifdef OFFSPEC_AVX512
// A grid of 4-value entries (IQ3_XXS: 256, IQ3_S: 512) as 16-bit codes, a nibble per value (its place among the
// grid's distinct values, `values`): 32 entries are then looked up by 16-bit permutes of 64 codes each.
struct Grid4Codes {
  alignas(64) uint16_t code[512];
  alignas(16) int8_t values[16];
};

inline Grid4Codes make_grid4_codes(int64_t type) {
  const int8_t* g = grid_of(type);
  const int64_t n = grid_entries(type);
  std::vector<int8_t> distinct(g, g + 4 * n);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  TORCH_CHECK(distinct.size() <= 16 && distinct.front() >= 0, "offspec: the grid of ggml type ", type,
              " does not fit 4-bit codes of non-negative values");
  Grid4Codes c{};
  std::copy(distinct.begin(), distinct.end(), c.values);
  for (int64_t e = 0; e < n; e++)
    for (int k = 0; k < 4; k++) {
      const int64_t place = std::lower_bound(distinct.begin(), distinct.end(), g[4 * e + k]) - distinct.begin();
      c.code[e] |= (uint16_t)(place << (4 * k));
    }
  return c;
}

// built once, at first use, from the grid kernels.py handed over at load (gguf's fixed table)
template <int64_t T>
inline const Grid4Codes& grid4_codes() {
  static const Grid4Codes c = make_grid4_codes(T);
  return c;
}

// The 32 grid entries of the 16-bit indices idx (< 64 * PARTS) as 128 bytes of values: entries 0-15 in lo, 16-31 in
// hi. PARTS permutes of 64 codes each, then a tree of blends on the index bits 6 and up; a code's 4 nibbles are
// spread to 4 bytes (the 64-bit lanes reordered so that the byte unpacks keep the entries in order) and mapped to
// their values by a byte shuffle.
template <int PARTS>
inline void grid4_x32(const Grid4Codes& t, __m512i idx, __m512i& lo, __m512i& hi) {
  const __m512i* c = reinterpret_cast<const __m512i*>(t.code);
  __m512i r[PARTS];
  for (int k = 0; k < PARTS; k++)
    r[k] = _mm512_permutex2var_epi16(_mm512_load_si512(c + 2 * k), idx, _mm512_load_si512(c + 2 * k + 1));
  for (int bit = 6, n = PARTS; n > 1; bit++, n /= 2) {
    const __mmask32 high = _mm512_test_epi16_mask(idx, _mm512_set1_epi16((short)(1 << bit)));
    for (int k = 0; k < n / 2; k++) r[k] = _mm512_mask_blend_epi16(high, r[2 * k], r[2 * k + 1]);
  }
  // 64-bit lane 2q takes entries 4q .. 4q+3 and lane 2q+1 entries 16 + 4q ..: unpacklo then yields entries 0-15
  const __m512i codes = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), r[0]);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i even = _mm512_and_si512(codes, nib), odd = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nib);
  const __m512i values = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t.values)));
  lo = _mm512_shuffle_epi8(values, _mm512_unpacklo_epi8(even, odd));
  hi = _mm512_shuffle_epi8(values, _mm512_unpackhi_epi8(even, odd));
}

// The scales of sub-blocks j and j + 1 (j even) as ksums512 takes them (16 x int16 of each), from 8 int32 lanes of
// scales: their low halves, 16-bit words 2j and 2j + 2. The word indices are loaded (GCC built each in 5
// instructions: the AVX-512 IQ3_XXS kernel ran 1.1x faster with the table).
inline __m512i scales_pair(__m512i ls32, int j) {
  alignas(64) static const int16_t words[4][32] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
      {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6},
      {8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10},
      {12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14,
       14, 14, 14, 14}};
  return _mm512_permutexvar_epi16(_mm512_load_si512(words[j / 2]), ls32);
}
#endif

#if defined(OFFSPEC_AVX2) && !defined(OFFSPEC_AVX512)  // the AVX2 kernels: a sub-block at a time
// the grid entries i[0 .. 8) (4 values each) as 32 bytes, a 32-bit load each inserted into its lane (1.3x faster
// than pairs of them joined into 64-bit words first, in the AVX2 IQ3_XXS kernel's one-row products)
inline __m256i grid4_x8(const int8_t* grid, const int* i) {
  uint32_t w[8];
  for (int k = 0; k < 8; k++) std::memcpy(&w[k], grid + 4 * (size_t)i[k], 4);
  return _mm256_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3], (int)w[4], (int)w[5], (int)w[6], (int)w[7]);
}

// 32 sign bits (little endian at p) -> 32 bytes, -1 where the bit is set, else 0
inline __m256i negatives_32(const uint8_t* p) {
  uint32_t s;
  std::memcpy(&s, p, 4);
  // byte i of the result looks at byte i/8 of s and tests bit i%8 there
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)s), spread), bit), bit);
}

// 8 x int32: ls * the products of 32 signed weights q with x (IQ4_XS's sign trick; exact, see the top)
inline __m256i isum_signed_scaled(__m256i q, __m256i sv, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
}
#elif !defined(OFFSPEC_AVX2)
inline int32_t isum_scaled(const QVec& q, XVec xq, int16_t ls) {
  int32_t part = 0;
  for (int l = 0; l < 32; l++) part += (int32_t)q.v[l] * xq[l];
  return part * ls;
}
#endif

// IQ3_XXS (98 bytes): d, qs[64] (8 grid indices per sub-block), then a word aux_j per sub-block: 4 x 7 sign bits (8
// weights each, ksigns) and the 4-bit scale s in bits 28-31; w = d * (2s + 1) / 4 * (+-grid value).
template <>
struct KBlock<IQ3_XXS> {
  static constexpr int64_t BYTES = 98;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
#ifdef OFFSPEC_AVX512
  __m512i mag[4];   // |w| of sub-blocks 2p, 2p + 1 (grid values)
  uint64_t neg[4];  // their sign bits (iq3xxs_sign_bytes)
  __m512i ls32;     // int32 lanes 0 .. 8: the sub-block scales 2s + 1
  // always inlined: GCC called it out of line from ktile's 8-row tiles (1.05x slower)
  __attribute__((always_inline)) explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p) * 0.25f) {
    const __m256i aux = load32u(p + 66);
    const __m256i ls = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
    ls32 = _mm512_castsi256_si512(ls);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(neg), iq3xxs_sign_bytes(p + 66));
    const Grid4Codes& t = grid4_codes<IQ3_XXS>();
    for (int h = 0; h < 2; h++)
      grid4_x32<4>(t, _mm512_cvtepu8_epi16(load32u(p + 2 + 32 * h)), mag[2 * h], mag[2 * h + 1]);
  }
  // sub-blocks j and j + 1 (j even): the scales (as ksums512 takes them), the magnitudes and the negative weights
  __m512i scales2(int j) const { return scales_pair(ls32, j); }
  void pair(int j, __m512i& m, __mmask64& negative) const {
    m = mag[j / 2];
    negative = _cvtu64_mask64(neg[j / 2]);
  }
#else
  int16_t ls[8];  // the sub-block scales 2s + 1
  const int8_t* grid;
#ifdef OFFSPEC_AVX2
  alignas(32) uint8_t sg[32];  // the sign bits of the 256 weights (iq3xxs_sign_bytes)
#endif
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p) * 0.25f), grid(grid_of(IQ3_XXS)) {
    for (int j = 0; j < 8; j++) ls[j] = (int16_t)(2 * (u32_at(p + 66 + 4 * j) >> 28) + 1);
#ifdef OFFSPEC_AVX2
    _mm256_store_si256(reinterpret_cast<__m256i*>(sg), iq3xxs_sign_bytes(p + 66));
#endif
  }
#ifdef OFFSPEC_AVX2
  // the 32 weights of sub-block j, +-grid value
  QVec q(int j) const {
    int i[8];
    for (int k = 0; k < 8; k++) i[k] = blk[2 + 8 * j + k];
    const __m256i negative = negatives_32(sg + 4 * j);
    return _mm256_sub_epi8(_mm256_xor_si256(grid4_x8(grid, i), negative), negative);
  }
  using Scales = __m256i;  // 16 x int16: the sub-block's scale
  Scales scales(int j) const { return _mm256_set1_epi16(ls[j]); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) { return isum_signed_scaled(q, sv, x); }
#else
  QVec q(int j) const {
    QVec r;
    const uint32_t aux = u32_at(blk + 66 + 4 * j);
    for (int k = 0; k < 8; k++) {
      const int8_t* e = grid + 4 * blk[2 + 8 * j + k];
      const uint8_t s = ksigns((aux >> (7 * (k / 2))) & 0x7F) >> (4 * (k % 2));
      for (int v = 0; v < 4; v++) r.v[4 * k + v] = (int8_t)((s >> v) & 1 ? -e[v] : e[v]);
    }
    return r;
  }
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_scaled(q, xq, ls[j]); }
#endif
#endif
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

// IQ3_S (110 bytes): d, qs[64] (the low 8 bits of 64 grid indices), qh[8] (their 9th bits, a byte per sub-block),
// signs[32] (a bit per weight), scales[4] (a nibble s per sub-block); w = d * (2s + 1) * (+-grid value).
template <>
struct KBlock<IQ3_S> {
  static constexpr int64_t BYTES = 110;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
#ifdef OFFSPEC_AVX512
  __m512i mag[4];  // |w| of sub-blocks 2p, 2p + 1 (grid values)
  __m512i ls32;    // int32 lanes 0 .. 8: the sub-block scales 2s + 1
  __attribute__((always_inline)) explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p)) {  // (as IQ3_XXS's)
    const __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u32_at(p + 106)),
                                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(0x0F));
    ls32 = _mm512_castsi256_si512(_mm256_or_si256(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1)));
    const Grid4Codes& t = grid4_codes<IQ3_S>();
    for (int h = 0; h < 2; h++) {  // entries 32h + e: qh bit e of the 32 bits at qh + 4h
      const __m512i low = _mm512_cvtepu8_epi16(load32u(p + 2 + 32 * h));
      const __mmask32 high = _cvtu32_mask32(u32_at(p + 66 + 4 * h));
      const __m512i idx = _mm512_mask_add_epi16(low, high, low, _mm512_set1_epi16(256));  // low < 256: an or
      grid4_x32<8>(t, idx, mag[2 * h], mag[2 * h + 1]);
    }
  }
  __m512i scales2(int j) const { return scales_pair(ls32, j); }  // as KBlock<IQ3_XXS>'s; the stored sign bits
  void pair(int j, __m512i& m, __mmask64& negative) const {
    uint64_t bits;
    std::memcpy(&bits, blk + 74 + 4 * j, 8);
    m = mag[j / 2];
    negative = _cvtu64_mask64(bits);
  }
#else
  int16_t ls[8];  // the sub-block scales 2s + 1
  const int8_t* grid;
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p)), grid(grid_of(IQ3_S)) {
    for (int j = 0; j < 8; j++) ls[j] = (int16_t)(2 * ((p[106 + j / 2] >> (4 * (j % 2))) & 0x0F) + 1);
  }
  // grid entry k of sub-block j
  int index(int j, int k) const { return blk[2 + 8 * j + k] | ((blk[66 + j] >> k) & 1) << 8; }
#ifdef OFFSPEC_AVX2
  QVec q(int j) const {
    int i[8];
    for (int k = 0; k < 8; k++) i[k] = index(j, k);
    const __m256i negative = negatives_32(blk + 74 + 4 * j);
    return _mm256_sub_epi8(_mm256_xor_si256(grid4_x8(grid, i), negative), negative);
  }
  using Scales = __m256i;  // 16 x int16: the sub-block's scale
  Scales scales(int j) const { return _mm256_set1_epi16(ls[j]); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) { return isum_signed_scaled(q, sv, x); }
#else
  QVec q(int j) const {
    QVec r;
    for (int k = 0; k < 8; k++) {
      const int8_t* e = grid + 4 * index(j, k);
      const uint8_t s = blk[74 + 4 * j + k / 2] >> (4 * (k % 2));
      for (int v = 0; v < 4; v++) r.v[4 * k + v] = (int8_t)((s >> v) & 1 ? -e[v] : e[v]);
    }
    return r;
  }
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_scaled(q, xq, ls[j]); }
#endif
#endif
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

}  // namespace offspec
