// Threshold sparsity (jpinfer.sparse.threshold) with the compaction inside the kernel:
//   jpinfer_threshold_rows       y (T, M) = sum over rows j of M (N, M) of x'[t, j] * M[j], counts (T,)
//   jpinfer_threshold_rows_int8  the same over an int8 matrix with one float32 scale per column
//                                (jpinfer.quant.int8 Int8Matrix, scale_axis 1: the input-major /
//                                neuron-major copies): x quantized per token whole
//                                (quantize_tokens' rounding), the kept rows summed exactly in int32,
//                                y = float(acc) * (token scale * column scale): threshold.py's int8 path.
// where x'[t, j] = x[t, j] if |x[t, j]| > threshold else 0 (kept strictly greater, so 0 keeps every
// non-zero entry; a NaN is never kept), a row is read when any token keeps it, and counts[t] is the
// number of entries token t keeps. This is both kinds of threshold.py:
//   input sparsity:      M = the input-major gate/up matrix (d, R n), x = the FFN input;
//   activation sparsity: M = the neuron-major down matrix (n, d),   x = the activations a.
// For T = 1 it is threshold.py's list product over the kept rows, for T > 1 its masked dense product
// (each token its own set; rows no token keeps are never read).
//
// Parallel split of the float kernel, by the matrix's width (never by T or the kept set, so a token's
// result is the same alone and in a batch, bit for bit: rows another token keeps add its zero weight):
// - up to kRowSplitCols columns, pieces of the matrix's rows (N alone sets them), each a partial sum of
//   its kept rows read whole, the parts added in piece order (AccumulateRanges). Measured against a
//   column split (every thread walking the whole list over its own columns), 2-core Zen 5 VM, same runs,
//   30 chained matrices, one token, about half the rows kept: the default model's down (1536 x 576)
//   26-29 -> 34-36 GB/s, q|k|v (576 x 960) 31-34 -> 36-37, the 7B down (11008 x 4096) 38 -> 40-41,
//   gate/up (576 x 3072) alike; at four tokens the down 17 -> 20-22. A column split gives each thread
//   short runs of many rows.
// - wider (the head's (d, vocab)), the column split: a partial sum of 49152 columns per piece, times up to
//   eight tokens, would not stay in cache. Its pieces are at most kWideTileFloats / T columns wide, so a
//   piece's outputs (T x width floats, 32 KiB) stay in L1 while every kept row passes over them. Measured
//   against one piece per thread (2-core Zen 5 VM, 2026-12-05, the default model's (576, 49152) head at a
//   threshold of -inf, alternated runs): 8 tokens 3.9-4.0 -> 3.3-3.5 ms, one token 3.3-3.7 -> 2.6-3.0.
// The int8 kernel splits the rows too: see there.
#include "float_rows.h"
#include "int8_rows.h"

namespace jpn {
namespace {

thread_local std::vector<int64_t> tl_kept;
thread_local std::vector<int64_t> tl_starts;
thread_local std::vector<float> tl_weights;

// Widest matrix split by rows (see the top): a piece's partial sum at eight tokens is then 128 KiB.
constexpr int64_t kRowSplitCols = 4096;
// Outputs of a piece of a wider matrix (T x its columns, see the top): 32 KiB.
constexpr int64_t kWideTileFloats = 8192;

// One token's compaction: the indices j of the n entries with |x[j]| > thr, in order, into kept; returns how
// many (a NaN is never kept: the comparison is ordered). Eight entries a compare and a movemask, then the set
// bits, where a scalar loop took a branch per entry before the parallel part: in one process against that loop
// (2-core Zen 4 VM, 2026-12-06, the default model's 30 layers chained, one token, bench/results/experiments/
// int8_threshold_rows.md) 0.96x the time for the float down rows at half kept, 0.98x for gate/up's input rows,
// 0.90x for the int8 down rows; the same bits.
inline int64_t KeptEntries(const float* x, int64_t n, float thr, int64_t* kept) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), t = _mm256_set1_ps(thr);
  int64_t nk = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + j), magnitude);
    for (unsigned mask = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a, t, _CMP_GT_OQ))); mask; mask &= mask - 1)
      kept[nk++] = j + __builtin_ctz(mask);
  }
  for (; j < n; ++j)
    if (std::fabs(x[j]) > thr) kept[nk++] = j;
  return nk;
}

