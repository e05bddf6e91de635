// Wide passes (prefill: many activation rows) of the lattice types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S on
// AVX512-VNNI, as a blocked integer GEMM: a block of weight rows is decoded once into signed bytes (the KBlock
// decoders of ggml_dot_iq2.h / ggml_dot_iq3.h, through ggml_dot512.h's ksigned2 and kscales2), the activations are
// laid out 16 rows to a register (4 bytes of K per row, vpdpbusd's layout), and a register tile of 4 weight rows x
// 32 activation rows runs over K with one weight dword broadcast per 2 products of 16 rows each. Included by
// ggml_cpu.cpp where the build has AVX512-VNNI.
//
// The same bits as ktile / kwtile (ggml_dot.h): per super-block the exact integer sum
//   I = sum_j ls_j sum_k q_k x_k
// is computed in another order (integer sums are exact in any order), then each output takes KSteps' one float
// step per super-block, acc = fma((float)I, d * dx, acc), in super-block order from acc = 0. The activations go in
// as unsigned bytes x + 128 (vpdpbusd multiplies unsigned by signed bytes, here the weights), so a sub-block's sum
// of q (x + 128) is 128 sum(q) too large: the super-block's integer sum starts at -128 sum_k ls_k q_k (WideW::corr,
// once per weight row). Every sum is exact in int32: |q| <= 62, a sub-block's |sum q (x + 128)| <= 32 * 62 * 255,
// times ls <= 31 and over 8 sub-blocks < 2^27.
//
// 476 activation rows, one core (the machine shared, medians of 7), IQ3_XXS ffn_up 8960x1536: ktile's 8-row tiles
// 266 -> 26 ms (49 -> 495 GOPS), ffn_down 1536x8960 196 -> 25 ms; IQ2_XS ffn_up 165 -> 29 ms; IQ2_S attn_q
// 1536x1536 39 -> 4.7 ms; IQ3_S attn_output 52 -> 4.7 ms.
//
// Each output depends on its own activation row and weight row only: padding rows (M to a multiple of 32, weight
// rows to a multiple of 4) compute lanes that are never stored. Row invariance holds at any M.
#pragma once

#include <immintrin.h>

#include <memory>
#include <vector>

namespace offspec {

// The types this file runs, and from how many activation rows (a pass of fewer rows keeps ktile's 8-row tiles;
// kwtile below 8).
constexpr bool wide_iq_type(int64_t t) { return t == IQ2_XXS || t == IQ2_XS || t == IQ2_S || t == IQ3_XXS || t == IQ3_S; }
// (one core, shared machine: 24 rows of IQ3_XXS ffn_up 8.6 -> 2.4 ms, 32: 10.0 -> 3.1; at 16, 32 padded rows, about
// even; 8 stay on kwtile / ktile)
constexpr int64_t WIDE_MIN_ROWS = 16;
constexpr int64_t WIDE_PANEL = 16;  // activation rows per register (16 int32 lanes)

// The activation rows in panels of 16: panel p, group g (elements 4g .. 4g + 3) holds 64 bytes, the 4 bytes x + 128 of
// rows 16p .. 16p + 15 in turn; padding rows (past M, to an even number of panels) are x = 0 and dx = 0.
struct WideX {
  int64_t M, K, P, nsb;  // P panels (even), nsb = K / 256 super-blocks
  std::unique_ptr<uint8_t[]> q;  // (P, K / 4, 16, 4)
  std::unique_ptr<float[]> dx;   // (P, nsb, 16) the activation scales
  const uint8_t* panel(int64_t p) const { return q.get() + p * WIDE_PANEL * K; }
  const float* dxs(int64_t p, int64_t sb) const { return dx.get() + (p * nsb + sb) * WIDE_PANEL; }
  explicit WideX(const XSet& x) : M(x.M), K(x.K), P((x.M + 2 * WIDE_PANEL - 1) / (2 * WIDE_PANEL) * 2), nsb(x.K / 256) {
    q.reset(new uint8_t[P * WIDE_PANEL * K]);
    dx.reset(new float[P * nsb * WIDE_PANEL]);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; p++)
        for (int r = 0; r < WIDE_PANEL; r++) {
          const int64_t m = p * WIDE_PANEL + r;
          uint32_t* out = reinterpret_cast<uint32_t*>(q.get() + p * WIDE_PANEL * K) + r;
          if (m < M) {
            const int8_t* src = x.q + m * K;
            for (int64_t g = 0; g < K / 4; g++) {
              uint32_t v;
              std::memcpy(&v, src + 4 * g, 4);
              out[g * WIDE_PANEL] = v ^ 0x80808080u;
            }
          } else {
            for (int64_t g = 0; g < K / 4; g++) out[g * WIDE_PANEL] = 0x80808080u;
          }
          for (int64_t sb = 0; sb < nsb; sb++) dx[(p * nsb + sb) * WIDE_PANEL + r] = m < M ? x.dval(m, sb) : 0.0f;
        }
    });
  }
};

