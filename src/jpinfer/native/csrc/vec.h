// Float vectors of the widest width the build has (16 lanes with AVX-512F, 8 with AVX2) for kernels whose
// arithmetic is the same at either width, and e^x for x <= 0 at both widths (the softmax of the attention
// kernels).
#pragma once

#include "common.h"

namespace jpn {

// e^x for 8 lanes, x <= 0 (scores minus their maximum), Cephes' single-precision method: x = n ln2 + r
// with |r| <= ln2 / 2 (ln2 in two parts, exact n * C1), a degree-6 polynomial for e^r, 2^n through the
// exponent bits. Relative error ~2 ulp; inputs below -87.3 give ~1e-38 instead of a denormal or 0.
inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#ifdef __AVX512F__
// The same method for 16 lanes (the same constants and operation order: lane for lane the 8-lane result).
inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365447504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

using Vec = __m512;
constexpr int kLanes = 16;
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VSet(float x) { return _mm512_set1_ps(x); }
inline Vec VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec VMul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec VSub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec VAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec VMax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
// lanes of e where s is -inf: exactly 0 (ExpNonPositive gives ~1e-38 there)
inline Vec VZeroWhereMinusInf(Vec e, Vec s) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}
// Lane reductions in a fixed order: the halves added (or maxed) pairwise down to one lane.
inline float VSumLanes(Vec v) {
  return HSum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
inline float VMaxLanes(Vec v) {
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, v);
  float m = lanes[0];
  for (float lane : lanes) m = std::max(m, lane);
  return m;
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VSet(float x) { return _mm256_set1_ps(x); }
inline Vec VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec VMul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec VSub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec VAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec VMax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec VZeroWhereMinusInf(Vec e, Vec s) {
  return _mm256_and_ps(e, _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
inline float VSumLanes(Vec v) { return HSum(v); }
inline float VMaxLanes(Vec v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  float m = lanes[0];
  for (float lane : lanes) m = std::max(m, lane);
  return m;
}
#endif

}  // namespace jpn
