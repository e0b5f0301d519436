"""Handing the C heap's free memory back to the operating system after one-off work.

Reading a file into int8 or 4-bit (a tensor at a time), building an engine's layouts and compiling its step free
hundreds of MB of short-lived host buffers; glibc keeps such freed memory in its heap, where it still counts as
the process's resident memory, and ``malloc_trim(0)`` returns it. Measured (scratch, 2-core Zen 5 VM): the
7B-shaped Q8_0 file read into int8 (2026-12-04), resident 7.17 GiB after loading for 6.28 GiB of arrays, 6.77
after trimming; the 7B-shaped Q4_0 file in int4 (2026-12-05), its planted-sparse engine's build peak 7.22 ->
5.71 GB with a trim after each layer's conversion and one after the step compiled (4.84 -> 4.51 GB resident for
the dense engine's step).
"""

from __future__ import annotations

import ctypes


def release_freed_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is no such
    call (another C library or system)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's C library, as solver.milp opens it
    except OSError:
        return False
    if trim is None:
        return False
    trim(0)
    return True
