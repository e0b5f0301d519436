// Float32 products of a few tokens with a whole (out, in) matrix, each row read once for all of them:
//   jpinfer_float_matvec  w (out, in) float32, x (T, in) float32, 1 <= T <= 8 -> y (T, out) = W @ x per token.
//
// Why: batched decoding (jpinfer.runtime.batch) multiplies up to 8 tokens by every projection, and
// XLA:CPU's products of 2-8 rows run far under the bandwidth its one-row products reach: the default
// model's (3072, 576) gate/up product took 0.72 ms for 8 rows against 0.25 ms for one, its (49152, 576)
// head 13.8 ms against 4.7 (2-core EPYC, 2026-12-03), so an 8-sequence step cost 3.8x a one-sequence step.
// A step reads every weight once however many tokens it carries: here each tile of rows is loaded once
// from memory and every token passes over it while it is in L1. Eight tokens still cost more than one: the
// products are 8x the multiply-adds (on the 2-core EPYC, 2026-12-03, before the tiles' software prefetch
// below: 30 layers' gate/up and down 0.59 ms a layer for one token, 0.85-0.96 for eight; the prefetch took
// the eight-token products to 0.50-0.82x that time, see kRows).
// One token runs Dots (blocks of 8 rows, the next block prefetched), whose sums are Tile's bit for bit:
// the decoder runs every float32 decode product here, one token or eight, so a sequence's output in a
// batch is exactly its output alone (with XLA's one-row product beside native few-token ones, rounding
// differences flipped the threshold mode's keep decisions: 10 of 32 greedy answers differed).
//
// With AVX-512, 2-8 tokens run PairTile instead: Tile's 8-lane sums with two tokens a 512-bit vector, the
// same bits at half the instructions. Measured (2-core Zen 5 VM, 2026-12-05, the default model's 30 layers of
// q|k|v, o, gate/up and down chained, three alternated runs each): 8 tokens 22.1-23.1 -> 13.9-14.3 ms (one
// token: 12 ms), 4 tokens 12.9-14.8 -> 12.5-12.8.
//
// Parallel split: blocks of kRows rows per piece; a (token, row) value is Tile's fixed-order sum whatever
// T and the split are, so a token's output does not depend on its batch or the thread count.
#include "float_rows.h"

// PairTile needs AVX-512 F and DQ (the 256-bit halves' broadcast and extract).
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define JPN_PAIR_TILE 1
#else
#define JPN_PAIR_TILE 0
#endif

