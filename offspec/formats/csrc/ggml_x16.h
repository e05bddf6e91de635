// Weights interleaved 16 rows at a time (the "x16" layouts), and their products on AVX2 / AVX-512: Q4_K and Q6_K
// here, Q2_K and Q3_K in ggml_x16_low.h, the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) in
// ggml_x16_legacy.h.
//
// A row-major K-quant row pays per super-block for what a one-row product cannot share between weight rows:
// unpacking its scales one row at a time, and summing each row's integer lanes horizontally before its float steps
// (rows_sum, kwtile). Interleaved, the 16 rows of a group store each piece side by side: 4 bytes of row r at
// 32-bit lane r of a 64-byte chunk. One broadcast of 4 activations then multiplies 16 rows at once (vpdpbusd), every
// lane stays one weight row's sum to the end, and the scales of 16 rows unpack in a few vector instructions. The
// bytes are the file's, permuted: the same size, nothing decoded ahead of time.
//
// A group's super-block (16 rows of it; rows 16g .. 16g + 15 of the weight, K/256 of them, one after another):
//   Q4_K (16 x 144 = 2304 bytes): d (16 halves), dmin (16 halves), the 12 scale bytes k of the 16 rows as 12 x 16
//     bytes (byte k of row r at 64 + 16 k + r), then the 128 quant bytes: chunk (p, c) (sub-block pair p < 4, c < 8)
//     holds bytes p*32 + 4c .. +4 of row r at 256 + (8p + c) * 64 + 4r: low nibbles elements 4c.. of sub-block 2p,
//     high nibbles of sub-block 2p + 1.
//   Q6_K (16 x 210 = 3360 bytes): 16 triples of chunks (h < 2, c < 8) in the order they are read, at (8h + c) * 192:
//     the high-bit bytes qh 32h + 4c .. of row r at + 4r, then the low-bit bytes ql 64h + 4c .. at + 64 + 4r and
//     ql 64h + 32 + 4c .. at + 128 + 4r; then d (16 halves) at 3072 and the 16 scales as 16 x 16 bytes (scale g of
//     row r at 3104 + 16 g + r). A super-block is 52.5 cache lines: where its index in the weight is odd, d and the
//     scales come first (288 bytes) and the triples after them, so that the triples start on a cache line in both
//     (the weight's rows being 64-byte aligned) and no 64-byte load straddles two lines.
//   The legacy types (ggml_x16_legacy.h), a block of 32 per row: Q4_0 / IQ4_NL (16 x 18 = 288 bytes), Q4_1 (320),
//     Q5_0 (352), Q5_1 (384), Q8_0 (544): d (16 halves), m (Q4_1, Q5_1: 16 halves), qh (Q5_0, Q5_1: 16 words),
//     then the quants as chunks of 64 bytes, chunk k holding bytes 4k .. 4k + 3 of row r's quants at 4r: for the
//     4-bit types low nibbles elements 4k.., high nibbles elements 4k + 16.. (k < 4); for Q8_0 elements 4k.. (k < 8).
//     A row's qh word has its bits permuted: bit 8j + c holds element 4c + j's fifth bit, so that one shift and one
//     mask put the fifth bits of elements 4c .. 4c + 3 at bit 4 of their bytes. Where a group block is not whole
//     cache lines (Q4_0, IQ4_NL, Q5_0, Q8_0: 32 bytes over), the blocks of odd index in the weight put d and qh first
//     and the quants after them; the others the quants first, then qh and d (so the quants start on a line).
//     MXFP4 (16 x 17 = 272 bytes): its 16 exponent bytes (byte r: row r), then the quants as Q4_0's. 16 bytes over
//     whole lines, no alternation of two blocks would keep its quants on a line: they always follow the exponents.
//   Q2_K (16 x 84 = 1344 bytes, 21 lines): the quant chunks (h < 2, c < 8): bytes qs[32h + 4c .. +4] of row r at
//     (8h + c) * 64 + 4r (2 bits of each byte per sub-block h*4 + s), then the 16 scale bytes of the 16 rows in pairs
//     (byte o of row r at 1024 + 32 (o / 2) + 2r + o % 2: one load and one widening give a row's two in its lane),
//     then d (16 halves) at 1280 and dmin at 1312.
//   Q3_K (16 x 110 = 1760 bytes, 27.5 lines): the quants (1536 bytes: the hmask chunks c < 8, bytes 4c .. of row r
//     at 64c + 4r, then the qs chunks as Q2_K's at 512 + (8h + c) * 64 + 4r) and the head (224 bytes: d, 16 halves,
//     then the 12 scale bytes in pairs as Q2_K's at 32 + 32 (o / 2) + 2r + o % 2); where its index in the weight is
//     odd the head comes first (so that the quants start on a cache line in both, as Q6_K's triples).
//   Their products: ggml_x16_low.h.
// Rows past the last whole group (N % 16) keep the row-major layout.
//
// Reading: each kernel reads its group's bytes in address order. With one activation row the hardware prefetcher
// streams them better alone: from memory, one Zen 4 core, Q4_K 29.3 -> 32.4 GB/s, Q6_K 16.9 -> 24-25 GB/s (with a
// prefetch a super-block ahead 18.5, four ahead 15.7); a prefetch 4.5 KB ahead cost one row 5% too. With 2 rows
// and more, the products keep a core busy long enough that the hardware prefetcher falls behind, and a prefetch
// into L2 6.75 KB ahead (x16_prefetch: 3 Q4_K super-blocks, 2 Q6_K) lets a pass of 3 rows cost what one row
// costs, 4 rows 1.2x less, 8 rows 1.5x less, 32 rows 1.15x (all the 1.5B target's matrices, 2 threads, Zen 4;
// 2.3 KB ahead was slower at 3-4 rows, 13.5 KB at 2-3). The AVX2 kernels are slower per byte (no vpdpbusd), so
// that one row keeps a core busy as several do on AVX-512: there a prefetch 13.5 KB ahead made the 1.5B target's
// one-row products 1.07-1.20x faster (2 threads, the AVX2 build on Zen 4; 6.75 KB 1.06-1.14x, 20.25 KB the same
// as 13.5), and a one-row pass walks both halves of a group at once (q4k_x16_avx2_one, q6k_x16_avx2_one, a draft's
// legacy_x16s_avx2_one). The legacy types' exact passes of several rows are bound by their float steps
// (ggml_x16_legacy.h): a prefetch gained them nothing; a draft's (legacy_x16s, 2 float steps a block) prefetch from
// 4 rows.
//
// AVX2's passes of several rows are bound by instructions, not bytes (no vpdpbusd: a chunk and row costs a broadcast,
// a maddubs and an add): q4k_x16_avx2 and q6k_x16_avx2 sum products in 16-bit lanes, scale them with vpmaddwd and
// unpack each chunk once for tiles of 4 rows whose running sums stay in registers (V8::in_register). Hot in L2, one
// Zen 4 core: Q4_K 2.4 cycles a chunk and row, Q6_K 3.7 (tiles of 2, sums spilled: 3.5-3.7, 4.8-5.1; AVX-512 1.6,
// 2.2).
//
// Exactness: a product computes the same exact integer sums per (weight row, super-block) as ggml_dot.h's kernels
// (Q4_K: sum_j sc_j sum(q x) and sum_j m_j sum(x); Q6_K: sum_g sc_g sum((q - 32) x), taken as sum(q x) - 32 sum(x)
// per 16), then the same float steps in the same order (KSteps: acc = fma(isum, d * dx, acc), acc = fnmadd(msum,
// dmin * dx, acc)): the same bits as the row-major kernels, whatever M or the tile. A draft's legacy weights
// (X16S_TYPES) round otherwise, for speed (ggml_x16_legacy.h legacy_x16s).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace offspec {

