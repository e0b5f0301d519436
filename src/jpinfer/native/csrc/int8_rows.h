// int8 pieces shared by the W8A8 kernels (quantized.cc's dense product, sparse_ffn.cc's int8 sparse FFN,
// threshold_rows.cc's int8 rows): the per-token quantization of x exactly like jpinfer.quant.int8
// (q = clip(rint(x * (127 / max|x|)), -127, 127), token scale max|x| * (1/127), float32 as XLA computes
// them), the int8 x int8 dot products of rows with those tokens (Int8Dots), and exact int32 row sums
// weighted by small integers (AddRowsInt8).
//
// Instructions: int8 x int8 on AVX2 goes through the sign trick: |w| (unsigned) times sign(w) * q
// (signed), which is w * q; |w| <= 128 and |q| <= 127, so a pair sum stays within +-32512 (no
// saturation, even for a weight of -128). With VNNI x is stored shifted to unsigned instead (see
// Int8Dots).
#pragma once

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define JPN_VNNI 1
#else
#define JPN_VNNI 0
#endif
// AVX-512 VNNI: Q4Rows (quantized.cc) and Int8Dots take two tokens a 512-bit vector
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define JPN_ZMM 1
#else
#define JPN_ZMM 0
#endif

namespace jpn {

// The token scale is max|x| * (1 / 127), not max|x| / 127: XLA rewrites a division by a constant into
// a product with its float32 reciprocal, so this is what jpinfer.quant.int8.quantize_tokens computes
// (about 5% of scales differ by one ulp from a true division). 127 / max|x| is a true division in both.
constexpr float kInv127 = 1.0f / 127.0f;

inline int8_t QuantizeOne(float v, float inverse) {
  float q = std::nearbyint(v * inverse);  // round half to even (default rounding mode)
  q = std::min(127.0f, std::max(-127.0f, q));
  return int8_t(q);
}

// max |x[j]| over n floats; a NaN never wins, as in std::max(peak, |x|).
inline float Peak(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float peak = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1)));
  for (; j < n; ++j) peak = std::max(peak, std::fabs(x[j]));
  return peak;
}

// QuantizeOne on 32 floats, the same float operations (max_ps returns its second operand for a NaN,
// so a NaN becomes -127 in both); int8 in order, and their sum. Measured for 8 tokens: QuantizeOctets
// took 60 us a call over 4096 inputs and 8 us over 576 with the scalar loop, 10 and 1.5 us with this.
inline __m256i Quantize32(const float* x, float inverse, int32_t* sum) {
  __m256i v[4];
  for (int k = 0; k < 4; ++k) {
    __m256 q = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), _mm256_set1_ps(inverse));
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
  }
  *sum = HSumI32(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
  // packs work within 128-bit halves: 32-bit groups come out as 0, 2, 4, 6 | 1, 3, 5, 7 of the order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Per token: q int8 in chunks of 32, chunk-major (chunk c of token t at (c T + t) 32: the tokens of a
// chunk side by side, see Int8Dots); scale (T,). VNNI: stored as q + 128 (unsigned, see Int8Dots).
inline void QuantizeTokens(const float* x, int64_t T, int64_t in, int8_t* q, float* scale) {
  const int8_t shift = int8_t(JPN_VNNI << 7);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * in;
    const float peak = Peak(xt, in);
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    int64_t j = 0;
    for (int32_t sum; j + 32 <= in; j += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (j / 32 * T + t) * 32),
                          _mm256_xor_si256(Quantize32(xt + j, inverse, &sum), _mm256_set1_epi8(shift)));
    for (; j < in; ++j) q[(j / 32 * T + t) * 32 + j % 32] = int8_t(QuantizeOne(xt[j], inverse) ^ shift);
    scale[t] = peak * kInv127;  // XLA's peak / 127 (a reciprocal product)
  }
}

// acc + u * s with u unsigned and s signed bytes, the four products of each int32 lane summed into it.
// VNNI does this in one instruction (vpdpbusd, exact); AVX2 takes three (maddubs to int16 pairs, madd
// with ones to int32, add), and a pair's u * s + u * s must then fit int16.
inline __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
#if JPN_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif JPN_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Rows an Int8Dots pass takes for T tokens: a row's bytes feed every token, an accumulator per (row, token)
// <= 8 (the dense int8 matvec and the int8 sparse FFN's gate/up rows).
constexpr int Int8RowsPerPass(int64_t T) { return T <= 2 ? 4 : (T <= 4 ? 2 : 1); }

