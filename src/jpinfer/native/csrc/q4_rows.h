// 4-bit products' pieces shared by quantized.cc (the dense Q4_0 / Q4_1 products) and sparse_ffn.cc (the 4-bit
// gate/up rows of listed neurons): x quantized in blocks of 32 and laid out for the 4-bit rows (Q8Octets), and the
// exact per-block integer sums of 4-bit rows with it, scaled per block (Q4Rows). Layout and instruction choices:
// quantized.cc's header.
#pragma once

#include "int8_rows.h"

namespace jpn {

// sum_k u[k] * s[k * stride] over N pairs of byte vectors, likewise (from zero). AVX2 adds the N maddubs
// results in int16 and widens once: each int16 then sums 2N products, which must fit (4-bit weights and
// N = 8: 16 * 15 * 127 = 30480 <= 32767).
template <int N>
inline __m256i DotBytesN(const __m256i* u, const __m256i* s, int64_t stride) {
#if JPN_VNNI
  __m256i acc = _mm256_setzero_si256();
  for (int k = 0; k < N; ++k) acc = DotBytes(acc, u[k], _mm256_loadu_si256(s + k * stride));
  return acc;
#else
  __m256i pairs = _mm256_maddubs_epi16(u[0], _mm256_loadu_si256(s));
  for (int k = 1; k < N; ++k)
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[k], _mm256_loadu_si256(s + k * stride)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// x for the 4-bit products, per token, in blocks of 32 quantized like QuantizeTokens (llama.cpp's Q8_0),
// laid out for Q4Rows, which takes eight blocks (an octet, 128 packed bytes) a step: it transposes the
// octet's four 32-byte loads so that int32 lane l of vector k holds bytes 4k..4k+3 of block
// kLaneBlock[l], whose low nibbles are elements 4k..4k+3 and high nibbles 16+4k..16+4k+3. Each lane
// then sums one block, and one conversion and multiply-add per octet and token scale the eight
// blocks. Per octet, token-major within it (two tokens' vectors side by side for JPN_ZMM):
//   q      (8, T, 32 bytes): for k = 0..3, the q matching vector k's low nibbles, then its high ones;
//   scale  (T, 8 floats), the blocks' scales in lane order;
//   corr   (Q4_0, T, 8 int32) in lane order, -8 * the block's sum of q: w = d * (nibble - 8) exactly;
//   msum   (Q4_1, T, 8 floats) in lane order, scale * the block's sum of q, for the mins.
// Blocks after the last whole octet (in % 256 != 0: the default model's 576 inputs are 2 octets and 2
// blocks) go two a step, block 2i in the low 128 bits and 2i + 1 in the high ones, as the row's 32 packed
// bytes load: per token and pair (an odd last block alone in the low half, zeros above it)
//   tq     (T, pairs, 2 x 32 bytes): the blocks' q 0..15 (for the low nibbles), then their q 16..31;
//   tscale, tcorr, tmsum (T, pairs, 8): each block's scale, Q4_0's correction and Q4_1's scaled sum in lane 0
//   (4 for the high block), zeros elsewhere.
// Two horizontal adds within the halves then put each block's exact sum in all four lanes of its half, and the
// scales, zero but in lanes 0 and 4, take one of them: each block is its exact int32 sum scaled once, as in an
// octet. Against one block at a time, each summed horizontally to a scalar (2-core Zen 4 VM, 2026-12-06, one
// process, the default model's 30 layers of 4-bit products and its head chained, 21 alternated runs, medians
// of the time ratios; bench/results/experiments/q4_tail_pairs.md): one token 0.99x the time for Q4_1 and Q4_0,
// eight tokens 0.82x and 0.89x. (Padding the tail to an octet with zero blocks, copied next to the row, made a (3072, 576)
// Q4_0 product take 76 us against 42 at 512 inputs.)
constexpr int kLaneBlock[8] = {0, 2, 4, 6, 1, 3, 5, 7};

struct Q8Octets {
  int8_t* q;
  float* scale;
  int32_t* corr;
  float* msum;
  int64_t octets;  // whole octets per token
  int8_t* tq;
  float* tscale;
  int32_t* tcorr;
  float* tmsum;
  int64_t tail;  // blocks after them (0..7)
  int64_t tail_pairs;  // (tail + 1) / 2
  int8_t* pairs;  // one token with JPN_ZMM: q again, octets 2i and 2i + 1 side by side (Q4OctetPairs)
};

inline void QuantizeOctets(const float* x, int64_t T, int64_t in, const Q8Octets& p) {
  const int64_t nb = in / 32;
  const size_t tail_lanes = size_t(T * p.tail_pairs * 8);  // the lanes no block fills stay zero
  std::memset(p.tq, 0, tail_lanes * 8);
  std::memset(p.tscale, 0, tail_lanes * sizeof(float));
  std::memset(p.tcorr, 0, tail_lanes * sizeof(int32_t));
  std::memset(p.tmsum, 0, tail_lanes * sizeof(float));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * in + b * 32;
      const float peak = Peak(xb, 32);
      int32_t sum, group[8];
      const __m256i qb = Quantize32(xb, peak > 0.0f ? 127.0f / peak : 0.0f, &sum);
      if (b >= p.octets * 8) {  // a tail block: its pair's low or high half
        const int64_t i = b - p.octets * 8, half = i % 2, pair = t * p.tail_pairs + i / 2;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(group), qb);
        std::memcpy(p.tq + pair * 64 + 16 * half, group, 16);
        std::memcpy(p.tq + pair * 64 + 32 + 16 * half, group + 4, 16);
        p.tscale[pair * 8 + 4 * half] = peak * kInv127;
        p.tcorr[pair * 8 + 4 * half] = -8 * sum;
        p.tmsum[pair * 8 + 4 * half] = peak * kInv127 * float(sum);
        continue;
      }
      const int64_t k = b / 8, i = b % 8, oct = k * T + t;
      const int64_t lane = (i % 2) * 4 + i / 2;  // kLaneBlock[lane] == i
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(group), qb);
      // bytes 4g..4g+3 of the block: vector 2 (g % 4) + g / 4 (low nibbles for g < 4, high ones)
      for (int g = 0; g < 8; ++g)
        std::memcpy(p.q + ((k * 8 + 2 * (g % 4) + g / 4) * T + t) * 32 + lane * 4, group + g, 4);
      p.scale[oct * 8 + lane] = peak * kInv127;
      p.corr[oct * 8 + lane] = -8 * sum;
      p.msum[oct * 8 + lane] = p.scale[oct * 8 + lane] * float(sum);
    }
}

