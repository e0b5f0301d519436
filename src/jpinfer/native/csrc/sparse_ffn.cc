// Float32 sparse FFN over listed neurons of a neuron-major layout (jpinfer.sparse.neurons):
// rows (n, R, d) with rows[i] = [gate_i, up_i, down_i] (R = 3) or [up_i, down_i] (R = 2, kind relu),
// so one neuron is one contiguous read of R * d floats.
//
// Targets (all: x (T, d) with T in 1..8, ids int32 (K,), count int32 scalar clamped to [0, K]; list
// positions >= count are padding, ids outside [0, n) are skipped (never read); a repeated id counts
// each time it is listed, like the XLA loop):
//   jpinfer_sparse_ffn          y (T, d) = sum over listed i of act_i(x) * down_i   (no b_down)
//   jpinfer_sparse_activations  a (T, K) = act_i(x) at each list position, 0 for padding / bad ids
//   jpinfer_listed_rows_sum     y (T, d) = sum over positions k of w[t, k] * M[ids[k], slot]
//                               (M (n, S, d), slot an attribute: the down slot R-1 of a bundle, or 0
//                               of a plain (n, 1, d) matrix)
//
// The fused kernel walks the list four neurons a pass: the 4 x gate/up rows share every load of
// x (Dots), the four activations are computed, and the four down rows are added to the piece's output
// with its partial sums held in registers (AddRows): each weight is read once, right after the
// previous ones of the same neuron (one contiguous bundle).
#include "float_rows.h"