// s[r * T + t] = sum_j w[r][j] * q_t[j], exact in int32, for RB rows and T tokens (RB * T <= 8 keeps
// the accumulators in registers): q from QuantizeTokens (chunk-major; VNNI: shifted). next: RB addresses whose
// bytes at the rows' offsets are prefetched while these stream (the caller's choice of distance).
template <int RB, int T>
inline void Int8Dots(const int8_t* const* w, const int8_t* const* next, const int8_t* q, int64_t in, int32_t* s) {
  const int64_t full = in & ~int64_t(31);
  __m256i acc[RB][T];
  [[maybe_unused]] __m256i wsum[RB];  // VNNI: each row's sum of weights
  for (int r = 0; r < RB; ++r) {
    wsum[r] = _mm256_setzero_si256();
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_si256();
  }
#if JPN_ZMM
  __m512i acc2[RB][T / 2 + 1];  // tokens 2i and 2i + 1
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i <= T / 2; ++i) acc2[r][i] = _mm512_setzero_si512();
#endif
  for (int64_t j = 0; j < full; j += 32) {
    const int8_t* qj = q + j * T;  // the chunk's tokens
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      // the same bytes of the next pass's rows: one pass of prefetch distance, as the hardware
      // prefetcher alone left single-thread streaming at about half of XLA's float32 rate
      if ((j & 63) == 0) PrefetchAhead(next[r] + j);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + j));
      int t0 = 0;
#if JPN_VNNI
      // q + 128 (unsigned) times the signed weights: one vpdpbusd a token; the weights' sum (one more,
      // shared by the tokens) takes the 128 * sum(w) back out below: one instruction a token, not two.
      wsum[r] = DotBytes(wsum[r], _mm256_set1_epi8(1), wv);
#if JPN_ZMM
      if constexpr (T >= 2) {  // two tokens a 512-bit vector (quantized.cc's Q4Rows likewise)
        const __m512i wv2 = _mm512_maskz_broadcast_i64x4(0xFF, wv);
        for (; t0 + 2 <= T; t0 += 2)
          acc2[r][t0 / 2] = _mm512_dpbusd_epi32(acc2[r][t0 / 2], _mm512_loadu_si512(qj + t0 * 32), wv2);
      }
#endif
#pragma GCC unroll 8
      for (int t = t0; t < T; ++t)
        acc[r][t] = DotBytes(acc[r][t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj + t * 32)), wv);
#else
      const __m256i aw = _mm256_abs_epi8(wv);
#pragma GCC unroll 8
      for (int t = t0; t < T; ++t) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj + t * 32));
        acc[r][t] = DotBytes(acc[r][t], aw, _mm256_sign_epi8(qv, wv));
      }
#endif
    }
  }
#if JPN_ZMM
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t + 1 < T; t += 2) {
      acc[r][t] = _mm512_maskz_extracti64x4_epi64(0xF, acc2[r][t / 2], 0);
      acc[r][t + 1] = _mm512_maskz_extracti64x4_epi64(0xF, acc2[r][t / 2], 1);
    }
#endif
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) {
#if JPN_VNNI  // per lane: no partial sum leaves the int32 range (sum (q + 128) w may, for in > 65k)
      acc[r][t] = _mm256_sub_epi32(acc[r][t], _mm256_slli_epi32(wsum[r], 7));
#endif
      int32_t sum = HSumI32(acc[r][t]);
      for (int64_t j = full; j < in; ++j)
        sum += int32_t(w[r][j]) * int32_t(int8_t(q[(full * T + t * 32) + j - full] ^ (JPN_VNNI << 7)));
      s[r * T + t] = sum;
    }
}

// acc[t * cols + slot(j)] += sum_b q[t * kSumRows + b] * rows[b][j] for j < cols, kSumRows int8 rows (a missing row
// points at any valid row with weight 0), exact in int32; slot: SumSlot. The (T, cols) int32 sums in memory are
// loaded and stored once per kSumRows rows.
//
// With AVX-512 VNNI, 64 columns a step: two rounds of byte and word unpacks put the same column of four rows in one
// int32 lane, so one vpdpbusd multiplies four rows by their four token weights and adds them. vpdpbusd takes one
// operand unsigned: the rows go in as w ^ 0x80 = w + 128 (unsigned), and 128 * (the token's weights' sum) comes back
// out of the sums once per pass. The unpacks work within 128-bit lanes, so each 64-column block's sums are kept in
// the lane order they leave in (SumSlot), and put back in column order only by the caller's last pass over them.
// Otherwise (AVX2) rows are widened to int16 and interleaved in pairs, one _mm256_madd_epi16 multiplying two rows by
// their two token weights; so are the last cols % 64 columns with VNNI. On the Intel Xeon VM (2026-12-06, whose L3
// holds the default model's int8 weights, so the products run at their instruction rate) the int16 form read the
// threshold mode's kept down rows at about half the dense int8 product's bytes per second, and made that mode slower
// than dense int8 (bench/results/experiments/int8_threshold_rows.md).
// Eight rows a pass against four (int16 form; 2-core Zen 4 VM, 2026-12-06, one process, 15 alternated rounds, one
// token, the int8 threshold rows kernel): the default model's 30 chained (1536, 576) down matrices 0.82x the time with
// every row kept, 0.78x at half kept; four 7B-shaped (11008, 4096) 0.92x either way; the same bits.
constexpr int kSumRows = 8;

