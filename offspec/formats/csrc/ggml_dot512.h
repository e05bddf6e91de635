// AVX-512 tiles of ggml_dot.h: two blocks of 32 weights per instruction (512-bit registers), with AVX512-VNNI's
// fused multiply-adds where the CPU has them. Included by ggml_dot.h when built with -mavx512f -mavx512bw.
//
// Bit for bit the AVX2 tiles' results: every integer sum is exact (no 16-bit saturation: the largest pair sum is
// 2 * 128 * 127), the two halves of a register are folded into the AVX2 kernel's 8 lanes before any float step,
// and the float steps are the AVX2 kernel's, in its order (the K-quants': KSteps). A machine with AVX-512 and one without compute the
// same logits (tests/test_formats.py compares the two builds where the CPU can run both).
#pragma once

#include <immintrin.h>

namespace offspec {

inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 join256(__m256 lo, __m256 hi) {  // (insertf32x8 would need AVX512DQ)
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 high256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
inline __m256i fold(__m512i v) {  // lanes i and i + 8 summed: the AVX2 kernel's 8 int32 lanes
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// acc + the pairwise products of 16-bit lanes (vpmaddwd, then a 32-bit add: exact either way)
inline __m512i madd_acc(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// 16 int32 sums of 4 products of unsigned bytes `u` with signed bytes `s` (exact: no pair reaches 2^15)
inline __m512i dot_us512(__m512i u, __m512i s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
// 16 int32 lanes: o + the sums of 4 products of unsigned u with signed x (exact where no pair of products
// reaches 2^15: see unsigned_legacy)
inline __m512i dot_us512_from(__m512i o, __m512i u, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(o, u, x);
#else
  return _mm512_add_epi32(o, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}

// a signed weight `q` as |q| (unsigned) and the lanes where it is negative: x is negated there (AVX2's sign trick)
struct Signed512 {
  __m512i mag;
  __mmask64 neg;
  explicit Signed512(__m512i q) : mag(_mm512_abs_epi8(q)), neg(_mm512_movepi8_mask(q)) {}
  Signed512(__m512i m, __mmask64 n) : mag(m), neg(n) {}
  __m512i apply(__m512i x) const { return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x); }
};
inline void keep(__m512i& v) { __asm__("" : "+v"(v)); }

// Q2_K's and Q3_K's 2-bit quants of sub-blocks j and j + 1 (j even, s = j % 4): bits 2s of the 32 bytes at p in the
// low half, bits 2s + 2 in the high half
inline __m512i low2_pair(const uint8_t* p, int s) {
  const __m512i shift = join256(_mm256_set1_epi16(2 * s), _mm256_set1_epi16(2 * s + 2));
  return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32u(p)), shift), _mm512_set1_epi8(3));
}

// K-quant sub-blocks j and j + 1 (j even) in one register, sub-block j in the low half (KBlock::q's values; Q3_K's:
// ksigned2)
template <int64_t T>
inline __m512i kq2(const KBlock<T>& b, int j) {
  if constexpr (T == Q2_K) {
    return low2_pair(b.blk + 16 + (j / 4) * 32, j % 4);
  } else if constexpr (ternary(T)) {  // ggml_dot_tq.h: the digits t (0 .. 3)
    return b.pair(j);
  } else if constexpr (T == IQ4_XS) {  // sub-blocks j and j + 1: 32 consecutive bytes, each 16 low nibbles then high
    const __m512i idx = join256(nibbles_32(b.blk + 8 + 16 * j), nibbles_32(b.blk + 24 + 16 * j));
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES_IQ4NL)));
    return _mm512_shuffle_epi8(table, idx);
  } else if constexpr (T == Q6_K) {
    const int h = j / 4, s = j % 4;  // s is 0 or 2: the two sub-blocks read 64 consecutive bytes, shifted alike
    const __m512i src = _mm512_loadu_si512(b.blk + h * 64);
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(src, 4 * (s >> 1)), _mm512_set1_epi8(0x0F));
    const __m256i hb = load32u(b.blk + 128 + h * 32);
    const __m512i hb2 = join256(_mm256_srli_epi16(hb, 2 * s), _mm256_srli_epi16(hb, 2 * s + 2));
    const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(hb2, _mm512_set1_epi8(3)), 4);
    return _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(32));
  } else {  // the low and high nibbles of the same 32 bytes
    const __m256i raw = load32u(b.blk + (T == Q4_K ? 16 : 48) + (j / 2) * 32);
    __m512i v = _mm512_and_si512(join256(raw, _mm256_srli_epi16(raw, 4)), _mm512_set1_epi8(0x0F));
    if constexpr (T == Q5_K) {
      const __m256i h = load32u(b.blk + 16);
      const __m512i h2 = join256(_mm256_srli_epi16(h, j), _mm256_srli_epi16(h, j + 1));
      v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(h2, _mm512_set1_epi8(1)), 4));
    }
    return v;
  }
}

