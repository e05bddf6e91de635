// AMX tiles for the K-quants Q4_K, Q5_K, Q6_K and IQ4_XS (not Q2_K, Q3_K: see qgemm): the integer products of many
// activation rows at once on the tile unit (Intel AMX-INT8), the float steps in AVX-512. Included by ggml_dot.h when
// built with -mamx-tile -mamx-int8 (and AVX-512 VBMI/VNNI, which every AMX CPU has).
//
// Bit for bit the other kernels' results: a super-block's integer sum is exact on the tiles too, and the float
// steps are KSteps' (ggml_dot.h), one chain per output in super-block order. So a tree pass that runs here and a
// one-token pass that runs in ggml_dot512.h give the same logits.
//
// The sub-block scales are applied to the weights before the tiles see them: v = scale * q fits 16 bits (Q4_K:
// 0..945, Q5_K: 0..1953, Q6_K: -4096..4064, IQ4_XS: -3937..4064) and is split into its low byte (unsigned) and high
// byte (signed), so isum = sum(lo * x) + 256 * sum(hi * x): two tile products per 64 weights, both exact in int32.
// The minimums' term of Q4_K/Q5_K (sum_j m_j sum(x_j), int16 operands) is a VNNI product in the float step.
//
// Shapes: 16 weight rows x 16 activation rows per C tile, 64 weights (one chunk) per A/B tile; a super-block is
// 4 chunks. Each super-block of a group of 16 weight rows is decoded once (8 KiB of A tiles, which stay in L1),
// then multiplied with every group of 16 activation rows (the last one padded with zeros).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <vector>

namespace offspec {
namespace amx {

constexpr int64_t TR = 16;  // weight rows per tile
constexpr int64_t TM = 16;  // activation rows per tile
constexpr int64_t CHUNK = 64;  // weights per A tile row (K bytes)
constexpr int64_t TILE = 1024;  // bytes of an A or B tile: 16 x 64
constexpr int64_t PREFETCH_AHEAD = 2;  // super-blocks

// Linux gives a process the tile registers' state only when asked (once per process); false: no AMX here.
inline bool permitted() {
  static const bool ok = [] {
#ifdef SYS_arch_prctl
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// Whether qgemm uses the tiles (set_amx switches them off and on: tests compare both paths' bits)
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{permitted()};
  return on;
}

// Tiles 0, 1 and 5, 6: C (lo, hi; two pairs taking turns); 2, 3: A (weights' low and high bytes); 4: B
// (activations). All 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 7; t++) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// The activations in tile layout, made once per call: B tile (g, c) holds activation rows 16g.. of chunk c,
// 4 consecutive bytes of a row per int32 column: b[i][4n + t] = x[16g + n][64c + 4i + t].
struct Acts {
  int64_t M, G, chunks, nsb;
  std::vector<int8_t> b;       // (G, chunks, 16, 64)
  std::vector<float> dx;       // (G, nsb, 16) the activation blocks' scales (0 for the padding rows)
  std::vector<int32_t> xsum;   // (G, nsb, 4, 16) sums of 32 activations, two sub-blocks per int32 (int16 each)
  explicit Acts(const XSet& x)
      : M(x.M), G((x.M + TM - 1) / TM), chunks(x.K / CHUNK), nsb(x.K / 256),
        b(G * chunks * TILE, 0), dx(G * nsb * TM, 0.0f), xsum(G * nsb * 4 * TM, 0) {
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; g++)
        for (int64_t n = 0; n < TM && g * TM + n < M; n++) {
          const int64_t m = g * TM + n;
          const int8_t* q = x.q + m * x.K;
          for (int64_t c = 0; c < chunks; c++) {
            int8_t* tile = &b[(g * chunks + c) * TILE];
            for (int i = 0; i < 16; i++) std::memcpy(tile + i * 64 + 4 * n, q + c * CHUNK + 4 * i, 4);
          }
          for (int64_t sb = 0; sb < nsb; sb++) {
            dx[(g * nsb + sb) * TM + n] = x.dval(m, sb);
            for (int p = 0; p < 4; p++) {
              const int32_t lo = x.sval(m, sb * 8 + 2 * p), hi = x.sval(m, sb * 8 + 2 * p + 1);  // |.| <= 32 * 128
              xsum[((g * nsb + sb) * 4 + p) * TM + n] = (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) |
                                                                  (uint16_t)(int16_t)lo);
            }
          }
        }
    });
  }
  const int8_t* tile(int64_t g, int64_t c) const { return &b[(g * chunks + c) * TILE]; }
};

// One super-block of 16 weight rows decoded for the tiles: per chunk an A tile of the low bytes and one of the
// high bytes of scale * q, and per row the float scales and the minimums (pairs of int16 in an int32).
struct alignas(64) Weights {
  uint8_t a[4][2][TILE];  // (chunk, lo/hi, 16 rows x 64)
  float d[TR], dmin[TR];
  int32_t mins[TR][4];
};

