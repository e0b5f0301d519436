// Dense quantized matrix-vector products for 1..8 tokens, float32 out (weights read once per call):
//   jpinfer_int8_matvec  W8A8: int8 weights (out, in) with one float32 scale per output row; x is
//                        quantized per token inside the kernel exactly like jpinfer.models.int8
//                        (q = clip(rint(x * (127 / max|x|)), -127, 127), token scale max|x| * (1/127),
//                        both float32, as XLA computes them); the int8 x int8 sums are exact in int32, then
//                        y = float(acc) * (token_scale * row_scale), the same formula (bit for bit)
//                        as int8.matmul. (|acc| < 2^31 holds up to in = 2^31 / (128 * 127) ~ 132k.)
//   jpinfer_q4_0_matvec  4-bit blocks of 32 along the input with llama.cpp's Q4_0 semantics:
//                        w = d * (q - 8), q in 0..15, d float16 per block;
//   jpinfer_q4_1_matvec  llama.cpp's Q4_1: w = d * q + m, d and m float16 per block.
// 4-bit layout (jpinfer.native.kernels.Q4Matrix): packed uint8 (out, in / 2) where byte i of a block
// (16 bytes) holds element i in its low nibble and element i + 16 in its high one: the order of
// llama.cpp's block_q4_0/q4_1 `qs`, so a GGUF tensor's blocks are a reshape away; scales (and
// mins) float16 (out, in / 32).
// The 4-bit products quantize x to int8 in blocks of 32 (llama.cpp's Q8_0 pairing, rounding as
// above per block): a block's 32 products are then exact int32 sums (two instructions a token,
// below) and only one float multiply-add per block and token remains. Keeping x in float instead
// would need the nibbles widened to float32 (4 conversions + 4 FMAs per 32 weights and token).
//
// Instructions (AVX2): _mm256_maddubs_epi16 multiplies unsigned by signed bytes and adds pairs
// into int16. int8 x int8 goes through the sign trick: |w| (unsigned) times sign(w) * q (signed),
// which is w * q; |w| <= 128 and |q| <= 127, so a pair sum stays within +-32512 (no saturation, even
// for a weight of -128). _mm256_madd_epi16 with ones then widens pairs to int32. Q4_1's nibbles are
// unsigned already; Q4_0's q - 8 lies in [-8, 7] and takes the sign trick.
// Rows are split in fixed pieces over the threads; each output is one row's sum in block order.
#include "common.h"

namespace jpn {
namespace {

constexpr int64_t kRowsPerPiece = 64;
// The token scale is max|x| * (1 / 127), not max|x| / 127: XLA rewrites a division by a constant into
// a product with its float32 reciprocal, so this is what jpinfer.models.int8.quantize_tokens computes
// (about 5% of scales differ by one ulp from a true division). 127 / max|x| is a true division in both.
constexpr float kInv127 = 1.0f / 127.0f;

thread_local std::vector<int8_t> tl_q;
thread_local std::vector<float> tl_scale;
thread_local std::vector<int32_t> tl_sums;

// Rows a pass for T tokens: a row's bytes feed every token, an accumulator per (row, token) <= 8.
template <int T>
constexpr int RowsFor() { return T <= 2 ? 4 : (T <= 4 ? 2 : 1); }

inline int8_t QuantizeOne(float v, float inverse) {
  float q = std::nearbyint(v * inverse);  // round half to even (default rounding mode)
  q = std::min(127.0f, std::max(-127.0f, q));
  return int8_t(q);
}

// Per token: q (T, in_padded) int8, zero-padded to a multiple of 32; scale (T,).
void QuantizeTokens(const float* x, int64_t T, int64_t in, int64_t in_padded, int8_t* q, float* scale) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * in;
    float peak = 0.0f;
    for (int64_t j = 0; j < in; ++j) peak = std::max(peak, std::fabs(xt[j]));
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    for (int64_t j = 0; j < in; ++j) q[t * in_padded + j] = QuantizeOne(xt[j], inverse);
    for (int64_t j = in; j < in_padded; ++j) q[t * in_padded + j] = 0;
    scale[t] = peak * kInv127;  // XLA's peak / 127 (a reciprocal product)
  }
}

// Per token and block of 32: q (T, in) int8, scale (T, nb), sum of the block's q (T, nb).
void QuantizeBlocks(const float* x, int64_t T, int64_t in, int8_t* q, float* scale, int32_t* sums) {
  const int64_t nb = in / 32;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * in + b * 32;
      float peak = 0.0f;
      for (int j = 0; j < 32; ++j) peak = std::max(peak, std::fabs(xb[j]));
      const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) {
        const int8_t v = QuantizeOne(xb[j], inverse);
        q[t * in + b * 32 + j] = v;
        s += v;
      }
      scale[t * nb + b] = peak * kInv127;
      sums[t * nb + b] = s;
    }
}

