"""host_heap.release_freed_heap: freed heap memory leaves the process's resident set (glibc; in a fresh process,
so nothing else's allocations blur the numbers), and the call is a no-op reporting False without malloc_trim."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from jpinfer import host_heap

PROBE = """
import numpy as np
from jpinfer.host_heap import release_freed_heap

def resident_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

# 3200 arrays of 64 KiB (under glibc's mmap threshold, so they come from the heap), each followed by a small one
# (2 KiB, from the heap too) that stays: the freed blocks are holes below live memory, which free() alone cannot
# give back
kept, blocks = [], []
for _ in range(3200):
    blocks.append(np.ones(8192))
    kept.append(np.ones(256))
del blocks
before = resident_mb()
assert release_freed_heap()
print(before, resident_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not sys.platform.startswith("linux"),
                    reason="malloc_trim is glibc's")
def test_release_returns_freed_heap_memory():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    before, after = float(out[0]), float(out[1])
    assert before - after > 150, f"resident {before:.0f} MB -> {after:.0f} MB: the 200 MB freed stayed"


def test_without_malloc_trim_it_reports_false(monkeypatch):
    monkeypatch.setattr(host_heap.ctypes, "CDLL", lambda name: object())  # a C library without the call
    assert host_heap.release_freed_heap() is False
