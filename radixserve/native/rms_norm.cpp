// RMSNorm with the residual add before it, in one pass over each row: the decoder's
// `hidden += delta; normed = weight * hidden / rms(hidden)` between its sublayers.
//
// At decode's few rows, torch runs these as five or six ops of ~10 us dispatch each (add,
// pow, mean, rsqrt, two muls), 61 norms a step: several ms of a batch-1 step in torch's
// profiler. Here they cost a row's read. The rounding is transformers' up to the sum's order: the add and
// each product are the same fp32 operations, the mean of squares is summed in 16 lanes.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace radixserve {

at::Tensor add_rms_norm(at::Tensor hidden, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
              hidden.device().is_cpu(), "hidden must be a contiguous 2-D fp32 CPU tensor");
  const int64_t T = hidden.size(0), D = hidden.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D,
              "weight must be a contiguous fp32 [", D, "]");
  if (delta) {
    TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->scalar_type() == at::kFloat &&
                delta->is_contiguous(), "delta must be a contiguous fp32 tensor like hidden");
  }
  at::Tensor out = at::empty_like(hidden);
  float* h = hidden.data_ptr<float>();
  const float* d = delta ? delta->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  constexpr int LANES = 16;
  // Rows are independent; below ~64 KiB of rows one thread is faster than waking the pool.
  at::parallel_for(0, T, std::max<int64_t>(1, (64 << 10) / (D * 4)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = h + t * D;
      float lanes[LANES] = {};
      int64_t i = 0;
      for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) {
          if (d) row[i + l] += d[t * D + i + l];
          lanes[l] += row[i + l] * row[i + l];
        }
      float sum = 0.f;
      for (int l = 0; l < LANES; ++l) sum += lanes[l];
      for (; i < D; ++i) {
        if (d) row[i] += d[t * D + i];
        sum += row[i] * row[i];
      }
      const float inv = 1.f / std::sqrt(sum / float(D) + float(eps));
      for (int64_t j = 0; j < D; ++j) o[t * D + j] = w[j] * (row[j] * inv);
    }
  });
  return out;
}

}  // namespace radixserve
