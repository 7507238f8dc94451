// A step's decoder layers and LM head in one native call (`model/native_layers.py`): per layer
// the residual add with RMSNorm, the QKV projection, rotary, the KV store at the step's slots,
// decode attention over the block tables, the output projection, the second norm, gate/up,
// SiLU x up and down; then the final norm and the LM head over the rows that want logits;
// each by the very kernel the module path calls (`add_rms_norm`,
// `f32_matmul` / `q4_matmul` / `int8_matmul`, `rotary_`, `decode_attention`; SiLU x up by
// ATen's own ops), in the same order on the same values: the output is bit for bit the
// module path's. What it saves is the interpreter between operations: at batch 1 on the
// default model a layer is ~15 Python-level calls (module calls, views, wrappers, dispatch)
// around 0.1-0.3 ms of kernels.
//
// And the threads' wake-ups: each kernel on torch's pool opens an OpenMP region of its own,
// ~5 a layer, and under OMP_WAIT_POLICY=PASSIVE each wakes the pool's sleeping threads
// (10-70 us here, 150 a token). Where every projection takes its GEMV path (up to 128
// tokens in fp32, 79 in q4 and int8), the whole step is one region (`Team`): the threads
// take chunks of each projection's output rows, computed by the kernels' own GEMV bodies
// (`f32_gemv`, `q4_gemv`, `int8_gemv`: an output row is one thread's whole, so the split
// changes no sum), the team shares attention's key chunks (`DecodeAttention`: which thread
// runs a chunk changes no sum either), thread 0 alone runs the small operations between
// them (norms, rotary, the store, SiLU: their kernels run inline inside a region), and the
// team meets at a spinning barrier after each. Larger steps run each kernel on torch's
// pool as the module path does (`Pooled`), dense paths and all. The default model, 2
// threads, quiet machines, one region against the pool: 1.50x (q4) and 1.21x (fp32) at 1
// token over 512; with attention shared, q4 over a 1k shared prefix on a Zen 4 1.18x at 8
// tokens, 1.13x at 16, 1.09x at 32, and 1.06x at 64 over 512.
//
// The weights are bound once (`DecoderLayers`), so a step passes only its own tensors.

#include "kernels.h"
#include "spin_barrier.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <optional>
#include <vector>

namespace radixserve {

namespace {

enum Format : int64_t { F32 = 0, Q4 = 1, INT8 = 2 };

// One projection's weight as `linear.py` packs it: a dense fp32 [N, K] (F32), or codes,
// scales and lows (Q4, INT8), and its bias if any.
struct Projection {
  int64_t format;
  std::vector<at::Tensor> weight;
  c10::optional<at::Tensor> bias;

  int64_t outputs() const { return weight[0].size(0); }
  int64_t inputs() const {
    return format == F32 ? weight[0].size(1) : weight[0].size(1) * (format == Q4 ? 2 : 1);
  }

  // The standalone kernel on torch's pool: the module path's call.
  at::Tensor operator()(const at::Tensor& x) const {
    switch (format) {
      case F32: return f32_matmul(x, weight[0], bias);
      case Q4: return q4_matmul(x, weight[0], weight[1], weight[2], bias);
      default: return int8_matmul(x, weight[0], weight[1], weight[2], bias);
    }
  }

  // Whether `operator()` takes its GEMV path at M rows of x, the one `rows` runs.
  bool gemv(int64_t M) const { return format == F32 ? M <= F32_GEMV_ROWS : M < GROUP_GEMV_ROWS; }
  int64_t units() const {
    return format == F32 ? f32_gemv_units(outputs()) : group_gemv_units(outputs());
  }

