// Float32 row primitives shared by the sparse FFN and the threshold kernels: blocked dot products
// (several rows share each load of x) and blocked row sums (the output's partial sums stay in
// registers while several rows are added).
#pragma once

#include "common.h"

namespace jpn {

// Columns of a row per pass of the dot products. With up to 8 rows a block that is 8 x 2 KiB,
// which stays in L1/L2 while each token passes over it: for T > 1 the rows come from memory once.
constexpr int64_t kDotTile = 512;

// out[t * P + r] = sum_j rows[r][j] * x[t * d + j], for P rows (P <= 8) and T tokens (T <= 8).
// Each (token, row) sums in 8 float lanes in column order, then HSum, then the d % 8 tail in order:
// the same arithmetic whatever T is, so a token's result does not depend on its batch.
// next: P rows the caller reads after these (nullptr: none); their cache lines are prefetched at the
// same column, one line per 16 floats, while these stream (the hardware prefetcher restarts at each
// new row of a scattered list; a block ahead covers that latency).
template <int P>
inline void Dots(const float* const* rows, const float* x, int64_t T, int64_t d, float* out,
                 const float* const* next = nullptr) {
  const int64_t d8 = d & ~int64_t(7);
  __m256 acc[kMaxTokens][P];
  for (int64_t t = 0; t < T; ++t)
    for (int r = 0; r < P; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < d8; j0 += kDotTile) {
    const int64_t j1 = std::min(j0 + kDotTile, d8);
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x + t * d;
      __m256 a[P];
#pragma GCC unroll 8
      for (int r = 0; r < P; ++r) a[r] = acc[t][r];
      if (next && t == 0) {  // the first token's pass streams the rows from memory: prefetch there
        for (int64_t j = j0; j < j1; j += 8) {
          if (((j - j0) & 15) == 0)
            for (int r = 0; r < P; ++r) PrefetchAhead(next[r] + j);
          const __m256 xv = _mm256_loadu_ps(xt + j);
#pragma GCC unroll 8
          for (int r = 0; r < P; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[r] + j), xv, a[r]);
        }
      } else {
        for (int64_t j = j0; j < j1; j += 8) {
          const __m256 xv = _mm256_loadu_ps(xt + j);
#pragma GCC unroll 8
          for (int r = 0; r < P; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[r] + j), xv, a[r]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < P; ++r) acc[t][r] = a[r];
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int r = 0; r < P; ++r) {
      float s = HSum(acc[t][r]);
      for (int64_t j = d8; j < d; ++j) s = std::fma(rows[r][j], x[t * d + j], s);
      out[t * P + r] = s;
    }
  }
}

inline void DotsN(int p, const float* const* rows, const float* x, int64_t T, int64_t d, float* out,
                  const float* const* next = nullptr) {
  WithCount<8>(p, [&](auto P) { Dots<decltype(P)::value>(rows, x, T, d, out, next); });
}

// y[t * ldy + j] += sum_b w[t * B + b] * rows[b][j] for j in [j0, j1), B rows (B <= 8), T tokens.
// Per element the sum is y = fma(w_0, r_0, y); y = fma(w_1, r_1, y); ... in the vector body and the
// scalar tail alike, so an element's value does not depend on where a column split falls.
// The B row vectors are loaded once per 8 columns and used by every token.
// next: rows read after these (nullptr: none), prefetched at the same columns as in Dots.
template <int B>
inline void AddRows(const float* const* rows, const float* w, int64_t T, int64_t j0, int64_t j1, float* y,
                    int64_t ldy, const float* const* next = nullptr, int n_next = 0) {
  __m256 wv[kMaxTokens][B];
  for (int64_t t = 0; t < T; ++t)
    for (int b = 0; b < B; ++b) wv[t][b] = _mm256_set1_ps(w[t * B + b]);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    if (n_next && ((j - j0) & 15) == 0)
      for (int b = 0; b < n_next; ++b) PrefetchAhead(next[b] + j);
    __m256 r[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) r[b] = _mm256_loadu_ps(rows[b] + j);
    for (int64_t t = 0; t < T; ++t) {
      float* yt = y + t * ldy + j;
      __m256 v = _mm256_loadu_ps(yt);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) v = _mm256_fmadd_ps(wv[t][b], r[b], v);
      _mm256_storeu_ps(yt, v);
    }
  }
  for (; j < j1; ++j) {
    for (int64_t t = 0; t < T; ++t) {
      float v = y[t * ldy + j];
      for (int b = 0; b < B; ++b) v = std::fma(w[t * B + b], rows[b][j], v);
      y[t * ldy + j] = v;
    }
  }
}

