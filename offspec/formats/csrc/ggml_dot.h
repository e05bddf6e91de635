// Dot products of one row of ggml weight blocks with one activation row quantized to 8 bits (the way ggml computes
// them): integer products summed exactly, then scaled in float32. The activations come in blocks of 32 with a
// scale each for the legacy types (ggml's Q8_0) and in blocks of 256 for the K-quants (Q8_K).
//
// Every function accumulates in an order fixed by K alone, so an output never depends on how many activation
// rows a call has (row invariance) or on how rows are split between threads.
#pragma once

#include "ggml_decode.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OFFSPEC_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define OFFSPEC_AVX512 1  // ggml_dot512.h: two blocks per instruction, the same results
#endif
#endif

namespace offspec {

constexpr int64_t QB = 32;  // the sums of activations are kept per 32 (minimum terms)

// Quantize x (K floats) in blocks of `ab` (32 or 256, K % ab == 0): d = max|x| / 127, q = round-half-even(x / d);
// d[K/ab], and s[K/32] the sums of q per 32.
inline void quantize_row(const float* x, int64_t K, int64_t ab, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / ab; b++) {
    const float* xb = x + b * ab;
    float amax = 0.0f;
    for (int64_t l = 0; l < ab; l++) amax = std::max(amax, std::fabs(xb[l]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    for (int64_t l = 0; l < ab; l++) q[b * ab + l] = (int8_t)(int)std::nearbyint(xb[l] * id);
    d[b] = db;
  }
  for (int64_t b = 0; b < K / QB; b++) {
    int32_t sum = 0;
    for (int l = 0; l < QB; l++) sum += q[b * QB + l];
    s[b] = sum;
  }
}

// s16[K/16]: the sums of q per 16 (ggml's Q8_K bsums: Q2_K's minimums, the interleaved Q6_K kernels)
inline void sums_16(const int8_t* q, int64_t K, int32_t* s16) {
  for (int64_t i = 0; i < K / 16; i++) {
    int32_t sum = 0;
    for (int l = 0; l < 16; l++) sum += q[i * 16 + l];
    s16[i] = sum;
  }
}

// The activation block of a weight type: 256 for the K-quants, IQ4_XS, the IQ1/IQ2/IQ3 types, TQ1_0 and TQ2_0
// (super-blocks of 256), else 32.
inline int64_t activation_block(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS ||
         type == IQ2_XXS || type == IQ2_XS || type == IQ2_S || type == IQ3_XXS || type == IQ3_S || type == IQ1_S ||
         type == IQ1_M || type == TQ1_0 || type == TQ2_0 ? 256 : QB;
}

// Whether the kernels of this type read XSet::s16 (Q2_K: minimums per 16 weights).
inline bool needs_sums_16(int64_t type) { return type == Q2_K; }

#ifdef OFFSPEC_AVX2
inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// 8 int32 sums of products of unsigned bytes `u` (< 128) with signed bytes `s`
inline __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// the same for two signed operands (|a| <= 128): sign moved onto b
inline __m256i dot_ss(__m256i a, __m256i b) {
  return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

inline __m256i nibbles_32(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles first, then high
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

inline __m256i bits_32(const uint8_t* p) {  // 32 bits (little endian) -> 32 bytes of 0x10 (bit set) or 0
  uint32_t x;
  std::memcpy(&x, p, 4);
  // byte i of the result looks at byte i/8 of x, and tests bit i%8 there
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                       1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

// 32 nibbles (nibbles_32's order) -> their int8 values in a 16-entry table (a byte shuffle per lane)
inline __m256i table_values(const int8_t* table16, __m256i nibbles) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table16)));
  return _mm256_shuffle_epi8(table, nibbles);
}
// ... in IQ4_NL's non-linear table
inline __m256i iq4_values(__m256i nibbles) { return table_values(KVALUES_IQ4NL, nibbles); }

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load32u(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

// --- per-type kernels: one weight row against M activation rows ---------------------------------------------
//
// Activation rows are processed in tiles (up to 8 rows for the K-quants, 4 for the legacy types, whose per-block
// float accumulators would not fit 8 rows in registers), with their accumulators in registers; each weight block
// is decoded once per tile. Every row sees the same sequence of float operations whatever the tile size or M
// (integer sums are exact in any order): that is what makes the results row invariant.

struct XSet {  // M quantized activation rows
  const int8_t* q;   // (M, K)
  const float* d;    // (M, nd) a scale per activation block
  const int32_t* s;  // (M, K/32)
  int64_t M, K, nb, nd;  // nb = K / 32, nd = K / activation block
  const int32_t* o = nullptr;  // (M, K/4) -offset * the sum of each 4 activations (offset_lanes), or none
  const int32_t* s16 = nullptr;  // (M, K/16) the sums per 16 (Q6_K interleaved, ggml_x16.h), or none
  const int8_t* qrow(int64_t m, int64_t blk) const { return q + m * K + blk * QB; }
  float dval(int64_t m, int64_t i) const { return d[m * nd + i]; }
  int32_t sval(int64_t m, int64_t blk) const { return s[m * nb + blk]; }
  const int32_t* orow(int64_t m, int64_t blk) const { return o + m * (K / 4) + blk * (QB / 4); }
};

// What the signed legacy types add to their weights to make them unsigned bytes (q + offset: Q4_0's and Q5_0's
// stored values, Q8_0's with the top bit flipped, IQ4_NL's table values + 128, MXFP4's + 12); 0 for the others.
constexpr int legacy_offset(int64_t type) {
  return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 || type == IQ4_NL ? 128 : type == MXFP4 ? MXFP4_OFFSET : 0;
}

// The lanes' offset terms of XSet::o: o[m][i] = -offset * (x[4i] + x[4i+1] + x[4i+2] + x[4i+3]) of row m.
inline void offset_lanes(const int8_t* q, int64_t K, int offset, int32_t* o) {
  for (int64_t i = 0; i < K / 4; i++) o[i] = -offset * ((int32_t)q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
}

#ifdef OFFSPEC_AVX2
using Acc = __m256;
using QVec = __m256i;  // 32 integer weights (int8 lanes)
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a, Acc b) { return hsum(_mm256_add_ps(a, b)); }
inline Acc fma_acc(__m256i isum, float scale, Acc acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale), acc);
}
inline __m256i isum_unsigned(QVec q, const int8_t* xq) { return dot_us(q, load32(xq)); }
inline __m256i isum_signed(QVec q, const int8_t* xq) { return dot_ss(q, load32(xq)); }
using XVec = __m256i;  // 32 activations
inline XVec xload(const int8_t* p) { return load32(p); }
#else
using Acc = float;
struct QVec { int8_t v[32]; };
inline Acc acc_zero() { return 0.0f; }
inline float acc_sum(Acc a, Acc b) { return a + b; }
inline Acc fma_acc(int32_t isum, float scale, Acc acc) { return acc + (float)isum * scale; }
inline int32_t isum_unsigned(const QVec& q, const int8_t* xq) {
  int32_t s = 0;
  for (int l = 0; l < 32; l++) s += (int32_t)q.v[l] * xq[l];
  return s;
}
inline int32_t isum_signed(const QVec& q, const int8_t* xq) { return isum_unsigned(q, xq); }
using XVec = const int8_t*;
inline XVec xload(const int8_t* p) { return p; }
#endif