// The signed weights of sub-blocks j and j + 1 as magnitudes and negative lanes. Q3_K's q = low2 - 4 is negative
// exactly where its high bit is 0, and |q| = 4 - low2 there: a test and a subtraction instead of decoding q.
template <int64_t T>
inline Signed512 ksigned2(const KBlock<T>& b, int j) {
  if constexpr (T == Q3_K) {
    const __m512i lo = low2_pair(b.blk + 32 + (j / 4) * 32, j % 4);
    const __m512i bit = join256(_mm256_set1_epi8((char)(1 << j)), _mm256_set1_epi8((char)(1 << (j + 1))));
    const __mmask64 neg = _mm512_testn_epi8_mask(_mm512_broadcast_i64x4(load32u(b.blk)), bit);  // hmask: bit j
    return Signed512(_mm512_mask_sub_epi8(lo, neg, _mm512_set1_epi8(4), lo), neg);
  } else if constexpr (iq2_type(T)) {  // grid magnitudes and sign bits (ggml_dot_iq2.h)
    return Signed512(b.mag2(j), b.neg2(j));
  } else if constexpr (T == IQ3_XXS || T == IQ3_S || T == IQ1_S || T == IQ1_M) {
    // the lattice types decode a pair at once: KBlock::pair (ggml_dot_iq3.h, ggml_dot_iq1.h)
    __m512i mag;
    __mmask64 neg;
    b.pair(j, mag, neg);
    return Signed512(mag, neg);
  } else {
    return Signed512(kq2(b, j));
  }
}

// The scales of sub-blocks j and j + 1 (16 x int16 each, as KBlock::scales). Q2_K's, Q3_K's, the IQ2 types' 16 per 16
// weights: one permutation of their int16 copies (sc16), 8 lanes each of scales 2j .. 2j + 3.
template <int64_t T>
inline __m512i kscales2(const KBlock<T>& b, int j) {
  if constexpr (T == Q2_K || T == Q3_K || iq2_type(T)) {
    alignas(64) static const int16_t quarters[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const __m512i idx = _mm512_add_epi16(_mm512_load_si512(quarters), _mm512_set1_epi16((short)(2 * j)));
    const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.sc16));
    return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(all));
  } else if constexpr (T == IQ3_XXS || T == IQ3_S || T == IQ1_S || T == IQ1_M) {  // KBlock::scales2 (as pair)
    return b.scales2(j);
  } else {
    return join256(b.scales(j), b.scales(j + 1));
  }
}

