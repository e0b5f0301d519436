"""The one place that picks each product's kernel: native C++ (``jpinfer.native``), Pallas (``jpinfer.pallas``)
or XLA, per weights format (float / int8 / int4) and lowering platform (the CPU with or without the native
library, a CUDA GPU, another accelerator).

- ``table``: ``pick``, the choice itself as a table over names (product, format, platform, native library,
  forced backend), and ``dispatch``, which lowers a choice per platform with ``jax.lax.platform_dependent``;
- ``dense``: dense products (the decoder's float ``linear``, every quantized matrix's ``quantized_matmul``);
- ``attention``: the cached attention (native decode and prefill kernels; the XLA one softmax and blocked forms);
- ``listed``: listed rows (the sparse FFN over a neuron list in every format, x @ M over listed rows);
  ``chunked``: their XLA loops for the CPU;
- ``threshold``: threshold rows (the threshold modes' input-major products, the input-thresholded head) and the
  predictor's compaction.

Level 2 of the dependency order, beside the kernels it picks among: it imports ``native``, ``pallas``, ``quant``
and level 0; ``models`` and everything above call it and never pick a kernel themselves. The XLA forms are the
fallback where a kernel does not run (no native library: one warning, then XLA) and the kernels' test reference.
"""
