// Weight-only quantized matmuls for the CPU with fp32 activations, exact up to rounding:
// y = x W^T + b, where W is held as
// - 4-bit groups (`q4_matmul`): value = code * scale + low per 32 inputs of a row (`low`
//   is the group's value at code 0: `Int4Groups`' zero - 8 * scale); codes packed two a
//   byte, byte j of a group holding code j (low nibble) and code j + 16 (high);
// - 8-bit groups (`int8_matmul`): value = code * scale per `group` inputs of a row (32 for
//   a GGUF's Q8_0, the whole row for per-channel int8).
// Scales are fp32 and every product and sum is fp32, so a result differs from the fp32
// matmul of the dequantized weight only in rounding (~1e-6 relative).
//
// Decode (a few rows of x) reads each weight once: a thread walks its share of output
// rows in memory order (codes and scales each one linear stream) and applies every row
// of x to a group of weights while it is dequantized in registers. Many rows of x
// (prefill) dequantize the weight a chunk of output rows at a time and run the dense
// matmul, which is compute-bound there; both paths compute the same weight values.
//
// Threads: torch's own pool (`at::parallel_for`). The build compiles this file with
// -fopenmp so that the pool's inline OpenMP region is live, and links torch's libgomp,
// not the compiler's, so that one OpenMP runtime serves torch and this file.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve {

constexpr int64_t Q4_GROUP = 32;
constexpr int64_t MAX_ROWS = 4;  // rows of x per pass over weight rows: fits the registers
// Rows of x from which dequantize + sgemm is faster: measured on the default model's
// projections (2 cores), the vector path wins at 64 rows by 25%, loses at 96 by 15%.
constexpr int64_t DENSE_FROM = 80;
constexpr int64_t DENSE_CHUNK_BYTES = 8 << 20;  // fp32 weight dequantized per sgemm call

// The weight bytes a thread should have at least: below this, waking torch's pool (10-70 us
// a call here with OMP_WAIT_POLICY=PASSIVE) costs more than the split saves. Measured on
// the default model's projections (0.2-1 MB each in q4), interleaved in one run: 32 KiB
// ran batch 1 in 7.5 ms against 9.1 ms with 512 KiB (one thread for most projections).
constexpr int64_t GRAIN_BYTES = 32 << 10;

#if !defined(__AVX512F__)
constexpr int LANES = 16;  // a group of 32 is two runs of LANES

inline float lane_sum(const float (&v)[LANES]) {
  float sum = 0.f;
  for (int i = 0; i < LANES; ++i) sum += v[i];
  return sum;
}
#endif

// --- 4-bit ---------------------------------------------------------------------------

// Output rows n..n + NR for `MB` rows of x (`x` [MB, K] at stride K):
// y[m * N + n + r] = sum_g sum_i (code_i * scale_g + low_g) x_i. A group's weights are
// dequantized in registers (one rounding: a fused multiply-add, then a table lookup, which
// is fewer instructions than widening each code to a float) and applied to every row
// of x; two output rows at a time share the loads of x, and the two halves of a group
// accumulate apart, so that the FMA chains are short enough to keep up with memory.
template <int NR, int MB>
inline void q4_rows(const float* x, int64_t K, const uint8_t* codes, const float* scale,
                    const float* low, const float* bias, float* y, int64_t N, int64_t n) {
  const int64_t G = K / Q4_GROUP;
#if defined(__AVX512F__)
  __m512 acc[NR][MB][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < G; ++g) {
    __m512 w[NR][2];
    for (int r = 0; r < NR; ++r) {
      // The group's 16 values code * scale + low, then each weight looked up by its code:
      // the permute reads only an index's low 4 bits, so the low nibbles need no mask.
      const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale[r * G + g]),
                                            _mm512_set1_ps(low[r * G + g]));
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128((const __m128i*)(codes + (r * G + g) * 16)));
      w[r][0] = _mm512_permutexvar_ps(b, values);
      w[r][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * K + g * Q4_GROUP);
      const __m512 x1 = _mm512_loadu_ps(x + m * K + g * Q4_GROUP + 16);
      for (int r = 0; r < NR; ++r) {
        acc[r][m][0] = _mm512_fmadd_ps(w[r][0], x0, acc[r][m][0]);
        acc[r][m][1] = _mm512_fmadd_ps(w[r][1], x1, acc[r][m][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m)
      y[m * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1])) +
                         (bias ? bias[n + r] : 0.f);