// One token's q with octets 2i and 2i + 1 side by side: vector v of pair i is octet 2i's vector v, then
// octet 2i + 1's (64 bytes).
inline void PairOctets(const Q8Octets& x) {
  for (int64_t i = 0; i < x.octets / 2; ++i)
    for (int v = 0; v < 8; ++v)
      for (int h = 0; h < 2; ++h)
        std::memcpy(x.pairs + (i * 8 + v) * 64 + 32 * h, x.q + ((2 * i + h) * 8 + v) * 32, 32);
}

// The 8 float16 scales (or mins) of an octet's blocks, in lane order.
inline __m256 OctetHalves(const uint16_t* h) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(v), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLaneBlock)));
}

// An octet's 128 packed bytes as the eight nibble vectors of the q layout (low and high of k = 0..3).
inline void OctetNibbles(const uint8_t* src, __m256i* nib) {
  __m256i r[4];
  for (int j = 0; j < 4; ++j) r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * j));
  // r[j] holds blocks 2j (low 128 bits) and 2j+1 (high); a 4x4 transpose of 32-bit words in each half
  const __m256i a = _mm256_unpacklo_epi32(r[0], r[1]), b = _mm256_unpacklo_epi32(r[2], r[3]);
  const __m256i c = _mm256_unpackhi_epi32(r[0], r[1]), e = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i w[4] = {_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b), _mm256_unpacklo_epi64(c, e),
                        _mm256_unpackhi_epi64(c, e)};
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    nib[2 * k] = _mm256_and_si256(w[k], low);
    nib[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(w[k], 4), low);
  }
}

