// Float vectors at either width behind one set of operations (VecOps<8> on __m256, VecOps<16> on __m512 with AVX-512F),
// so that code whose arithmetic is the same at both widths is written once: e^x for x <= 0 (the softmax of the
// attention kernels) at both widths, and the prefill attention's products at the widest width the build has
// (Vec, Wide).
#pragma once

#include "common.h"

namespace jpn {

// Keyed by lane count, not by the vector type: a vector type as a template argument drops its attributes
// (gcc's -Wignored-attributes); OpsOf finds a vector's operations by overloading instead.
template <int kLaneCount>
struct VecOps;

template <>
struct VecOps<8> {
  static constexpr int kLanes = 8;
  static __m256 Zero() { return _mm256_setzero_ps(); }
  static __m256 Set(float x) { return _mm256_set1_ps(x); }
  static __m256 Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static __m256 Fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 Fnma(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
  static __m256 Mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 Sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
  static __m256 Add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 Max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
  static __m256 RoundNearest(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for integral n in the float exponent's range, through the exponent bits
  static __m256 Pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  // lanes of e where s is -inf: exactly 0 (ExpNonPositive gives ~1e-38 there)
  static __m256 ZeroWhereMinusInf(__m256 e, __m256 s) {
    return _mm256_and_ps(e, _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
  }
  static float SumLanes(__m256 v) { return HSum(v); }
};

#ifdef __AVX512F__
template <>
struct VecOps<16> {
  static constexpr int kLanes = 16;
  static __m512 Zero() { return _mm512_setzero_ps(); }
  static __m512 Set(float x) { return _mm512_set1_ps(x); }
  static __m512 Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static __m512 Fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 Fnma(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
  static __m512 Mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 Sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
  static __m512 Add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 Max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
  static __m512 RoundNearest(__m512 v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m512 Pow2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static __m512 ZeroWhereMinusInf(__m512 e, __m512 s) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
  }
  // the halves added, then the 8-lane order: a fixed order of additions
  static float SumLanes(__m512 v) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return HSum(_mm256_add_ps(_mm512_castps512_ps256(v), high));
  }
};
#endif

VecOps<8> OpsOf(__m256);  // declarations only: for decltype
#ifdef __AVX512F__
VecOps<16> OpsOf(__m512);
#endif

// The largest lane of v (max is exact, so any order gives the same result).
template <class V>
inline float MaxLanes(V v) {
  using O = decltype(OpsOf(v));
  alignas(64) float lanes[O::kLanes];
  O::Store(lanes, v);
  float m = lanes[0];
  for (float lane : lanes) m = std::max(m, lane);
  return m;
}

// e^x for x <= 0 (scores minus their maximum), Cephes' single-precision method: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, exact n * C1), a degree-6 polynomial for e^r, 2^n through the exponent
// bits. Relative error ~2 ulp; inputs below -87.3 give ~1e-38 instead of a denormal or 0. The same operations
// in the same order at either width, so a lane's result does not depend on the width.
template <class V>
inline V ExpNonPositive(V x) {
  using O = decltype(OpsOf(x));
  x = O::Max(x, O::Set(-87.3365447504f));
  const V n = O::RoundNearest(O::Mul(x, O::Set(1.44269504088896341f)));
  V r = O::Fnma(n, O::Set(0.693359375f), x);
  r = O::Fnma(n, O::Set(-2.12194440e-4f), r);
  V p = O::Set(1.9875691500e-4f);
  p = O::Fma(p, r, O::Set(1.3981999507e-3f));
  p = O::Fma(p, r, O::Set(8.3334519073e-3f));
  p = O::Fma(p, r, O::Set(4.1665795894e-2f));
  p = O::Fma(p, r, O::Set(1.6666665459e-1f));
  p = O::Fma(p, r, O::Set(5.0000001201e-1f));
  p = O::Fma(p, O::Mul(r, r), O::Add(r, O::Set(1.0f)));
  return O::Mul(p, O::Pow2(n));
}

// The widest float vector of the build.
#ifdef __AVX512F__
using Vec = __m512;
#else
using Vec = __m256;
#endif
using Wide = decltype(OpsOf(Vec()));
constexpr int kLanes = Wide::kLanes;

}  // namespace jpn
