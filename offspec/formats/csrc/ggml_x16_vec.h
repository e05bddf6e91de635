// The vector operations of the interleaved kernels (ggml_x16.h, ggml_x16_legacy.h), at 16 lanes (AVX-512: one
// register holds a group's 16 rows) and at 8 (AVX2: a group is computed as two halves of 8 rows). Included by
// ggml_x16.h in its AVX2 part, and by attention.h.
#pragma once

namespace offspec {

#ifdef OFFSPEC_AVX512
struct V16 {
  static constexpr int LANES = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I set8(char v) { return _mm512_set1_epi8(v); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I bcast4(const int8_t* p) {  // 4 activations into every lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static void in_register(I&) {}  // 32 registers: the running sums stay in them anyway (V8::in_register)
  static I andv(I a, I b) { return _mm512_and_si512(a, b); }
  static I orv(I a, I b) { return _mm512_or_si512(a, b); }
  template <int n> static I srl16(I a) { return _mm512_srli_epi16(a, n); }
  template <int n> static I sll16(I a) { return _mm512_slli_epi16(a, n); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  // acc + the sums of 4 products of unsigned bytes u (< 64) with signed bytes s, per 32-bit lane (exact)
  static I dpbusd(I acc, I u, I s) { return dot_us512_from(acc, u, s); }
  static I dpwssd(I acc, I a, I b) { return madd_acc(acc, a, b); }
  static I dot_signed(I q, I s) {  // the sums of 4 products of signed bytes (|q| <= 128): the sign moved onto s
    const Signed512 qs(q);
    return dot_us512(qs.mag, qs.apply(s));
  }
  static I xorv(I a, I b) { return _mm512_xor_si512(a, b); }
  static I table16(const int8_t* t, char flip) {  // a 16-byte table in every 128-bit lane, its bytes ^ flip
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
    return _mm512_broadcast_i32x4(_mm_xor_si128(v, _mm_set1_epi8(flip)));
  }
  static I shuffle(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static I u8x32(__m128i b) { return _mm512_cvtepu8_epi32(b); }  // 16 unsigned bytes -> 16 int32 lanes
  static I s8x32(__m128i b) { return _mm512_cvtepi8_epi32(b); }
  // lane r: a_r | b_r << 16 (two unsigned bytes of row r as int16 pairs)
  static I pairs(__m128i a, __m128i b) {
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
  }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // 16 E8M0 exponents (MXFP4's) -> 2^(e - 128), bits as ggml_decode_mxfp4.h's e8m0_half builds them
  static F e8m0(const uint8_t* p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i one = _mm512_set1_epi32(1);
    const __mmask16 low = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));  // subnormal: 0x00200000 << e
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(low, _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23),
                                                       _mm512_slli_epi32(_mm512_add_epi32(e, one), 21)));
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fmax(F a, F b) { return _mm512_max_ps(a, b); }
  static F fround(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for whole n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), set32(127)), 23));
  }
  static F keep_ge(F y, F x, F lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }  // else 0
};
#endif

struct V8 {
  static constexpr int LANES = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set8(char v) { return _mm256_set1_epi8(v); }
  static I set32(int32_t v) { return _mm256_set1_epi32(v); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  // A running sum kept in a register, added to chunk by chunk (an empty asm, no instruction): with the chunks
  // unrolled GCC otherwise computes all their products first, spills them and adds them as a tree (AVX2's products
  // of several activation rows 1.2-1.4x slower)
  static void in_register(I& a) { asm("" : "+x"(a)); }
  static I andv(I a, I b) { return _mm256_and_si256(a, b); }
  static I orv(I a, I b) { return _mm256_or_si256(a, b); }
  template <int n> static I srl16(I a) { return _mm256_srli_epi16(a, n); }
  template <int n> static I sll16(I a) { return _mm256_slli_epi16(a, n); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I dpbusd(I acc, I u, I s) { return _mm256_add_epi32(acc, dot_us(u, s)); }  // exact: u < 64
  static I dpwssd(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static I dot_signed(I q, I s) { return dot_ss(q, s); }
  static I xorv(I a, I b) { return _mm256_xor_si256(a, b); }
  static I table16(const int8_t* t, char flip) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
    return _mm256_broadcastsi128_si256(_mm_xor_si128(v, _mm_set1_epi8(flip)));
  }
  static I shuffle(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static __m128i bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static I u8x32(__m128i b) { return _mm256_cvtepu8_epi32(b); }  // the low 8 bytes
  static I s8x32(__m128i b) { return _mm256_cvtepi8_epi32(b); }
  static I pairs(__m128i a, __m128i b) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b)); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F e8m0(const uint8_t* p) {  // 8 exponents, as V16::e8m0
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(_mm256_sub_epi32(e, one), 23),
                                                  _mm256_slli_epi32(_mm256_add_epi32(e, one), 21), low));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fmax(F a, F b) { return _mm256_max_ps(a, b); }
  static F fround(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n for whole n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), set32(127)), 23));
  }
  static F keep_ge(F y, F x, F lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }  // else 0
};

}  // namespace offspec
