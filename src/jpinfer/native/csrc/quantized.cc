// Dense quantized matrix-vector products for 1..8 tokens, float32 out (weights read once per call):
//   jpinfer_int8_matvec  W8A8: int8 weights (out, in) with one float32 scale per output row; x is
//                        quantized per token inside the kernel exactly like jpinfer.quant.int8
//                        (q = clip(rint(x * (127 / max|x|)), -127, 127), token scale max|x| * (1/127),
//                        both float32, as XLA computes them); the int8 x int8 sums are exact in int32, then
//                        y = float(acc) * (token_scale * row_scale), the same formula (bit for bit)
//                        as int8.product. (|acc| < 2^31 holds up to in = 2^31 / (128 * 127) ~ 132k.)
//   jpinfer_q4_0_matvec  4-bit blocks of 32 along the input with llama.cpp's Q4_0 semantics:
//                        w = d * (q - 8), q in 0..15, d float16 per block;
//   jpinfer_q4_1_matvec  llama.cpp's Q4_1: w = d * q + m, d and m float16 per block.
// 4-bit layout (jpinfer.quant.q4.Q4Matrix): packed uint8 (out, in / 2) where byte i of a block
// (16 bytes) holds element i in its low nibble and element i + 16 in its high one: the order of
// llama.cpp's block_q4_0/q4_1 `qs`, so a GGUF tensor's blocks are a reshape away; scales (and
// mins) float16 (out, in / 32).
// The 4-bit products quantize x to int8 in blocks of 32 (llama.cpp's Q8_0 pairing, rounding as
// above per block): a block's 32 products are then exact int32 sums and only one float multiply-add
// per block and token remains (Q4Rows does eight blocks' in one).
//
// Instructions: int8_rows.h (the sign trick on AVX2, vpdpbusd with VNNI). 4-bit nibbles are unsigned
// already; Q4_0's -8 is an exact integer correction per block.
// Rows are split in fixed pieces over the threads; each output is one row's sum in a fixed order.
// Measured at 11008 x 4096 against the previous kernels (a float multiply-add per block and token
// after two to four integer instructions, Q4_1's mins in scalar code, the sign trick for int8 with
// VNNI too), same run, idle 2-core EPYC VM (AVX-512): Q4_0 / Q4_1 at 1 token 1.29 / 1.44 -> 0.88 /
// 1.10 ms, at 8 tokens 4.54 / 5.58 -> 1.79 / 2.24 ms; int8 at 8 tokens 2.58 -> 1.60 ms; the
// x86-64-v3 build: Q4_0 1.41 -> 0.85 ms and 4.22 -> 1.92 ms.
#include "q4_rows.h"