namespace jpn {
namespace {

constexpr int64_t kRows = 48;  // rows per piece (48 x 2.3 KiB at in = 576, the default model's width): whole tiles
// The tiles of several tokens prefetch each row's stream kStreamPrefetchBytes ahead (past the matrix's end only
// prefetched, never read); they had no software prefetch, the hardware's alone. Both libraries in one process
// (2-core Zen 4 VM, 2026-12-07, AVX-512 build; 12 chained random matrices of the default model's shapes, 21
// alternated rounds, the same bits), gate/up (3072, 576) / down (576, 1536) / q|k|v (960, 576) / head (49152, 576):
// two tokens 0.61 / 0.82 / 0.60 / 0.65x the time, four 0.58 / 0.81 / 0.50 / 0.60x, eight 0.50 / 0.82 / 0.52 /
// 0.56x (16 KiB ahead alike: 0.50-0.80x).
constexpr int64_t kStreamFloats = kStreamPrefetchBytes / sizeof(float);
// A tile is R rows x TT tokens: R x TT accumulators, R row vectors and one x vector in registers (16 ymm
// with AVX2, 32 with AVX-512); per 8 columns it loads R + TT vectors for R x TT multiply-adds. GCC folds each
// x load into its multiply-adds unless told the vector lives in a register (the empty asm in Tile): folded,
// a 4 x 2 tile issued 12 loads per 8 multiply-adds, load-port bound at 40 GFLOP/s a core with the rows in
// L2, against 66 for a 3 x 4 tile with x held (2-core EPYC Zen 3, 2026-12-04; its FMA peak measures 100). In
// the default model's 8-sequence decode step the FFI products fell from 56 to 37 ms (of a 48 ms step).
#if !JPN_PAIR_TILE
constexpr int kTileRows = 3;
constexpr int kTileTokens = 4;

// out[t * R + r] = sum_j rows[r][j] * x[t * in + j] for R rows and TT tokens: per (token, row) 8 float lanes
// summed in column order, then HSum, then the in % 8 tail in order: the same arithmetic for any tile,
// so a token's result does not depend on which tokens share its tile.
template <int R, int TT>
inline void Tile(const float* const* rows, const float* x, int64_t in, float* out) {
  const int64_t in8 = in & ~int64_t(7);
  __m256 acc[TT][R];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < in8; j += 8) {
    if ((j & 15) == 0)
      for (int r = 0; r < R; ++r) PrefetchAhead(rows[r] + j + kStreamFloats);
    __m256 w[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) w[r] = _mm256_loadu_ps(rows[r] + j);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      __m256 xv = _mm256_loadu_ps(x + t * in + j);
      asm("" : "+x"(xv));  // keep x in a register: one load for R multiply-adds (see kTileRows)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(w[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) {
      float v = HSum(acc[t][r]);
      for (int64_t j = in8; j < in; ++j) v = std::fma(rows[r][j], x[t * in + j], v);
      out[t * R + r] = v;
    }
}

template <int R>
inline void TileTokens(int tt, const float* const* rows, const float* x, int64_t in, float* out) {
  WithCount<kTileTokens>(tt, [&](auto n) { Tile<R, decltype(n)::value>(rows, x, in, out); });
}
#else
constexpr int kTileRows = 4;  // PairTile: 4 rows x 4 token pairs

// Tile<R, 2 TP>'s sums for the T <= 2 TP tokens of x (T, in), two tokens a 512-bit vector: xp holds the pairs
// interleaved per 8 columns ((pair, column / 8, 16 floats), the pair's first token in the low half;
// PairInterleave), each row's 8 floats are broadcast to both halves, so every token's 8 lanes see Tile's
// multiply-adds in Tile's order, then Tile's HSum and in % 8 tail (the same bits). R x TP accumulators, R row
// vectors and one x vector: 21 of the 32 zmm registers at 4 x 4. (The maskz forms: gcc 12 warns about the
// unmasked ones' undefined pass-through operand.)
template <int R, int TP>
inline void PairTile(const float* const* rows, const float* xp, const float* x, int64_t T, int64_t in, float* out) {
  const int64_t in8 = in & ~int64_t(7);
  __m512 acc[TP][R];
#pragma GCC unroll 16
  for (int p = 0; p < TP; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < in8; j += 8) {
    if ((j & 15) == 0)
      for (int r = 0; r < R; ++r) PrefetchAhead(rows[r] + j + kStreamFloats);
    __m512 w[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) w[r] = _mm512_maskz_broadcast_f32x8(0xFFFF, _mm256_loadu_ps(rows[r] + j));
#pragma GCC unroll 4
    for (int p = 0; p < TP; ++p) {
      __m512 xv = _mm512_loadu_ps(xp + 2 * (p * in8 + j));
      asm("" : "+v"(xv));  // held in a register, as in Tile
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[p][r] = _mm512_fmadd_ps(w[r], xv, acc[p][r]);
    }
  }
  for (int p = 0; p < TP; ++p)
    for (int h = 0; h < 2 && 2 * p + h < T; ++h)
      for (int r = 0; r < R; ++r) {
        const int64_t t = 2 * p + h;
        const __m256 lanes = h ? _mm512_maskz_extractf32x8_ps(0xFF, acc[p][r], 1)
                               : _mm512_maskz_extractf32x8_ps(0xFF, acc[p][r], 0);
        float v = HSum(lanes);
        for (int64_t j = in8; j < in; ++j) v = std::fma(rows[r][j], x[t * in + j], v);
        out[t * R + r] = v;
      }
}

// x (T, in) as PairTile's token pairs over the first in8 columns; an odd T's last pair has a zero second token.
inline void PairInterleave(const float* x, int64_t T, int64_t in, int64_t in8, float* xp) {
  for (int64_t p = 0; p < (T + 1) / 2; ++p)
    for (int64_t j = 0; j < in8; j += 8)
      for (int h = 0; h < 2; ++h) {
        float* dst = xp + 2 * (p * in8 + j) + 8 * h;
        if (2 * p + h < T)
          std::memcpy(dst, x + (2 * p + h) * in + j, 8 * sizeof(float));
        else
          std::fill(dst, dst + 8, 0.0f);
      }
}

thread_local std::vector<float> tl_pairs;
#endif

ffi::Error FloatMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[1] || xd[0] < 1 || xd[0] > kMaxTokens)
    return ffi::Error::InvalidArgument("jpinfer float matvec: w (out, in), x (T, in), 1 <= T <= 8");
  const int64_t out = wd[0], in = wd[1], T = xd[0];
  const float *W = w.typed_data(), *X = x.typed_data();
  float* Y = y->typed_data();
#if JPN_PAIR_TILE
  const int64_t in8 = in & ~int64_t(7);
  float* xp = nullptr;
  if (T > 1) {
    xp = Scratch(tl_pairs, size_t((T + 1) / 2 * 2 * in8));
    PairInterleave(X, T, in, in8, xp);
  }
#endif
  ParallelFor(pool, CeilDiv(out, kRows), out * in * 4, [&](int64_t piece) {
    const int64_t r0 = piece * kRows, r1 = std::min(out, r0 + kRows);
    float block[kMaxTokens * kTileRows];
    if (T == 1) {  // one token: Dots' blocks of 8 rows with the next block prefetched (the same sums as Tile's)
      for (int64_t r = r0; r < r1; r += 8) {
        const int p = int(std::min<int64_t>(8, r1 - r));
        const float *rows[8], *next[8];
        for (int i = 0; i < 8; ++i) {
          rows[i] = W + std::min(r + i, r1 - 1) * in;
          next[i] = W + std::min(r + 8 + i, out - 1) * in;
        }
        DotsN(p, rows, X, 1, in, Y + r, r + 8 < out ? next : nullptr);
      }
      return;
    }
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int p = int(std::min<int64_t>(kTileRows, r1 - r));
      const float* rows[kTileRows];
      for (int i = 0; i < kTileRows; ++i) rows[i] = W + std::min(r + i, r1 - 1) * in;  // tail rows: repeats
#if JPN_PAIR_TILE
      WithCount<kMaxTokens / 2>((T + 1) / 2,
                                [&](auto n) { PairTile<kTileRows, decltype(n)::value>(rows, xp, X, T, in, block); });
#else
      for (int64_t t0 = 0; t0 < T; t0 += kTileTokens)
        TileTokens<kTileRows>(int(std::min<int64_t>(kTileTokens, T - t0)), rows, X + t0 * in, in,
                              block + t0 * kTileRows);
#endif
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < p; ++i) Y[t * out + r + i] = block[t * kTileRows + i];
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_float_matvec, jpn::FloatMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w (out, in)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x (T, in)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y (T, out)
