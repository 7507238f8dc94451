// Decode attention on the CPU straight from the KV blocks: no gather, no padding.
//
// One query token per sequence; its keys are positions start[b] .. kv_len[b]-1 of the
// sequence, position t in block block_tables[b][t / page] at row t % page. The caches are
// `[num_blocks, page, num_kv_heads, head_dim]` with any strides but a contiguous head_dim,
// so the paged pool's blocks and the virtual layout's block-major views are read in
// place, each key row once for all the query heads that share it (grouped-query).
//
// Work is split over (sequence, chunk of keys) so that one sequence still fills every
// thread; a task reads each of its key rows once, all kv heads, and keeps per query head
// an online softmax (running max, sum, output), rescaled once per tile of keys. The
// chunks of a sequence are merged at the end. Accumulation is fp32.
#include "kernels.h"

#include <ATen/Parallel.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kChunk = 256;  // keys per task: enough work to amortise its setup
constexpr int64_t kTile = 32;    // keys scored before one rescale of the running outputs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The three primitives of a tile, for one query head: scores (dot products), the
// softmax's exponentials, and the weighted sum of values. AVX-512 where the build
// machine has it (`-march=native`), plain loops (auto-vectorized) elsewhere.
#ifdef __AVX512F__
template <int D>
inline float dot(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int i = 16; i < D; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
  return _mm512_reduce_add_ps(acc);
}

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

struct Cache {
  const float* data;
  int64_t block, row, head;  // strides, in floats
};

// One task: keys t0..t1-1 of one sequence, every kv head; writes per query head the
// running max m, sum l and unnormalised output o ([H, D]).
template <int D>
void attend_chunk(const float* q, const Cache& k, const Cache& v, const int32_t* table,
                  int64_t page, int64_t t0, int64_t t1, int64_t Hkv, int64_t group,
                  float scale, float* m, float* l, float* o) {
  float scores[kTile];
  const float* krow[kTile];
  const float* vrow[kTile];
  for (int64_t tile = t0; tile < t1; tile += kTile) {
    const int64_t n = std::min(kTile, t1 - tile);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = tile + j, blk = table[t / page], r = t % page;
      krow[j] = k.data + blk * k.block + r * k.row;
      vrow[j] = v.data + blk * v.block + r * v.row;
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
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

using ChunkFn = void (*)(const float*, const Cache&, const Cache&, const int32_t*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*);

// Every head_dim that is a multiple of 16 up to 256 (`kMaxHeadDim`).
constexpr int64_t kMaxHeadDim = 256;

template <int... Units>
ChunkFn chunk_fn_of(int64_t D, std::integer_sequence<int, Units...>) {
  ChunkFn fn = nullptr;
  ((D == 16 * (Units + 1) ? (fn = attend_chunk<16 * (Units + 1)>, 0) : 0), ...);
  return fn;
}

ChunkFn chunk_fn(int64_t D) {
  return chunk_fn_of(D, std::make_integer_sequence<int, kMaxHeadDim / 16>{});
}

}  // namespace

// q `[B, H, D]`; returns the output `[B, H, D]` and the natural log-sum-exp `[B, H]`,
// both fp32 (-inf log-sum-exp and zero output for a sequence with no keys).
namespace radixserve {

std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor starts, torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat,
              "k_cache and v_cache must be float32 [blocks, page, kv_heads, head_dim] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the caches' head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous() &&
                  starts.scalar_type() == torch::kLong && kv_lens.scalar_type() == torch::kLong,
              "block_tables int32 (contiguous), starts and kv_lens int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t page = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head_dim or head counts do not match");
  const ChunkFn attend = chunk_fn(D);
  TORCH_CHECK(attend != nullptr, "decode_attention: head_dim ", D,
              " is not a multiple of 16 up to ", kMaxHeadDim);
  const int64_t group = H / Hkv, width = block_tables.size(1);
  const Cache k{k_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const Cache v{v_cache.data_ptr<float>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  auto starts_c = starts.contiguous(), lens_c = kv_lens.contiguous();
  const int64_t* start = starts_c.data_ptr<int64_t>();
  const int64_t* len = lens_c.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();

  // Tasks: each sequence's keys cut into chunks (one task for a sequence without keys).
  std::vector<int64_t> first_task(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b] >= 0 && start[b] <= len[b] && len[b] <= width * page,
                "sequence ", b, "'s keys ", start[b], "..", len[b], " are outside its table");
    const int64_t chunks = std::max<int64_t>(1, (len[b] - start[b] + kChunk - 1) / kChunk);
    first_task[b + 1] = first_task[b] + chunks;
  }
  const int64_t tasks = first_task[B];
  auto part_m = torch::full({tasks, H}, kNegInf);
  auto part_l = torch::zeros({tasks, H});
  auto part_o = torch::zeros({tasks, H, D});
  float* pm = part_m.data_ptr<float>();
  float* pl = part_l.data_ptr<float>();
  float* po = part_o.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = std::upper_bound(first_task.begin(), first_task.end(), task) -
                        first_task.begin() - 1;
      const int64_t t0 = start[b] + (task - first_task[b]) * kChunk;
      const int64_t t1 = std::min(len[b], t0 + kChunk);
      attend(qp + b * H * D, k, v, tables + b * width, page, t0, t1, Hkv, group, fscale,
             pm + task * H, pl + task * H, po + task * H * D);
    }
  });

  auto out = torch::empty({B, H, D});
  auto lse = torch::empty({B, H});
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, head = bh % H;
      float M = kNegInf;
      for (int64_t c = first_task[b]; c < first_task[b + 1]; ++c) M = std::max(M, pm[c * H + head]);
      float* y = op + bh * D;
      std::fill(y, y + D, 0.f);
      if (M == kNegInf) {
        lp[bh] = M;
        continue;
      }
      float L = 0;
      for (int64_t c = first_task[b]; c < first_task[b + 1]; ++c) {
        const float w = std::exp(pm[c * H + head] - M);
        L += w * pl[c * H + head];
        const float* part = po + (c * H + head) * D;
        for (int64_t d = 0; d < D; ++d) y[d] += w * part[d];
      }
      for (int64_t d = 0; d < D; ++d) y[d] /= L;
      lp[bh] = M + std::log(L);
    }
  });
  return {out, lse};
}

}  // namespace radixserve
