// y = x W^T + b for a dense fp32 weight: decode's projections and LM head.
//
// At a few rows of x a step is a read of the weights and nothing else, and torch's paths
// are built for many rows: on the default model's projections (cold weights, 2 cores,
// interleaved runs) oneDNN's packed GEMM took 1.1-1.5x this kernel's time at one row and
// 1.4-1.8x at 8-16, sgemm 1.0-1.3x and 1.4-1.6x. Up to F32_GEMV_ROWS rows this kernel walks
// each thread's share of output rows in memory order, applying every row of x to a weight
// vector while it is in a register, so the weight is read once: up to four rows of x one
// weight row at a time (the loads one stream), past four eight weight rows at a time
// (AVX-512; four on AVX2). Sums are in fp32 in another order than sgemm's: results differ
// from `torch.nn.functional.linear` in rounding only (~1e-6 relative).

#include "avx2.h"
#include "kernels.h"
#include "x_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace radixserve {

namespace {

// F32_GEMV_ROWS (kernels.h), the rows of x up to which this kernel beats sgemm. Measured as
// a decode step meets the weights (30 layers of the default model's projections, then its
// LM head, each read cold; 2 cores, alternated, best of 5), sgemm's time over this kernel's
// was, layers / LM head: 1.51x / 2.27x at 40 rows, 1.40x / 2.08x at 48, 1.11x / 1.40x at
// 128, 1.00x / 1.12x at 192 (AVX-512 build, MKL); 1.25x / 1.38x at 128 and 1.15x / 1.22x
// at 192 in the AVX2 build against MKL held to AVX2. With the weights hot in the cache
// sgemm is ahead from 48 rows, but a step's weights never are.
static_assert(F32_GEMV_ROWS == 128);
// Up to MAX_ROWS rows of x a pass takes one weight row (`gemv_block<1, MAX_ROWS>`), so a
// thread's loads are one stream through its rows, which the hardware prefetchers follow at
// a plain read's speed. Passes of four weight rows, four streams each as short as a row
// (2-6 KB) and restarting every pass, read slower: the LM head (113 MB, cold, 2 cores,
// alternated) at 16-21 GB/s at one row of x against 24-31 one row at a time, 15-17 against
// 20-27 at four rows. Each output's sum is the same either way (bit for bit).
#if defined(__AVX512F__)
// From MAX_ROWS + 1 rows of x a pass takes 8 weight rows and 3 rows of x (24 sums of the
// 32 registers), not 4 and 4: a row of x, which comes from L2 once x outgrows L1, then
// serves 8 weight rows per load instead of 4. The same sums in the same order (bit for bit);
// 30 layers of the default model's projections, cold, 2 cores, alternated: 1.15x faster at
// 8 rows, 1.10x at 16-48, 1.08x at 96-128; at 1-4 rows nothing changes.
constexpr int WIDE_R = 8, WIDE_MB = 3;
#else
constexpr int WIDE_R = MAX_ROWS, WIDE_MB = MAX_ROWS;  // AVX2's 16 registers hold no more
#endif
constexpr int64_t UNIT = WIDE_R;  // output rows per work unit, each a thread's whole
// Weight bytes a thread should have at least: below this, waking torch's pool (10-70 us a
// call with OMP_WAIT_POLICY=PASSIVE) costs more than the split saves.
constexpr int64_t GEMV_GRAIN_BYTES = 64 << 10;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Output rows n..n + R for `MB` (at most 2) rows of x, in AVX2's 16 vector registers: R x MB
// x A sums of 8 lanes, each x vector loaded once per step and each weight vector once. One
// row of x keeps two sums per weight row (A = 2), whose FMA chains are then half as long.
template <int R, int MB>
inline void gemv_avx2(const float* x, int64_t K, const float* w, const float* bias, float* y,
                      int64_t N, int64_t n) {
  constexpr int A = MB == 1 ? 2 : 1;
  __m256 acc[R][MB][A];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * A <= K; k += 8 * A) {
    for (int a = 0; a < A; ++a) {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k + 8 * a);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_loadu_ps(w + r * K + k + 8 * a);
        for (int m = 0; m < MB; ++m) acc[r][m][a] = _mm256_fmadd_ps(wv, xv[m], acc[r][m][a]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      __m256 total = acc[r][m][0];
      if constexpr (A == 2) total = _mm256_add_ps(total, acc[r][m][1]);
      float sum = hsum(total);
      for (int64_t j = k; j < K; ++j) sum += w[r * K + j] * x[m * K + j];
      y[m * N + n + r] = sum + (bias ? bias[n + r] : 0.f);
    }
}
#endif

// Output rows n..n + R for `MB` rows of x.
template <int R, int MB>
inline void gemv_rows(const float* x, int64_t K, const float* w, const float* bias, float* y,
                      int64_t N, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + r * K + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, w + r * K + k);
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * K + k), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.f);
#elif defined(__AVX2__) && defined(__FMA__)
  // Two rows of x at a time: four would need more registers than AVX2 has. The second
  // pass reads the R weight rows from the cache the first brought them to.
  gemv_avx2<R, MB == 1 ? 1 : 2>(x, K, w, bias, y, N, n);
  if constexpr (MB > 2) gemv_avx2<R, MB - 2>(x + 2 * K, K, w, bias, y + 2 * N, N, n);
