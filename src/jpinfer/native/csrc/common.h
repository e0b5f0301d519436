// Shared pieces of jpinfer's native CPU kernels (XLA FFI custom calls, see ../__init__.py).
//
// Threads: a kernel splits its work between the calling thread and jpinfer's own helper threads, as many
// helpers as XLA's intra-op pool (handed to every handler through the FFI context, `ffi::ThreadPool`) has
// threads beyond one, the pool's threads being idle while a custom call runs (it is one op of the program).
// Not OpenMP: XLA:CPU already keeps one worker per core; an OpenMP team would be a second set of threads
// that spin after each parallel region (GOMP_SPINCOUNT) while XLA's workers run the next ops,
// oversubscribing the cores, and would add a libgomp dependency to the wheel. The helpers spin only
// briefly after a loop and yield while they do (ParallelFor below says why they are not XLA's pool).
// Measured (bench/native_kernels.py, 2-core EPYC, 2026-12-02, same ParallelFor with an OpenMP
// `parallel for schedule(dynamic)` body, build flag -DJPN_OPENMP -fopenmp): the OpenMP build ran the 7B
// sparse FFN within run-to-run noise of this one (0.71-0.82 vs 0.64-0.86 of XLA's W @ x rate), but
// XLA's own dense FFN, run in between, slowed by up to 30% at the small shape while the OpenMP team
// spun: the oversubscription above. So no OpenMP; JPN_OPENMP is kept for re-measuring only.
//
// Determinism: every kernel cuts its work into a partition that depends on the shapes and the
// count only, never on the number of threads; each piece writes its own output slice or partial sum,
// and partial sums are added in piece order. Which thread runs which piece changes nothing, so the
// results are bit-identical for any thread count (tests/test_native_kernels.py checks 1 vs all).
//
// Instruction set: AVX2 + FMA (+ F16C for float16 block scales) is the baseline (x86-64-v3); the
// build uses -march=native by default or -march=x86-64-v3 with JPINFER_NATIVE_PORTABLE=1.
// No -ffast-math: the float sums keep their written order, which the determinism relies on.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef JPN_OPENMP
#include <omp.h>
#endif

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "jpinfer native kernels need AVX2, FMA and F16C (-march=x86-64-v3 or newer)"
#endif

namespace jpn {

namespace ffi = xla::ffi;

constexpr int kMaxTokens = 8;  // tokens per call (T); the Python wrappers check it

// Upper bound on worker threads, 0 = the pool's size. Set through jpinfer_native_set_max_threads
// (tests compare 1 thread with all of them).
int MaxThreads();

inline int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The cache slots [lo, hi) a token at position p sees in a cache of S slots, the attention kernels' one mask
// (attention.cc, prefill_attention.cc): s <= p, and s > p - window when window > 0 (sliding window).
struct SlotRange {
  int64_t lo, hi;
};
inline SlotRange VisibleSlots(int64_t p, int64_t S, int64_t window) {
  const int64_t hi = Clamp(p + 1, 0, S);
  return {window > 0 ? Clamp(p - window + 1, 0, hi) : 0, hi};
}

// f(std::integral_constant<int, n>{}) for a run-time count n in [1, N] (nothing outside it): the kernels take
// their row and token counts as template arguments (accumulators in registers, unrolled loops), and this
// is the one place a run-time count becomes one.
template <int N, class F>
inline void WithCount(int64_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) return f(std::integral_constant<int, N>{});
    WithCount<N - 1>(n, f);
  }
}
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// The list's count as the kernels use it: a scalar int32 buffer, clamped to [0, K].
inline int64_t ListCount(const ffi::Buffer<ffi::S32>& count, int64_t k) {
  return count.element_count() < 1 ? 0 : Clamp(count.typed_data()[0], 0, k);
}