template <int RB, int T>
void Int8Rows(const int8_t* w, const float* ws, const int8_t* q, const float* qs, int64_t in, int64_t in_padded,
              int64_t o, int64_t out, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t full = in & ~int64_t(31);
  __m256i acc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_si256();
  for (int64_t j = 0; j < full; j += 32) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      // the same bytes of the next pass's rows (RB rows further): one pass of prefetch distance, as the
      // hardware prefetcher alone left single-thread streaming at about half of XLA's float32 rate
      if ((j & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (o + r + RB) * in + j), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (o + r) * in + j));
      const __m256i aw = _mm256_abs_epi8(wv);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * in_padded + j));
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(qv, wv));
        acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(p, ones));
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) {
      int32_t s = HSumI32(acc[r][t]);
      for (int64_t j = full; j < in; ++j) s += int32_t(w[(o + r) * in + j]) * int32_t(q[t * in_padded + j]);
      y[t * out + o + r] = float(s) * (qs[t] * ws[o + r]);
    }
}

// The 32 weights of block b of a row: low nibbles are elements 0..15, high nibbles 16..31.
inline __m256i Nibbles(const uint8_t* block16) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block16));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

inline float Half(uint16_t h) { return _cvtsh_ss(h); }

template <int RB, int T, bool kQ41>
void Q4Rows(const uint8_t* packed, const uint16_t* d, const uint16_t* m, const int8_t* q, const float* qd,
            const int32_t* qsum, int64_t in, int64_t o, int64_t out, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i eight = _mm256_set1_epi8(8);
  const int64_t nb = in / 32;
  __m256 acc[RB][T];
  float macc[RB][T];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps(), macc[r][t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const int64_t row = o + r;
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(packed + (row + RB) * (in / 2) + b * 16), _MM_HINT_T0);
      const __m256i wv = Nibbles(packed + row * (in / 2) + b * 16);
      const float dw = Half(d[row * nb + b]);
      if constexpr (kQ41) {
        const float mw = Half(m[row * nb + b]);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * in + b * 32));
          const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, qv), ones);
          acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * qd[t * nb + b]), _mm256_cvtepi32_ps(s), acc[r][t]);
          macc[r][t] += mw * qd[t * nb + b] * float(qsum[t * nb + b]);
        }
      } else {
        const __m256i ws = _mm256_sub_epi8(wv, eight);
        const __m256i aw = _mm256_abs_epi8(ws);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * in + b * 32));
          const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(qv, ws)), ones);
          acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * qd[t * nb + b]), _mm256_cvtepi32_ps(s), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) y[t * out + o + r] = HSum(acc[r][t]) + macc[r][t];
}

// Runs rows [r0, r1) through Kernel<RB, T> (RB rows a pass, then single rows for the rest).
template <int T, template <int, int> class Kernel, class... A>
void RowRange(int64_t r0, int64_t r1, A... a) {
  constexpr int RB = RowsFor<T>();
  int64_t o = r0;
  for (; o + RB <= r1; o += RB) Kernel<RB, T>::Run(o, a...);
  for (; o < r1; ++o) Kernel<1, T>::Run(o, a...);
}

template <int RB, int T>
struct Int8K {
  static void Run(int64_t o, const int8_t* w, const float* ws, const int8_t* q, const float* qs, int64_t in,
                  int64_t in_padded, int64_t out, float* y) {
    Int8Rows<RB, T>(w, ws, q, qs, in, in_padded, o, out, y);
  }
};
template <int RB, int T>
struct Q40K {
  static void Run(int64_t o, const uint8_t* p, const uint16_t* d, const uint16_t* m, const int8_t* q,
                  const float* qd, const int32_t* qsum, int64_t in, int64_t out, float* y) {
    Q4Rows<RB, T, false>(p, d, m, q, qd, qsum, in, o, out, y);
  }
};
template <int RB, int T>
struct Q41K {
  static void Run(int64_t o, const uint8_t* p, const uint16_t* d, const uint16_t* m, const int8_t* q,
                  const float* qd, const int32_t* qsum, int64_t in, int64_t out, float* y) {
    Q4Rows<RB, T, true>(p, d, m, q, qd, qsum, in, o, out, y);
  }
};

template <template <int, int> class Kernel, class... A>
void DispatchT(int64_t T, int64_t r0, int64_t r1, A... a) {
  switch (T) {
    case 1: return RowRange<1, Kernel>(r0, r1, a...);
    case 2: return RowRange<2, Kernel>(r0, r1, a...);
    case 3: return RowRange<3, Kernel>(r0, r1, a...);
    case 4: return RowRange<4, Kernel>(r0, r1, a...);
    case 5: return RowRange<5, Kernel>(r0, r1, a...);
    case 6: return RowRange<6, Kernel>(r0, r1, a...);
    case 7: return RowRange<7, Kernel>(r0, r1, a...);
    case 8: return RowRange<8, Kernel>(r0, r1, a...);
  }
}

