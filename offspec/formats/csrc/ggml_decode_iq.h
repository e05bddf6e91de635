// Exact block decoders for the IQ types (IQ4_NL, IQ4_XS, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the
// ternary TQ1_0 / TQ2_0: the float32 values of one block, computed with the arithmetic of the gguf package's reference
// decoder (gguf/quants.py), operation for operation (compiled with -ffp-contract=off: no fused multiply-adds).
// Included by ggml_decode.h (which defines the type ids and half_at).
//
// The lattice grids of the IQ1/IQ2/IQ3 types are the gguf package's own tables, handed over once at load by
// kernels.py (set_grid): a decoder of a type whose grid is missing refuses to run. kvalues (IQ4_NL, IQ4_XS) and the
// sign patterns (ksigns: 7 bits, the 8th their parity) are defined here.
#pragma once

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace offspec {

constexpr int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline uint8_t ksigns(uint32_t i) { return (uint8_t)(i | (uint32_t)(__builtin_popcount(i) & 1) << 7); }

// The lattice grids by ggml type id: entries of 8 (IQ1, IQ2) or 4 (IQ3) small integers, row after row.
inline std::array<std::vector<int8_t>, 64>& grids() {
  static std::array<std::vector<int8_t>, 64> g;
  return g;
}

inline int grid_width(int64_t type) { return type == IQ3_XXS || type == IQ3_S ? 4 : 8; }

inline int64_t grid_entries(int64_t type) {
  switch (type) {
    case IQ2_XXS: return 256;
    case IQ2_XS: return 512;
    case IQ2_S: return 1024;
    case IQ3_XXS: return 256;
    case IQ3_S: return 512;
    case IQ1_S: case IQ1_M: return 2048;
    default: return 0;
  }
}

// The IQ2 grids (IQ2_XXS, IQ2_XS, IQ2_S: values 8, 25 and 43 only) as one 16-bit code per entry, value k's level
// (0, 1, 2) at bits 8 * (k % 2) + 2 * (k / 2): the even values in the low byte, the odd ones in the high byte, as
// ggml_dot_iq2.h's AVX-512 kernels look them up (64 entries per word permute) and expand them.
inline std::array<std::vector<uint16_t>, 64>& grid_codes() {
  static std::array<std::vector<uint16_t>, 64> g;
  return g;
}

inline std::vector<uint16_t> level_codes(int64_t type, const int8_t* grid, int64_t entries) {
  std::vector<uint16_t> codes(entries);
  for (int64_t e = 0; e < entries; e++)
    for (int k = 0; k < 8; k++) {
      const int8_t v = grid[8 * e + k];
      TORCH_CHECK(v == 8 || v == 25 || v == 43, "offspec: the grid of ggml type ", type, " has a value ", (int)v,
                  " (8, 25 or 43 expected)");
      codes[e] |= (uint16_t)((v == 8 ? 0 : v == 25 ? 1 : 2) << (8 * (k % 2) + 2 * (k / 2)));
    }
  return codes;
}

// Set the grid of `type` from a (entries, width) int8 tensor (kernels.py, at load).
inline void set_grid(int64_t type, torch::Tensor values) {
  TORCH_CHECK(type >= 0 && type < 64 && grid_entries(type) > 0, "offspec: ggml type ", type, " has no grid");
  values = values.contiguous();
  TORCH_CHECK(values.scalar_type() == torch::kInt8 && values.dim() == 2 && values.size(0) == grid_entries(type) &&
              values.size(1) == grid_width(type), "offspec: the grid of ggml type ", type, " has the wrong shape");
  const int8_t* p = values.data_ptr<int8_t>();
  if (type == IQ2_XXS || type == IQ2_XS || type == IQ2_S) grid_codes()[type] = level_codes(type, p, values.size(0));
  grids()[type].assign(p, p + values.numel());
}

inline const int8_t* grid_of(int64_t type) {
  const std::vector<int8_t>& g = grids()[type];
  TORCH_CHECK(!g.empty(), "offspec: the grid of ggml type ", type, " was not loaded (kernels.py sets it)");
  return g.data();
}

inline const uint16_t* codes_of(int64_t type) {
  const std::vector<uint16_t>& c = grid_codes()[type];
  TORCH_CHECK(!c.empty(), "offspec: the grid of ggml type ", type, " was not loaded (kernels.py sets it)");
  return c.data();
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// --- 4-bit non-linear ------------------------------------------------------------------------------------------

void dec_iq4_nl(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int j = 0; j < 16; j++) {
    out[j] = d * (float)KVALUES_IQ4NL[b[2 + j] & 0x0F];
    out[j + 16] = d * (float)KVALUES_IQ4NL[b[2 + j] >> 4];
  }
}

// the 6-bit scale of IQ4_XS sub-block ib, as stored (0..63; the value is scale - 32)
inline int iq4xs_scale(const uint8_t* b, int ib) {
  const int lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
  const int hi = (u16_at(b + 2) >> (2 * ib)) & 3;
  return lo | (hi << 4);
}

void dec_iq4_xs(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int ib = 0; ib < 8; ib++) {
    const float dl = d * (float)(iq4xs_scale(b, ib) - 32);
    const uint8_t* qs = b + 8 + 16 * ib;
    for (int j = 0; j < 16; j++) {
      out[32 * ib + j] = dl * (float)KVALUES_IQ4NL[qs[j] & 0x0F];
      out[32 * ib + j + 16] = dl * (float)KVALUES_IQ4NL[qs[j] >> 4];
    }
  }
}

