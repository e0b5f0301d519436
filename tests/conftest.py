"""Test-wide setup: two simulated CPU devices (device 0 plays the accelerator)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JPINFER_COMPILE_CACHE"] = "0"  # the CLI's XLA cache: each test's cache directory is temporary

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
# The tolerances (tests/tolerances.py) are derived from float32 rounding. On a GPU platform (JAX_PLATFORMS set
# to cuda by hand), XLA's default precision for float32 matmuls is TF32 (10-bit mantissa, ~8000x float32's
# rounding), which no float32 tolerance allows for: ask for full float32. The CPU always computes float32
# matmuls in full float32, so this changes nothing there.
jax.config.update("jax_default_matmul_precision", "highest")