#if JPN_ZMM
// The int8 kernel's one-token compaction with AVX-512: per 16 entries a compare, their integers (QuantizeOne's float
// operations: the product, round half to even, the clamp), and the kept ones' indices and integers compressed in
// registers (vpcompressd's memory form is slow on Zen 4), where KeptEntries' set bits and a QuantizeOne per kept
// entry ran serially before the parallel part (~4 ns a kept entry). Both libraries in one process, reading the same
// chained random matrices out of the L3 (2-core Zen 4 VM, 2026-12-07, one token, 61 alternated rounds, the same
// bits): every row kept 0.93x / 0.93x / 0.96x / 0.95x the time on the default model's (1536, 576) down rows and its
// (576, 960) q|k|v, (576, 3072) gate/up and (576, 576) o input rows; a half to three quarters kept 1.00x / 0.97x /
// 0.96x / 0.94x. Writes up to 15 entries past the count: kept and q need n + 15 entries; n < 2^31 (int32 lanes).
inline int64_t KeptQuantized(const float* x, int64_t n, float thr, float inverse, int64_t* kept, int16_t* q) {
  const __m512 t = _mm512_set1_ps(thr), inv = _mm512_set1_ps(inverse);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t nk = 0, j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_abs_ps(v), t, _CMP_GT_OQ);
    if (!keep) continue;
    // the masked forms (every lane) as gcc 12 warns of an uninitialized operand in the unmasked ones
    const __m512 r =
        _mm512_maskz_roundscale_ps(0xFFFF, _mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_maskz_min_ps(0xFFFF, _mm512_maskz_max_ps(0xFFFF, r, lo), hi);
    const __m512i qi = _mm512_maskz_compress_epi32(keep, _mm512_maskz_cvtps_epi32(0xFFFF, c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + nk), _mm512_maskz_cvtepi32_epi16(0xFFFF, qi));
    const __m512i idx = _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(j))));
    _mm512_storeu_si512(kept + nk, _mm512_maskz_cvtepi32_epi64(0xFF, _mm512_maskz_extracti64x4_epi64(0xF, idx, 0)));
    _mm512_storeu_si512(kept + nk + 8,
                        _mm512_maskz_cvtepi32_epi64(0xFF, _mm512_maskz_extracti64x4_epi64(0xF, idx, 1)));
    nk += __builtin_popcount(keep);
  }
  for (; j < n; ++j)
    if (std::fabs(x[j]) > thr) q[nk] = int16_t(QuantizeOne(x[j], inverse)), kept[nk++] = j;
  return nk;
}
#endif

// Both kernels' compaction of x (T, N): the rows any token keeps, in order, into kept (returns how many), per
// kept row the T weights weight(x, t) (zero where token t drops the row), and counts[t], the entries token t
// keeps. One token goes through KeptEntries (the int8 kernel's, with AVX-512, through KeptQuantized instead).
template <class W, class WeightFn>
int64_t KeptRows(const float* X, int64_t N, int64_t T, float thr, int64_t* kept, W* weights, int32_t* counts,
                 WeightFn&& weight) {
  if (T == 1) {
    const int64_t nk = KeptEntries(X, N, thr, kept);
    for (int64_t k = 0; k < nk; ++k) weights[k] = weight(X[kept[k]], 0);
    counts[0] = int32_t(nk);
    return nk;
  }
  for (int64_t t = 0; t < T; ++t) counts[t] = 0;
  int64_t nk = 0;
  for (int64_t j = 0; j < N; ++j) {
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      const float v = X[t * N + j];
      const bool keep = std::fabs(v) > thr;
      weights[nk * T + t] = keep ? weight(v, t) : W(0);
      counts[t] += keep;
      any |= keep;
    }
    if (any) kept[nk++] = j;
  }
  return nk;
}

