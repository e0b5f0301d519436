// Library-wide C entry points read by ../library.py through ctypes: what the library was compiled
// for, whether this CPU has it, the ABI version, and the thread cap.
//
// The feature checks are compiled for plain x86-64 (target attribute) so that calling them is safe
// on a CPU that lacks what the rest of the library was built for: library.py calls them before any
// kernel runs. (Loading the library runs no kernel code: the FFI handlers build their state lazily.)
#include "common.h"

namespace jpn {
static std::atomic<int> g_max_threads{0};
int MaxThreads() { return g_max_threads.load(std::memory_order_relaxed); }
}  // namespace jpn

// Bits of jpinfer_native_compiled_features / jpinfer_native_cpu_features.
enum : uint32_t {
  kAvx2 = 1u << 0,
  kFma = 1u << 1,
  kF16c = 1u << 2,
  kAvx512f = 1u << 3,
  kAvx512bw = 1u << 4,
  kAvx512vl = 1u << 5,
  kAvx512vnni = 1u << 6,
  kAvxvnni = 1u << 7,
  kBmi2 = 1u << 8,
};

extern "C" {

// Bumped whenever a handler's signature changes; library.py refuses a library of another version
// (a stale in-place build after a source update).
__attribute__((visibility("default"))) int jpinfer_native_abi_version() { return 14; }

__attribute__((visibility("default"), target("arch=x86-64"))) uint32_t jpinfer_native_compiled_features() {
  uint32_t f = 0;
#ifdef __AVX2__
  f |= kAvx2;
#endif
#ifdef __FMA__
  f |= kFma;
#endif
#ifdef __F16C__
  f |= kF16c;
#endif
#ifdef __AVX512F__
  f |= kAvx512f;
#endif
#ifdef __AVX512BW__
  f |= kAvx512bw;
#endif
#ifdef __AVX512VL__
  f |= kAvx512vl;
#endif
#ifdef __AVX512VNNI__
  f |= kAvx512vnni;
#endif
#ifdef __AVXVNNI__
  f |= kAvxvnni;
#endif
#ifdef __BMI2__
  f |= kBmi2;
#endif
  return f;
}

__attribute__((visibility("default"), target("arch=x86-64"))) uint32_t jpinfer_native_cpu_features() {
  __builtin_cpu_init();
  uint32_t f = 0;
  if (__builtin_cpu_supports("avx2")) f |= kAvx2;
  if (__builtin_cpu_supports("fma")) f |= kFma;
  // gcc 12's __builtin_cpu_supports knows no "f16c": every CPU with AVX2 so far has F16C, and the
  // OS check (XSAVE state for AVX) is part of the "avx2" test; take it from CPUID leaf 1, ECX bit 29.
  {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (c & (1u << 29)) f |= kF16c;
  }
  if (__builtin_cpu_supports("avx512f")) f |= kAvx512f;
  if (__builtin_cpu_supports("avx512bw")) f |= kAvx512bw;
  if (__builtin_cpu_supports("avx512vl")) f |= kAvx512vl;
  if (__builtin_cpu_supports("avx512vnni")) f |= kAvx512vnni;
#if __GNUC__ >= 11
  if (__builtin_cpu_supports("avxvnni")) f |= kAvxvnni;
#endif
  if (__builtin_cpu_supports("bmi2")) f |= kBmi2;
  return f;
}

// 0 = as many workers as XLA's intra-op pool has threads; n > 0 caps the workers (the caller included) at n.
__attribute__((visibility("default"))) void jpinfer_native_set_max_threads(int n) {
  jpn::g_max_threads.store(n < 0 ? 0 : n, std::memory_order_relaxed);
}

}  // extern "C"
