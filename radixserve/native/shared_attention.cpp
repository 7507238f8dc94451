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
// queries, so a run read once for G rows costs G times its arithmetic but one read of its
// bytes. The task goes through its keys 16 at a time, each tile's rows (every head) read
// from memory once and kept in L1 while every block of queries attends to them.
#include "attention.h"

#include <algorithm>
#include <vector>

namespace radixserve::attention {

namespace {

// The running softmax of 16 queries of one kv head: their scaled components transposed
// (`qt[d]`: component d of each), unnormalised outputs likewise, max and sum.
template <int D>
struct alignas(64) LaneState {
  float qt[D][kLanes];
  float ot[D][kLanes];
  float max[kLanes];
  float sum[kLanes];
};

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
    const int64_t H = Hkv * group, queries = rows * group;
    const int64_t blocks = (queries + kLanes - 1) / kLanes;  // of 16 queries, per kv head
    // Query i of kv head h: row i / group, head h * group + i % group.
    auto query = [&](int64_t h, int64_t i) { return i / group * H + h * group + i % group; };
    std::vector<LaneState<D>> states(Hkv * blocks);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t i = 0; i < blocks * kLanes; ++i) {  // lanes past the last query score 0s
        LaneState<D>& st = states[h * blocks + i / kLanes];
        const float* qi = q + query(h, std::min(i, queries - 1)) * D;
        for (int d = 0; d < D; ++d) st.qt[d][i % kLanes] = i < queries ? qi[d] * scale : 0.f;
      }
    }
    for (LaneState<D>& st : states) {
      std::fill(&st.ot[0][0], &st.ot[0][0] + D * kLanes, 0.f);
      store(st.max, splat(kNegInf));
      store(st.sum, splat(0.f));
    }
    alignas(64) float p[kLanes][kLanes];  // a tile's scores, then weights: [key][query]
    // Tile by tile, each tile's rows of every head read once and attended by every
    // block of queries; the next tile's rows of a head are asked for into L2 as this
    // tile's are scored (a run is read from memory once, so its reads must overlap the
    // arithmetic; into L1, they would evict what is being scored).
    for (int64_t tile = 0; tile < t1 - t0; tile += kLanes) {
      const int64_t n = std::min(kLanes, t1 - t0 - tile);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = tile + kLanes; t < std::min(tile + 2 * kLanes, t1 - t0); ++t) {
          for (int d = 0; d < D; d += kLanes) {
            __builtin_prefetch(kbase[t] + h * k.head + d, 0, 2);
            __builtin_prefetch(vbase[t] + h * v.head + d, 0, 2);
          }
        }
        const float* krow[kLanes];
        const float* vrow[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {  // a short tile repeats its last key ...
          krow[j] = kbase[tile + std::min(j, n - 1)] + h * k.head;
          vrow[j] = vbase[tile + std::min(j, n - 1)] + h * v.head;
        }
        for (int64_t b = 0; b < blocks; ++b) {
          LaneState<D>& st = states[h * blocks + b];
          // Scores, four keys at a time: four independent chains of D multiply-adds.
          for (int64_t j = 0; j < kLanes; j += 4) {
            const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
            Lanes a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0;
            for (int d = 0; d < D; ++d) {
              const Lanes qd = load(st.qt[d]);
              a0 = fma(qd, splat(k0[d]), a0);
              a1 = fma(qd, splat(k1[d]), a1);
              a2 = fma(qd, splat(k2[d]), a2);
              a3 = fma(qd, splat(k3[d]), a3);
            }
            store(p[j], a0);
            store(p[j + 1], a1);
            store(p[j + 2], a2);
            store(p[j + 3], a3);
          }
          for (int64_t j = n; j < kLanes; ++j) store(p[j], splat(kNegInf));  // ... scored -inf
          Lanes tile_max = load(p[0]);
          for (int64_t j = 1; j < kLanes; ++j) tile_max = max(tile_max, load(p[j]));
          const Lanes run_max = load(st.max), new_max = max(run_max, tile_max);
          const Lanes alpha = exp_lanes(sub(run_max, new_max));  // 0 on the first tile
          Lanes sum = splat(0.f);
          for (int64_t j = 0; j < kLanes; ++j) {
            const Lanes e = exp_lanes(sub(load(p[j]), new_max));
            store(p[j], e);
            sum = add(sum, e);
          }
          store(st.sum, fma(load(st.sum), alpha, sum));
          store(st.max, new_max);
          // Outputs, four components at a time, over the tile's weighted values.
          for (int d = 0; d < D; d += 4) {
            Lanes a0 = mul(load(st.ot[d]), alpha), a1 = mul(load(st.ot[d + 1]), alpha),
                  a2 = mul(load(st.ot[d + 2]), alpha), a3 = mul(load(st.ot[d + 3]), alpha);
            for (int64_t j = 0; j < kLanes; ++j) {
              const Lanes w = load(p[j]);
              const float* vj = vrow[j] + d;
              a0 = fma(w, splat(vj[0]), a0);
              a1 = fma(w, splat(vj[1]), a1);
              a2 = fma(w, splat(vj[2]), a2);
              a3 = fma(w, splat(vj[3]), a3);
            }
            store(st.ot[d], a0);
            store(st.ot[d + 1], a1);
            store(st.ot[d + 2], a2);
            store(st.ot[d + 3], a3);
          }
        }
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t i = 0; i < queries; ++i) {
        const LaneState<D>& st = states[h * blocks + i / kLanes];
        const int64_t at = query(h, i), lane = i % kLanes;
        m[at] = st.max[lane];
        l[at] = st.sum[lane];
        for (int d = 0; d < D; ++d) o[at * D + d] = st.ot[d][lane];
      }
    }
  }
};

}  // namespace

ChunkFn shared_chunk_fn(int64_t D) { return by_head_dim<LaneKernel>(D); }

}  // namespace radixserve::attention