constexpr int64_t X16_ROWS = 16;
constexpr int64_t X16_TYPES = 100;  // a layout's type id: the ggml type's + 100 (never a ggml id)
// The same bytes for a draft's products: the legacy types' block lanes summed as integers first (legacy_x16s in
// ggml_x16_legacy.h: not the row-major kernels' bits); the K-quants' products are those of X16_TYPES.
constexpr int64_t X16S_TYPES = 200;

// The legacy types' interleaved group blocks: where d, m, qh and the quants start (`odd`: the block's index in the
// weight is odd; only the types whose group block is not whole cache lines alternate).
struct LegacyX16Layout {
  int64_t group_bytes, quants;
  bool min, qh, flip;
  int64_t sb;  // the bytes of a row's d: 2 (a half), 1 (MXFP4's exponent)
  int64_t d_bytes() const { return X16_ROWS * sb; }  // the group's d: 32 or 16 bytes
  int64_t qh_in_row() const { return min ? 4 : sb; }  // where a row-major block's qh word (or quants) start
  int64_t d_at(bool odd) const { return flip && !odd ? quants + (qh ? 64 : 0) : 0; }
  int64_t m_at() const { return 32; }  // Q4_1, Q5_1 (never flipped)
  int64_t qh_at(bool odd) const { return flip ? (odd ? d_bytes() : quants) : min ? 64 : d_bytes(); }
  int64_t quants_at(bool odd) const {
    if (flip) return odd ? d_bytes() + (qh ? 64 : 0) : 0;
    return (min ? 64 : d_bytes()) + (qh ? 64 : 0);
  }
};
constexpr bool x16_legacy(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == IQ4_NL ||
         type == MXFP4;
}
constexpr LegacyX16Layout legacy_x16_layout(int64_t type) {
  const int64_t rb = type == Q4_0 || type == IQ4_NL ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22
                     : type == Q5_1 ? 24 : type == MXFP4 ? 17 : 34;
  return {X16_ROWS * rb, type == Q8_0 ? 512 : 256, type == Q4_1 || type == Q5_1, type == Q5_0 || type == Q5_1,
          X16_ROWS * rb % 64 == 32, type == MXFP4 ? 1 : 2};
}

constexpr bool x16_low(int64_t type) { return type == Q2_K || type == Q3_K; }  // ggml_x16_low.h
inline bool x16_able(int64_t type) { return type == Q4_K || type == Q6_K || x16_legacy(type) || x16_low(type); }
// The ggml type of an interleaved layout's id (X16_TYPES or X16S_TYPES), or -1.
inline int64_t x16_base(int64_t type) {
  const int64_t base = type >= X16S_TYPES ? type - X16S_TYPES : type - X16_TYPES;
  return type >= X16_TYPES && x16_able(base) ? base : -1;
}
inline bool is_x16(int64_t type) { return x16_base(type) >= 0; }

// A Q5 row's qh word as stored interleaved (forward: bit 8j + c <- bit 4c + j) or back.
inline uint32_t x16_qh_bits(uint32_t w, bool forward) {
  uint32_t out = 0;
  for (int c = 0; c < 8; c++)
    for (int j = 0; j < 4; j++) {
      const int file = 4 * c + j, mixed = 8 * j + c;
      out |= ((w >> (forward ? file : mixed)) & 1u) << (forward ? mixed : file);
    }
  return out;
}