// ksums (ggml_dot.h) with two sub-blocks per step; the sums folded to the AVX2 kernel's 8 lanes.
template <int64_t T, int R>
inline void ksums512(const KBlock<T>& blk, const XSet& x, int64_t r0, int64_t sb, ISum* out, ISum* ms) {
  __m512i is[R];
  for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    const __m512i sv = kscales2(blk, j);
    if constexpr (T == Q3_K || T == Q6_K || T == IQ4_XS || iq2_type(T) || T == IQ3_XXS || T == IQ3_S || T == IQ1_S ||
                  T == IQ1_M) {  // signed weights
      const Signed512 qs = ksigned2(blk, j);
      for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_loadu_si512(x.qrow(r0 + r, sb * 8 + j));
        is[r] = madd_acc(is[r], _mm512_maddubs_epi16(qs.mag, qs.apply(xv)), sv);
        keep(is[r]);
      }
    } else if constexpr (ternary(T)) {  // digits 0 .. 3, no scales: one dot product per row
      const __m512i q = kq2(blk, j);
      for (int r = 0; r < R; r++) {
        is[r] = dot_us512_from(is[r], q, _mm512_loadu_si512(x.qrow(r0 + r, sb * 8 + j)));
        keep(is[r]);
      }
    } else {
      const __m512i q = kq2(blk, j);
      for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_loadu_si512(x.qrow(r0 + r, sb * 8 + j));
        is[r] = madd_acc(is[r], _mm512_maddubs_epi16(q, xv), sv);
        keep(is[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) out[r] = fold(is[r]);
  if constexpr (ternary(T))  // as ksums
    for (int r = 0; r < R; r++) out[r] = less_xsum(out[r], min_sums<T>(x, r0 + r, sb));
  if constexpr (KBlock<T>::MIN) {
    const auto mv = blk.min_vec();
    for (int r = 0; r < R; r++) ms[r] = blk.min_prod(mv, min_sums<T>(x, r0 + r, sb));
  }
}

// Rows r0 .. r0+R of one legacy weight row's output: tile with an even and an odd block per step, the even
// block's float accumulator in the low half of a register and the odd one's in the high half.
template <class B, int R>
void tile512(const uint8_t* w, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  __m512 acc[R];
  float off_even[R], off_odd[R];  // minimums (Q4_1, Q5_1): + m * dx * sum(x)
  for (int r = 0; r < R; r++) {
    acc[r] = _mm512_setzero_ps();
    off_even[r] = off_odd[r] = 0.0f;
  }
  const int64_t n = x.K / 32;
  int64_t xb = 0;
  for (; xb + 2 <= n; xb += 2) {
    const B b0(w + xb * B::BYTES), b1(w + (xb + 1) * B::BYTES);
    legacy_prefetch(w + xb * B::BYTES);
    const __m512i q = join256(b0.q(0), b1.q(0));
    const __m512 ws = join256(_mm256_set1_ps(b0.scale(0)), _mm256_set1_ps(b1.scale(0)));
    const Signed512 qs(q);  // unused (optimised away) for the unsigned types
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_loadu_si512(x.qrow(r0 + r, xb));
      const __m512i isum = B::MIN ? dot_us512(q, xv) : dot_us512(qs.mag, qs.apply(xv));
      const float dx0 = x.dval(r0 + r, xb), dx1 = x.dval(r0 + r, xb + 1);
      const __m512 scale = _mm512_mul_ps(ws, join256(_mm256_set1_ps(dx0), _mm256_set1_ps(dx1)));  // ws * dx per half
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
      if constexpr (B::MIN) {
        off_even[r] += (b0.min(0) * dx0) * (float)x.sval(r0 + r, xb);
        off_odd[r] += (b1.min(0) * dx1) * (float)x.sval(r0 + r, xb + 1);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    Acc even = _mm512_castps512_ps256(acc[r]), odd = high256(acc[r]);
    if (xb < n) {  // an odd number of blocks: the last one is even
      const B blk(w + xb * B::BYTES);
      const float dx = x.dval(r0 + r, xb);
      even = fma_acc(B::isum(blk.q(0), x.qrow(r0 + r, xb), 0), blk.scale(0) * dx, even);
      if constexpr (B::MIN) off_even[r] += (blk.min(0) * dx) * (float)x.sval(r0 + r, xb);
    }
    float v = acc_sum(even, odd);
    if constexpr (B::MIN) v += off_even[r] + off_odd[r];
    y[(r0 + r) * ystride] = v;
  }
}

// The signed legacy types as unsigned bytes (Q4_0, Q5_0; Q8_0 where VNNI multiplies all 8 bits of an unsigned byte
// without saturating): u = q + offset, so a block pair's products need no sign trick (tile512's abs, mask and
// negation) and a lane's sum starts at -offset times the sum of its 4 activations (XSet::o, once per activation row),
// which leaves it the exact int32 sum of q * x that tile512 computes: the same float steps on the same integers.
// MXFP4's u = q + 12 (at most 24) too.
constexpr bool unsigned_legacy(int64_t type) {
#ifdef __AVX512VNNI__
  return type == Q4_0 || type == Q5_0 || type == Q8_0 || type == IQ4_NL || type == MXFP4;
#else
  // maddubs' 16-bit pair sums hold 2 * 31 * 127, not 2 * 255 * 127
  return type == Q4_0 || type == Q5_0 || type == MXFP4;
#endif
}

// blocks b0 and b1 (32 weights each) as u = q + offset, b0 in the low half
template <int64_t T>
inline __m512i legacy_unsigned2(const uint8_t* b0, const uint8_t* b1) {
  if constexpr (T == Q8_0) {
    return _mm512_xor_si512(join256(load32u(b0 + 2), load32u(b1 + 2)), _mm512_set1_epi8((char)0x80));
  } else {
    constexpr int qs = T == Q5_0 ? 6 : T == MXFP4 ? 1 : 2;  // the 16 bytes of nibbles: elements 0-15 low, 16-31 high
    const __m512i both = join256(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qs))),
                                 _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qs))));
    // the second copy of each block's bytes shifted to their high nibbles (16-bit lanes 8-15 and 24-31)
    __m512i v = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFF00FF00u, both, 4), _mm512_set1_epi8(0x0F));
    if constexpr (T == Q5_0) {  // bit i of a block's 32 bits is the fifth bit of its element i
      uint32_t h0, h1;
      std::memcpy(&h0, b0 + 2, 4);
      std::memcpy(&h1, b1 + 2, 4);
      v = _mm512_mask_add_epi8(v, _cvtu64_mask64((uint64_t)h1 << 32 | h0), v, _mm512_set1_epi8(16));
    }
    if constexpr (T == IQ4_NL) {  // the nibbles index IQ4_NL's table, here + 128 (unsigned bytes 1 .. 241)
      const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES_IQ4NL));
      v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_xor_si128(k, _mm_set1_epi8((char)0x80))), v);
    }
    if constexpr (T == MXFP4) {  // MXFP4's table + 12 (unsigned bytes 0 .. 24)
      const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES_MXFP4_U));
      v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(k), v);
    }
    return v;
  }
}