// Legacy types, one block of 32 per step. Q4_0 -> q - 8, Q5_0 -> q - 16, Q8_0 -> q, IQ4_NL -> kvalues[q] (signed,
// w = d q'); Q4_1 / Q5_1 -> q (unsigned, w = d q + m). MXFP4 is IQ4_NL's kind with its own table and, for d, an E8M0
// exponent of one byte (ggml_decode_mxfp4.h), made a float here once per block.
template <int64_t T>
struct Legacy {
  static constexpr int64_t TYPE = T;
  static constexpr int64_t BYTES = T == Q4_0 || T == IQ4_NL ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24
                                   : T == MXFP4 ? 17 : 34;
  static constexpr bool MIN = T == Q4_1 || T == Q5_1;
  const uint8_t* blk;
  float d, m;
  explicit Legacy(const uint8_t* p) : blk(p), d(scale_at(p)), m(MIN ? half_at(p + 2) : 0.0f) {}
  static float scale_at(const uint8_t* p) {
    if constexpr (T == MXFP4) return e8m0_half(p[0]);
    else return half_at(p);
  }
  QVec q(int) const {
#ifdef OFFSPEC_AVX2
    if (T == Q4_0) return _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8));
    if (T == Q5_0) return _mm256_sub_epi8(_mm256_or_si256(nibbles_32(blk + 6), bits_32(blk + 2)), _mm256_set1_epi8(16));
    if (T == Q8_0) return load32u(blk + 2);
    if (T == IQ4_NL) return iq4_values(nibbles_32(blk + 2));
    if (T == MXFP4) return table_values(KVALUES_MXFP4, nibbles_32(blk + 1));
    if (T == Q4_1) return nibbles_32(blk + 4);
    return _mm256_or_si256(nibbles_32(blk + 8), bits_32(blk + 4));  // Q5_1
