// Q2_K's and Q3_K's interleaved products (the layout: ggml_x16.h). Included by ggml_x16.h after its vector
// operations (V16, V8).
//
// Row-major, these types cost a wide pass (many activation rows) about three times Q4_K's interleaved products
// ((512, 1536) x 8960 rows, one Zen core: Q2_K 94, Q3_K 80 against Q4_K x16's 26 ms): per weight row, activation row
// and pair of sub-blocks ksums512 takes a maddubs and a vpdpwssd (their scales per 16 weights applied to 16-bit
// products) and, for Q3_K, a masked negation of the activations (its signed quants), and every super-block ends in
// horizontal sums (rows_sum) and float steps per weight row (KStepsLanes). Interleaved, one vpdpbusd of a 64-byte
// chunk (4 quants of 16 rows) with 4 broadcast activations does the work of 16 rows, every lane stays one weight
// row's sum to the end, and the scales of 16 rows are applied in a few vector instructions:
//   Q2_K: each quant q (0 .. 3) is multiplied by its scale before the products, by a byte shuffle: in every
//     128-bit lane (4 rows) a table of the 4 rows' q * sc (0 .. 45, unsigned bytes) indexed by q + 4 * the row, so
//     that the chunk's vpdpbusd sums sc q x directly; the minimums' term sum_g m_g sum(x_g) takes one vpdpwssd of
//     (m_2j, m_2j+1) int16 pairs with (sum(x_2j), sum(x_2j+1)) per sub-block j.
//   Q3_K: each chunk's u = q + 4 (0 .. 7: the 2 low bits and the high bit, unsigned) is summed per group of 16 with
//     the activations, from -4 sum(x_g) (the -4 of q = u - 4), so that the group's sum is sum(q x) (|.| <= 16 * 4 *
//     128 < 2^15), scaled by one vpdpwssd against (sc_g, 0): the sum's high half is its sign, times 0. (Scaling the
//     quants first as Q2_K's, sc (u - 4) + 124 in 0 .. 252 by two shuffles, ran 1.17x slower with VNNI, and without
//     it maddubs would saturate.)
// AVX-512 takes tiles of 8 activation rows (Q3_K 1.07x faster than 4, Q2_K the same), the activations of each chunk
// and row as vpdpbusd's broadcast operand (X16Low::dot4). AVX2 has 16 registers and no vpdpbusd: tiles of 4, Q2_K's
// products of two chunks and Q3_K's of a group's 4 summed in 16-bit lanes before one vpmaddwd (as q4k_x16_avx2's).
// Exactness: the integer sums per (weight row, super-block) are the row-major kernels' (Q2_K: sum_g sc_g sum(q x)
// and sum_g m_g sum(x_g); Q3_K: sum_g sc_g sum(q x)), and the float steps KSteps' in its order (acc = fma(isum,
// d * dx, acc), then acc = fnmadd(msum, dmin * dx, acc) for Q2_K): the same bits for any M or tile. No 16-bit lane
// saturates: Q2_K's maddubs pairs (AVX2, AVX-512 without VNNI) reach 2 * 45 * 128 (two chunks' sums 4 * 45 * 128),
// Q3_K's 2 * 7 * 128 (a group's AVX2 halves 8128 + 4 * 2 * 7 * 128).
#pragma once

