// A decode step's decoder layers in one native call (`model/native_layers.py`): per layer the
// residual add with RMSNorm, the QKV projection, rotary, the KV store at the step's slots,
// decode attention over the block tables, the output projection, the second norm, gate/up,
// SiLU x up and down, each by the very kernel the module path calls (`add_rms_norm`,
// `f32_matmul` / `q4_matmul` / `int8_matmul`, `rotary_`, `decode_attention`; SiLU x up by
// ATen's own ops), in the same order on the same values: the output is bit for bit the
// module path's. What it saves is the interpreter between operations: at batch 1 on the
// default model a layer is ~15 Python-level calls (module calls, views, wrappers, dispatch)
// around 0.1-0.3 ms of kernels.
//
// The weights are bound once (`DecoderLayers`), so a step passes only its own tensors.

#include "kernels.h"

#include <cstring>
#include <vector>

namespace radixserve {

namespace {

enum Format : int64_t { F32 = 0, Q4 = 1, INT8 = 2 };

// One projection's weight as `linear.py` packs it: a dense fp32 [N, K] (F32), or codes,
// scales and lows (Q4, INT8), and its bias if any.
struct Projection {
  int64_t format;
  std::vector<at::Tensor> weight;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (format) {
      case F32: return f32_matmul(x, weight[0], bias);
      case Q4: return q4_matmul(x, weight[0], weight[1], weight[2], bias);
      default: return int8_matmul(x, weight[0], weight[1], weight[2], bias);
    }
  }
};

// K or V rows `[T, Hkv, D]` (head_dim contiguous, any other strides) into `cache`
// `[blocks, page, Hkv, D]` (head_dim contiguous) at slots block * page + row, as the torch
// backend's `index_put_` does.
void store(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots) {
  const int64_t T = rows.size(0), H = rows.size(1), D = rows.size(2), page = cache.size(1);
  const float* src = rows.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = slots[t] / page, r = slots[t] % page;
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(dst + blk * cache.stride(0) + r * cache.stride(1) + h * cache.stride(2),
                  src + t * rows.stride(0) + h * rows.stride(1), D * sizeof(float));
  }
}

}  // namespace

class DecoderLayers {
 public:
  // `norms`: per layer its input and post-attention norm weights; `formats`, `weights`,
  // `biases`: per layer its qkv, o, gate_up and down projections (`Projection`).
  DecoderLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                std::vector<at::Tensor> norms, std::vector<int64_t> formats,
                std::vector<std::vector<at::Tensor>> weights,
                std::vector<c10::optional<at::Tensor>> biases)
      : H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale),
        norms_(std::move(norms)) {
    TORCH_CHECK(formats.size() == weights.size() && formats.size() == biases.size() &&
                formats.size() == 2 * norms_.size(), "four projections and two norms a layer");
    for (size_t i = 0; i < formats.size(); ++i) {
      TORCH_CHECK(formats[i] >= F32 && formats[i] <= INT8 &&
                  weights[i].size() == (formats[i] == F32 ? 1u : 3u), "bad projection ", i);
      projections_.push_back({formats[i], std::move(weights[i]), std::move(biases[i])});
    }
  }

  // Runs every layer over the residual stream `x` `[T, hidden]` (added to in place, as the
  // module path's norms do) for T decode tokens, `slots` `[T]` their KV slots, `cos`/`sin`
  // their rotary tables (`T * head_dim` each), `tables`/`starts`/`lens` the native decode's
  // arguments (one row per token); returns the last layer's output, which the final norm
  // adds into `x`.
  at::Tensor step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& starts,
                  const at::Tensor& lens, std::vector<at::Tensor> k_caches,
                  std::vector<at::Tensor> v_caches) {
    const int64_t L = static_cast<int64_t>(norms_.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                static_cast<int64_t>(v_caches.size()) == L, "one K and V cache per layer");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                slots.numel() == x.size(0), "slots: contiguous int64, one per token");
    const int64_t T = x.size(0), q_size = H_ * D_, kv_size = Hkv_ * D_;
    const int64_t* slot = slots.data_ptr<int64_t>();
    c10::optional<at::Tensor> delta;
    for (int64_t l = 0; l < L; ++l) {
      at::Tensor& k_cache = k_caches[l];
      at::Tensor& v_cache = v_caches[l];
      TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) == Hkv_ && k_cache.size(3) == D_ && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1, "the caches must be fp32 [blocks, page, kv_heads, "
                  "head_dim], head_dim contiguous");
      const Projection* p = projections_.data() + 4 * l;
      at::Tensor h = add_rms_norm(x, delta, norms_[2 * l], eps_);
      at::Tensor qkv = p[0](h);
      rotary_(qkv.narrow(1, 0, q_size + kv_size).view({T, H_ + Hkv_, D_}), cos, sin);
      store(qkv.narrow(1, q_size, kv_size).view({T, Hkv_, D_}), k_cache, slot);
      store(qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv_, D_}), v_cache, slot);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H_, D_}).contiguous();
      at::Tensor attended = std::get<0>(decode_attention(q, k_cache, v_cache, tables, starts,
                                                         lens, scale_, c10::nullopt,
                                                         c10::nullopt));
      h = add_rms_norm(x, p[1](attended.view({T, q_size})), norms_[2 * l + 1], eps_);
      const std::vector<at::Tensor> gate_up = p[2](h).chunk(2, -1);
      delta = p[3](at::silu(gate_up[0]) * gate_up[1]);  // as `llama.silu_mul`
    }
    TORCH_CHECK(delta.has_value(), "no layers");
    return *delta;
  }

 private:
  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  std::vector<at::Tensor> norms_;
  std::vector<Projection> projections_;
};

void bind_decode_layers(pybind11::module_& m) {
  pybind11::class_<DecoderLayers>(m, "DecoderLayers",
                                  "a decode step's decoder layers in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>,
                          std::vector<int64_t>, std::vector<std::vector<at::Tensor>>,
                          std::vector<c10::optional<at::Tensor>>>())
      .def("step", &DecoderLayers::step,
           "every layer over x [T, hidden] (in place); returns the last layer's output");
}

}  // namespace radixserve