// Where AddRowsInt8 keeps column j's sum among cols: within a whole block of 64 (VNNI), column 16 L + 4 k + e (128-bit
// lane L of the unpacked vector k, int32 e of it) at 16 k + 4 L + e; elsewhere in order.
inline int64_t SumSlot(int64_t j, int64_t cols) {
#if JPN_ZMM
  const int64_t c = j & 63, base = j - c;
  if (base + 64 <= cols) return base + 16 * ((c & 15) >> 2) + 4 * (c >> 4) + (c & 3);
#endif
  return j;
}

inline void AddRowsInt8(const int8_t* const* rows, const int16_t* q, int64_t T, int64_t cols, int32_t* acc,
                        const int8_t* const* next, int n_next) {
  int64_t j = 0;
#if JPN_ZMM
  {
    constexpr int kQuads = kSumRows / 4;
    __m512i weights[kQuads][kMaxTokens];  // rows 4g..4g+3's token weights, a byte each, in every int32 lane
    __m512i back[kMaxTokens];             // -128 * the sum of a token's weights
    for (int64_t t = 0; t < T; ++t) {
      int32_t sum = 0;
      for (int g = 0; g < kQuads; ++g) {
        uint32_t quad = 0;
        for (int b = 0; b < 4; ++b) {
          const int16_t v = q[t * kSumRows + 4 * g + b];
          quad |= uint32_t(uint8_t(int8_t(v))) << (8 * b);
          sum += v;
        }
        weights[g][t] = _mm512_set1_epi32(int32_t(quad));
      }
      back[t] = _mm512_set1_epi32(-128 * sum);
    }
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    for (; j + 64 <= cols; j += 64) {
      for (int b = 0; b < n_next; ++b) PrefetchAhead(next[b] + j);
      __m512i quads[kQuads][4];
      for (int g = 0; g < kQuads; ++g) {
        __m512i r[4];
        for (int b = 0; b < 4; ++b) r[b] = _mm512_xor_si512(_mm512_loadu_si512(rows[4 * g + b] + j), flip);
        const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
        const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
        quads[g][0] = _mm512_unpacklo_epi16(lo01, lo23);  // columns 16 L + 0..3 of each lane L
        quads[g][1] = _mm512_unpackhi_epi16(lo01, lo23);  // 4..7
        quads[g][2] = _mm512_unpacklo_epi16(hi01, hi23);  // 8..11
        quads[g][3] = _mm512_unpackhi_epi16(hi01, hi23);  // 12..15
      }
      for (int64_t t = 0; t < T; ++t) {
        int32_t* a = acc + t * cols + j;
        for (int k = 0; k < 4; ++k) {
          __m512i v = _mm512_add_epi32(_mm512_loadu_si512(a + 16 * k), back[t]);
          for (int g = 0; g < kQuads; ++g) v = _mm512_dpbusd_epi32(v, quads[g][k], weights[g][t]);
          _mm512_storeu_si512(a + 16 * k, v);
        }
      }
    }
  }
#endif
  constexpr int kPairs = kSumRows / 2;
  __m256i w[kPairs][kMaxTokens];  // rows 2p and 2p + 1's token weights in every int32 lane
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < kPairs; ++p) {
      const uint32_t pair = uint16_t(q[t * kSumRows + 2 * p]) | uint32_t(uint16_t(q[t * kSumRows + 2 * p + 1])) << 16;
      w[p][t] = _mm256_set1_epi32(int32_t(pair));
    }
  const int64_t j0 = j;
  for (; j + 16 <= cols; j += 16) {
    if (n_next && ((j - j0) & 63) == 0)
      for (int b = 0; b < n_next; ++b) PrefetchAhead(next[b] + j);
    // unpack works within 128-bit lanes: lo holds columns 0-3 and 8-11, hi 4-7 and 12-15
    __m256i lo[kPairs], hi[kPairs];
    for (int p = 0; p < kPairs; ++p) {
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + j)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + j)));
      lo[p] = _mm256_unpacklo_epi16(a, b);
      hi[p] = _mm256_unpackhi_epi16(a, b);
    }
    for (int64_t t = 0; t < T; ++t) {
      __m256i l = _mm256_madd_epi16(lo[0], w[0][t]), h = _mm256_madd_epi16(hi[0], w[0][t]);
      for (int p = 1; p < kPairs; ++p) {
        l = _mm256_add_epi32(l, _mm256_madd_epi16(lo[p], w[p][t]));
        h = _mm256_add_epi32(h, _mm256_madd_epi16(hi[p], w[p][t]));
      }
      // back to column order: (0-3, 4-7) and (8-11, 12-15)
      const __m256i c0 = _mm256_permute2x128_si256(l, h, 0x20), c1 = _mm256_permute2x128_si256(l, h, 0x31);
      int32_t* a = acc + t * cols + j;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a),
                          _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), c0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 8),
                          _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 8)), c1));
    }
  }
  for (; j < cols; ++j)
    for (int64_t t = 0; t < T; ++t)
      for (int b = 0; b < kSumRows; ++b) acc[t * cols + j] += int32_t(q[t * kSumRows + b]) * int32_t(rows[b][j]);
}

