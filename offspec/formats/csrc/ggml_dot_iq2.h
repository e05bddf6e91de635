// IQ2_XXS, IQ2_XS and IQ2_S in KBlock's interface (ggml_dot.h), so that ksums, ksums512, ktile and kwtile run them
// as they run the K-quants: activations in blocks of 256 (ggml's Q8_K), a super-block's products summed in integers
// with its scales applied in integers, then KSteps' float steps. Included by ggml_dot.h.
//
// The three types share one arithmetic (ggml's ggml_vec_dot_iq2_*_q8_K): weight w = d/8 * (2s + 1) * g * sign, g a
// value of a grid entry (8 magnitudes, each 8, 25 or 43: gguf's tables, handed over at load), one sign bit per
// weight, s a 4-bit scale per 16 weights (IQ2_XXS: per 32). The decoders' (d * (0.5 + s)) * 0.25 is the same number
// (exact in float32: 11 by 5 significant bits), and so is d/8 (a power of two): d holds it, the integer scales 2s + 1
// (1 .. 31) multiply the products. Every integer sum is exact: the largest maddubs pair sum is 2 * 43 * 127 (int16
// holds it), and a super-block's |isum| <= 256 * 43 * 127 * 31 < 2^26.
//
// Per super-block the constructor unpacks what its sub-blocks share: the 256 sign bits (IQ2_XXS's and IQ2_XS's
// 7-bit sign indices completed by their parity bit, ggml's ksigns) and the 16 integer scales. Then:
// - scalar and AVX2 (q(j)): a sub-block's 32 weights are its 4 grid entries fetched as 64-bit loads, negated where
//   their sign bit is set (a byte mask from the sign bits);
// - AVX-512, two sub-blocks per register (ggml_dot512.h ksigned2: mag2, neg2): IQ2_XXS's and IQ2_XS's 32 entries
//   as 16-bit codes (grid_codes: 2 bits per value) looked up 64 entries per word permute, a pair's 64 magnitudes
//   expanded from 8 codes by a permute, a shift and a byte shuffle; IQ2_S's 1024 entries would take 16 permutes, so
//   its indices are unpacked in a vector and the entries fetched as 64-bit loads. A pair's 64 sign bits are the
//   mask register that negates the activations. One weight row of super-blocks against one activation row (kwtile,
//   one core of a Zen 5 EPYC, weights in L2), ns per super-block: IQ2_XXS 10.5, IQ2_XS 10.2, IQ2_S 10.9 (every
//   entry a 64-bit load: 11.7, 10.8, the lookups for IQ2_S: 13.2; llama.cpp's vec_dot: 13.3, 13.7, 12.5).
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
#endif

#ifdef OFFSPEC_AVX512
// The codes of 32 grid entries (word i: entry i) from a table of N * 64 (codes_of): N word permutes of 64 entries
// each, by bits 0-5 of the indices (idx), blended by the index bits above them (bit[0]: bit 6, ...).
template <int N>
inline __m512i lookup_codes(const uint16_t* table, __m512i idx, const __mmask32* bit) {
  __m512i r[N];
#pragma GCC unroll 16
  for (int t = 0; t < N; t++)
    r[t] = _mm512_permutex2var_epi16(_mm512_loadu_si512(table + 64 * t), idx, _mm512_loadu_si512(table + 64 * t + 32));
  int level = 0;
#pragma GCC unroll 4
  for (int n = N; n > 1; n /= 2, level++)
#pragma GCC unroll 8
    for (int t = 0; t < n / 2; t++) r[t] = _mm512_mask_blend_epi16(bit[level], r[2 * t], r[2 * t + 1]);
  return r[0];
}
#elif defined(OFFSPEC_AVX2)
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

#endif

#ifdef OFFSPEC_AVX2
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
  float d, dmin = 0.0f;  // d: the block's scale / 8
#ifdef OFFSPEC_AVX512
  __m512i entries;                // word i: grid entry i's code (IQ2_XXS, IQ2_XS) or index (IQ2_S)
  const int8_t* grid = nullptr;  // IQ2_S
  __m512i sign16;                 // word i: entry i's 8 sign bits, in both its bytes
  alignas(32) int16_t sc16[16];  // the integer scales 2s + 1 of each 16 weights (kscales2)
#elif defined(OFFSPEC_AVX2)
  const int8_t* grid;
  alignas(32) uint8_t sg[32];  // bit k of byte i: weight 8i + k is negative
  __m128i sc8;                 // byte h: the integer scale 2s + 1 of weights 16h .. 16h + 15
#else
  const int8_t* grid;
  uint8_t sg[32];
  int16_t sc16[16];
