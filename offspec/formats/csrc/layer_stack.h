// A model's decoder layers with their weights and shapes bound once, run in one call (offspec/formats/layers.py's
// resident fast path): the ~50 us per layer that transformers' model loop, the module calls and the argument lists
// cost in Python (2-3 ms of a 28-layer pass on a CPU) become one call per pass. Each layer is decoder_layer
// (layer.h), so the results are the same bits as calling it per layer.
//
// With its body bound (`set_body`: the token embedding's ggml rows and the final RMSNorm), `run` goes from token ids to
// the final hidden states in that one call; `watch` / `unchanged` check in one call that nothing it holds was bound
// anew since (a pass's check: tens of microseconds here, about 0.3 ms in Python after a pass has left the caches).
//
// Included by ggml_cpu.cpp after layer.h.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K);  // ggml_cpu.cpp

namespace offspec {

// layer.h's RMSNorm of each row of x (M, K) float32: the final norm of a model whose layers run here (layer_stack.py's
// `install_final_norm` gives the model's own norm this forward, so that its layers one by one and `LayerStack::run`
// agree to the bit)
inline torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps, double norm_offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "offspec: rms_norm takes (M, K) float32 rows on the CPU");
  return layer::rms_norm(x.contiguous(), weight, (float)eps, (float)norm_offset);
}

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
                        L.activation, std::nullopt);
    }
    return h;
  }

  // The body around the layers: `embed` (vocab, row_bytes) the token embedding's ggml rows of `embed_type` (decoded
  // exactly, as the embedding module decodes them), `final_norm` (E,) the model's last RMSNorm.
  void set_body(torch::Tensor embed, int64_t embed_type, torch::Tensor final_norm, double eps, double norm_offset) {
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == torch::kUInt8 && final_norm.dim() == 1,
                "offspec: the embedding must be (vocab, row_bytes) uint8 and the final norm (E,)");
    embed_ = embed;
    embed_type_ = embed_type;
    final_norm_ = final_norm;
    final_eps_ = eps;
    final_offset_ = norm_offset;
  }

  // The (M, E) final hidden states of token ids (M,) long: the embedding, every layer (as `forward`), the final norm.
  torch::Tensor run(torch::Tensor ids, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                    const std::vector<torch::Tensor>& v_caches, torch::Tensor slots, int64_t kv_len,
                    const std::vector<torch::Tensor>& visibles) const {
    TORCH_CHECK(embed_.defined(), "offspec: the stack's body is not bound (set_body)");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "offspec: token ids must be (M,) long");
    torch::Tensor h = ::dequantize(embed_.index_select(0, ids), embed_type_, final_norm_.numel());  // (M, E)
    h = forward(h, cos, sin, k_caches, v_caches, slots, kv_len, visibles);
    return layer::rms_norm(h, final_norm_, (float)final_eps_, (float)final_offset_);
  }

  // What `unchanged` checks: (holder, key, expected, kind) with holder a dict; kind 0: holder[key] is expected, 1:
  // holder[key] == expected, 2: holder[key] is expected and empty (a module's hooks).
  using Watched = std::tuple<pybind11::dict, pybind11::object, pybind11::object, int64_t>;
  void watch(std::vector<Watched> entries) { watched_ = std::move(entries); }

  bool unchanged() const {
    for (const Watched& e : watched_) {
      PyObject* held = PyDict_GetItemWithError(std::get<0>(e).ptr(), std::get<1>(e).ptr());  // borrowed
      if (held == nullptr) {
        if (PyErr_Occurred()) throw pybind11::error_already_set();
        return false;  // no longer held there
      }
      const int64_t kind = std::get<3>(e);
      if (kind == 1) {
        const int same = PyObject_RichCompareBool(held, std::get<2>(e).ptr(), Py_EQ);
        if (same < 0) throw pybind11::error_already_set();
        if (!same) return false;
      } else if (held != std::get<2>(e).ptr() || (kind == 2 && (!PyDict_Check(held) || PyDict_Size(held) != 0))) {
        return false;
      }
    }
    return true;
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
  torch::Tensor embed_, final_norm_;  // undefined until set_body
  int64_t embed_type_ = -1;
  double final_eps_ = 0.0, final_offset_ = 0.0;
  std::vector<Watched> watched_;
};

}  // namespace offspec
