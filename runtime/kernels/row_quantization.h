// Per-row activation quantization as ONNX Runtime's stock nodes compute it, shared by the RowQuantize kernel
// (row_quantize.cc) and the quantized weight product (quantized_matmul.cc): the row's largest |x| times 1/levels is its
// scale, and each level is round-half-to-even(x / scale) clamped, then shifted by the zero point (a division, as
// QuantizeLinear does, not a product with the reciprocal).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace nmt_kernels {

// Four running maxima, not one: one waited on the last (4 cycles per 8 values), which made this pass half the cost of
// quantizing a row. The largest value is the same in any order.
inline float max_abs(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int part = 0; part < 4; ++part) top[part] = _mm256_max_ps(top[part], _mm256_and_ps(_mm256_loadu_ps(x + i + 8 * part), magnitude));
  for (; i + 8 <= n; i += 8) top[0] = _mm256_max_ps(top[0], _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3])));
  float result = 0.0f;
  for (float lane : lanes) result = std::max(result, lane);
  for (; i < n; ++i) result = std::max(result, std::fabs(x[i]));
  return result;
}

// One level: NaN (0 / 0 in a row of zeros) becomes the lowest level, as the vector path's max(NaN, low) = low does.
inline uint8_t level(float x, float scale, float low, float high, int zero_point) {
  float v = x / scale;
  v = v > low ? v : low;
  v = v < high ? v : high;
  return static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)) + zero_point);
}

inline __m256i levels8(const float* x, __m256 scale, __m256 low, __m256 high) {
  const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x), scale), low), high);
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline void quantize_row(const float* x, int64_t n, float scale, int zero_point, uint8_t* out) {
  const float low = static_cast<float>(-zero_point), high = static_cast<float>(255 - zero_point);
  const __m256 scale8 = _mm256_set1_ps(scale), low8 = _mm256_set1_ps(low), high8 = _mm256_set1_ps(high);
  const __m256i shift = _mm256_set1_epi16(static_cast<int16_t>(zero_point));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i low16 = _mm256_add_epi16(_mm256_packs_epi32(levels8(x + i, scale8, low8, high8), levels8(x + i + 8, scale8, low8, high8)), shift);
    const __m256i high16 = _mm256_add_epi16(_mm256_packs_epi32(levels8(x + i + 16, scale8, low8, high8), levels8(x + i + 24, scale8, low8, high8)), shift);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low16, high16), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bytes);
  }
  for (; i < n; ++i) out[i] = level(x[i], scale, low, high, zero_point);
}

}  // namespace nmt_kernels
