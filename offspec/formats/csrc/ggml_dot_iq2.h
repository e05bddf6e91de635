// IQ2_XXS, IQ2_XS and IQ2_S in KBlock's interface (ggml_dot.h), so that ksums, ksums512, ktile and kwtile run them
// as they run the K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's products summed in integers
// with its scales applied in integers, then KSteps' float steps. Included by ggml_dot.h.
//
// The three types share one arithmetic (ggml's ggml_vec_dot_iq2_*_q8_K): weight w = d/8 * (2s + 1) * g * sign, g a
// value of a grid entry (8 magnitudes: 8, 25 or 43, gguf's tables handed over at load: grid_of), one sign bit per
// weight, s a 4-bit scale per 16 weights (IQ2_XXS: per 32). The decoders' (d * (0.5 + s)) * 0.25 is the same number
// (exact in float32: 11 by 5 significant bits), and so is d/8 (a power of two): d holds it, the integer scales 2s + 1
// (1 .. 31) multiply the products. Every integer sum is exact: the largest maddubs pair sum is 2 * 43 * 127 (int16
// holds it), and a super-block's |isum| <= 256 * 43 * 127 * 31 < 2^26.
//
// Per super-block the constructor unpacks what the sub-blocks share: the 256 sign bits (sg; IQ2_XXS's and IQ2_XS's
// 7-bit sign indices completed by their parity bit, ggml's ksigns) and the 16 integer scales (sc16). A sub-block's
// 32 weights are 4 grid entries fetched as 64-bit loads (mag) with the signs applied (AVX2: a byte mask from the sign
// bits; AVX-512, two sub-blocks per register (ggml_dot512.h ksigned2): the 64 sign bits are the mask register that
// negates the activations, mag2 / neg2).
#pragma once

namespace offspec {

constexpr bool iq2_type(int64_t t) { return t == IQ2_XXS || t == IQ2_XS || t == IQ2_S; }

#ifdef OFFSPEC_AVX2
// bytes v (< 128, a 7-bit sign index each) -> v with bit 7 its parity (ggml's ksigns), nibble by nibble in a table
inline __m256i with_parity(__m256i v) {
  const __m256i odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128,
                                                                -128, 0, 0, -128, 0, -128, -128, 0));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  return _mm256_or_si256(v, _mm256_xor_si256(_mm256_shuffle_epi8(odd, lo), _mm256_shuffle_epi8(odd, hi)));
}

// 8 bytes of 4-bit scales, 16 nibbles (low nibble first) -> the 16 integer scales 2s + 1 as int16
inline void nibble_scales(const uint8_t* p, int16_t* sc16) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i s = _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
  const __m256i w = _mm256_cvtepu8_epi16(s);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc16), _mm256_add_epi16(_mm256_add_epi16(w, w), _mm256_set1_epi16(1)));
}

// 32 sign bits (little endian) -> 32 bytes, 0xFF where the bit is set
inline __m256i sign_mask_32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // byte i of the result looks at byte i/8 of the bits, and tests bit i%8 there
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit);
  return _mm256_cmpeq_epi8(v, bit);
}

// grid entries a, b (8 bytes each), a in the low half
inline __m128i grid_pair(const int8_t* grid, uint32_t a, uint32_t b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(grid + 8 * a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grid + 8 * b)));
}
#endif

template <int64_t T>
struct IQ2Block {
  static constexpr int64_t BYTES = T == IQ2_XXS ? 66 : T == IQ2_XS ? 74 : 82;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  const int8_t* grid;
  float d, dmin = 0.0f;  // d: the block's scale / 8
  alignas(32) uint8_t sg[32];    // bit k of byte i: weight 8i + k is negative
  alignas(32) int16_t sc16[16];  // the integer scales 2s + 1 of each 16 weights (IQ2_XXS: each scale twice)

  explicit IQ2Block(const uint8_t* p) : blk(p), grid(grid_of(T)), d(half_at(p) * 0.125f) {
    if constexpr (T == IQ2_XXS) {  // sub-block j: 4 index bytes, then 4 x 7 sign bits and the scale (bits 28-31)
#ifdef OFFSPEC_AVX2
      const __m256 a = _mm256_castsi256_ps(load32u(p + 2)), b = _mm256_castsi256_ps(load32u(p + 34));
      // the 8 words of sign bits and scale, sub-block order (the odd 32-bit words of the 64 bytes)
      const __m256i w = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8);
      // byte k of word j: its sign index k (bits 7k .. 7k + 6), each moved to bits 8k .. 8k + 6
      const __m256i s7 = _mm256_set1_epi32(0x7F);
      __m256i idx = _mm256_and_si256(w, s7);
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 1), _mm256_slli_epi32(s7, 8)));
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 2), _mm256_slli_epi32(s7, 16)));
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 3), _mm256_slli_epi32(s7, 24)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sg), with_parity(idx));
      // 2s + 1 in both 16-bit halves of word j: sub-block j's two scales per 16
      const __m256i s4 = _mm256_srli_epi32(w, 28);
      const __m256i ls = _mm256_add_epi32(_mm256_add_epi32(s4, s4), _mm256_set1_epi32(1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), _mm256_or_si256(ls, _mm256_slli_epi32(ls, 16)));
#else
      for (int j = 0; j < 8; j++) {
        const uint32_t aux = u32_at(p + 2 + 8 * j + 4);
        for (int k = 0; k < 4; k++) sg[4 * j + k] = ksigns((aux >> (7 * k)) & 0x7F);
        sc16[2 * j] = sc16[2 * j + 1] = (int16_t)(2 * (aux >> 28) + 1);
      }
