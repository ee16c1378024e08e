// RMSNorm of one row as norm.py computes it, bit for bit, and the explicitly rounded float steps it is
// spelled with: shared by the projection kernels that fold a layer's norm into their first pass.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jserve {

#if defined(__AVX512F__)
// Lanes [0, left) of a 16-lane vector: the tail of a row (all of them from 16 on, none at 0 or below).
inline __mmask16 Lanes(int64_t left) { return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1; }

// The float steps are spelled as intrinsics with explicit rounding: -ffast-math may neither fuse them
// into FMAs nor turn a division into a reciprocal, so each rounds the same whatever the compiler.
inline constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline float Div(float a, float b) { return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), kNearest)); }

inline float Add(float a, float b) { return _mm_cvtss_f32(_mm_add_round_ss(_mm_set_ss(a), _mm_set_ss(b), kNearest)); }
inline float Sqrt(float a) { return _mm_cvtss_f32(_mm_sqrt_round_ss(_mm_set_ss(a), _mm_set_ss(a), kNearest)); }

// RMSNorm of x[0, depth) into `normed`: norm[k] · (x[k] · rsqrt(mean(x²) + eps)), as norm.py computes it.
inline void NormalizeRow(const float* x, int64_t depth, const float* norm, float eps, float* normed) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; k += 16) {
    const __mmask16 m = Lanes(depth - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = Div(_mm512_reduce_add_ps(squares), static_cast<float>(depth));
  const __m512 r = _mm512_set1_ps(Div(1.0f, Sqrt(Add(mean, eps))));
  for (int64_t k = 0; k < depth; k += 16) {
    const __mmask16 m = Lanes(depth - k);
    const __m512 v = _mm512_mul_round_ps(_mm512_maskz_loadu_ps(m, x + k), r, kNearest);
    _mm512_mask_storeu_ps(normed + k, m, _mm512_mul_round_ps(_mm512_maskz_loadu_ps(m, norm + k), v, kNearest));
  }
}

#else
// RMSNorm of x[0, depth) into `normed` (without AVX-512: plain float steps).
inline void NormalizeRow(const float* x, int64_t depth, const float* norm, float eps, float* normed) {
  float squares = 0.0f;
  for (int64_t k = 0; k < depth; ++k) squares += x[k] * x[k];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(depth) + eps);
  for (int64_t k = 0; k < depth; ++k) normed[k] = norm[k] * (x[k] * r);
}
#endif

}  // namespace jserve