namespace offspec {

// The byte shuffle's index offsets of q2k_x16: 4 * the row of each byte within its 128-bit lane (4 rows of 4 bytes).
alignas(16) constexpr int8_t X16_LOW_ROWS[16] = {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12};

// Between sub-blocks: keeps gcc from holding the chunks it loaded for one sub-block in registers for the next ones
// (the same bytes, loaded again from L1, cost less than the registers: with 8 activation rows their running sums
// spilled)
inline void x16_low_fence() { asm volatile("" ::: "memory"); }

// The operations the two kernels need beyond V16's and V8's, by register type. Q3_K's sums per group of 16 (gstart,
// gadd, gend) are 32-bit lanes on AVX-512 (vpdpbusd, then one vpdpwssd against (sc, 0)) and on AVX2 two 16-bit
// halves per lane (maddubs and 16-bit adds, then one vpmaddwd against (sc, sc)): 2 operations a chunk and row
// instead of 3, as q4k_x16_avx2's.
template <class I>
struct X16Low;

template <>
struct X16Low<__m256i> {
  // lane r: bytes 2r and 2r + 1 at p, each zero-extended to 16 bits (a row's pair of scale bytes)
  static __m256i pairs(const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256i srl16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
  static __m256i sll16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
  static __m256i srl32(__m256i a, int n) { return _mm256_srli_epi32(a, n); }
  static __m256i sub16(__m256i a, __m256i b) { return _mm256_sub_epi16(a, b); }
  static __m256i low2_or(__m256i a, __m256i b) {  // (a & 3) | b, per byte (b has no bit 0 or 1 set)
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi8(3)), b);
  }
  // out[j] = s[2j] | s[2j + 1] << 16 as int16 pairs, j < 8: a super-block's 16 sums per 16 of one activation row
  // (exact: |s| <= 16 * 128)
  static void sum_pairs(const int32_t* s, int32_t* out) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
  }
  // acc + the pairwise products of the int16 pairs a with the pair at p in every lane
  static __m256i madd4(__m256i acc, __m256i a, const int32_t* p) { return V8::dpwssd(acc, a, _mm256_set1_epi32(*p)); }
  // acc + the products of two chunks' unsigned bytes w0, w1 with the 4 activations at p0, p1 in every lane, summed
  // in 16-bit lanes first (exact where each chunk's pair sums stay below 2^14)
  static __m256i dot4x2(__m256i acc, __m256i w0, const int8_t* p0, __m256i w1, const int8_t* p1) {
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, V8::bcast4(p0)), _mm256_maddubs_epi16(w1, V8::bcast4(p1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
  static __m256i gstart(int32_t v) { return _mm256_set1_epi32(v & 0xFFFF); }  // v in the low half, 0 in the high
  static __m256i gadd(__m256i a, __m256i u, const int8_t* p) {
    return _mm256_add_epi16(a, _mm256_maddubs_epi16(u, V8::bcast4(p)));
  }
  // the group scales of sc's int16 pairs (sc_2j, sc_2j+1), as gend takes them: (sc_2j+part, sc_2j+part)
  static __m256i gscale(__m256i sc, int part) {
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    return part ? _mm256_or_si256(_mm256_srli_epi32(sc, 16), _mm256_andnot_si256(low, sc))
                : _mm256_or_si256(_mm256_and_si256(sc, low), _mm256_slli_epi32(sc, 16));
  }
  static __m256i gend(__m256i is, __m256i a, __m256i scale) { return _mm256_add_epi32(is, _mm256_madd_epi16(a, scale)); }
};

#ifdef OFFSPEC_AVX512
template <>
struct X16Low<__m512i> {
  static __m512i pairs(const uint8_t* p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i srl16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
  static __m512i sll16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
  static __m512i srl32(__m512i a, int n) { return _mm512_srli_epi32(a, n); }
  static __m512i sub16(__m512i a, __m512i b) { return _mm512_sub_epi16(a, b); }
  static __m512i low2_or(__m512i a, __m512i b) {  // 0xEA: (a & c) | b
    return _mm512_ternarylogic_epi32(a, _mm512_set1_epi8(3), b, 0xEA);
  }
  static void sum_pairs(const int32_t* s, int32_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_loadu_si512(s)));
  }
  // With VNNI the 4 activations (the pair) are the instruction's broadcast memory operand: one instruction where a
  // broadcast and a vpdpbusd are two (gcc does not fold the broadcast into VNNI's instructions itself)
  using i32_alias = int32_t __attribute__((may_alias));
  static __m512i dot4(__m512i acc, __m512i u, const int8_t* p) {
#ifdef __AVX512VNNI__
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const i32_alias*>(p)));
    return acc;
#else
    return V16::dpbusd(acc, u, V16::bcast4(p));