#else
  // Portable loops with LANES independent sums per row of x: the compiler vectorizes them
  // for the machine's own vector width without reordering a sum.
  for (int r = 0; r < NR; ++r) {
    float acc[MB][LANES] = {};
    float w[Q4_GROUP];
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* q = codes + (r * G + g) * 16;
      const float s = scale[r * G + g], l = low[r * G + g];
      for (int i = 0; i < 16; ++i) {
        w[i] = std::fma(float(q[i] & 15), s, l);
        w[i + 16] = std::fma(float(q[i] >> 4), s, l);
      }
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < Q4_GROUP; h += LANES)
          for (int i = 0; i < LANES; ++i)
            acc[m][i] = std::fma(w[h + i], x[m * K + g * Q4_GROUP + h + i], acc[m][i]);
    }
    for (int m = 0; m < MB; ++m) y[m * N + n + r] = lane_sum(acc[m]) + (bias ? bias[n + r] : 0.f);
  }
#endif
}

// The template instance for 1..MAX_ROWS rows of x.
template <typename Rows>
inline void dispatch_rows(int64_t rows, Rows&& run) {
  switch (rows) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{}); break;
  }
}

void check_x(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              x.device().is_cpu(), "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weight ", K);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bias must be a contiguous fp32 [", N, "]");
  }
}

// fp32 [n1 - n0, K] values of 4-bit rows n0..n1, as the GEMV computes them.
at::Tensor q4_dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& low, int64_t n0, int64_t n1) {
  const int64_t K = codes.size(1) * 2, G = K / Q4_GROUP;
  at::Tensor out = at::empty({n1 - n0, K}, scale.options());
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *l = low.data_ptr<float>();
  float* w = out.data_ptr<float>();
  at::parallel_for(n0, n1, std::max<int64_t>(1, GRAIN_BYTES / (K / 2)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* qg = q + n * (K / 2) + g * 16;
        float* wg = w + (n - n0) * K + g * Q4_GROUP;
        const float sg = s[n * G + g], lg = l[n * G + g];
        for (int i = 0; i < 16; ++i) {
          wg[i] = std::fma(float(qg[i] & 15), sg, lg);
          wg[i + 16] = std::fma(float(qg[i] >> 4), sg, lg);
        }
      }
  });
  return out;
}

// Dense path for many rows of x: a chunk of output rows dequantized at a time.
template <typename Dequantize>
at::Tensor dense_matmul(const at::Tensor& x, int64_t N, int64_t K,
                        const c10::optional<at::Tensor>& bias, Dequantize&& dequantize) {
  const int64_t chunk = std::max<int64_t>(16, DENSE_CHUNK_BYTES / (4 * K));
  if (chunk >= N) {
    at::Tensor w = dequantize(0, N);
    return bias ? at::addmm(*bias, x, w.t()) : at::mm(x, w.t());
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n1 = std::min(N, n0 + chunk);
    at::Tensor w = dequantize(n0, n1);
    at::Tensor part = bias ? at::addmm(bias->narrow(0, n0, n1 - n0), x, w.t()) : at::mm(x, w.t());
    y.narrow(1, n0, n1 - n0).copy_(part);
  }
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low, const c10::optional<at::Tensor>& bias) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / Q4_GROUP, M = x.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && K % Q4_GROUP == 0,
              "codes must be contiguous uint8 [N, K / 2], K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && low.scalar_type() == at::kFloat &&
              scale.is_contiguous() && low.is_contiguous() && scale.size(0) == N &&
              scale.size(1) == G && low.sizes() == scale.sizes(),
              "scale and low must be contiguous fp32 [N, K / 32]");
  check_x(x, K, bias, N);
  if (M >= DENSE_FROM)
    return dense_matmul(x, N, K, bias, [&](int64_t n0, int64_t n1) {
      return q4_dequantize_rows(codes, scale, low, n0, n1);
    });
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *l = low.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Work items are pairs of output rows (the last one alone where N is odd).
  at::parallel_for(0, (N + 1) / 2, std::max<int64_t>(1, GRAIN_BYTES / K),
                   [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = 2 * pair;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
        dispatch_rows(std::min(MAX_ROWS, M - m0), [&](auto rows) {
          constexpr int MB = decltype(rows)::value;
          const float* xm = xp + m0 * K;
          float* ym = yp + m0 * N;
          if (n + 1 < N)
            q4_rows<2, MB>(xm, K, q + n * (K / 2), s + n * G, l + n * G, b, ym, N, n);
          else
            q4_rows<1, MB>(xm, K, q + n * (K / 2), s + n * G, l + n * G, b, ym, N, n);
        });
    }
  });
  return y;
}

