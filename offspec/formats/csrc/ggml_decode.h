// Exact block decoders for the ggml formats: the float32 values of a row of blocks, computed with the same
// arithmetic as the gguf package's reference decoder (gguf/quants.py). Compiled with -ffp-contract=off.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace offspec {

enum GgmlType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

struct Layout { int64_t block; int64_t bytes; };

Layout layout_of(int64_t type) {
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case IQ4_NL: return {32, 18};
    case IQ4_XS: return {256, 136};
    case IQ2_XXS: return {256, 66};
    case IQ2_XS: return {256, 74};
    case IQ2_S: return {256, 82};
    case IQ3_XXS: return {256, 98};
    case IQ3_S: return {256, 110};
    case IQ1_S: return {256, 50};
    case IQ1_M: return {256, 56};
    case TQ1_0: return {256, 54};
    case TQ2_0: return {256, 66};
    case MXFP4: return {32, 17};
    default: TORCH_CHECK(false, "offspec: no CPU kernel for ggml type ", type);
  }
  return {0, 0};
}

inline float fp16_to_fp32(uint16_t h) {  // exact (every half is a float)
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      do { e++; mant <<= 1; } while ((mant & 0x400) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // the hardware conversion: exact too, subnormals included
#else
  return fp16_to_fp32(h);
#endif
}

// --- block decoders: out[0 .. block) from one block, arithmetic as in gguf/quants.py ------------------------

void dec_q4_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; j++) {
    out[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
    out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}

void dec_q4_1(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; j++) {
    out[j] = d * (float)(qs[j] & 0x0F) + m;
    out[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}

void dec_q5_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; j++) {
    int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
    int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
    out[j] = d * (float)(lo - 16);
    out[j + 16] = d * (float)(hi - 16);
  }
}

void dec_q5_1(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; j++) {
    int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
    int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
    out[j] = d * (float)lo + m;
    out[j + 16] = d * (float)hi + m;
  }
}

void dec_q8_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; j++) out[j] = (float)qs[j] * d;
}

void dec_q2_k(const uint8_t* b, float* out) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int h = 0; h < 2; h++) {
    for (int s = 0; s < 4; s++) {
      const int e0 = h * 128 + s * 32;
      for (int half = 0; half < 2; half++) {
        const uint8_t sc = scales[(e0 >> 4) + half];
        const float dl = d * (float)(sc & 0x0F), ml = dmin * (float)(sc >> 4);
        for (int l = half * 16; l < half * 16 + 16; l++) {
          out[e0 + l] = dl * (float)((qs[h * 32 + l] >> (2 * s)) & 3) - ml;
        }
      }
    }
  }
}

void dec_q3_k(const uint8_t* b, float* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half_at(b + 108);
  float dl[16];
  for (int i = 0; i < 16; i++) {
    int lo = i < 8 ? (sc[i] & 0x0F) : (sc[i - 8] >> 4);
    int hi = (sc[8 + (i % 4)] >> (2 * (i / 4))) & 3;
    dl[i] = d * (float)((int8_t)(lo | (hi << 4)) - 32);
  }
  for (int h = 0; h < 2; h++) {
    for (int s = 0; s < 4; s++) {
      const int e0 = h * 128 + s * 32;
      for (int l = 0; l < 32; l++) {
        const int e = e0 + l;
        int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
        int qh = ((hmask[e & 31] >> (e >> 5)) & 1) ^ 1;
        out[e] = dl[e >> 4] * (float)(ql - (qh << 2));
      }
    }
  }
}

inline void k_scale_min(const uint8_t* scales, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; j++) {
    sc[j] = scales[j] & 0x3F;
    mn[j] = scales[4 + j] & 0x3F;
    sc[j + 4] = (scales[8 + j] & 0x0F) | ((scales[j] >> 2) & 0x30);
    mn[j + 4] = (scales[8 + j] >> 4) | ((scales[4 + j] >> 2) & 0x30);
  }
}

