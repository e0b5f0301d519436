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
//   jpinfer_sparse_ffn_int8     jpinfer_sparse_ffn over int8 bundles (jpinfer.sparse.neurons, the dense int8
//                               model's own integers): rows int8 (n, R, d), a float32 scale per gate/up
//                               row (n, R-1) and per output (d,) for the down slots; W8A8 like
//                               jpinfer.quant.int8 (below); optional weights (T, K) multiply each list
//                               position's activation (the routing weights of a neuron's expert)
//
// Direct host calls (plain C functions, end of file, called with ctypes: modes.hybrid's host half): the same
// three FFNs (float rows, int8 bundles, 4-bit records) on the caller's arrays, with the thread count given. Each
// FFN is one function on raw arrays (FloatFfn, Int8Ffn, Q4Ffn) that its FFI handler and its direct call both call,
// so both give the same bits.
//
// The fused kernel walks the list four neurons a pass: the 4 x gate/up rows share every load of
// x (Dots), the four activations are computed, and the four down rows are added to the piece's output
// with its partial sums held in registers (AddRows): each weight is read once, right after the
// previous ones of the same neuron (one contiguous bundle).
#include "float_rows.h"
#include "q4_rows.h"

namespace jpn {
namespace {

enum Kind : int32_t { kSwiglu = 0, kReglu = 1, kDrelu = 2, kRelu = 3, kGeglu = 4, kGelu = 5, kKinds = 6 };

inline bool Gated(int32_t kind) { return kind != kRelu && kind != kGelu; }

inline float Activate(int32_t kind, float g, float u) {
  switch (kind) {
    case kSwiglu: return g / (1.0f + std::exp(-g)) * u;  // silu(g) * u
    case kGeglu:  // gelu(g) * u, GELU's tanh form (jax.nn.gelu(approximate=True), Gemma's gelu_pytorch_tanh)
      return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    case kReglu: return std::max(g, 0.0f) * u;
    case kDrelu: return std::max(g, 0.0f) * std::max(u, 0.0f);
    case kGelu: return 0.5f * u * (1.0f + std::erf(u * 0.7071067811865476f));  // gelu(u), the erf form (Falcon)
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

// A listed FFN call's operands as raw arrays: what the FFI handlers read out of their buffers and the direct host
// calls are given. The list is its first `count` positions (clamped to [0, K]).
struct Listed {
  const float* x;  // (T, d)
  int64_t T, d;
  const int32_t* ids;  // (K,)
  int64_t K, count;
  const float* b_up;     // (n,) or nullptr
  const float* weights;  // (T, K) or nullptr: each list position's activation times it (int8 and 4-bit only)
  float* y;              // (T, d)
  int32_t kind;
};

// The checks every listed FFN makes of its operands (R: the bundles' slots; 0 for 4-bit records, which hold no
// gate/up slot). nullptr: fine; else what is wrong.
const char* CheckListed(const Listed& c, int64_t R) {
  if (c.kind < 0 || c.kind >= kKinds) return "unknown kind";
  if (R > 0 && R != (Gated(c.kind) ? 3 : 2)) return "R must be 3 (2 for relu and gelu)";
  if (c.T < 1 || c.T > kMaxTokens) return "x must be (T, d), 1 <= T <= 8";
  if (c.count < 0 || c.count > c.K) return "count outside [0, K]";
  return nullptr;
}

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

ffi::Error CheckFfn(const ffi::Buffer<ffi::F32>& rows, const ffi::Buffer<ffi::F32>& b_up,
                    const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S32>& ids, int32_t kind) {
  const auto rd = rows.dimensions(), xd = x.dimensions();
  if (rd.size() != 3 || xd.size() != 2 || ids.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn: rows (n, R, d), x (T, d), ids (K,) expected");
  if (kind < 0 || kind >= kKinds) return ffi::Error::InvalidArgument("jpinfer sparse ffn: unknown kind");
  if (rd[1] != (Gated(kind) ? 3 : 2))
    return ffi::Error::InvalidArgument("jpinfer sparse ffn: R must be 3 (2 for relu and gelu)");
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

// The float FFN over the list of float32 rows (n, R, d) (jpinfer_sparse_ffn, jpinfer_host_sparse_ffn).
const char* FloatFfn(Threads pool, const float* rows, int64_t n, int64_t R, const Listed& l) {
  if (const char* e = CheckListed(l, R)) return e;
  if (l.weights) return "float rows take no weights (the two halves do)";
  const Ffn f{rows, n, R, l.d, l.b_up, l.x, l.T, l.ids, l.kind};
  const int64_t c = l.count;
  AccumulatePieces(pool, c, f.T, f.d, f.R * f.d * 4, l.y, [&](int64_t p0, int64_t p1, float* out) {
    ForBlocks(f.ids, f.n, p0, p1, c, [&](const int64_t* block, const int64_t*, int B, const int64_t* next, int nb) {
      float act[kMaxTokens * 4];
      BlockActivations(f, block, B, act, next, nb);
      const float* down[4];
      const float* next_down[4];
      for (int b = 0; b < B; ++b) down[b] = f.Row(block[b], f.R - 1);
      for (int b = 0; b < nb; ++b) next_down[b] = f.Row(next[b], f.R - 1);
      AddRowsN<4>(B, down, act, f.T, 0, f.d, out, f.d, next_down, nb);
    });
  });
  return nullptr;
}

ffi::Error Failed(const char* what, const char* e) {
  return e ? ffi::Error::InvalidArgument(std::string(what) + ": " + e) : ffi::Error::Success();
}

ffi::Error SparseFfnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> b_up,
                         ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count,
                         ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  if (auto e = CheckFfn(rows, b_up, x, ids, kind); e.failure()) return e;
  const Ffn f = MakeFfn(rows, b_up, x, ids, kind);
  const int64_t K = ids.dimensions()[0];
  const Listed l{f.x, f.T, f.d, f.ids, K, ListCount(count, K), f.b_up, nullptr, y->typed_data(), kind};
  return Failed("jpinfer sparse ffn", FloatFfn(pool, f.rows, f.n, f.R, l));
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
      AddRowsN<4>(B, r, wb, T, 0, d, out, d, rn, nb);
    });
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- int8 bundles (W8A8)
//
// The dense int8 FFN's arithmetic restricted to the listed neurons, so the full list gives its integers:
//   1. x quantized per token (QuantizeTokens); gate/up of each listed neuron an exact int32 dot (Int8Dots),
//      h = float(acc) * (token scale * row scale) (+ b_up), the activation in float32 (times its list
//      position's weight when weights are given: the dense model's routed activation);
//   2. the listed activations quantized per token (a (T, K) vector whose peak is that of the dense
//      activation vector with the unlisted neurons at 0: the dense down product's input quantization);
//   3. the down slots summed exactly in int32 weighted by those integers (AddRowsInt8), then
//      y = float(acc) * (activation scale * down scale[j]).
// Step 2 needs every activation of a token before any down sum, so the list is walked twice (gate/up
// rows, then down rows), not fused per block like the float kernel. Step 1 takes up to four gate/up rows
// a pass (two gated neurons at one or two tokens) sharing each chunk of x, like the dense int8 kernel. Step 1 is cut into fixed pieces of
// the list, each writing its own activations; step 3 into up to one piece per thread with its own int32
// partial sum: integer sums are exact, so the result does not depend on the split (deterministic).
thread_local std::vector<int8_t> tl_xq;
thread_local std::vector<int64_t> tl_listed;
thread_local std::vector<int64_t> tl_positions;
thread_local std::vector<float> tl_act;
thread_local std::vector<int16_t> tl_actq;
thread_local std::vector<int32_t> tl_down;

// Steps 2 and 3 of the int8 and 4-bit sparse FFNs: the m listed activations act[k * T + t] quantized per token
// (int8, held in int16 for AddRowsInt8, as quantize_tokens would), the down rows down(k) summed exactly weighted
// by them, then y = acc * (activation scale * down scale of the output).
template <class RowFn>
void QuantizedDownSum(Threads pool, int64_t m, int64_t T, int64_t d, const float* act, RowFn&& down,
                      const float* down_scales, float* Y) {
  int16_t* aq = Scratch(tl_actq, size_t(m * T));
  float as[kMaxTokens];
  for (int64_t t = 0; t < T; ++t) {
    float peak = 0.0f;
    for (int64_t k = 0; k < m; ++k) peak = std::max(peak, std::fabs(act[k * T + t]));
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    for (int64_t k = 0; k < m; ++k) aq[k * T + t] = QuantizeOne(act[k * T + t], inverse);
    as[t] = peak * kInv127;
  }
  ScaledRowsSum(pool, m, T, d, down, aq, as, down_scales, tl_down, Y);
}

// The valid ids among the first `count` of a list (repeats kept: each counts) and their list positions, in
// list order, into the thread's scratch; returns how many.
int64_t ValidList(const int32_t* I, int64_t c, int64_t n, int64_t*& listed, int64_t*& position) {
  listed = Scratch(tl_listed, size_t(c));
  position = Scratch(tl_positions, size_t(c));
  int64_t m = 0;
  for (int64_t p = 0; p < c; ++p)
    if (I[p] >= 0 && I[p] < n) listed[m] = I[p], position[m++] = p;
  return m;
}

// s[r * T + t] = exact int32 dot of rows[r] with token t, rb rows (rb <= Int8RowsPerPass(T)): one Int8Dots pass when
// rb is 2 or 4, else one row at a time.
template <int T>
inline void RowDots(int rb, const int8_t* const* rows, const int8_t* const* next, const int8_t* q, int64_t d,
                    int32_t* s) {
  if constexpr (T <= 2)
    if (rb == 4) return Int8Dots<4, T>(rows, next, q, d, s);
  if constexpr (T <= 4)
    if (rb == 2) return Int8Dots<2, T>(rows, next, q, d, s);
  for (int r = 0; r < rb; ++r) Int8Dots<1, T>(rows + r, next + r, q, d, s + r * T);
}

inline void RowDotsT(int64_t T, int rb, const int8_t* const* rows, const int8_t* const* next, const int8_t* q,
                     int64_t d, int32_t* s) {
  WithCount<kMaxTokens>(T, [&](auto t) { RowDots<decltype(t)::value>(rb, rows, next, q, d, s); });
}

// The int8 FFN over the list of int8 bundles W (n, R, d) with their gate/up row scales RS (n, R-1) and the down
// scales DS (d,) (jpinfer_sparse_ffn_int8, jpinfer_host_sparse_ffn_int8).
const char* Int8Ffn(Threads pool, const int8_t* W, int64_t n, int64_t R, const float* RS, const float* DS,
                    const Listed& l) {
  if (const char* e = CheckListed(l, R)) return e;
  const int64_t d = l.d, T = l.T, P = R - 1, K = l.K, kind = l.kind;
  const float* BU = l.b_up;
  const float* WT = l.weights;
  float* Y = l.y;
  std::fill(Y, Y + T * d, 0.0f);
  int64_t *listed, *position;
  const int64_t m = ValidList(l.ids, l.count, n, listed, position);
  if (m == 0) return nullptr;
  auto row = [&](int64_t id, int64_t slot) { return W + (id * R + slot) * d; };

  // 1. activations act[k * T + t] of the listed neurons
  int8_t* q = Scratch(tl_xq, size_t(T * RoundUp(d, 32)));
  float qs[kMaxTokens];
  QuantizeTokens(l.x, T, d, q, qs);
  float* act = Scratch(tl_act, size_t(m * T));
  constexpr int64_t kActPiece = 32;
  const int64_t per_pass = std::max<int64_t>(1, Int8RowsPerPass(T) / P);  // neurons a pass: 2 gated at one token
  // the bundles prefetched while a pass streams: those of the first pass at least kRowsPrefetchBytes ahead. The
  // next pass's, before, were 3.5 KiB ahead on the default model at one token and 1.7 KiB at 3-8 (a neuron a pass).
  // Both libraries in one process (2-core Zen 4 VM, 2026-12-07; 30 chained random layers of its shape, 95% / 50%
  // listed, 21 alternated rounds, the same bits): one token 0.97-0.98x / 0.98-1.01x the time, two 0.87x / 0.86x,
  // four 0.82x / 0.81x, eight 0.82x / 0.82x; the AVX2 build keeps the next pass (kRowsPrefetchBytes). (The 4-bit
  // records' kernel the same way: 1.12x at four tokens; not kept there.)
  const int64_t ahead = RowsAhead(per_pass, per_pass * R * d);
  ParallelFor(pool, CeilDiv(m, kActPiece), m * P * d, [&](int64_t i) {
    const int64_t k1 = std::min(m, (i + 1) * kActPiece);
    for (int64_t k = i * kActPiece; k < k1; k += per_pass) {
      const int64_t B = std::min(per_pass, k1 - k);
      const int8_t* r[4];
      const int8_t* next[4];  // the bundles `ahead` in the list (the last listed one stands in at the end)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t slot = 0; slot < P; ++slot) {
          r[b * P + slot] = row(listed[k + b], slot);
          next[b * P + slot] = row(listed[std::min(k + ahead + b, m - 1)], slot);
        }
      int32_t s[4 * kMaxTokens];
      RowDotsT(T, int(B * P), r, next, q, d, s);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t id = listed[k + b];
        for (int64_t t = 0; t < T; ++t) {
          const float g = P == 2 ? float(s[(b * P) * T + t]) * (qs[t] * RS[id * P]) : 0.0f;
          float u = float(s[(b * P + P - 1) * T + t]) * (qs[t] * RS[id * P + P - 1]);
          if (BU) u += BU[id];
          const float a = Activate(kind, g, u);
          act[(k + b) * T + t] = WT ? a * WT[t * K + position[k + b]] : a;
        }
      }
    }
  });

  QuantizedDownSum(pool, m, T, d, act, [&](int64_t k) { return row(listed[k], P); }, DS, Y);
  return nullptr;
}

ffi::Error SparseFfnInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> rows, ffi::Buffer<ffi::F32> row_scales,
                             ffi::Buffer<ffi::F32> down_scales, ffi::Buffer<ffi::F32> b_up, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> weights,
                             ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  const auto rd = rows.dimensions(), xd = x.dimensions();
  if (rd.size() != 3 || xd.size() != 2 || ids.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn int8: rows (n, R, d), x (T, d), ids (K,) expected");
  const int64_t n = rd[0], R = rd[1], d = rd[2], K = ids.dimensions()[0];
  if (weights.element_count() != 0 && int64_t(weights.element_count()) != xd[0] * K)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn int8: weights must be (T, K) or empty");
  if (xd[1] != d) return ffi::Error::InvalidArgument("jpinfer sparse ffn int8: x must be (T, d), 1 <= T <= 8");
  if (int64_t(row_scales.element_count()) != n * std::max<int64_t>(R - 1, 0) || int64_t(down_scales.element_count()) != d)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn int8: scales (n, R-1) and down scales (d,) expected");
  if (b_up.element_count() != 0 && int64_t(b_up.element_count()) != n)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn int8: b_up must be (n,) or empty");
  const Listed l{x.typed_data(), xd[0], d, ids.typed_data(), K, ListCount(count, K),
                 b_up.element_count() ? b_up.typed_data() : nullptr,
                 weights.element_count() ? weights.typed_data() : nullptr, y->typed_data(), kind};
  return Failed("jpinfer sparse ffn int8", Int8Ffn(pool, reinterpret_cast<const int8_t*>(rows.typed_data()), n, R,
                                                   row_scales.typed_data(), down_scales.typed_data(), l));
}

// ---------------------------------------------------------------- 4-bit gate/up records (W4A8), int8 down slots
//
// A 4-bit model's neuron-major FFN (jpinfer.sparse.neurons) holds its gate/up rows in records by neuron
// (jpinfer.quant.q4.Q4Bundles, (n, record bytes)): neuron i's P packed rows (d / 2 bytes each: gate, then up; up only,
// P = 1, for an ungated kind), then their block scales (P x d / 32 float16), then (Q4_1) their mins likewise. Only the
// down slots are int8 columns (n, d) with a scale per output, as the int8 bundles' (4-bit blocks run along the
// neurons there, so a neuron's column cuts across them). Step 1 is the dense 4-bit product's arithmetic (x quantized
// in blocks of 32, Q4Rows) on the listed neurons' rows; steps 2 and 3 are the int8 bundles' (QuantizedDownSum). One
// record a pass, its rows each a stream prefetched at the same offsets of the record two further down the list
// (9 KiB ahead at d 4096), that record's scales (and mins) too. Reading one record, not a neuron's rows and scale
// rows from four places, made this half 1.5x faster (Q4Bundles' docstring).
thread_local Q8Scratch tl_q8;

template <int T, bool kQ41>
inline void Q4NeuronDots(int P, const uint8_t* const* rows, const uint16_t* const* ds, const uint16_t* const* ms,
                         const uint8_t* const* ahead, const Q8Octets& x, float* s) {
  if constexpr (Q4RowsPerPass(T) >= 2)
    if (P == 2) return Q4Rows<2, T, kQ41>(rows, ds, ms, ahead, x, s, 2);
  for (int r = 0; r < P; ++r) Q4Rows<1, T, kQ41>(rows + r, ds + r, ms + r, ahead + r, x, s + r, P);
}

// The 4-bit FFN over the list: gate/up records R (n, record bytes), int8 down slots down_rows (n, d) with their
// scales per output (d,) (jpinfer_sparse_ffn_q4_*, jpinfer_host_sparse_ffn_q4).
template <bool kQ41>
const char* Q4Ffn(Threads pool, const uint8_t* R, int64_t record_bytes, const int8_t* down_rows, int64_t n,
                  const float* down_scales, const Listed& l) {
  if (const char* e = CheckListed(l, 0)) return e;
  const int64_t d = l.d, T = l.T, P = Gated(l.kind) ? 2 : 1, nb = d / 32, K = l.K, kind = l.kind;
  const int64_t scales_at = P * d / 2, mins_at = scales_at + P * nb * 2, record = mins_at + (kQ41 ? P * nb * 2 : 0);
  if (d % 32 != 0 || record_bytes != record) return "a record of P 4-bit rows of d per neuron of down (n, d)";
  const float* BU = l.b_up;
  const float* WT = l.weights;
  float* Y = l.y;
  std::fill(Y, Y + T * d, 0.0f);
  int64_t *listed, *position;
  const int64_t m = ValidList(l.ids, l.count, n, listed, position);
  if (m == 0) return nullptr;

  // 1. activations act[k * T + t] of the listed neurons
  const Q8Octets xq = QuantizeForQ4(l.x, T, d, tl_q8);
  float* act = Scratch(tl_act, size_t(m * T));
  constexpr int64_t kActPiece = 32;
  ParallelFor(pool, CeilDiv(m, kActPiece), m * record, [&](int64_t i) {
    const int64_t k1 = std::min(m, (i + 1) * kActPiece);
    for (int64_t k = i * kActPiece; k < k1; ++k) {
      const int64_t id = listed[k];
      const uint8_t* own = R + id * record;
      const uint8_t* later = R + listed[std::min(k + 2, m - 1)] * record;
      const uint8_t* rows[2];
      const uint8_t* ahead[2];
      const uint16_t* ds[2];
      const uint16_t* ms[2];
      for (int64_t r = 0; r < P; ++r) {
        rows[r] = own + r * (d / 2), ahead[r] = later + r * (d / 2);
        ds[r] = reinterpret_cast<const uint16_t*>(own + scales_at) + r * nb;
        ms[r] = kQ41 ? reinterpret_cast<const uint16_t*>(own + mins_at) + r * nb : nullptr;
      }
      for (int64_t c = scales_at; c < record; c += 64) PrefetchAhead(later + c);
      float s[2 * kMaxTokens];
      WithCount<kMaxTokens>(T, [&](auto t) {
        Q4NeuronDots<decltype(t)::value, kQ41>(int(P), rows, ds, ms, ahead, xq, s);
      });
      for (int64_t t = 0; t < T; ++t) {
        const float g = P == 2 ? s[t * P] : 0.0f;
        const float u = s[t * P + P - 1] + (BU ? BU[id] : 0.0f);
        const float a = Activate(kind, g, u);
        act[k * T + t] = WT ? a * WT[t * K + position[k]] : a;
      }
    }
  });
  QuantizedDownSum(pool, m, T, d, act, [&](int64_t k) { return down_rows + listed[k] * d; }, down_scales, Y);
  return nullptr;
}

template <bool kQ41>
ffi::Error SparseFfnQ4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> records, ffi::Buffer<ffi::S8> down,
                           ffi::Buffer<ffi::F32> down_scales, ffi::Buffer<ffi::F32> b_up, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> weights,
                           ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  const auto rd = records.dimensions(), dd = down.dimensions(), xd = x.dimensions();
  if (rd.size() != 2 || dd.size() != 2 || xd.size() != 2 || ids.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn q4: records (n, bytes), down (n, d), x (T, d), ids (K,)");
  const int64_t n = dd[0], d = dd[1], K = ids.dimensions()[0];
  if (rd[0] != n || xd[1] != d)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn q4: records (n, bytes), down (n, d), x (T, d) expected");
  if (int64_t(down_scales.element_count()) != d || (b_up.element_count() != 0 && int64_t(b_up.element_count()) != n))
    return ffi::Error::InvalidArgument("jpinfer sparse ffn q4: down scales (d,) and b_up (n,) or empty expected");
  if (weights.element_count() != 0 && int64_t(weights.element_count()) != xd[0] * K)
    return ffi::Error::InvalidArgument("jpinfer sparse ffn q4: weights must be (T, K) or empty");
  const Listed l{x.typed_data(), xd[0], d, ids.typed_data(), K, ListCount(count, K),
                 b_up.element_count() ? b_up.typed_data() : nullptr,
                 weights.element_count() ? weights.typed_data() : nullptr, y->typed_data(), kind};
  return Failed("jpinfer sparse ffn q4", Q4Ffn<kQ41>(pool, records.typed_data(), rd[1],
                                                     reinterpret_cast<const int8_t*>(down.typed_data()), n,
                                                     down_scales.typed_data(), l));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_sparse_ffn_int8, jpn::SparseFfnInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // rows (n, R, d) int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row scales (n, R-1): gate/up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down scales (d,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b_up (n,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (T, d)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids (K,)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // count ()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights (T, K) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (T, d)
                                  .Attr<int32_t>("kind"));

#define JPN_SPARSE_Q4_BINDING                                                      \
  ffi::Ffi::Bind()                                                                 \
      .Ctx<ffi::ThreadPool>()                                                      \
      .Arg<ffi::Buffer<ffi::U8>>()  /* gate/up records (n, record bytes) */        \
      .Arg<ffi::Buffer<ffi::S8>>()  /* down slots (n, d) int8 */                   \
      .Arg<ffi::Buffer<ffi::F32>>() /* down scales (d,) */                         \
      .Arg<ffi::Buffer<ffi::F32>>() /* b_up (n,) or (0,) */                        \
      .Arg<ffi::Buffer<ffi::F32>>() /* x (T, d) */                                 \
      .Arg<ffi::Buffer<ffi::S32>>() /* ids (K,) */                                 \
      .Arg<ffi::Buffer<ffi::S32>>() /* count () */                                 \
      .Arg<ffi::Buffer<ffi::F32>>() /* weights (T, K) or (0,) */                   \
      .Ret<ffi::Buffer<ffi::F32>>() /* y (T, d) */                                 \
      .Attr<int32_t>("kind")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_sparse_ffn_q4_0, jpn::SparseFfnQ4Impl<false>, JPN_SPARSE_Q4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_sparse_ffn_q4_1, jpn::SparseFfnQ4Impl<true>, JPN_SPARSE_Q4_BINDING);

// ---------------------------------------------------------------- direct host calls
//
// The three listed FFNs above as plain C functions on the caller's arrays, for a caller outside XLA: the hybrid's
// host half (jpinfer.native.host), which calls them with ctypes from its host callback on the cold part's own
// buffers, where a jitted call a layer cost ~350 us of dispatch and synchronisation (bench/results/hybrid_host.md).
// Same functions as the FFI handlers (FloatFfn, Int8Ffn, Q4Ffn), so the same bits. Arrays are C-contiguous, shapes
// as the handlers' (the caller checks them); b_up and weights may be null; count is clamped to [0, K]; threads: the
// workers to spread over, the calling thread included (the handlers use XLA's intra-op pool's size). Each returns
// null, or what is wrong with the arguments (then y is unspecified).
extern "C" {

__attribute__((visibility("default"))) const char* jpinfer_host_sparse_ffn(
    int32_t threads, const float* rows, int64_t n, int64_t R, int64_t d, const float* b_up, const float* x, int64_t T,
    const int32_t* ids, int64_t K, int64_t count, float* y, int32_t kind) {
  const jpn::Listed l{x, T, d, ids, K, jpn::Clamp(count, 0, K), b_up, nullptr, y, kind};
  return jpn::FloatFfn(jpn::Threads(threads), rows, n, R, l);
}

__attribute__((visibility("default"))) const char* jpinfer_host_sparse_ffn_int8(
    int32_t threads, const int8_t* rows, int64_t n, int64_t R, int64_t d, const float* row_scales,
    const float* down_scales, const float* b_up, const float* x, int64_t T, const int32_t* ids, int64_t K,
    int64_t count, const float* weights, float* y, int32_t kind) {
  const jpn::Listed l{x, T, d, ids, K, jpn::Clamp(count, 0, K), b_up, weights, y, kind};
  return jpn::Int8Ffn(jpn::Threads(threads), rows, n, R, row_scales, down_scales, l);
}

// q4_1: 0 for Q4_0 records, 1 for Q4_1's (with their mins).
__attribute__((visibility("default"))) const char* jpinfer_host_sparse_ffn_q4(
    int32_t threads, int32_t q4_1, const uint8_t* records, int64_t record_bytes, const int8_t* down, int64_t n,
    int64_t d, const float* down_scales, const float* b_up, const float* x, int64_t T, const int32_t* ids, int64_t K,
    int64_t count, const float* weights, float* y, int32_t kind) {
  const jpn::Listed l{x, T, d, ids, K, jpn::Clamp(count, 0, K), b_up, weights, y, kind};
  const jpn::Threads pool(threads);
  return q4_1 ? jpn::Q4Ffn<true>(pool, records, record_bytes, down, n, down_scales, l)
              : jpn::Q4Ffn<false>(pool, records, record_bytes, down, n, down_scales, l);
}

}  // extern "C"
