"""Layer offload (llama.cpp's ``-ngl``) as a jpinfer engine, and the random-weight models the
accelerator benches run it on.

``offload_engine(model, n_gpu, devices, host_dtype)``: the first ``n_gpu`` whole layers (weights
and KV cache) on the accelerator, the others dense on the host, embeddings, head and sampling on
the accelerator; the hidden state crosses to the host and back once per token. Every layer keeps the
model's weights format (float, int8, int4), so the host's layers run the products the dense engine runs
in that format on the CPU (``ops``: the native int8 / 4-bit kernels), as llama.cpp's host layers run its
own: the comparison with the hybrid isolates the placement, not the kernels. Only float arrays change
on the host: ``host_dtype`` (``modes.devices.host_dtype_for``: float32 for a 16-bit model). It is the
baseline the GPU suite (``gpu_suite``, ``synthetic``) measures the hybrid mode against under the same GPU
budget; ``gpu_layers`` is its n for a budget in bytes.

``LLAMA2_7B`` / ``TINY`` and ``random_weights``: the shapes the GPU suite's fixed-list and hybrid
parts decode with (bench/modelled_speed.py models the same shapes), with weights
drawn per tensor on the device, in float or drawn directly in the int8 / int4 format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.models import quantized, transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Norm, Weights, nbytes
from jpinfer.modes.devices import cast_floats, default_devices, host_dtype_for
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.sampling import sample_next_jit

LLAMA2_7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                        d_ff=11008, ffn_kind="swiglu", max_position=4096, name="Llama-2-7B shapes, random weights")
TINY = ModelConfig(vocab_size=1000, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=688,
                   ffn_kind="swiglu", name="tiny, random weights")

step_inputs = jax.jit(transformer.step_inputs, static_argnames=("cfg",))


# ----- random weights

FORMATS = ("float", "int8", "int4")  # models.quantized's weights formats
# Standard deviations of a random int8 value (uniform on [-127, 127]) and 4-bit value (uniform on 0..15): a quantized
# matrix's scale is the float weights' standard deviation over it, so every format has the float draw's spread
INT8_STD, Q4_STD = math.sqrt((255**2 - 1) / 12), math.sqrt((16**2 - 1) / 12)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key: jax.Array, scale: float, offset: float, *, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("shape", "packed"))
def _integers(key: jax.Array, *, shape: tuple[int, ...], packed: bool) -> jax.Array:
    """int8 values uniform on [-127, 127], or (``packed``) bytes of two uniform 4-bit values."""
    if packed:
        return jax.random.bits(key, shape, jnp.uint8)
    return jax.random.randint(key, shape, -int8.QMAX, int8.QMAX + 1, jnp.int8)


def _quantized(key: jax.Array, scale: float, fmt: str, shape: tuple[int, int], device: Any):
    """A random (out, in) matrix in ``fmt`` as ``quantized.quantize_matrix`` would store it (4-bit Q4_1 blocks where
    the inputs fill blocks of 32, else int8 per row), drawn in its integers with one scale (and min) for all."""
    out, inputs = shape
    if fmt == "int8" or inputs % q4.QK:
        scales = jnp.full((out,), scale / INT8_STD, jnp.float32, device=device)
        return Int8Matrix(_integers(key, shape=shape, packed=False), scales, 0)
    step = scale / Q4_STD  # values step * q - 7.5 step, q uniform on 0..15: mean 0
    blocks = (out, inputs // q4.QK)
    return Q4Matrix(_integers(key, shape=(out, inputs // 2), packed=True),
                    jnp.full(blocks, step, jnp.float16, device=device),
                    jnp.full(blocks, -7.5 * step, jnp.float16, device=device), quantized.INT4_KIND)


def random_weights(cfg: ModelConfig, dtype: Any, device: Any, seed: int = 0, scale: float = 0.02,
                   fmt: str = "float") -> Weights:
    """Llama-layout weights drawn per tensor on ``device``: numpy would take minutes for 6.7B
    parameters and hold them twice in host memory. ``fmt`` "int8" / "int4": the projections and the head drawn in
    that format (``models.quantized``'s layout: the head int8 per vocabulary row), not quantized from floats
    (quantizing a 7B model on its host takes minutes); norms and the input embedding in ``dtype``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}; choose from {', '.join(FORMATS)}")
    keys = iter(jax.device_put(jax.random.split(jax.random.key(seed), 3 + 6 * cfg.n_layers), device))
    if fmt == "float":
        matrix = lambda *shape: _normal(next(keys), scale, 0.0, shape=shape, dtype=dtype)
    else:
        matrix = lambda *shape: _quantized(next(keys), scale, fmt, shape, device)
    norm = lambda: Norm(_normal(next(keys), 0.1, 1.0, shape=(cfg.d_model,), dtype=dtype))
    d, f = cfg.d_model, cfg.d_ff
    layers = [Layer(attn_norm=norm(), w_qkv=matrix(cfg.q_dim + 2 * cfg.kv_dim, d), wo=matrix(d, cfg.q_dim),
                    ffn_norm=norm(), w_gate_up=matrix(2 * f, d), w_down=matrix(d, f)) for _ in range(cfg.n_layers)]
    head = matrix(d, cfg.vocab_size) if fmt == "float" else _quantized(next(keys), scale, "int8",
                                                                        (cfg.vocab_size, d), device)
    final_norm = norm()
    embed = _normal(next(keys), scale, 0.0, shape=(cfg.vocab_size, d), dtype=dtype)
    return Weights(head=head, layers=layers, final_norm=final_norm, embed=embed)


