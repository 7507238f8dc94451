// The dot-product kernel of `decode_attention` (`attention.h`'s `ChunkFn`): a few query
// rows (a plain decode's one) against a key set, each (key, query) score one dot product,
// with a running softmax per query rescaled once per tile of keys. Many rows per key set
// take the lane kernel instead (`shared_attention.cpp`).
#include "attention.h"
#include "avx2.h"
#include "prefetch.h"

#include <algorithm>
#include <cmath>

namespace radixserve::attention {

namespace {

constexpr int64_t kTile = 32;  // keys scored before one rescale of the running outputs

// The three primitives of a tile, for one query head: scores (dot products), the
// softmax's exponentials, and the weighted sum of values. AVX-512 where the build
// machine has it (`-march=native`), else AVX2 and FMA, else plain loops (auto-vectorized).
#ifdef __AVX512F__
template <int D>
inline float dot(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int i = 16; i < D; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// s[j] = e^(s[j] - m) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = n - j >= 16 ? 0xffff : (1u << (n - j)) - 1;
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + j), _mm512_set1_ps(m));
    const __m512 e = _mm512_maskz_mov_ps(in, exp_nonpositive(x));
    _mm512_mask_storeu_ps(s + j, in, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// o = alpha * o + sum_j p[j] * rows[j][offset..offset+D)
template <int D>
inline void accumulate(float* o, float alpha, const float* p, const float* const* rows,
                       int64_t offset, int64_t n) {
  __m512 acc[D / 16];
  for (int i = 0; i < D / 16; ++i)
    acc[i] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * i), _mm512_set1_ps(alpha));
  for (int64_t j = 0; j < n; ++j) {
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* row = rows[j] + offset;
    for (int i = 0; i < D / 16; ++i)
      acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 16 * i), acc[i]);
  }
  for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// Two sums of 8 lanes (D is a multiple of 16): two FMA chains, half as long.
template <int D>
inline float dot(const float* q, const float* k) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
  for (int i = 16; i < D; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
  }
  return radixserve::hsum(_mm256_add_ps(a0, a1));
}

inline float exp_shifted(float* s, int64_t n, float m) {
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = radixserve::hsum(sum);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    total += s[j];
  }
  return total;
}

template <int D>
inline void accumulate(float* o, float alpha, const float* p, const float* const* rows,
                       int64_t offset, int64_t n) {
  __m256 acc[D / 8];
  for (int i = 0; i < D / 8; ++i)
    acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * i), _mm256_set1_ps(alpha));
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* row = rows[j] + offset;
    for (int i = 0; i < D / 8; ++i)
      acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * i), acc[i]);
  }
  for (int i = 0; i < D / 8; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}
#else
template <int D>
inline float dot(const float* q, const float* k) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

template <int D>
inline void accumulate(float* o, float alpha, const float* p, const float* const* rows,
                       int64_t offset, int64_t n) {
  for (int d = 0; d < D; ++d) o[d] *= alpha;
  for (int64_t j = 0; j < n; ++j)
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] += p[j] * rows[j][offset + d];
}
#endif

// The dot-product kernel (`ChunkFn`): per tile of keys and query, one dot product per key.
template <int D>
struct DotKernel {
  static void run(const float* q, int64_t rows, const Cache& k, const Cache& v,
                  const int32_t* table, int64_t page, int64_t t0, int64_t t1, int64_t Hkv,
                  int64_t group, float scale, float* m, float* l, float* o) {
    float scores[kTile];
    const float* krow[kTile];
    const float* vrow[kTile];
    const int64_t H = Hkv * group;
    for (int64_t tile = t0; tile < t1; tile += kTile) {
      const int64_t n = std::min(kTile, t1 - tile);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = tile + j, blk = table[t / page], r = t % page;
        krow[j] = k.data + blk * k.block + r * k.row;
        vrow[j] = v.data + blk * v.block + r * v.row;
      }
      // The next tile's keys and values, asked for into L2 while this one is scored: they
      // lie in pages anywhere in the pool, where the hardware's prefetchers start cold (a
      // tile's keys and values, 48 KiB for the default model, would not fit L1 beside it).
      for (int64_t t = tile + kTile; t < std::min(t1, tile + 2 * kTile); ++t) {
        const int64_t blk = table[t / page], r = t % page;
        for (int64_t h = 0; h < Hkv; ++h) {
          prefetch<kL2>(k.data + blk * k.block + r * k.row + h * k.head, D * 4);
          prefetch<kL2>(v.data + blk * v.block + r * v.row + h * v.head, D * 4);
        }
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t i = 0; i < rows * group; ++i) {
          const int64_t head = i / group * H + h * group + i % group;
          const float* qh = q + head * D;
          float tile_max = kNegInf;
          for (int64_t j = 0; j < n; ++j) {
            scores[j] = dot<D>(qh, krow[j] + h * k.head) * scale;
            tile_max = std::max(tile_max, scores[j]);
          }
          const float m_new = std::max(m[head], tile_max);
          const float alpha = std::exp(m[head] - m_new);  // 0 on the first tile (m = -inf)
          l[head] = l[head] * alpha + exp_shifted(scores, n, m_new);
          m[head] = m_new;
          accumulate<D>(o + head * D, alpha, scores, vrow, h * v.head, n);
        }
      }
    }
  }
};

}  // namespace

ChunkFn dot_chunk_fn(int64_t D) { return by_head_dim<DotKernel>(D); }

}  // namespace radixserve::attention