ffi::Error Int8MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[1] || xd[0] < 1 || xd[0] > kMaxTokens ||
      int64_t(scales.element_count()) != wd[0])
    return ffi::Error::InvalidArgument("jpinfer int8 matvec: w (out, in), scales (out,), x (T, in), T <= 8");
  const int64_t out = wd[0], in = wd[1], T = xd[0], in_padded = RoundUp(in, 32);
  int8_t* q = Scratch(tl_q, size_t(T * in_padded));
  float* qs = Scratch(tl_scale, size_t(T));
  QuantizeTokens(x.typed_data(), T, in, in_padded, q, qs);
  const int8_t* W = reinterpret_cast<const int8_t*>(w.typed_data());
  const float* S = scales.typed_data();
  float* Y = y->typed_data();
  ParallelFor(pool, CeilDiv(out, kRowsPerPiece), out * in, [&](int64_t i) {
    const int64_t r0 = i * kRowsPerPiece, r1 = std::min(out, r0 + kRowsPerPiece);
    DispatchT<Int8K>(T, r0, r1, W, S, (const int8_t*)q, (const float*)qs, in, in_padded, out, Y);
  });
  return ffi::Error::Success();
}

template <bool kQ41>
ffi::Error Q4MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F16> d,
                        ffi::Buffer<ffi::F16> m, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto pd = packed.dimensions(), xd = x.dimensions();
  if (pd.size() != 2 || xd.size() != 2 || xd[0] < 1 || xd[0] > kMaxTokens)
    return ffi::Error::InvalidArgument("jpinfer q4 matvec: packed (out, in/2), x (T, in), T <= 8");
  const int64_t out = pd[0], in = xd[1], T = xd[0], nb = in / 32;
  if (in % 32 != 0 || pd[1] * 2 != in || int64_t(d.element_count()) != out * nb ||
      (kQ41 && int64_t(m.element_count()) != out * nb))
    return ffi::Error::InvalidArgument("jpinfer q4 matvec: in must be a multiple of 32, scales (out, in/32)");
  int8_t* q = Scratch(tl_q, size_t(T * in));
  float* qd = Scratch(tl_scale, size_t(T * nb));
  int32_t* qsum = Scratch(tl_sums, size_t(T * nb));
  QuantizeBlocks(x.typed_data(), T, in, q, qd, qsum);
  const uint8_t* P = packed.typed_data();
  const uint16_t* D = reinterpret_cast<const uint16_t*>(d.untyped_data());
  const uint16_t* M = kQ41 ? reinterpret_cast<const uint16_t*>(m.untyped_data()) : nullptr;
  float* Y = y->typed_data();
  ParallelFor(pool, CeilDiv(out, kRowsPerPiece), out * in / 2, [&](int64_t i) {
    const int64_t r0 = i * kRowsPerPiece, r1 = std::min(out, r0 + kRowsPerPiece);
    if constexpr (kQ41)
      DispatchT<Q41K>(T, r0, r1, P, D, M, (const int8_t*)q, (const float*)qd, (const int32_t*)qsum, in, out, Y);
    else
      DispatchT<Q40K>(T, r0, r1, P, D, M, (const int8_t*)q, (const float*)qd, (const int32_t*)qsum, in, out, Y);
  });
  return ffi::Error::Success();
}

ffi::Error Q40Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> m,
                   ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  return Q4MatvecImpl<false>(pool, packed, d, m, x, y);
}
ffi::Error Q41Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> m,
                   ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  return Q4MatvecImpl<true>(pool, packed, d, m, x, y);
}

}  // namespace
}  // namespace jpn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_int8_matvec, jpn::Int8MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values (out, in)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales (out,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (T, in)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y (T, out)

#define JPN_Q4_BINDING                                                   \
  ffi::Ffi::Bind()                                                       \
      .Ctx<ffi::ThreadPool>()                                            \
      .Arg<ffi::Buffer<ffi::U8>>()  /* packed (out, in / 2) */           \
      .Arg<ffi::Buffer<ffi::F16>>() /* scales (out, in / 32) */          \
      .Arg<ffi::Buffer<ffi::F16>>() /* mins (out, in / 32), Q4_0: (0,) */ \
      .Arg<ffi::Buffer<ffi::F32>>() /* x (T, in) */                      \
      .Ret<ffi::Buffer<ffi::F32>>() /* y (T, out) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_q4_0_matvec, jpn::Q40Impl, JPN_Q4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_q4_1_matvec, jpn::Q41Impl, JPN_Q4_BINDING);
