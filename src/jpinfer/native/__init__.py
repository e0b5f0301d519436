"""Native CPU kernels for the cold neurons: C++ XLA FFI custom calls, with an XLA fallback.

PowerInfer's split puts the frequently firing (hot) neurons on the accelerator and the rest (cold)
on the CPU, where each token needs only the few cold neurons that fire. XLA:CPU has no fast way to
read a list of scattered rows (see jpinfer.sparse.cpu_backend), so this package brings kernels that
do exactly that, written in C++ against XLA's FFI (``csrc/``) and called from jitted JAX code:

- ``kernels.sparse_ffn``: a layer's sparse FFN over listed neurons of the neuron-major layout,
  gate/up, activation and down fused four neurons a pass (plus its two halves); ``sparse_ffn_int8``
  the same over int8 bundles (W8A8, the dense int8 model's integers);
- ``kernels.threshold_rows_product`` (and ``_int8``): the threshold modes' products, compaction inside
  the kernel;
- ``kernels.int8_matvec`` and ``kernels.q4_matvec``: dense W8A8 and llama.cpp-style 4-bit
  (Q4_0 / Q4_1) matrix-vector products for 1..8 tokens;
- ``kernels.cached_attention``: a decode step's grouped-query attention over the KV cache, read in
  place up to the last position (native only: the model's XLA attention is its other form).

The library is compiled at ``pip install`` time (setup.py: g++ -O3 -march=native, or
-march=x86-64-v3 with JPINFER_NATIVE_PORTABLE=1) and loaded with ctypes on first use
(``library.py``); when it is missing, broken, built for another CPU, or disabled with
JPINFER_NATIVE=0, one warning says why and every function runs its XLA implementation instead.
Kernels split their work between the calling thread and jpinfer's own helper threads (as many
as XLA's intra-op pool has beyond one; ``csrc/threads.cc``) with fixed partitions: results are
bit-identical whatever the thread count.
"""

from jpinfer.native.library import native_available, unavailable_reason

__all__ = ["native_available", "unavailable_reason"]
