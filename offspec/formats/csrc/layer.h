// One decoder layer in one call, for the families whose layers are a pre-norm attention block and a gated MLP: llama
// (Llama, Mistral, SmolLM2), qwen2, qwen3, gemma2, gemma3 and phi3, and the attention block of a mixture of experts
// (qwen3moe, qwen2moe, Mixtral, gpt-oss). In order: RMSNorm, the q/k/v projections (fused into one where the model has
// them fused, phi3; with their biases where it has them, qwen2, gpt-oss), per-head q/k RMSNorms (qwen3, gemma3), the
// rotary embedding (of the first `cos.size(1)` dims of each head: phi3's partial rotary), the cache write, exact
// attention (attention.h; with logit soft-capping, gemma2; with attention sinks, gpt-oss), the output projection (with
// its bias, gpt-oss), a post-attention RMSNorm (gemma's sandwich), the residual add, RMSNorm, the gated MLP (SiLU or
// tanh-GELU; gate and up fused where the model has them fused), a post-MLP RMSNorm (gemma), the residual add. Gemma's
// norms scale by (1 + w) rather than w: `norm_offset` is 1 there, 0 elsewhere. It computes what transformers' layer
// computes (a norm's sum of squares is taken in order here, so its last bit may differ); what it saves is the ~150
// dispatched torch operations and ~14 module calls per layer that cost 0.4-0.7 ms in Python on a CPU: a third of a 0.5B
// draft's step.
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
std::vector<torch::Tensor> qgemm_many(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                      int64_t K);  // ggml_cpu.cpp

namespace offspec {
namespace layer {

// y = (weight + offset) * (x / sqrt(mean(x^2) + eps)) per row of x (M, K), in float32 as transformers' RMSNorm
// (the mean summed in order); offset 0 (llama's norms) or 1 (gemma's, which store w for a scale of 1 + w)
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, float eps, float offset) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.numel() == K && weight.is_contiguous() && weight.scalar_type() == torch::kFloat32,
              "offspec: a norm weight must be (", K, ",) float32");
  auto y = torch::empty_like(x);  // (M, K) float32
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float* r = xp + m * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += r[k] * r[k];
    const float inv = 1.0f / std::sqrt(sum / (float)K + eps);
    for (int64_t k = 0; k < K; k++) yp[m * K + k] = (wp[k] + offset) * (r[k] * inv);
  }
  return y;
}

// The RMSNorm of each head of t (M, heads * D) over its D values (qwen3's and gemma3's q/k norms)
inline torch::Tensor head_norm(const torch::Tensor& t, int64_t heads, int64_t D, const torch::Tensor& weight,
                               float eps, float offset) {
  return rms_norm(t.view({t.size(0) * heads, D}), weight, eps, offset).view({t.size(0), heads * D});
}

// In place on t (M, heads * D): the first R dims of each head become x * cos + rotate_half(x) * sin, cos and sin
// (M, R) per row; dims R..D pass unchanged (partial rotary; R == D for most models)
inline void rotate(torch::Tensor& t, int64_t heads, int64_t D, int64_t R, const float* cos, const float* sin) {
  const int64_t M = t.size(0), half = R / 2;
  float* p = t.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float* c = cos + m * R;
    const float* s = sin + m * R;
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

inline torch::Tensor project(const torch::Tensor& x, const std::optional<torch::Tensor>& w, int64_t type) {
  TORCH_CHECK(w.has_value(), "offspec: a projection weight is missing");
  return ::qgemm(x, *w, type, x.size(1));
}

// The projections of one input by the weights `which` of a layer's (q, k, v; gate, up): its activations quantized
// once where the weights' kernels take them alike, and one fork for all (qgemm_many)
inline std::vector<torch::Tensor> project_many(const torch::Tensor& x,
                                               const std::vector<std::optional<torch::Tensor>>& weights,
                                               const std::vector<int64_t>& types, std::initializer_list<int> which) {
  std::vector<torch::Tensor> ws;
  std::vector<int64_t> ts;
  for (int i : which) {
    TORCH_CHECK(weights[i].has_value(), "offspec: a projection weight is missing");
    ws.push_back(*weights[i]);
    ts.push_back(types[i]);
  }
  return ::qgemm_many(x, ws, ts, x.size(1));
}

}  // namespace layer

enum Activation : int64_t { SILU = 0, GELU_TANH = 1, SWIGLU_OAI = 2 };  // SWIGLU_OAI: gpt-oss's experts only