ffi::Error ThresholdRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> threshold, ffi::ResultBuffer<ffi::F32> y,
                             ffi::ResultBuffer<ffi::S32> counts) {
  const auto md = m.dimensions(), xd = x.dimensions();
  if (md.size() != 2 || xd.size() != 2 || xd[1] != md[0] || xd[0] < 1 || xd[0] > kMaxTokens)
    return ffi::Error::InvalidArgument("jpinfer threshold rows: M (N, M), x (T, N) with 1 <= T <= 8 expected");
  if (threshold.element_count() != 1) return ffi::Error::InvalidArgument("jpinfer threshold rows: scalar threshold");
  const int64_t N = md[0], cols = md[1], T = xd[0];
  const float* W = m.typed_data();
  const float* X = x.typed_data();
  const float thr = threshold.typed_data()[0];
  int32_t* C = counts->typed_data();
  float* Y = y->typed_data();

  // Compaction: the kept rows in order, and per kept row the T weights (0 where a token drops it).
  int64_t* kept = Scratch(tl_kept, size_t(N));
  float* wts = Scratch(tl_weights, size_t(N * T));
  const int64_t nk = KeptRows(X, N, T, thr, kept, wts, C, [](float v, int64_t) { return v; });
  // Rows a pass: eight on a narrow matrix (the default model's down, q|k|v and o products), four on a wide
  // one; a pass loads its outputs once for all its rows. (Measured with the column split, 2026-12-04:
  // narrow pieces 26-44 -> 34-47 GB/s with eight, while wide ones read 31-36 with eight against four's
  // 34-46.) Each output's sum within a piece is the same chain of multiply-adds in list order either way.
  const int pass = cols <= 1024 ? 8 : 4;
  const auto add_rows = [&](int64_t k0, int64_t k1, int64_t j0, int64_t j1, float* out) {
    for (int64_t k = k0; k < k1; k += pass) {
      const int B = int(std::min<int64_t>(pass, k1 - k));
      const float* r[8];
      float wb[kMaxTokens * 8];
      for (int b = 0; b < B; ++b) {
        r[b] = W + kept[k + b] * cols;
        for (int64_t t = 0; t < T; ++t) wb[t * B + b] = wts[(k + b) * T + t];
      }
      const float* rn[8];
      const int nb = int(std::clamp<int64_t>(k1 - k - pass, 0, pass));
      for (int b = 0; b < nb; ++b) rn[b] = W + kept[k + pass + b] * cols;
      AddRowsN<8>(B, r, wb, T, j0, j1, out, cols, rn, nb);
    }
  };
  if (cols <= kRowSplitCols) {
    // Pieces of the matrix's rows (fixed by N alone), each a partial sum over its kept rows, whole rows
    // read; the parts added in piece order.
    const int64_t pieces = std::clamp<int64_t>(N / 64, 1, 8), rows_per_piece = CeilDiv(N, pieces);
    int64_t* starts = Scratch(tl_starts, size_t(pieces + 1));
    for (int64_t p = 0, k = 0; p <= pieces; ++p) {  // the last bound, pieces * rows_per_piece >= N, gives nk
      while (k < nk && kept[k] < p * rows_per_piece) ++k;
      starts[p] = k;
    }
    const auto range = [&](int64_t p) { return std::pair<int64_t, int64_t>(starts[p], starts[p + 1]); };
    AccumulateRanges(pool, pieces, T, cols, nk * cols * 4, Y, range,
                     [&](int64_t k0, int64_t k1, float* out) { add_rows(k0, k1, 0, cols, out); });
    return ffi::Error::Success();
  }
  // A wide matrix (the head's (d, vocab), read at a threshold of -inf): pieces of columns, every piece walking
  // the whole list, a column's sum in list order whatever the split (so here the thread count may set the
  // partition): one per thread, or narrower where its outputs would not stay in L1 (see the top).
  std::fill(Y, Y + T * cols, 0.0f);
  if (nk == 0) return ffi::Error::Success();
  const int64_t width =
      std::max<int64_t>(256, RoundUp(std::min<int64_t>(CeilDiv(cols, Workers(pool)), kWideTileFloats / T), 16));
  ParallelFor(pool, CeilDiv(cols, width), nk * cols * 4, [&](int64_t i) {
    const int64_t j0 = i * width;
    add_rows(0, nk, j0, std::min(cols, j0 + width), Y);
  });
  return ffi::Error::Success();
}

thread_local std::vector<int16_t> tl_qweights;
thread_local std::vector<int32_t> tl_acc;

ffi::Error ThresholdRowsInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> m, ffi::Buffer<ffi::F32> col_scales,
                                 ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> threshold,
                                 ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::S32> counts) {
  const auto md = m.dimensions(), xd = x.dimensions();
  if (md.size() != 2 || xd.size() != 2 || xd[1] != md[0] || xd[0] < 1 || xd[0] > kMaxTokens ||
      int64_t(col_scales.element_count()) != md[1])
    return ffi::Error::InvalidArgument("jpinfer threshold rows int8: M (N, M), scales (M,), x (T, N), T <= 8");
  if (threshold.element_count() != 1) return ffi::Error::InvalidArgument("jpinfer threshold rows: scalar threshold");
  const int64_t N = md[0], cols = md[1], T = xd[0];
  const int8_t* W = reinterpret_cast<const int8_t*>(m.typed_data());
  const float* X = x.typed_data();
  const float* S = col_scales.typed_data();
  const float thr = threshold.typed_data()[0];
  int32_t* C = counts->typed_data();
  float* Y = y->typed_data();

  // Per token: the scale of x whole (jpinfer.quant.int8.quantize_tokens), kept entries quantized.
  float token_scale[kMaxTokens], inverse[kMaxTokens];
  for (int64_t t = 0; t < T; ++t) {
    const float peak = Peak(X + t * N, N);
    inverse[t] = peak > 0.0f ? 127.0f / peak : 0.0f;
    token_scale[t] = peak * kInv127;  // XLA's peak / 127 (see int8_rows.h)
  }
  int64_t* kept = Scratch(tl_kept, size_t(N + 15));
  int16_t* qw = Scratch(tl_qweights, size_t(N * T + 15));  // [kept k][token]
  const auto quantize = [&](float v, int64_t t) { return int16_t(QuantizeOne(v, inverse[t])); };
#if JPN_ZMM
  const int64_t nk = T == 1 && N <= INT32_MAX ? (C[0] = int32_t(KeptQuantized(X, N, thr, inverse[0], kept, qw)))
                                             : KeptRows(X, N, T, thr, kept, qw, C, quantize);
#else
  const int64_t nk = KeptRows(X, N, T, thr, kept, qw, C, quantize);
#endif
  ScaledRowsSum(pool, nk, T, cols, [&](int64_t k) { return W + kept[k] * cols; }, qw, token_scale, S, tl_acc, Y);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_threshold_rows_int8, jpn::ThresholdRowsInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // M (N, M) int8, row-major
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales (M,), one per column
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (T, N)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // threshold ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (T, M)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // counts (T,)

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_threshold_rows, jpn::ThresholdRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // M (N, M), row-major
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (T, N)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // threshold ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (T, M)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // counts (T,)
