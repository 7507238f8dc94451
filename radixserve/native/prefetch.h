// Asking for memory ahead of its use, where the hardware's prefetchers fall short: a GEMV's
// several streams a thread, attention's keys and values scattered over pages.
#pragma once

#include <cstdint>

namespace radixserve {

// Ask for `bytes` from `p` to be brought to the cache. Always inlined: GCC 12's ipa-modref
// finds that a function which only prefetches has no effect, and drops its calls.
[[gnu::always_inline]] inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64)
    __builtin_prefetch(static_cast<const char*>(p) + at, 0, 3);
}

}  // namespace radixserve
