"""What the machine can do, measured in the same run as the engines it is compared with."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
