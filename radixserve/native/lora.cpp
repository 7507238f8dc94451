// LoRA adapters added to a projection's output, each token under its own adapter
// (`radixserve/lora/slots.py`): for token t of slot s and each fused part p,
//   shrink: h = a[s, p*R .. p*R + r) . x[t]            (r dot products over IN)
//   expand: y[t, part p's columns] += h @ bt[s, the same rows, part p's columns]
// with r = ranks[s, p], the adapter's own rank for that part (0: it adapts no such part).
//
// Why not two matmuls: a step's tokens run different adapters, so torch would compute every
// slot for every token and mask (n slots: n times the shrink, and the fused parts' zero
// blocks times the expand), or loop over adapters at ~10 us a small op, 4 ops a projection
// and 120 projections a step. Here each token reads only its adapter's rows, in one pass.

#include "kernels.h"

#include <ATen/Parallel.h>

namespace radixserve {

void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slots, const at::Tensor& part_cols, const at::Tensor& ranks,
               int64_t rank) {
  const int64_t T = x.size(0), IN = x.size(1), OUT = y.size(1);
  const int64_t S = a.size(0), W = a.size(1), P = part_cols.numel() - 1;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&y, &x, &a, &bt})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "lora_add_: y, x, a and bt must be contiguous fp32 CPU tensors");
  TORCH_CHECK(y.size(0) == T && a.size(2) == IN && bt.size(0) == S && bt.size(1) == W &&
              bt.size(2) == OUT && W == P * rank, "lora_add_: shapes do not fit");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T &&
              part_cols.scalar_type() == at::kLong && ranks.scalar_type() == at::kLong &&
              ranks.numel() == S * P, "lora_add_: slots [T], part_cols [P+1], ranks [S, P] int64");
  const float* xs = x.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bs = bt.data_ptr<float>();
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  const int64_t* cols = part_cols.data_ptr<int64_t>();
  const int64_t* rs = ranks.data_ptr<int64_t>();
  float* ys = y.data_ptr<float>();
  constexpr int LANES = 16;
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rank);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slot_of[t];
      if (s < 0) continue;
      TORCH_CHECK(s < S, "lora_add_: slot ", s, " past the ", S, " slots");
      const float* xt = xs + t * IN;
      float* yt = ys + t * OUT;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t r_p = rs[s * P + p];
        for (int64_t r = 0; r < r_p; ++r) {
          const float* row = as + (s * W + p * rank + r) * IN;
          float lanes[LANES] = {};
          int64_t i = 0;
          for (; i + LANES <= IN; i += LANES)
            for (int l = 0; l < LANES; ++l) lanes[l] += row[i + l] * xt[i + l];
          float sum = 0.f;
          for (int l = 0; l < LANES; ++l) sum += lanes[l];
          for (; i < IN; ++i) sum += row[i] * xt[i];
          h[r] = sum;
        }
        for (int64_t r = 0; r < r_p; ++r) {
          const float* row = bs + (s * W + p * rank + r) * OUT;
          const float hr = h[r];
          for (int64_t c = cols[p]; c < cols[p + 1]; ++c) yt[c] += hr * row[c];
        }
      }
    }
  });
}

}  // namespace radixserve