// Where byte o of row r's block lies in its group's interleaved block; `odd`: the block's index in the whole weight
// (group * blocks per row + its own) is odd (Q6_K's layout and some legacy ones alternate, see above).
inline int64_t x16_offset(int64_t type, int64_t r, int64_t o, bool odd) {
  if (x16_legacy(type)) {
    const LegacyX16Layout L = legacy_x16_layout(type);
    if (o < L.sb) return L.d_at(odd) + L.sb * r + o;  // d
    if (L.min && o < 4) return L.m_at() + 2 * r + (o - 2);
    const int64_t qh0 = L.qh_in_row(), q0 = qh0 + (L.qh ? 4 : 0);
    if (L.qh && o < q0) return L.qh_at(odd) + 4 * r + (o - qh0);
    const int64_t i = o - q0;
    return L.quants_at(odd) + (i / 4) * 64 + 4 * r + i % 4;
  }
  if (type == Q4_K) {
    if (o < 2) return 2 * r + o;                // d
    if (o < 4) return 32 + 2 * r + (o - 2);     // dmin
    if (o < 16) return 64 + 16 * (o - 4) + r;  // scale byte k = o - 4
    const int64_t i = o - 16, p = i / 32, c = (i % 32) / 4;
    return 256 + (8 * p + c) * 64 + 4 * r + i % 4;
  }
  if (type == Q2_K) {  // scales[16], qs[64], d, dmin
    if (o < 16) return 1024 + 32 * (o / 2) + 2 * r + o % 2;
    if (o < 80) return ((o - 16) / 4) * 64 + 4 * r + o % 4;
    return 1280 + 32 * ((o - 80) / 2) + 2 * r + o % 2;
  }
  if (type == Q3_K) {  // hmask[32], qs[64], scales[12], d
    const int64_t quants = odd ? 224 : 0, head = odd ? 0 : 1536;
    if (o < 96) return quants + (o / 4) * 64 + 4 * r + o % 4;  // hmask chunks 0 .. 7, qs chunks from 512
    if (o < 108) return head + 32 + 32 * ((o - 96) / 2) + 2 * r + o % 2;
    return head + 2 * r + (o - 108);
  }
  // Q6_K: ql[128], qh[64], scales[16], d
  const int64_t tri = odd ? 288 : 0, head = odd ? 0 : 3072;
  if (o < 128) {
    const int64_t h = o / 64, t = (o % 64) / 32, c = (o % 32) / 4;
    return tri + (8 * h + c) * 192 + 64 * (1 + t) + 4 * r + o % 4;
  }
  if (o < 192) {
    const int64_t i = o - 128, h = i / 32, c = (i % 32) / 4;
    return tri + (8 * h + c) * 192 + 4 * r + i % 4;
  }
  if (o < 208) return head + 32 + 16 * (o - 192) + r;
  return head + 2 * r + (o - 208);
}

// dst = src's N rows (rb bytes each, `type`: x16_able) with every whole group of 16 interleaved (forward) or back
// (!forward); the rows past the last whole group are copied as they are. The bytes move in runs (the quant bytes 4
// at a time): a 1.5B model's weights take well under a second.
inline void x16_permute(const uint8_t* src, uint8_t* dst, int64_t N, int64_t rb, int64_t type, bool forward) {
  const int64_t B = layout_of(type).bytes, nsb = rb / B, groups = N / X16_ROWS;
  const bool q5 = x16_legacy(type) && legacy_x16_layout(type).qh;  // Q5_0, Q5_1: their qh bits move too
  const LegacyX16Layout q5_layout = legacy_x16_layout(q5 ? type : Q5_0);
  struct Run { int64_t from, to, len; };  // row r's bytes o .. o + len -> the group super-block's to .. to + len
  std::vector<Run> runs[2];  // by the super-block's parity (Q6_K), for the 16 rows: from = r * B + o
  for (int64_t odd = 0; odd < 2; odd++)
    for (int64_t r = 0; r < X16_ROWS; r++)
      for (int64_t o = 0; o < B; o++) {
        const int64_t to = x16_offset(type, r, o, odd);
        auto& v = runs[odd];
        if (!v.empty() && v.back().from + v.back().len == r * B + o && v.back().to + v.back().len == to) v.back().len++;
        else v.push_back({r * B + o, to, 1});
      }
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t sb = 0; sb < nsb; sb++) {
        uint8_t* const mixed = (forward ? dst : const_cast<uint8_t*>(src)) + g * X16_ROWS * rb + sb * X16_ROWS * B;
        for (const Run& run : runs[(g * nsb + sb) % 2]) {
          const int64_t r = run.from / B, o = run.from % B;
          const int64_t row = (g * X16_ROWS + r) * rb + sb * B + o;
          if (forward) std::memcpy(mixed + run.to, src + row, run.len);
          else std::memcpy(dst + row, mixed + run.to, run.len);
        }
        if (q5)  // the qh words' bits (see above)
          for (int64_t r = 0; r < X16_ROWS; r++) {
            const bool odd = (g * nsb + sb) % 2;
            uint8_t* word = forward ? mixed + q5_layout.qh_at(odd) + 4 * r
                                    : dst + (g * X16_ROWS + r) * rb + sb * B + q5_layout.qh_in_row();
            uint32_t w;
            std::memcpy(&w, word, 4);
            w = x16_qh_bits(w, forward);
            std::memcpy(word, &w, 4);
          }
      }
  });
  std::memcpy(dst + groups * X16_ROWS * rb, src + groups * X16_ROWS * rb, (N - groups * X16_ROWS) * rb);
}

#ifdef OFFSPEC_AVX2
}  // namespace offspec

#include "ggml_x16_vec.h"  // V16, V8: the vector operations of the kernels below