  // Work units `begin .. end` of `y = operator()(x)` into y [M, N] (contiguous, as x).
  void rows(const at::Tensor& x, at::Tensor& y, int64_t begin, int64_t end) const {
    const Gemv g{x.data_ptr<float>(), y.data_ptr<float>(),
                 bias ? bias->data_ptr<float>() : nullptr, x.size(0), x.size(1), y.size(1)};
    if (format == F32) return f32_gemv(g, weight[0].data_ptr<float>(), begin, end);
    const uint8_t* codes = weight[0].data_ptr<uint8_t>();
    const float *scale = weight[1].data_ptr<float>(), *low = weight[2].data_ptr<float>();
    if (format == Q4) return q4_gemv(g, codes, scale, low, begin, end);
    int8_gemv(g, codes, scale, low, begin, end);
  }
};

// Runs a step's operations on the calling thread, each kernel on torch's pool.
struct Pooled {
  template <typename Op>
  bool serial(Op&& op) {
    op();
    return true;
  }
  bool project(const Projection& p, const at::Tensor& x, at::Tensor& y) {
    y = p(x);
    return true;
  }
  bool attend(DecodeAttention& a) {
    a.run();
    return true;
  }
};

// One thread of the team that runs a whole step in one OpenMP region: a projection's output
// rows taken by the team's threads in chunks as each comes free, anything else on thread
// 0, a barrier after each. An operation that throws on thread 0 ends the step for all
// threads at that barrier (false), its exception kept for the caller.
//
// Chunks, not equal shares: a thread that starts a projection late (woken from the
// barrier's sleep after a long serial operation) or reads slower than the other left it
// waiting at the barrier, 1.8 ms a token in fp32 and 0.5 in q4 (the default model, batch
// 1, 1k context, 2 threads, both threads' waits summed). A work unit is still one thread's
// whole, so no sum changes.
struct Team {
  SpinBarrier& barrier;
  std::exception_ptr& error;
  std::atomic<int64_t>* claimed;  // two counters of units taken, shared by the team
  int thread, threads;
  int64_t projections = 0;  // this thread's count of the step's projections so far

  template <typename Op>
  bool serial(Op&& op) {
    if (thread == 0) {
      try {
        op();
      } catch (...) {
        error = std::current_exception();
      }
    }
    barrier.wait();
    return !error;
  }
  bool project(const Projection& p, const at::Tensor& x, at::Tensor& y) {
    // The counters alternate: the one the next projection takes from is idle now (every
    // thread passed the barrier after the last projection to use it), and the barrier after
    // this one publishes its reset.
    std::atomic<int64_t>& next = claimed[projections % 2];
    if (thread == 0) claimed[(projections + 1) % 2].store(0, std::memory_order_relaxed);
    ++projections;
    const int64_t units = p.units(), chunk = std::max<int64_t>(1, units / (8 * threads));
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < units;)
      p.rows(x, y, begin, std::min(units, begin + chunk));
    barrier.wait();
    return true;
  }
  // Attention's key chunks taken by every thread as it comes free, then its outputs merged
  // in equal shares: at a long context it is the step's largest operation after the
  // projections, too large for thread 0 alone.
  bool attend(DecodeAttention& a) {
    if (a.tasks() < 2) return serial([&] { a.run(); });  // one chunk: nothing to share
    a.run_tasks();
    barrier.wait();
    const int64_t outputs = a.outputs();
    a.merge(outputs * thread / threads, outputs * (thread + 1) / threads);
    barrier.wait();
    return true;
  }
};

// A step's arguments and the tensors its operations pass along.
struct Flow {
  at::Tensor x, cos, sin;
  const at::Tensor &tables, &starts, &lens;
  const c10::optional<at::Tensor> &row_offsets, &rows;
  const int64_t* slots;
  std::vector<at::Tensor>& k_caches;
  std::vector<at::Tensor>& v_caches;
  const at::Tensor& logit_rows;
  at::Tensor h, qkv, attended, delta, gate_up, act, logits;
  // Attention's plan: made at the first layer (on thread 0), rebound at each later one.
  std::optional<DecodeAttention> attention;
};

// K or V rows `[T, Hkv, D]` (head_dim contiguous, any other strides) into `cache`
// `[blocks, page, Hkv, D]` (head_dim contiguous) at slots block * page + row, as the torch
// backend's `index_put_` does.
void store(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots) {
  const int64_t T = rows.size(0), H = rows.size(1), D = rows.size(2), page = cache.size(1);
  const float* src = rows.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = slots[t] / page, r = slots[t] % page;
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(dst + blk * cache.stride(0) + r * cache.stride(1) + h * cache.stride(2),
                  src + t * rows.stride(0) + h * rows.stride(1), D * sizeof(float));
  }
}

}  // namespace