# ----- layer offload


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "first"), donate_argnames=("keys", "values"))
def _segment(layers: list[Layer], h, positions, rope_cs, keys, values, *, cfg: ModelConfig, attend: int, first: int):
    """Consecutive dense layers (the model's from ``first`` on) on one device, in their float dtype; h
    returns in its own."""
    dtype, keys, values = h.dtype, list(keys), list(values)
    h = h.astype(float_dtype(layers[0]))
    for i, layer in enumerate(layers):
        h, x, keys[i], values[i] = transformer.attention_residual(layer, h, positions, rope_cs, keys[i], values[i],
                                                                  cfg, attend, window=cfg.layer_window(first + i))
        h = transformer.ffn_residual(layer, h, transformer.ffn_dense(layer, x, cfg), cfg)
    return h.astype(dtype), keys, values


def float_dtype(layer: Layer) -> Any:
    """The dtype of a layer's activations and KV cache: its norms' (an int8 or 4-bit layer's matrices have none)."""
    return layer.attn_norm.scale.dtype


@functools.partial(jax.jit, static_argnames=("cfg",))
def _final_logits(top: Weights, h, last, *, cfg: ModelConfig):
    h = transformer.norm(top.final_norm, h, cfg)
    return transformer.logits(top, jax.lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False), cfg)


@dataclasses.dataclass
class Segment:
    device: Any
    layers: list[Layer]