namespace jpn {
namespace {

constexpr int64_t kRowsPerPiece = 64, kPieceBytes = 128 << 10, kMinPieces = 8;

// Rows a piece: kRowsPerPiece, or where rows are short enough for kRowsPerPiece of them to hold under kPieceBytes,
// the rows of kPieceBytes (at most out / kMinPieces: pieces enough to share among the threads). A piece is where a
// thread's stream, and the prefetch ahead of it, restarts. Measured (2-core Zen 4 VM, 2026-12-05, 32 chained
// matrices so none stays in cache, one token, medians of 9 rotated rounds): a 7B predictor's (11008, 256) w_out
// int8 3.97 -> 2.74 ms, 4-bit 4.12 -> 2.88 ms (their 64-row pieces were 16 and 10 KB); the (256, 4096),
// (4096, 4096) and (11008, 4096) products, whose pieces stay 64 rows, within noise (0.97-1.04)
// (bench/results/experiments/short_row_pieces.md).
int64_t RowsPerPiece(int64_t out, int64_t row_bytes) {
  const int64_t fill = CeilDiv(kPieceBytes, std::max<int64_t>(row_bytes, 1));  // (an empty row: no division by 0)
  return std::max(kRowsPerPiece, std::min(fill, CeilDiv(out, kMinPieces)));
}
thread_local std::vector<int8_t> tl_q;
thread_local std::vector<float> tl_scale;
thread_local Q8Scratch tl_q8;

// Runs rows [r0, r1) through Kernel<RB, T> (RB rows a pass, then single rows for the rest).
template <int T, template <int, int> class Kernel, class... A>
void RowRange(int64_t r0, int64_t r1, A... a) {
  constexpr int RB = Kernel<1, T>::RowsPerPass();
  int64_t o = r0;
  for (; o + RB <= r1; o += RB) Kernel<RB, T>::Run(o, a...);
  for (; o < r1; ++o) Kernel<1, T>::Run(o, a...);
}

template <int RB, int T>
void Int8Rows(const int8_t* w, const float* ws, const int8_t* q, const float* qs, int64_t in, int64_t o, int64_t out,
              float* y) {
  const int8_t* rows[RB];
  const int8_t* next[RB];
  // The stream kStreamPrefetchBytes ahead, or (several tokens) the next pass's rows where they are farther (past
  // the end only prefetched, never read). Several tokens prefetched the next pass's rows alone before, 0.6-2.3 KiB
  // ahead at the default model's widths: both libraries in one process (2-core Zen 4 VM, 2026-12-07, 30 chained
  // random matrices of its shapes, 21 alternated rounds, the same bits), gate/up (3072, 576) / down (576, 1536) /
  // q|k|v (960, 576) / head (49152, 576): two tokens 0.76 / 1.05 / 0.84 / 0.76x the time, four 0.65 / 0.75 / 0.70 /
  // 0.53x, eight 0.91 / 0.83 / 1.09 / 1.01x. (The 4-bit rows the same way: 0.87-1.36x; not changed there.)
  const int64_t ahead = T == 1 ? kStreamPrefetchBytes : std::max<int64_t>(kStreamPrefetchBytes, RB * in);
  for (int r = 0; r < RB; ++r) {
    rows[r] = w + (o + r) * in;
    next[r] = rows[r] + ahead;
  }
  int32_t s[RB * T];
  Int8Dots<RB, T>(rows, next, q, in, s);
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < T; ++t) y[t * out + o + r] = float(s[r * T + t]) * (qs[t] * ws[o + r]);
}

template <int RB, int T>
struct Int8K {
  static constexpr int RowsPerPass() { return T == 1 ? 1 : Int8RowsPerPass(T); }
  static void Run(int64_t o, const int8_t* w, const float* ws, const int8_t* q, const float* qs, int64_t in,
                  int64_t out, float* y) {
    Int8Rows<RB, T>(w, ws, q, qs, in, o, out, y);
  }
};
// RB 4-bit rows from row o of a packed (out, in) matrix; ahead: with kStream the stream kStreamPrefetchBytes
// ahead (one token), else the next pass's rows.
template <int RB, int T, bool kQ41, bool kStream>
void Q4MatrixRows(int64_t o, const uint8_t* p, const uint16_t* d, const uint16_t* m, const Q8Octets* x, int64_t in,
                  int64_t out, float* y) {
  const int64_t nb = in / 32, row_bytes = in / 2;
  const uint8_t* rows[RB];
  const uint8_t* ahead[RB];
  const uint16_t* ds[RB];
  const uint16_t* ms[RB];
  for (int r = 0; r < RB; ++r) {
    rows[r] = p + (o + r) * row_bytes, ds[r] = d + (o + r) * nb, ms[r] = kQ41 ? m + (o + r) * nb : nullptr;
    ahead[r] = kStream ? rows[r] + kStreamPrefetchBytes : rows[r] + RB * row_bytes;
  }
  Q4Rows<RB, T, kQ41>(rows, ds, ms, ahead, *x, y + o, out);
}

// The 4-bit product's rows. One token: with AVX-512, one row a pass (Q4OctetPairs, two octets a step) as one
// stream; rows of fewer than two octets (kShort: in < 512, which Q4OctetPairs leaves to the 256-bit loop) four a
// pass, the stream prefetched ahead all the same. Measured (as RowsPerPiece) at (11008, 256) 4-bit: one row a
// pass 2.35 ms, four a pass 1.83 ms (0.79x, same bits); four a pass with the next pass's rows prefetched (640
// bytes ahead) was slower than one row a pass.
template <bool kQ41, bool kShort>
struct Q4K {
  template <int RB, int T>
  struct Rows {
    static constexpr int RowsPerPass() { return kShort && T == 1 ? 4 : Q4RowsPerPass(T); }
    static void Run(int64_t o, const uint8_t* p, const uint16_t* d, const uint16_t* m, const Q8Octets* x, int64_t in,
                    int64_t out, float* y) {
      Q4MatrixRows<RB, T, kQ41, T == 1 && (kShort || (JPN_ZMM && RB == 1))>(o, p, d, m, x, in, out, y);
    }
  };
};

template <template <int, int> class Kernel, class... A>
void DispatchT(int64_t T, int64_t r0, int64_t r1, A... a) {
  WithCount<kMaxTokens>(T, [&](auto t) { RowRange<decltype(t)::value, Kernel>(r0, r1, a...); });
}

ffi::Error Int8MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[1] || xd[0] < 1 || xd[0] > kMaxTokens ||
      int64_t(scales.element_count()) != wd[0])
    return ffi::Error::InvalidArgument("jpinfer int8 matvec: w (out, in), scales (out,), x (T, in), T <= 8");
  const int64_t out = wd[0], in = wd[1], T = xd[0];
  int8_t* q = Scratch(tl_q, size_t(T * RoundUp(in, 32)));
  float* qs = Scratch(tl_scale, size_t(T));
  QuantizeTokens(x.typed_data(), T, in, q, qs);
  const int8_t* W = reinterpret_cast<const int8_t*>(w.typed_data());
  const float* S = scales.typed_data();
  float* Y = y->typed_data();
  const int64_t rows = RowsPerPiece(out, in + 4);
  ParallelFor(pool, CeilDiv(out, rows), out * in, [&](int64_t i) {
    const int64_t r0 = i * rows, r1 = std::min(out, r0 + rows);
    DispatchT<Int8K>(T, r0, r1, W, S, (const int8_t*)q, (const float*)qs, in, out, Y);
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
  const Q8Octets xq = QuantizeForQ4(x.typed_data(), T, in, tl_q8);
  const uint8_t* P = packed.typed_data();
  const uint16_t* D = reinterpret_cast<const uint16_t*>(d.untyped_data());
  const uint16_t* M = kQ41 ? reinterpret_cast<const uint16_t*>(m.untyped_data()) : nullptr;
  float* Y = y->typed_data();
  const int64_t rows = RowsPerPiece(out, in / 2 + nb * (kQ41 ? 4 : 2));
  const bool short_rows = in < 512;
  ParallelFor(pool, CeilDiv(out, rows), out * in / 2, [&](int64_t i) {
    const int64_t r0 = i * rows, r1 = std::min(out, r0 + rows);
    if (short_rows)
      DispatchT<Q4K<kQ41, true>::template Rows>(T, r0, r1, P, D, M, &xq, in, out, Y);
    else
      DispatchT<Q4K<kQ41, false>::template Rows>(T, r0, r1, P, D, M, &xq, in, out, Y);
  });
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_q4_0_matvec, jpn::Q4MatvecImpl<false>, JPN_Q4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpinfer_q4_1_matvec, jpn::Q4MatvecImpl<true>, JPN_Q4_BINDING);
