// CPU kernels for GGUF (ggml) block formats, used by offspec/formats/kernels.py (built once per machine with
// torch.utils.cpp_extension). The weights stay in the file's own blocks: nothing is dequantized in memory.
//
//   qgemm(x, w, type, K)   y (M, N) = x (M, K) @ W^T, W given as N rows of blocks
//   qgemm_many(x, ws, types, K)  qgemm by several weights of one input (q, k, v; gate, up), quantized once
//   dequantize(w, type, K)  the exact float32 values of rows of blocks (gguf's reference arithmetic)
//   attend(q, k, v, visible, scale, softcap[, sinks])  attention per query over its visible keys (attention.h)
//   decoder_layer(...)      a whole decoder layer in one call: llama, qwen2/3, gemma2/3, phi3 (layer.h)
//   experts_ffn(...)        a mixture's routed experts in one call (experts.h)
//   LayerStack              a model's decoder layers bound once, run in one call (layer_stack.h)
//
// Row invariance: y[m, n] depends only on x[m] and W[n] (see ggml_dot.h), never on M or the thread split, so
// a one-token pass and a tree pass give bitwise identical rows.

#include "attention.h"
#include "ggml_dot.h"

#include <ATen/Parallel.h>

#include "ggml_x16.h"
#ifdef OFFSPEC_AMX
#include "ggml_amx.h"
#endif
#if defined(OFFSPEC_AVX512) && defined(__AVX512VNNI__)
#define OFFSPEC_WIDE_IQ 1
#include "ggml_wide_iq.h"  // the lattice types' wide passes as a blocked integer GEMM
#endif

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

using namespace offspec;

namespace {

void check_weight(const torch::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "offspec: weight blocks must be a contiguous (rows, row_bytes) uint8 CPU tensor");
  const Layout lay = layout_of(type);
  TORCH_CHECK(K % lay.block == 0, "offspec: K=", K, " is not a multiple of the block size ", lay.block);
  TORCH_CHECK(w.size(1) == K / lay.block * lay.bytes, "offspec: row bytes ", w.size(1), " do not match K=", K);
}

constexpr int64_t GRAIN = 16;  // weight rows per task: amortises the fork for small N

#ifdef OFFSPEC_AMX
// activation rows from which a K-quant runs on the AMX tiles: below it, decoding 16 weight rows for the tiles costs
// more than the products it saves over the AVX-512 kernels (kwtile below 8 rows decodes each block once for all the
// rows). Measured streaming the 1.5B target's weights, 2 cores of a Xeon with AMX, ms (AVX-512 / AMX): all its
// K-quant block weights, 4 rows 69.5 / 81.3, 5: 83.5 / 86.7, 6: 89.1 / 84.7, 8: 115.3 / 89.0. Q6_K's decoding
// costs about twice Q4_K's, so its tiles pay from 8 rows (the LM head, 151936 x 1536: 6 rows 14.6 / 19.6, 7: 15.7 /
// 19.7, 8: 19.1 / 19.7), or from 6 where kwtile's activation rows (M x K int8) spill out of L1 (ffn_down, K = 8960).
inline int64_t amx_min_rows(int64_t type, int64_t K) { return type == Q6_K && K <= 4096 ? 8 : 6; }
#endif

