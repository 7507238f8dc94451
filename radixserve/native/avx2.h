// What the AVX2 paths share (x86 without AVX-512 but with AVX2 and FMA: most desktops,
// laptops and AMD servers before Zen 4). Each kernel picks its path at compile time:
// AVX-512, else these, else its portable loops.
#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace radixserve {

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace radixserve
#endif