// Low bytes of 64 int16 products (p0: weights 0..31, p1: 32..63) in order, and their high bytes.
inline void split_bytes(__m512i p0, __m512i p1, uint8_t* lo, uint8_t* hi) {
  alignas(64) static const uint8_t even[64] = {
      0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
      44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86,
      88, 90, 92, 94, 96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
  const __m512i ie = _mm512_load_si512(even);
  const __m512i io = _mm512_add_epi8(ie, _mm512_set1_epi8(1));
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi8(p0, ie, p1));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi8(p0, io, p1));
}

inline __m512i widen(const uint8_t* p) {  // 32 bytes -> 32 uint16
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i two_scales(int16_t a, int16_t b) {  // 16 x a, then 16 x b
  return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}

// Decode weight row r (of 16) of one super-block.
template <int64_t T>
void decode_row(const uint8_t* blk, int r, Weights& out) {
  const KBlock<T> kb(blk);
  out.d[r] = kb.d;
  out.dmin[r] = kb.dmin;
  if constexpr (KBlock<T>::MIN)
    for (int p = 0; p < 4; p++) out.mins[r][p] = (int32_t)kb.mn[2 * p] | ((int32_t)kb.mn[2 * p + 1] << 16);
  const __m512i nib = _mm512_set1_epi16(0x0F);
  for (int c = 0; c < 4; c++) {
    __m512i p0, p1;  // scale * q of weights 64c .. +31 and 64c + 32 .. +63 (sub-blocks 2c and 2c + 1)
    if constexpr (T == IQ4_XS) {  // table values (-127 .. 113) times the sub-block scale (-32 .. 31)
      p0 = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(kb.q(2 * c)), _mm512_set1_epi16(kb.ls[2 * c]));
      p1 = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(kb.q(2 * c + 1)), _mm512_set1_epi16(kb.ls[2 * c + 1]));
    } else if constexpr (T == Q6_K) {
      const int h = c / 2, up = c % 2;  // which 128 weights; low (0) or high (1) nibbles and 2-bit pairs
      const __m512i qh = widen(blk + 128 + h * 32);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      __m512i v[2];
      for (int a = 0; a < 2; a++) {
        const int quarter = 2 * up + a;
        const __m512i lo4 = _mm512_and_si512(_mm512_srli_epi16(widen(blk + h * 64 + a * 32), 4 * up), nib);
        const __m512i hi2 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * quarter), _mm512_set1_epi16(3)), 4);
        const __m512i q = _mm512_sub_epi16(_mm512_or_si512(lo4, hi2), _mm512_set1_epi16(32));
        v[a] = _mm512_mullo_epi16(q, two_scales(sc[4 * c + 2 * a], sc[4 * c + 2 * a + 1]));
      }
      p0 = v[0];
      p1 = v[1];
    } else {
      const __m512i raw = widen(blk + (T == Q4_K ? 16 : 48) + c * 32);
      __m512i q0 = _mm512_and_si512(raw, nib), q1 = _mm512_srli_epi16(raw, 4);
      if constexpr (T == Q5_K) {
        const __m512i qh = widen(blk + 16);
        q0 = _mm512_or_si512(q0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * c), _mm512_set1_epi16(1)), 4));
        q1 = _mm512_or_si512(q1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * c + 1), _mm512_set1_epi16(1)), 4));
      }
      p0 = _mm512_mullo_epi16(q0, _mm512_set1_epi16(kb.sc[2 * c]));
      p1 = _mm512_mullo_epi16(q1, _mm512_set1_epi16(kb.sc[2 * c + 1]));
    }
    split_bytes(p0, p1, &out.a[c][0][r * 64], &out.a[c][1][r * 64]);
  }
}

// The products of one super-block's 16 weight rows with 16 activation rows into two C tiles (low bytes, high
// bytes), stored to clo / chi. Two pairs of C tiles take turns (0, 1 and 5, 6), so the tile unit can work on the
// next group while the float steps read this one. (Tile numbers must be literals: the intrinsics are macros.)
#define OFFSPEC_AMX_PRODUCTS(C0, C1)                        \
  _tile_zero(C0);                                            \
  _tile_zero(C1);                                            \
  for (int c = 0; c < 4; c++) {                              \
    _tile_loadd(4, xs.tile(g, sb * 4 + c), 64);              \
    _tile_loadd(2, wt.a[c][0], 64);                          \
    _tile_loadd(3, wt.a[c][1], 64);                          \
    _tile_dpbusd(C0, 2, 4); /* low bytes: unsigned x signed */ \
    _tile_dpbssd(C1, 3, 4); /* high bytes: signed x signed */  \
  }                                                          \
  _tile_stored(C0, clo, 64);                                 \
  _tile_stored(C1, chi, 64);

inline void products(int turn, const Weights& wt, const Acts& xs, int64_t g, int64_t sb, int32_t* clo, int32_t* chi) {
  if (turn) {
    OFFSPEC_AMX_PRODUCTS(5, 6)
  } else {
    OFFSPEC_AMX_PRODUCTS(0, 1)
  }
}
#undef OFFSPEC_AMX_PRODUCTS