namespace jpn {
namespace {

enum Kind : int32_t { kSwiglu = 0, kReglu = 1, kDrelu = 2, kRelu = 3 };

inline float Activate(int32_t kind, float g, float u) {
  switch (kind) {
    case kSwiglu: return g / (1.0f + std::exp(-g)) * u;  // silu(g) * u
    case kReglu: return std::max(g, 0.0f) * u;
    case kDrelu: return std::max(g, 0.0f) * std::max(u, 0.0f);
    default: return std::max(u, 0.0f);  // kRelu: relu(u); std::max keeps a NaN like jax.nn.relu
  }
}

struct Ffn {
  const float* rows;
  int64_t n, R, d;
  const float* b_up;  // nullptr: no up bias
  const float* x;
  int64_t T;
  const int32_t* ids;
  int32_t kind;
  const float* Row(int64_t id, int64_t slot) const { return rows + (id * R + slot) * d; }
};

// Activations of a block of B <= 4 neurons: act[t * B + b]. next/nb: the following block (prefetched
// while this one streams; nb = 0: none).
inline void BlockActivations(const Ffn& f, const int64_t* block, int B, float* act, const int64_t* next = nullptr,
                             int nb = 0) {
  const int proj = int(f.R - 1);  // gate and up rows (up only for kind relu)
  const float* ptr[8] = {};
  const float* pf[8] = {};
  const int P = B * proj;
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < proj; ++r) ptr[b * proj + r] = f.Row(block[b], r);
  // the next block's bundles: its gate/up rows where Dots reads these, then (the bundle's contiguous
  // tail) the hardware prefetcher carries on into the down rows
  for (int i = 0; i < P; ++i) pf[i] = nb ? f.Row(next[std::min(i / proj, nb - 1)], i % proj) : nullptr;
  float dots[kMaxTokens * 8];
  DotsN(P, ptr, f.x, f.T, f.d, dots, nb ? pf : nullptr);
  for (int64_t t = 0; t < f.T; ++t) {
    for (int b = 0; b < B; ++b) {
      const float g = proj == 2 ? dots[t * P + b * proj] : 0.0f;
      float u = dots[t * P + b * proj + proj - 1];
      if (f.b_up) u += f.b_up[block[b]];
      act[t * B + b] = Activate(f.kind, g, u);
    }
  }
}

thread_local std::vector<int64_t> tl_valid;

// Calls fn(block ids, block positions, B, next block ids, next B) for the valid ids at positions
// [p0, p1), four at a time (the last block of the range may hold fewer). The next block (prefetched
// while fn streams this one) runs on past p1 up to `end`: the following piece's first ids, which this
// thread reads next when it runs the pieces in a row (the default model's 95% list is four pieces of
// five blocks: a cold first block each cost it ~x). next B = 0 after the last block before `end`.
template <class Fn>
inline void ForBlocks(const int32_t* ids, int64_t n, int64_t p0, int64_t p1, int64_t end, Fn&& fn) {
  // Valid (id, position) pairs of the range first, so each block knows the next one; then up to four
  // valid ids after it.
  std::vector<int64_t>& v = tl_valid;
  v.clear();
  int64_t m = -1;
  for (int64_t p = p0, after = 0; p < end && after < 4; ++p) {
    if (p == p1) m = int64_t(v.size()) / 2;
    const int64_t id = ids[p];
    if (id >= 0 && id < n) v.push_back(id), v.push_back(p), after += p >= p1;
  }
  if (m < 0) m = int64_t(v.size()) / 2;
  const int64_t total = int64_t(v.size()) / 2;
  for (int64_t k = 0; k < m; k += 4) {
    int64_t block[4], pos[4], next[4];
    const int B = int(std::min<int64_t>(4, m - k));
    const int nb = int(std::clamp<int64_t>(total - k - B, 0, 4));
    for (int b = 0; b < B; ++b) block[b] = v[2 * (k + b)], pos[b] = v[2 * (k + b) + 1];
    for (int b = 0; b < nb; ++b) next[b] = v[2 * (k + B + b)];
    fn(block, pos, B, next, nb);
  }
}

thread_local std::vector<float> tl_parts;

// Shared driver of the two accumulating targets: pieces of the list each add into their own (T, d)
// output (piece 0 into y), then the parts are added to y in piece order.
template <class PieceFn>
void AccumulatePieces(ffi::ThreadPool& pool, int64_t c, int64_t T, int64_t d, int64_t bytes_per_position, float* y,
                      PieceFn&& piece_fn) {
  std::fill(y, y + T * d, 0.0f);
  if (c == 0) return;
  const int64_t len = PieceLength(c);
  const int64_t pieces = CeilDiv(c, len);
  float* parts = Scratch(tl_parts, size_t(std::max<int64_t>(pieces - 1, 0) * T * d));
  ParallelFor(pool, pieces, c * bytes_per_position, [&](int64_t i) {
    float* out = i == 0 ? y : parts + (i - 1) * T * d;
    if (i > 0) std::fill(out, out + T * d, 0.0f);
    piece_fn(i * len, std::min(c, (i + 1) * len), out);
  });
  ReduceParts(pool, y, parts, pieces - 1, T, d);
}

ffi::Error CheckFfn(const ffi::Buffer<ffi::F32>& rows, const ffi::Buffer<ffi::F32>& b_up,
                    const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S32>& ids, int32_t kind) {
  const auto rd = rows.dimensions(), xd = x.dimensions();
  if (rd.size() != 3 || xd.size() != 2 || ids.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn: rows (n, R, d), x (T, d), ids (K,) expected");
  if (kind < 0 || kind > 3) return ffi::Error::InvalidArgument("jpinfer sparse ffn: unknown kind");
  if (rd[1] != (kind == kRelu ? 2 : 3)) return ffi::Error::InvalidArgument("jpinfer sparse ffn: R must be 3 (2 for relu)");
  if (xd[1] != rd[2] || xd[0] < 1 || xd[0] > kMaxTokens)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn: x must be (T, d), 1 <= T <= 8");
  if (b_up.element_count() != 0 && int64_t(b_up.element_count()) != rd[0])
    return ffi::Error::InvalidArgument("jpinfer sparse ffn: b_up must be (n,) or empty");
  return ffi::Error::Success();
}

Ffn MakeFfn(const ffi::Buffer<ffi::F32>& rows, const ffi::Buffer<ffi::F32>& b_up, const ffi::Buffer<ffi::F32>& x,
            const ffi::Buffer<ffi::S32>& ids, int32_t kind) {
  const auto rd = rows.dimensions();
  return Ffn{rows.typed_data(), rd[0], rd[1], rd[2], b_up.element_count() ? b_up.typed_data() : nullptr,
             x.typed_data(), x.dimensions()[0], ids.typed_data(), kind};
}

ffi::Error SparseFfnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> b_up,
                         ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count,
                         ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  if (auto e = CheckFfn(rows, b_up, x, ids, kind); e.failure()) return e;
  const Ffn f = MakeFfn(rows, b_up, x, ids, kind);
  const int64_t c = ListCount(count, ids.dimensions()[0]);
  AccumulatePieces(pool, c, f.T, f.d, f.R * f.d * 4, y->typed_data(), [&](int64_t p0, int64_t p1, float* out) {
    ForBlocks(f.ids, f.n, p0, p1, c, [&](const int64_t* block, const int64_t*, int B, const int64_t* next, int nb) {
      float act[kMaxTokens * 4];
      BlockActivations(f, block, B, act, next, nb);
      const float* down[4];
      const float* next_down[4];
      for (int b = 0; b < B; ++b) down[b] = f.Row(block[b], f.R - 1);
      for (int b = 0; b < nb; ++b) next_down[b] = f.Row(next[b], f.R - 1);
      AddRowsN(B, down, act, f.T, 0, f.d, out, f.d, next_down, nb);
    });
  });
  return ffi::Error::Success();
}

ffi::Error SparseActivationsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> b_up,
                                 ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count,
                                 ffi::ResultBuffer<ffi::F32> a, int32_t kind) {
  if (auto e = CheckFfn(rows, b_up, x, ids, kind); e.failure()) return e;
  const Ffn f = MakeFfn(rows, b_up, x, ids, kind);
  const int64_t K = ids.dimensions()[0];
  const int64_t c = ListCount(count, K);
  float* A = a->typed_data();
  std::fill(A, A + f.T * K, 0.0f);
  if (c == 0) return ffi::Error::Success();
  // Each position's activation is written by the one piece that holds it: no partial sums.
  const int64_t len = 32;
  ParallelFor(pool, CeilDiv(c, len), c * (f.R - 1) * f.d * 4, [&](int64_t i) {
    ForBlocks(f.ids, f.n, i * len, std::min(c, (i + 1) * len), c,
              [&](const int64_t* block, const int64_t* pos, int B, const int64_t* next, int nb) {
      float act[kMaxTokens * 4];
      BlockActivations(f, block, B, act, next, nb);
      for (int64_t t = 0; t < f.T; ++t)
        for (int b = 0; b < B; ++b) A[t * K + pos[b]] = act[t * B + b];
    });
  });
  return ffi::Error::Success();
}