#if JPN_ZMM
// One token, one row, two octets a 512-bit vector (octet 2i in the low half, 2i + 1 in the high one): the
// transpose, nibble split and eight vpdpbusd of Q4Rows' 256-bit loop run once for both octets, and the
// scale products and conversions once; the two octets are then added to the row's 8 lane sums one after the
// other, in Q4Rows' order (the same bits as the 256-bit loop and as the row in a batch of tokens). One row at
// a time is one sequential stream per thread, prefetched kStreamPrefetchBytes ahead. Measured (2-core Zen 5 VM,
// 2026-12-05, one token, four Q4_0 matrices chained so none stays in cache, medians of 8 alternated runs), GB/s
// at 11008 x 4096 / 4096 x 11008 / 4096 x 4096: Q4Rows' four rows a pass (the next pass's rows prefetched)
// 40.5 / 41.5 / 49.4; this with the next row prefetched 43.5 / 53.1 / 52.9; prefetched 4 / 8 / 16 KiB ahead
// 43.4 / 49.0 / 55.8, 46.0 / 51.9 / 65.7, 40.8 / 50.9 / 61.8. (With the rows in L2, one thread, it is no
// faster than Q4Rows: x's vectors are loaded per row, not shared by four.) Llama-2-7B-shaped Q4_0 decode
// (bench/cpu_7b.py, back-to-back runs): 8.4 -> 11.9 tok/s, 0.92x -> 1.13x llama.cpp's in the same run.
// ahead: bytes prefetched at the offsets the row is read at (kStreamPrefetchBytes further in a dense product).
// Returns the octets done (an odd last one is left to the caller).
inline __m256 LowHalf(__m512 v) { return _mm512_maskz_extractf32x8_ps(0xFF, v, 0); }
inline __m256 HighHalf(__m512 v) { return _mm512_maskz_extractf32x8_ps(0xFF, v, 1); }

template <bool kQ41>
inline int64_t Q4OctetPairs(const uint8_t* row, const uint16_t* d, const uint16_t* m, const uint8_t* ahead,
                             const Q8Octets& x, __m256& acc) {
  const __m512i lanes = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t pairs = x.octets / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint8_t* src = row + i * 256;
    for (int c = 0; c < 4; ++c) PrefetchAhead(ahead + i * 256 + 64 * c);
    // (the maskz forms throughout: gcc 12's unmasked ones warn about their undefined pass-through operand)
    __m512i r[4];
    for (int j = 0; j < 4; ++j)
      r[j] = _mm512_maskz_inserti64x4(0xFF, _mm512_maskz_loadu_epi64(0x0F, src + 32 * j),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 128 + 32 * j)), 1);
    // OctetNibbles' transpose: its unpacks work within 128-bit lanes, so each half gets its octet's
    const __m512i a = _mm512_maskz_unpacklo_epi32(0xFFFF, r[0], r[1]);
    const __m512i b = _mm512_maskz_unpacklo_epi32(0xFFFF, r[2], r[3]);
    const __m512i c = _mm512_maskz_unpackhi_epi32(0xFFFF, r[0], r[1]);
    const __m512i e = _mm512_maskz_unpackhi_epi32(0xFFFF, r[2], r[3]);
    const __m512i w[4] = {_mm512_maskz_unpacklo_epi64(0xFF, a, b), _mm512_maskz_unpackhi_epi64(0xFF, a, b),
                          _mm512_maskz_unpacklo_epi64(0xFF, c, e), _mm512_maskz_unpackhi_epi64(0xFF, c, e)};
    const int8_t* q = x.pairs + i * 8 * 64;
    __m512i sums = kQ41 ? _mm512_setzero_si512() : _mm512_loadu_si512(x.corr + i * 16);
    for (int j = 0; j < 4; ++j) {
      sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(w[j], low), _mm512_loadu_si512(q + 2 * j * 64));
      sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(_mm512_srli_epi16(w[j], 4), low),
                                 _mm512_loadu_si512(q + (2 * j + 1) * 64));
    }
    const auto halves = [&](const uint16_t* h) {  // the 16 float16 values of both octets, in lane order
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16 * i));
      return _mm512_maskz_permutexvar_ps(0xFFFF, lanes, _mm512_maskz_cvtph_ps(0xFFFF, raw));
    };
    const __m512 v = _mm512_maskz_cvtepi32_ps(0xFFFF, sums);
    const __m512 scale = _mm512_mul_ps(halves(d), _mm512_loadu_ps(x.scale + i * 16));
    __m512 mins, msum;
    if constexpr (kQ41) mins = halves(m), msum = _mm512_loadu_ps(x.msum + i * 16);
    // octet 2i, then 2i + 1: Q4Rows' multiply-adds in its order
    acc = _mm256_fmadd_ps(LowHalf(v), LowHalf(scale), acc);
    if constexpr (kQ41) acc = _mm256_fmadd_ps(LowHalf(mins), LowHalf(msum), acc);
    acc = _mm256_fmadd_ps(HighHalf(v), HighHalf(scale), acc);
    if constexpr (kQ41) acc = _mm256_fmadd_ps(HighHalf(mins), HighHalf(msum), acc);
  }
  return 2 * pairs;
}
#endif

