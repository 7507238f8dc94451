// Weight-only quantized matmuls for the CPU with fp32 activations, exact up to rounding:
// y = x W^T + b, where W is held in groups of 32 inputs of a row (`model/quant/groups.py`):
// value = code * scale + low, scale and low fp32 per group, the codes
// - 4 bits (`q4_matmul`): two a byte, byte j of a group holding code j (low nibble) and
//   code j + 16 (high);
// - 8 bits (`int8_matmul`): one a byte, in input order.
// Every path rounds a weight's value once (a fused multiply-add of code, scale and low) and
// every product and sum is fp32, so a result differs from the fp32 matmul of the
// dequantized weight only in rounding (~1e-6 relative).
//
// Decode (a few rows of x) reads each weight once: a thread walks its share of output
// rows in memory order (codes, scales and lows each one linear stream) and applies every
// row of x to a group of weights while it is dequantized in registers. Many rows of x
// (prefill) dequantize the weight a chunk of output rows at a time and run the dense
// matmul, which is compute-bound there; both paths compute the same weight values.
//
// Threads: torch's own pool (`at::parallel_for`). The build compiles this file with
// -fopenmp so that the pool's inline OpenMP region is live, and links torch's libgomp,
// not the compiler's, so that one OpenMP runtime serves torch and this file.

#include "avx2.h"
#include "kernels.h"
#include "prefetch.h"
#include "x_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace radixserve {

constexpr int64_t GROUP = 32;
// GROUP_GEMV_ROWS (kernels.h), the rows of x from which dequantize + sgemm is faster:
// measured on the default model's projections (2 cores), the vector path wins at 64 rows by
// 25%, loses at 96 by 15%.
static_assert(GROUP_GEMV_ROWS == 80);
// Rows of x per pass over the weights: AVX-512's 32 registers hold one output row's sums
// for 8 of them (a group decoded once for a batch of 8), AVX2's two rows' for 4.
#if defined(__AVX512F__)
constexpr int PASS_ROWS = 8;
#else
constexpr int PASS_ROWS = MAX_ROWS;
#endif
constexpr int64_t DENSE_CHUNK_BYTES = 8 << 20;  // fp32 weight dequantized per sgemm call

// The weight bytes a thread should have at least: below this, waking torch's pool (10-70 us
// a call here with OMP_WAIT_POLICY=PASSIVE) costs more than the split saves. Measured on
// the default model's projections (0.2-1 MB each in q4), interleaved in one run: 32 KiB
// ran batch 1 in 7.5 ms against 9.1 ms with 512 KiB (one thread for most projections).
constexpr int64_t GRAIN_BYTES = 32 << 10;

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
constexpr int LANES = 16;  // a group of 32 is two runs of LANES

inline float lane_sum(const float (&v)[LANES]) {
  float sum = 0.f;
  for (int i = 0; i < LANES; ++i) sum += v[i];
  return sum;
}
#endif

// --- formats --------------------------------------------------------------------------

// A format: BYTES of codes per group of 32, and `decode`, the group's 32 values
// code * scale + low, into memory (the portable loops and the dense path), two registers
// (the AVX-512 GEMV) or four (the AVX2 GEMV), rounded alike.

struct Q4 {
  static constexpr int64_t BYTES = 16;
  static inline void decode(const uint8_t* q, float s, float l, float* w) {
    for (int i = 0; i < 16; ++i) {
      w[i] = std::fma(float(q[i] & 15), s, l);
      w[i + 16] = std::fma(float(q[i] >> 4), s, l);
    }
  }
#if defined(__AVX512F__)
  // The group's 16 values code * scale + low, then each weight looked up by its code (fewer
  // instructions than widening each code to a float): the permute reads only an index's
  // low 4 bits, so the low nibbles need no mask.
  static inline void decode(const uint8_t* q, float s, float l, __m512& w0, __m512& w1) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(s), _mm512_set1_ps(l));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    w0 = _mm512_permutexvar_ps(b, values);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // Codes widened to 32 bits, 8 at a time: low nibbles of bytes 0-7 and 8-15 (codes 0-15),
  // then their high nibbles (codes 16-31). These conversions bound the AVX2 GEMV on a Zen 3
  // EPYC (~3 ns a group, in cache or not). Rounding x to 16 bits per group and taking the
  // dot as integer multiply-adds ran 1.55x faster at one row, but moved the default
  // model's prompt logprobs by up to 1.2e-2 (a group's one large input coarsens the
  // others' steps), past the 1e-3 a quantized path is held to; so x stays fp32.
  static inline void decode(const uint8_t* q, float s, float l, __m256 (&w)[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)q);
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes);
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256 vs = _mm256_set1_ps(s), vl = _mm256_set1_ps(l);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), vs, vl);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), vs, vl);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vs, vl);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vs, vl);
  }
