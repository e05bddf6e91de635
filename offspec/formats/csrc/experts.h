// A mixture's routed experts in one call (offspec/formats/experts.py: QExperts): for each expert `ids[j]`, in
// ascending order, the rows of x routed to it (idx (T, k)) go through down(act(gate(x)) * up(x)) on qgemm, and each
// row adds its result times its routing weight (w (T, k)) to its output row, as transformers' loop and
// QExperts' torch path do: the product first, then the add, row by row, experts in ascending order. So a row's bits
// depend on that row alone (qgemm is row-invariant, the activation elementwise): a tree node equals the token
// decoded alone. What it saves is about 12 dispatched torch operations per routed expert, and two forks of the
// threads per expert: the experts are spread over the threads instead.
//
// gpt-oss's experts add a bias to each of their three products and gate with a clamped SwiGLU (`swiglu_oai`), whose
// sigmoid is softmax_exp's (attention.h): the same bits in every build and lane, where torch's vectorized sigmoid
// and its scalar tail may give one value two results.
//
// Included by ggml_cpu.cpp after `qgemm` and `qgemm_many`.

#pragma once

#include <algorithm>
#include <atomic>

namespace offspec {

// 1 / (1 + exp(-z)) from softmax_exp of a non-positive argument only (where it is exact to about 2 ulp)
inline float stable_sigmoid(float z) {
  if (z >= 0.0f) return 1.0f / (1.0f + softmax_exp(-z));
  const float e = softmax_exp(z);
  return e / (1.0f + e);
}

// In place on g (r, I): (clamp(u, -limit, limit) + 1) * x * sigmoid(alpha x), x = min(g, limit) (gpt-oss's
// experts: transformers' GptOssExperts._apply_gate, llama.cpp's swiglu_oai), value by value
inline void swiglu_oai(torch::Tensor& g, const torch::Tensor& u, float alpha, float limit) {
  TORCH_CHECK(g.is_contiguous() && u.sizes() == g.sizes(), "offspec: gate and up must be (r, I)");
  torch::Tensor uc = u.contiguous();
  float* gp = g.data_ptr<float>();
  const float* up = uc.data_ptr<float>();
  for (int64_t i = 0, n = g.numel(); i < n; i++) {
    const float x = std::min(gp[i], limit);
    const float y = std::min(std::max(up[i], -limit), limit);
    gp[i] = (y + 1.0f) * (x * stable_sigmoid(alpha * x));
  }
}

// x (T, H) float32; idx (T, k) long, w (T, k) float32; ids (n,) long ascending, the experts routed to; gates, ups,
// downs (n each): their weights as ggml block rows, `types` (3n: gate, up, down of each); activation: SILU,
// GELU_TANH or SWIGLU_OAI (with `alpha` and `limit`); biases: empty, or 3n (gate, up, down of each; gpt-oss).
// Returns (T, H) float32.
inline torch::Tensor experts_ffn(torch::Tensor x, torch::Tensor idx, torch::Tensor w, torch::Tensor ids,
                                 std::vector<torch::Tensor> gates, std::vector<torch::Tensor> ups,
                                 std::vector<torch::Tensor> downs, std::vector<int64_t> types, int64_t activation,
                                 std::vector<torch::Tensor> biases, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "offspec: experts take (T, H) float32 CPU rows");
  const int64_t n = ids.numel();
  TORCH_CHECK(gates.size() == (size_t)n && ups.size() == (size_t)n && downs.size() == (size_t)n &&
              types.size() == (size_t)(3 * n), "offspec: one gate, up and down (and 3 types) per routed expert");
  TORCH_CHECK(activation == SILU || activation == GELU_TANH || activation == SWIGLU_OAI,
              "offspec: unknown activation ", activation);
  TORCH_CHECK(biases.empty() || biases.size() == (size_t)(3 * n), "offspec: no biases, or 3 per routed expert");
  x = x.contiguous();
  idx = idx.to(torch::kLong).contiguous();
  w = w.to(torch::kFloat32).contiguous();
  ids = ids.to(torch::kLong).contiguous();
  const int64_t T = x.size(0), H = x.size(1), K = idx.size(1);
  TORCH_CHECK(idx.size(0) == T && w.sizes() == idx.sizes(), "offspec: idx and w must be (T, k)");
  auto out = torch::zeros_like(x);  // (T, H)
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<std::vector<int64_t>> rows(n);  // per routed expert: the tokens routed to it, in token order
  std::vector<std::vector<float>> weights(n);  // and their routing weights
  for (int64_t j = 0; j < n; j++) {
    const int64_t e = ids.data_ptr<int64_t>()[j];
    for (int64_t t = 0; t < T; t++)
      for (int64_t s = 0; s < K; s++)
        if (ip[t * K + s] == e) {
          rows[j].push_back(t);
          weights[j].push_back(wp[t * K + s]);
        }
  }
  // each expert's rows through its three products, one expert per thread at a time (its products then run on that
  // thread alone: a nested fork runs inline), so that a one-token pass forks once per layer, not three times per
  // expert; which thread computes an expert changes no bits
  std::vector<torch::Tensor> ys(n);  // (r_j, H) per routed expert
  auto run = [&](int64_t j) {
    if (rows[j].empty()) return;
    auto picked = torch::from_blob(rows[j].data(), {(int64_t)rows[j].size()}, torch::kLong);
    torch::Tensor xs = x.index_select(0, picked);  // (r, H)
    auto gu = qgemm_many(xs, {gates[j], ups[j]}, {types[3 * j], types[3 * j + 1]}, H);
    torch::Tensor g = gu[0];  // (r, I)
    if (!biases.empty()) {  // (r, I) + (I,): one rounding per value, as QLinear's add
      g += biases[3 * j];
      gu[1] += biases[3 * j + 1];
    }
    if (activation == SWIGLU_OAI) {
      swiglu_oai(g, gu[1], (float)alpha, (float)limit);
    } else if (activation == GELU_TANH) {
      at::gelu_(g, "tanh").mul_(gu[1]);
    } else {
      at::silu_(g).mul_(gu[1]);
    }
    ys[j] = qgemm(g, downs[j], types[3 * j + 2], g.size(1));  // (r, H)
    if (!biases.empty()) ys[j] += biases[3 * j + 2];
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t j = 0; j < n; j++) run(j);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < n;) run(j);
    });
  }
  for (int64_t j = 0; j < n; j++) {  // ascending experts, each row's product then its add, as the torch steps
    if (rows[j].empty()) continue;
    const float* dp = ys[j].data_ptr<float>();
    for (size_t r = 0; r < rows[j].size(); r++) {
      float* o = op + rows[j][r] * H;
      const float* y = dp + r * H;
      const float c = weights[j][r];
      for (int64_t h = 0; h < H; h++) {
        const float p = y[h] * c;  // rounded, then added (no fused multiply-add: -ffp-contract=off)
        o[h] = o[h] + p;
      }
    }
  }
  return out;
}

}  // namespace offspec
