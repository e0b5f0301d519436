// Neuron selection of the predictor modes (jpinfer.predictor.mlp.select_neurons): per row of logits, the ids of
// the logits over a cut-off in increasing order, at most K of them (then zeros), and how many were over.
//
// XLA:CPU compacts a mask (jnp.nonzero with a static size) through a cumulative sum and a scatter over every
// neuron; one pass that writes each id over the cut-off took 0.53 against 3.39 ms for 32 layers of 11008 neurons
// (bench/results/experiments/native_selection.md). Ids are read eight logits at a time: one compare and a
// movemask give the eight bits, and each set bit's id is written in order. A NaN logit or cut-off compares false (ordered compare),
// as `logits > cutoff` does.
#include "common.h"

namespace jpn {
namespace {

ffi::Error SelectOverImpl(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> cutoff, ffi::ResultBuffer<ffi::S32> ids,
                          ffi::ResultBuffer<ffi::S32> wanted) {
  const auto ld = logits.dimensions(), id = ids->dimensions();
  if (ld.size() < 1 || id.size() != ld.size())
    return ffi::Error::InvalidArgument("jpinfer select over: logits (..., n) and ids (..., K) expected");
  const int64_t n = ld.back(), K = id.back(), rows = n ? int64_t(logits.element_count()) / n : 0;
  const int64_t cutoffs = int64_t(cutoff.element_count());
  if (int64_t(wanted->element_count()) != rows || int64_t(ids->element_count()) != rows * K ||
      (cutoffs != 1 && cutoffs != rows))
    return ffi::Error::InvalidArgument("jpinfer select over: wanted (...,), cutoff () or (...,) expected");
  const float* L = logits.typed_data();
  int32_t* I = ids->typed_data();
  int32_t* W = wanted->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = L + r * n;
    int32_t* out = I + r * K;
    const float c = cutoff.typed_data()[cutoffs == 1 ? 0 : r];
    const __m256 cv = _mm256_set1_ps(c);
    int64_t over = 0, j = 0;
    for (; j + 8 <= n; j += 8) {
      unsigned bits = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), cv, _CMP_GT_OQ)));
      for (; bits; bits &= bits - 1, ++over)
        if (over < K) out[over] = int32_t(j + __builtin_ctz(bits));
    }
    for (; j < n; ++j)
      if (x[j] > c) {
        if (over < K) out[over] = int32_t(j);
        ++over;
      }
    std::fill(out + std::min(over, K), out + K, 0);
    W[r] = int32_t(std::min<int64_t>(over, INT32_MAX));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_select_over, jpn::SelectOverImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits (..., n)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cutoff () or (...,)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids (..., K)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // wanted (...,)