// How far ahead in the list ScaledRowsSum's passes prefetch rows (AddRowsInt8's `next`), in bytes of rows: the
// next pass's rows, what a pass prefetched before, are only 4.6 KiB ahead on the default model's (1536, 576) int8
// down rows, too close for the memory's latency; 12 KiB makes that three passes (two on q|k|v's (576, 960), one on
// the (576, 3072) gate/up, as before). Tried on a 2-core Zen 4 VM (2026-12-07; one token, 30 chained random
// matrices): in alternated processes 12 KiB took the down rows to 0.77-0.79x the time (every row kept, half
// kept), 16 KiB 0.82x, 32 KiB 1.0-1.1x; no software prefetch made every case 1.5-2x slower. Then both libraries
// in one process (the old one under another FFI name, its own matrices, 21 rounds alternated, medians of the
// same-round ratios, in two runs; the same bits): down 0.81-0.88x kept whole, 0.91-0.95x half kept; the output
// product (576, 576) 0.92-0.93x / 0.94-0.99x; q|k|v 0.91-0.98x / 0.97-1.01x; gate/up, the same code, 1.02-1.04x
// (the noise); eight tokens 0.96-0.98x for the narrow ones. Not in the AVX2 build (0: the next pass, as before):
// there the same A/B could not tell (the x86-64-v3 build on the same VM: the unchanged code measured 1.07-1.43x
// its copy, as the two libraries' helper threads contend; the int16 row sums run nearer their instruction rate).
constexpr int64_t kRowsPrefetchBytes = JPN_ZMM ? 12288 : 0;

// The pass a pass of rows_per_pass rows (pass_bytes of them) prefetches: the first whole pass at least
// kRowsPrefetchBytes ahead, counted in rows of the list.
inline int64_t RowsAhead(int64_t rows_per_pass, int64_t pass_bytes) {
  return rows_per_pass * std::max<int64_t>(1, CeilDiv(kRowsPrefetchBytes, pass_bytes));
}

// acc[t * w + SumSlot(j, w)] = sum over k in [k0, k1) of q[k * T + t] * row(k)[j0 + j], j < w: columns [j0, j0 + w)
// of listed rows, exact in int32, kSumRows rows a pass (AddRowsInt8); acc is zeroed first.
template <class RowFn>
inline void SumRowRange(RowFn& row, const int16_t* q, int64_t T, int64_t k0, int64_t k1, int64_t j0, int64_t w,
                        int32_t* acc) {
  std::fill(acc, acc + T * w, 0);
  const int64_t ahead = RowsAhead(kSumRows, kSumRows * w);
  for (int64_t k = k0; k < k1; k += kSumRows) {
    const int B = int(std::min<int64_t>(kSumRows, k1 - k));
    const int8_t* r[kSumRows];
    int16_t qb[kMaxTokens * kSumRows];
    for (int b = 0; b < kSumRows; ++b) {  // a short last block: its first row stands in, weight 0
      r[b] = row(k + (b < B ? b : 0)) + j0;
      for (int64_t t = 0; t < T; ++t) qb[t * kSumRows + b] = b < B ? q[(k + b) * T + t] : 0;
    }
    const int8_t* rn[kSumRows];
    const int nb = int(std::clamp<int64_t>(k1 - k - ahead, 0, kSumRows));
    for (int b = 0; b < nb; ++b) rn[b] = row(k + ahead + b) + j0;
    AddRowsInt8(r, qb, T, w, acc, rn, nb);
  }
}