// tile512 for the unsigned_legacy types: the same accumulators and float steps, in the same order.
template <int64_t T, int R>
void tile512u(const uint8_t* w, const XSet& x, int64_t r0, float* y, int64_t ystride) {
  using B = Legacy<T>;
  __m512 acc[R];  // the even block's 8 lanes low, the odd block's high
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const int64_t n = x.K / 32;
  int64_t xb = 0;
  for (; xb + 2 <= n; xb += 2) {
    const uint8_t* p0 = w + xb * B::BYTES;
    const uint8_t* p1 = p0 + B::BYTES;
    legacy_prefetch(p0);
    const __m512i u = legacy_unsigned2<T>(p0, p1);
    __m512 ws;  // the two blocks' d, b0's in the low half
    if constexpr (T == MXFP4) {
      ws = join256(_mm256_set1_ps(e8m0_half(p0[0])), _mm256_set1_ps(e8m0_half(p1[0])));
    } else {
      uint16_t h0, h1;
      std::memcpy(&h0, p0, 2);
      std::memcpy(&h1, p1, 2);
      ws = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)h1), _mm_set1_epi16((short)h0)));  // exact
    }
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_loadu_si512(x.qrow(r0 + r, xb));
      const __m512i isum = dot_us512_from(_mm512_loadu_si512(x.orow(r0 + r, xb)), u, xv);
      const __m512 scale = _mm512_mul_ps(ws, join256(_mm256_set1_ps(x.dval(r0 + r, xb)), _mm256_set1_ps(x.dval(r0 + r, xb + 1))));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    Acc even = _mm512_castps512_ps256(acc[r]), odd = high256(acc[r]);
    if (xb < n) {  // an odd number of blocks: the last one is even, as tile512 does it
      const B blk(w + xb * B::BYTES);
      even = fma_acc(B::isum(blk.q(0), x.qrow(r0 + r, xb), 0), blk.scale(0) * x.dval(r0 + r, xb), even);
    }
    y[(r0 + r) * ystride] = acc_sum(even, odd);
  }
}

}  // namespace offspec