#else
    QVec r;
    if (T == Q8_0) {
      std::memcpy(r.v, blk + 2, 32);
      return r;
    }
    if (T == IQ4_NL || T == MXFP4) {
      const int8_t* table = T == IQ4_NL ? KVALUES_IQ4NL : KVALUES_MXFP4;
      const uint8_t* qs = blk + (T == IQ4_NL ? 2 : 1);
      for (int j = 0; j < 16; j++) {
        r.v[j] = table[qs[j] & 0x0F];
        r.v[j + 16] = table[qs[j] >> 4];
      }
      return r;
    }
    const uint8_t* qs = blk + (T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (T == Q5_0) std::memcpy(&qh, blk + 2, 4);
    if (T == Q5_1) std::memcpy(&qh, blk + 4, 4);
    const int bias = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
      int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if (T == Q5_0 || T == Q5_1) {
        lo |= (int)(((qh >> j) & 1u) << 4);
        hi |= (int)(((qh >> (j + 16)) & 1u) << 4);
      }
      r.v[j] = (int8_t)(lo - bias);
      r.v[j + 16] = (int8_t)(hi - bias);
    }
    return r;
#endif
  }
  float scale(int) const { return d; }
  float min(int) const { return m; }  // + m * sum(x)
  static auto isum(const QVec& q, const int8_t* xq, int) { return MIN ? isum_unsigned(q, xq) : isum_signed(q, xq); }
};

// K-quants (Q4_K, Q5_K, Q6_K; Q2_K, Q3_K in ggml_dot_low.h), ggml's way: the activations come in blocks of 256 with
// one float scale (Q8_K); a super-block's products are summed in integers with its sub-block scales applied in
// integers too, then float steps per super-block (KSteps below): one chain per output, acc = fma(isum, d * dx, acc)
// and, for Q2_K/Q4_K/Q5_K, acc = fma(-msum, dmin * dx, acc), msum = sum_j m_j sum(x_j).
template <int64_t T>
struct KBlock {
  static constexpr int64_t BYTES = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  static constexpr bool MIN = T != Q6_K;
  const uint8_t* blk;
  float d, dmin;
  uint8_t sc[8], mn[8];  // Q4_K / Q5_K sub-block scales and minimums (6 bits)
  explicit KBlock(const uint8_t* p) : blk(p), d(0.0f), dmin(0.0f) {
    if constexpr (T == Q6_K) {
      d = half_at(p + 208);
    } else {
      d = half_at(p);
      dmin = half_at(p + 2);
      unpack_scales(p + 4);
    }
  }
  // the 32 weights of sub-block j: Q4_K/Q5_K unsigned q in [0, 31]; Q6_K signed q - 32 in [-32, 31], where
  // activation block j = h*4 + s covers elements h*128 + s*32 .. +32
  QVec q(int j) const {
#ifdef OFFSPEC_AVX2
    if constexpr (T == Q6_K) {
      const int h = j / 4, s = j % 4;
      const __m256i src = load32u(blk + h * 64 + (s & 1) * 32);
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(src, 4 * (s >> 1)), _mm256_set1_epi8(0x0F));
      const __m256i hb = load32u(blk + 128 + h * 32);
      const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), _mm256_set1_epi8(3)), 4);
      return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
    } else {
      const __m256i raw = load32u(blk + (T == Q4_K ? 16 : 48) + (j / 2) * 32);
      __m256i v = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j % 2)), _mm256_set1_epi8(0x0F));
      if constexpr (T == Q5_K) {
        const __m256i h = _mm256_and_si256(_mm256_srli_epi16(load32u(blk + 16), j), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
      }
      return v;
    }
