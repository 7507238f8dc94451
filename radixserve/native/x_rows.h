// How the GEMV kernels (`f32_matmul.cpp`, `quant_matmul.cpp`) take the rows of x: up to
// MAX_ROWS at a time, each count a template instance of its own, so that the accumulators
// of every (weight row, x row) pair are registers.
#pragma once

#include <cstdint>
#include <type_traits>

namespace radixserve {

constexpr int64_t MAX_ROWS = 4;  // rows per pass over the weight rows: fits the registers

// `run` called with std::integral_constant<int, R> for R = min(rows, MAX_ROWS) (rows >= 1).
template <typename Run>
inline void dispatch_rows(int64_t rows, Run&& run) {
  switch (rows) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{}); break;
  }
}

}  // namespace radixserve