// --- 8-bit ---------------------------------------------------------------------------

// One output row `n` for `MB` rows of x: y[m * N + n] = sum_g scale_g * sum_i code_i x_i.
// Two partial sums per row of x keep the FMA chains short when a group is a whole row.
template <int MB>
inline void int8_row(const float* x, int64_t K, int64_t group, const int8_t* codes,
                     const float* scale, const float* bias, float* y, int64_t N, int64_t n) {
  const int64_t G = K / group;
#if defined(__AVX512F__)
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 t0[MB], t1[MB];
    for (int m = 0; m < MB; ++m) t0[m] = t1[m] = _mm512_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
      const __m512 w0 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + i))));
      const __m512 w1 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + i + 16))));
      for (int m = 0; m < MB; ++m) {
        t0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + i), t0[m]);
        t1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + i + 16), t1[m]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale[g]);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_add_ps(t0[m], t1[m]), s, acc[m]);
  }
  for (int m = 0; m < MB; ++m)
    y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + (bias ? bias[n] : 0.f);
#else
  float acc[MB][LANES] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * K;
      float t[LANES] = {};
      for (int64_t h = g * group; h < (g + 1) * group; h += LANES)
        for (int i = 0; i < LANES; ++i) t[i] = std::fma(float(codes[h + i]), xm[h + i], t[i]);
      for (int i = 0; i < LANES; ++i) acc[m][i] = std::fma(t[i], scale[g], acc[m][i]);
    }
  for (int m = 0; m < MB; ++m) y[m * N + n] = lane_sum(acc[m]) + (bias ? bias[n] : 0.f);
#endif
}

at::Tensor int8_dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                                int64_t n0, int64_t n1) {
  const int64_t K = codes.size(1), G = scale.size(1), group = K / G;
  at::Tensor out = at::empty({n1 - n0, K}, scale.options());
  const int8_t* q = codes.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  float* w = out.data_ptr<float>();
  at::parallel_for(n0, n1, std::max<int64_t>(1, GRAIN_BYTES / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = g * group; i < (g + 1) * group; ++i)
          w[(n - n0) * K + i] = float(q[n * K + i]) * s[n * G + g];
  });
  return out;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = codes.size(0), K = codes.size(1), M = x.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && K % 32 == 0,
              "codes must be contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == N && K % scale.size(1) == 0 && (K / scale.size(1)) % 32 == 0,
              "scale must be contiguous fp32 [N, groups], a group a multiple of 32 inputs");
  check_x(x, K, bias, N);
  const int64_t group = K / scale.size(1);
  if (M >= DENSE_FROM)
    return dense_matmul(x, N, K, bias, [&](int64_t n0, int64_t n1) {
      return int8_dequantize_rows(codes, scale, n0, n1);
    });
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* q = codes.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t G = scale.size(1);
  at::parallel_for(0, N, std::max<int64_t>(1, GRAIN_BYTES / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
        dispatch_rows(std::min(MAX_ROWS, M - m0), [&](auto rows) {
          int8_row<decltype(rows)::value>(xp + m0 * K, K, group, q + n * K, s + n * G, b,
                                          yp + m0 * N, N, n);
        });
  });
  return y;
}

}  // namespace radixserve
