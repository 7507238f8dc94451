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
// queries per kv head takes the dot-product kernel (`dot_attention.cpp`); one with many,
// the kernel of `shared_attention.cpp`, which puts queries in vector lanes. The partial
// states of a row (every chunk of every set it reads) are merged at the end, by
// log-sum-exp. The tasks, then the merges, are run by torch's pool or by a caller's own
// team (`DecodeAttention`). Accumulation is fp32.
#include "attention.h"
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

// Queries per kv head (rows x group) from which a set of several rows takes the lane
// kernel: it then fills at least half of each vector, and its scores need no horizontal
// sums. A plain decode (one row) keeps the dot kernel whatever its group.
constexpr int64_t kLaneQueries = kLanes / 2;

}  // namespace

namespace radixserve {

void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat,
              "k_cache and v_cache must be float32 [blocks, page, kv_heads, head_dim] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the caches' head_dim must be contiguous");
}

// Everything a `DecodeAttention` works from, fixed when it is planned.
struct DecodeAttention::Plan {
  int64_t R, H, D, page, Hkv, group, width;
  float scale;
  ChunkFn dot_fn, lane_fn;
  Cache k, v;
  torch::Tensor starts, lens, rows, qm, part_m, part_l, part_o;  // rows: undefined without
  const int64_t *start, *len;
  const int32_t* tables;
  const float* qp;
  float *pm, *pl, *po;
  // Members: set b's reads of its rows are members first_member[b] .. first_member[b+1]-1,
  // member i reading row member_row[i] (the constructor's); `qm` holds the members' queries
  // in that order.
  std::vector<int64_t> first_member, member_set;
  // Tasks: each set's keys cut into chunks (one task for a set without keys); a task's
  // partial states start at `first_state[task]` (one per query of its set's members).
  std::vector<int64_t> first_task, first_state, task_set, order;
  // Each row's members, in order (a counting sort of member_row).
  std::vector<int64_t> first_of_row, row_members;
  std::atomic<int64_t> next{0};

  std::pair<int64_t, int64_t> keys(int64_t task) const {
    const int64_t b = task_set[task], t0 = start[b] + (task - first_task[b]) * kChunk;
    return std::make_pair(t0, std::min(len[b], t0 + kChunk));
  }
  int64_t work(int64_t task) const {
    const auto [t0, t1] = keys(task);
    return (first_member[task_set[task] + 1] - first_member[task_set[task]]) * (t1 - t0);
  }
};