#endif
    } else if constexpr (T == IQ2_XS) {  // 32 words: a 9-bit grid index, a 7-bit sign index; 8 bytes of scales
#ifdef OFFSPEC_AVX2
      const __m256i lo = _mm256_srli_epi16(load32u(p + 2), 9), hi = _mm256_srli_epi16(load32u(p + 34), 9);
      _mm256_store_si256(reinterpret_cast<__m256i*>(sg),
                         with_parity(_mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8)));
      nibble_scales(p + 66, sc16);
#else
      for (int i = 0; i < 32; i++) sg[i] = ksigns(u16_at(p + 2 + 2 * i) >> 9);
      for (int h = 0; h < 16; h++) sc16[h] = (int16_t)(2 * ((p[66 + h / 2] >> (4 * (h % 2))) & 0x0F) + 1);
#endif
    } else {  // IQ2_S: qs[32] (index bits 0-7), signs[32], qh[8] (index bits 8-9, 2 per entry), 8 bytes of scales
      std::memcpy(sg, p + 34, 32);
#ifdef OFFSPEC_AVX2
      nibble_scales(p + 74, sc16);
#else
      for (int h = 0; h < 16; h++) sc16[h] = (int16_t)(2 * ((p[74 + h / 2] >> (4 * (h % 2))) & 0x0F) + 1);
#endif
    }
  }

  // the grid indices of sub-block j's 4 entries, packed: entry k is index(packed(j), k)
  uint64_t packed(int j) const {
    if constexpr (T == IQ2_XXS) {
      return u32_at(blk + 2 + 8 * j);  // 4 bytes
    } else if constexpr (T == IQ2_XS) {
      uint64_t v;  // 4 words
      std::memcpy(&v, blk + 2 + 8 * j, 8);
      return v;
    } else {  // 4 bytes of qs, then their 4 x 2 high bits
      return u32_at(blk + 2 + 4 * j) | (uint64_t)blk[66 + j] << 32;
    }
  }
  static uint32_t index(uint64_t v, int k) {
    if constexpr (T == IQ2_XXS) {
      return (uint32_t)(v >> (8 * k)) & 0xFF;
    } else if constexpr (T == IQ2_XS) {
      return (uint32_t)(v >> (16 * k)) & 0x1FF;
    } else {  // bits 8k .. 8k + 7, and bits 32 + 2k, 33 + 2k as bits 8, 9
      return ((uint32_t)(v >> (8 * k)) & 0xFF) | ((uint32_t)(v >> (24 + 2 * k)) & 0x300);
    }
  }

#ifdef OFFSPEC_AVX2
  // the 32 magnitudes of sub-block j (its 4 grid entries)
  __m256i mag(int j) const {
    const uint64_t v = packed(j);
    return _mm256_set_m128i(grid_pair(grid, index(v, 2), index(v, 3)), grid_pair(grid, index(v, 0), index(v, 1)));
  }
  // the 32 weights of sub-block j: magnitudes negated where their sign bit is set
  QVec q(int j) const {
    const __m256i neg = sign_mask_32(sg + 4 * j);
    return _mm256_sub_epi8(_mm256_xor_si256(mag(j), neg), neg);
  }
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products
  Scales scales(int j) const { return _mm256_set_m128i(_mm_set1_epi16(sc16[2 * j + 1]), _mm_set1_epi16(sc16[2 * j])); }
  static __m256i isum(__m256i q, Scales sv, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
  }
#ifdef OFFSPEC_AVX512
  // sub-blocks j and j + 1 (j even): their 64 magnitudes, j's in the low half, and their 64 sign bits (lane l of
  // the register: bit l)
  __m512i mag2(int j) const { return _mm512_inserti64x4(_mm512_castsi256_si512(mag(j)), mag(j + 1), 1); }
  __mmask64 neg2(int j) const {
    uint64_t bits;
    std::memcpy(&bits, sg + 4 * j, 8);
    return _cvtu64_mask64(bits);
  }
#endif
#else
  QVec q(int j) const {
    QVec r;
    const uint64_t v = packed(j);
    for (int k = 0; k < 4; k++) {
      const int8_t* entry = grid + 8 * index(v, k);
      const uint8_t s = sg[4 * j + k];
      for (int l = 0; l < 8; l++) r.v[8 * k + l] = (int8_t)((s >> l) & 1 ? -entry[l] : entry[l]);
    }
    return r;
  }
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const { return isum_per16(q, xq, sc16 + 2 * j); }
#endif
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

// IQ2_XXS (66 bytes): d, then per sub-block of 32 four 8-bit indices into a 256-entry grid and a 32-bit word of
// 4 x 7 sign bits and a 4-bit scale.
template <>
struct KBlock<IQ2_XXS> : IQ2Block<IQ2_XXS> {
  explicit KBlock(const uint8_t* p) : IQ2Block(p) {}
};

// IQ2_XS (74 bytes): d, 32 16-bit words (a 9-bit index into a 512-entry grid, a 7-bit sign index), 16 4-bit scales.
template <>
struct KBlock<IQ2_XS> : IQ2Block<IQ2_XS> {
  explicit KBlock(const uint8_t* p) : IQ2Block(p) {}
};

// IQ2_S (82 bytes): d, 32 index bytes and 32 sign bytes, 8 bytes of 2-bit index tops (a 1024-entry grid), 16 4-bit
// scales.
template <>
struct KBlock<IQ2_S> : IQ2Block<IQ2_S> {
  explicit KBlock(const uint8_t* p) : IQ2Block(p) {}
};

}  // namespace offspec
