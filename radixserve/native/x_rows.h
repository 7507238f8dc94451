// How the GEMV kernels (`f32_matmul.cpp`, `quant_matmul.cpp`) take the rows of x: up to
// MAX_ROWS (or a kernel's own count) at a time, each count a template instance of its own,
// so that the accumulators of every (weight row, x row) pair are registers.
#pragma once

#include <cstdint>
#include <type_traits>

namespace radixserve {

constexpr int64_t MAX_ROWS = 4;  // rows per pass over the weight rows: fits the registers

// `run` called with std::integral_constant<int, R> for R = min(rows, MAX) (rows >= 1).
template <int MAX = MAX_ROWS, int R = 1, typename Run>
inline void dispatch_rows(int64_t rows, Run&& run) {
  if constexpr (R == MAX) {
    run(std::integral_constant<int, R>{});
  } else {
    if (rows <= R) return run(std::integral_constant<int, R>{});
    dispatch_rows<MAX, R + 1>(rows, run);
  }
}

}  // namespace radixserve