DecodeAttention::DecodeAttention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache,
                                 const torch::Tensor& block_tables, const torch::Tensor& starts,
                                 const torch::Tensor& kv_lens, double scale,
                                 const c10::optional<torch::Tensor>& row_offsets,
                                 const c10::optional<torch::Tensor>& rows)
    : plan_(std::make_unique<Plan>()) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [R, H, D] tensor");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous() &&
                  starts.scalar_type() == torch::kLong && kv_lens.scalar_type() == torch::kLong,
              "block_tables int32 (contiguous), starts and kv_lens int64");
  Plan& p = *plan_;
  const int64_t R = p.R = q.size(0), H = p.H = q.size(1), D = p.D = q.size(2);
  const int64_t B = block_tables.size(0);
  p.page = k_cache.size(1), p.Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % p.Hkv == 0, "head_dim or head counts do not match");
  p.dot_fn = dot_chunk_fn(D), p.lane_fn = shared_chunk_fn(D);
  TORCH_CHECK(p.dot_fn != nullptr, "decode_attention: head_dim ", D,
              " is not a multiple of 16 up to ", kMaxHeadDim);
  p.group = H / p.Hkv, p.width = block_tables.size(1), p.scale = static_cast<float>(scale);
  p.k = {k_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  p.v = {v_cache.data_ptr<float>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  p.starts = starts.contiguous(), p.lens = kv_lens.contiguous();
  TORCH_CHECK(p.starts.numel() == B && p.lens.numel() == B, "one start and length per table");
  p.start = p.starts.data_ptr<int64_t>(), p.len = p.lens.data_ptr<int64_t>();
  p.tables = block_tables.data_ptr<int32_t>();

  auto& first_member = p.first_member;
  first_member.resize(B + 1);
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
  p.qm = q;
  if (rows.has_value()) {
    auto rows_c = rows->to(torch::kLong).contiguous();
    TORCH_CHECK(rows_c.numel() == N, "rows: one per member, row_offsets[-1] of them");
    std::copy_n(rows_c.data_ptr<int64_t>(), N, member_row.begin());
    for (const int64_t r : member_row) TORCH_CHECK(r >= 0 && r < R, "rows must index q");
    p.rows = rows_c;
    p.qm = q.index_select(0, rows_c);
  } else {
    TORCH_CHECK(N == R, "row_offsets must span q's rows");
    for (int64_t i = 0; i < N; ++i) member_row[i] = i;
  }
  p.qp = p.qm.data_ptr<float>();

  p.first_task.assign(B + 1, 0), p.first_state.assign(1, 0), p.member_set.resize(N);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(p.start[b] >= 0 && p.start[b] <= p.len[b] && p.len[b] <= p.width * p.page,
                "sequence ", b, "'s keys ", p.start[b], "..", p.len[b],
                " are outside its table");
    const int64_t chunks = std::max<int64_t>(1, (p.len[b] - p.start[b] + kChunk - 1) / kChunk);
    p.first_task[b + 1] = p.first_task[b] + chunks;
    for (int64_t c = 0; c < chunks; ++c)
      p.first_state.push_back(p.first_state.back() +
                              (first_member[b + 1] - first_member[b]) * H);
    std::fill(p.member_set.begin() + first_member[b],
              p.member_set.begin() + first_member[b + 1], b);
  }
  const int64_t tasks = p.first_task[B], states = p.first_state[tasks];
  p.part_m = torch::full({states}, kNegInf), p.pm = p.part_m.data_ptr<float>();
  p.part_l = torch::zeros({states}), p.pl = p.part_l.data_ptr<float>();
  p.part_o = torch::zeros({states, D}), p.po = p.part_o.data_ptr<float>();

  // A task's set and keys; its work is its rows times its keys. Tasks are handed out
  // one at a time as threads come free, the most work first: a run's chunk is many rows'
  // work and a decode's one row's, so equal shares of the task list would not be equal
  // shares of the work.
  p.task_set.resize(tasks), p.order.resize(tasks);
  for (int64_t b = 0; b < B; ++b)
    std::fill(p.task_set.begin() + p.first_task[b], p.task_set.begin() + p.first_task[b + 1], b);
  std::iota(p.order.begin(), p.order.end(), 0);
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](int64_t a, int64_t b) { return p.work(a) > p.work(b); });

  p.first_of_row.assign(R + 1, 0), p.row_members.resize(N);
  for (const int64_t r : member_row) ++p.first_of_row[r + 1];
  for (int64_t r = 0; r < R; ++r) p.first_of_row[r + 1] += p.first_of_row[r];
  std::vector<int64_t> next(p.first_of_row.begin(), p.first_of_row.end() - 1);
  for (int64_t i = 0; i < N; ++i) p.row_members[next[member_row[i]]++] = i;
  out = torch::empty({R, H, D});
  lse = torch::empty({R, H});
}

DecodeAttention::~DecodeAttention() = default;