ffi::Error ListedRowsSumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count, ffi::ResultBuffer<ffi::F32> y,
                             int32_t slot) {
  const auto md = m.dimensions(), wd = w.dimensions();
  if (md.size() != 3 || wd.size() != 2 || ids.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jpinfer listed rows sum: M (n, S, d), w (T, K), ids (K,) expected");
  const int64_t n = md[0], S = md[1], d = md[2], T = wd[0], K = ids.dimensions()[0];
  if (slot < 0 || slot >= S) return ffi::Error::InvalidArgument("jpinfer listed rows sum: slot out of range");
  if (wd[1] != K || T < 1 || T > kMaxTokens)
    return ffi::Error::InvalidArgument("jpinfer listed rows sum: w must be (T, K), 1 <= T <= 8");
  const float* M = m.typed_data();
  const float* W = w.typed_data();
  const int32_t* I = ids.typed_data();
  const int64_t c = ListCount(count, K);
  AccumulatePieces(pool, c, T, d, d * 4, y->typed_data(), [&](int64_t p0, int64_t p1, float* out) {
    ForBlocks(I, n, p0, p1, c, [&](const int64_t* block, const int64_t* pos, int B, const int64_t* next, int nb) {
      const float* r[4];
      const float* rn[4];
      for (int b = 0; b < nb; ++b) rn[b] = M + (next[b] * S + slot) * d;
      float wb[kMaxTokens * 4];
      for (int b = 0; b < B; ++b) r[b] = M + (block[b] * S + slot) * d;
      for (int64_t t = 0; t < T; ++t)
        for (int b = 0; b < B; ++b) wb[t * B + b] = W[t * K + pos[b]];
      AddRowsN(B, r, wb, T, 0, d, out, d, rn, nb);
    });
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_sparse_ffn, jpn::SparseFfnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rows (n, R, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_up (n,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (T, d)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids (K,)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // count ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (T, d)
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_sparse_activations, jpn::SparseActivationsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // a (T, K)
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_listed_rows_sum, jpn::ListedRowsSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // M (n, S, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w (T, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids (K,)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // count ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (T, d)
                                  .Attr<int32_t>("slot"));
