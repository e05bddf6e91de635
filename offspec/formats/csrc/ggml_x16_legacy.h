// The legacy types' interleaved products (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4; the layout: ggml_x16.h).
// Included by ggml_x16.h after its vector operations (V16, V8).
//
// The row-major kernels (ggml_dot.h tile, ggml_dot512.h tile512 / tile512u) keep per weight row 8 float lanes and
// two accumulators, one for the even blocks and one for the odd: lane l of block b adds fma(sum of the products of
// elements 4l .. 4l + 3, d * dx) (+ (m * dx) * sum(x) in a scalar per parity for Q4_1 / Q5_1), and the row's result
// is hsum(even + odd) (lanes l and l + 4, then 0 + 2 and 1 + 3, then the two). Interleaved, the 16 rows' sums of
// lane l are one vpdpbusd of chunk l with 4 broadcast activations, so each of the 8 lanes x 2 parities is a register
// of 16 rows and the whole reduction is vertical: the same integers, the same float steps in the same order, the
// same bits, with no horizontal sums and the scales of 16 rows in one conversion. One activation row's 16
// accumulators take half of AVX-512's registers, so several rows split the lanes between passes: 4 rows take lane
// pair {k, k + 4} per pass over the group's blocks, 2 rows lanes {0, 1, 4, 5} then {2, 3, 6, 7}, 1 row all 8; each
// chunk is unpacked once for the rows of a pass. That pays from 8 rows up (prefill: 1.4x at 64); at 2-4 rows the
// float steps per lane and block bound the products either way.
// AVX2's 16 registers hold 8 accumulators: 1 row in two passes of 4 lanes, 2 rows in four of 2.
// A draft's weights (X16S_TYPES, formats/kernels.py as_draft) take legacy_x16s instead: each block's 8 lanes summed
// as integers first, then one conversion and one fma per block and row (not the row-major bits; a draft only
// proposes): the 0.5B draft's Q5_0 / Q8_0 matrices 1.1x at 2 rows, 1.5-2.5x from 3 (AVX2 1.3-2.1x), its prefill
// 1.6x.
#pragma once

