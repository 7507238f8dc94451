// The kernels `module.cpp` binds for Python (one library, `radixserve/native/__init__.py`).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <tuple>

namespace radixserve {

// One GEMV's operands, for a caller that runs its own threads (`decode_layers.cpp`): x
// `[M, K]` and y `[M, N]` contiguous fp32, bias `[N]` or null. A kernel's work is `units`
// blocks of output rows, each a thread's whole; its standalone entry point below splits
// them over torch's pool, and runs the same body on each share.
struct Gemv {
  const float* x;
  float* y;
  const float* bias;
  int64_t M, K, N;
};

// quant_matmul.cpp: y = x W^T + b for 4-bit and 8-bit group weights, fp32 activations.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low, const c10::optional<at::Tensor>& bias);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& low, const c10::optional<at::Tensor>& bias);
at::Tensor q4_dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& low, int64_t begin, int64_t end);

// quant_matmul.cpp: the GEMV path of the two above, which they take below `group_gemv_rows`
// rows of x (then a dense path), over work units `begin .. end` of `group_gemv_units(N)`.
// `codes`, `scale`, `low` as the entry points take them, checked there.
constexpr int64_t GROUP_GEMV_ROWS = 80;
int64_t group_gemv_units(int64_t N);
void q4_gemv(const Gemv& g, const uint8_t* codes, const float* scale, const float* low,
             int64_t begin, int64_t end);
void int8_gemv(const Gemv& g, const uint8_t* codes, const float* scale, const float* low,
               int64_t begin, int64_t end);

// quant_matmul.cpp: checks `x` is contiguous fp32 [M, K] on the CPU, `bias` (if given) fp32 [N].
void check_x(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N);

// f32_matmul.cpp: y = x W^T + b for a dense fp32 weight (its own GEMV at decode's rows).
at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias);
// f32_matmul.cpp: its GEMV path, which it takes up to `F32_GEMV_ROWS` rows of x (then
// torch's GEMM), over work units `begin .. end` of `f32_gemv_units(N)`.
constexpr int64_t F32_GEMV_ROWS = 128;
int64_t f32_gemv_units(int64_t N);
void f32_gemv(const Gemv& g, const float* weight, int64_t begin, int64_t end);

// rms_norm.cpp: `hidden += delta` (if given), then RMSNorm of each row times `weight`.
at::Tensor add_rms_norm(at::Tensor hidden, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps);

// rotary.cpp: rotary position embedding of x [T, heads, head_dim] in place.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// decode_attention.cpp: query rows over their key sets' KV blocks, in place (one row
// per set: a decode; several rows per set: a shared run, `row_offsets`; a row reading
// several sets, merged: tree attention's parts, `rows`).
std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor starts, torch::Tensor kv_lens, double scale,
    c10::optional<torch::Tensor> row_offsets, c10::optional<torch::Tensor> rows);
// decode_attention.cpp: the caches every plan reads (and `decode_layers.cpp` writes):
// float32 `[blocks, page, kv_heads, head_dim]`, the two alike, head_dim contiguous (other
// strides are free); else a clear error.
void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache);
// decode_attention.cpp: the same, planned (and its arguments checked) once and run by a
// caller's own threads (`decode_layers.cpp`'s team): `run_tasks` on every thread (each
// takes key chunks until none are left), then `merge` over shares of `outputs()`, with a
// barrier between (`run`: both on torch's pool). Which thread runs a chunk changes no sum.
class DecodeAttention {
 public:
  DecodeAttention(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& starts, const torch::Tensor& kv_lens, double scale,
                  const c10::optional<torch::Tensor>& row_offsets,
                  const c10::optional<torch::Tensor>& rows);
  ~DecodeAttention();
  // The same key sets, tables and rows over another layer: its queries `q` and caches,
  // shaped as the planned ones (the caches any strides, head_dim contiguous). What a plan
  // costs to make (its tensors, its task order) is then paid once a step, not once a layer.
  void rebind(const torch::Tensor& q, const torch::Tensor& k_cache,
              const torch::Tensor& v_cache);
  void run();
  void run_tasks();
  int64_t tasks() const;    // key chunks
  int64_t outputs() const;  // rows x heads
  void merge(int64_t begin, int64_t end);
  torch::Tensor out, lse;  // `[R, H, D]` and `[R, H]`, complete once every output is merged

 private:
  struct Plan;
  std::unique_ptr<Plan> plan_;
};

// lora.cpp: y[t] += each token's LoRA adapter's share (its slot's rows of a and bt), in place.
void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slots, const at::Tensor& part_cols, const at::Tensor& ranks,
               int64_t rank);

// decode_layers.cpp: `DecoderLayers`, a step's decoder layers and LM head in one call, for
// Python.
void bind_decode_layers(pybind11::module_& m);

}  // namespace radixserve