// The kernels' software prefetch of weight rows read later in the call (the next pass's rows, a stream's bytes
// kStreamPrefetchBytes ahead, the next listed neurons'), into L2 rather than L1: a core has few L1 miss buffers,
// and prefetches that hold them until the line arrives stall the loads. Measured (2-core Zen 4 VM, 2026-12-05,
// scratch benches of the kernels, weights out of cache, medians of 9-15 alternated calls, two runs each, the
// AVX-512 build): one-token 4-bit matvec 11008 x 4096 0.88-1.11 -> 0.77-0.78 ms, int8 1.32-1.52 -> 1.18-1.42,
// float32 (the default model's 30 layers of products) 16.0-16.1 -> 12.5-14.0, the 4-bit sparse FFN (1101 of 11008
// neurons at random) 0.53-0.62 -> 0.45-0.59 (noisy); the AVX2 (x86-64-v3) build: 4-bit 1.05-1.21 -> 0.82-0.88,
// float32 15.6-15.8 -> 13.9-14.5, the others unchanged within noise (bench/results/experiments/prefetch_to_l2.md).
// Prefetching into L1 (_MM_HINT_T0) is what they did before.
inline void PrefetchAhead(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// How far ahead a stream of rows is prefetched. A one-token dense int8 product (quantized.cc) reads one row at a
// time, a single sequential stream per thread, prefetched this far ahead: against four rows a pass (four streams,
// each prefetched at the next pass's rows), measured out of cache (2-core Zen 5 VM, 2026-12-05, four matrices
// chained, medians of 8 alternated runs), int8 at 11008 x 4096 / 4096 x 11008 / 4096 x 4096 / 49152 x 576: 37.2 /
// 39.8 / 46.7 / 35.2 -> 45.8 / 46.5 / 52.2 / 34.0 GB/s (4 KiB ahead: 45.8 / 46.1 / 50.0 / 34.3); 4-bit: see
// Q4OctetPairs. The int8 product of several tokens and the float32 one (dense.cc) take it too.
constexpr int64_t kStreamPrefetchBytes = 8192;

// Horizontal sum of 8 float lanes in a fixed order ((0+4)+(2+6))+((1+5)+(3+7)).
inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline int32_t HSumI32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// A per-thread scratch buffer reused across calls (no malloc/mmap and page faults per call).
template <class T>
T* Scratch(std::vector<T>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Runs body(i) for every i in [0, n): the calling thread and up to (threads - 1) of jpinfer's helper
// threads (threads.cc) claim indices from one atomic counter (dynamic balance, no fixed thread->piece map).
// work_bytes: about how many bytes the whole loop reads; below kInlineBytes it runs on the caller alone.
//
// Why own helpers and not XLA's pool: a pool.Schedule wakes a sleeping pool thread, which on the 2-core
// Intel Xeon VM (2026-12-06) cost the caller 20-46 us on average, so the loops it was worth it for were few:
// in the int8 threshold mode's decode 78% of the dense int8 products and 96% of the threshold products
// ran on the caller alone, and one thread decoded as fast as two. A helper that has just run a loop spins
// for 2 ms (threads.cc) (yielding now and then) before it sleeps, so the next loop of a decode step, microseconds
// later, hands it work with two atomic stores; a sleeping helper is woken only for loops of kWakeBytes
// and more, and lingers again after them.
constexpr int64_t kInlineBytes = 96 * 1024;
constexpr int64_t kWakeBytes = 512 * 1024;

// One ParallelFor loop as its threads share it: indices claimed from `next`, finished ones counted in `done`.
// Shared ownership: a helper may start after the caller has returned (every index claimed); it then finds the
// counter exhausted and never touches `body`, which lives on the caller's stack.
struct Loop {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n = 0;
  void* body = nullptr;
  void (*call)(void* body, int64_t i) = nullptr;

  void Work() {
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      call(body, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Offers `loop` to up to `wanted` helpers that are free (starting them on first use); a sleeping one only
// when `wake`. Each that takes it runs loop->Work() once.
void OfferToHelpers(int wanted, const std::shared_ptr<Loop>& loop, bool wake);

// The threads a kernel may spread over (the calling one included): inside a custom call the size of XLA's intra-op
// pool (implicitly, from the handler's `ffi::ThreadPool`), in a direct host call (sparse_ffn.cc's jpinfer_host_*)
// the count its caller passes. Only the count is read: the work runs on jpinfer's helpers either way.
struct Threads {
  int64_t count;
  Threads(ffi::ThreadPool& pool) : count(pool.num_threads()) {}  // NOLINT: implicit, every handler passes its pool
  explicit Threads(int64_t n) : count(n) {}
};

// Threads a ParallelFor may use: the pool's size (at least 1), capped by MaxThreads().
inline int64_t Workers(Threads pool) {
  int64_t threads = std::max<int64_t>(1, pool.count);
  const int cap = MaxThreads();
  return cap > 0 ? std::min<int64_t>(threads, cap) : threads;
}

template <class F>
void ParallelFor(Threads pool, int64_t n, int64_t work_bytes, F&& body) {
  if (n <= 0) return;
#ifdef JPN_OPENMP  // measurement build only (bench/results/native_kernels.md): OpenMP instead of the helpers
  {
    const int cap = MaxThreads();
    const int threads = cap > 0 ? std::min(cap, omp_get_max_threads()) : omp_get_max_threads();
    if (threads <= 1 || work_bytes < kInlineBytes) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#endif
  const int64_t helpers = std::min<int64_t>(Workers(pool), n) - 1;
  if (helpers <= 0 || work_bytes < kInlineBytes) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  using Body = std::remove_reference_t<F>;
  auto loop = std::make_shared<Loop>();
  loop->n = n;
  loop->body = const_cast<void*>(static_cast<const void*>(&body));
  loop->call = [](void* b, int64_t i) { (*static_cast<Body*>(b))(i); };
  OfferToHelpers(int(helpers), loop, work_bytes >= kWakeBytes);
  loop->Work();
  // Wait only for pieces other threads have claimed and are running (never for work not yet begun, so a
  // helper that starts late cannot hold us).
  for (int spins = 0; loop->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
}

}  // namespace jpn
