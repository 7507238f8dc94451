// Rotary position embedding applied in place to q and k as they sit in the fused QKV
// projection's output: no copies, one pass.
//
// transformers computes x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1];
// each output here is the same two fp32 products and one sum (no fused multiply-add:
// the build turns contraction off), so results are bit for bit torch's.

#include "kernels.h"

#include <ATen/Parallel.h>

namespace radixserve {

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
              x.device().is_cpu(), "x must be fp32 [T, heads, head_dim], head_dim contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
              sin.numel() == T * D, "cos and sin must be contiguous fp32 [T, head_dim]");
  float* xp = x.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, std::max<int64_t>(1, (32 << 10) / (H * D * 4)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *ct = c + t * D, *sn = s + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* v = xp + t * st + h * sh;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * ct[i] + (-x2) * sn[i];
          v[i + half] = x2 * ct[i + half] + x1 * sn[i + half];
        }
      }
    }
  });
}

}  // namespace radixserve