#endif

  explicit IQ2Block(const uint8_t* p) : blk(p), d(half_at(p) * 0.125f) {
#ifdef OFFSPEC_AVX512
    const __m512i s16 = _mm512_cvtepu8_epi16(sign_bytes(p));
    sign16 = _mm512_or_si512(s16, _mm512_slli_epi16(s16, 8));
    if constexpr (T == IQ2_S) {
      grid = grid_of(T);
      entries = indices(p);
    } else {
      entries = codes(p);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), _mm256_cvtepu8_epi16(scale_bytes(p)));
#elif defined(OFFSPEC_AVX2)
    grid = grid_of(T);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sg), sign_bytes(p));
    sc8 = scale_bytes(p);
#else
    grid = grid_of(T);
    if constexpr (T == IQ2_XXS) {
      for (int j = 0; j < 8; j++) {
        const uint32_t aux = u32_at(p + 2 + 8 * j + 4);
        for (int k = 0; k < 4; k++) sg[4 * j + k] = ksigns((aux >> (7 * k)) & 0x7F);
        sc16[2 * j] = sc16[2 * j + 1] = (int16_t)(2 * (aux >> 28) + 1);
      }
    } else {
      for (int i = 0; i < 32; i++) sg[i] = T == IQ2_XS ? ksigns(u16_at(p + 2 + 2 * i) >> 9) : p[34 + i];
      const uint8_t* sc = p + (T == IQ2_XS ? 66 : 74);
      for (int h = 0; h < 16; h++) sc16[h] = (int16_t)(2 * ((sc[h / 2] >> (4 * (h % 2))) & 0x0F) + 1);
    }
#endif
  }

#ifdef OFFSPEC_AVX2
  // IQ2_XXS's 8 words of 4 x 7 sign bits and a scale (bits 28-31), sub-block order: the odd 32-bit words of its
  // 64 bytes (sub-block j: 4 index bytes, then that word)
  static __m256i aux_words(const uint8_t* p) {
    const __m256 a = _mm256_castsi256_ps(load32u(p + 2)), b = _mm256_castsi256_ps(load32u(p + 34));
    return _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8);
  }
  // the 32 sign bytes: bit k of byte i set where weight 8i + k is negative
  static __m256i sign_bytes(const uint8_t* p) {
    if constexpr (T == IQ2_XXS) {  // byte k of word j: its sign index k (bits 7k .. 7k + 6) moved to bits 8k ..
      const __m256i w = aux_words(p), s7 = _mm256_set1_epi32(0x7F);
      __m256i idx = _mm256_and_si256(w, s7);
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 1), _mm256_slli_epi32(s7, 8)));
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 2), _mm256_slli_epi32(s7, 16)));
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_slli_epi32(w, 3), _mm256_slli_epi32(s7, 24)));
      return with_parity(idx);
    } else if constexpr (T == IQ2_XS) {  // the top 7 bits of each of the 32 words
      const __m256i lo = _mm256_srli_epi16(load32u(p + 2), 9), hi = _mm256_srli_epi16(load32u(p + 34), 9);
      return with_parity(_mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8));
    } else {  // IQ2_S: the 32 sign bytes as stored
      return load32u(p + 34);
    }
  }
  // the 16 integer scales 2s + 1 as bytes (IQ2_XXS: each of its 8 twice)
  static __m128i scale_bytes(const uint8_t* p) {
    if constexpr (T == IQ2_XXS) {  // bits 28-31 of the words of aux_words
      const __m256i s4 = _mm256_srli_epi32(aux_words(p), 28);
      const __m256i ls = _mm256_add_epi32(_mm256_add_epi32(s4, s4), _mm256_set1_epi32(1));
      const __m256i pick = _mm256_setr_epi8(0, 0, 4, 4, 8, 8, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 0, 4, 4, 8, 8, 12, 12, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m256i twice = _mm256_shuffle_epi8(ls, pick);  // each 128 bits: its 4 scales twice, in 8 bytes
      return _mm_unpacklo_epi64(_mm256_castsi256_si128(twice), _mm256_extracti128_si256(twice, 1));
    } else {  // 8 bytes, 16 nibbles (low nibble first)
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + (T == IQ2_XS ? 66 : 74)));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      const __m128i s = _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
      return _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1));
    }
  }
#endif