#endif
};

struct Q8 {
  static constexpr int64_t BYTES = 32;
  static inline void decode(const uint8_t* q, float s, float l, float* w) {
    for (int i = 0; i < 32; ++i) w[i] = std::fma(float(q[i]), s, l);
  }
#if defined(__AVX512F__)
  static inline void decode(const uint8_t* q, float s, float l, __m512& w0, __m512& w1) {
    const __m512 vs = _mm512_set1_ps(s), vl = _mm512_set1_ps(l);
    w0 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q))), vs, vl);
    w1 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))),
        vs, vl);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  static inline void decode(const uint8_t* q, float s, float l, __m256 (&w)[4]) {
    const __m256 vs = _mm256_set1_ps(s), vl = _mm256_set1_ps(l);
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * i)))),
          vs, vl);
  }
#endif
};

// --- the GEMV ---------------------------------------------------------------------------

// Output rows n..n + NR for `MB` rows of x (`x` [MB, K] at stride K):
// y[m * N + n + r] = sum_g sum_i (code_i * scale_g + low_g) x_i. A group's weights are
// dequantized in registers and applied to every row of x; two output rows at a time share
// the loads of x, and the two halves of a group accumulate apart, so that the FMA chains
// are short enough to keep up with memory.
template <typename F, int NR, int MB>
inline void group_rows(const float* x, int64_t K, const uint8_t* codes, const float* scale,
                       const float* low, const float* bias, float* y, int64_t N, int64_t n) {
  const int64_t G = K / GROUP;
#if defined(__AVX512F__)
  __m512 acc[NR][MB][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 w[NR][2];
    for (int r = 0; r < NR; ++r)
      F::decode(codes + (r * G + g) * F::BYTES, scale[r * G + g], low[r * G + g], w[r][0],
                w[r][1]);
    for (int m = 0; m < MB; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * K + g * GROUP);
      const __m512 x1 = _mm512_loadu_ps(x + m * K + g * GROUP + 16);
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
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 has 16 vector registers: one row's group decoded (4) and applied to every row of
  // x before the next row's, and A sums per (row, x row), two where they fit (shorter FMA
  // chains at few rows of x), else one.
  constexpr int A = NR * MB <= 4 ? 2 : 1;
  __m256 acc[NR][MB][A];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g)
    for (int r = 0; r < NR; ++r) {
      __m256 w[4];
      F::decode(codes + (r * G + g) * F::BYTES, scale[r * G + g], low[r * G + g], w);
      for (int m = 0; m < MB; ++m) {
        const float* xg = x + m * K + g * GROUP;
        for (int i = 0; i < 4; ++i)
          acc[r][m][i * A / 4] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i),
                                                 acc[r][m][i * A / 4]);
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[r][m][0];
      if constexpr (A == 2) sum = _mm256_add_ps(sum, acc[r][m][1]);
      y[m * N + n + r] = hsum(sum) + (bias ? bias[n + r] : 0.f);
    }
#else
  // Portable loops with LANES independent sums per row of x: the compiler vectorizes them
  // for the machine's own vector width without reordering a sum.
  for (int r = 0; r < NR; ++r) {
    float acc[MB][LANES] = {};
    float w[GROUP];
    for (int64_t g = 0; g < G; ++g) {
      F::decode(codes + (r * G + g) * F::BYTES, scale[r * G + g], low[r * G + g], w);
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < GROUP; h += LANES)
          for (int i = 0; i < LANES; ++i)
            acc[m][i] = std::fma(w[h + i], x[m * K + g * GROUP + h + i], acc[m][i]);
    }
    for (int m = 0; m < MB; ++m) y[m * N + n + r] = lane_sum(acc[m]) + (bias ? bias[n + r] : 0.f);
  }
#endif
}

// --- the dense path ---------------------------------------------------------------------