namespace offspec {

constexpr int LEGACY_X16_TILE = 4;  // AVX-512: activation rows per pass over a group's blocks (4, 2 or 1)
// Passes of fewer activation rows take them one at a time: the 0.5B draft's matrices at 2 rows (a draft's catch-up
// after a pass) ran 0.87-0.91x as fast in 2-row tiles on AVX2, and no faster on AVX-512; from 4 rows tiles gain.
constexpr int LEGACY_X16_TILED_FROM = 4;

// Inlined wherever used: a chunk's registers passed by reference, or accumulators captured by one, go through memory
// where gcc outlines the function (it did, by the instantiations around it: 0.6x).
#define OFFSPEC_X16_INLINE __attribute__((always_inline))

// Do a signed legacy type's products run as unsigned bytes u = q + offset, the lane sums starting at XSet::o (exact
// where the multiply cannot saturate: VNNI's vpdpbusd, or a byte below 128 for maddubs), rather than with the sign
// moved onto the activations?
constexpr bool x16_offset_lanes(int64_t type) {
#if defined(OFFSPEC_AVX512) && defined(__AVX512VNNI__)
  return type == Q4_0 || type == Q5_0 || type == Q8_0 || type == IQ4_NL || type == MXFP4;
#else
  return type == Q4_0 || type == Q5_0 || type == MXFP4;  // MXFP4's u = q + 12 <= 24: maddubs cannot saturate
#endif
}

// The d of the V::LANES rows from `row0` of a group block whose d field is at p: halves, or MXFP4's exponents.
template <class V, int64_t T>
OFFSPEC_X16_INLINE inline typename V::F legacy_x16_d(const uint8_t* p, int64_t row0) {
  if constexpr (T == MXFP4) return V::e8m0(p + row0);
  else return V::halves(p + 2 * row0);
}

// The 16 (V16) or 8 (V8) rows' weights of lanes k (low) and k + 4 (high) of one block, as the bytes the products
// take: u = q + offset (x16_offset_lanes: Q4_0, Q5_0, MXFP4 always), q (Q4_1, Q5_1: unsigned already), or signed q
// (Q8_0, IQ4_NL without VNNI).
template <class V, int64_t T>
OFFSPEC_X16_INLINE inline void legacy_x16_chunk(const uint8_t* quants, const typename V::I& qh, int k,
                                                int64_t half, typename V::I& lo, typename V::I& hi) {
  using I = typename V::I;
  const int64_t at = half * 4 * V::LANES;
  if constexpr (T == Q8_0) {
    lo = V::load(quants + 64 * k + at);
    hi = V::load(quants + 64 * (k + 4) + at);
    if constexpr (x16_offset_lanes(T)) {
      lo = V::xorv(lo, V::set8((char)0x80));
      hi = V::xorv(hi, V::set8((char)0x80));
    }
    return;
  } else {
    const I m4 = V::set8(0x0F), v = V::load(quants + 64 * k + at);
    lo = V::andv(v, m4);
    hi = V::andv(V::template srl16<4>(v), m4);
    if constexpr (T == Q5_0 || T == Q5_1) {  // bit 8j + c of a row's word: element 4c + j's fifth bit (-> bit 4)
      const I m10 = V::set8(0x10);
      I blo;
      switch (k) {  // lane k < 4: bits k -> 4; lane k + 4: bits k + 4 -> 4
        case 0: blo = V::template sll16<4>(qh); break;
        case 1: blo = V::template sll16<3>(qh); break;
        case 2: blo = V::template sll16<2>(qh); break;
        default: blo = V::template sll16<1>(qh); break;
      }
      I bhi;
      switch (k) {
        case 0: bhi = qh; break;
        case 1: bhi = V::template srl16<1>(qh); break;
        case 2: bhi = V::template srl16<2>(qh); break;
        default: bhi = V::template srl16<3>(qh); break;
      }
      lo = V::orv(lo, V::andv(blo, m10));
      hi = V::orv(hi, V::andv(bhi, m10));
    }
    if constexpr (T == IQ4_NL || T == MXFP4) {  // the table's values, + 128 (MXFP4: + 12) where they run unsigned
      const I table = T == MXFP4 ? V::table16(KVALUES_MXFP4_U, 0)
                                 : V::table16(KVALUES_IQ4NL, x16_offset_lanes(T) ? (char)0x80 : 0);
      lo = V::shuffle(table, lo);
      hi = V::shuffle(table, hi);
    }
  }
}

// The exact sum of the products of one lane's 4 weights (as legacy_x16_chunk gives them) with 4 activations.
template <class V, int64_t T>
OFFSPEC_X16_INLINE inline typename V::I legacy_x16_isum(const typename V::I& w, const int8_t* x4,
                                                         int32_t offset_term) {
  if constexpr (x16_offset_lanes(T)) return V::dpbusd(V::set32(offset_term), w, V::bcast4(x4));
  else if constexpr (T == Q4_1 || T == Q5_1) return V::dpbusd(V::zero(), w, V::bcast4(x4));
  else return V::dot_signed(w, V::bcast4(x4));
}

// Lanes k0 .. k0 + NK and k0 + 4 .. k0 + 4 + NK of activation rows m0 .. m0 + R over a group's blocks at g
// (`first`: the index in the weight of its first block): q[r][k0 + j] = t[k0 + j] + t[k0 + j + 4] of row m0 + r,
// t = even + odd (the first step of hsum); for Q4_1 / Q5_1, off[r] = off_even + off_odd (where k0 == 0). The R rows
// share each chunk's unpacking; every row's float steps are those of a pass of its own.
template <class V, int64_t T, int k0, int NK, int R>
void legacy_x16_lanes(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t m0,
                      typename V::F (*q)[4], typename V::F* off) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr bool MIN = T == Q4_1 || T == Q5_1, QH = T == Q5_0 || T == Q5_1;
  F acc[2][2 * NK][R];  // [block parity][j][row]: lane k0 + j (j < NK), lane k0 + j - NK + 4 (j >= NK)
  F offs[2][R];         // [block parity][row] Q4_1 / Q5_1: sum of (m * dx) * sum(x)
  for (int p = 0; p < 2; p++)
    for (int r = 0; r < R; r++) {
      offs[p][r] = V::fzero();
      for (int j = 0; j < 2 * NK; j++) acc[p][j][r] = V::fzero();
    }
  // block xb into the accumulators of parity PAR (a constant, so that they stay in registers)
  auto block = [&](int64_t xb, auto PAR) OFFSPEC_X16_INLINE {
    const int par = PAR;  // its accumulators (the row-major kernels' even / odd)
    constexpr LegacyX16Layout L = legacy_x16_layout(T);  // not the enclosing one: gcc 12 cannot capture it
    const bool odd = (first + xb) % 2;  // the layout of this block (ggml_x16.h)
    const uint8_t* b = g + xb * L.group_bytes;
    const F d = legacy_x16_d<V, T>(b + L.d_at(odd), half * V::LANES);
    F scale[R];
    for (int r = 0; r < R; r++) scale[r] = V::fmul(d, V::fset(x.dval(m0 + r, xb)));
    const I qh = QH ? V::load(b + L.qh_at(odd) + half * 4 * V::LANES) : V::zero();
#pragma GCC unroll 4
    for (int j = 0; j < NK; j++) {
      const int k = k0 + j;
      I lo, hi;
      legacy_x16_chunk<V, T>(b + L.quants_at(odd), qh, k, half, lo, hi);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const int8_t* xq = x.qrow(m0 + r, xb);
        const int32_t* o = x16_offset_lanes(T) ? x.orow(m0 + r, xb) : nullptr;
        const I slo = legacy_x16_isum<V, T>(lo, xq + 4 * k, o ? o[k] : 0);
        const I shi = legacy_x16_isum<V, T>(hi, xq + 4 * (k + 4), o ? o[k + 4] : 0);
        acc[par][j][r] = V::fmadd(V::cvt(slo), scale[r], acc[par][j][r]);
        acc[par][NK + j][r] = V::fmadd(V::cvt(shi), scale[r], acc[par][NK + j][r]);
      }
    }
    if constexpr (MIN) {
      if (k0 == 0) {
        const F m = V::halves(b + L.m_at() + 2 * half * V::LANES);
        for (int r = 0; r < R; r++) {
          const F mdx = V::fmul(m, V::fset(x.dval(m0 + r, xb)));
          offs[par][r] = V::fadd(offs[par][r], V::fmul(mdx, V::fset((float)x.sval(m0 + r, xb))));
        }
      }
    }
  };
  const int64_t n = x.K / 32;  // blocks: even ones to the even accumulators, odd ones to the odd
  int64_t xb = 0;
  if constexpr (V::LANES == 8 && R == 1) {  // AVX2, one row: the parity at run time (as fast, and smaller code)
    for (; xb < n; xb++) block(xb, int(xb % 2));
  } else {  // the parity a constant: several rows' accumulators stay in registers
    for (; xb + 2 <= n; xb += 2) {
      block(xb, std::integral_constant<int, 0>{});
      block(xb + 1, std::integral_constant<int, 1>{});
    }
    if (xb < n) block(xb, std::integral_constant<int, 0>{});
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < NK; j++)
      q[r][k0 + j] = V::fadd(V::fadd(acc[0][j][r], acc[1][j][r]), V::fadd(acc[0][NK + j][r], acc[1][NK + j][r]));
    if (MIN && k0 == 0) off[r] = V::fadd(offs[0][r], offs[1][r]);
  }
}