#else
    QVec r;
    for (int l = 0; l < 32; l++) {
      if constexpr (T == Q6_K) {
        const int h = j / 4, s = j % 4;
        const int lo = (blk[h * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 0x0F;
        const int hi = (blk[128 + h * 32 + l] >> (2 * s)) & 3;
        r.v[l] = (int8_t)((lo | (hi << 4)) - 32);
      } else {
        int v = (blk[(T == Q4_K ? 16 : 48) + (j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
        if (T == Q5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
        r.v[l] = (int8_t)v;
      }
    }
    return r;
#endif
  }
#ifdef OFFSPEC_AVX2
  using Scales = __m256i;  // 16 x int16: the scale of each pair of products
  Scales scales(int j) const {
    if constexpr (T == Q6_K) {  // one scale per 16 weights
      const int8_t* s = reinterpret_cast<const int8_t*>(blk + 192);
      return _mm256_set_m128i(_mm_set1_epi16(s[2 * j + 1]), _mm_set1_epi16(s[2 * j]));
    } else {
      return _mm256_set1_epi16(sc[j]);
    }
  }
  // 8 x int32: the scaled products of sub-block j with 32 activations (no overflow: |sum| < 2^25 per super-block)
  static __m256i isum(__m256i q, Scales sv, __m256i x) {
    const __m256i p16 = T == Q6_K ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
                                  : _mm256_maddubs_epi16(q, x);
    return _mm256_madd_epi16(p16, sv);
  }
#else
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const {
    if constexpr (T == Q6_K) {
      const int8_t* s = reinterpret_cast<const int8_t*>(blk + 192);
      int32_t total = 0;
      for (int half = 0; half < 2; half++) {
        int32_t part = 0;
        for (int l = half * 16; l < half * 16 + 16; l++) part += (int32_t)q.v[l] * xq[l];
        total += part * s[2 * j + half];
      }
      return total;
    } else {
      int32_t part = 0;
      for (int l = 0; l < 32; l++) part += (int32_t)q.v[l] * xq[l];
      return part * sc[j];
    }
  }
#endif
  // the 12 bytes of 6-bit scales and minimums (k_scale_min's layout) unpacked four at a time
  void unpack_scales(const uint8_t* p) {
    uint32_t u[3], lo = 0x3F3F3F3Fu, nib = 0x0F0F0F0Fu, top = 0x03030303u;
    std::memcpy(u, p, 12);
    const uint32_t s03 = u[0] & lo, m03 = u[1] & lo;
    const uint32_t s47 = (u[2] & nib) | (((u[0] >> 6) & top) << 4);
    const uint32_t m47 = ((u[2] >> 4) & nib) | (((u[1] >> 6) & top) << 4);
    std::memcpy(sc, &s03, 4);
    std::memcpy(sc + 4, &s47, 4);
    std::memcpy(mn, &m03, 4);
    std::memcpy(mn + 4, &m47, 4);
  }
#ifdef OFFSPEC_AVX2
  // m_j * sum(x_j) for the 8 sub-blocks, as 8 int32 lanes (exact)
  __m256i min_vec() const { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))); }
  static __m256i min_prod(__m256i m, const int32_t* xsum) {
    return _mm256_mullo_epi32(m, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum)));
  }
#else
  int min_vec() const { return 0; }
  int32_t min_prod(int, const int32_t* xsum) const {
    int32_t t = 0;
    for (int j = 0; j < 8; j++) t += (int32_t)mn[j] * xsum[j];
    return t;
  }
#endif
};

// IQ4_XS: super-blocks of 256 in 8 sub-blocks of 32, each with a 6-bit scale (stored + 32) and 4-bit indices into
// IQ4_NL's table; the activations come in blocks of 256 as for the K-quants, and the integer sums and float steps
// are Q6_K's (signed weights, sub-block scales applied in integers, no minimums): KBlock's interface, so ktile,
// kwtile and ksums run it as they run the K-quants.
template <>
struct KBlock<IQ4_XS> {
  static constexpr int64_t BYTES = 136;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  float d, dmin = 0.0f;
  int8_t ls[8];  // the sub-block scales, -32 .. 31
  explicit KBlock(const uint8_t* p) : blk(p), d(half_at(p)) {
    for (int j = 0; j < 8; j++) ls[j] = (int8_t)(iq4xs_scale(p, j) - 32);
  }
  // the 32 weights of sub-block j (int8 values of the table, -127 .. 113)
  QVec q(int j) const {
#ifdef OFFSPEC_AVX2
    return iq4_values(nibbles_32(blk + 8 + 16 * j));
#else
    QVec r;
    for (int l = 0; l < 16; l++) {
      r.v[l] = KVALUES_IQ4NL[blk[8 + 16 * j + l] & 0x0F];
      r.v[l + 16] = KVALUES_IQ4NL[blk[8 + 16 * j + l] >> 4];
    }
    return r;
#endif
  }
#ifdef OFFSPEC_AVX2
  using Scales = __m256i;  // 16 x int16: the sub-block's scale
  Scales scales(int j) const { return _mm256_set1_epi16(ls[j]); }
  // 8 x int32: the scaled products of sub-block j with 32 activations (|pair sum| <= 2 * 127 * 127: no saturation;
  // |sum| < 2^28 per super-block)
  static __m256i isum(__m256i q, Scales sv, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), sv);
  }
  int min_vec() const { return 0; }  // no minimums (MIN is false: never called)
#else
  using Scales = int;
  Scales scales(int j) const { return j; }
  int32_t isum(const QVec& q, Scales j, XVec xq) const {
    int32_t part = 0;
    for (int l = 0; l < 32; l++) part += (int32_t)q.v[l] * xq[l];
    return part * ls[j];
  }
  int min_vec() const { return 0; }
#endif
  int32_t min_prod(int, const int32_t*) const { return 0; }
};

}  // namespace offspec

#include "ggml_dot_low.h"  // Q2_K, Q3_K
#include "ggml_dot_iq2.h"  // IQ2_XXS, IQ2_XS, IQ2_S
#include "ggml_dot_iq3.h"  // IQ3_XXS, IQ3_S
#include "ggml_dot_iq1.h"  // IQ1_S, IQ1_M
#include "ggml_dot_tq.h"   // TQ1_0, TQ2_0