// --- lattice types: 8 (or 4) values of a grid entry, each times db, negated where its sign bit is set ------------

inline void grid_signed(const int8_t* entry, int width, uint8_t signs, float db, float* out) {
  for (int k = 0; k < width; k++) {
    const float v = db * (float)entry[k];
    out[k] = (signs >> k) & 1 ? -v : v;
  }
}

void dec_iq2_xxs(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ2_XXS);
  const float d = half_at(b);
  for (int g = 0; g < 8; g++) {  // 32 values: 4 grid indices, then 4 x 7 sign bits and a 4-bit scale
    const uint8_t* q = b + 2 + 8 * g;
    const uint32_t aux = u32_at(q + 4);
    const float db = (d * (0.5f + (float)(aux >> 28))) * 0.25f;
    for (int k = 0; k < 4; k++)
      grid_signed(grid + 8 * q[k], 8, ksigns((aux >> (7 * k)) & 0x7F), db, out + 32 * g + 8 * k);
  }
}

void dec_iq2_xs(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ2_XS);
  const float d = half_at(b);
  for (int i = 0; i < 32; i++) {  // 8 values per 16-bit word: a 9-bit grid index, a 7-bit sign index
    const uint16_t q = u16_at(b + 2 + 2 * i);
    const int sc = (b[66 + i / 4] >> (4 * ((i / 2) % 2))) & 0x0F;  // a scale per 16 values
    const float db = (d * (0.5f + (float)sc)) * 0.25f;
    grid_signed(grid + 8 * (q & 511), 8, ksigns(q >> 9), db, out + 8 * i);
  }
}

void dec_iq2_s(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ2_S);
  const float d = half_at(b);
  const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
  for (int i = 0; i < 32; i++) {
    const int index = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
    const int sc = (scales[i / 4] >> (4 * ((i / 2) % 2))) & 0x0F;
    const float db = (d * (0.5f + (float)sc)) * 0.25f;
    grid_signed(grid + 8 * index, 8, signs[i], db, out + 8 * i);
  }
}

void dec_iq3_xxs(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ3_XXS);
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int g = 0; g < 8; g++) {  // 32 values: 8 grid indices of 4 values, 4 x 7 sign bits and a scale
    const uint32_t aux = u32_at(b + 66 + 4 * g);
    const float db = (d * (0.5f + (float)(aux >> 28))) * 0.5f;
    for (int k = 0; k < 4; k++) {
      const uint8_t s = ksigns((aux >> (7 * k)) & 0x7F);
      grid_signed(grid + 4 * qs[8 * g + 2 * k], 4, s, db, out + 32 * g + 8 * k);
      grid_signed(grid + 4 * qs[8 * g + 2 * k + 1], 4, s >> 4, db, out + 32 * g + 8 * k + 4);
    }
  }
}

