"""Host memory for the CPU's share of the weights: huge-page copies of arrays and layouts (the chunked XLA loops
that read them are ``jpinfer.ops.chunked``: an implementation of the listed-rows products, picked by ``ops``)."""

from jpinfer.sparse.cpu_backend.host_memory import huge_page_array, huge_page_ffn

__all__ = ["huge_page_array", "huge_page_ffn"]