#else
  // LANES independent sums per (row, x row): the compiler vectorizes them for the
  // machine's own width.
  constexpr int LANES = 16;
  for (int r = 0; r < R; ++r) {
    float acc[MB][LANES] = {};
    const float* wr = w + r * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES)
      for (int m = 0; m < MB; ++m)
        for (int i = 0; i < LANES; ++i) acc[m][i] += wr[k + i] * x[m * K + k + i];
    for (int m = 0; m < MB; ++m) {
      float sum = 0.f;
      for (int i = 0; i < LANES; ++i) sum += acc[m][i];
      for (int64_t j = k; j < K; ++j) sum += wr[j] * x[m * K + j];
      y[m * N + n + r] = sum + (bias ? bias[n + r] : 0.f);
    }
  }
#endif
}

// Output rows n0..n1 for every row of x: passes of R weight rows by MB rows of x.
template <int R, int MB>
inline void gemv_block(const Gemv& g, const float* weight, int64_t n0, int64_t n1) {
  const int64_t M = g.M, K = g.K, N = g.N;
  for (int64_t n = n0; n < n1; n += R)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      dispatch_rows<R>(std::min<int64_t>(R, n1 - n), [&](auto r) {
        dispatch_rows<MB>(M - m0, [&](auto mb) {
          gemv_rows<decltype(r)::value, decltype(mb)::value>(g.x + m0 * K, K, weight + n * K,
                                                             g.bias, g.y + m0 * N, N, n);
        });
      });
}

}  // namespace

int64_t f32_gemv_units(int64_t N) { return (N + UNIT - 1) / UNIT; }

void f32_gemv(const Gemv& g, const float* weight, int64_t begin, int64_t end) {
  for (int64_t blk = begin; blk < end; ++blk) {
    const int64_t n0 = blk * UNIT, n1 = std::min(n0 + UNIT, g.N);
    if (g.M > MAX_ROWS)
      gemv_block<WIDE_R, WIDE_MB>(g, weight, n0, n1);
    else
      gemv_block<1, MAX_ROWS>(g, weight, n0, n1);
  }
}

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && weight.device().is_cpu(),
              "weight must be a contiguous 2-D fp32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, bias, N);
  if (M > F32_GEMV_ROWS) return bias ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  at::Tensor y = at::empty({M, N}, x.options());
  const Gemv g{x.data_ptr<float>(), y.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, M, K, N};
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, f32_gemv_units(N), std::max<int64_t>(1, GEMV_GRAIN_BYTES / (UNIT * K * 4)),
                   [&](int64_t begin, int64_t end) { f32_gemv(g, w, begin, end); });
  return y;
}

}  // namespace radixserve