namespace offspec {

// The activation sums that a K-quant's minimums multiply (min_prod), of row m in super-block sb: Q2_K's 16 per 16
// weights (XSet::s16), Q4_K's and Q5_K's 8 per 32.
template <int64_t T>
inline const int32_t* min_sums(const XSet& x, int64_t m, int64_t sb) {
  return T == Q2_K ? x.s16 + m * (x.K / 16) + sb * 16 : x.s + m * x.nb + sb * 8;
}

#ifdef OFFSPEC_AVX2
using ISum = __m256i;
inline ISum isum_zero() { return _mm256_setzero_si256(); }
inline ISum isum_add(ISum a, ISum b) { return _mm256_add_epi32(a, b); }
// keeps the compiler from re-associating a row's integer sum into a tree across rows (exact either way, but the
// tree needs more registers than AVX2 has and spills)
inline void keep(ISum& v) { __asm__("" : "+x"(v)); }

// lane r: the sum of the 8 lanes of v[r], for r < R (0 above): 8 rows' horizontal sums in 9 instructions
template <int R>
inline __m256i rows_sum(const __m256i* v) {
  __m256i u[8];
  for (int r = 0; r < 8; r++) u[r] = r < R ? v[r] : _mm256_setzero_si256();
  const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
  const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(u[4], u[5]), _mm256_hadd_epi32(u[6], u[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

// The K-quants' float steps for R activation rows (R <= 8) of one weight row: one chain per output over the
// super-blocks, acc = fma(isum, d * dx, acc), then acc = fma(-msum, dmin * dx, acc) where there are minimums.
// Every kernel (this one, the scalar one, the AMX tiles of ggml_amx.h) does exactly these float operations on the
// same exact integer sums, so all of them give the same bits. From 4 rows, a lane per activation row; below,
// one row at a time (the 8-row horizontal sums of rows_sum would cost a one-row pass half its time again).
template <int R>
struct KStepsLanes {
  __m256 acc = _mm256_setzero_ps();  // lane r: the output of activation row r0 + r
  // is[r], ms[r]: 8-lane partial integer sums of row r (ms: nullptr where the type has no minimums)
  void step(const ISum* is, const ISum* ms, float d, float dmin, const XSet& x, int64_t r0, int64_t sb) {
    alignas(32) float dx[8] = {};
    for (int r = 0; r < R; r++) dx[r] = x.dval(r0 + r, sb);
    const __m256 dxv = _mm256_load_ps(dx);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows_sum<R>(is)), _mm256_mul_ps(_mm256_set1_ps(d), dxv), acc);
    if (ms != nullptr)
      acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(rows_sum<R>(ms)), _mm256_mul_ps(_mm256_set1_ps(dmin), dxv), acc);
  }
  void store(float* y, int64_t r0, int64_t ystride) const {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc);
    for (int r = 0; r < R; r++) y[(r0 + r) * ystride] = v[r];
  }
};

template <int R>
struct KStepsRows {
  __m128 acc[R];  // lane 0: the output of activation row r0 + r (the other lanes are not used)
  KStepsRows() {
    for (int r = 0; r < R; r++) acc[r] = _mm_setzero_ps();
  }
  void step(const ISum* is, const ISum* ms, float d, float dmin, const XSet& x, int64_t r0, int64_t sb) {
    for (int r = 0; r < R; r++) {
      // the lanes of is[r] and of ms[r] summed together, [is, ms, is, ms], in float (kept in vector registers:
      // a round trip through a general register costs a one-row pass a third of its time)
      const __m256i h = _mm256_hadd_epi32(is[r], ms != nullptr ? ms[r] : _mm256_setzero_si256());
      const __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      const __m128 sums = _mm_cvtepi32_ps(_mm_hadd_epi32(q, q));
      const __m128 scale = _mm_mul_ps(_mm_setr_ps(d, dmin, 0.0f, 0.0f), _mm_set1_ps(x.dval(r0 + r, sb)));
      acc[r] = _mm_fmadd_ss(sums, scale, acc[r]);
      if (ms != nullptr)
        acc[r] = _mm_fnmadd_ss(_mm_movehdup_ps(sums), _mm_movehdup_ps(scale), acc[r]);  // lane 1 into lane 0
    }
  }
  void store(float* y, int64_t r0, int64_t ystride) const {
    for (int r = 0; r < R; r++) y[(r0 + r) * ystride] = _mm_cvtss_f32(acc[r]);
  }
};

template <int R>
using KSteps = std::conditional_t<(R >= 4), KStepsLanes<R>, KStepsRows<R>>;
#else
using ISum = int32_t;
inline ISum isum_zero() { return 0; }
inline ISum isum_add(ISum a, ISum b) { return a + b; }
inline void keep(ISum&) {}

