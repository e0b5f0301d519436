"""What the machine can do, measured in the same run as the engines it is compared with."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.protocol import fastest


def matvec_read_bandwidth(n_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s at which XLA streams a large float32 matrix through a matrix-vector product.

    Decoding one token is a chain of such products, so this is its speed limit here.
    """
    cols = 4096
    rows = n_bytes // (4 * cols)
    w = jnp.ones((rows, cols), jnp.float32)
    x = jnp.ones((cols,), jnp.float32)
    f = jax.jit(lambda w, x: w @ x)
    (best,) = fastest([lambda: f(w, x)], rounds=repeats, per_round=1)
    return rows * cols * 4 / best


class HostCopy:
    """The host's copy bandwidth: one buffer of ``n_bytes`` copied into another (``np.copyto``, which releases the
    GIL) in ``threads`` equal slices at once, one a thread (default: the cores this process may run on, as the
    native kernels use them). A copy moves each byte through memory twice (read and write); its rate here is
    bytes copied per second, memcpy's usual figure. Buffers of 512 MiB or more also flush the caches (each copy
    streams twice that through them), so a timed read after a copy starts from memory."""

    def __init__(self, n_bytes: int = 512 << 20, threads: int | None = None) -> None:
        self.threads = threads or len(os.sched_getaffinity(0))
        self.n_bytes = n_bytes
        self._source = np.ones(n_bytes, np.uint8)
        self._target = np.zeros(n_bytes, np.uint8)  # both written now: no page faults in a timed copy
        step = -(-n_bytes // self.threads)
        self._slices = [slice(i * step, min(n_bytes, (i + 1) * step)) for i in range(self.threads)]
        self._pool = ThreadPoolExecutor(self.threads)

    def seconds(self) -> float:
        """Wall seconds of one copy."""
        start = time.perf_counter()
        list(self._pool.map(lambda s: np.copyto(self._target[s], self._source[s]), self._slices))
        return time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown()
        self._source = self._target = None


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory now (``rss``) and at its peak so far (``peak``), in bytes (Linux's
    /proc/PID/status VmRSS and VmHWM: anonymous memory and the file pages it has mapped, such as a model file
    read through mmap); an empty dict where the system has no such file."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    kib = lambda key: int(fields[key].split()[0]) * 1024
    return {"rss": kib("VmRSS"), "peak": kib("VmHWM")} if "VmHWM" in fields else {}
