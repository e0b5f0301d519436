"""Cold-neuron FFN work on the JAX CPU device (plain XLA, tuned for caches and cores)."""

from jpinfer.sparse.cpu_backend.chunked import sparse_ffn_chunked, sparse_rows_product
from jpinfer.sparse.cpu_backend.host_memory import huge_page_array, huge_page_ffn

__all__ = ["huge_page_array", "huge_page_ffn", "sparse_ffn_chunked", "sparse_rows_product"]
