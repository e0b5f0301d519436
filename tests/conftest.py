"""Test-wide setup: two simulated CPU devices (device 0 plays the accelerator)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
