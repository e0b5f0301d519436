"""The sparse FFN: one layer's FFN computed over a list of neurons only.

- ``neurons``: the neuron-major layout (a neuron's gate, up and down rows side by side).
- ``op``: ``sparse_ffn``, the op over a layout (``jpinfer.ops.listed`` picks its kernel per lowering platform);
  ``all_rows_ffn``, the same over every neuron as dense products (prefill); ``host_sparse_ffn``, the op as a direct
  host call (no jax dispatch); ``sparse_rows_product``, x @ M over listed rows.
- ``threshold_layout``: the FFN laid out for threshold sparsity (``ThresholdLayout``: input-major gate/up rows,
  neuron-major down rows) and ``threshold_ffn``, the FFN over the rows its thresholds keep; the attention's
  products the same way (``ThresholdProjection``, ``threshold_projection``).
- ``cpu_backend``: huge-page host memory for the CPU's weights.
"""

from jpinfer.sparse.neurons import NeuronFFN, from_arrays, from_layer
from jpinfer.sparse.op import BACKENDS, ROWS_BACKENDS, all_rows_ffn, host_sparse_ffn, sparse_ffn, sparse_rows_product
from jpinfer.sparse.threshold_layout import ThresholdLayout, ThresholdProjection, threshold_ffn, threshold_projection

__all__ = ["NeuronFFN", "from_arrays", "from_layer", "BACKENDS", "ROWS_BACKENDS", "all_rows_ffn", "host_sparse_ffn",
           "sparse_ffn", "sparse_rows_product", "ThresholdLayout", "ThresholdProjection", "threshold_ffn",
           "threshold_projection"]