template <int R>
struct KSteps {  // the same float operations, one output at a time
  float acc[R] = {};
  void step(const ISum* is, const ISum* ms, float d, float dmin, const XSet& x, int64_t r0, int64_t sb) {
    for (int r = 0; r < R; r++) {
      const float dx = x.dval(r0 + r, sb);
      acc[r] = std::fma((float)is[r], d * dx, acc[r]);
      if (ms != nullptr) acc[r] = std::fma(-(float)ms[r], dmin * dx, acc[r]);
    }
  }
  void store(float* y, int64_t r0, int64_t ystride) const {
    for (int r = 0; r < R; r++) y[(r0 + r) * ystride] = acc[r];
  }
};
#endif

// The integer sums of one K-quant super-block (blk, super-block sb) with activation rows r0 .. r0+R: is[r] over
// the 8 sub-blocks and, where the type has minimums, ms[r] = sum_j m_j sum(x_j), each as partial sums in lanes
// (exact). Each sub-block is decoded once for the R rows (tiles of 8 rows ran 1.4x (Q4_K) and 1.5x (Q6_K) faster
// than tiles of 4 with the minimum terms summed apart, at 16 rows on one Zen 3 core).
template <int64_t T, int R>
inline void ksums(const KBlock<T>& blk, const XSet& x, int64_t r0, int64_t sb, ISum* is, ISum* ms) {
  for (int r = 0; r < R; r++) is[r] = isum_zero();
#pragma GCC unroll 8
  for (int j = 0; j < 8; j++) {
    const QVec q = blk.q(j);
    const auto sv = blk.scales(j);
    for (int r = 0; r < R; r++) {
      is[r] = isum_add(is[r], blk.isum(q, sv, xload(x.qrow(r0 + r, sb * 8 + j))));
      keep(is[r]);
    }
  }
  if constexpr (KBlock<T>::MIN) {
    const auto mv = blk.min_vec();
    for (int r = 0; r < R; r++) ms[r] = blk.min_prod(mv, min_sums<T>(x, r0 + r, sb));
  }
  if constexpr (ternary(T))  // digits t = q + 1 (ggml_dot_tq.h): the sum of t x less the activations' sum
    for (int r = 0; r < R; r++) is[r] = less_xsum(is[r], min_sums<T>(x, r0 + r, sb));
}

// The legacy types' weights are read one row after another: the bytes 4 KB ahead are asked into L2 and those 1 KB
// ahead into L1, once per block pair (36 to 68 bytes of weights). Streaming the 0.5B draft's Q5_0 rows (616 bytes) from
// memory, 2 cores of a Xeon: 12.0 -> 17.3 GB/s (Q8_0 17.5 -> 23.1); the next row's 64 bytes per 4 blocks that this
// replaces kept a core waiting on memory, and the K-quants' kernels, bound by their arithmetic, gain nothing from it.
inline void legacy_prefetch(const uint8_t* p) {
  __builtin_prefetch(p + 4096, 0, 1);
  __builtin_prefetch(p + 1024, 0, 3);
}

