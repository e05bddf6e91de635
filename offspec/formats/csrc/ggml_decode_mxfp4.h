// MXFP4 (ggml's block_mxfp4, gpt-oss's experts): blocks of 32 values in 17 bytes, an E8M0 exponent e, then 16
// bytes of 4-bit indices (value j the low nibble of byte j, value j + 16 the high one) into a table of twice the FP4
// (E2M1) numbers, so that the table is int8 and the scale is half the OCP one: x = KVALUES_MXFP4[q] * 2^(e - 128).
// Structurally IQ4_NL with another table and an exponent for d; its integer kernels are IQ4_NL's (ggml_dot.h
// Legacy, ggml_dot512.h, ggml_x16_legacy.h), the exponent made a float once per block (e8m0_half). Included by
// ggml_decode.h (which defines the type ids).
#pragma once

#include <cstdint>
#include <cstring>

namespace offspec {

constexpr int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The table + 12 (0 .. 24): the weights as unsigned bytes for the products that take them so (u = q + 12,
// legacy_offset); maddubs' pair sums of them stay below 2^15 (2 * 24 * 128), so every build may.
constexpr int8_t KVALUES_MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr int MXFP4_OFFSET = 12;

// 2^(e - 128) as ggml builds it (ggml-impl.h ggml_e8m0_to_fp32_half, gguf's MXFP4.e8m0_to_fp32_half): its float
// bits, e < 2 a subnormal (0x00200000 << e), else the exponent field e - 1; e = 255 is 2^127, never infinity or NaN.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// gguf's arithmetic: the scale times the table's value as a float (one rounding; inf past 2^128, as gguf's)
void dec_mxfp4(const uint8_t* b, float* out) {
  const float d = e8m0_half(b[0]);
  for (int j = 0; j < 16; j++) {
    out[j] = d * (float)KVALUES_MXFP4[b[1 + j] & 0x0F];
    out[j + 16] = d * (float)KVALUES_MXFP4[b[1 + j] >> 4];
  }
}

}  // namespace offspec