@dataclasses.dataclass
class LayerOffloadStepper:
    """``runtime.Stepper`` of llama.cpp's ``-ngl``: whole layers (weights and KV cache) per device,
    run segment after segment; embeddings, head and sampling on ``accelerator``. The hidden
    state crosses to the host and back once per token."""

    cfg: ModelConfig
    top: Weights
    segments: list[Segment]
    accelerator: Any
    name: str = "layer offload"

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> transformer.KVCache:
        shape = (batch, self.cfg.n_kv_heads, capacity, self.cfg.head_dim)
        zeros = lambda s, layer: jnp.zeros(shape, float_dtype(layer), device=s.device)
        k = [zeros(s, layer) for s in self.segments for layer in s.layers]
        v = [zeros(s, layer) for s in self.segments for layer in s.layers]
        length = jnp.zeros((batch,) if per_sequence else (), jnp.int32, device=self.accelerator)
        return transformer.KVCache(k, v, length)

    def _run(self, tokens, cache, attend: int, n_valid=None):
        h, positions, rope_cs = step_inputs(self.top, tokens, cache.length, n_valid=n_valid, cfg=self.cfg)
        keys, values = [], []
        for s in self.segments:
            i, n = len(keys), len(s.layers)
            h, k, v = _segment(s.layers, *jax.device_put((h, positions, rope_cs), s.device), cache.k[i:i + n],
                               cache.v[i:i + n], cfg=self.cfg, attend=attend, first=i)
            keys += k
            values += v
        return jax.device_put(h, self.accelerator), transformer.KVCache(keys, values, cache.length + tokens.shape[1])

    def first_logits(self, tokens, n_valid, cache, attend):
        h, cache = self._run(tokens, cache, attend, n_valid)
        logits = _final_logits(self.top, h, n_valid - 1, cfg=self.cfg)
        return logits, dataclasses.replace(cache, length=cache.length - tokens.shape[1] + n_valid)

    def first(self, tokens, n_valid, cache, key, sampler, attend):
        logits, cache = self.first_logits(tokens, n_valid, cache, attend)
        token, key = sample_next_jit(logits, key, sampler=sampler)
        return token, cache, key

    def step_logits(self, token, cache, attend):
        h, cache = self._run(token[:, None], cache, attend)
        return _final_logits(self.top, h, 0, cfg=self.cfg), cache

    def next(self, token, cache, key, sampler, attend):
        step_logits, cache = self.step_logits(token, cache, attend)
        token, key = sample_next_jit(step_logits, key, sampler=sampler)
        return token, cache, key


def offload_engine(model: LoadedModel, n_gpu: int, devices: tuple[Any, Any] | None = None,
                   host_dtype: Any = None) -> Engine:
    """The first ``n_gpu`` layers on ``devices[0]``, the rest on ``devices[1]`` (default ``default_devices``), each
    in the model's weights format; the host layers' float arrays (norms, biases, float matrices) in
    ``host_dtype`` (default ``host_dtype_for`` the model's dtype), their int8 and 4-bit matrices as they are
    (``modes.devices.cast_floats``)."""
    accelerator, host = devices or default_devices()
    layers = model.weights.layers
    if not 0 <= n_gpu <= len(layers):
        raise ValueError(f"n_gpu must be in 0..{len(layers)}, got {n_gpu}")
    host_dtype = host_dtype_for(model.weights.dtype, host) if host_dtype is None else host_dtype
    segments = [Segment(accelerator, jax.device_put(layers[:n_gpu], accelerator))] if n_gpu else []
    if n_gpu < len(layers):
        # cast where the weights are (the accelerator): XLA:CPU converts at about 1 GB/s
        cold = [jax.device_put(cast_floats(layer, host_dtype), host) for layer in layers[n_gpu:]]
        segments.append(Segment(host, cold))
    top = jax.device_put(dataclasses.replace(model.weights, layers=[]), accelerator)
    return Engine(model, stepper=LayerOffloadStepper(model.cfg, top, segments, accelerator))


def gpu_layers(weights: Weights, budget: int, kv_bytes: int) -> int:
    """The layers ``offload_engine`` keeps on the accelerator within ``budget`` bytes, as llama.cpp's ``-ngl`` is
    chosen: the top part (embeddings, head, final norm) first, then whole layers in order, each with its KV cache
    (``kv_bytes`` a layer), while the next one fits. Bytes in the weights' format (``models.params.nbytes``: an int8
    or 4-bit matrix with its scales), the measure the hybrid's budget uses."""
    left = budget - nbytes(dataclasses.replace(weights, layers=[]))
    for n, layer in enumerate(weights.layers):
        left -= nbytes(layer) + kv_bytes
        if left < 0:
            return n
    return len(weights.layers)
