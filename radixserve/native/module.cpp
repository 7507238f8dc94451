// The Python module of radixserve's CPU kernels (`radixserve/native/__init__.py` builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace radixserve;
  m.def("q4_matmul", &q4_matmul, "x [M, K] fp32 times 4-bit group weights, transposed");
  m.def("int8_matmul", &int8_matmul, "x [M, K] fp32 times 8-bit group weights, transposed");
  m.def("f32_matmul", &f32_matmul, "x [M, K] fp32 times a dense fp32 weight, transposed");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta, then RMSNorm times weight");
  m.def("rotary_", &rotary_, "rotary embedding of x [T, heads, head_dim] in place");
  m.def("q4_dequantize", [](const at::Tensor& c, const at::Tensor& s, const at::Tensor& z) {
    return q4_dequantize_rows(c, s, z, 0, c.size(0));
  }, "fp32 values of 4-bit group weights");
  m.def("decode_attention", &decode_attention,
        "q [R, H, D] against the keys of each row's set in its KV blocks: (out, lse), fp32");
  m.def("lora_add_", &lora_add_,
        "y [T, OUT] += each token's LoRA adapter's share (its slot's a and bt rows), in place");
  bind_decode_layers(m);
  m.def("isa", []() {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
  }, "which paths this build runs: avx512, avx2 (with FMA) or portable (plain loops)");
}