// fp32 [n1 - n0, K] values of rows n0..n1, as the GEMV computes them.
template <typename F>
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                           const at::Tensor& low, int64_t n0, int64_t n1) {
  const int64_t G = scale.size(1), K = G * GROUP;
  at::Tensor out = at::empty({n1 - n0, K}, scale.options());
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *l = low.data_ptr<float>();
  float* w = out.data_ptr<float>();
  at::parallel_for(n0, n1, std::max<int64_t>(1, GRAIN_BYTES / (G * F::BYTES)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t g = 0; g < G; ++g)
        F::decode(q + (n * G + g) * F::BYTES, s[n * G + g], l[n * G + g],
                  w + (n - n0) * K + g * GROUP);
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

// --- the GEMV's work units ---------------------------------------------------------------

// Work units are pairs of output rows (the last one alone where N is odd).
int64_t group_gemv_units(int64_t N) { return (N + 1) / 2; }

// How far ahead of the weight rows it works on a thread asks for the rows it reads next
// (codes, scales and lows: three streams). Streamed from memory (the cache flushed, as a
// step's layers flush it), the hardware's prefetchers alone held the default model's int8
// LM head (35 MB, 2 threads) at 17 GB/s, 34 with this (a Zen 4 EPYC whose plain read
// reaches 30-43). The fp32 GEMV (one stream a row) gained nothing steady.
constexpr int64_t PREFETCH_BYTES = 4 << 10;

template <typename F>
void group_gemv(const Gemv& g, const uint8_t* q, const float* s, const float* l, int64_t begin,
                int64_t end) {
  const int64_t M = g.M, K = g.K, N = g.N, G = K / GROUP;
  const int64_t pair_codes = 2 * G * F::BYTES, pair_scales = 2 * G * int64_t(sizeof(float));
  const int64_t ahead = 2 * std::max<int64_t>(1, PREFETCH_BYTES / (pair_codes + 2 * pair_scales));
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t n = 2 * pair;
    if (n + ahead + 2 <= N) {
      prefetch(q + (n + ahead) * G * F::BYTES, pair_codes);
      prefetch(s + (n + ahead) * G, pair_scales);
      prefetch(l + (n + ahead) * G, pair_scales);
    }
    for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS)
      dispatch_rows<PASS_ROWS>(M - m0, [&](auto rows) {
        constexpr int MB = decltype(rows)::value;
        const float* xm = g.x + m0 * K;
        float* ym = g.y + m0 * N;
        if constexpr (MB <= MAX_ROWS) {
          if (n + 1 < N)  // two output rows share each load of x
            return group_rows<F, 2, MB>(xm, K, q + n * G * F::BYTES, s + n * G, l + n * G,
                                        g.bias, ym, N, n);
        }
        // One output row at a time: the same sums, in fewer registers.
        for (int64_t r = n; r < std::min(N, n + 2); ++r)
          group_rows<F, 1, MB>(xm, K, q + r * G * F::BYTES, s + r * G, l + r * G, g.bias, ym,
                               N, r);
      });
  }
}

void q4_gemv(const Gemv& g, const uint8_t* codes, const float* scale, const float* low,
             int64_t begin, int64_t end) {
  group_gemv<Q4>(g, codes, scale, low, begin, end);
}

void int8_gemv(const Gemv& g, const uint8_t* codes, const float* scale, const float* low,
               int64_t begin, int64_t end) {
  group_gemv<Q8>(g, codes, scale, low, begin, end);
}

// --- the entry points -------------------------------------------------------------------

void check_x(const at::Tensor& x, int64_t K, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              x.device().is_cpu(), "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weight ", K);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bias must be a contiguous fp32 [", N, "]");
  }
}

template <typename F>
at::Tensor group_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& low, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              codes.size(1) % F::BYTES == 0,
              "codes must be contiguous uint8 [N, ", F::BYTES, " bytes per 32 inputs]");
  const int64_t N = codes.size(0), G = codes.size(1) / F::BYTES, K = G * GROUP, M = x.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && low.scalar_type() == at::kFloat &&
              scale.is_contiguous() && low.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == N && scale.size(1) == G && low.sizes() == scale.sizes(),
              "scale and low must be contiguous fp32 [N, K / 32]");
  check_x(x, K, bias, N);
  if (M >= GROUP_GEMV_ROWS)
    return dense_matmul(x, N, K, bias, [&](int64_t n0, int64_t n1) {
      return dequantize_rows<F>(codes, scale, low, n0, n1);
    });
  at::Tensor y = at::empty({M, N}, x.options());
  const Gemv g{x.data_ptr<float>(), y.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, M, K, N};
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *l = low.data_ptr<float>();
  at::parallel_for(0, group_gemv_units(N), std::max<int64_t>(1, GRAIN_BYTES / (2 * G * F::BYTES)),
                   [&](int64_t begin, int64_t end) { group_gemv<F>(g, q, s, l, begin, end); });
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low, const c10::optional<at::Tensor>& bias) {
  return group_matmul<Q4>(x, codes, scale, low, bias);
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& low, const c10::optional<at::Tensor>& bias) {
  return group_matmul<Q8>(x, codes, scale, low, bias);
}

at::Tensor q4_dequantize_rows(const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& low, int64_t n0, int64_t n1) {
  return dequantize_rows<Q4>(codes, scale, low, n0, n1);
}

}  // namespace radixserve