// h (M, E) float32 hidden states in; returns h after the layer.
// weights (7): q, k, v, o, gate, up, down as ggml block rows (their types in `types`); where the model fuses them,
//   q holds q|k|v stacked (k and v None) and gate holds gate|up stacked (up None); gate, up and down all None: the
//   attention block alone, h after its residual add (a mixture of experts, whose sparse block runs apart);
// biases (4): q, k, v, o (or None); norms (6): input, post-attention (or None), pre-MLP, post-MLP (or None), q and k
//   per-head norms (or None); cos, sin (M, R) with R <= D; k_cache, v_cache (1, Hkv, capacity, D) buffers whose
//   slots `slots` (M,) the new keys and values are written to; attention over slots [0, kv_len) as `visible`
//   (M, kv_len) bool allows, its logits soft-capped at `softcap` (0: not); sinks (H,) float32 or None: gpt-oss's
//   attention sinks.
inline torch::Tensor decoder_layer(torch::Tensor h, std::vector<std::optional<torch::Tensor>> weights,
                                   std::vector<int64_t> types, std::vector<std::optional<torch::Tensor>> biases,
                                   std::vector<std::optional<torch::Tensor>> norms, double eps, double norm_offset,
                                   torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor slots, int64_t kv_len, torch::Tensor visible, int64_t H, int64_t Hkv,
                                   int64_t D, double scale, double softcap, int64_t activation,
                                   std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(weights.size() == 7 && types.size() == 7 && biases.size() == 4 && norms.size() == 6,
              "offspec: a layer takes 7 weights, 4 biases and 6 norms");
  TORCH_CHECK(!sinks.has_value() || (sinks->numel() == H && sinks->is_contiguous() &&
                                     sinks->scalar_type() == torch::kFloat32),
              "offspec: attention sinks must be (H,) float32");
  TORCH_CHECK(norms[0].has_value() && norms[2].has_value(), "offspec: a layer needs its two pre-norms");
  TORCH_CHECK(activation == SILU || activation == GELU_TANH, "offspec: unknown activation ", activation);
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32 && h.is_contiguous(), "offspec: h must be (M, E)");
  const int64_t M = h.size(0), R = cos.size(1), cap = k_cache.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == M && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && R <= D && R % 2 == 0,
              "offspec: cos and sin must be (M, R) float32, R <= D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4 && k_cache.size(1) == Hkv && k_cache.size(3) == D &&
              k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "offspec: the cache buffers must be (1, Hkv, capacity, D) float32");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == M && kv_len <= cap && H % Hkv == 0,
              "offspec: slots (M,) long within the cache");
  visible = visible.to(torch::kBool).contiguous();
  slots = slots.contiguous();
  TORCH_CHECK(visible.size(0) == M && visible.size(1) == kv_len, "offspec: visible must be (M, kv_len)");
  const float fe = (float)eps, off = (float)norm_offset;

  // attention
  torch::Tensor x = layer::rms_norm(h, *norms[0], fe, off);
  torch::Tensor q, k, v;
  if (!weights[1].has_value()) {  // fused q|k|v rows (phi3)
    torch::Tensor qkv = layer::project(x, weights[0], types[0]);  // (M, (H + 2 Hkv) * D)
    TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "offspec: fused qkv rows disagree with the head shapes");
    q = qkv.slice(1, 0, H * D).contiguous();
    k = qkv.slice(1, H * D, (H + Hkv) * D).contiguous();
    v = qkv.slice(1, (H + Hkv) * D, (H + 2 * Hkv) * D).contiguous();
  } else {
    auto qkv = layer::project_many(x, weights, types, {0, 1, 2});
    q = qkv[0];  // (M, H * D)
    k = qkv[1];  // (M, Hkv * D)
    v = qkv[2];  // (M, Hkv * D)
  }
  layer::add_bias(q, biases[0]);
  layer::add_bias(k, biases[1]);
  layer::add_bias(v, biases[2]);
  TORCH_CHECK(q.size(1) == H * D && k.size(1) == Hkv * D && v.size(1) == Hkv * D, "offspec: head shapes disagree");
  if (norms[4].has_value()) q = layer::head_norm(q, H, D, *norms[4], fe, off);
  if (norms[5].has_value()) k = layer::head_norm(k, Hkv, D, *norms[5], fe, off);
  layer::rotate(q, H, D, R, cos.data_ptr<float>(), sin.data_ptr<float>());
  layer::rotate(k, Hkv, D, R, cos.data_ptr<float>(), sin.data_ptr<float>());
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
         cap * D, (float)scale, (float)softcap, sinks.has_value() ? sinks->data_ptr<float>() : nullptr);
  torch::Tensor a = layer::project(att, weights[3], types[3]);  // (M, E)
  layer::add_bias(a, biases[3]);
  if (norms[1].has_value()) a = layer::rms_norm(a, *norms[1], fe, off);
  torch::Tensor out = h + a;  // (M, E)
  if (!weights[4].has_value() && !weights[6].has_value()) return out;  // no MLP: a mixture's experts run apart

  // MLP: down(act(gate(x)) * up(x))
  x = layer::rms_norm(out, *norms[2], fe, off);
  torch::Tensor g, u;
  if (!weights[5].has_value()) {  // fused gate|up rows (phi3)
    torch::Tensor gu = layer::project(x, weights[4], types[4]);  // (M, 2 I)
    const int64_t I = gu.size(1) / 2;
    g = gu.slice(1, 0, I).contiguous();
    u = gu.slice(1, I, 2 * I);
  } else {
    auto gu = layer::project_many(x, weights, types, {4, 5});
    g = gu[0];  // (M, I)
    u = gu[1];  // (M, I)
  }
  // torch's vectorized elementwise kernels, as transformers' MLP runs them (a scalar std::exp per value cost a
  // 150-token prefill half a second): each value is computed from itself alone, so rows stay independent
  if (activation == GELU_TANH) {
    at::gelu_(g, "tanh").mul_(u);
  } else {
    at::silu_(g).mul_(u);
  }
  torch::Tensor d = layer::project(g, weights[6], types[6]);  // (M, E)
  if (norms[3].has_value()) d = layer::rms_norm(d, *norms[3], fe, off);
  out += d;
  return out;
}

}  // namespace offspec
