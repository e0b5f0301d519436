// Causal grouped-query attention of 1..8 new tokens over the KV cache, read in place:
//   jpinfer_cached_attention  q (B, T, H, hd), cache k and v (B, KV, S, hd), positions (T,) or (B, T)
//                             int32 -> (B, T, H, hd) float32.
// Positions (T,) are shared by the batch; (B, T) give each sequence its own (batched decoding, every
// sequence at its own length). Query head h reads kv head h / (H / KV). Token t of sequence b sees cache
// slots s with s <= positions[b, t] (and s > positions[b, t] - window when window > 0); a score is q . k * scale, then softcap * tanh(score /
// softcap) when softcap > 0 (Gemma 2); slots past the last token's position are never read,
// so a decode step at position 40 of a 4096-slot cache reads 41 rows of each head's keys and values.
// A token that sees no slot gets zeros.
//
// Why a kernel: XLA:CPU's decode step copied the attended part of every layer's cache before its two
// products (a slice of the keys, a transpose of the values), and ran the 1-row products and the softmax
// as separate operations: 1.4 of the default model's 8.7 ms int8 step (bench/decode_profile.py,
// 2-core EPYC, 2026-12-03), where the products themselves read ~6 MB.
//
// Layout of the work: the used slots are cut into blocks of kBlock positions; one piece is one
// (batch, kv head, block), and it holds the scores of all the head group's queries for its block in
// scratch (keys read once, from memory; the group's queries share each load), exponentiates them
// against the block's own maxima, and sums the probability-weighted value rows (read once). The
// pieces' (max, sum, weighted values) are combined in block order on the calling thread, the
// split-softmax rule: out = sum_j e^(m_j - M) acc_j / sum_j e^(m_j - M) l_j, M = max_j m_j. The
// partition depends on the shapes and positions only, so results do not depend on the thread count;
// a sequence's pieces end at its own last position and blocks it cannot see are skipped, so its output
// does not depend on the other sequences of the batch either.
#include "float_rows.h"
#include "vec.h"

