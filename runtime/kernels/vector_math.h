// Vector helpers the attention kernels share: exp, horizontal sum and softmax over AVX2 registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>

namespace nmt_kernels {

constexpr size_t kCacheLine = 64;

// Asks for `bytes` from `start` into the L1 cache. The cross-attention's block of keys and values, usually evicted by
// the rest of the step and spread over pages the hardware prefetcher does not cross, then arrives as overlapping misses
// rather than one after another. (The self-attention's int8 block, a quarter the bytes, showed no gain from it:
// decoder calls within run-to-run noise at 8, 32 and 128 rows.)
inline void prefetch_bytes(const void* start, size_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (size_t offset = 0; offset < bytes; offset += kCacheLine) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// exp of 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two constants), e^r by its degree-6 Taylor
// polynomial (relative error below 2e-7 on that interval), times 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[0, n) -> softmax weights in place (nothing to do for n = 0).
inline void softmax_in_place(float* scores, int n) {
  if (n == 0) return;
  const float top = *std::max_element(scores, scores + n);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = sum8(total8);
  if (t < n) {  // the tail through one padded vector, so every weight comes from the same exp
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = t + i < n ? scores[t + i] - top : -87.0f;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int i = 0; t + i < n; ++i) {
      scores[t + i] = tail[i];
      total += tail[i];
    }
  }
  const float inverse = 1.0f / total;
  for (int i = 0; i < n; ++i) scores[i] *= inverse;
}

}  // namespace nmt_kernels