// f(i0, i1) over 0 .. n in chunks of `chunk`, handed to the threads as they come free (an atomic counter) instead of
// at::parallel_for's one fixed share each. On a machine whose cores something else also runs, the fixed share of a
// thread that shares its core takes twice as long and the whole pass waits for it: decode steps of the 1.5B Q3_K_M
// target, 2 threads on a 2-core Zen 4 shared with other jobs, ran 28-30 ms at quiet moments and 47-53 ms at busy ones
// with fixed shares (llama.cpp's threads take chunks as they come free). Not yet measured with this: the machine was
// too busy (load 4-6) to tell; at a quiet moment one decode step's matmuls cost the same (30.1 against 30.2 ms).
// Which thread computes a chunk changes no bits (row invariance).
template <class F>
void shared_for(int64_t n, int64_t chunk, const F& f) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t T = std::min<int64_t>(at::get_num_threads(), chunks);
  if (T <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

#ifdef OFFSPEC_AVX2
// The activation rows of interleaved products quantized as their base type's kernels take them (qgemm quantizes
// them per call; qgemm_many once for several weights where `same_x16_input`). `sums16`: their sums per 16 too (Q2_K, Q3_K, Q6_K).
struct X16Input {
  std::vector<int8_t> xq;        // (M, K) activations in 8 bits
  std::vector<float> xd;         // (M, K/ab) their scales
  std::vector<int32_t> xs_sum;   // (M, K/32) their sums per 32
  std::vector<int32_t> xo;       // (M, K/4) their lanes' offset terms, for the types that take them
  std::vector<int32_t> s16;      // (M, K/16) their sums per 16, or empty
  XSet xs;
  X16Input(const float* xp, int64_t M, int64_t K, int64_t base, bool sums16) {
    const int64_t ab = activation_block(base);
    TORCH_CHECK(K % ab == 0, "offspec: K=", K, " is not a multiple of ", ab);
    const int64_t nb = K / QB, nd = K / ab;
    xq.resize(M * K);
    xd.resize(M * nd);
    xs_sum.resize(M * nb);
    xo.resize(x16_offset_lanes(base) ? M * (K / 4) : 0);
    s16.resize(sums16 ? M * (K / 16) : 0);
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++) {
        quantize_row(xp + m * K, K, ab, &xq[m * K], &xd[m * nd], &xs_sum[m * nb]);
        if (!xo.empty()) offset_lanes(&xq[m * K], K, legacy_offset(base), &xo[m * (K / 4)]);
        if (!s16.empty()) sums_16(&xq[m * K], K, &s16[m * (K / 16)]);
      }
    });
    xs = XSet{xq.data(), xd.data(), xs_sum.data(), M, K, nb, nd};
    if (!xo.empty()) xs.o = xo.data();
    if (!s16.empty()) xs.s16 = s16.data();
  }
};

// Do the interleaved kernels of base types a and b take their activations quantized alike (the same activation
// block, and the same lane offsets or none), so that their products can share them?
inline bool same_x16_input(int64_t a, int64_t b) {
  return activation_block(a) == activation_block(b) && x16_offset_lanes(a) == x16_offset_lanes(b) &&
         (!x16_offset_lanes(a) || legacy_offset(a) == legacy_offset(b));
}

// ys[i] (M, N_i) = x @ W_i^T for interleaved weights ws (types[i]) that all take the same quantized input
// (`same_x16_input`): the input quantized once, one fork over all of the weights' 16-row groups as one range, then the
// rows past each weight's last group (row-major layout and kernels).
void x16_gemm(const float* xp, int64_t M, int64_t K, const std::vector<torch::Tensor>& ws,
              const std::vector<int64_t>& types, const std::vector<torch::Tensor>& ys) {
  const int64_t n = ws.size();
  std::vector<int64_t> first(n + 1, 0);  // weight i's groups are [first[i], first[i + 1]) of the one range
  bool sums16 = false;
  for (int64_t i = 0; i < n; i++) {
    first[i + 1] = first[i] + ws[i].size(0) / X16_ROWS;
    sums16 = sums16 || x16_base(types[i]) == Q6_K || x16_low(x16_base(types[i]));
  }
  const X16Input in(xp, M, K, x16_base(types[0]), sums16);
  // chunks of about a twelfth of a thread's share (decode's gate and up, 1120 groups on 2 threads: 47 groups, 0.3 MB)
  const int64_t chunk = std::max<int64_t>(1, first[n] / (12 * at::get_num_threads()));
  shared_for(first[n], chunk, [&](int64_t g0, int64_t g1) {
    for (int64_t i = 0; i < n; i++) {  // weight i's groups [a, b) of this task's share, counted within the weight
      const int64_t a = std::max(g0, first[i]) - first[i], b = std::min(g1, first[i + 1]) - first[i];
      const int64_t rb = ws[i].size(1);
      if (a < b)
        x16_rows(types[i], ws[i].data_ptr<uint8_t>() + a * X16_ROWS * rb, rb, a, b - a, in.xs,
                 ys[i].data_ptr<float>() + a * X16_ROWS, ws[i].size(0));
    }
  });
  for (int64_t i = 0; i < n; i++) {
    const int64_t N = ws[i].size(0), rb = ws[i].size(1), tail = N / X16_ROWS * X16_ROWS;
    if (tail < N)
      dot_rows(x16_base(types[i]), ws[i].data_ptr<uint8_t>() + tail * rb, rb, N - tail, in.xs,
               ys[i].data_ptr<float>() + tail, N);
  }
}
#endif

}  // namespace

torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t type, int64_t K) {
  const bool x16 = is_x16(type);  // rows interleaved 16 at a time (ggml_x16.h): the kernels of the ggml type below
  check_weight(w, x16 ? x16_base(type) : type, K);
#ifndef OFFSPEC_AVX2
  TORCH_CHECK(!x16, "offspec: interleaved weights need the AVX2 kernels");
#endif
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "offspec: activations must be a (M, K) float32 CPU tensor");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), rb = w.size(1);
  auto y = torch::empty({M, N}, x.options());  // (M, N) float32
  if (M == 0) return y;  // no activation rows: every path below assumes at least one
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();

  if (!x16 && !integer_kernel(type)) {  // float weights, the types without an integer kernel: exact decode + float dot
    at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
      std::vector<float> buf(K);  // (K,) one decoded weight row
      for (int64_t n = n0; n < n1; n++) {
        decode_row(type, wp + n * rb, K, buf.data());
        for (int64_t m = 0; m < M; m++) yp[m * N + n] = dot_f32(xp + m * K, buf.data(), K);
      }
    });
    return y;
  }

#ifdef OFFSPEC_AVX2
  if (x16) {
    x16_gemm(xp, M, K, {w}, {type}, {y});
    return y;
  }
#endif
  const int64_t ab = activation_block(type);
  TORCH_CHECK(K % ab == 0, "offspec: K=", K, " is not a multiple of ", ab);
  const int64_t nb = K / QB, nd = K / ab;
  std::vector<int8_t> xq(M * K);        // (M, K) activations in 8 bits
  std::vector<float> xd(M * nd);        // (M, K/ab) their scales
  std::vector<int32_t> xs_sum(M * nb);  // (M, K/32) their sums per 32
  const bool lanes = needs_offset_lanes(type);
  std::vector<int32_t> xo(lanes ? M * (K / 4) : 0);  // (M, K/4) their lanes' offset terms
  std::vector<int32_t> s16(needs_sums_16(type) ? M * (K / 16) : 0);  // (M, K/16) their sums per 16
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      quantize_row(xp + m * K, K, ab, &xq[m * K], &xd[m * nd], &xs_sum[m * nb]);
      if (!xo.empty()) offset_lanes(&xq[m * K], K, legacy_offset(type), &xo[m * (K / 4)]);
      if (!s16.empty()) sums_16(&xq[m * K], K, &s16[m * (K / 16)]);
    }
  });
  XSet xs{xq.data(), xd.data(), xs_sum.data(), M, K, nb, nd};
  if (!xo.empty()) xs.o = xo.data();
  if (!s16.empty()) xs.s16 = s16.data();
  int64_t done = 0;  // weight rows computed on the AMX tiles (whole groups of 16), the same bits as dot_rows'
#ifdef OFFSPEC_AMX
  // not Q2_K, Q3_K and the IQ2 types: ggml_amx.h has no decoder for their scales per 16 weights (nor Q2_K's minimums
  // per 16, the IQ2 grids), and nothing here tests such tiles against the AVX-512 bits, so they stay on the AVX-512
  // kernels, wide passes too
  if ((type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS) && M >= amx_min_rows(type, K) &&
      amx::enabled().load())
    done = amx::kgemm(type, wp, rb, N, xs, yp);
