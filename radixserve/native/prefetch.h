// Asking for memory ahead of its use, where the hardware's prefetchers fall short: a GEMV's
// several streams a thread, attention's keys and values scattered over pages.
#pragma once

#include <cstdint>

namespace radixserve {

// Where a prefetch brings its lines: every level, L1 included (`kL1`), or L2 and below
// (`kL2`, for reads ahead larger than L1, which would evict what is being worked on).
constexpr int kL1 = 3, kL2 = 2;

// Ask for `bytes` from `p` to be brought to the cache (`Level`: kL1 or kL2). Always
// inlined: GCC 12's ipa-modref finds that a function which only prefetches has no effect,
// and drops its calls.
template <int Level = kL1>
[[gnu::always_inline]] inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64)
    __builtin_prefetch(static_cast<const char*>(p) + at, 0, Level);
}

}  // namespace radixserve