#endif
  }
  static __m512i madd4(__m512i acc, __m512i a, const int32_t* p) {
#ifdef __AVX512VNNI__
    asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
    return acc;
#else
    return V16::dpwssd(acc, a, _mm512_set1_epi32(*p));
#endif
  }
  static __m512i dot4x2(__m512i acc, __m512i w0, const int8_t* p0, __m512i w1, const int8_t* p1) {
    return dot4(dot4(acc, w0, p0), w1, p1);
  }
  static __m512i gstart(int32_t v) { return _mm512_set1_epi32(v); }
  static __m512i gadd(__m512i a, __m512i u, const int8_t* p) { return dot4(a, u, p); }
  // (sc_2j+part, 0): a group's sum (|a| < 2^15) is its lane's low half, and its high half (the sign) meets a 0
  static __m512i gscale(__m512i sc, int part) {
    return part ? _mm512_srli_epi32(sc, 16) : _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF));
  }
  static __m512i gend(__m512i is, __m512i a, __m512i scale) { return madd_acc(is, a, scale); }
};
#endif

// Q2_K x16: outputs y[(r0 + r) * ystride + i] (i < V::LANES) of the group's rows half * LANES + i, activation rows
// r0 .. r0 + R, over the group's super-blocks at `g`. x.s16: the activations' sums per 16.
template <class V, int R>
void q2k_x16(const uint8_t* g, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using I = typename V::I;
  using F = typename V::F;
  using O = X16Low<I>;
  constexpr int64_t SB = 16 * 84, L = V::LANES;
  // the byte shuffle's index q + 4 * (the row within a 128-bit lane), and each row's multiples 0, 1, 2, 3 of its
  // scale in its 4 table bytes
  const I rows = V::table16(X16_LOW_ROWS, 0), steps = V::set32(0x03020100);
  F acc[R];
  for (int r = 0; r < R; r++) acc[r] = V::fzero();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const uint8_t* b = g + sb * SB;
    alignas(32) int32_t xs[R][8];  // (sum(x_2j), sum(x_2j+1)) int16 pairs of each activation row
    for (int r = 0; r < R; r++) O::sum_pairs(x.s16 + (r0 + r) * (x.K / 16) + sb * 16, xs[r]);
    I is[R], ms[R];
    for (int r = 0; r < R; r++) is[r] = ms[r] = V::zero();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {  // sub-block j: groups 2j, 2j + 1 (elements 32j .. 32j + 32)
      x16_low_fence();
      if (j % 2 == 0) x16_prefetch<R>(b + 6 * 64 * (j / 2), 6);  // a quarter of a super-block (21 lines) a pair
      const I p = O::pairs(b + 1024 + 32 * j + 2 * half * L);  // lane r: row r's scale bytes 2j, 2j + 1
      const I mn = O::srl16(p, 4);  // the minimums of groups 2j, 2j + 1 as int16 pairs
      for (int r = 0; r < R; r++) ms[r] = O::madd4(ms[r], mn, &xs[r][j]);
      const I sc = V::andv(p, V::set32(0x000F000F));
      const I table[2] = {V::mul(V::andv(sc, V::set32(0xFFFF)), steps), V::mul(O::srl32(sc, 16), steps)};
      const int h = j / 4, s = j % 4;
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {  // chunks (h, c), (h, c + 1): bits 2s of bytes 4c .. of qs[32h ..], group 2j + c / 4
        I w[2];
        for (int k = 0; k < 2; k++) {
          const I q = V::load(b + (8 * h + c + k) * 64 + half * 4 * L);
          w[k] = V::shuffle(table[c / 4], O::low2_or(O::srl16(q, 2 * s), rows));  // sc q, 0 .. 45
        }
        for (int r = 0; r < R; r++) {
          const int8_t* xr = x.qrow(r0 + r, sb * 8 + j) + 4 * c;
          is[r] = O::dot4x2(is[r], w[0], xr, w[1], xr + 4);  // maddubs pair sums <= 2 * 45 * 128
          V::in_register(is[r]);
        }
      }
    }
    const F d = V::halves(b + 1280 + 2 * half * L), dmin = V::halves(b + 1312 + 2 * half * L);
    for (int r = 0; r < R; r++) {
      const F dx = V::fset(x.dval(r0 + r, sb));
      acc[r] = V::fmadd(V::cvt(is[r]), V::fmul(d, dx), acc[r]);
      acc[r] = V::fnmadd(V::cvt(ms[r]), V::fmul(dmin, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) V::store(y + (r0 + r) * ystride, acc[r]);
}

// Q3_K x16, as q2k_x16; `first`: the group's first super-block in the weight (the layout alternates).
template <class V, int R>
void q3k_x16(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using I = typename V::I;
  using F = typename V::F;
  using O = X16Low<I>;
  constexpr int64_t SB = 16 * 110, L = V::LANES;
  const I four = V::set8(4);
  F acc[R];
  for (int r = 0; r < R; r++) acc[r] = V::fzero();
  for (int64_t sb = 0, n = x.K / 256; sb < n; sb++) {
    const bool odd = (first + sb) % 2;
    const uint8_t* qb = g + sb * SB + (odd ? 224 : 0) + half * 4 * L;  // the quants, this half's lanes
    const uint8_t* sp = g + sb * SB + (odd ? 0 : 1536) + 32 + 2 * half * L;  // the scale byte pairs, this half's
    alignas(64) int32_t xs[R][16];  // -4 sum(x_g) of each activation row: the -4 of q = u - 4, per group
    for (int r = 0; r < R; r++)
      for (int i = 0; i < 16; i++) xs[r][i] = -4 * x.s16[(r0 + r) * (x.K / 16) + sb * 16 + i];
    I is[R];
    for (int r = 0; r < R; r++) is[r] = V::zero();
    const I top[2] = {O::pairs(sp + 32 * 4), O::pairs(sp + 32 * 5)};  // scale bytes (8, 9), (10, 11)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {  // sub-block j: groups 2j, 2j + 1
      x16_low_fence();
      if (j % 2 == 0) x16_prefetch<R>(g + sb * SB + 7 * 64 * (j / 2), 7);  // a quarter of 27.5 lines a pair
      // scales 2j, 2j + 1 (int16 pairs): the low 4 bits nibble j / 4 of bytes 2 (j % 4), 2 (j % 4) + 1, the top 2
      // bits 2 (j / 2) of bytes 8 + 2 (j % 2), 9 + 2 (j % 2); stored + 32
      const I lo = V::andv(O::srl16(O::pairs(sp + 32 * (j % 4)), 4 * (j / 4)), V::set32(0x000F000F));
      const I hi = V::andv(O::srl16(top[j % 2], 2 * (j / 2)), V::set32(0x00030003));
      const I sc = O::sub16(V::orv(lo, O::sll16(hi, 4)), V::set32(0x00200020));
      const int h = j / 4, s = j % 4;
#pragma GCC unroll 2
      for (int part = 0; part < 2; part++) {  // group 2j + part: chunks 4 part .. 4 part + 3
        I a[R];  // sum(u x) - 4 sum(x) = sum(q x) over the group's 16 elements (|a| < 2^15; AVX2: in two halves,
                 // each below 2^14 + 16 * 4 * 128)
        for (int r = 0; r < R; r++) a[r] = O::gstart(xs[r][2 * j + part]);
#pragma GCC unroll 4
        for (int cc = 0; cc < 4; cc++) {
          const int c = 4 * part + cc;  // qs chunk (h, c): bits 2s; hmask chunk c: bit j, moved to bit 2
          const I q = V::load(qb + 512 + (8 * h + c) * 64), hm = V::load(qb + 64 * c);
          const I hb = V::andv(j >= 2 ? O::srl16(hm, j - 2) : O::sll16(hm, 2 - j), four);
          const I u = O::low2_or(O::srl16(q, 2 * s), hb);  // 0 .. 7
          for (int r = 0; r < R; r++) {
            a[r] = O::gadd(a[r], u, x.qrow(r0 + r, sb * 8 + j) + 4 * c);
            V::in_register(a[r]);
          }
        }
        const I scale = O::gscale(sc, part);
        for (int r = 0; r < R; r++) is[r] = O::gend(is[r], a[r], scale);
      }
    }
    const F d = V::halves(g + sb * SB + (odd ? 0 : 1536) + 2 * half * L);
    for (int r = 0; r < R; r++) acc[r] = V::fmadd(V::cvt(is[r]), V::fmul(d, V::fset(x.dval(r0 + r, sb))), acc[r]);
  }
  for (int r = 0; r < R; r++) V::store(y + (r0 + r) * ystride, acc[r]);
}

}  // namespace offspec