void dec_q4_k(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  uint8_t sc[8], mn[8];
  k_scale_min(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; c++) {
    for (int s = 0; s < 2; s++) {
      const int sub = 2 * c + s;
      const float ds = d * (float)sc[sub], dm = dmin * (float)mn[sub];
      for (int l = 0; l < 32; l++) out[sub * 32 + l] = ds * (float)((qs[c * 32 + l] >> (4 * s)) & 0x0F) - dm;
    }
  }
}

void dec_q5_k(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  uint8_t sc[8], mn[8];
  k_scale_min(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int c = 0; c < 4; c++) {
    for (int s = 0; s < 2; s++) {
      const int sub = 2 * c + s;
      const float ds = d * (float)sc[sub], dm = dmin * (float)mn[sub];
      for (int l = 0; l < 32; l++) {
        int q = ((qs[c * 32 + l] >> (4 * s)) & 0x0F) | (((qh[l] >> sub) & 1) << 4);
        out[sub * 32 + l] = ds * (float)q - dm;
      }
    }
  }
}

void dec_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; h++) {
    for (int s = 0; s < 4; s++) {  // element e = h*128 + s*32 + l: low nibble from ql, 2 high bits from qh
      const int e0 = h * 128 + s * 32;
      const float ds0 = d * (float)scales[e0 >> 4], ds1 = d * (float)scales[(e0 >> 4) + 1];
      for (int l = 0; l < 32; l++) {
        const int e = e0 + l;
        const int lo = (ql[h * 64 + (e0 % 64) + l] >> (4 * (s / 2))) & 0x0F;
        const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
        out[e] = (l < 16 ? ds0 : ds1) * (float)((lo | (hi << 4)) - 32);
      }
    }
  }
}

}  // namespace offspec

#include "ggml_decode_iq.h"  // the IQ and TQ types' decoders (they use half_at above)
#include "ggml_decode_mxfp4.h"  // MXFP4's table, exponent and decoder

namespace offspec {

// One whole row of K elements.
void decode_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  switch (type) {
    case F32: std::memcpy(out, row, K * 4); return;
    case F16: for (int64_t k = 0; k < K; k++) out[k] = half_at(row + 2 * k); return;
    case BF16:
      for (int64_t k = 0; k < K; k++) {
        uint32_t bits = (uint32_t)row[2 * k] << 16 | (uint32_t)row[2 * k + 1] << 24;
        std::memcpy(out + k, &bits, 4);
      }
      return;
    default: break;
  }
  const Layout lay = layout_of(type);
  void (*dec)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case Q4_0: dec = dec_q4_0; break;
    case Q4_1: dec = dec_q4_1; break;
    case Q5_0: dec = dec_q5_0; break;
    case Q5_1: dec = dec_q5_1; break;
    case Q8_0: dec = dec_q8_0; break;
    case Q2_K: dec = dec_q2_k; break;
    case Q3_K: dec = dec_q3_k; break;
    case Q4_K: dec = dec_q4_k; break;
    case Q5_K: dec = dec_q5_k; break;
    case Q6_K: dec = dec_q6_k; break;
    case IQ4_NL: dec = dec_iq4_nl; break;
    case IQ4_XS: dec = dec_iq4_xs; break;
    case IQ2_XXS: dec = dec_iq2_xxs; break;
    case IQ2_XS: dec = dec_iq2_xs; break;
    case IQ2_S: dec = dec_iq2_s; break;
    case IQ3_XXS: dec = dec_iq3_xxs; break;
    case IQ3_S: dec = dec_iq3_s; break;
    case IQ1_S: dec = dec_iq1_s; break;
    case IQ1_M: dec = dec_iq1_m; break;
    case TQ1_0: dec = dec_tq1_0; break;
    case TQ2_0: dec = dec_tq2_0; break;
    case MXFP4: dec = dec_mxfp4; break;
    default: TORCH_CHECK(false, "offspec: no CPU kernel for ggml type ", type);
  }
  for (int64_t i = 0, n = K / lay.block; i < n; i++) dec(row + i * lay.bytes, out + i * lay.block);
}

}  // namespace offspec
