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

// The three primitives of a tile: a query's scores against 16 keys (`scores16`), the
// softmax's exponentials (`exp_shifted`), and the weighted sums of values for Q queries
// (`accumulate_queries`). AVX-512 where the build machine has it (`-march=native`), else
// AVX2 and FMA, else plain loops (auto-vectorized), these two a dot product per key and a
// pass over the values per query.
#ifdef __AVX512F__
// Queries whose outputs `accumulate_queries` keeps in registers beside a value row.
template <int D>
constexpr int kAccQueries = std::max(1, 28 / (D / 16) - 1);

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

// The scores of one query against keys[0..16) (`keys[j] + offset`; those past `count`
// are scored too, and ignored), scaled, into s[0..16): 16 dot products, their sums taken
// together by a transposing tree of adds (45 vector operations, where 16 horizontal sums
// would take some 130).
template <int D>
inline void scores16(const float* q, const float* const* keys, int64_t, int64_t offset,
                     float scale, float* s) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) {
    const float* k = keys[j] + offset;
    a[j] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int i = 16; i < D; i += 16)
      a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a[j]);
  }
  __m512 t[8], u[4];
  for (int p = 0; p < 8; ++p)
    t[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]),
                         _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
  for (int p = 0; p < 4; ++p) {
    const __m512d x = _mm512_castps_pd(t[2 * p]), y = _mm512_castps_pd(t[2 * p + 1]);
    u[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                                   _mm512_shuffle_f32x4(w01, w23, 0xdd));
  _mm512_storeu_ps(s, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
}

// For Q queries at once: o_i = alpha_i * o_i + sum_j p_i[j] * rows[j][offset..offset+D),
// each value vector loaded once for all of them (`p_i` = p + i * stride).
template <int D, int Q>
inline void accumulate_queries(float* const* o, const float* alpha, const float* p,
                               int64_t stride, const float* const* rows, int64_t offset,
                               int64_t n) {
  __m512 acc[Q][D / 16];
  for (int i = 0; i < Q; ++i)
    for (int d = 0; d < D / 16; ++d)
      acc[i][d] = _mm512_mul_ps(_mm512_loadu_ps(o[i] + 16 * d), _mm512_set1_ps(alpha[i]));
  for (int64_t j = 0; j < n; ++j) {
    const float* row = rows[j] + offset;
    __m512 v[D / 16];
    for (int d = 0; d < D / 16; ++d) v[d] = _mm512_loadu_ps(row + 16 * d);
    for (int i = 0; i < Q; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * stride + j]);
      for (int d = 0; d < D / 16; ++d) acc[i][d] = _mm512_fmadd_ps(w, v[d], acc[i][d]);
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int d = 0; d < D / 16; ++d) _mm512_storeu_ps(o[i] + 16 * d, acc[i][d]);
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

#if !defined(__AVX512F__)
template <int D>
constexpr int kAccQueries = 1;

template <int D>
inline void scores16(const float* q, const float* const* keys, int64_t count, int64_t offset,
                     float scale, float* s) {
  for (int64_t j = 0; j < count; ++j) s[j] = dot<D>(q, keys[j] + offset) * scale;
}

template <int D, int Q>
inline void accumulate_queries(float* const* o, const float* alpha, const float* p,
                               int64_t stride, const float* const* rows, int64_t offset,
                               int64_t n) {
  for (int i = 0; i < Q; ++i) accumulate<D>(o[i], alpha[i], p + i * stride, rows, offset, n);
}
#endif

// `accumulate_queries` for q (1..kAccQueries) queries, q chosen at run time.
template <int D, int Q = 1>
inline void accumulate_some(int64_t q, float* const* o, const float* alpha, const float* p,
                            int64_t stride, const float* const* rows, int64_t offset,
                            int64_t n) {
  if constexpr (Q < kAccQueries<D>) {
    if (q > Q) return accumulate_some<D, Q + 1>(q, o, alpha, p, stride, rows, offset, n);
  }
  accumulate_queries<D, Q>(o, alpha, p, stride, rows, offset, n);
}

// The dot-product kernel (`ChunkFn`). Per tile of keys and kv head: each query's scores
// (one dot product per key), its softmax rescaled, then the values weighted for several
// queries at once. The next tile's keys and values are asked for into L2 as this tile's
// are scored, head by head: they lie in pages anywhere in the pool, where the hardware's
// prefetchers start cold, and one burst of the whole tile's lines (48 KiB for the default
// model) stalled the loads behind it. Against one dot product, one horizontal sum and one
// pass over the values per (key, query) and the burst, on the default model's heads (1,024
// keys, 30 layers' caches read cold, 1 thread): 1.2x faster with the caches hot, 1.1x cold.
template <int D>
struct DotKernel {
  static void run(const float* q, int64_t rows, const Cache& k, const Cache& v,
                  const int32_t* table, int64_t page, int64_t t0, int64_t t1, int64_t Hkv,
                  int64_t group, float scale, float* m, float* l, float* o) {
    // The key and value rows of this tile and the next, each tile's found once: as the
    // next one while its predecessor is scored (for its prefetches), then read.
    const float* krows[2][kTile];
    const float* vrows[2][kTile];
    auto locate = [&](int64_t first, int64_t count, int buffer) {
      for (int64_t j = 0; j < count; ++j) {
        const int64_t t = first + j, blk = table[t / page], r = t % page;
        krows[buffer][j] = k.data + blk * k.block + r * k.row;
        vrows[buffer][j] = v.data + blk * v.block + r * v.row;
      }
    };
    const int64_t H = Hkv * group;
    int now = 0;
    locate(t0, std::min(kTile, t1 - t0), now);
    for (int64_t tile = t0; tile < t1; tile += kTile, now = 1 - now) {
      const int64_t n = std::min(kTile, t1 - tile);
      const int64_t next = std::min(kTile, t1 - tile - kTile);  // keys of the next tile
      locate(tile + kTile, next, 1 - now);
      const float** krow = krows[now];
      const float* const* vrow = vrows[now];
      const float* const* knext = krows[1 - now];
      const float* const* vnext = vrows[1 - now];
      // Keys past n score as copies of the last (their scores are not used), so that
      // every key is scored 16 at a time.
      for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) krow[j] = krow[n - 1];
      constexpr int64_t QC = 8;  // queries scored, then accumulated, together (a set with
                                 // more per kv head takes the lane kernel, but for one row)
      float scores[QC][kTile];
      float alpha[QC];
      float* outs[QC];
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t i0 = 0; i0 < rows * group; i0 += QC) {
          const int64_t qc = std::min(QC, rows * group - i0);
          for (int64_t c = 0; c < qc; ++c) {
            const int64_t i = i0 + c, head = i / group * H + h * group + i % group;
            for (int64_t j = 0; j < n; j += 16) {
              if (c == 0)  // the next tile's keys and values of this head, as these are read
                for (int64_t jn = j; jn < std::min(next, j + 16); ++jn) {
                  prefetch<kL2>(knext[jn] + h * k.head, D * 4);
                  prefetch<kL2>(vnext[jn] + h * v.head, D * 4);
                }
              scores16<D>(q + head * D, krow + j, std::min<int64_t>(16, n - j), h * k.head,
                          scale, scores[c] + j);
            }
            float tile_max = kNegInf;
            for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, scores[c][j]);
            const float m_new = std::max(m[head], tile_max);
            alpha[c] = std::exp(m[head] - m_new);  // 0 on the first tile (m = -inf)
            l[head] = l[head] * alpha[c] + exp_shifted(scores[c], n, m_new);
            m[head] = m_new;
            outs[c] = o + head * D;
          }
          for (int64_t c = 0; c < qc; c += kAccQueries<D>)
            accumulate_some<D>(std::min<int64_t>(kAccQueries<D>, qc - c), outs + c, alpha + c,
                               scores[c], kTile, vrow, h * v.head, n);
        }
      }
    }
  }
};

}  // namespace

ChunkFn dot_chunk_fn(int64_t D) { return by_head_dim<DotKernel>(D); }

}  // namespace radixserve::attention