// Per octet and token: one exact int32 sum a block (DotBytesN over the eight nibble vectors; Q4_0
// adds its correction), one conversion, one multiply-add with the lanes' scales (row x token).
// (Measured with rows in L2, 1 token: 1.15-1.3x the rate of a conversion and multiply-add per pair of
// blocks without the transpose; the same at 8 tokens.)
// RB rows: rows[r] their packed bytes, d[r] (m[r]) their block scales (mins); y[t * ldy + r] = row r times
// token t. ahead[r]: bytes prefetched at the offsets row r is read at (the stream ahead of it: a dense product's
// next rows, a sparse one's next listed rows).
template <int RB, int T, bool kQ41>
inline void Q4Rows(const uint8_t* const* rows, const uint16_t* const* d, const uint16_t* const* m,
                   const uint8_t* const* ahead, const Q8Octets& x, float* y, int64_t ldy) {
  __m256 acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
#if JPN_ZMM
  __m512 acc2[RB][T / 2 + 1];  // tokens 2i and 2i + 1
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i <= T / 2; ++i) acc2[r][i] = _mm512_setzero_ps();
#endif
  int64_t k0 = 0;
#if JPN_ZMM
  if constexpr (T == 1 && RB == 1)
    k0 = Q4OctetPairs<kQ41>(rows[0], d[0], kQ41 ? m[0] : nullptr, ahead[0], x, acc[0][0]);
#endif
  for (int64_t k = k0; k < x.octets; ++k) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const uint8_t* src = rows[r] + k * 128;
      const uint16_t* dr = d[r] + 8 * k;
      const uint16_t* mr = kQ41 ? m[r] + 8 * k : nullptr;
      PrefetchAhead(ahead[r] + k * 128);
      PrefetchAhead(ahead[r] + k * 128 + 64);
      __m256i nib[8];
      OctetNibbles(src, nib);
      const __m256 dw = OctetHalves(dr);
      const __m256 mw = kQ41 ? OctetHalves(mr) : _mm256_setzero_ps();
      int t0 = 0;
#if JPN_ZMM
      // Two tokens a 512-bit vector: the row's nibbles and scales in both halves, the tokens' q side by
      // side; each token's lanes see the same operations as below (the same bits). Measured 1.25-1.3x
      // the 256-bit rate at 8 tokens (rows in L2, the AVX-512 EPYC VM).
      if constexpr (T >= 2) {
        __m512i nib2[8];
        // (the maskz forms: gcc 12's unmasked ones warn about their undefined pass-through operand)
        for (int v = 0; v < 8; ++v) nib2[v] = _mm512_maskz_broadcast_i64x4(0xFF, nib[v]);
        const __m512 dw2 = _mm512_maskz_broadcast_f32x8(0xFFFF, dw);
        const __m512 mw2 = _mm512_maskz_broadcast_f32x8(0xFFFF, mw);
#pragma GCC unroll 4
        for (; t0 + 2 <= T; t0 += 2) {
          const int64_t ot = k * T + t0;
          const int8_t* q = x.q + (k * 8 * T + t0) * 32;
          __m512i sums = kQ41 ? _mm512_setzero_si512() : _mm512_loadu_si512(x.corr + ot * 8);
          for (int v = 0; v < 8; ++v) sums = _mm512_dpbusd_epi32(sums, nib2[v], _mm512_loadu_si512(q + v * T * 32));
          __m512& a = acc2[r][t0 / 2];
          const __m512 scale = _mm512_mul_ps(dw2, _mm512_loadu_ps(x.scale + ot * 8));
          a = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, sums), scale, a);
          if constexpr (kQ41) a = _mm512_fmadd_ps(mw2, _mm512_loadu_ps(x.msum + ot * 8), a);
        }
      }
#endif
#pragma GCC unroll 8
      for (int t = t0; t < T; ++t) {
        const int64_t ot = k * T + t;
        __m256i sums = DotBytesN<8>(nib, reinterpret_cast<const __m256i*>(x.q + (k * 8 * T + t) * 32), T);
        if constexpr (!kQ41)
          sums = _mm256_add_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + ot * 8)));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_loadu_ps(x.scale + ot * 8)),
                                    acc[r][t]);
        if constexpr (kQ41) acc[r][t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.msum + ot * 8), acc[r][t]);
      }
    }
  }
