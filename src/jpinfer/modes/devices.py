"""The two devices of the hybrid mode (and of layer offload), and the dtype their host part keeps."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jpinfer.errors import JpinferError
from jpinfer.models.quantized import is_quantized


def default_devices() -> tuple[Any, Any]:
    """(accelerator, host): the first device and the CPU; two simulated CPU devices without a GPU."""
    first = jax.devices()[0]
    if first.platform != "cpu":
        return first, jax.devices("cpu")[0]
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        raise JpinferError(
            "hybrid mode needs an accelerator, or two CPU devices to play one: call "
            "jax.config.update('jax_num_cpu_devices', 2) before JAX starts"
        )
    return cpus[0], cpus[1]


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating arrays of ``tree`` (norms, biases, float matrices and rows) in ``dtype`` (on their device); integers
    (ids, int8 rows) untouched, and int8 / 4-bit matrices whole, their scales included: they are the format (a 4-bit
    matrix's float16 scales are what the native kernel reads)."""
    cast = lambda a: a if is_quantized(a) or not jnp.issubdtype(a.dtype, jnp.floating) else a.astype(dtype)
    return jax.tree_util.tree_map(cast, tree, is_leaf=is_quantized)


def host_dtype_for(model_dtype: Any, host: Any) -> Any:
    """The cold neurons' dtype: float32 on a CPU when the model is 16-bit. XLA:CPU ran bfloat16
    matrix-vector products 5-8x slower than float32 (bench/results/dense_bench.md) and the sparse
    CPU loop 40x slower at 7B width (scratch probe, 2026-12-01): host memory is the cheap side."""
    if host.platform == "cpu" and jnp.dtype(model_dtype).itemsize < 4:
        return jnp.float32
    return model_dtype
