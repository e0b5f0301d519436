"""Layer offload (llama.cpp's ``-ngl``) as a jpinfer engine, and the random-weight models the
accelerator benches run it on.

``offload_engine(model, n_gpu, devices, host_dtype)``: the first ``n_gpu`` whole layers (weights
and KV cache) on the accelerator, the others dense on the host, embeddings, head and sampling on
the accelerator; the hidden state crosses to the host and back once per token. It is the
baseline the GPU suite (``gpu_suite``, ``synthetic``) measures the hybrid mode against under the same GPU budget.

``LLAMA2_7B`` / ``TINY`` and ``random_weights``: the shapes the GPU suite's fixed-list and hybrid
parts decode with (bench/modelled_speed.py models the same shapes), with weights
drawn per tensor on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Norm, Weights
from jpinfer.modes.devices import cast_floats
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.sampling import sample_next_jit

LLAMA2_7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                        d_ff=11008, ffn_kind="swiglu", max_position=4096, name="Llama-2-7B shapes, random weights")
TINY = ModelConfig(vocab_size=1000, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=688,
                   ffn_kind="swiglu", name="tiny, random weights")

step_inputs = jax.jit(transformer.step_inputs, static_argnames=("cfg",))


# ----- random weights


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key: jax.Array, scale: float, offset: float, *, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_weights(cfg: ModelConfig, dtype: Any, device: Any, seed: int = 0, scale: float = 0.02) -> Weights:
    """Llama-layout weights drawn per tensor on ``device``: numpy would take minutes for 6.7B
    parameters and hold them twice in host memory."""
    keys = iter(jax.device_put(jax.random.split(jax.random.key(seed), 3 + 6 * cfg.n_layers), device))
    matrix = lambda *shape: _normal(next(keys), scale, 0.0, shape=shape, dtype=dtype)
    norm = lambda: Norm(_normal(next(keys), 0.1, 1.0, shape=(cfg.d_model,), dtype=dtype))
    d, f = cfg.d_model, cfg.d_ff
    layers = [Layer(attn_norm=norm(), w_qkv=matrix(cfg.q_dim + 2 * cfg.kv_dim, d), wo=matrix(d, cfg.q_dim),
                    ffn_norm=norm(), w_gate_up=matrix(2 * f, d), w_down=matrix(d, f)) for _ in range(cfg.n_layers)]
    return Weights(head=matrix(d, cfg.vocab_size), layers=layers, final_norm=norm(), embed=matrix(cfg.vocab_size, d))



# ----- layer offload


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "first"), donate_argnames=("keys", "values"))
def _segment(layers: list[Layer], h, positions, rope_cs, keys, values, *, cfg: ModelConfig, attend: int, first: int):
    """Consecutive dense layers (the model's from ``first`` on) on one device, in their weights' dtype; h
    returns in its own."""
    dtype, keys, values = h.dtype, list(keys), list(values)
    h = h.astype(layers[0].wo.dtype)
    for i, layer in enumerate(layers):
        h, x, keys[i], values[i] = transformer.attention_residual(layer, h, positions, rope_cs, keys[i], values[i],
                                                                  cfg, attend, window=cfg.layer_window(first + i))
        h = transformer.ffn_residual(layer, h, transformer.ffn_dense(layer, x, cfg), cfg)
    return h.astype(dtype), keys, values


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
        zeros = lambda s, layer: jnp.zeros(shape, layer.wo.dtype, device=s.device)
        k = [zeros(s, layer) for s in self.segments for layer in s.layers]
        v = [zeros(s, layer) for s in self.segments for layer in s.layers]
        length = jnp.zeros((batch,) if per_sequence else (), jnp.int32, device=self.accelerator)
        return transformer.KVCache(k, v, length)

    def _run(self, tokens, cache, attend: int):
        h, positions, rope_cs = step_inputs(self.top, tokens, cache.length, cfg=self.cfg)
        keys, values = [], []
        for s in self.segments:
            i, n = len(keys), len(s.layers)
            h, k, v = _segment(s.layers, *jax.device_put((h, positions, rope_cs), s.device), cache.k[i:i + n],
                               cache.v[i:i + n], cfg=self.cfg, attend=attend, first=i)
            keys += k
            values += v
        return jax.device_put(h, self.accelerator), transformer.KVCache(keys, values, cache.length + tokens.shape[1])

    def first_logits(self, tokens, n_valid, cache, attend):
        h, cache = self._run(tokens, cache, attend)
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


def offload_engine(model: LoadedModel, n_gpu: int, devices: tuple[Any, Any], host_dtype: Any) -> Engine:
    accelerator, host = devices
    layers = model.weights.layers
    segments = [Segment(accelerator, layers[:n_gpu])] if n_gpu else []
    if n_gpu < len(layers):
        # cast where the weights are (the accelerator): XLA:CPU converts at about 1 GB/s
        cold = [jax.device_put(cast_floats(layer, host_dtype), host) for layer in layers[n_gpu:]]
        segments.append(Segment(host, cold))
    top = dataclasses.replace(model.weights, layers=[])
    return Engine(model, stepper=LayerOffloadStepper(model.cfg, top, segments, accelerator))
