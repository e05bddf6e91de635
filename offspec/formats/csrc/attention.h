// Attention whose result for a query depends only on that query and the keys it may see, in slot order:
// never on the other queries of the pass or on the keys it may not see. A tree node attends to the committed
// prefix and its ancestors; the target alone attends to the same prefix and the same tokens, committed. With
// the same keys in the same order, the same operations give the same bits: verification and decoding without
// a draft agree exactly (as the row-invariant linear kernels do for the rest of the layer).
//
// Per query head the operations are fixed: each visible key's score dot_f32(q, k) * scale (then soft-capped), the
// largest of them, p = softmax_exp(score - largest) and their double sum in slot order, and each output element's fma
// chain acc = fma(p, v, acc) over the keys in slot order, times 1 / sum. gpt-oss's attention sinks (a learned logit
// per head, a key without a value) join the largest and, last, the sum: the same for every query. What may vary is
// only how the work is laid out, never the value of an operation: the query heads that share a key head
// (grouped-query attention) run together, so that each visible key and value row is read once for all of them and
// the visible keys are listed once, and the output elements' chains run in registers, a chunk of elements at a
// time over all the keys.
#pragma once

#include "ggml_dot.h"
#ifdef OFFSPEC_AVX2
#include "ggml_x16_vec.h"  // V16, V8
#endif

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace offspec {

// exp(x) for a softmax's x = score - largest <= 0: Cephes' single-precision polynomial after a reduction by ln 2, in
// operations every build computes alike (the scalar function below, AVX2's 8 lanes and AVX-512's 16 are the same
// fmas, products and roundings), so a key's weight never depends on the build or on which lane it fell in. About
// 2 ulp of exp; 0 below ln(FLT_MIN) (no subnormals). It replaced a scalar std::exp per key: the target's attention
// at 2,048 keys on one thread, 0.22-0.24 -> 0.17 ms a layer for one query, 14.1-15.3 -> 10.6-10.8 ms for 64.
constexpr float EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;  // ln 2 = HI + LO, HI exact in 9 bits
constexpr float EXP_MIN = -87.3365447505531f;                             // ln(FLT_MIN)
constexpr float EXP_C0 = 1.9875691500e-4f, EXP_C1 = 1.3981999507e-3f, EXP_C2 = 8.3334519073e-3f,
                EXP_C3 = 4.1665795894e-2f, EXP_C4 = 1.6666665459e-1f, EXP_C5 = 5.0000001201e-1f;

inline float softmax_exp(float x) {
  if (!(x >= EXP_MIN)) return 0.0f;
  const float n = std::nearbyint(x * EXP_LOG2E);  // in [-126, 0]
  float r = std::fma(n, -EXP_LN2_HI, x);
  r = std::fma(n, -EXP_LN2_LO, r);
  float p = std::fma(EXP_C0, r, EXP_C1);
  p = std::fma(p, r, EXP_C2);
  p = std::fma(p, r, EXP_C3);
  p = std::fma(p, r, EXP_C4);
  p = std::fma(p, r, EXP_C5);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#ifdef OFFSPEC_AVX2
// softmax_exp in each lane of a vector (V16: AVX-512, V8: AVX2), operation for operation
template <class V>
inline typename V::F softmax_expv(typename V::F x) {
  using F = typename V::F;
  const F lo = V::fset(EXP_MIN);
  const F xin = V::fmax(x, lo);  // the lanes dropped at the end stay in range
  const F n = V::fround(V::fmul(xin, V::fset(EXP_LOG2E)));
  F r = V::fmadd(n, V::fset(-EXP_LN2_HI), xin);
  r = V::fmadd(n, V::fset(-EXP_LN2_LO), r);
  F p = V::fmadd(V::fset(EXP_C0), r, V::fset(EXP_C1));
  p = V::fmadd(p, r, V::fset(EXP_C2));
  p = V::fmadd(p, r, V::fset(EXP_C3));
  p = V::fmadd(p, r, V::fset(EXP_C4));
  p = V::fmadd(p, r, V::fset(EXP_C5));
  const F y = V::fadd(V::fmadd(p, V::fmul(r, r), r), V::fset(1.0f));
  return V::keep_ge(V::fmul(y, V::pow2(n)), x, lo);
}
#endif

// p[c] = softmax_exp(p[c] - top) for c < n, in place: whole vectors, then the rest one by one (the same values)
inline void softmax_exps(float* p, int64_t n, float top) {
  int64_t c = 0;
#ifdef OFFSPEC_AVX512
  for (; c + 16 <= n; c += 16) V16::store(p + c, softmax_expv<V16>(V16::fsub(V16::fload(p + c), V16::fset(top))));
#endif
#ifdef OFFSPEC_AVX2
  for (; c + 8 <= n; c += 8) V8::store(p + c, softmax_expv<V8>(V8::fsub(V8::fload(p + c), V8::fset(top))));
#endif
  for (; c < n; c++) p[c] = softmax_exp(p[c] - top);
}

// The query heads of one key head that run together: each key and value row is read once for them. Up to 4 (groups
// of 5 to 8 split in two): 8 at a time gave AVX-512 one read of a row for 6 heads, but its dots then ran slower
// (a 2048-token prefill's attention 1.15x slower, a decoding step's from memory 1.05x faster), and fewer tasks.
constexpr int ATTEND_HEADS = 4;

// s[g] = dot_f32(q[g], k, D) for G heads against one key row, read once: each head's sum in dot_f32's own order
// (four 8-lane accumulators over steps of 32, then hsum of (a0 + a1) + (a2 + a3)), so the same bits. D % 32 == 0.
template <int G>
inline void attend_dots(const float* const* q, const float* k, int64_t D, float* s) {
#ifdef OFFSPEC_AVX2
  __m256 a[G][4];
  for (int g = 0; g < G; g++) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    for (int j = 0; j < 4; j++) {
      const __m256 kv = _mm256_loadu_ps(k + d + 8 * j);
      for (int g = 0; g < G; g++) a[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d + 8 * j), kv, a[g][j]);
    }
  }
  for (int g = 0; g < G; g++) s[g] = hsum(_mm256_add_ps(_mm256_add_ps(a[g][0], a[g][1]), _mm256_add_ps(a[g][2], a[g][3])));
#else
  for (int g = 0; g < G; g++) s[g] = dot_f32(q[g], k, D);
#endif
}

