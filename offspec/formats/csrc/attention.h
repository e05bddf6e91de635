// Attention whose result for a query depends only on that query and the keys it may see, in slot order:
// never on the other queries of the pass or on the keys it may not see. A tree node attends to the committed
// prefix and its ancestors; the target alone attends to the same prefix and the same tokens, committed. With
// the same keys in the same order, the same operations give the same bits: verification and decoding without
// a draft agree exactly (as the row-invariant linear kernels do for the rest of the layer).
#pragma once

#include "ggml_dot.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace offspec {

// out (Q, H, D) = softmax(cap(scale q k^T) over visible keys) v, per query row and head; cap(s) = tanh(s / softcap)
// * softcap where softcap > 0 (gemma2's attention logit soft-capping), else s.
// q (H, Q, D) contiguous; k, v (Hkv, L, D) with row stride D and head stride `kv_head_stride` (a slice of a
// pre-allocated cache); visible (Q, L) bool.
inline void attend(const float* q, const float* k, const float* v, const bool* visible, float* out, int64_t H,
                   int64_t Hkv, int64_t Q, int64_t L, int64_t D, int64_t kv_head_stride, float scale,
                   float softcap = 0.0f) {
  const int64_t group = H / Hkv;
  at::parallel_for(0, H * Q, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(L);  // scores of the visible keys, in slot order
    std::vector<int64_t> slot(L);
    std::vector<float> acc(D);
    for (int64_t t = t0; t < t1; t++) {
      const int64_t h = t / Q, i = t % Q;
      const float* qi = q + (h * Q + i) * D;
      const float* kh = k + (h / group) * kv_head_stride;
      const float* vh = v + (h / group) * kv_head_stride;
      const bool* vis = visible + i * L;
      int64_t n = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j < L; j++) {
        if (!vis[j]) continue;
        float s = dot_f32(qi, kh + j * D, D) * scale;
        if (softcap > 0.0f) s = std::tanh(s / softcap) * softcap;
        score[n] = s;
        slot[n++] = j;
        top = s > top ? s : top;
      }
      float* o = out + (i * H + h) * D;
      if (n == 0) {
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        continue;
      }
      double total = 0.0;  // in slot order
      for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
      for (int64_t c = 0; c < n; c++) {
        const float p = std::exp(score[c] - top);
        total += p;
        const float* vr = vh + slot[c] * D;
        for (int64_t d = 0; d < D; d++) acc[d] = std::fma(p, vr[d], acc[d]);
      }
      const float inv = (float)(1.0 / total);
      for (int64_t d = 0; d < D; d++) o[d] = acc[d] * inv;
    }
  });
}

}  // namespace offspec
