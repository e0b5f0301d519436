// Causal grouped-query attention of a long prompt (many new tokens, one position row) over the KV cache:
//   jpinfer_prefill_attention  q (B, T, H, hd), cache k and v (B, KV, S, hd), positions (T,) int32
//                              -> (B, T, H, hd) float32.
// The same attention as jpinfer_cached_attention (attention.cc: visible slots, scale, softcap, window, zeros
// for a token that sees nothing), for prompts: that kernel holds every query's scores for a block of slots,
// which suits 1-8 tokens; here the work is the prompt's queries against the keys they see, computed in tiles.
//
// Why a kernel: XLA:CPU's blocked attention (models/transformer.py blocked_attention) ran a 1024-token
// prefill of the default model at ~100 GFLOP/s, 12-16 ms a layer, a third of the prefill (2-core Intel Xeon
// VM, 2026-12-06): its products have an inner dimension of hd = 64, and its blocks compute the masked half of
// the diagonal ones.
//
// Layout of the work (the softmax of Milakov and Gimelshein, 2018, tiled as in FlashAttention, Dao et al.,
// 2022): one piece is one (batch, kv head, tile of the prompt's tokens); its queries (the head group's for
// each token, kQueryRows rows at most) stay in scratch with their output rows, running maxima and sums,
// while key tiles of kKeyTile slots go by in slot order, from the first any of its tokens sees to the last:
// scores = queries x keys^T (the used keys are transposed once per call, tile by tile, so the products
// broadcast a query entry against a vector of keys: no horizontal sums), the tile's softmax update, then output += probabilities x values.
// The key tiles are fixed by slot index, so a token's arithmetic depends on its own positions only: not on
// its tile, the prompt's length or the thread count (each piece is one thread's).
#include "vec.h"