#ifdef OFFSPEC_AVX512
  // the codes of the 32 grid entries (word i: entry i)
  static __m512i codes(const uint8_t* p) {
    const uint16_t* table = codes_of(T);  // IQ2_XXS, IQ2_XS
    const __m512i b6 = _mm512_set1_epi16(64), b7 = _mm512_set1_epi16(128);
    if constexpr (T == IQ2_XXS) {  // the index bytes: the low 32-bit word of each 64 bits
      const __m512i idx = _mm512_cvtepu8_epi16(_mm512_cvtepi64_epi32(_mm512_loadu_si512(p + 2)));
      const __mmask32 bits[2] = {_mm512_test_epi16_mask(idx, b6), _mm512_test_epi16_mask(idx, b7)};
      return lookup_codes<4>(table, idx, bits);
    } else {  // IQ2_XS: bits 0-8 of each word
      const __m512i idx = _mm512_loadu_si512(p + 2);
      const __mmask32 bits[3] = {_mm512_test_epi16_mask(idx, b6), _mm512_test_epi16_mask(idx, b7),
                                 _mm512_test_epi16_mask(idx, _mm512_set1_epi16(256))};
      return lookup_codes<8>(table, idx, bits);
    }
  }
  // IQ2_S's 32 grid indices (word i: entry i): the qs bytes, and bits 2k, 2k + 1 of qh byte i / 4 (k = i % 4) as
  // their bits 8, 9
  static __m512i indices(const uint8_t* p) {
    const __m512i qh8 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 66))));  // words 0-7: the qh bytes
    const __m512i qh = _mm512_permutexvar_epi16(entry_of_word(0), qh8);  // word i: qh byte i / 4
    const __m512i up = _mm512_broadcast_i32x4(_mm_setr_epi16(8, 6, 4, 2, 8, 6, 4, 2));  // bit 2k to bit 8
    const __m512i top = _mm512_and_si512(_mm512_sllv_epi16(qh, up), _mm512_set1_epi16(0x300));
    return _mm512_or_si512(_mm512_cvtepu8_epi16(load32u(p + 2)), top);
  }
  static __m512i entry_of_word(int j) {  // word w -> 4j + w / 4 (the entry of a pair's weights 2w, 2w + 1)
    alignas(64) static const int16_t quarter[32] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                                     4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
    return _mm512_add_epi16(_mm512_load_si512(quarter), _mm512_set1_epi16((short)(4 * j)));
  }
  // sub-blocks j and j + 1 (j even): their 64 magnitudes, j's in the low half. Word w: values 2 (w % 4) and
  // 2 (w % 4) + 1 of its entry, whose levels a shift by 2 (w % 4) brings to bits 0-1 of its two bytes.
  __m512i mag2(int j) const {
    if constexpr (T == IQ2_S) {  // entries 4j .. 4j + 7 fetched as 64-bit loads
      uint64_t v[2];  // their indices, 4 words each
      std::memcpy(v, reinterpret_cast<const uint16_t*>(&entries) + 4 * j, 16);
      auto at = [&](int k) { return (uint32_t)(v[k / 4] >> (16 * (k % 4))) & 0x3FF; };
      const __m256i lo = _mm256_set_m128i(grid_pair(grid, at(2), at(3)), grid_pair(grid, at(0), at(1)));
      const __m256i hi = _mm256_set_m128i(grid_pair(grid, at(6), at(7)), grid_pair(grid, at(4), at(5)));
      return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const __m512i c = _mm512_permutexvar_epi16(entry_of_word(j), entries);
    const __m512i shift = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 2, 4, 6, 0, 2, 4, 6));
    const __m512i level = _mm512_and_si512(_mm512_srlv_epi16(c, shift), _mm512_set1_epi16(0x0303));
    const __m512i value = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    return _mm512_shuffle_epi8(value, level);
  }
  // their 64 sign bits: lane l, bit l % 8 of its entry's sign byte
  __mmask64 neg2(int j) const {
    return _mm512_test_epi8_mask(_mm512_permutexvar_epi16(entry_of_word(j), sign16),
                                 _mm512_set1_epi64((int64_t)0x8040201008040201ULL));
  }
#else
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
  // the 32 weights of sub-block j: the magnitudes of its 4 grid entries, negated where their sign bit is set
  QVec q(int j) const {
    const uint64_t v = packed(j);
    const __m256i mag = _mm256_set_m128i(grid_pair(grid, index(v, 2), index(v, 3)),
                                         grid_pair(grid, index(v, 0), index(v, 1)));
    const __m256i neg = sign_mask_32(sg + 4 * j);
    return _mm256_sub_epi8(_mm256_xor_si256(mag, neg), neg);
  }
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products, 8 of scale 2j, then 8 of scale 2j + 1
  Scales scales(int j) const {
    const __m128i at = _mm_add_epi8(_mm_set1_epi8((char)(2 * j)),
                                    _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc8, at));
  }
  static __m256i isum(__m256i q, Scales sv, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
  }
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
