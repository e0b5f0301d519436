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
// Parallel split of the float kernel: over output columns, every piece walks the whole kept list four
// rows a pass. A column's value is then a sum in list order that no split changes, and there are no
// partial sums. (The int8 kernel splits the rows instead: see there.)
#include "float_rows.h"
#include "int8_rows.h"

namespace jpn {
namespace {

thread_local std::vector<int64_t> tl_kept;
thread_local std::vector<float> tl_weights;

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
  for (int64_t t = 0; t < T; ++t) C[t] = 0;
  int64_t nk = 0;
  for (int64_t j = 0; j < N; ++j) {
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      const float v = X[t * N + j];
      const bool keep = std::fabs(v) > thr;
      wts[nk * T + t] = keep ? v : 0.0f;
      C[t] += keep;
      any |= keep;
    }
    if (any) kept[nk++] = j;
  }
  std::fill(Y, Y + T * cols, 0.0f);
  if (nk == 0 || cols == 0) return ffi::Error::Success();

  // One piece of columns per thread: a column's sum is the same whatever the split (see above), so
  // here, unlike the list splits, the thread count may set the partition. Few wide pieces read long
  // runs of each row (8 KiB of a 4096-wide row with 2 threads); eight 2 KiB pieces measured slower.
  const int64_t width = std::max<int64_t>(256, RoundUp(CeilDiv(cols, Workers(pool)), 16));
  ParallelFor(pool, CeilDiv(cols, width), nk * cols * 4, [&](int64_t i) {
    const int64_t j0 = i * width, j1 = std::min(cols, j0 + width);
    // Rows a pass: eight on a narrow piece (the default model's q|k|v, output and down products, 288-480 columns
    // a thread), four on a wide one. A pass loads the piece's outputs once for all its rows; eight short rows
    // also keep more reads in flight. Measured in the same runs (2-core EPYC, 30 chained matrices, 2026-12-04):
    // narrow pieces 26-44 -> 34-47 GB/s with eight, while on wide ones (the gate/up product's 1536 columns a
    // thread, the head's 24576) eight read 31-36 against four's 34-46. Each output's sum is the same chain of
    // multiply-adds in list order either way (AddRows), so the choice never changes a result.
    const int64_t pass = j1 - j0 <= 1024 ? 8 : 4;
    for (int64_t k = 0; k < nk; k += pass) {
      const int B = int(std::min<int64_t>(pass, nk - k));
      const float* r[8];
      float wb[kMaxTokens * 8];
      for (int b = 0; b < B; ++b) {
        r[b] = W + kept[k + b] * cols;
        for (int64_t t = 0; t < T; ++t) wb[t * B + b] = wts[(k + b) * T + t];
      }
      const float* rn[8];
      const int nb = int(std::clamp<int64_t>(nk - k - pass, 0, pass));
      for (int b = 0; b < nb; ++b) rn[b] = W + kept[k + pass + b] * cols;
      AddRowsN(B, r, wb, T, j0, j1, Y, cols, rn, nb);
    }
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
    float peak = 0.0f;
    for (int64_t j = 0; j < N; ++j) peak = std::max(peak, std::fabs(X[t * N + j]));
    inverse[t] = peak > 0.0f ? 127.0f / peak : 0.0f;
    token_scale[t] = peak * kInv127;  // XLA's peak / 127 (see int8_rows.h)
    C[t] = 0;
  }
  int64_t* kept = Scratch(tl_kept, size_t(N));
  int16_t* qw = Scratch(tl_qweights, size_t(RoundUp(N, 4) * T));  // [kept k][token], padded to whole blocks
  int64_t nk = 0;
  for (int64_t j = 0; j < N; ++j) {
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      const float v = X[t * N + j];
      const bool keep = std::fabs(v) > thr;
      qw[nk * T + t] = keep ? int16_t(QuantizeOne(v, inverse[t])) : 0;
      C[t] += keep;
      any |= keep;
    }
    if (any) kept[nk++] = j;
  }
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