#endif
#ifdef OFFSPEC_WIDE_IQ
  if (wide_iq_type(type) && M >= WIDE_MIN_ROWS) {  // ggml_wide_iq.h: the same bits as dot_rows'
    const WideX wx(xs);
    at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
      wide_dot_rows(type, wp + n0 * rb, rb, n1 - n0, wx, yp + n0, N);
    });
    return y;
  }
#endif
  // chunks of whole GRAINs, about a twelfth of a thread's share (shared_for)
  const int64_t rest = N - done, chunk = std::max<int64_t>(1, rest / GRAIN / (12 * at::get_num_threads())) * GRAIN;
  shared_for(rest, chunk, [&](int64_t n0, int64_t n1) {
    dot_rows(type, wp + (done + n0) * rb, rb, n1 - n0, xs, yp + done + n0, N);
  });
  return y;
}

// y_i = x @ W_i^T for several weights of the same input (a layer's q, k, v; its gate and up): where they are all
// interleaved and `same_x16_input`, the activations are quantized once and one fork computes every weight's
// groups (one range over all of them); otherwise one qgemm each. The same bits as qgemm per weight either way.
std::vector<torch::Tensor> qgemm_many(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                      int64_t K) {
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "offspec: qgemm_many takes one type per weight");
  bool shared = ws.size() > 1 && x.dim() == 2 && x.size(0) > 0;
#ifdef OFFSPEC_AVX2
  for (int64_t t : types) shared = shared && is_x16(t) && same_x16_input(x16_base(t), x16_base(types[0]));
#else
  shared = false;
#endif
  std::vector<torch::Tensor> ys;
  if (!shared) {
    for (size_t i = 0; i < ws.size(); i++) ys.push_back(qgemm(x, ws[i], types[i], K));
    return ys;
  }
#ifdef OFFSPEC_AVX2
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.size(1) == K,
              "offspec: activations must be a (M, K) float32 CPU tensor");
  x = x.contiguous();
  for (size_t i = 0; i < ws.size(); i++) {
    check_weight(ws[i], x16_base(types[i]), K);
    ys.push_back(torch::empty({x.size(0), ws[i].size(0)}, x.options()));  // (M, N_i) float32
  }
  x16_gemm(x.data_ptr<float>(), x.size(0), K, ws, types, ys);
#endif
  return ys;
}

#include "layer.h"  // decoder_layer: one decoder layer per call (llama, qwen, gemma, phi3 families), on qgemm
#include "layer_stack.h"  // LayerStack: a model's layers in one call
#include "experts.h"  // experts_ffn: a mixture's routed experts in one call

torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K) {
  if (is_x16(type)) {  // back to row-major rows first (a copy), then as the ggml type
    type = x16_base(type);
    check_weight(w, type, K);
    auto rows = torch::empty_like(w);  // (R, row_bytes) uint8
    x16_permute(w.data_ptr<uint8_t>(), rows.data_ptr<uint8_t>(), w.size(0), w.size(1), type, false);
    w = rows;
  }
  check_weight(w, type, K);
  const int64_t R = w.size(0), rb = w.size(1);
  auto out = torch::empty({R, K}, torch::dtype(torch::kFloat32));  // (R, K) float32
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) decode_row(type, wp + r * rb, K, op + r * K);
  });
  return out;
}

// q (1, H, Q, D), k and v (1, Hkv, L, D) slices of a cache (last dim contiguous), visible (Q, L) bool
// -> (1, Q, H, D) float32, the layout transformers' attention functions return.
torch::Tensor attend_exact(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor visible, double scale,
                           double softcap, std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "offspec: exact attention runs in float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1, "offspec: one sequence at a time");
  q = q.contiguous();
  visible = visible.to(torch::kBool).contiguous();
  const int64_t H = q.size(1), Q = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D &&
              k.stride(1) == v.stride(1), "offspec: keys and values must be rows of a cache buffer");
  TORCH_CHECK(visible.size(0) == Q && visible.size(1) == L && H % Hkv == 0, "offspec: attention shapes disagree");
  torch::Tensor sink;  // (H,) float32, gpt-oss's attention sinks
  if (sinks.has_value()) {
    sink = sinks->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sink.numel() == H, "offspec: one attention sink per head");
  }
  auto out = torch::empty({1, Q, H, D}, q.options());  // (1, Q, H, D) float32
  attend(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), visible.data_ptr<bool>(),
         out.data_ptr<float>(), H, Hkv, Q, L, D, k.stride(1), (float)scale, (float)softcap,
         sinks.has_value() ? sink.data_ptr<float>() : nullptr);
  return out;
}

