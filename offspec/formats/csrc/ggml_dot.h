// Dot products of one row of ggml weight blocks with one activation row quantized to 8 bits per block of 32
// (the way ggml computes them): integer products summed exactly per block, then scaled in float32.
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
#endif

namespace offspec {

constexpr int64_t QB = 32;  // activation block

// Quantize x (K floats, K % 32 == 0): d = max|x| / 127, q = round-half-even(x / d), s = sum(q).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / QB; b++) {
    const float* xb = x + b * QB;
    float amax = 0.0f;
    for (int l = 0; l < QB; l++) amax = std::max(amax, std::fabs(xb[l]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int l = 0; l < QB; l++) {
      const int v = (int)std::nearbyint(xb[l] * id);
      q[b * QB + l] = (int8_t)v;
      sum += v;
    }
    d[b] = db;
    s[b] = sum;
  }
}

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

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load32u(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

// --- per-type kernels: one weight row against M activation rows ---------------------------------------------
//
// Activation rows are processed in tiles of up to 4, with their accumulators in registers; each weight block is
// decoded once per tile. Every row has two vector accumulators (even and odd activation blocks) and one scalar
// for minimum terms, and sees the same sequence of operations whatever the tile size or M: that is what makes
// the results row invariant.

struct XSet {  // M quantized activation rows
  const int8_t* q;   // (M, K)
  const float* d;    // (M, K/32)
  const int32_t* s;  // (M, K/32)
  int64_t M, K, nb;  // nb = K / 32
  const int8_t* qrow(int64_t m, int64_t blk) const { return q + m * K + blk * QB; }
  float dval(int64_t m, int64_t blk) const { return d[m * nb + blk]; }
  int32_t sval(int64_t m, int64_t blk) const { return s[m * nb + blk]; }
};

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
#endif

// Legacy types, one block of 32 per step. Q4_0 -> q - 8, Q5_0 -> q - 16, Q8_0 -> q (signed, w = d q');
// Q4_1 / Q5_1 -> q (unsigned, w = d q + m).
template <int64_t T>
struct Legacy {
  static constexpr int64_t BYTES = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  static constexpr int SUBS = 1, BLOCK = 32;
  static constexpr bool MIN = T == Q4_1 || T == Q5_1;
  const uint8_t* blk;
  float d, m;
  explicit Legacy(const uint8_t* p) : blk(p), d(half_at(p)), m(MIN ? half_at(p + 2) : 0.0f) {}
  QVec q(int) const {
#ifdef OFFSPEC_AVX2
    if (T == Q4_0) return _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8));
    if (T == Q5_0) return _mm256_sub_epi8(_mm256_or_si256(nibbles_32(blk + 6), bits_32(blk + 2)), _mm256_set1_epi8(16));
    if (T == Q8_0) return load32u(blk + 2);
    if (T == Q4_1) return nibbles_32(blk + 4);
    return _mm256_or_si256(nibbles_32(blk + 8), bits_32(blk + 4));  // Q5_1
#else
    QVec r;
    if (T == Q8_0) {
      std::memcpy(r.v, blk + 2, 32);
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

// Q4_K / Q5_K: super-blocks of 256, w = d sc_j q - dmin m_j per sub-block j of 32
template <int64_t T>
struct KQuant45 {
  static constexpr int64_t BYTES = T == Q4_K ? 144 : 176;
  static constexpr int SUBS = 8, BLOCK = 256;
  static constexpr bool MIN = true;
  const uint8_t* blk;
  float ds[8], dm[8];
  explicit KQuant45(const uint8_t* p) : blk(p) {
    const float d = half_at(p), dmin = half_at(p + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(p + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
      ds[j] = d * (float)sc[j];
      dm[j] = -(dmin * (float)mn[j]);  // - dmin m_j * sum(x)
    }
  }
  QVec q(int j) const {
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48);
#ifdef OFFSPEC_AVX2
    const __m256i raw = load32u(qs + (j / 2) * 32);
    __m256i v = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j % 2)), _mm256_set1_epi8(0x0F));
    if (T == Q5_K) {
      const __m256i h = _mm256_and_si256(_mm256_srli_epi16(load32u(blk + 16), j), _mm256_set1_epi8(1));
      v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
    }
    return v;
#else
    QVec r;
    for (int l = 0; l < 32; l++) {
      int v = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
      if (T == Q5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
      r.v[l] = (int8_t)v;
    }
    return r;
#endif
  }
  float scale(int j) const { return ds[j]; }
  float min(int j) const { return dm[j]; }
  static auto isum(const QVec& q, const int8_t* xq, int) { return isum_unsigned(q, xq); }
};

