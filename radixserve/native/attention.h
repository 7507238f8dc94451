// What the two decode-attention kernels share (`dot_attention.cpp`: one query row per
// key set; `shared_attention.cpp`: many rows per key set): the view of a KV cache, the
// signature of one task (keys t0..t1-1 of one key set), dispatch by head_dim, e^x, and
// vectors of 16 and 8 floats (AVX-512 where the build machine has it, else AVX2 and FMA,
// else plain loops).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

namespace radixserve::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 256;  // every head_dim that is a multiple of 16 up to this
constexpr int64_t kChunk = 256;  // keys per task: enough work to amortise its setup

struct Cache {
  const float* data;
  int64_t block, row, head;  // strides, in floats
};

// One task: keys t0..t1-1 (at most kChunk) of one key set (`table` its blocks), for the
// `rows` query rows that read it (`q`: `[rows, Hkv * group, D]`). Writes per (row, query
// head), at `row * Hkv * group + head`, the running max m of the scaled scores, the sum l
// of their exponentials and the unnormalised output o (`D` floats each).
using ChunkFn = void (*)(const float* q, int64_t rows, const Cache& k, const Cache& v,
                         const int32_t* table, int64_t page, int64_t t0, int64_t t1,
                         int64_t Hkv, int64_t group, float scale, float* m, float* l, float* o);

// `Kernel<D>::run` for the head_dim D (a multiple of 16 up to kMaxHeadDim), else nullptr.
template <template <int> class Kernel, int... Units>
ChunkFn by_head_dim(int64_t D, std::integer_sequence<int, Units...>) {
  ChunkFn fn = nullptr;
  ((D == 16 * (Units + 1) ? (fn = &Kernel<16 * (Units + 1)>::run, 0) : 0), ...);
  return fn;
}

template <template <int> class Kernel>
ChunkFn by_head_dim(int64_t D) {
  return by_head_dim<Kernel>(D, std::make_integer_sequence<int, kMaxHeadDim / 16>{});
}

// dot_attention.cpp: the kernel for a few query rows per key set (a plain decode's one).
ChunkFn dot_chunk_fn(int64_t D);
// shared_attention.cpp: the kernel for many query rows per key set.
ChunkFn shared_chunk_fn(int64_t D);

#ifdef __AVX512F__
// e^x for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^7, times 2^n; below -87 (e^x under float's normal range) it is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(live, p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same e^x in 8 lanes: 2^n built in the exponent field (n >= -126 wherever x >= -87,
// so a normal float), and 0 below -87 by a blend.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.f))),
                       _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

constexpr int64_t kLanes = 16;  // queries in a full block of the lane kernel

// Vectors of W floats (16 or 8): the lane kernel's, one query per lane. Its full blocks
// of queries take 16 lanes, a kv head's last block of 8 or fewer takes 8 (half the
// arithmetic of 16, of which half would idle).
template <int W>
struct Lanes;

#if defined(__AVX512F__) && defined(__AVX512VL__)
template <>
struct Lanes<16> {
  using V = __m512;
  static V splat(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return exp_nonpositive(x); }  // x <= 0 or -inf
};

template <>
struct Lanes<8> {
  using V = __m256;
  static V splat(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) {  // the upper half of the widened vector is whatever: not kept
    return _mm512_castps512_ps256(exp_nonpositive(_mm512_castps256_ps512(x)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
template <>
struct Lanes<8> {
  using V = __m256;
  static V splat(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return exp_nonpositive(x); }  // x <= 0 or -inf
};

// 16 lanes as two vectors of 8.
template <>
struct Lanes<16> {
  using H = Lanes<8>;
  struct V {
    __m256 lo, hi;
  };
  static V splat(float x) { return {H::splat(x), H::splat(x)}; }
  static V load(const float* p) { return {H::load(p), H::load(p + 8)}; }
  static void store(float* p, V x) { H::store(p, x.lo), H::store(p + 8, x.hi); }
  static V fma(V a, V b, V c) { return {H::fma(a.lo, b.lo, c.lo), H::fma(a.hi, b.hi, c.hi)}; }
  static V add(V a, V b) { return {H::add(a.lo, b.lo), H::add(a.hi, b.hi)}; }
  static V sub(V a, V b) { return {H::sub(a.lo, b.lo), H::sub(a.hi, b.hi)}; }
  static V mul(V a, V b) { return {H::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static V max(V a, V b) { return {H::max(a.lo, b.lo), H::max(a.hi, b.hi)}; }
  static V exp(V x) { return {H::exp(x.lo), H::exp(x.hi)}; }
};
#else
template <int W>
struct Lanes {
  struct V {
    float x[W];
  };
  template <typename F>
  static V each(F f) {
    V r;
#pragma omp simd
    for (int i = 0; i < W; ++i) r.x[i] = f(i);
    return r;
  }
  static V splat(float x) { return each([&](int) { return x; }); }
  static V load(const float* p) { return each([&](int i) { return p[i]; }); }
  static void store(float* p, V x) {
    for (int i = 0; i < W; ++i) p[i] = x.x[i];
  }
  static V fma(V a, V b, V c) { return each([&](int i) { return a.x[i] * b.x[i] + c.x[i]; }); }
  static V add(V a, V b) { return each([&](int i) { return a.x[i] + b.x[i]; }); }
  static V sub(V a, V b) { return each([&](int i) { return a.x[i] - b.x[i]; }); }
  static V mul(V a, V b) { return each([&](int i) { return a.x[i] * b.x[i]; }); }
  static V max(V a, V b) {
    return each([&](int i) { return a.x[i] > b.x[i] ? a.x[i] : b.x[i]; });
  }
  static V exp(V x) { return each([&](int i) { return std::exp(x.x[i]); }); }
};
#endif

}  // namespace radixserve::attention