void dec_iq3_s(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ3_S);
  const float d = half_at(b);
  const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
  for (int g = 0; g < 8; g++) {  // 32 values, one scale
    const float db = d * (float)(1 + 2 * ((scales[g / 2] >> (4 * (g % 2))) & 0x0F));
    for (int k = 0; k < 8; k++) {
      const int i = 8 * g + k;  // grid entry i: values 4i .. 4i+3
      const int index = qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8);
      grid_signed(grid + 4 * index, 4, signs[i / 2] >> (4 * (i % 2)), db, out + 4 * i);
    }
  }
}

// IQ1_S / IQ1_M: dl * (grid value + delta), delta = +-1/8
inline void grid_delta(const int8_t* entry, float delta, float dl, float* out) {
  for (int k = 0; k < 8; k++) out[k] = dl * ((float)entry[k] + delta);
}

void dec_iq1_s(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ1_S);
  const float d = half_at(b);
  for (int g = 0; g < 8; g++) {  // 32 values: 4 grid entries, one 16-bit word of high index bits, scale and delta sign
    const uint16_t qh = u16_at(b + 34 + 2 * g);
    const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
    const float delta = qh & 0x8000 ? -0.125f : 0.125f;
    for (int k = 0; k < 4; k++) {
      const int index = b[2 + 4 * g + k] | (((qh >> (3 * k)) & 7) << 8);
      grid_delta(grid + 8 * index, delta, dl, out + 32 * g + 8 * k);
    }
  }
}

void dec_iq1_m(const uint8_t* b, float* out) {
  const int8_t* grid = grid_of(IQ1_M);
  const uint8_t *qs = b, *qh = b + 32, *sc = b + 48;
  uint16_t s[4];
  std::memcpy(s, sc, 8);
  // d's 16 bits are the top nibbles of the 4 scale words
  const uint16_t dbits = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00) | (s[3] & 0xF000));
  uint8_t dh[2];
  std::memcpy(dh, &dbits, 2);
  const float d = half_at(dh);
  for (int i = 0; i < 32; i++) {  // grid entry i: values 8i .. 8i+7
    const int nib = (qh[i / 2] >> (4 * (i % 2))) & 0x0F;
    const int index = qs[i] | ((nib & 7) << 8);
    const int scale = (s[i / 8] >> (3 * ((i / 2) % 4))) & 7;  // one per 16 values
    const float dl = d * (float)(2 * scale + 1);
    grid_delta(grid + 8 * index, nib & 8 ? -0.125f : 0.125f, dl, out + 8 * i);
  }
}

// --- ternary -----------------------------------------------------------------------------------------------------

inline int tq1_digit(uint8_t q, int pow3) {  // the base-3 digit that q * 3^k (mod 256) leads with
  const uint8_t v = (uint8_t)(q * pow3);
  return ((int)v * 3 >> 8) - 1;
}

void dec_tq1_0(const uint8_t* b, float* out) {
  const float d = half_at(b + 52);
  static constexpr int POW3[5] = {1, 3, 9, 27, 81};
  for (int k = 0; k < 5; k++)
    for (int l = 0; l < 32; l++) out[32 * k + l] = d * (float)tq1_digit(b[l], POW3[k]);
  for (int k = 0; k < 5; k++)
    for (int l = 0; l < 16; l++) out[160 + 16 * k + l] = d * (float)tq1_digit(b[32 + l], POW3[k]);
  for (int k = 0; k < 4; k++)
    for (int l = 0; l < 4; l++) out[240 + 4 * k + l] = d * (float)tq1_digit(b[48 + l], POW3[k]);
}

void dec_tq2_0(const uint8_t* b, float* out) {
  const float d = half_at(b + 64);
  for (int j = 0; j < 2; j++)
    for (int s = 0; s < 4; s++)
      for (int l = 0; l < 32; l++) out[128 * j + 32 * s + l] = d * (float)(((b[32 * j + l] >> (2 * s)) & 3) - 1);
}

}  // namespace offspec
