"""Pallas kernels for the accelerator (GPU via Triton; interpret mode on CPU for tests)."""

from jpinfer.sparse.pallas_kernels.sparse_rows import sparse_rows_ffn

__all__ = ["sparse_rows_ffn"]
