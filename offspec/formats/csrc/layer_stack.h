// A model's decoder layers with their weights and shapes bound once, run in one call (offspec/formats/layers.py's
// resident fast path): the ~50 us per layer that transformers' model loop, the module calls and the argument lists
// cost in Python (2-3 ms of a 28-layer pass on a CPU) become one call per pass. Each layer is decoder_layer
// (layer.h), so the results are the same bits as calling it per layer.
//
// Included by ggml_cpu.cpp after layer.h.
#pragma once

#include <optional>
#include <vector>

namespace offspec {

class LayerStack {
 public:
  // Append a layer (decoder_layer's arguments that do not change from pass to pass); `window`: which of
  // `forward`'s visibility masks it takes.
  void add(std::vector<std::optional<torch::Tensor>> weights, std::vector<int64_t> types,
           std::vector<std::optional<torch::Tensor>> biases, std::vector<std::optional<torch::Tensor>> norms,
           double eps, double norm_offset, int64_t H, int64_t Hkv, int64_t D, double scale, double softcap,
           int64_t activation, int64_t window) {
    layers_.push_back({std::move(weights), std::move(types), std::move(biases), std::move(norms), eps, norm_offset, H,
                       Hkv, D, scale, softcap, activation, window});
  }

  // h (M, E) through every layer; k_caches, v_caches: one buffer pair per layer; visibles: the (M, kv_len) masks
  // the layers' `window` indices pick.
  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        torch::Tensor slots, int64_t kv_len, const std::vector<torch::Tensor>& visibles) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "offspec: one key and one value buffer per layer");
    for (size_t i = 0; i < layers_.size(); i++) {
      const Layer& L = layers_[i];
      TORCH_CHECK(L.window >= 0 && L.window < (int64_t)visibles.size(), "offspec: a layer's mask is missing");
      h = decoder_layer(h, L.weights, L.types, L.biases, L.norms, L.eps, L.norm_offset, cos, sin, k_caches[i],
                        v_caches[i], slots, kv_len, visibles[L.window], L.H, L.Hkv, L.D, L.scale, L.softcap,
                        L.activation);
    }
    return h;
  }

 private:
  struct Layer {
    std::vector<std::optional<torch::Tensor>> weights;
    std::vector<int64_t> types;
    std::vector<std::optional<torch::Tensor>> biases, norms;
    double eps, norm_offset;
    int64_t H, Hkv, D;
    double scale, softcap;
    int64_t activation, window;
  };
  std::vector<Layer> layers_;
};

}  // namespace offspec
