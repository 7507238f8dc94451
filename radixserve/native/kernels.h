// The kernels `module.cpp` binds for Python (one library, `radixserve/native/__init__.py`).
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace radixserve {

// quant_matmul.cpp: y = x W^T + b for 4-bit and 8-bit group weights, fp32 activations.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low, const c10::optional<at::Tensor>& bias);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& low, const c10::optional<at::Tensor>& bias);
at::Tensor q4_dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& low, int64_t begin, int64_t end);

// quant_matmul.cpp: checks `x` is contiguous fp32 [M, K] on the CPU, `bias` (if given) fp32 [N].
void check_x(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N);

// f32_matmul.cpp: y = x W^T + b for a dense fp32 weight (its own GEMV at decode's rows).
at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias);

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

// lora.cpp: y[t] += each token's LoRA adapter's share (its slot's rows of a and bt), in place.
void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slots, const at::Tensor& part_cols, const at::Tensor& ranks,
               int64_t rank);

// decode_layers.cpp: `DecoderLayers`, a decode step's decoder layers in one call, for Python.
void bind_decode_layers(pybind11::module_& m);

}  // namespace radixserve