// A block of decoded weight rows: q the signed weights, sc the integer scale of each 16 weights, corr the start of each
// super-block's integer sum (-128 sum_k ls_k q_k), d the super-block scale as ktile takes it (KBlock::d).
struct WideW {
  int64_t rows, K, nsb;
  std::vector<int8_t> q;      // (rows, K)
  std::vector<int32_t> sc;    // (rows, K / 16)
  std::vector<int32_t> corr;  // (rows, nsb)
  std::vector<float> d;       // (rows, nsb)
  WideW(int64_t rows_, int64_t K_)
      : rows(rows_), K(K_), nsb(K_ / 256), q(rows_ * K_), sc(rows_ * (K_ / 16)), corr(rows_ * nsb), d(rows_ * nsb) {}
  void clear(int64_t t) {  // a padding row: no weights
    std::fill(q.begin() + t * K, q.begin() + (t + 1) * K, 0);
    std::fill(sc.begin() + t * (K / 16), sc.begin() + (t + 1) * (K / 16), 0);
    std::fill(corr.begin() + t * nsb, corr.begin() + (t + 1) * nsb, 0);
    std::fill(d.begin() + t * nsb, d.begin() + (t + 1) * nsb, 0.0f);
  }
  // row t of the block from weight row w (nsb super-blocks of T)
  template <int64_t T>
  void decode(int64_t t, const uint8_t* w) {
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
    for (int64_t sb = 0; sb < nsb; sb++) {
      const KBlock<T> b(w + sb * KBlock<T>::BYTES);
      __m512i c = zero;  // 16 lanes of sum ls q
      int8_t* qo = q.data() + t * K + sb * 256;
      int32_t* so = sc.data() + t * (K / 16) + sb * 16;
      for (int j = 0; j < 8; j += 2) {  // sub-blocks j, j + 1
        const Signed512 s = ksigned2(b, j);
        const __m512i v = _mm512_mask_sub_epi8(s.mag, s.neg, zero, s.mag);
        _mm512_storeu_si512(qo + 32 * j, v);
        const __m512i sv = kscales2(b, j);  // int16 lane i: the scale of weights 2i, 2i + 1
        c = _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_maddubs_epi16(ones, v), sv));
        alignas(64) int16_t s16[32];
        _mm512_store_si512(s16, sv);
        for (int h = 0; h < 4; h++) so[2 * j + h] = s16[8 * h];
      }
      corr[t * nsb + sb] = -128 * _mm512_reduce_add_epi32(c);
      d[t * nsb + sb] = b.d;
    }
  }
};

// The scales' granularity: IQ2_XS and IQ2_S have a scale per 16 weights, the others per 32.
constexpr int wide_group(int64_t t) { return t == IQ2_XS || t == IQ2_S ? 16 : 32; }