// GCC 12 reports the unmasked AVX-512 intrinsics' _mm512_undefined_ps() source as "may be used uninitialized"
// once they are inlined here (a false positive: the all-ones mask never reads it).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace jpn {
namespace {

// Slots per key tile: kKeyVecs vectors of scores a row (64 slots with AVX-512, 16 with AVX2), and rows per
// register block: the two products keep kRowBlock x kKeyVecs accumulators, which with AVX2's 16 registers
// means 6 x 2 (4 x 4 spilled: the AVX2 build took 11 ms a layer at 1024 tokens, 8.2 ms with 6 x 2; 2-core
// Intel Xeon VM, 2026-12-06). Query rows per piece: 64 (with the default model's 3 queries a kv head, 21
// tokens); a piece's scratch (queries, outputs, scores) is ~50 KiB at hd 64, in L2.
#ifdef __AVX512F__
constexpr int64_t kKeyVecs = 4;
constexpr int kRowBlock = 4;  // rows per register block of the two products
#else
constexpr int64_t kKeyVecs = 2;
constexpr int kRowBlock = 6;
#endif
constexpr int64_t kKeyTile = kKeyVecs * kLanes;
constexpr int64_t kQueryRows = 64;

thread_local std::vector<float> tl_queries, tl_outputs, tl_scores, tl_stats, tl_keys_t;

// Both products of a piece, one register block: c[r][0 .. kKeyVecs * kLanes) = (c[r] if kAccumulate) + sum over
// i < n, in order, of a[r][i] * b[i][0 ..], for R (<= kRowBlock) rows of a, a row's entry broadcast against the
// vectors of b's row (no horizontal sums); the strides are a row's. The scores: a the queries (n = hd), b a key
// tile transposed (hd, kKeyTile); the output: a the probabilities (n the tile's slots), b the values from column c0.
template <int R, bool kAccumulate>
inline void BroadcastProduct(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t n, float* c,
                             int64_t c_stride) {
  Vec acc[R][kKeyVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j)
      acc[r][j] = kAccumulate ? Wide::Load(c + r * c_stride + j * kLanes) : Wide::Zero();
  for (int64_t i = 0; i < n; ++i) {
    Vec bv[kKeyVecs];
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j) bv[j] = Wide::Load(b + i * b_stride + j * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec av = Wide::Set(a[r * a_stride + i]);
#pragma GCC unroll 4
      for (int j = 0; j < kKeyVecs; ++j) acc[r][j] = Wide::Fma(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j) Wide::Store(c + r * c_stride + j * kLanes, acc[r][j]);
}

// out[r] += probs[r] x values for the last hd % (kKeyVecs * kLanes) columns, one vector at a time.
inline void AddWeightedValuesTail(const float* probs, const float* values, int64_t hd, int64_t n, int64_t rows,
                                  int64_t c0, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = c0; c < hd; c += kLanes) {
      Vec acc = Wide::Load(out + r * hd + c);
      for (int64_t s = 0; s < n; ++s)
        acc = Wide::Fma(Wide::Set(probs[r * kKeyTile + s]), Wide::Load(values + s * hd + c), acc);
      Wide::Store(out + r * hd + c, acc);
    }
}

struct Shape {
  int64_t B, T, H, KV, S, hd, G;
  int64_t tokens_per_piece, tiles;
};

// One piece: tokens [t0, t1) of sequence b, the queries of kv head kvh.
// keys_t: this (b, kvh)'s keys transposed, tile j at keys_t + j * hd * kKeyTile as (hd, kKeyTile).
void Piece(const Shape& sh, const float* q, const float* keys_t, const float* v, const int64_t* lo,
           const int64_t* hi, float scale, float softcap, int64_t b, int64_t kvh, int64_t t0, int64_t t1, float* o) {
  const int64_t G = sh.G, hd = sh.hd, rows = (t1 - t0) * G;
  float* queries = Scratch(tl_queries, rows * hd);
  float* outputs = Scratch(tl_outputs, rows * hd);
  float* scores = Scratch(tl_scores, RoundUp(rows, kRowBlock) * kKeyTile);
  float* stats = Scratch(tl_stats, 2 * rows);  // running max, running sum
  float *run_max = stats, *run_sum = stats + rows;
  for (int64_t t = t0; t < t1; ++t) {  // rows token-major: (token, query of the group), scaled
    const float* src = q + ((b * sh.T + t) * sh.H + kvh * G) * hd;
    float* dst = queries + (t - t0) * G * hd;
    for (int64_t i = 0; i < G * hd; ++i) dst[i] = src[i] * scale;
  }
  std::fill(outputs, outputs + rows * hd, 0.0f);
  std::fill(run_max, run_max + rows, -INFINITY);
  std::fill(run_sum, run_sum + rows, 0.0f);
  int64_t first = sh.S, last = 0;  // slots any of these tokens sees
  for (int64_t t = t0; t < t1; ++t)
    if (lo[t] < hi[t]) first = std::min(first, lo[t]), last = std::max(last, hi[t]);
  const float* values = v + (b * sh.KV + kvh) * sh.S * hd;
  const int64_t full_cols = hd - hd % (kKeyVecs * kLanes);
  for (int64_t s0 = first - first % kKeyTile; s0 < last; s0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last - s0);
    const float* tile_keys_t = keys_t + s0 * hd;  // tile s0 / kKeyTile
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
      WithCount<kRowBlock>(std::min<int64_t>(kRowBlock, rows - r0), [&](auto R) {
        BroadcastProduct<decltype(R)::value, false>(queries + r0 * hd, hd, tile_keys_t, kKeyTile, hd,
                                                    scores + r0 * kKeyTile, kKeyTile);
      });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / G;
      const int64_t a = Clamp(lo[t] - s0, 0, n), z = Clamp(hi[t] - s0, 0, n);  // visible, relative
      float* row = scores + r * kKeyTile;
      if (a >= z) {  // nothing this row sees here: no weights
        std::fill(row, row + kKeyTile, 0.0f);
        continue;
      }
      if (softcap > 0)
        for (int64_t s = a; s < z; ++s) row[s] = softcap * std::tanh(row[s] / softcap);
      std::fill(row, row + a, -INFINITY);
      std::fill(row + z, row + kKeyTile, -INFINITY);
      Vec m = Wide::Load(row);
      for (int64_t j = 1; j < kKeyVecs; ++j) m = Wide::Max(m, Wide::Load(row + j * kLanes));
      const float tile_max = MaxLanes(m);
      const float new_max = std::max(run_max[r], tile_max);
      const Vec mv = Wide::Set(new_max);
      Vec sum = Wide::Zero();
      for (int64_t j = 0; j < kKeyVecs; ++j) {
        const Vec s = Wide::Load(row + j * kLanes);
        const Vec e = Wide::ZeroWhereMinusInf(ExpNonPositive(Wide::Sub(s, mv)), s);
        Wide::Store(row + j * kLanes, e);
        sum = Wide::Add(sum, e);
      }
      if (new_max != run_max[r]) {  // earlier tiles' weights were against a smaller maximum
        const float rescale = std::exp(run_max[r] - new_max);  // 0 before the first visible tile
        run_sum[r] *= rescale;
        float* out = outputs + r * hd;
        const Vec scale = Wide::Set(rescale);
        for (int64_t c = 0; c < hd; c += kLanes) Wide::Store(out + c, Wide::Mul(Wide::Load(out + c), scale));
      }
      run_max[r] = new_max;
      run_sum[r] += Wide::SumLanes(sum);
    }
    const float* tile_values = values + s0 * hd;
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t rn = std::min<int64_t>(kRowBlock, rows - r0);
      for (int64_t c0 = 0; c0 < full_cols; c0 += kKeyVecs * kLanes)
        WithCount<kRowBlock>(rn, [&](auto R) {
          BroadcastProduct<decltype(R)::value, true>(scores + r0 * kKeyTile, kKeyTile, tile_values + c0, hd, n,
                                                     outputs + r0 * hd + c0, hd);
        });
      if (full_cols < hd)
        AddWeightedValuesTail(scores + r0 * kKeyTile, tile_values, hd, n, rn, full_cols, outputs + r0 * hd);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, h = kvh * G + r % G;
    float* dst = o + ((b * sh.T + t) * sh.H + h) * hd;
    const float* src = outputs + r * hd;
    if (run_sum[r] > 0) {
      const float inv = 1.0f / run_sum[r];
      for (int64_t c = 0; c < hd; ++c) dst[c] = src[c] * inv;
    } else {
      std::fill(dst, dst + hd, 0.0f);
    }
  }
}

ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k,
                                ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> positions,
                                ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window) {
  const auto qd = q.dimensions(), kd = cache_k.dimensions(), vd = cache_v.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      !std::equal(qd.begin(), qd.end(), od.begin(), od.end()) || int64_t(positions.element_count()) != qd[1] ||
      qd[0] != kd[0] || qd[3] != kd[3] || qd[1] < 1 || kd[1] < 1 || qd[2] % kd[1] != 0 || kd[3] % 16 != 0)
    return ffi::Error::InvalidArgument(
        "jpinfer prefill attention: q (B, T, H, hd), caches (B, KV, S, hd), positions (T,), H a multiple of KV, "
        "hd a multiple of 16");
  Shape sh{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], qd[2] / kd[1], 0, 0};
  sh.tokens_per_piece = std::max<int64_t>(1, kQueryRows / sh.G);
  sh.tiles = CeilDiv(sh.T, sh.tokens_per_piece);
  std::vector<int64_t> lo(sh.T), hi(sh.T);  // visible slots [lo, hi) per token
  int64_t used = 0;
  for (int64_t t = 0; t < sh.T; ++t) {
    const int64_t p = positions.typed_data()[t];
    const SlotRange seen = VisibleSlots(p, sh.S, window);
    lo[t] = seen.lo, hi[t] = seen.hi;
    used = std::max(used, hi[t]);
  }
  const float *qp = q.typed_data(), *kp = cache_k.typed_data(), *vp = cache_v.typed_data();
  float* o = out->typed_data();
  // the used keys of every (b, kv head) transposed, tile by tile (hd, kKeyTile), slots past `used` zero
  const int64_t key_tiles = CeilDiv(used, kKeyTile), per_head = key_tiles * kKeyTile * sh.hd;
  float* keys_t = Scratch(tl_keys_t, sh.B * sh.KV * per_head);
  ParallelFor(pool, sh.B * sh.KV * key_tiles, sh.B * sh.KV * used * sh.hd * 8, [&](int64_t i) {
    const int64_t bk = i / key_tiles, s0 = i % key_tiles * kKeyTile, hd = sh.hd;
    const float* keys = kp + bk * sh.S * hd;
    float* dst = keys_t + bk * per_head + s0 * hd;
    for (int64_t s = 0; s < kKeyTile; ++s)
      for (int64_t c = 0; c < hd; ++c) dst[c * kKeyTile + s] = s0 + s < used ? keys[(s0 + s) * hd + c] : 0.0f;
  });
  // pieces in reverse token order: a causal prompt's last tiles see the most keys, so they start first
  const int64_t pieces = sh.B * sh.KV * sh.tiles;
  ParallelFor(pool, pieces, pieces * sh.S * sh.hd * 8, [&](int64_t i) {
    const int64_t tile = sh.tiles - 1 - i % sh.tiles, bk = i / sh.tiles;
    const int64_t t0 = tile * sh.tokens_per_piece, t1 = std::min(sh.T, t0 + sh.tokens_per_piece);
    Piece(sh, qp, keys_t + bk * per_head, vp, lo.data(), hi.data(), scale, softcap, bk / sh.KV, bk % sh.KV, t0, t1,
          o);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_prefill_attention, jpn::PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, hd)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache k (B, KV, S, hd)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache v (B, KV, S, hd)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions (T,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, hd)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));