class DecoderLayers {
 public:
  // `norms`: per layer its input and post-attention norm weights, then the final norm's;
  // `formats`, `weights`, `biases`: per layer its qkv, o, gate_up and down projections
  // (`Projection`), then the LM head, each run once here on zeros: the kernels' own checks,
  // which a step's team does not repeat; `cos`/`sin`: the rotary tables by position
  // (`[positions, head_dim]`), which a step looks its tokens' rows up in.
  // `one_region`: whether steps that can run as one region do (else always `Pooled`).
  DecoderLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                std::vector<at::Tensor> norms, std::vector<int64_t> formats,
                std::vector<std::vector<at::Tensor>> weights,
                std::vector<c10::optional<at::Tensor>> biases, at::Tensor cos, at::Tensor sin,
                bool one_region)
      : H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale),
        one_region_(one_region), norms_(std::move(norms)), cos_(std::move(cos)),
        sin_(std::move(sin)) {
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.dim() == 2 && cos_.size(1) == D_ &&
                cos_.is_contiguous() && sin_.sizes() == cos_.sizes() &&
                sin_.scalar_type() == at::kFloat && sin_.is_contiguous(),
                "cos and sin must be contiguous fp32 [positions, head_dim]");
    TORCH_CHECK(formats.size() == weights.size() && formats.size() == biases.size() &&
                norms_.size() % 2 == 1 && norms_.size() > 1 &&
                formats.size() == 2 * norms_.size() - 1,
                "four projections and two norms a layer (one layer at least), then the final "
                "norm and the LM head");
    for (size_t i = 0; i < formats.size(); ++i) {
      TORCH_CHECK(formats[i] >= F32 && formats[i] <= INT8 &&
                  weights[i].size() == (formats[i] == F32 ? 1u : 3u), "bad projection ", i);
      projections_.push_back({formats[i], std::move(weights[i]), std::move(biases[i])});
    }
    const int64_t hidden = norms_[0].numel(), q_size = H_ * D_;
    const int64_t outputs[4] = {q_size + 2 * Hkv_ * D_, hidden, projections_[2].outputs(),
                                hidden};
    const int64_t inputs[4] = {hidden, q_size, hidden, outputs[2] / 2};
    for (size_t i = 0; i + 1 < projections_.size(); ++i) {
      const Projection& p = projections_[i];
      TORCH_CHECK(p.outputs() == outputs[i % 4] && p.inputs() == inputs[i % 4] &&
                  norms_[i / 2].numel() == hidden, "projection ", i, " is [", p.outputs(),
                  ", ", p.inputs(), "], not [", outputs[i % 4], ", ", inputs[i % 4], "]");
      p(at::zeros({1, p.inputs()}));
    }
    TORCH_CHECK(projections_.back().inputs() == hidden && norms_.back().numel() == hidden,
                "the LM head takes [", projections_.back().inputs(), "] rows, not [", hidden,
                "]");
    projections_.back()(at::zeros({1, hidden}));
  }

  // Runs every layer over the residual stream `x` `[T, hidden]` (added to in place, as the
  // module path's norms do) for T tokens at `positions` `[T]` (int64), `slots` `[T]` their
  // KV slots, `tables`/`starts`/`lens`/`row_offsets`/`rows` the key sets of
  // `decode_attention` (one per token, or tree attention's own parts and shared runs);
  // returns the logits `[R, vocab]` of the R rows `logit_rows` (int64) names.
  at::Tensor step(at::Tensor x, const at::Tensor& positions,
                  const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& starts,
                  const at::Tensor& lens, const c10::optional<at::Tensor>& row_offsets,
                  const c10::optional<at::Tensor>& rows, std::vector<at::Tensor> k_caches,
                  std::vector<at::Tensor> v_caches, const at::Tensor& logit_rows) {
    const int64_t L = static_cast<int64_t>(norms_.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                static_cast<int64_t>(v_caches.size()) == L, "one K and V cache per layer");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                slots.numel() == x.size(0), "slots: contiguous int64, one per token");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                x.size(1) == norms_[0].numel(), "x must be contiguous fp32 [T, hidden]");
    for (int64_t l = 0; l < L; ++l) {  // before any store into them
      check_caches(k_caches[l], v_caches[l]);
      TORCH_CHECK(k_caches[l].size(2) == Hkv_ && k_caches[l].size(3) == D_,
                  "the caches must hold ", Hkv_, " kv heads of ", D_, " dims");
    }
    TORCH_CHECK(logit_rows.scalar_type() == at::kLong && logit_rows.dim() == 1,
                "logit_rows: int64 [R]");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                positions.numel() == x.size(0), "positions: int64, one per token");
    const int64_t T = x.size(0), R = logit_rows.numel();
    // The tokens' rows of the tables, as `RotaryEmbedding` looks them up (out of range: an
    // error here, before any work).
    Flow f{x, cos_.index_select(0, positions), sin_.index_select(0, positions), tables,
           starts, lens, row_offsets, rows, slots.data_ptr<int64_t>(), k_caches, v_caches,
           logit_rows};
    const int threads = at::get_num_threads();
    bool team = one_region_ && threads > 1 && projections_.back().gemv(R);
    for (size_t i = 0; i + 1 < projections_.size(); ++i) team = team && projections_[i].gemv(T);
    if (!team) {
      Pooled run;
      layers(run, f);
      return f.logits;
    }
    f.qkv = at::empty({T, projections_[0].outputs()}, x.options());
    f.delta = at::empty_like(x);
    f.gate_up = at::empty({T, projections_[2].outputs()}, x.options());
    f.logits = at::empty({R, projections_.back().outputs()}, x.options());
    SpinBarrier barrier;
    std::exception_ptr error;
    std::atomic<int64_t> claimed[2] = {0, 0};
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
      barrier.reset(omp_get_num_threads());
      Team run{barrier, error, claimed, omp_get_thread_num(), omp_get_num_threads()};
      layers(run, f);
    }
    if (error) std::rethrow_exception(error);
    return f.logits;
  }

 private:
  // The layers' operations in order, then the LM head's, by `run` (`Pooled` or one thread's
  // `Team`).
  template <typename Run>
  void layers(Run& run, Flow& f) const {
    const int64_t T = f.x.size(0), q_size = H_ * D_, kv_size = Hkv_ * D_;
    const int64_t L = static_cast<int64_t>(norms_.size()) / 2;
    for (int64_t l = 0; l < L; ++l) {
      const Projection* p = projections_.data() + 4 * l;
      const bool go =
          run.serial([&] {
            f.h = add_rms_norm(f.x, l ? c10::optional<at::Tensor>(f.delta) : c10::nullopt,
                               norms_[2 * l], eps_);
          }) &&
          run.project(p[0], f.h, f.qkv) &&
          run.serial([&] {
            rotary_(f.qkv.narrow(1, 0, q_size + kv_size).view({T, H_ + Hkv_, D_}), f.cos,
                    f.sin);
            store(f.qkv.narrow(1, q_size, kv_size).view({T, Hkv_, D_}), f.k_caches[l],
                  f.slots);
            store(f.qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv_, D_}),
                  f.v_caches[l], f.slots);
            at::Tensor q = f.qkv.narrow(1, 0, q_size).view({T, H_, D_}).contiguous();
            if (f.attention)  // the first layer's plan: the same sets, tables and rows
              f.attention->rebind(q, f.k_caches[l], f.v_caches[l]);
            else
              f.attention.emplace(q, f.k_caches[l], f.v_caches[l], f.tables, f.starts, f.lens,
                                  scale_, f.row_offsets, f.rows);
            f.attended = f.attention->out.view({T, q_size});
          }) &&
          run.attend(*f.attention) &&
          run.project(p[1], f.attended, f.delta) &&
          run.serial([&] { f.h = add_rms_norm(f.x, f.delta, norms_[2 * l + 1], eps_); }) &&
          run.project(p[2], f.h, f.gate_up) &&
          run.serial([&] {  // as `llama.silu_mul`, into one buffer for the step
            const int64_t inter = f.gate_up.size(1) / 2;
            if (!f.act.defined()) f.act = at::empty({T, inter}, f.x.options());
            at::silu_out(f.act, f.gate_up.narrow(1, 0, inter));
            f.act.mul_(f.gate_up.narrow(1, inter, inter));
          }) &&
          run.project(p[3], f.act, f.delta);
      if (!go) return;
    }
    // As `DecoderModel.forward`: the final norm adds the last layer's output into a copy of
    // the rows that want logits.
    run.serial([&] {
      f.h = add_rms_norm(f.x.index_select(0, f.logit_rows),
                         f.delta.index_select(0, f.logit_rows), norms_.back(), eps_);
    }) && run.project(projections_.back(), f.h, f.logits);
  }

  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  bool one_region_;
  std::vector<at::Tensor> norms_;
  std::vector<Projection> projections_;
  at::Tensor cos_, sin_;
};

void bind_decode_layers(pybind11::module_& m) {
  pybind11::class_<DecoderLayers>(m, "DecoderLayers",
                                  "a step's decoder layers and LM head in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>,
                          std::vector<int64_t>, std::vector<std::vector<at::Tensor>>,
                          std::vector<c10::optional<at::Tensor>>, at::Tensor, at::Tensor,
                          bool>())
      .def("step", &DecoderLayers::step,
           "every layer over x [T, hidden] (in place); returns the logits of logit_rows");
}

}  // namespace radixserve