// y[(m0 + r) * ystride + i] (i < V::LANES) for the group's rows half * LANES + i and activation rows m0 .. m0 + R:
// R rows at a time in NK = 4 / R lanes per pass (AVX-512: 16 accumulators), or NK = 2 / R (AVX2's 16 registers
// hold 8 of them); the passes over the group's lanes read its chunks once between them.
template <class V, int64_t T, int R>
void legacy_x16_tile(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t m0, float* y,
                     int64_t ystride) {
  using F = typename V::F;
  constexpr bool MIN = T == Q4_1 || T == Q5_1;
  constexpr int NK = (V::LANES == 16 ? 4 : 2) / R;
  static_assert(NK >= 1, "at most 4 rows (AVX-512) or 2 (AVX2) per pass");
  F q[R][4], off[R];
  for (int r = 0; r < R; r++) off[r] = V::fzero();
  legacy_x16_lanes<V, T, 0, NK, R>(g, first, half, x, m0, q, off);
  if constexpr (NK <= 2) legacy_x16_lanes<V, T, NK, NK, R>(g, first, half, x, m0, q, off);
  if constexpr (NK == 1) {
    legacy_x16_lanes<V, T, 2, 1, R>(g, first, half, x, m0, q, off);
    legacy_x16_lanes<V, T, 3, 1, R>(g, first, half, x, m0, q, off);
  }
  for (int r = 0; r < R; r++) {
    F v = V::fadd(V::fadd(q[r][0], q[r][2]), V::fadd(q[r][1], q[r][3]));  // hsum's last two steps
    if constexpr (MIN) v = V::fadd(v, off[r]);
    V::store(y + (m0 + r) * ystride, v);
  }
}