// Rows r0 .. r0+R of the output column of one legacy weight row (blocks of 32, activations in blocks of 32).
template <class B, int R>
void tile(const uint8_t* w, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  Acc even[R], odd[R];
  float off_even[R], off_odd[R];  // minimums (Q4_1, Q5_1): + m * dx * sum(x)
  for (int r = 0; r < R; r++) {
    even[r] = odd[r] = acc_zero();
    off_even[r] = off_odd[r] = 0.0f;
  }
  for (int64_t xb = 0, n = x.K / 32; xb < n; xb++) {
    const B blk(w + xb * B::BYTES);
    if (xb % 2 == 0) legacy_prefetch(w + xb * B::BYTES);
    const QVec q = blk.q(0);
    const float ws = blk.scale(0);
    for (int r = 0; r < R; r++) {
      const float dx = x.dval(r0 + r, xb);
      const auto isum = B::isum(q, x.qrow(r0 + r, xb), 0);
      if (xb & 1) odd[r] = fma_acc(isum, ws * dx, odd[r]); else even[r] = fma_acc(isum, ws * dx, even[r]);
      if constexpr (B::MIN) {
        const float t = (blk.min(0) * dx) * (float)x.sval(r0 + r, xb);
        if (xb & 1) off_odd[r] += t; else off_even[r] += t;
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float v = acc_sum(even[r], odd[r]);
    if constexpr (B::MIN) v += off_even[r] + off_odd[r];
    y[(r0 + r) * ystride] = v;
  }
}

// f(r0, std::integral_constant<int, R>) over the M activation rows: tiles of 8 (when `wide`), then of 4, then one
// of the remainder.
template <bool wide, class F>
void in_tiles(int64_t M, F&& f) {
  int64_t r = 0;
  if constexpr (wide)
    for (; r + 8 <= M; r += 8) f(r, std::integral_constant<int, 8>{});
  for (; r + 4 <= M; r += 4) f(r, std::integral_constant<int, 4>{});
  switch (M - r) {
    case 3: f(r, std::integral_constant<int, 3>{}); break;
    case 2: f(r, std::integral_constant<int, 2>{}); break;
    case 1: f(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

}  // namespace offspec

#ifdef OFFSPEC_AVX512
#include "ggml_dot512.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define OFFSPEC_AMX 1  // ggml_amx.h: the K-quants of wide passes on the tile unit, the same results
#endif
#endif

namespace offspec {

// Whether the kernels read XSet::o for weights of this type.
inline bool needs_offset_lanes(int64_t type) {
#ifdef OFFSPEC_AVX512
  return unsigned_legacy(type);
#else
  (void)type;
  return false;
#endif
}

template <class B>
void rows(const uint8_t* w, const XSet& x, float* y, int64_t ystride) {
#ifdef OFFSPEC_AVX512
  if constexpr (unsigned_legacy(B::TYPE)) {
    in_tiles<false>(x.M, [&](int64_t r, auto R) { tile512u<B::TYPE, decltype(R)::value>(w, x, r, y, ystride); });
    return;
  }
  in_tiles<false>(x.M, [&](int64_t r, auto R) { tile512<B, decltype(R)::value>(w, x, r, y, ystride); });
#else
  in_tiles<false>(x.M, [&](int64_t r, auto R) { tile<B, decltype(R)::value>(w, x, r, y, ystride); });
#endif
}

#ifdef OFFSPEC_AVX512
#define OFFSPEC_KSUMS ksums512  // two sub-blocks per instruction (ggml_dot512.h)
#else
#define OFFSPEC_KSUMS ksums
#endif

// Rows r0 .. r0+R of the output column of one K-quant weight row: per super-block the integer sums, then the float
// steps of KSteps. The next weight row's super-block is prefetched while this one computes (streaming a model from
// memory ran 5-15% faster with it: the hardware prefetcher alone leaves gaps between rows).
template <int64_t T, int R>
void ktile(const uint8_t* w, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using B = KBlock<T>;
  KSteps<R> steps;
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const B blk(w + sb * B::BYTES);
    for (int64_t line = 0; line < B::BYTES; line += 64) __builtin_prefetch(w + n * B::BYTES + sb * B::BYTES + line);
    ISum is[R], ms[R];
    OFFSPEC_KSUMS<T, R>(blk, x, r0, sb, is, ms);
    steps.step(is, B::MIN ? ms : nullptr, blk.d, blk.dmin, x, r0, sb);
  }
  steps.store(y, r0, ystride);
}

#ifdef OFFSPEC_AVX2
// Streaming the 1.5B target's block weights through kwtile against ktile's tiles (2 cores, ms): AVX-512 4 rows 67
// against 83, 6: 89 / 134, 7: 103 / 144; AVX2 5: 110 / 145, 7: 133 / 153. From 8, ktile's 8-row tiles.
constexpr int64_t KWTILE_ROWS = 8;

// Fewer than KWTILE_ROWS activation rows (a decoding step, a small tree): 8 weight rows at a time, a lane per weight
// row, so one 8-row horizontal sum (rows_sum) serves 8 outputs, and each weight block is decoded once for all the
// activation rows (ktile's tiles of 4 decode it once per tile). Each output's float steps are KSteps' (the same bits).
// y[(r0 + r) * ystride + i] for weight rows w + i * rb, i < 8.
template <int64_t T, int R>
void kwtile(const uint8_t* w, int64_t rb, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using B = KBlock<T>;
  __m256 acc[R];  // acc[r], lane i: weight row i, activation row r0 + r
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    ISum is[R][8], ms[R][8];  // (activation row, weight row)
    alignas(32) float d[8], dmin[8];
    for (int i = 0; i < 8; i++) {
      const uint8_t* wi = w + i * rb;
      // this row two super-blocks ahead, or the next 8 rows' first ones (8 rows are read side by side)
      const uint8_t* ahead = sb + 2 < n ? wi + (sb + 2) * B::BYTES : wi + 8 * rb + (sb + 2 - n) * B::BYTES;
      for (int64_t line = 0; line < B::BYTES; line += 64) __builtin_prefetch(ahead + line);
      const B blk(wi + sb * B::BYTES);
      ISum part[R], mpart[R];
      OFFSPEC_KSUMS<T, R>(blk, x, r0, sb, part, mpart);
      for (int r = 0; r < R; r++) {
        is[r][i] = part[r];
        if constexpr (B::MIN) ms[r][i] = mpart[r];
      }
      d[i] = blk.d;
      dmin[i] = blk.dmin;
    }
    for (int r = 0; r < R; r++) {
      const __m256 dx = _mm256_set1_ps(x.dval(r0 + r, sb));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows_sum<8>(is[r])), _mm256_mul_ps(_mm256_load_ps(d), dx), acc[r]);
      if constexpr (B::MIN)
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(rows_sum<8>(ms[r])), _mm256_mul_ps(_mm256_load_ps(dmin), dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ystride, acc[r]);
}
#endif

// y[r * ystride + i] for `count` K-quant weight rows W_i (rb bytes apart) and every activation row r.
template <int64_t T>
void krows(const uint8_t* w, int64_t rb, int64_t count, const XSet& x, float* y, int64_t ystride) {
  int64_t i = 0;
#ifdef OFFSPEC_AVX2
  if (x.M < KWTILE_ROWS)
    for (; i + 8 <= count; i += 8) switch (x.M) {
        case 1: kwtile<T, 1>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 2: kwtile<T, 2>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 3: kwtile<T, 3>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 4: kwtile<T, 4>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 5: kwtile<T, 5>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 6: kwtile<T, 6>(w + i * rb, rb, x, 0, y + i, ystride); break;
        case 7: kwtile<T, 7>(w + i * rb, rb, x, 0, y + i, ystride); break;
        default: break;  // unreachable: qgemm returns before a product of no rows
      }
#endif
  for (; i < count; i++)
    in_tiles<true>(x.M, [&](int64_t r, auto R) { ktile<T, decltype(R)::value>(w + i * rb, x, r, y + i, ystride); });
}

// Float dot product in a fixed order (float weights, and the types without an integer kernel).
inline float dot_f32(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float r = 0.0f;
#ifdef OFFSPEC_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
  r = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; k + 8 <= K; k += 8)
    for (int l = 0; l < 8; l++) acc[l] += a[k + l] * b[k + l];
  r = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
  for (; k < K; k++) r += a[k] * b[k];
  return r;
}

// The types whose dot product runs on quantized activations.
inline bool integer_kernel(int64_t type) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K:
    case IQ4_NL: case IQ4_XS:
    case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ1_S: case IQ1_M: case TQ1_0: case TQ2_0:
    case MXFP4:
      return true;
    default: return false;
  }
}

