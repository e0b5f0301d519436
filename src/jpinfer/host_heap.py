"""Handing the C heap's free memory back to the operating system after one-off work.

Building an engine (quantized copies, neuron-major layouts) and compiling its step free hundreds of MB of
short-lived host buffers; glibc keeps such freed memory in its heap, where it still counts as the process's
resident memory. ``malloc_trim(0)`` returns it. Measured on a Llama-2-7B-shaped int4 model (2026-12-05,
2-core EPYC VM): after building the planted-sparse engine resident memory went 5.74 -> 5.12 GB, after compiling
the dense engine's step 4.84 -> 4.51 GB.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the OS where the C library can (glibc); elsewhere nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