// y[m * ystride + i] (i < V::LANES) for the group's rows half * LANES + i and every activation row m.
template <class V, int64_t T>
void legacy_x16(const uint8_t* g, int64_t first, int64_t half, const XSet& x, float* y, int64_t ystride) {
  constexpr int TILE = V::LANES == 16 ? LEGACY_X16_TILE : 2;
  int64_t m = 0;
  if (x.M >= LEGACY_X16_TILED_FROM) {
    for (; m + TILE <= x.M; m += TILE) legacy_x16_tile<V, T, TILE>(g, first, half, x, m, y, ystride);
    if constexpr (TILE == 4) {  // 2 or 3 rows left: 2 of them in one pass
      if (m + 2 <= x.M) {
        legacy_x16_tile<V, T, 2>(g, first, half, x, m, y, ystride);
        m += 2;
      }
    }
  }
  for (; m < x.M; m++) legacy_x16_tile<V, T, 1>(g, first, half, x, m, y, ystride);
}

// A draft's products (X16S_TYPES: the same bytes, another type id) of activation rows m0 .. m0 + R: per block and
// row, the 8 lanes' exact integer sums in one register (the signed types' offset folded in as -offset * the block's
// sum of x), then acc = fma(that, d * dx, acc) (Q4_1 / Q5_1: off = fma(m * dx, sum(x), off), and acc + off at the
// end): 2 float steps a block where the exact kernels take 16, so the R rows share each chunk's unpacking with
// registers to spare (AVX2: V::in_register keeps the rows' sums there as the chunks add, the 0.5B draft's Q5_0
// products 1.03-1.09x faster at 2-64 rows). A row's result is the same whatever R or the build (tests: test_x16,
// test_kernel_isa).
template <class V, int64_t T, int R>
void legacy_x16s_tile(const uint8_t* g, int64_t first, int64_t half, const XSet& x, int64_t m0, float* y,
                      int64_t ystride) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr bool MIN = T == Q4_1 || T == Q5_1, QH = T == Q5_0 || T == Q5_1;
  constexpr LegacyX16Layout L = legacy_x16_layout(T);
  F acc[R], offs[R];
  for (int r = 0; r < R; r++) acc[r] = offs[r] = V::fzero();
  for (int64_t xb = 0, n = x.K / 32; xb < n; xb++) {
    const bool odd = (first + xb) % 2;
    const uint8_t* b = g + xb * L.group_bytes;
    if constexpr (R >= 4) x16_prefetch<R>(b, (L.group_bytes + 63) / 64);  // 4 rows on: 1.1x, 8 rows 1.6x
    const I qh = QH ? V::load(b + L.qh_at(odd) + half * 4 * V::LANES) : V::zero();
    I is[R];
    for (int r = 0; r < R; r++)
      is[r] = x16_offset_lanes(T) ? V::set32(-legacy_offset(T) * x.sval(m0 + r, xb)) : V::zero();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      I lo, hi;
      legacy_x16_chunk<V, T>(b + L.quants_at(odd), qh, k, half, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        const int8_t* xq = x.qrow(m0 + r, xb);
        if constexpr (x16_offset_lanes(T) || MIN) {
          is[r] = V::dpbusd(is[r], lo, V::bcast4(xq + 4 * k));
          is[r] = V::dpbusd(is[r], hi, V::bcast4(xq + 4 * (k + 4)));
        } else {
          is[r] = V::add(is[r], V::add(V::dot_signed(lo, V::bcast4(xq + 4 * k)),
                                       V::dot_signed(hi, V::bcast4(xq + 4 * (k + 4)))));
        }
        V::in_register(is[r]);
      }
    }
    const F d = legacy_x16_d<V, T>(b + L.d_at(odd), half * V::LANES);
    for (int r = 0; r < R; r++) acc[r] = V::fmadd(V::cvt(is[r]), V::fmul(d, V::fset(x.dval(m0 + r, xb))), acc[r]);
    if constexpr (MIN) {
      const F m = V::halves(b + L.m_at() + 2 * half * V::LANES);
      for (int r = 0; r < R; r++)
        offs[r] = V::fmadd(V::fmul(m, V::fset(x.dval(m0 + r, xb))), V::fset((float)x.sval(m0 + r, xb)), offs[r]);
    }
  }
  for (int r = 0; r < R; r++) V::store(y + (m0 + r) * ystride, MIN ? V::fadd(acc[r], offs[r]) : acc[r]);
}

