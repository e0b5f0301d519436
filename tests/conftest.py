"""Test-wide setup: two simulated CPU devices (device 0 plays the accelerator)."""

import atexit
import gc
import os
import shutil
import tempfile

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
# XLA's persistent cache for this test session: _release_compiled_programs drops the compiled programs after
# each module, and the same tiny-model programs (a decode step, a prefill) come back in many modules; with the
# cache a later module loads them instead of compiling again. One fresh directory per process (per xdist
# worker), removed at exit, so no run sees another's programs. Not one directory shared by the workers: JAX writes
# an entry in place (a worker could read another's half-written file), and its size limit, which makes it lock each
# read and write, also makes every write read the whole directory (a session writes ~10k files).
_COMPILED = tempfile.mkdtemp(prefix=f"jpinfer-tests-xla-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
atexit.register(shutil.rmtree, _COMPILED, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILED)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the tiny models' programs compile fast


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every XLA:CPU executable holds memory
    mappings of its own; over the whole suite in one process they passed the kernel's limit of 65530
    (vm.max_map_count: 46518 mappings at 62% of the suite, then a segmentation fault in a compile)."""
    yield
    jax.clear_caches()
    gc.collect()