namespace jpn {
namespace {

// Slots per piece: 128 KiB of keys and values at hd 64, in L2. Smaller blocks, for more pieces than the default
// model's 3 kv heads give at short lengths, did not pay (2-core Zen 4 VM, 2026-12-06, one process, 30 layers
// chained, one token, 25 alternated rounds): 128 slots 0.99-1.02x the time at 100-900 positions, 64 slots
// 1.00-1.09x; a 7B-shaped layer (32 kv heads) 0.99-1.08x and 1.10-1.14x; four tokens 0.97-0.98x and 0.98-1.02x.
constexpr int64_t kBlock = 256;

thread_local std::vector<float> tl_scores;
thread_local std::vector<float> tl_queries;
thread_local std::vector<float> tl_partial;

// acc[0 .. 8 NV) = sum over s in [lo, hi) of p[s] * v[s * hd ...]: the columns in registers, rows in order.
template <int NV>
inline void WeightedRows(const float* p, const float* v, int64_t hd, int64_t lo, int64_t hi, float* acc) {
  __m256 a[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t s = lo; s < hi; ++s) {
    const __m256 w = _mm256_set1_ps(p[s]);
    const float* row = v + s * hd;
#pragma GCC unroll 8
    for (int i = 0; i < NV; i += 2) _mm_prefetch(reinterpret_cast<const char*>(row + 8 * hd + 8 * i), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * i), a[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

void WeightedRowsAnyWidth(const float* p, const float* v, int64_t hd, int64_t lo, int64_t hi, float* acc) {
  for (int64_t c = 0; c < hd; c += 64) {
    WithCount<8>(std::min<int64_t>(8, (hd - c) / 8),
                 [&](auto n) { WeightedRows<decltype(n)::value>(p, v + c, hd, lo, hi, acc + c); });
  }
}

struct Shape {
  int64_t B, T, H, KV, S, hd, G;
};

// One piece: queries Q = T * G of (b, kvh) against slots [s0, s1). For query i (token i / G) the
// visible slots are [lo[t], hi[t]) (sequence b's rows). Writes per query: max, sum of e^(score - max),
// and hd weighted sums; a max of -inf for a query that sees nothing here (nothing read when no query does).
void Piece(const Shape& sh, const float* q, const float* k, const float* v, const int64_t* lo, const int64_t* hi,
           float scale, float softcap, int64_t b, int64_t kvh, int64_t s0, int64_t s1, float* out) {
  const int64_t Q = sh.T * sh.G, hd = sh.hd, n = s1 - s0;
  bool seen = false;
  for (int64_t t = 0; t < sh.T; ++t) seen |= lo[t] < s1 && hi[t] > s0;
  if (!seen || n <= 0) {
    for (int64_t i = 0; i < Q; ++i) {
      out[i * (hd + 2)] = -INFINITY;
      std::fill(out + i * (hd + 2) + 1, out + (i + 1) * (hd + 2), 0.0f);
    }
    return;
  }
  // the group's queries, contiguous (Q, hd), token-major
  float* queries = Scratch(tl_queries, Q * hd);
  for (int64_t t = 0; t < sh.T; ++t)
    std::memcpy(queries + t * sh.G * hd, q + ((b * sh.T + t) * sh.H + kvh * sh.G) * hd, sh.G * hd * sizeof(float));
  const float* keys = k + ((b * sh.KV + kvh) * sh.S + s0) * hd;
  const float* values = v + ((b * sh.KV + kvh) * sh.S + s0) * hd;
  // scores (Q, n): eight key rows at a time against up to eight queries (Dots' token limit)
  float* scores = Scratch(tl_scores, Q * RoundUp(n, 8));
  const int64_t stride = RoundUp(n, 8);
  float block[kMaxTokens * 8];
  for (int64_t s = 0; s < n; s += 8) {
    const float *rows[8], *next[8];
    for (int r = 0; r < 8; ++r) {
      rows[r] = keys + std::min<int64_t>(s + r, n - 1) * hd;  // tail: repeats, unused
      next[r] = keys + std::min<int64_t>(s + 8 + r, n - 1) * hd;
    }
    for (int64_t q0 = 0; q0 < Q; q0 += kMaxTokens) {
      const int64_t qn = std::min<int64_t>(kMaxTokens, Q - q0);
      Dots<8>(rows, queries + q0 * hd, qn, hd, block, q0 == 0 ? next : nullptr);
      for (int64_t i = 0; i < qn; ++i)
        for (int r = 0; r < 8; ++r) scores[(q0 + i) * stride + s + r] = block[i * 8 + r] * scale;
    }
  }
  if (softcap > 0)
    for (int64_t i = 0; i < Q * stride; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t t = i / sh.G;
    const int64_t a = std::max(lo[t], s0) - s0, z = std::min(hi[t], s1) - s0;  // visible, relative
    float* row = scores + i * stride;
    float* res = out + i * (hd + 2);
    if (a >= z) {  // nothing visible in this block
      res[0] = -INFINITY;
      std::fill(res + 1, res + hd + 2, 0.0f);
      continue;
    }
    float m = row[a];  // the maximum: eight lanes, then the tail (max is exact in any order)
    {
      __m256 m8 = _mm256_set1_ps(m);
      int64_t s = a;
      for (; s + 8 <= z; s += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + s));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m8);
      for (float lane : lanes) m = std::max(m, lane);
      for (; s < z; ++s) m = std::max(m, row[s]);
    }
    // e^(score - m) in place over [a, z): whole vectors, then the tail in a padded copy
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t s = a;
    for (; s + 8 <= z; s += 8) {
      const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(row + s), mv));
      _mm256_storeu_ps(row + s, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float l = HSum(sum8);
    if (s < z) {
      alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::copy(row + s, row + z, tail);
      alignas(32) float e[8];
      _mm256_store_ps(e, ExpNonPositive(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
      for (int64_t j = 0; j < z - s; ++j) {
        row[s + j] = e[j];
        l += e[j];
      }
    }
    res[0] = m;
    res[1] = l;
    WeightedRowsAnyWidth(row, values, hd, a, z, res + 2);
  }
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k,
                               ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> positions,
                               ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window) {
  const auto qd = q.dimensions(), kd = cache_k.dimensions(), vd = cache_v.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      !std::equal(qd.begin(), qd.end(), od.begin(), od.end()) ||
      (int64_t(positions.element_count()) != qd[1] && int64_t(positions.element_count()) != qd[0] * qd[1]) ||
      qd[0] != kd[0] || qd[3] != kd[3] || qd[1] < 1 || qd[1] > kMaxTokens ||
      kd[1] < 1 || qd[2] % kd[1] != 0 || kd[3] % 8 != 0)
    return ffi::Error::InvalidArgument(
        "jpinfer cached attention: q (B, T, H, hd), caches (B, KV, S, hd), positions (T,) or (B, T), T <= 8, "
        "H a multiple of KV, hd a multiple of 8");
  const Shape sh{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], qd[2] / kd[1]};
  // visible slots [lo, hi) per (sequence, token); shared positions are repeated for every sequence
  const bool shared = int64_t(positions.element_count()) == sh.T;
  std::vector<int64_t> lo(sh.B * sh.T), hi(sh.B * sh.T), used_by(sh.B, 0);
  int64_t used = 0;
  for (int64_t bt = 0; bt < sh.B * sh.T; ++bt) {
    const int64_t p = positions.typed_data()[shared ? bt % sh.T : bt];
    const SlotRange seen = VisibleSlots(p, sh.S, window);
    lo[bt] = seen.lo, hi[bt] = seen.hi;
    used_by[bt / sh.T] = std::max(used_by[bt / sh.T], hi[bt]);
    used = std::max(used, hi[bt]);
  }
  const int64_t first = *std::min_element(lo.begin(), lo.end()) / kBlock;  // blocks before every window: skipped
  const int64_t blocks = CeilDiv(used, kBlock) - first;
  const int64_t Q = sh.T * sh.G, stride = Q * (sh.hd + 2);
  float* o = out->typed_data();
  if (blocks <= 0) {
    std::fill(o, o + out->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  const int64_t pieces = sh.B * sh.KV * blocks;
  float* partial = Scratch(tl_partial, pieces * stride);
  const float *qp = q.typed_data(), *kp = cache_k.typed_data(), *vp = cache_v.typed_data();
  ParallelFor(pool, pieces, sh.B * sh.KV * (used - first * kBlock) * sh.hd * 8, [&](int64_t piece) {
    const int64_t j = piece % blocks, bk = piece / blocks;
    const int64_t b = bk / sh.KV, s0 = (first + j) * kBlock, s1 = std::min(s0 + kBlock, used_by[b]);
    Piece(sh, qp, kp, vp, lo.data() + b * sh.T, hi.data() + b * sh.T, scale, softcap, b, bk % sh.KV, s0, s1,
          partial + piece * stride);
  });
  // combine the blocks of each (b, kv head, query) in block order
  for (int64_t bk = 0; bk < sh.B * sh.KV; ++bk) {
    const int64_t b = bk / sh.KV, kvh = bk % sh.KV;
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t t = i / sh.G, h = kvh * sh.G + i % sh.G;
      float* dst = o + ((b * sh.T + t) * sh.H + h) * sh.hd;
      float m = -INFINITY;
      for (int64_t j = 0; j < blocks; ++j) m = std::max(m, partial[(bk * blocks + j) * stride + i * (sh.hd + 2)]);
      std::fill(dst, dst + sh.hd, 0.0f);
      if (m == -INFINITY) continue;
      float l = 0.0f;
      for (int64_t j = 0; j < blocks; ++j) {
        const float* res = partial + (bk * blocks + j) * stride + i * (sh.hd + 2);
        if (res[0] == -INFINITY) continue;
        const float w = blocks == 1 ? 1.0f : std::exp(res[0] - m);
        l += w * res[1];
        for (int64_t c = 0; c < sh.hd; ++c) dst[c] += w * res[2 + c];
      }
      const float inv = 1.0f / l;
      for (int64_t c = 0; c < sh.hd; ++c) dst[c] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_cached_attention, jpn::CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, hd)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache k (B, KV, S, hd)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache v (B, KV, S, hd)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions (T,) or (B, T)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, hd)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));