namespace offspec {

// The weights' bytes `X16_AHEAD` past `p` (AVX2 with one activation row: `X16_AHEAD_ONE`), `lines` cache lines of
// them, into L2 (see "Reading" above); AVX-512 with one row: nothing.
constexpr int64_t X16_AHEAD = 6912;
constexpr int64_t X16_AHEAD_ONE = 13824;
template <int R>
inline void x16_prefetch(const uint8_t* p, int lines) {
#ifdef OFFSPEC_AVX512
  if (R < 2) return;
  constexpr int64_t ahead = X16_AHEAD;
#else
  constexpr int64_t ahead = R < 2 ? X16_AHEAD_ONE : X16_AHEAD;
#endif
  for (int l = 0; l < lines; l++) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64 * l), _MM_HINT_T1);
}

// The 16 rows' scales (sc) and minimums (mn) of a Q4_K group super-block, one 16-byte vector per sub-block (byte r:
// row r): k_scale_min's unpacking (KBlock::unpack_scales) of 16 rows at once. `half` selects rows 8.. for V8.
struct X16Scales {
  __m128i sc[8], mn[8];
  X16Scales(const uint8_t* b, int64_t off) {
    __m128i u[12];
    for (int k = 0; k < 12; k++) u[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + 16 * k + off));
    const __m128i m6 = _mm_set1_epi8(0x3F), m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
    for (int j = 0; j < 4; j++) {
      sc[j] = _mm_and_si128(u[j], m6);
      mn[j] = _mm_and_si128(u[j + 4], m6);
      const __m128i top_s = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(u[j], 6), m2), 4);
      const __m128i top_m = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(u[j + 4], 6), m2), 4);
      sc[j + 4] = _mm_or_si128(_mm_and_si128(u[j + 8], m4), top_s);
      mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(u[j + 8], 4), m4), top_m);
    }
  }
  // rows 8 .. 15's (bytes 8 .. 15) at bytes 0 .. 7: what X16Scales(b, 8) unpacks, from this one (off 0)
  X16Scales upper() const {
    X16Scales h = *this;
    for (int j = 0; j < 8; j++) h.sc[j] = _mm_srli_si128(sc[j], 8), h.mn[j] = _mm_srli_si128(mn[j], 8);
    return h;
  }
};

// After a Q4_K group super-block's scaled sums `is` (sum_j sc_j sum(q x), per row lane): its minimum terms
// sum_j m_j sum(x_j), two sub-blocks per pair product, then the float steps in KSteps' order.
template <class V, int R>
inline void q4k_x16_steps(const X16Scales& s, const uint8_t* b, int64_t half, const XSet& x, int64_t r0, int64_t sb,
                          const typename V::I* is, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t L = V::LANES;
  I ms[R];
  for (int r = 0; r < R; r++) ms[r] = V::zero();
  for (int p = 0; p < 4; p++) {
    const I mp = V::pairs(s.mn[2 * p], s.mn[2 * p + 1]);
    for (int r = 0; r < R; r++) {
      const int32_t* xs = &x.s[(r0 + r) * x.nb + sb * 8 + 2 * p];
      ms[r] = V::dpwssd(ms[r], mp, V::set32((int32_t)((uint32_t)(uint16_t)xs[0] | ((uint32_t)xs[1] << 16))));
    }
  }
  const F d = V::halves(b + 2 * half * L), dmin = V::halves(b + 32 + 2 * half * L);
  for (int r = 0; r < R; r++) {
    const F dx = V::fset(x.dval(r0 + r, sb));
    acc[r] = V::fmadd(V::cvt(is[r]), V::fmul(d, dx), acc[r]);
    acc[r] = V::fnmadd(V::cvt(ms[r]), V::fmul(dmin, dx), acc[r]);
  }
}

// Q4_K x16: outputs y[(r0 + r) * ystride + i] (i < V::LANES) of the group's rows half * LANES + i, activation rows
// r0 .. r0 + R, over the group's super-blocks at `g`.
template <class V, int R>
void q4k_x16(const uint8_t* g, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t SB = 16 * 144, L = V::LANES;
  const I m4 = V::set8(0x0F);
  F acc[R];
  for (int r = 0; r < R; r++) acc[r] = V::fzero();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const uint8_t* b = g + sb * SB;
    const X16Scales s(b, half * L);
    I is[R];
    for (int r = 0; r < R; r++) is[r] = V::zero();
    for (int p = 0; p < 4; p++) {
      x16_prefetch<R>(b + 9 * 64 * p, 9);  // a quarter of a super-block (36 lines) a sub-block pair
      I lo[R], hi[R];
      for (int r = 0; r < R; r++) lo[r] = hi[r] = V::zero();
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const uint8_t* chunk = b + 256 + (8 * p + c) * 64 + half * 4 * L;
        const I v = V::load(chunk);
        const I ql = V::andv(v, m4), qh = V::andv(V::template srl16<4>(v), m4);
        for (int r = 0; r < R; r++) {
          const int8_t* xr = x.qrow(r0 + r, sb * 8 + 2 * p) + 4 * c;
          lo[r] = V::dpbusd(lo[r], ql, V::bcast4(xr));
          hi[r] = V::dpbusd(hi[r], qh, V::bcast4(xr + 32));
        }
      }
      const I slo = V::u8x32(s.sc[2 * p]), shi = V::u8x32(s.sc[2 * p + 1]);
      for (int r = 0; r < R; r++) is[r] = V::add(is[r], V::add(V::mul(lo[r], slo), V::mul(hi[r], shi)));
    }
    q4k_x16_steps<V, R>(s, b, half, x, r0, sb, is, acc);
  }
  for (int r = 0; r < R; r++) V::store(y + (r0 + r) * ystride, acc[r]);
}