#if JPN_ZMM
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t + 1 < T; t += 2) {
      acc[r][t] = _mm512_maskz_extractf32x8_ps(0xFF, acc2[r][t / 2], 0);
      acc[r][t + 1] = _mm512_maskz_extractf32x8_ps(0xFF, acc2[r][t / 2], 1);
    }
#endif
  // the tail blocks, two a step (Q8Octets): the pair's 32 packed bytes (16, zeros above, for an odd last
  // block) split into low and high nibbles, elements 0..15 and 16..31 of each block; per token two products
  // with the pair's q added to Q4_0's correction, summed within each half, then scaled (lanes 0 and 4; Q4_1's
  // min term alike) into the row's sum
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t i = 0; i < x.tail_pairs; ++i) {
    const int64_t b = 8 * x.octets + 2 * i;
    const bool both = 2 * i + 1 < x.tail;
    // a block's float16 scale (or min) in its half's four lanes; an absent second block's is zero
    const auto pair_halves = [&](const uint16_t* h) {
      uint32_t two = h[b];
      if (both) std::memcpy(&two, h + b, 4);
      const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(two)));
      return _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(v), halves);
    };
    for (int r = 0; r < RB; ++r) {
      const uint8_t* src = rows[r] + b * 16;
      const __m256i bytes = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      const __m256 dw = pair_halves(d[r]);
      const __m256 mw = kQ41 ? pair_halves(m[r]) : _mm256_setzero_ps();
      for (int t = 0; t < T; ++t) {
        const int64_t j = t * x.tail_pairs + i;
        const __m256i* q = reinterpret_cast<const __m256i*>(x.tq + j * 64);
        __m256i sums = kQ41 ? _mm256_setzero_si256()
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.tcorr + j * 8));
        sums = DotBytes(DotBytes(sums, lo, _mm256_loadu_si256(q)), hi, _mm256_loadu_si256(q + 1));
        sums = _mm256_hadd_epi32(sums, sums);
        sums = _mm256_hadd_epi32(sums, sums);  // each half's four lanes: its block's sum
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_loadu_ps(x.tscale + j * 8)),
                                    acc[r][t]);
        if constexpr (kQ41) acc[r][t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.tmsum + j * 8), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) y[t * ldy + r] = HSum(acc[r][t]);
}

// Rows a pass: one at one token (one stream, kStreamPrefetchBytes), 4-bit only with AVX-512 (Q4OctetPairs);
// else as Int8Dots takes them.
constexpr int Q4RowsPerPass(int64_t T) { return JPN_ZMM && T == 1 ? 1 : Int8RowsPerPass(T); }

// Scratch of one thread's Q8Octets (the arrays QuantizeForQ4 lays x out in).
struct Q8Scratch {
  std::vector<int8_t> q, pairs;
  std::vector<float> scale, msum;
  std::vector<int32_t> corr;
};

// x (T, in) quantized and laid out for Q4Rows in `s` (in a multiple of 32); the pairs too where Q4Rows takes
// them (one token with JPN_ZMM).
inline Q8Octets QuantizeForQ4(const float* x, int64_t T, int64_t in, Q8Scratch& s) {
  const int64_t nb = in / 32, octets = nb / 8, tail = nb % 8, pairs = (tail + 1) / 2;
  // one scratch buffer of each kind: the octets' part, then the tail's
  int8_t* q = Scratch(s.q, size_t(T * (octets * 256 + pairs * 64)));
  float* scale = Scratch(s.scale, size_t(T * (octets + pairs) * 8));
  int32_t* corr = Scratch(s.corr, size_t(T * (octets + pairs) * 8));
  float* msum = Scratch(s.msum, size_t(T * (octets + pairs) * 8));
  const bool paired = JPN_ZMM && T == 1;
  const Q8Octets xq{q, scale, corr, msum, octets, q + T * octets * 256, scale + T * octets * 8,
                    corr + T * octets * 8, msum + T * octets * 8, tail, pairs,
                    paired ? Scratch(s.pairs, size_t(octets * 256)) : nullptr};
  QuantizeOctets(x, T, in, xq);
  if (paired) PairOctets(xq);
  return xq;
}

}  // namespace jpn
