// A barrier for the threads of one OpenMP team that waits by spinning a short while, then
// sleeps (a futex, C++20's atomic wait): `decode_layers.cpp` crosses ~8 a layer, 240 a
// token, each some microseconds of work apart. OpenMP's own barrier sleeps at once under
// OMP_WAIT_POLICY=PASSIVE (how radixserve runs beside torch's pool), and a wake-up costs
// 10-70 us here; a spin of ~20 us catches a balanced team's arrival. It must not spin
// longer: on a loaded machine (more runnable threads than cores) a spinning thread holds a
// core the late thread needs, and a spin-then-yield barrier measured ~5x the per-kernel
// regions' step time at load 13 on 2 cores.
#pragma once

#include <atomic>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace radixserve {

class SpinBarrier {
 public:
  // Before the team's first `wait` (e.g. in an `omp single`): the team's size.
  void reset(int threads) {
    threads_ = threads;
    arrived_.store(0, std::memory_order_relaxed);
  }

  // Returns once all `threads` have called it; what each wrote before is visible to all.
  void wait() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      phase_.notify_all();
      return;
    }
    for (int spins = 0; spins < SPINS; ++spins) {
      if (phase_.load(std::memory_order_acquire) != phase) return;
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    }
    while (phase_.load(std::memory_order_acquire) == phase)
      phase_.wait(phase, std::memory_order_acquire);
  }

 private:
  static constexpr int SPINS = 1024;  // ~20 us of pauses (Zen 4: ~60 cycles each)
  int threads_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
};

}  // namespace radixserve