// The rows of w (`type`: x16_able, (N, row_bytes) uint8) interleaved 16 at a time (forward) or back: a new tensor,
// the same shape and bytes permuted (ggml_x16.h).
torch::Tensor interleave(torch::Tensor w, int64_t type, int64_t K, bool forward) {
  TORCH_CHECK(x16_able(type), "offspec: only Q2_K, Q3_K, Q4_K, Q6_K and the legacy types' rows interleave, not type ", type);
  check_weight(w, type, K);
  auto out = torch::empty_like(w);  // (N, row_bytes) uint8
  x16_permute(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), w.size(0), w.size(1), type, forward);
  return out;
}

// Switch the AMX tiles off (false) or on (true, where the CPU and the OS allow them); returns whether they were on.
// Both paths compute the same bits: tests compare them, a benchmark can time them.
bool set_amx(bool on) {
#ifdef OFFSPEC_AMX
  return amx::enabled().exchange(on && amx::permitted());
#else
  (void)on;
  return false;
#endif
}

std::string isa() {  // the instruction set the kernels were built for (and use: AMX only while it is on)
#if defined(OFFSPEC_AMX)
  return amx::enabled().load() ? "AMX + AVX-512 VNNI" : "AVX-512 VNNI";
#elif defined(OFFSPEC_AVX512) && defined(__AVX512VNNI__)
  return "AVX-512 VNNI";
#elif defined(OFFSPEC_AVX512)
  return "AVX-512";
#elif defined(OFFSPEC_AVX2)
  return "AVX2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemm", &qgemm, "y = x @ W^T with W in ggml blocks (row invariant)");
  m.def("qgemm_many", &qgemm_many, "qgemm of one input by several weights, the activations quantized once where "
        "they can be");
  m.def("dequantize", &dequantize, "exact float32 rows of ggml blocks");
  m.def("attend", &attend_exact, "attention per query over its visible keys only, logits soft-capped where softcap > 0 "
        "(row invariant), with gpt-oss's attention sinks where given", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("visible"), py::arg("scale"), py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("decoder_layer", &decoder_layer, "one decoder layer: llama, qwen2/3, gemma2/3, phi3 (layer.h)");
  m.def("experts_ffn", &experts_ffn, "a mixture's routed experts, ascending, each row its own (experts.h)");
  m.def("interleave", &interleave, "weight rows interleaved 16 at a time (forward) or back (ggml_x16.h)");
  m.def("isa", &isa, "the instruction set the kernels were built for");
  m.def("set_grid", &set_grid, "the lattice grid of an IQ type, (entries, 8 or 4) int8 (once, at load)");
  // module_local: each build of these kernels (tests load the AVX2 and AVX-512 ones side by side) has its own class
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local(),
                               "a model's decoder layers bound once, run in one call (layer_stack.h)")
      .def(pybind11::init<>())
      .def("add", &LayerStack::add)
      .def("forward", &LayerStack::forward)
      .def("set_body", &LayerStack::set_body)
      .def("run", &LayerStack::run)
      .def("watch", &LayerStack::watch)
      .def("unchanged", &LayerStack::unchanged);
  m.def("rms_norm", &offspec::rms_norm_rows, "RMSNorm of each row of (M, K) float32, as the compiled layers' norms");
  m.def("set_amx", &set_amx, "switch the AMX tiles off or on (the same results); returns whether they were on");
}
