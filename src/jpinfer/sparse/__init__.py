"""The sparse FFN: one layer's FFN computed over a list of neurons only.

- ``neurons``: the neuron-major layout (a neuron's gate, up and down rows side by side).
- ``op``: ``sparse_ffn``, the op, and its backend choice per lowering platform; ``all_rows_ffn``, the
  same over every neuron as dense products (prefill); ``sparse_rows_product``, x @ M over listed rows.
- ``threshold``: the training-free threshold FFN (activation and input sparsity).
- ``pallas_kernels``: the accelerator kernels (Pallas; interpret mode on the CPU for tests).
- ``cpu_backend``: the CPU kernels (chunked XLA loop) and huge-page host memory.
"""

from jpinfer.sparse.neurons import NeuronFFN, from_arrays, from_layer
from jpinfer.sparse.op import BACKENDS, ROWS_BACKENDS, all_rows_ffn, sparse_ffn, sparse_rows_product
from jpinfer.sparse.threshold import ThresholdFFN, threshold_ffn

__all__ = ["NeuronFFN", "from_arrays", "from_layer", "BACKENDS", "ROWS_BACKENDS", "all_rows_ffn", "sparse_ffn",
           "sparse_rows_product", "ThresholdFFN", "threshold_ffn"]