#ifndef OFFSPEC_AVX512
// legacy_x16s_tile for one activation row on AVX2, both halves of the group in one walk over its blocks (the
// activations broadcast once for the 16 rows, each block read once, a prefetch ahead as the K-quants' one-row walks
// take it): the same integer sums and float steps per row, so the same results.
template <int64_t T>
__attribute__((noinline)) void legacy_x16s_avx2_one(const uint8_t* g, int64_t first, const XSet& x, float* y) {
  using V = V8;
  using I = V::I;
  using F = V::F;
  constexpr bool MIN = T == Q4_1 || T == Q5_1, QH = T == Q5_0 || T == Q5_1;
  constexpr LegacyX16Layout L = legacy_x16_layout(T);
  F acc[2] = {V::fzero(), V::fzero()}, offs[2] = {V::fzero(), V::fzero()};  // rows 0..7, 8..15
  for (int64_t xb = 0, n = x.K / 32; xb < n; xb++) {
    const bool odd = (first + xb) % 2;
    const uint8_t* b = g + xb * L.group_bytes;
    x16_prefetch<1>(b, (L.group_bytes + 63) / 64);
    const I qh[2] = {QH ? V::load(b + L.qh_at(odd)) : V::zero(), QH ? V::load(b + L.qh_at(odd) + 32) : V::zero()};
    const I start = x16_offset_lanes(T) ? V::set32(-legacy_offset(T) * x.sval(0, xb)) : V::zero();
    I is[2] = {start, start};
    const int8_t* xq = x.qrow(0, xb);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      const I xl = V::bcast4(xq + 4 * k), xh = V::bcast4(xq + 4 * (k + 4));
      for (int e = 0; e < 2; e++) {
        I lo, hi;
        legacy_x16_chunk<V, T>(b + L.quants_at(odd), qh[e], k, e, lo, hi);
        if constexpr (x16_offset_lanes(T) || MIN) {
          is[e] = V::dpbusd(is[e], lo, xl);
          is[e] = V::dpbusd(is[e], hi, xh);
        } else {
          is[e] = V::add(is[e], V::add(V::dot_signed(lo, xl), V::dot_signed(hi, xh)));
        }
      }
    }
    const F dx = V::fset(x.dval(0, xb));
    for (int e = 0; e < 2; e++) {
      acc[e] = V::fmadd(V::cvt(is[e]), V::fmul(legacy_x16_d<V, T>(b + L.d_at(odd), 8 * e), dx), acc[e]);
      if constexpr (MIN)
        offs[e] = V::fmadd(V::fmul(V::halves(b + L.m_at() + 16 * e), dx), V::fset((float)x.sval(0, xb)), offs[e]);
    }
  }
  for (int e = 0; e < 2; e++) V::store(y + 8 * e, MIN ? V::fadd(acc[e], offs[e]) : acc[e]);
}
#endif

// legacy_x16's rows for a draft: tiles of 8 activation rows (AVX-512) or 4 (AVX2), then the rest in one tile.
template <class V, int64_t T>
void legacy_x16s(const uint8_t* g, int64_t first, int64_t half, const XSet& x, float* y, int64_t ystride) {
  constexpr int TILE = V::LANES == 16 ? 8 : 4;
  int64_t m = 0;
  for (; m + TILE <= x.M; m += TILE) legacy_x16s_tile<V, T, TILE>(g, first, half, x, m, y, ystride);
  auto rest = [&](auto R) { legacy_x16s_tile<V, T, decltype(R)::value>(g, first, half, x, m, y, ystride); };
  switch (x.M - m) {
    case 1: rest(std::integral_constant<int, 1>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 4: rest(std::integral_constant<int, TILE == 8 ? 4 : 1>{}); break;  // AVX2: a whole tile (above)
    case 5: rest(std::integral_constant<int, TILE == 8 ? 5 : 1>{}); break;
    case 6: rest(std::integral_constant<int, TILE == 8 ? 6 : 1>{}); break;
    case 7: rest(std::integral_constant<int, TILE == 8 ? 7 : 1>{}); break;
    default: break;
  }
}

}  // namespace offspec