// Weight rows t0 .. t0 + 4 of W against activation panels p0, p0 + 1 over all of K (8 integer sums of a sub-block,
// 8 of the super-block and 8 float accumulators in registers: per 4 bytes of K, 2 activation loads and 4 weight
// broadcasts feed 8 vpdpbusd of 64 products each; IQ2_XS's and IQ2_S's scales per 16 cost a vpmulld per 4 of them): y[m * ystride + t] for the
// valid rows m < M and t < nw (weight row t0 + t of the block is output column t of y).
template <int G>
inline void wide_tile(const WideW& W, int64_t t0, int64_t nw, const WideX& X, int64_t p0, float* y, int64_t ystride) {
  constexpr int NW = 4, NA = 2;
  const int64_t K = X.K;
  const uint8_t* xp[NA] = {X.panel(p0), X.panel(p0 + 1)};
  const int8_t* wq[NW];
  for (int t = 0; t < NW; t++) wq[t] = W.q.data() + (t0 + t) * K;
  __m512 facc[NW][NA];
  for (int t = 0; t < NW; t++)
    for (int a = 0; a < NA; a++) facc[t][a] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < X.nsb; sb++) {
    __m512i s1[NW][NA];  // the super-block's integer sums
    for (int t = 0; t < NW; t++) {
      const __m512i c = _mm512_set1_epi32(W.corr[(t0 + t) * X.nsb + sb]);
      for (int a = 0; a < NA; a++) s1[t][a] = c;
    }
#pragma GCC unroll 2
    for (int sub = 0; sub < 256 / G; sub++) {
      __m512i acc[NW][NA];  // the sub-block's sums of q (x + 128)
      for (int t = 0; t < NW; t++)
        for (int a = 0; a < NA; a++) acc[t][a] = _mm512_setzero_si512();
      const int64_t g0 = sb * 64 + sub * (G / 4);
#pragma GCC unroll 8
      for (int g = 0; g < G / 4; g++) {
        __m512i xv[NA];
        for (int a = 0; a < NA; a++) xv[a] = _mm512_loadu_si512(xp[a] + (g0 + g) * 64);
        for (int t = 0; t < NW; t++) {
          int32_t wd;
          std::memcpy(&wd, wq[t] + 4 * (g0 + g), 4);
          const __m512i wv = _mm512_set1_epi32(wd);
          for (int a = 0; a < NA; a++) acc[t][a] = _mm512_dpbusd_epi32(acc[t][a], xv[a], wv);
        }
      }
      for (int t = 0; t < NW; t++) {
        const __m512i sv = _mm512_set1_epi32(W.sc[(t0 + t) * (K / 16) + (sb * 256 + sub * G) / 16]);
        for (int a = 0; a < NA; a++) s1[t][a] = _mm512_add_epi32(s1[t][a], _mm512_mullo_epi32(acc[t][a], sv));
      }
    }
    for (int t = 0; t < NW; t++) {  // KSteps' float step: acc = fma((float)I, d * dx, acc)
      const __m512 d = _mm512_set1_ps(W.d[(t0 + t) * X.nsb + sb]);
      for (int a = 0; a < NA; a++)
        facc[t][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[t][a]), _mm512_mul_ps(d, _mm512_loadu_ps(X.dxs(p0 + a, sb))),
                                     facc[t][a]);
    }
  }
  for (int a = 0; a < NA; a++) {
    for (int t = 0; t < nw; t++) {
      alignas(64) float v[WIDE_PANEL];
      _mm512_store_ps(v, facc[t][a]);
      for (int l = 0; l < WIDE_PANEL; l++) {
        const int64_t m = (p0 + a) * WIDE_PANEL + l;
        if (m < X.M) y[m * ystride + t0 + t] = v[l];
      }
    }
  }
}

// y[m * ystride + i] for `count` weight rows W_i (rb bytes apart) and every activation row m: blocks of weight rows
// decoded once (about 256 KB of them, 64 at most: L2-resident with a pair of activation panels, 32 x K bytes, which
// the block's 4-row tiles then read from L2), each against all the panels (the activations stream from L3 once per
// block, a byte per 16 to 64 products).
template <int64_t T>
void wide_rows(const uint8_t* w, int64_t rb, int64_t count, const WideX& X, float* y, int64_t ystride) {
  const int64_t K = X.K;
  const int64_t block = std::max<int64_t>(4, std::min<int64_t>(64, (256 * 1024 / K) / 4 * 4));
  WideW W(block, K);
  for (int64_t i0 = 0; i0 < count; i0 += block) {
    const int64_t n = std::min(block, count - i0), padded = (n + 3) / 4 * 4;
    for (int64_t t = 0; t < n; t++) W.decode<T>(t, w + (i0 + t) * rb);
    for (int64_t t = n; t < padded; t++) W.clear(t);
    for (int64_t p = 0; p < X.P; p += 2)
      for (int64_t t0 = 0; t0 < padded; t0 += 4)
        wide_tile<wide_group(T)>(W, t0, std::min<int64_t>(4, n - t0), X, p, y + i0, ystride);
  }
}

inline void wide_dot_rows(int64_t type, const uint8_t* w, int64_t rb, int64_t count, const WideX& X, float* y,
                          int64_t ystride) {
  switch (type) {
    case IQ2_XXS: return wide_rows<IQ2_XXS>(w, rb, count, X, y, ystride);
    case IQ2_XS: return wide_rows<IQ2_XS>(w, rb, count, X, y, ystride);
    case IQ2_S: return wide_rows<IQ2_S>(w, rb, count, X, y, ystride);
    case IQ3_XXS: return wide_rows<IQ3_XXS>(w, rb, count, X, y, ystride);
    case IQ3_S: return wide_rows<IQ3_S>(w, rb, count, X, y, ystride);
    default: TORCH_CHECK(false, "offspec: no wide kernel for ggml type ", type);
  }
}

}  // namespace offspec