void DecodeAttention::rebind(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache) {
  Plan& p = *plan_;
  TORCH_CHECK(q.dim() == 3 && q.size(0) == p.R && q.size(1) == p.H && q.size(2) == p.D &&
                  q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "rebind: q must be shaped as the planned one");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(1) == p.page && k_cache.size(2) == p.Hkv && k_cache.size(3) == p.D,
              "rebind: the caches must be shaped as the planned ones");
  p.k = {k_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  p.v = {v_cache.data_ptr<float>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  p.qm = p.rows.defined() ? q.index_select(0, p.rows) : q;
  p.qp = p.qm.data_ptr<float>();
  const int64_t states = p.part_l.numel();
  std::fill(p.pm, p.pm + states, kNegInf);
  std::fill(p.pl, p.pl + states, 0.f);
  std::fill(p.po, p.po + states * p.D, 0.f);
  p.next.store(0);
}

void DecodeAttention::run_tasks() {
  Plan& p = *plan_;
  for (int64_t i; (i = p.next.fetch_add(1)) < tasks();) {
    const int64_t task = p.order[i], b = p.task_set[task];
    const auto [t0, t1] = p.keys(task);
    const int64_t n = p.first_member[b + 1] - p.first_member[b], s = p.first_state[task];
    const ChunkFn attend = n > 1 && n * p.group >= kLaneQueries ? p.lane_fn : p.dot_fn;
    attend(p.qp + p.first_member[b] * p.H * p.D, n, p.k, p.v, p.tables + b * p.width, p.page,
           t0, t1, p.Hkv, p.group, p.scale, p.pm + s, p.pl + s, p.po + s * p.D);
  }
}

void DecodeAttention::run() {
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { run_tasks(); });
  at::parallel_for(0, outputs(), 16, [&](int64_t lo, int64_t hi) { merge(lo, hi); });
}

int64_t DecodeAttention::tasks() const { return static_cast<int64_t>(plan_->order.size()); }

int64_t DecodeAttention::outputs() const { return plan_->R * plan_->H; }

void DecodeAttention::merge(int64_t begin, int64_t end) {
  const Plan& p = *plan_;
  const int64_t H = p.H, D = p.D;
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  for (int64_t rh = begin; rh < end; ++rh) {
    const int64_t row = rh / H, head = rh % H;
    // The row's query state in each task of each set that reads it.
    auto each_state = [&](auto&& visit) {
      for (int64_t j = p.first_of_row[row]; j < p.first_of_row[row + 1]; ++j) {
        const int64_t i = p.row_members[j], b = p.member_set[i];
        const int64_t within = (i - p.first_member[b]) * H + head;
        for (int64_t c = p.first_task[b]; c < p.first_task[b + 1]; ++c)
          visit(p.first_state[c] + within);
      }
    };
    float M = kNegInf;
    each_state([&](int64_t s) { M = std::max(M, p.pm[s]); });
    float* y = op + rh * D;
    std::fill(y, y + D, 0.f);
    if (M == kNegInf) {
      lp[rh] = M;
      continue;
    }
    float L = 0;
    each_state([&](int64_t s) {
      const float w = std::exp(p.pm[s] - M);
      L += w * p.pl[s];
      const float* part = p.po + s * D;
      for (int64_t d = 0; d < D; ++d) y[d] += w * part[d];
    });
    for (int64_t d = 0; d < D; ++d) y[d] /= L;
    lp[rh] = M + std::log(L);
  }
}

// q `[R, H, D]`; returns the output `[R, H, D]` and the natural log-sum-exp `[R, H]`, both
// fp32, each row's over the keys of every set it reads (-inf and zeros for a row that
// reads none). Which rows set b reads: row b (no `row_offsets`); rows row_offsets[b] ..
// row_offsets[b+1]-1 (no `rows`); or rows[row_offsets[b] .. row_offsets[b+1]-1], a row
// perhaps read by several sets (its own part and its shared runs: merged here).
std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor starts, torch::Tensor kv_lens, double scale,
    c10::optional<torch::Tensor> row_offsets, c10::optional<torch::Tensor> rows) {
  DecodeAttention a(q, k_cache, v_cache, block_tables, starts, kv_lens, scale, row_offsets,
                    rows);
  a.run();
  return {a.out, a.lse};
}

}  // namespace radixserve