#ifndef OFFSPEC_AVX512
// q4k_x16 for AVX2, which has no vpdpbusd (a multiply, a pair add and an add emulate it): the products of a
// sub-block are summed in 16-bit lanes (maddubs, then adds: at most 8 x 2 x 15 x 127 = 30480, exact), and its scale
// applied by one vpmaddwd against (sc, sc) pairs, which also adds each row's two 16-bit halves: 2 operations per
// chunk and row instead of 3, and no 32-bit multiply. The same integer sums, so the same bits.
template <int R>
void q4k_x16_avx2(const uint8_t* g, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using V = V8;
  constexpr int64_t SB = 16 * 144, L = V::LANES;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const uint8_t* b = g + sb * SB;
    const X16Scales s(b, half * L);
    __m256i is[R];
    for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
      x16_prefetch<R>(b + 9 * 64 * p, 9);
      __m256i lo[R], hi[R];  // 16-bit sums of products: two per row (its 32-bit lane)
      for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const __m256i v = V::load(b + 256 + (8 * p + c) * 64 + half * 4 * L);
        const __m256i ql = _mm256_and_si256(v, m4), qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int r = 0; r < R; r++) {
          const int8_t* xr = x.qrow(r0 + r, sb * 8 + 2 * p) + 4 * c;
          lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ql, V::bcast4(xr)));
          hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qh, V::bcast4(xr + 32)));
          V::in_register(lo[r]), V::in_register(hi[r]);
        }
      }
      const __m256i slo = V::u8x32(s.sc[2 * p]), shi = V::u8x32(s.sc[2 * p + 1]);  // (sc, sc) int16 pairs below
      const __m256i plo = _mm256_or_si256(slo, _mm256_slli_epi32(slo, 16));
      const __m256i phi = _mm256_or_si256(shi, _mm256_slli_epi32(shi, 16));
      for (int r = 0; r < R; r++)
        is[r] = _mm256_add_epi32(is[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], plo), _mm256_madd_epi16(hi[r], phi)));
    }
    q4k_x16_steps<V, R>(s, b, half, x, r0, sb, is, acc);
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ystride, acc[r]);
}

// q4k_x16_avx2 for one activation row, both halves of the group in one walk over its super-blocks: the scales
// unpacked and the activations broadcast once for the 16 rows, each chunk's 64 bytes loaded at once. The same sums
// and float steps per row as the two halves one after the other, so the same bits.
inline __attribute__((noinline)) void q4k_x16_avx2_one(const uint8_t* g, const XSet& x, float* y) {
  using V = V8;
  constexpr int64_t SB = 16 * 144;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // rows 0..7, 8..15
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const uint8_t* b = g + sb * SB;
    const X16Scales s(b, 0), s1 = s.upper();
    __m256i is[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int p = 0; p < 4; p++) {
      x16_prefetch<1>(b + 9 * 64 * p, 9);
      const int8_t* xr = x.qrow(0, sb * 8 + 2 * p);
      __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;  // 16-bit sums, as q4k_x16_avx2's
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const uint8_t* chunk = b + 256 + (8 * p + c) * 64;
        const __m256i v0 = V::load(chunk), v1 = V::load(chunk + 32);
        const __m256i xl = V::bcast4(xr + 4 * c), xh = V::bcast4(xr + 32 + 4 * c);
        lo0 = _mm256_add_epi16(lo0, _mm256_maddubs_epi16(_mm256_and_si256(v0, m4), xl));
        hi0 = _mm256_add_epi16(hi0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), xh));
        lo1 = _mm256_add_epi16(lo1, _mm256_maddubs_epi16(_mm256_and_si256(v1, m4), xl));
        hi1 = _mm256_add_epi16(hi1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), xh));
        V::in_register(lo0), V::in_register(hi0), V::in_register(lo1), V::in_register(hi1);
      }
      const __m128i both[2][2] = {{s.sc[2 * p], s.sc[2 * p + 1]}, {s1.sc[2 * p], s1.sc[2 * p + 1]}};
      const __m256i lo[2] = {lo0, lo1}, hi[2] = {hi0, hi1};
      for (int h = 0; h < 2; h++) {
        const __m256i slo = V::u8x32(both[h][0]), shi = V::u8x32(both[h][1]);  // (sc, sc) int16 pairs
        const __m256i plo = _mm256_or_si256(slo, _mm256_slli_epi32(slo, 16));
        const __m256i phi = _mm256_or_si256(shi, _mm256_slli_epi32(shi, 16));
        is[h] = _mm256_add_epi32(is[h], _mm256_add_epi32(_mm256_madd_epi16(lo[h], plo), _mm256_madd_epi16(hi[h], phi)));
      }
    }
    q4k_x16_steps<V, 1>(s, b, 0, x, 0, sb, &is[0], &acc[0]);
    q4k_x16_steps<V, 1>(s1, b, 1, x, 0, sb, &is[1], &acc[1]);
  }
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}
#endif