// AddRows for a count b <= kMaxRows known at run time (kMaxRows: the callers' row arrays' size, so no
// instantiation reads past them).
template <int kMaxRows>
inline void AddRowsN(int b, const float* const* rows, const float* w, int64_t T, int64_t j0, int64_t j1, float* y,
                     int64_t ldy, const float* const* next = nullptr, int n_next = 0) {
  WithCount<kMaxRows>(b, [&](auto B) { AddRows<decltype(B)::value>(rows, w, T, j0, j1, y, ldy, next, n_next); });
}

// y (T x d) = sum of parts[p] (T x d each), p = 0 .. parts-1 added in order into y (which holds
// part 0), split over columns.
inline void ReduceParts(Threads pool, float* y, const float* parts, int64_t n_parts, int64_t T, int64_t d) {
  if (n_parts <= 0) return;
  constexpr int64_t kCols = 1024;
  const int64_t pieces = CeilDiv(d, kCols);
  ParallelFor(pool, pieces, n_parts * T * d * 4, [&](int64_t i) {
    const int64_t j0 = i * kCols, j1 = std::min(d, j0 + kCols);
    for (int64_t p = 0; p < n_parts; ++p)
      for (int64_t t = 0; t < T; ++t) {
        float* yt = y + t * d;
        const float* pt = parts + (p * T + t) * d;
        for (int64_t j = j0; j < j1; ++j) yt[j] += pt[j];
      }
  });
}

// How a list of c positions is cut into pieces with partial sums of their own: at most 8 pieces,
// about 16 positions at least each, lengths a multiple of 4 (whole blocks). Depends on c only.
// (Up to 32 pieces, for a finer balance between threads, measured no better at the 7B shape.)
inline int64_t PieceLength(int64_t c) {
  const int64_t pieces = Clamp(c / 16, 1, 8);
  return std::max<int64_t>(4, RoundUp(CeilDiv(c, pieces), 4));
}

inline thread_local std::vector<float> tl_parts;

// Pieces of a list, piece i the positions range(i) = {begin, end}, each add into their own (T, d) output
// (piece 0 into y, the others zeroed first), then the parts are added to y in piece order.
template <class RangeFn, class PieceFn>
inline void AccumulateRanges(Threads pool, int64_t pieces, int64_t T, int64_t d, int64_t work_bytes, float* y,
                             RangeFn&& range, PieceFn&& piece_fn) {
  std::fill(y, y + T * d, 0.0f);
  if (pieces <= 0) return;
  float* parts = Scratch(tl_parts, size_t((pieces - 1) * T * d));
  ParallelFor(pool, pieces, work_bytes, [&](int64_t i) {
    float* out = i == 0 ? y : parts + (i - 1) * T * d;
    if (i > 0) std::fill(out, out + T * d, 0.0f);
    const auto [begin, end] = range(i);
    piece_fn(begin, end, out);
  });
  ReduceParts(pool, y, parts, pieces - 1, T, d);
}

// The same over a list of c positions cut by PieceLength (the count alone sets the pieces): the sparse
// FFN's accumulating targets.
template <class PieceFn>
inline void AccumulatePieces(Threads pool, int64_t c, int64_t T, int64_t d, int64_t bytes_per_position,
                             float* y, PieceFn&& piece_fn) {
  const int64_t len = PieceLength(c);
  const auto range = [&](int64_t i) { return std::pair<int64_t, int64_t>(i * len, std::min(c, (i + 1) * len)); };
  AccumulateRanges(pool, CeilDiv(c, len), T, d, c * bytes_per_position, y, range, piece_fn);
}

}  // namespace jpn
