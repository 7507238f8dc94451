// A barrier for the threads of one OpenMP team that waits by spinning, then by yielding the
// core: `decode_layers.cpp` crosses ~7 a layer, 200 a token, each a few microseconds of
// work apart. OpenMP's own barrier sleeps at once under OMP_WAIT_POLICY=PASSIVE (how
// radixserve runs beside torch's pool), and a wake-up costs 10-70 us here; spinning a
// bounded while catches the other threads' arrival in well under one, and the yield after
// it leaves the core to other work when a thread is late (a loaded machine).
#pragma once

#include <atomic>
#include <thread>

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
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < SPINS) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int SPINS = 4096;  // ~0.1 ms of pauses (Zen 4: ~60 cycles each)
  int threads_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
};

}  // namespace radixserve