// Q6_K x16, as q4k_x16. x.s16: the activations' sums per 16.
template <class V, int R>
void q6k_x16(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t SB = 16 * 210, L = V::LANES;
  const I m4 = V::set8(0x0F), m30 = V::set8(0x30);
  F acc[R];
  for (int r = 0; r < R; r++) acc[r] = V::fzero();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const bool odd = (first + sb) % 2;  // the layout of this super-block (see above)
    const uint8_t* b = g + sb * SB + (odd ? 288 : 0);  // the triples
    const uint8_t* head = g + sb * SB + (odd ? 0 : 3072);  // d and the scales
    I is[R];
    for (int r = 0; r < R; r++) is[r] = V::zero();
    for (int h = 0; h < 2; h++) {
      for (int q2 = 0; q2 < 2; q2++) {  // elements 16 q2 .. of each 32: scale groups 8h + 2s + q2
        x16_prefetch<R>(g + sb * SB + 14 * 64 * (2 * h + q2), 14);  // a quarter of a super-block (52.5 lines)
        I a[4][R];  // sub-block s = 0..3 of this half: sum(q x) over 16 elements
        for (int s = 0; s < 4; s++)
          for (int r = 0; r < R; r++) a[s][r] = V::zero();
#pragma GCC unroll 4
        for (int cc = 0; cc < 4; cc++) {
          const int c = 4 * q2 + cc;
          const uint8_t* hc = b + (8 * h + c) * 192 + half * 4 * L;
          const I hv = V::load(hc);
          for (int t = 0; t < 2; t++) {
            const I lv = V::load(hc + 64 * (1 + t));
            // high bits 2s, 2s + 1 of each byte moved to bits 4, 5: s = t (low nibbles), s = t + 2 (high nibbles)
            const I hlo = V::andv(t == 0 ? V::template sll16<4>(hv) : V::template sll16<2>(hv), m30);
            const I hhi = V::andv(t == 0 ? hv : V::template srl16<2>(hv), m30);
            const I ulo = V::orv(V::andv(lv, m4), hlo);
            const I uhi = V::orv(V::andv(V::template srl16<4>(lv), m4), hhi);
            for (int r = 0; r < R; r++) {
              const int8_t* xr = x.qrow(r0 + r, sb * 8 + 4 * h) + 4 * c;
              a[t][r] = V::dpbusd(a[t][r], ulo, V::bcast4(xr + 32 * t));
              a[t + 2][r] = V::dpbusd(a[t + 2][r], uhi, V::bcast4(xr + 32 * (t + 2)));
            }
          }
        }
        for (int s = 0; s < 4; s++) {
          const int64_t grp = 8 * h + 2 * s + q2;
          const I sc = V::s8x32(V::bytes(head + 32 + 16 * grp + half * L));
          for (int r = 0; r < R; r++) {
            const int32_t xs = x.s16[(r0 + r) * (x.K / 16) + sb * 16 + grp];  // sum of the group's 16 activations
            is[r] = V::add(is[r], V::mul(V::sub(a[s][r], V::set32(32 * xs)), sc));
          }
        }
      }
    }
    const F d = V::halves(head + 2 * half * L);
    for (int r = 0; r < R; r++) acc[r] = V::fmadd(V::cvt(is[r]), V::fmul(d, V::fset(x.dval(r0 + r, sb))), acc[r]);
  }
  for (int r = 0; r < R; r++) V::store(y + (r0 + r) * ystride, acc[r]);
}

#ifndef OFFSPEC_AVX512
// q6k_x16 for AVX2 with R activation rows, as q6k_x16_avx2_one does one: two chunks' products summed in 16-bit
// lanes, scaled by one vpmaddwd per group, and the offset terms 32 sum_g sc_g sum(x_g) by one vpmaddwd per two
// groups. The same integer sums as q6k_x16's, so the same bits.
template <int R>
void q6k_x16_avx2(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using V = V8;
  constexpr int64_t SB = 16 * 210, L = V::LANES;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const bool odd = (first + sb) % 2;
    const uint8_t* b = g + sb * SB + (odd ? 288 : 0) + half * 4 * L;  // the triples, this half's lanes
    const uint8_t* head = g + sb * SB + (odd ? 0 : 3072);  // d and the scales
    __m256i is[R], off[R];
    for (int r = 0; r < R; r++) is[r] = off[r] = _mm256_setzero_si256();
    for (int gp = 0; gp < 8; gp++) {  // sum_g sc_g xs_g, groups 2 gp and 2 gp + 1 as (sc, sc') int16 pairs
      const __m128i s0 = V::bytes(head + 32 + 32 * gp + half * L), s1 = V::bytes(head + 48 + 32 * gp + half * L);
      const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
      for (int r = 0; r < R; r++) {
        const int32_t* xs = x.s16 + (r0 + r) * (x.K / 16) + sb * 16 + 2 * gp;  // |xs| <= 16 x 128
        const uint32_t pair = (uint32_t)(uint16_t)xs[0] | ((uint32_t)xs[1] << 16);
        off[r] = _mm256_add_epi32(off[r], _mm256_madd_epi16(sc2, _mm256_set1_epi32((int32_t)pair)));
      }
    }
    for (int h = 0; h < 2; h++)
      for (int q2 = 0; q2 < 2; q2++) {
        x16_prefetch<R>(g + sb * SB + 14 * 64 * (2 * h + q2), 14);
        for (int t = 0; t < 2; t++) {  // sub-blocks s = t (low nibbles) and s = t + 2 (high nibbles)
          __m256i sp[2];  // (sc, sc) int16 pairs of group 8h + 2s + q2, s = t and t + 2
          for (int k = 0; k < 2; k++) {
            const __m128i v = V::bytes(head + 32 + 16 * (8 * h + 2 * (t + 2 * k) + q2) + half * L);
            sp[k] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
          }
          for (int cp = 0; cp < 2; cp++) {
            __m256i lo[R], hi[R];  // 16-bit sums of two chunks' products
            for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
            for (int k = 0; k < 2; k++) {
              const int cc = 2 * cp + k;
              const uint8_t* hc = b + (8 * h + 4 * q2 + cc) * 192;
              const __m256i hv = V::load(hc), lv = V::load(hc + 64 * (1 + t));
              const __m256i hlo = _mm256_and_si256(t == 0 ? _mm256_slli_epi16(hv, 4) : _mm256_slli_epi16(hv, 2), m30);
              const __m256i hhi = _mm256_and_si256(t == 0 ? hv : _mm256_srli_epi16(hv, 2), m30);
              const __m256i ulo = _mm256_or_si256(_mm256_and_si256(lv, m4), hlo);
              const __m256i uhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lv, 4), m4), hhi);
              for (int r = 0; r < R; r++) {
                const int8_t* xr = x.qrow(r0 + r, sb * 8 + 4 * h) + 16 * q2 + 4 * cc;
                lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ulo, V::bcast4(xr + 32 * t)));
                hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(uhi, V::bcast4(xr + 32 * (t + 2))));
                V::in_register(lo[r]), V::in_register(hi[r]);
              }
            }
            for (int r = 0; r < R; r++)
              is[r] = _mm256_add_epi32(is[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sp[0]),
                                                               _mm256_madd_epi16(hi[r], sp[1])));
          }
        }
      }
    const __m256 d = V::halves(head + 2 * half * L);
    for (int r = 0; r < R; r++) {
      const __m256i isum = _mm256_sub_epi32(is[r], _mm256_slli_epi32(off[r], 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(x.dval(r0 + r, sb))), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ystride, acc[r]);
}

