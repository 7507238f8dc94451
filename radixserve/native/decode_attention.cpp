// Decode attention on the CPU straight from the KV blocks: no gather, no padding.
//
// Each key set b is positions start[b] .. kv_len[b]-1 of a sequence, position t in block
// block_tables[b][t / page] at row t % page; its query rows are one decode token (plain
// decode: one row per set) or, for a shared run of tree attention, every token of the
// group that shares it. A row may read several sets (tree attention: its own part and a
// run per level), and its output is over the keys of all of them. The caches are
// `[num_blocks, page, num_kv_heads, head_dim]` with any strides but a contiguous
// head_dim, so the paged pool's blocks and the virtual layout's block-major views are
// read in place, each key row once for all the query heads and rows that read it.
//
// Work is split over (key set, chunk of keys) so that one set still fills every thread; a
// task reads each of its key rows once, all kv heads, and keeps per query an online
// softmax (running max, sum, output), rescaled once per tile of keys. A set with few
// queries per kv head takes the dot-product kernel here; one with many, the kernel of
// `shared_attention.cpp`, which puts queries in vector lanes. The partial states of a
// row (every chunk of every set it reads) are merged at the end, by log-sum-exp.
// Accumulation is fp32.
#include "attention.h"
#include "avx2.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace radixserve::attention;

constexpr int64_t kTile = 32;    // keys scored before one rescale of the running outputs
// Queries per kv head (rows x group) from which a set of several rows takes the lane
// kernel: it then fills at least half of each vector, and its scores need no horizontal
// sums. A plain decode (one row) keeps the dot kernel whatever its group.
constexpr int64_t kLaneQueries = kLanes / 2;

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

