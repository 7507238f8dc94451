// The lane kernel of `decode_attention` (`attention.h`'s `ChunkFn`): many query rows
// reading one key set, as tree attention's shared runs are read (every token of a group
// against the prefix its sequences share).
//
// A plain decode has a few queries per kv head and scores each key by a dot product, a
// horizontal sum per (key, query). Here 16 queries of one kv head sit in the lanes of one
// vector, their head_dim transposed (`qt[d]` holds component d of all 16): a key's scores
// for all of them are D fused multiply-adds with the key's components broadcast, the
// softmax's max, exponentials and rescaling are lane-wise, and so is the weighted sum of
// values into the transposed outputs (`ot[d]`). That is the arithmetic's floor, 2 D
// multiply-adds per (key, query) with no lane idle but in a kv head's last block of
// queries (8 lanes wide where 8 or fewer queries are left), so a run read once for G rows
// costs G times its arithmetic but one read of its bytes. The task goes through its keys 16 at a time, each tile's rows (every head) read
// from memory once and kept in L1 while every block of queries attends to them.
#include "attention.h"
#include "prefetch.h"

#include <algorithm>
#include <vector>

namespace radixserve::attention {

namespace {

// The running softmax of W queries of one kv head (`first` the first of them): their
// scaled components transposed (`qt[d]`: component d of each), unnormalised outputs
// likewise, max and sum.
template <int D, int W>
struct alignas(64) LaneState {
  float qt[D][W];
  float ot[D][W];
  float max[W];
  float sum[W];
  int64_t first;
};

// A task's queries: query i of kv head h is row i / group's head h * group + i % group.
struct Queries {
  const float* q;
  int64_t H, group, count;
  int64_t at(int64_t h, int64_t i) const { return i / group * H + h * group + i % group; }
};

template <int D, int W>
void start(LaneState<D, W>& st, const Queries& qs, int64_t h, int64_t first, float scale) {
  using L = Lanes<W>;
  st.first = first;
  for (int64_t i = 0; i < W; ++i) {  // lanes past the last query score 0s
    const float* qi = qs.q + qs.at(h, std::min(first + i, qs.count - 1)) * D;
    for (int d = 0; d < D; ++d) st.qt[d][i] = first + i < qs.count ? qi[d] * scale : 0.f;
  }
  std::fill(&st.ot[0][0], &st.ot[0][0] + D * W, 0.f);
  L::store(st.max, L::splat(kNegInf));
  L::store(st.sum, L::splat(0.f));
}

// One tile of 16 keys (`n` of them real; the rows past them repeat the last) for the
// block's queries.
template <int D, int W>
void attend_tile(LaneState<D, W>& st, const float* const* krow, const float* const* vrow,
                 int64_t n) {
  using L = Lanes<W>;
  using V = typename L::V;
  alignas(64) float p[kLanes][W];  // scores, then weights: [key][query]
  // Scores, four keys at a time: four independent chains of D multiply-adds.
  for (int64_t j = 0; j < kLanes; j += 4) {
    const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
    V a0 = L::splat(0.f), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < D; ++d) {
      const V qd = L::load(st.qt[d]);
      a0 = L::fma(qd, L::splat(k0[d]), a0);
      a1 = L::fma(qd, L::splat(k1[d]), a1);
      a2 = L::fma(qd, L::splat(k2[d]), a2);
      a3 = L::fma(qd, L::splat(k3[d]), a3);
    }
    L::store(p[j], a0);
    L::store(p[j + 1], a1);
    L::store(p[j + 2], a2);
    L::store(p[j + 3], a3);
  }
  for (int64_t j = n; j < kLanes; ++j) L::store(p[j], L::splat(kNegInf));  // not keys
  V tile_max = L::load(p[0]);
  for (int64_t j = 1; j < kLanes; ++j) tile_max = L::max(tile_max, L::load(p[j]));
  const V run_max = L::load(st.max), new_max = L::max(run_max, tile_max);
  const V alpha = L::exp(L::sub(run_max, new_max));  // 0 on the first tile
  V sum = L::splat(0.f);
  for (int64_t j = 0; j < kLanes; ++j) {
    const V e = L::exp(L::sub(L::load(p[j]), new_max));
    L::store(p[j], e);
    sum = L::add(sum, e);
  }
  L::store(st.sum, L::fma(L::load(st.sum), alpha, sum));
  L::store(st.max, new_max);
  // Outputs, four components at a time, over the tile's weighted values.
  for (int d = 0; d < D; d += 4) {
    V a0 = L::mul(L::load(st.ot[d]), alpha), a1 = L::mul(L::load(st.ot[d + 1]), alpha),
      a2 = L::mul(L::load(st.ot[d + 2]), alpha), a3 = L::mul(L::load(st.ot[d + 3]), alpha);
    for (int64_t j = 0; j < kLanes; ++j) {
      const V w = L::load(p[j]);
      const float* vj = vrow[j] + d;
      a0 = L::fma(w, L::splat(vj[0]), a0);
      a1 = L::fma(w, L::splat(vj[1]), a1);
      a2 = L::fma(w, L::splat(vj[2]), a2);
      a3 = L::fma(w, L::splat(vj[3]), a3);
    }
    L::store(st.ot[d], a0);
    L::store(st.ot[d + 1], a1);
    L::store(st.ot[d + 2], a2);
    L::store(st.ot[d + 3], a3);
  }
}

template <int D, int W>
void finish(const LaneState<D, W>& st, const Queries& qs, int64_t h, float* m, float* l,
            float* o) {
  for (int64_t i = 0; i < W && st.first + i < qs.count; ++i) {
    const int64_t at = qs.at(h, st.first + i);
    m[at] = st.max[i];
    l[at] = st.sum[i];
    for (int d = 0; d < D; ++d) o[at * D + d] = st.ot[d][i];
  }
}

template <int D>
struct LaneKernel {
  static void run(const float* q, int64_t rows, const Cache& k, const Cache& v,
                  const int32_t* table, int64_t page, int64_t t0, int64_t t1, int64_t Hkv,
                  int64_t group, float scale, float* m, float* l, float* o) {
    // Where each key's row starts (kv head 0); a task has at most kChunk keys.
    const float* kbase[kChunk];
    const float* vbase[kChunk];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t blk = table[t / page], r = t % page;
      kbase[t - t0] = k.data + blk * k.block + r * k.row;
      vbase[t - t0] = v.data + blk * v.block + r * v.row;
    }
    const Queries qs{q, Hkv * group, group, rows * group};
    // Per kv head: blocks of 16 queries, and the last 8 or fewer in a block of 8.
    const int64_t wide = qs.count % kLanes > kLanes / 2 ? (qs.count + kLanes - 1) / kLanes
                                                        : qs.count / kLanes;
    const bool half = wide * kLanes < qs.count;
    std::vector<LaneState<D, kLanes>> blocks(Hkv * wide);
    std::vector<LaneState<D, kLanes / 2>> halves(half ? Hkv : 0);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t b = 0; b < wide; ++b) start(blocks[h * wide + b], qs, h, b * kLanes, scale);
      if (half) start(halves[h], qs, h, wide * kLanes, scale);
    }
    // Tile by tile, each tile's rows of every head read once and attended by every
    // block of queries; the next tile's rows of a head are asked for into L2 as this
    // tile's are scored (a run is read from memory once, so its reads must overlap the
    // arithmetic; into L1, they would evict what is being scored).
    for (int64_t tile = 0; tile < t1 - t0; tile += kLanes) {
      const int64_t n = std::min(kLanes, t1 - t0 - tile);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = tile + kLanes; t < std::min(tile + 2 * kLanes, t1 - t0); ++t) {
          prefetch<kL2>(kbase[t] + h * k.head, D * 4);
          prefetch<kL2>(vbase[t] + h * v.head, D * 4);
        }
        const float* krow[kLanes];
        const float* vrow[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          krow[j] = kbase[tile + std::min(j, n - 1)] + h * k.head;
          vrow[j] = vbase[tile + std::min(j, n - 1)] + h * v.head;
        }
        for (int64_t b = 0; b < wide; ++b) attend_tile(blocks[h * wide + b], krow, vrow, n);
        if (half) attend_tile(halves[h], krow, vrow, n);
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t b = 0; b < wide; ++b) finish(blocks[h * wide + b], qs, h, m, l, o);
      if (half) finish(halves[h], qs, h, m, l, o);
    }
  }
};

}  // namespace

ChunkFn shared_chunk_fn(int64_t D) { return by_head_dim<LaneKernel>(D); }

}  // namespace radixserve::attention