// q6k_x16 for one activation row on AVX2, both halves of the group in one walk (the broadcasts shared), and no
// 32-bit multiply: two chunks' products summed in 16-bit lanes (at most 2 x 2 x 63 x 128 = 32256, exact), each scale
// group's sum scaled by one vpmaddwd against (sc, sc) pairs, and the offset terms 32 sum_g sc_g sum(x_g) by one
// vpmaddwd per two groups. The same integer sums as q6k_x16's (a_g - 32 xs_g) sc_g, so the same bits.
inline __attribute__((noinline)) void q6k_x16_avx2_one(const uint8_t* g, int64_t first, const XSet& x, float* y) {
  using V = V8;
  constexpr int64_t SB = 16 * 210;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // rows 0..7, 8..15
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const bool odd = (first + sb) % 2;
    const uint8_t* b = g + sb * SB + (odd ? 288 : 0);  // the triples
    const uint8_t* head = g + sb * SB + (odd ? 0 : 3072);  // d and the scales
    const int32_t* xs = x.s16 + sb * 16;  // the activations' sums per 16 (one row)
    __m256i is[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, off[2] = {is[0], is[1]};
    for (int gp = 0; gp < 8; gp++) {  // sum_g sc_g xs_g, groups 2 gp and 2 gp + 1 as (sc, sc') int16 pairs
      const __m128i s0 = V::bytes16(head + 32 + 32 * gp), s1 = V::bytes16(head + 48 + 32 * gp);
      const uint32_t pair = (uint32_t)(uint16_t)xs[2 * gp] | ((uint32_t)xs[2 * gp + 1] << 16);  // |xs| <= 16 x 128
      const __m256i xp = _mm256_set1_epi32((int32_t)pair);
      off[0] = _mm256_add_epi32(off[0], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1)), xp));
      off[1] = _mm256_add_epi32(off[1], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(s0, s1)), xp));
    }
    for (int h = 0; h < 2; h++)
      for (int q2 = 0; q2 < 2; q2++) {
        x16_prefetch<1>(g + sb * SB + 14 * 64 * (2 * h + q2), 14);
        const int8_t* xr = x.qrow(0, sb * 8 + 4 * h) + 16 * q2;
        for (int t = 0; t < 2; t++) {  // sub-blocks s = t (low nibbles) and s = t + 2 (high nibbles)
          __m256i sp[2][2];  // (sc, sc) int16 pairs of group 8h + 2s + q2, by [s = t, t + 2][half]
          for (int k = 0; k < 2; k++) {
            const __m128i v = V::bytes16(head + 32 + 16 * (8 * h + 2 * (t + 2 * k) + q2));
            sp[k][0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
            sp[k][1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(v, v));
          }
          for (int cp = 0; cp < 2; cp++) {
            __m256i lo[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, hi[2] = {lo[0], lo[1]};
            for (int k = 0; k < 2; k++) {
              const int cc = 2 * cp + k;
              const uint8_t* hc = b + (8 * h + 4 * q2 + cc) * 192;
              const __m256i xl = V::bcast4(xr + 4 * cc + 32 * t), xh = V::bcast4(xr + 4 * cc + 32 * (t + 2));
              for (int e = 0; e < 2; e++) {
                const __m256i hv = V::load(hc + 32 * e), lv = V::load(hc + 64 * (1 + t) + 32 * e);
                const __m256i hlo = _mm256_and_si256(t == 0 ? _mm256_slli_epi16(hv, 4) : _mm256_slli_epi16(hv, 2), m30);
                const __m256i hhi = _mm256_and_si256(t == 0 ? hv : _mm256_srli_epi16(hv, 2), m30);
                const __m256i ulo = _mm256_or_si256(_mm256_and_si256(lv, m4), hlo);
                const __m256i uhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lv, 4), m4), hhi);
                lo[e] = _mm256_add_epi16(lo[e], _mm256_maddubs_epi16(ulo, xl));
                hi[e] = _mm256_add_epi16(hi[e], _mm256_maddubs_epi16(uhi, xh));
                V::in_register(lo[e]), V::in_register(hi[e]);
              }
            }
            for (int e = 0; e < 2; e++)
              is[e] = _mm256_add_epi32(is[e], _mm256_add_epi32(_mm256_madd_epi16(lo[e], sp[0][e]),
                                                               _mm256_madd_epi16(hi[e], sp[1][e])));
          }
        }
      }
    const __m256 dx = _mm256_set1_ps(x.dval(0, sb));
    for (int e = 0; e < 2; e++) {
      const __m256i isum = _mm256_sub_epi32(is[e], _mm256_slli_epi32(off[e], 5));
      acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(V::halves(head + 16 * e), dx), acc[e]);
    }
  }
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}
#endif

}  // namespace offspec

