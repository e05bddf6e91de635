// One decoder layer of the llama family (Llama, Qwen2, Mistral) in one call: RMSNorm, q/k/v projections (with
// their biases where the model has them), rotary embedding, the cache write, exact attention (attention.h), the
// output projection, RMSNorm, the SiLU-gated MLP, and both residual adds. It computes what transformers' layer
// computes (a norm's sum of squares is taken in order here, so its last bit may differ); what it saves is the ~150
// dispatched torch operations and ~14 module calls per layer that cost 0.4-0.7 ms in Python on a CPU: a third of a
// 0.5B draft's step.
//
// Included by ggml_cpu.cpp after `qgemm`. Every step computes a row from that row alone (the norms, the rotary
// embedding and the activation per row; the projections are qgemm's row-invariant products; attention per query),
// so a one-token pass and a tree pass give bitwise identical rows here too.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <vector>

torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t type, int64_t K);  // ggml_cpu.cpp

namespace offspec {
namespace layer {

// y = weight * (x / sqrt(mean(x^2) + eps)) per row, in float32 as transformers' RMSNorm (the mean summed in order)
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, float eps) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty_like(x);  // (M, K) float32
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float* r = xp + m * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += r[k] * r[k];
    const float inv = 1.0f / std::sqrt(sum / (float)K + eps);
    for (int64_t k = 0; k < K; k++) yp[m * K + k] = wp[k] * (r[k] * inv);
  }
  return y;
}

// In place on t (M, heads * D): x * cos + rotate_half(x) * sin per head, cos and sin (M, D) per row
inline void rotate(torch::Tensor& t, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t M = t.size(0), half = D / 2;
  float* p = t.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float* c = cos + m * D;
    const float* s = sin + m * D;
    for (int64_t h = 0; h < heads; h++) {
      float* x = p + (m * heads + h) * D;
      for (int64_t j = 0; j < half; j++) {
        const float a = x[j], b = x[j + half];
        x[j] = a * c[j] + (-b) * s[j];
        x[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  }
}

inline void add_bias(torch::Tensor& y, const std::optional<torch::Tensor>& bias) {
  if (bias.has_value()) y += *bias;  // (M, N) + (N,): the add QLinear does
}

}  // namespace layer

// h (M, E) float32 hidden states in; returns h after the layer. weights: the q, k, v, o, gate, up and down
// projections as ggml block rows (their types in `types`); biases: q, k, v (or None); norms: the two RMSNorm
// weights (E,); cos, sin (M, D); k_cache, v_cache (1, Hkv, capacity, D) buffers whose slots `slots` (M,) the
// new keys and values are written to; attention over slots [0, kv_len) as `visible` (M, kv_len) bool allows.
inline torch::Tensor decoder_layer(torch::Tensor h, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                                   std::vector<std::optional<torch::Tensor>> biases, torch::Tensor norm1,
                                   torch::Tensor norm2, double eps, torch::Tensor cos, torch::Tensor sin,
                                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t kv_len,
                                   torch::Tensor visible, int64_t H, int64_t Hkv, double scale) {
  TORCH_CHECK(weights.size() == 7 && types.size() == 7 && biases.size() == 3, "offspec: a layer takes 7 weights");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32 && h.is_contiguous(), "offspec: h must be (M, E)");
  const int64_t M = h.size(0), D = cos.size(1), cap = k_cache.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == M && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "offspec: cos and sin must be (M, D) float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4 && k_cache.size(1) == Hkv && k_cache.size(3) == D &&
              k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "offspec: the cache buffers must be (1, Hkv, capacity, D) float32");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == M && kv_len <= cap && H % Hkv == 0,
              "offspec: slots (M,) long within the cache");
  visible = visible.to(torch::kBool).contiguous();
  slots = slots.contiguous();
  TORCH_CHECK(visible.size(0) == M && visible.size(1) == kv_len, "offspec: visible must be (M, kv_len)");
  const float fe = (float)eps;

  // attention
  torch::Tensor x = layer::rms_norm(h, norm1, fe);
  torch::Tensor q = ::qgemm(x, weights[0], types[0], x.size(1));  // (M, H * D)
  torch::Tensor k = ::qgemm(x, weights[1], types[1], x.size(1));  // (M, Hkv * D)
  torch::Tensor v = ::qgemm(x, weights[2], types[2], x.size(1));  // (M, Hkv * D)
  layer::add_bias(q, biases[0]);
  layer::add_bias(k, biases[1]);
  layer::add_bias(v, biases[2]);
  TORCH_CHECK(q.size(1) == H * D && k.size(1) == Hkv * D && v.size(1) == Hkv * D, "offspec: head shapes disagree");
  layer::rotate(q, H, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  layer::rotate(k, Hkv, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    TORCH_CHECK(sp[m] >= 0 && sp[m] < cap, "offspec: slot ", sp[m], " outside the cache");
    for (int64_t g = 0; g < Hkv; g++) {
      std::copy_n(k.data_ptr<float>() + (m * Hkv + g) * D, D, kc + (g * cap + sp[m]) * D);
      std::copy_n(v.data_ptr<float>() + (m * Hkv + g) * D, D, vc + (g * cap + sp[m]) * D);
    }
  }
  torch::Tensor qh = q.view({M, H, D}).transpose(0, 1).contiguous();  // (H, M, D) as attend takes queries
  auto att = torch::empty({M, H * D}, h.options());                    // (M, H, D) as attend writes them
  attend(qh.data_ptr<float>(), kc, vc, visible.data_ptr<bool>(), att.data_ptr<float>(), H, Hkv, M, kv_len, D,
         cap * D, (float)scale);
  torch::Tensor out = h + ::qgemm(att, weights[3], types[3], att.size(1));  // (M, E)

  // MLP: down(silu(gate(x)) * up(x))
  x = layer::rms_norm(out, norm2, fe);
  torch::Tensor g = ::qgemm(x, weights[4], types[4], x.size(1));  // (M, I)
  torch::Tensor u = ::qgemm(x, weights[5], types[5], x.size(1));  // (M, I)
  // torch's vectorized elementwise kernels, as transformers' MLP runs them (a scalar std::exp per value cost a
  // 150-token prefill half a second): each value is computed from itself alone, so rows stay independent
  at::silu_(g).mul_(u);
  out += ::qgemm(g, weights[6], types[6], g.size(1));
  return out;
}

}  // namespace offspec