// Q6_K: super-blocks of 256, w = d sc_j (q - 32) per sub-block j of 16; the two scales of an activation block
// are applied in integers
struct KQuant6 {
  static constexpr int64_t BYTES = 210;
  static constexpr int SUBS = 8, BLOCK = 256;
  static constexpr bool MIN = false;
  const uint8_t* blk;
  const int8_t* sc;
  float d;
  explicit KQuant6(const uint8_t* p) : blk(p), sc(reinterpret_cast<const int8_t*>(p + 192)), d(half_at(p + 208)) {}
  QVec q(int i) const {  // activation block i = h*4 + s: elements h*128 + s*32 .. +32, values in [-32, 31]
    const int h = i / 4, s = i % 4;
#ifdef OFFSPEC_AVX2
    const __m256i src = load32u(blk + h * 64 + (s & 1) * 32);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(src, 4 * (s >> 1)), _mm256_set1_epi8(0x0F));
    const __m256i hb = load32u(blk + 128 + h * 32);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
#else
    QVec r;
    for (int l = 0; l < 32; l++) {
      const int lo = (blk[h * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 0x0F;
      const int hi = (blk[128 + h * 32 + l] >> (2 * s)) & 3;
      r.v[l] = (int8_t)((lo | (hi << 4)) - 32);
    }
    return r;
#endif
  }
  float scale(int) const { return d; }
  float min(int) const { return 0.0f; }
  auto isum(const QVec& q, const int8_t* xq, int i) const {
#ifdef OFFSPEC_AVX2
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(load32(xq), q));
    const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1]), _mm_set1_epi16(sc[2 * i]));
    return _mm256_madd_epi16(p16, scales);  // 8 x int32, each half of the block times its own scale
#else
    int32_t total = 0;
    for (int half = 0; half < 2; half++) {
      int32_t part = 0;
      for (int l = half * 16; l < half * 16 + 16; l++) part += (int32_t)q.v[l] * xq[l];
      total += part * sc[2 * i + half];
    }
    return total;
#endif
  }
};

template <class B> inline auto block_isum(const B& blk, const QVec& q, const int8_t* xq, int j) {
  if constexpr (std::is_same_v<B, KQuant6>) return blk.isum(q, xq, j); else return B::isum(q, xq, j);
}

// Rows r0 .. r0+R of the output column of one weight row.
template <class B, int R>
void tile(const uint8_t* w, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  constexpr bool KMIN = B::MIN && B::SUBS == 8;  // k-quant minimums: one vector step per super-block
  Acc even[R], odd[R], mins[R];
  float off_even[R], off_odd[R];  // legacy minimums
  for (int r = 0; r < R; r++) {
    even[r] = odd[r] = mins[r] = acc_zero();
    off_even[r] = off_odd[r] = 0.0f;
  }
  for (int64_t sb = 0, n = x.K / B::BLOCK; sb < n; sb++) {
    const B blk(w + sb * B::BYTES);
    for (int j = 0; j < B::SUBS; j++) {
      const QVec q = blk.q(j);
      const float ws = blk.scale(j);
      const int64_t xb = sb * B::SUBS + j;
      for (int r = 0; r < R; r++) {
        const float dx = x.dval(r0 + r, xb);
        const auto isum = block_isum(blk, q, x.qrow(r0 + r, xb), j);
        if (xb & 1) odd[r] = fma_acc(isum, ws * dx, odd[r]); else even[r] = fma_acc(isum, ws * dx, even[r]);
        if (B::MIN && !KMIN) {
          const float t = (blk.min(j) * dx) * (float)x.sval(r0 + r, xb);
          if (xb & 1) off_odd[r] += t; else off_even[r] += t;
        }
      }
    }
    if constexpr (KMIN) {
      for (int r = 0; r < R; r++) {  // sum over the 8 sub-blocks of min_j * dx_j * sum(x_j)
        const float* dx = &x.d[(r0 + r) * x.nb + sb * 8];
        const int32_t* sx = &x.s[(r0 + r) * x.nb + sb * 8];
#ifdef OFFSPEC_AVX2
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(blk.dm), _mm256_loadu_ps(dx));
        mins[r] = _mm256_fmadd_ps(t, _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sx))),
                                  mins[r]);
#else
        for (int j = 0; j < 8; j++) mins[r] += (blk.dm[j] * dx[j]) * (float)sx[j];
#endif
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float v = acc_sum(even[r], odd[r]);
    if constexpr (KMIN) v += acc_sum(mins[r], acc_zero());
    if (B::MIN && !KMIN) v += off_even[r] + off_odd[r];
    y[(r0 + r) * ystride] = v;
  }
}

template <class B>
void rows(const uint8_t* w, const XSet& x, float* y, int64_t ystride) {
  int64_t r = 0;
  for (; r + 4 <= x.M; r += 4) tile<B, 4>(w, x, r, y, ystride);
  switch (x.M - r) {
    case 3: tile<B, 3>(w, x, r, y, ystride); break;
    case 2: tile<B, 2>(w, x, r, y, ystride); break;
    case 1: tile<B, 1>(w, x, r, y, ystride); break;
    default: break;
  }
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
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}

// y[r * ystride] = W_row . x_r for every activation row r.
inline void dot_rows(int64_t type, const uint8_t* w, const XSet& x, float* y, int64_t ystride) {
  switch (type) {
    case Q4_0: rows<Legacy<Q4_0>>(w, x, y, ystride); break;
    case Q4_1: rows<Legacy<Q4_1>>(w, x, y, ystride); break;
    case Q5_0: rows<Legacy<Q5_0>>(w, x, y, ystride); break;
    case Q5_1: rows<Legacy<Q5_1>>(w, x, y, ystride); break;
    case Q8_0: rows<Legacy<Q8_0>>(w, x, y, ystride); break;
    case Q4_K: rows<KQuant45<Q4_K>>(w, x, y, ystride); break;
    case Q5_K: rows<KQuant45<Q5_K>>(w, x, y, ystride); break;
    case Q6_K: rows<KQuant6>(w, x, y, ystride); break;
    default: TORCH_CHECK(false, "offspec: no integer kernel for ggml type ", type);
  }
}

}  // namespace offspec
