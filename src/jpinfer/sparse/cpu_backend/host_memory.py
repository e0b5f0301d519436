"""Weights for CPU kernels in transparent-huge-page memory.

A sparse FFN reads each active neuron's bundle (48 KiB for a 7B layer) from a random
place: with 4 KiB pages that is 12 pages, each likely a TLB miss. On Linux with
THP in ``madvise`` mode (the common default) XLA's own buffers get 4 KiB pages; copying
the weights into an ``madvise(MADV_HUGEPAGE)`` mapping and handing that memory to JAX
without a copy (DLPack) gives them 2 MiB pages. Measured on a 7B layer: the sparse op up
to ~10% faster, the dense FFN 15-20% faster (bench/results/kernels.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys

import jax
import numpy as np

from jpinfer.sparse.neurons import NeuronFFN

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _huge_page_buffer(nbytes: int) -> np.ndarray | None:
    """A 2 MiB-aligned uint8 array of nbytes in an anonymous mapping advised for huge
    pages, or None where that is unavailable. The array keeps the mapping alive."""
    if not sys.platform.startswith("linux"):
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -start % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) != 0:
        return None
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)


def huge_page_array(a: np.ndarray | jax.Array) -> jax.Array:
    """``a`` as a JAX array on the first CPU device, backed by huge pages where possible.

    Falls back to an ordinary copy (same values, 4 KiB pages) when the platform has no
    ``madvise`` or JAX cannot import the memory without copying.
    """
    a = np.asarray(a)
    cpu = jax.devices("cpu")[0]
    buf = _huge_page_buffer(a.nbytes) if a.nbytes else None
    if buf is None:
        return jax.device_put(a, cpu)
    host = buf.view(a.dtype).reshape(a.shape)
    host[...] = a
    out = jax.dlpack.from_dlpack(host, device=cpu)
    return out if out.unsafe_buffer_pointer() == host.ctypes.data else jax.device_put(a, cpu)



def huge_page_ffn(ffn: NeuronFFN) -> NeuronFFN:
    """The same neuron-major FFN with its bundles (the bulk of its bytes) in huge pages."""
    return dataclasses.replace(ffn, rows=huge_page_array(ffn.rows))
