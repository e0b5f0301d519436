"""Hardware profile: the numbers the placement cost model needs, presets, measurement.

Bandwidths are *effective* bytes per second for streaming neuron rows; presets carry
datasheet peaks, which are optimistic (sparse gathers reach a fraction of them: on the
CPU the sparse FFN reads its rows at 13-16 GB/s where a dense matrix-vector product
reaches 35-40, bench/results/kernels.md), so measure the target machine with
``measure_hardware()`` when you can.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable

GiB = 2**30
GB = 1e9

# Fields a caller may override (CLI ``--set name=value`` / API ``profile.replace(...)``).
NUMERIC_FIELDS = (
    "accel_memory",
    "accel_bandwidth",
    "cpu_bandwidth",
    "cpu_threads",
    "link_bandwidth",
    "link_latency",
    "sync_cost",
    "reserved",
)


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator plus its host, as seen by the placement cost model.

    accel_memory: accelerator memory in bytes; ``reserved`` of it is kept free for the
    runtime (context, workspace, activations), the rest is the placement budget.
    link_bandwidth / link_latency: one host<->device copy, per direction.
    sync_cost: extra time a layer pays when its FFN is split across both devices
    (launching the accelerator's share and waiting on the host's partial sum).
    measured: names of the fields measured on this machine; the others come from a preset.
    """

    name: str
    accel_memory: int
    accel_bandwidth: float
    cpu_bandwidth: float
    cpu_threads: int
    link_bandwidth: float
    link_latency: float
    sync_cost: float
    reserved: int = 0
    measured: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("accel_memory", "accel_bandwidth", "cpu_bandwidth", "cpu_threads", "link_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"HardwareProfile.{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("link_latency", "sync_cost", "reserved"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"HardwareProfile.{field} must be >= 0, got {getattr(self, field)!r}")
        if self.reserved >= self.accel_memory:
            raise ValueError(
                f"HardwareProfile.reserved ({self.reserved} B) must be below accel_memory ({self.accel_memory} B)"
            )

    @property
    def budget(self) -> int:
        """Accelerator bytes available to weights, predictors and the KV cache."""
        return int(self.accel_memory - self.reserved)

    def replace(self, **overrides: float) -> "HardwareProfile":
        """A copy with some numeric fields changed (unknown names are a ValueError)."""
        unknown = set(overrides) - set(NUMERIC_FIELDS) - {"name"}
        if unknown:
            raise ValueError(
                f"unknown hardware field(s) {sorted(unknown)}; choose from {', '.join(NUMERIC_FIELDS)}"
            )
        fixed = {k: (int(v) if k in ("accel_memory", "cpu_threads", "reserved") else v) for k, v in overrides.items()}
        return dataclasses.replace(self, **fixed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"measured": list(self.measured)}

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        return cls(**(data | {"measured": tuple(data.get("measured", ()))}))


# Presets. Sources:
# - GPU memory size and bandwidth: NVIDIA product pages / datasheets: GeForce RTX 4090
#   24 GB GDDR6X, 1008 GB/s (Ada Lovelace architecture whitepaper); GeForce RTX 2080 Ti
#   11 GB GDDR6, 616 GB/s (RTX 2080 Ti spec page); A100 80GB PCIe 1935 GB/s (A100
#   datasheet); H200 141 GB HBM3e, 4.8 TB/s (H200 datasheet).
# - Host links: PCIe 3.0 / 4.0 / 5.0 x16 = 8 / 16 / 32 GT/s x 16 lanes x 128b/130b
#   = 15.75 / 31.5 / 63 GB/s per direction (PCI-SIG base specifications).
# - Hosts of the consumer cards are the PowerInfer paper's (Song et al., SOSP'24, sec. 8):
#   PC-High i9-13900K with 67.2 GB/s memory bandwidth, PC-Low i7-12700K with 38.4 GB/s,
#   both 8 performance cores. Server hosts: AMD EPYC 7763 (8 x DDR4-3200 = 204.8 GB/s,
#   64 cores) for A100, AMD EPYC 9654 (12 x DDR5-4800 = 460.8 GB/s, 96 cores) for H200
#   (AMD product specifications).
# - link_latency 10 us, sync_cost 20 us and reserved 1 GiB are estimates (a small CUDA
#   copy plus event wait; CUDA context and workspace), not datasheet figures.
_LATENCY = 10e-6
_SYNC = 20e-6

PRESETS: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("rtx4090", 24 * GiB, 1008 * GB, 67.2 * GB, 8, 31.5 * GB, _LATENCY, _SYNC, 1 * GiB),
        HardwareProfile("rtx2080ti", 11 * GiB, 616 * GB, 38.4 * GB, 8, 15.75 * GB, _LATENCY, _SYNC, 1 * GiB),
        HardwareProfile("a100-80gb", 80 * GiB, 1935 * GB, 204.8 * GB, 64, 31.5 * GB, _LATENCY, _SYNC, 1 * GiB),
        HardwareProfile("h200", int(141 * GB), 4800 * GB, 460.8 * GB, 96, 63 * GB, _LATENCY, _SYNC, 1 * GiB),
    )
}