#ifdef OFFSPEC_AVX2
// Elements d0 .. d0 + CH * V::LANES of attend_values (below) for G heads, in G * CH registers over all the keys.
template <class V, int G, int CH>
inline void attend_values_chunk(const float* const* p, const int64_t* slot, int64_t n, const float* vh, int64_t D,
                                int64_t d0, const float* inv, float* const* o) {
  using F = typename V::F;
  F a[G][CH];
  for (int g = 0; g < G; g++)
    for (int j = 0; j < CH; j++) a[g][j] = V::fzero();
  for (int64_t c = 0; c < n; c++) {
    const float* vr = vh + slot[c] * D + d0;
    F v[CH];
    for (int j = 0; j < CH; j++) v[j] = V::fload(vr + V::LANES * j);
    for (int g = 0; g < G; g++) {
      const F pc = V::fset(p[g][c]);
      for (int j = 0; j < CH; j++) a[g][j] = V::fmadd(pc, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; g++) {
    const F s = V::fset(inv[g]);
    for (int j = 0; j < CH; j++) V::store(o[g] + d0 + V::LANES * j, V::fmul(a[g][j], s));
  }
}
#endif

// o[g][0 .. D) = (sum over c < n, in order, of fma(p[g][c], vh[slot[c] * D + d], .)) * inv[g] for G heads. Each
// element's chain is the same whatever G or the chunking: a chunk of elements of the G heads stays in registers
// over all the keys (AVX-512: up to 128 elements, as many as G heads' sums fit in its 32 registers; AVX2: 16,
// 2G + 2 of its 16).
template <int G>
inline void attend_values(const float* const* p, const int64_t* slot, int64_t n, const float* vh, int64_t D,
                          const float* inv, float* const* o) {
  int64_t d0 = 0;
#ifdef OFFSPEC_AVX512
  // CH registers of 16 elements a head, G * CH + CH of the 32: the widest chunk that fits runs first
  constexpr int WIDE = G <= 3 ? 8 : G <= 6 ? 4 : 2;
  if constexpr (WIDE >= 8)
    for (; d0 + 128 <= D; d0 += 128) attend_values_chunk<V16, G, 8>(p, slot, n, vh, D, d0, inv, o);
  if constexpr (WIDE >= 4)
    for (; d0 + 64 <= D; d0 += 64) attend_values_chunk<V16, G, 4>(p, slot, n, vh, D, d0, inv, o);
  for (; d0 + 32 <= D; d0 += 32) attend_values_chunk<V16, G, 2>(p, slot, n, vh, D, d0, inv, o);
#endif
#ifdef OFFSPEC_AVX2
  for (; d0 + 16 <= D; d0 += 16) attend_values_chunk<V8, G, 2>(p, slot, n, vh, D, d0, inv, o);
#endif
  for (; d0 < D; d0++) {  // the rest (and every element without AVX2), one element at a time: the same chain
    for (int g = 0; g < G; g++) {
      float acc = 0.0f;
      for (int64_t c = 0; c < n; c++) acc = std::fma(p[g][c], vh[slot[c] * D + d0], acc);
      o[g][d0] = acc * inv[g];
    }
  }
}

// The largest of x[0 .. n) (n > 0; scores are finite).
inline float attend_max(const float* x, int64_t n) {
  int64_t c = 0;
  float top = x[0];
#ifdef OFFSPEC_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (c = 8; c + 8 <= n; c += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + c));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
#endif
  for (; c < n; c++) top = x[c] > top ? x[c] : top;
  return top;
}

// One query's G heads (q[g]; out o[g]) over its n visible keys (slot), their scores and exponentials in p[g].
template <int G>
inline void attend_heads(const float* const* q, const int64_t* slot, int64_t n, const float* kh, const float* vh,
                         int64_t D, float scale, float softcap, const float* sink, float* const* p, float* const* o) {
  if (n == 0) {
    for (int g = 0; g < G; g++)
      for (int64_t d = 0; d < D; d++) o[g][d] = 0.0f;
    return;
  }
  for (int64_t c = 0; c < n; c++) {  // one key row for the G heads
    const float* kr = kh + slot[c] * D;
    float s[G];
    if (D % 32 == 0) attend_dots<G>(q, kr, D, s);
    else
      for (int g = 0; g < G; g++) s[g] = dot_f32(q[g], kr, D);
    for (int g = 0; g < G; g++) {
      float x = s[g] * scale;
      if (softcap > 0.0f) x = std::tanh(x / softcap) * softcap;
      p[g][c] = x;
    }
  }
  float top[G];  // the largest score (a maximum: the same whatever the order it is taken in)
  for (int g = 0; g < G; g++) top[g] = attend_max(p[g], n);
  if (sink != nullptr)
    for (int g = 0; g < G; g++) top[g] = sink[g] > top[g] ? sink[g] : top[g];
  for (int g = 0; g < G; g++) softmax_exps(p[g], n, top[g]);
  double total[G];  // each head's in slot order (the heads' chains interleaved)
  for (int g = 0; g < G; g++) total[g] = 0.0;
  for (int64_t c = 0; c < n; c++)
    for (int g = 0; g < G; g++) total[g] += p[g][c];
  if (sink != nullptr)  // the sink's weight, last: it takes a share of the sum and gives no value
    for (int g = 0; g < G; g++) total[g] += softmax_exp(sink[g] - top[g]);
  float inv[G];
  for (int g = 0; g < G; g++) inv[g] = (float)(1.0 / total[g]);
  attend_values<G>(p, slot, n, vh, D, inv, o);
}

// out (Q, H, D) = softmax(cap(scale q k^T) over visible keys) v, per query row and head; cap(s) = tanh(s / softcap)
// * softcap where softcap > 0 (gemma2's attention logit soft-capping), else s; sinks (H,) or nullptr: a logit per
// head in the softmax's sum and no value (gpt-oss).
// q (H, Q, D) contiguous; k, v (Hkv, L, D) with row stride D and head stride `kv_head_stride` (a slice of a
// pre-allocated cache); visible (Q, L) bool.
inline void attend(const float* q, const float* k, const float* v, const bool* visible, float* out, int64_t H,
                   int64_t Hkv, int64_t Q, int64_t L, int64_t D, int64_t kv_head_stride, float scale,
                   float softcap = 0.0f, const float* sinks = nullptr) {
  const int64_t group = H / Hkv;
  const int64_t batches = (group + ATTEND_HEADS - 1) / ATTEND_HEADS;  // per key head, of near-equal sizes
  // task t: key head t / (Q * batches), query (t / batches) % Q, head batch t % batches
  at::parallel_for(0, Hkv * Q * batches, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slot(L);                  // (n,) the visible keys' slots, in order
    std::vector<float> score(ATTEND_HEADS * L);    // (G, n) scores, then their exponentials
    for (int64_t t = t0; t < t1; t++) {
      const int64_t hk = t / (Q * batches), i = (t / batches) % Q, b = t % batches;
      const int64_t h0 = hk * group + b * group / batches, G = hk * group + (b + 1) * group / batches - h0;
      const float* kh = k + hk * kv_head_stride;
      const float* vh = v + hk * kv_head_stride;
      const bool* vis = visible + i * L;
      int64_t n = 0;
      for (int64_t j = 0; j < L; j++)
        if (vis[j]) slot[n++] = j;
      const float* qg[ATTEND_HEADS];
      float* pg[ATTEND_HEADS];
      float* og[ATTEND_HEADS];
      for (int64_t g = 0; g < G; g++) {
        qg[g] = q + ((h0 + g) * Q + i) * D;
        pg[g] = score.data() + g * L;
        og[g] = out + (i * H + h0 + g) * D;
      }
      const float* sg = sinks != nullptr ? sinks + h0 : nullptr;
      switch (G) {
        case 1: attend_heads<1>(qg, slot.data(), n, kh, vh, D, scale, softcap, sg, pg, og); break;
        case 2: attend_heads<2>(qg, slot.data(), n, kh, vh, D, scale, softcap, sg, pg, og); break;
        case 3: attend_heads<3>(qg, slot.data(), n, kh, vh, D, scale, softcap, sg, pg, og); break;
        default: attend_heads<4>(qg, slot.data(), n, kh, vh, D, scale, softcap, sg, pg, og); break;
      }
    }
  });
}

}  // namespace offspec