// Y[t * cols + j0 + j] = acc[t * w + SumSlot(j, w)] * (token_scale[t] * col_scale[j0 + j]) for j < w.
inline void ScaleSums(const int32_t* acc, int64_t T, int64_t j0, int64_t w, int64_t cols, const float* token_scale,
                      const float* col_scale, float* Y) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < w; ++j)
      Y[t * cols + j0 + j] = float(acc[t * w + SumSlot(j, w)]) * (token_scale[t] * col_scale[j0 + j]);
}

// Widest matrix ScaledRowsSum splits by rows (the 7B down's 4096 columns); wider (the head's (d, vocab)), pieces of
// columns, each at most kWideTileSums / T wide so its (T, width) int32 sums stay in L1 (32 KiB) while every listed
// row passes over them, where a piece of the rows kept (T, 49152) sums, past L2 at eight tokens. The default
// model's head (576, 49152) as the threshold mode's input-major int8 copy, every row kept (2-core Zen 4 VM,
// 2026-12-07; both libraries in one process, 15 alternated rounds, the same bits): against the row pieces one token
// 0.94x the time, four 0.97x, eight 0.60x (2.05x -> 1.23x the dense int8 product's time); a fifth of the rows
// skipped 0.85x / 0.93x / 0.59x.
constexpr int64_t kRowSplitSums = 4096;
constexpr int64_t kWideTileSums = 8192;

// Y[t * cols + j] = (sum over k < m of q[k * T + t] * row(k)[j]) * (token_scale[t] * col_scale[j]): m listed
// int8 rows of `cols` entries weighted by int8 values (held in int16), summed exactly in int32, kSumRows rows
// a pass (AddRowsInt8), then scaled. Integer sums are exact, so any partition gives the same bits. Up to
// kRowSplitSums columns, split over the rows: each thread reads whole rows (4 KiB of an int8 down row of the
// 7B shape; a column split left 2 KiB runs and measured 4.6 GB/s where XLA's float32 W @ x reads 16), each
// piece summing into its own int32 (T, cols) part of `parts`; the parts are added, then scaled. Wider, pieces
// of columns (kWideTileSums). The second half of the threshold mode's int8 kernel (and so of an int8 head's
// input-major copy) and of the int8 sparse FFN.
template <class RowFn>
inline void ScaledRowsSum(Threads pool, int64_t m, int64_t T, int64_t cols, RowFn&& row, const int16_t* q,
                          const float* token_scale, const float* col_scale, std::vector<int32_t>& parts, float* Y) {
  std::fill(Y, Y + T * cols, 0.0f);
  if (m == 0 || cols == 0) return;
  if (cols > kRowSplitSums) {  // pieces of columns, each over every listed row (see kWideTileSums)
    const int64_t width = std::max<int64_t>(
        64, std::min(RoundUp(CeilDiv(cols, Workers(pool)), 64), kWideTileSums / T / 64 * 64));
    ParallelFor(pool, CeilDiv(cols, width), m * cols, [&](int64_t i) {
      alignas(64) int32_t acc[kWideTileSums];
      const int64_t j0 = i * width, w = std::min(width, cols - j0);
      SumRowRange(row, q, T, 0, m, j0, w, acc);
      ScaleSums(acc, T, j0, w, cols, token_scale, col_scale, Y);
    });
    return;
  }
  const int64_t pieces = std::min<int64_t>(Workers(pool), CeilDiv(m, 16));
  const int64_t len = RoundUp(CeilDiv(m, pieces), kSumRows);
  int32_t* acc = Scratch(parts, size_t(pieces * T * cols));
  ParallelFor(pool, pieces, m * cols, [&](int64_t i) {
    SumRowRange(row, q, T, i * len, std::min(m, (i + 1) * len), 0, cols, acc + i * T * cols);
  });
  for (int64_t i = 1; i < pieces; ++i)
    for (int64_t e = 0; e < T * cols; ++e) acc[e] += acc[i * T * cols + e];
  ScaleSums(acc, T, 0, cols, cols, token_scale, col_scale, Y);
}

}  // namespace jpn
