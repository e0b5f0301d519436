"""Pallas kernels for the accelerator (GPU via Triton; interpret mode on the CPU for tests).

``KERNELS`` maps each variant to one call signature ``(rows, b_up, x, ids, count, *, kind,
interpret=False)``; ``DEFAULT_KERNEL`` is the one ``jpinfer.ops`` picks for a
listed-rows FFN on a CUDA GPU (``ops.table``). A kernel library like ``jpinfer.native``: it picks nothing itself.
"""

import functools

from jpinfer.pallas.listed_ffn import MAX_TOKENS, VARIANTS, listed_ffn
from jpinfer.pallas.sparse_rows import sparse_rows_ffn
from jpinfer.pallas.triton import triton_available

KERNELS = {"rows": sparse_rows_ffn} | {v: functools.partial(listed_ffn, variant=v) for v in VARIANTS}
# The one form measured on a GPU (the two-phase form, H200: 3.5x over dense at 90%; docs/architecture.md,
# "GPU kernels"); the atomic and fused variants await a GPU run of the GPU suite (python -m jpinfer.bench gpu).
DEFAULT_KERNEL = "split"

__all__ = ["KERNELS", "DEFAULT_KERNEL", "MAX_TOKENS", "listed_ffn", "sparse_rows_ffn", "triton_available"]