// y[r * ystride + i] = W_i . x_r for the `count` weight rows W_i (rb bytes apart) and every activation row r.
inline void dot_rows(int64_t type, const uint8_t* w, int64_t rb, int64_t count, const XSet& x, float* y,
                     int64_t ystride) {
  switch (type) {
    case Q2_K: return krows<Q2_K>(w, rb, count, x, y, ystride);
    case Q3_K: return krows<Q3_K>(w, rb, count, x, y, ystride);
    case Q4_K: return krows<Q4_K>(w, rb, count, x, y, ystride);
    case Q5_K: return krows<Q5_K>(w, rb, count, x, y, ystride);
    case Q6_K: return krows<Q6_K>(w, rb, count, x, y, ystride);
    case IQ4_XS: return krows<IQ4_XS>(w, rb, count, x, y, ystride);
    case IQ2_XXS: return krows<IQ2_XXS>(w, rb, count, x, y, ystride);
    case IQ2_XS: return krows<IQ2_XS>(w, rb, count, x, y, ystride);
    case IQ2_S: return krows<IQ2_S>(w, rb, count, x, y, ystride);
    case IQ3_XXS: return krows<IQ3_XXS>(w, rb, count, x, y, ystride);
    case IQ3_S: return krows<IQ3_S>(w, rb, count, x, y, ystride);
    case IQ1_S: return krows<IQ1_S>(w, rb, count, x, y, ystride);
    case IQ1_M: return krows<IQ1_M>(w, rb, count, x, y, ystride);
    case TQ1_0: return krows<TQ1_0>(w, rb, count, x, y, ystride);
    case TQ2_0: return krows<TQ2_0>(w, rb, count, x, y, ystride);
    default: break;
  }
  for (int64_t i = 0; i < count; i++) {
    const uint8_t* wi = w + i * rb;
    float* yi = y + i;
    switch (type) {
      case Q4_0: rows<Legacy<Q4_0>>(wi, x, yi, ystride); break;
      case Q4_1: rows<Legacy<Q4_1>>(wi, x, yi, ystride); break;
      case Q5_0: rows<Legacy<Q5_0>>(wi, x, yi, ystride); break;
      case Q5_1: rows<Legacy<Q5_1>>(wi, x, yi, ystride); break;
      case Q8_0: rows<Legacy<Q8_0>>(wi, x, yi, ystride); break;
      case IQ4_NL: rows<Legacy<IQ4_NL>>(wi, x, yi, ystride); break;
      case MXFP4: rows<Legacy<MXFP4>>(wi, x, yi, ystride); break;
      default: TORCH_CHECK(false, "offspec: no integer kernel for ggml type ", type);
    }
  }
}

}  // namespace offspec