def preset(name: str) -> HardwareProfile:
    """The named preset; a ValueError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; choose from {', '.join(PRESETS)}") from None


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (compilation, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def measure_hardware(base: HardwareProfile | str = "rtx4090", *, array_mib: int = 128,
                     devices: tuple | None = None) -> HardwareProfile:
    """Measure this machine in a few seconds; fields it cannot measure keep ``base``'s values.

    CPU: thread count, and the bandwidth of a float32 matrix-vector product on the JAX
    CPU device (how the cold FFN streams weights). Accelerator, when ``jax.devices()[0]``
    is not a CPU: memory limit, on-device bandwidth, host<->device bandwidth and latency
    with ``jax.device_put``, and the cost of one dispatch-and-wait (sync). On a CPU-only
    machine those stay at ``base``'s values and are absent from ``measured``, unless
    ``devices`` = (accelerator, host) names the two devices the hybrid engine runs on (two
    simulated CPU devices): then the link and the sync are measured between them.
    """
    import jax
    import numpy as np

    profile = preset(base) if isinstance(base, str) else base
    if array_mib < 1:
        raise ValueError(f"array_mib must be >= 1, got {array_mib}")
    cols = 4096
    rows = max(1, array_mib * 2**20 // (4 * cols))
    host = np.ones((rows, cols), np.float32)
    vec = np.ones(cols, np.float32)
    matvec = jax.jit(lambda a, v: a @ v)

    accel, cpu = devices or (jax.devices()[0], jax.devices("cpu")[0])
    host_a, host_v = jax.device_put(host, cpu), jax.device_put(vec, cpu)
    cpu_s = _best_seconds(lambda: matvec(host_a, host_v).block_until_ready(), repeats=5)
    found: dict[str, float] = {"cpu_bandwidth": host.nbytes / cpu_s, "cpu_threads": _cpu_threads()}

    if accel != cpu:
        stats = accel.memory_stats() or {}
        if "bytes_limit" in stats:
            found["accel_memory"] = int(stats["bytes_limit"])
        dev_a, dev_v = jax.device_put(host, accel), jax.device_put(vec, accel)
        found["accel_bandwidth"] = host.nbytes / _best_seconds(
            lambda: matvec(dev_a, dev_v).block_until_ready(), repeats=10
        )
        to_dev = _best_seconds(lambda: jax.device_put(host_a, accel).block_until_ready(), repeats=3)
        to_host = _best_seconds(lambda: jax.device_put(dev_a, cpu).block_until_ready(), repeats=3)
        found["link_bandwidth"] = host.nbytes / ((to_dev + to_host) / 2)
        small = jax.device_put(np.ones(cols, np.float32), accel)  # one hidden state, there and back
        found["link_latency"] = _median_seconds(
            lambda: jax.device_put(jax.device_put(small, cpu), accel).block_until_ready(), repeats=50
        ) / 2
        tiny = jax.jit(lambda v: v + 1)
        found["sync_cost"] = _median_seconds(lambda: tiny(dev_v).block_until_ready(), repeats=50)
    updated = profile.replace(**found)
    return dataclasses.replace(
        updated, name=f"measured (rest from {profile.name})", measured=tuple(sorted(found))
    )
