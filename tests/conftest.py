"""Test-wide setup: two simulated CPU devices (device 0 plays the accelerator)."""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JPINFER_COMPILE_CACHE"] = "0"  # the CLI's XLA cache: each test's cache directory is temporary

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
# The tolerances (tests/tolerances.py) are derived from float32 rounding. On a GPU platform (JAX_PLATFORMS set
# to cuda by hand), XLA's default precision for float32 matmuls is TF32 (10-bit mantissa, ~8000x float32's
# rounding), which no float32 tolerance allows for: ask for full float32. The CPU always computes float32
# matmuls in full float32, so this changes nothing there.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every XLA:CPU executable holds memory
    mappings of its own; over the whole suite in one process they passed the kernel's limit of 65530
    (vm.max_map_count: 46518 mappings at 62% of the suite, then a segmentation fault in a compile)."""
    yield
    jax.clear_caches()
    gc.collect()