namespace radixserve {

// q `[R, H, D]`; returns the output `[R, H, D]` and the natural log-sum-exp `[R, H]`, both
// fp32, each row's over the keys of every set it reads (-inf and zeros for a row that
// reads none). Which rows set b reads: row b (no `row_offsets`); rows row_offsets[b] ..
// row_offsets[b+1]-1 (no `rows`); or rows[row_offsets[b] .. row_offsets[b+1]-1], a row
// perhaps read by several sets (its own part and its shared runs: merged here).
std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor starts, torch::Tensor kv_lens, double scale,
    c10::optional<torch::Tensor> row_offsets, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [R, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat,
              "k_cache and v_cache must be float32 [blocks, page, kv_heads, head_dim] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the caches' head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous() &&
                  starts.scalar_type() == torch::kLong && kv_lens.scalar_type() == torch::kLong,
              "block_tables int32 (contiguous), starts and kv_lens int64");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), B = block_tables.size(0);
  const int64_t page = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head_dim or head counts do not match");
  const ChunkFn dot_fn = by_head_dim<DotKernel>(D), lane_fn = shared_chunk_fn(D);
  TORCH_CHECK(dot_fn != nullptr, "decode_attention: head_dim ", D,
              " is not a multiple of 16 up to ", kMaxHeadDim);
  const int64_t group = H / Hkv, width = block_tables.size(1);
  const Cache k{k_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const Cache v{v_cache.data_ptr<float>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  auto starts_c = starts.contiguous(), lens_c = kv_lens.contiguous();
  TORCH_CHECK(starts_c.numel() == B && lens_c.numel() == B, "one start and length per table");
  const int64_t* start = starts_c.data_ptr<int64_t>();
  const int64_t* len = lens_c.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  // Members: set b's reads of its rows are members first_member[b] .. first_member[b+1]-1,
  // member i reading row member_row[i]; `qm` holds the members' queries in that order.
  std::vector<int64_t> first_member(B + 1);
  if (row_offsets.has_value()) {
    auto offsets = row_offsets->to(torch::kLong).contiguous();
    TORCH_CHECK(offsets.numel() == B + 1, "row_offsets: one more than the tables");
    std::copy_n(offsets.data_ptr<int64_t>(), B + 1, first_member.begin());
  } else {
    for (int64_t b = 0; b <= B; ++b) first_member[b] = b;
  }
  TORCH_CHECK(first_member[0] == 0 && std::is_sorted(first_member.begin(), first_member.end()),
              "row_offsets must rise from 0");
  const int64_t N = first_member[B];
  std::vector<int64_t> member_row(N);
  torch::Tensor qm = q;
  if (rows.has_value()) {
    auto rows_c = rows->to(torch::kLong).contiguous();
    TORCH_CHECK(rows_c.numel() == N, "rows: one per member, row_offsets[-1] of them");
    std::copy_n(rows_c.data_ptr<int64_t>(), N, member_row.begin());
    for (const int64_t r : member_row) TORCH_CHECK(r >= 0 && r < R, "rows must index q");
    qm = q.index_select(0, rows_c);
  } else {
    TORCH_CHECK(N == R, "row_offsets must span q's rows");
    for (int64_t i = 0; i < N; ++i) member_row[i] = i;
  }
  const float* qp = qm.data_ptr<float>();

  // Tasks: each set's keys cut into chunks (one task for a set without keys); a task's
  // partial states start at `first_state[task]` (one per query of its set's members).
  std::vector<int64_t> first_task(B + 1, 0), first_state(1, 0), member_set(N);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b] >= 0 && start[b] <= len[b] && len[b] <= width * page,
                "sequence ", b, "'s keys ", start[b], "..", len[b], " are outside its table");
    const int64_t chunks = std::max<int64_t>(1, (len[b] - start[b] + kChunk - 1) / kChunk);
    first_task[b + 1] = first_task[b] + chunks;
    for (int64_t c = 0; c < chunks; ++c)
      first_state.push_back(first_state.back() + (first_member[b + 1] - first_member[b]) * H);
    std::fill(member_set.begin() + first_member[b], member_set.begin() + first_member[b + 1], b);
  }
  const int64_t tasks = first_task[B], states = first_state[tasks];
  auto part_m = torch::full({states}, kNegInf);
  auto part_l = torch::zeros({states});
  auto part_o = torch::zeros({states, D});
  float* pm = part_m.data_ptr<float>();
  float* pl = part_l.data_ptr<float>();
  float* po = part_o.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // A task's set and keys; its work is its rows times its keys. Tasks are handed out
  // one at a time as threads come free, the most work first: a run's chunk is many rows'
  // work and a decode's one row's, so equal shares of the task list would not be equal
  // shares of the work.
  std::vector<int64_t> task_set(tasks), order(tasks);
  for (int64_t b = 0; b < B; ++b)
    std::fill(task_set.begin() + first_task[b], task_set.begin() + first_task[b + 1], b);
  auto keys = [&](int64_t task) {
    const int64_t b = task_set[task], t0 = start[b] + (task - first_task[b]) * kChunk;
    return std::make_pair(t0, std::min(len[b], t0 + kChunk));
  };
  auto work = [&](int64_t task) {
    const auto [t0, t1] = keys(task);
    return (first_member[task_set[task] + 1] - first_member[task_set[task]]) * (t1 - t0);
  };
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work(a) > work(b); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) {
      const int64_t task = order[i], b = task_set[task];
      const auto [t0, t1] = keys(task);
      const int64_t n = first_member[b + 1] - first_member[b], s = first_state[task];
      const ChunkFn attend = n > 1 && n * group >= kLaneQueries ? lane_fn : dot_fn;
      attend(qp + first_member[b] * H * D, n, k, v, tables + b * width, page, t0, t1, Hkv,
             group, fscale, pm + s, pl + s, po + s * D);
    }
  });

  // Each row's members, in order (a counting sort of member_row).
  std::vector<int64_t> first_of_row(R + 1, 0), row_members(N);
  for (const int64_t r : member_row) ++first_of_row[r + 1];
  for (int64_t r = 0; r < R; ++r) first_of_row[r + 1] += first_of_row[r];
  {
    std::vector<int64_t> next(first_of_row.begin(), first_of_row.end() - 1);
    for (int64_t i = 0; i < N; ++i) row_members[next[member_row[i]]++] = i;
  }
  auto out = torch::empty({R, H, D});
  auto lse = torch::empty({R, H});
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, R * H, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t rh = lo; rh < hi; ++rh) {
      const int64_t row = rh / H, head = rh % H;
      // The row's query state in each task of each set that reads it.
      auto each_state = [&](auto&& visit) {
        for (int64_t j = first_of_row[row]; j < first_of_row[row + 1]; ++j) {
          const int64_t i = row_members[j], b = member_set[i];
          const int64_t within = (i - first_member[b]) * H + head;
          for (int64_t c = first_task[b]; c < first_task[b + 1]; ++c)
            visit(first_state[c] + within);
        }
      };
      float M = kNegInf;
      each_state([&](int64_t s) { M = std::max(M, pm[s]); });
      float* y = op + rh * D;
      std::fill(y, y + D, 0.f);
      if (M == kNegInf) {
        lp[rh] = M;
        continue;
      }
      float L = 0;
      each_state([&](int64_t s) {
        const float w = std::exp(pm[s] - M);
        L += w * pl[s];
        const float* part = po + s * D;
        for (int64_t d = 0; d < D; ++d) y[d] += w * part[d];
      });
      for (int64_t d = 0; d < D; ++d) y[d] /= L;
      lp[rh] = M + std::log(L);
    }
  });
  return {out, lse};
}

}  // namespace radixserve