// KSteps' float steps for one super-block: acc[r][n] (weight row r, activation row n of group g) from the exact
// integer sums of the tiles (clo + 256 chi) and, for Q4_K/Q5_K, the minimums' VNNI products.
template <bool MIN>
inline void float_steps(const int32_t* clo, const int32_t* chi, const Weights& wt, const Acts& xs, int64_t g,
                        int64_t sb, float* acc) {
  const __m512 dxv = _mm512_loadu_ps(&xs.dx[(g * xs.nsb + sb) * TM]);
  __m512i xsum[4];
  if constexpr (MIN)
    for (int p = 0; p < 4; p++) xsum[p] = _mm512_loadu_si512(&xs.xsum[((g * xs.nsb + sb) * 4 + p) * TM]);
  for (int r = 0; r < TR; r++) {
    const __m512i isum = _mm512_add_epi32(_mm512_load_si512(clo + r * TM), _mm512_slli_epi32(_mm512_load_si512(chi + r * TM), 8));
    __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(wt.d[r]), dxv),
                               _mm512_loadu_ps(acc + r * TM));
    if constexpr (MIN) {
      __m512i ms = _mm512_setzero_si512();
      for (int p = 0; p < 4; p++) ms = madd_acc(ms, _mm512_set1_epi32(wt.mins[r][p]), xsum[p]);
      a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(_mm512_set1_ps(wt.dmin[r]), dxv), a);
    }
    _mm512_storeu_ps(acc + r * TM, a);
  }
}

// y[m, r] for the 16 weight rows at w (rb bytes apart) and every activation row m: super-block by super-block,
// each decoded once for every group of 16 activation rows. acc: (G, 16, 16) floats.
template <int64_t T>
void row_group(const uint8_t* w, int64_t rb, const Acts& xs, Weights& wt, float* acc, float* y, int64_t ystride) {
  constexpr int64_t BYTES = KBlock<T>::BYTES;
  alignas(64) int32_t c[2][2][TR * TM];  // (turn, lo/hi) the C tiles as stored
  std::fill(acc, acc + xs.G * TR * TM, 0.0f);
  int turn = 0;
  for (int64_t sb = 0; sb < xs.nsb; sb++) {
    // the 16 rows' super-blocks PREFETCH_AHEAD ahead (the next row group's first ones at the end), while this one
    // computes: a pass streams the weights from memory once, and 16 strided streams defeat the hardware prefetcher
    const int64_t ahead = sb + PREFETCH_AHEAD;
    const uint8_t* next = ahead < xs.nsb ? w + ahead * BYTES : w + TR * rb + (ahead - xs.nsb) * BYTES;
    for (int r = 0; r < TR; r++)
      for (int64_t line = 0; line < BYTES; line += 64) __builtin_prefetch(next + r * rb + line);
    for (int r = 0; r < TR; r++) decode_row<T>(w + r * rb + sb * BYTES, r, wt);
    for (int64_t g = 0; g < xs.G; g++, turn ^= 1) {
      products(turn, wt, xs, g, sb, c[turn][0], c[turn][1]);
      float_steps<KBlock<T>::MIN>(c[turn][0], c[turn][1], wt, xs, g, sb, acc + g * TR * TM);
    }
  }
  for (int64_t g = 0; g < xs.G; g++)
    for (int64_t n = 0; n < TM && g * TM + n < xs.M; n++)
      for (int r = 0; r < TR; r++) y[(g * TM + n) * ystride + r] = acc[(g * TR + r) * TM + n];
}

// y (M, N) for N weight rows of a K-quant type: whole groups of 16 rows on the tiles; returns the rows done
// (a multiple of 16: the caller computes the rest).
inline int64_t kgemm(int64_t type, const uint8_t* w, int64_t rb, int64_t N, const XSet& x, float* y) {
  const int64_t groups = N / TR;
  if (groups == 0) return 0;
  const Acts xs(x);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const TileConfig config;
    _tile_loadconfig(&config);  // per thread: the tile shapes
    Weights wt;
    std::vector<float> acc(xs.G * TR * TM);  // (G, 16, 16)
    for (int64_t g = g0; g < g1; g++) {
      const uint8_t* wg = w + g * TR * rb;
      float* yg = y + g * TR;
      switch (type) {
        case Q4_K: row_group<Q4_K>(wg, rb, xs, wt, acc.data(), yg, N); break;
        case Q5_K: row_group<Q5_K>(wg, rb, xs, wt, acc.data(), yg, N); break;
        case IQ4_XS: row_group<IQ4_XS>(wg, rb, xs, wt, acc.data(), yg, N); break;
        default: row_group<Q6_K>(wg, rb, xs, wt, acc.data(), yg, N); break;
      }
    }
    _tile_release();
  });
  return groups * TR;
}

}  // namespace amx
}  // namespace offspec