#include "ggml_x16_legacy.h"
#include "ggml_x16_low.h"

namespace offspec {

#ifdef OFFSPEC_AVX512
using VX16 = V16;
#else
using VX16 = V8;
#endif
// Activation rows per pass over a group's weights; AVX2's 16 registers hold the 8 running sums of 4 rows
// (V8::in_register), their scaled sums and accumulators stay in memory (4 rows 1.15-1.3x faster than 2 there).
constexpr int X16_TILE = 4;
#ifdef OFFSPEC_AVX512
constexpr bool X16_LOW_WIDE = true;  // Q2_K, Q3_K: tiles of 8 rows (32 registers hold their sums)
#else
constexpr bool X16_LOW_WIDE = false;
#endif

// y[r * ystride + 16 g + i] for the `groups` interleaved groups at w (16 rb bytes each, the first of them group
// `g0` of the weight) and every activation row.
inline void x16_rows(int64_t type, const uint8_t* w, int64_t rb, int64_t g0, int64_t groups, const XSet& x, float* y,
                     int64_t ystride) {
  const int64_t base = x16_base(type);
  const bool sums = type >= X16S_TYPES;  // a draft's products (the legacy types' legacy_x16s)
  for (int64_t gi = 0; gi < groups; gi++) {
#ifndef OFFSPEC_AVX512
    if (x.M == 1 && (base == Q4_K || base == Q6_K || (sums && x16_legacy(base)))) {  // a step: one walk a group
      const uint8_t* g = w + gi * X16_ROWS * rb;
      float* yg = y + gi * X16_ROWS;
      switch (base) {
        case Q4_K: q4k_x16_avx2_one(g, x, yg); break;
        case Q6_K: q6k_x16_avx2_one(g, (g0 + gi) * (x.K / 256), x, yg); break;
        case Q4_0: legacy_x16s_avx2_one<Q4_0>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        case Q4_1: legacy_x16s_avx2_one<Q4_1>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        case Q5_0: legacy_x16s_avx2_one<Q5_0>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        case Q5_1: legacy_x16s_avx2_one<Q5_1>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        case Q8_0: legacy_x16s_avx2_one<Q8_0>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        case MXFP4: legacy_x16s_avx2_one<MXFP4>(g, (g0 + gi) * (x.K / 32), x, yg); break;
        default: legacy_x16s_avx2_one<IQ4_NL>(g, (g0 + gi) * (x.K / 32), x, yg); break;
      }
      continue;
    }
#endif
    for (int64_t half = 0; half < X16_ROWS / VX16::LANES; half++) {
      const uint8_t* g = w + gi * X16_ROWS * rb;
      float* yg = y + gi * X16_ROWS + half * VX16::LANES;
      const int64_t first = (g0 + gi) * (x.K / 32);  // the group's first block in the weight (legacy types)
      auto legacy = [&](auto T) {
        constexpr int64_t t = decltype(T)::value;
        if (sums) legacy_x16s<VX16, t>(g, first, half, x, yg, ystride);
        else legacy_x16<VX16, t>(g, first, half, x, yg, ystride);
      };
      switch (base) {
        case Q4_0: legacy(std::integral_constant<int64_t, Q4_0>{}); continue;
        case Q4_1: legacy(std::integral_constant<int64_t, Q4_1>{}); continue;
        case Q5_0: legacy(std::integral_constant<int64_t, Q5_0>{}); continue;
        case Q5_1: legacy(std::integral_constant<int64_t, Q5_1>{}); continue;
        case Q8_0: legacy(std::integral_constant<int64_t, Q8_0>{}); continue;
        case IQ4_NL: legacy(std::integral_constant<int64_t, IQ4_NL>{}); continue;
        case MXFP4: legacy(std::integral_constant<int64_t, MXFP4>{}); continue;
        default: break;
      }
      if (x16_low(base)) {  // ggml_x16_low.h: tiles of 8 rows where X16_LOW_WIDE, then of 4, then the rest
        auto low = [&](int64_t r, auto R) {
          if (base == Q2_K) q2k_x16<VX16, decltype(R)::value>(g, half, x, r, yg, ystride);
          else q3k_x16<VX16, decltype(R)::value>(g, (g0 + gi) * (x.K / 256), half, x, r, yg, ystride);
        };
        in_tiles<X16_LOW_WIDE>(x.M, low);
        continue;
      }
      int64_t r = 0;
      auto run = [&](auto R) {
#ifdef OFFSPEC_AVX512
        if (base == Q4_K) q4k_x16<VX16, decltype(R)::value>(g, half, x, r, yg, ystride);
        else q6k_x16<VX16, decltype(R)::value>(g, (g0 + gi) * (x.K / 256), half, x, r, yg, ystride);
#else
        if (base == Q4_K) q4k_x16_avx2<decltype(R)::value>(g, half, x, r, yg, ystride);
        else q6k_x16_avx2<decltype(R)::value>(g, (g0 + gi) * (x.K / 256), half, x, r, yg, ystride);
#endif
      };
      for (; r + X16_TILE <= x.M; r += X16_TILE) run(std::integral_constant<int, X16_TILE>{});
      switch (x.M - r) {  // the rest (below X16_TILE)
        case 3: run(std::integral_constant<int, 3 < X16_TILE ? 3 : 1>{}); break;
        case 2: run(std::integral_constant<int, 2 < X16_TILE ? 2 : 1>{}); break;
        case 1: run(std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
  }
}
#endif  // OFFSPEC_AVX2

}  // namespace offspec
