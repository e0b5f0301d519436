"""Layer offload (``bench.layer_offload``, llama.cpp's ``-ngl``) in every weights format, on two simulated CPU
devices (device 0 plays the accelerator): whole layers per device, each in the model's format, decode as the dense
engine in that format does (the same products, some on the other device); the host's layers keep their int8 and
4-bit matrices; ``gpu_layers`` fills a budget with whole layers at their format's bytes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import assert_decodes_like
from test_sparse_int4 import int4_engine
from test_sparse_int8 import int8_engine

from jpinfer.bench.layer_offload import TINY, gpu_layers, offload_engine, random_weights
from jpinfer.models import quantized
from jpinfer.models.loading import LoadedModel
from jpinfer.quant import q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.runtime.engine import Engine
from jpinfer.solver import model_sizes

from profiler_fixtures import tiny_engine
from tolerances import DECODER_ATOL

FORMATS = {"float": lambda: tiny_engine("swiglu"), "int8": lambda: int8_engine("swiglu"),
           "int4": lambda: int4_engine("swiglu")}
MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


@functools.cache
def dense(fmt: str) -> Engine:
    return FORMATS[fmt]()


def devices() -> tuple:
    return tuple(jax.devices("cpu")[:2])


def device_of(array) -> object:
    return next(iter(array.devices()))


@pytest.mark.parametrize("n_gpu", [0, 1, 2])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_layer_offload_decodes_like_the_dense_engine_in_its_format(fmt, n_gpu):
    """0, 1 and all 2 layers on the accelerator: the dense engine's greedy tokens, and its forced logits within
    DECODER_ATOL (the same products in float32, int8 W8A8 or 4-bit W4A8, in other programs: a layer on the host is
    its own program, so XLA may fuse and round the float parts around the products otherwise). A layer run twice,
    skipped or in the wrong format moves the logits by ~0.1 or more."""
    reference = dense(fmt)
    engine = offload_engine(reference.model, n_gpu, devices())
    assert_decodes_like(engine, reference, 12, rtol=0, atol=DECODER_ATOL)


def test_a_layer_run_twice_fails_the_comparison():
    """The comparison can fail: the int4 model with its first layer in place of its second (on the host), offloaded
    at 1 layer, is not the dense int4 engine."""
    model = dense("int4").model
    first = model.weights.layers[0]
    twice = dataclasses.replace(model, weights=dataclasses.replace(model.weights, layers=[first, first]))
    with pytest.raises(AssertionError):
        assert_decodes_like(offload_engine(twice, 1, devices()), dense("int4"), 12, rtol=0, atol=DECODER_ATOL)


def bfloat16(model: LoadedModel) -> LoadedModel:
    cast = lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return dataclasses.replace(model, weights=jax.tree_util.tree_map(cast, model.weights))


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
def test_host_layers_keep_the_format_and_their_floats_go_float32(fmt):
    """A bfloat16 model, 1 of 2 layers on the accelerator: the accelerator's layer as the model holds it (bfloat16);
    the host's on device 1 with the very integers and scales of the model's int8 / 4-bit matrices (a 4-bit matrix's
    scales stay float16: the native kernel reads them), its float arrays (norms; a float model's matrices) float32
    (``host_dtype_for``); its KV cache float32 too."""
    model = bfloat16(tiny_engine("swiglu").model)
    if fmt != "float":
        model = dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, fmt))
    accelerator, host = devices()
    stepper = offload_engine(model, 1, (accelerator, host)).stepper
    [gpu], [cpu] = (s.layers for s in stepper.segments)
    assert [s.device for s in stepper.segments] == [accelerator, host]
    assert gpu.attn_norm.scale.dtype == jnp.bfloat16 and device_of(gpu.attn_norm.scale) == accelerator
    layer = model.weights.layers[1]
    assert cpu.attn_norm.scale.dtype == cpu.ffn_norm.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cpu.ffn_norm.scale), np.asarray(layer.ffn_norm.scale, np.float32))
    for name in MATRICES:
        want, got = getattr(layer, name), getattr(cpu, name)
        assert type(got) is type(want)
        leaves = jax.tree_util.tree_leaves(got)
        assert all(device_of(a) == host for a in leaves)
        if fmt == "float":
            assert got.dtype == jnp.float32
            continue
        for a, b in zip(leaves, jax.tree_util.tree_leaves(want), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if fmt == "int4":
        assert isinstance(cpu.w_gate_up, Q4Matrix) and cpu.w_gate_up.scales.dtype == jnp.float16
        assert isinstance(cpu.w_down, Int8Matrix)  # d_ff 48: no whole blocks of 32
    cache = stepper.new_cache(16)
    assert [k.dtype for k in cache.k] == [jnp.bfloat16, jnp.float32]
    assert [device_of(k) for k in cache.k] == [accelerator, host]


def int4_layer_bytes(cfg) -> int:
    """One tiny int4 layer's bytes from its shapes: Q4_1 (out, in) matrices hold in / 2 bytes of nibbles and a
    float16 scale and min per block of 32 a row; w_down (in 48, no whole blocks) int8 with a float32 scale a row;
    two float32 norms."""
    q4 = lambda out, inp: out * inp // 2 + out * (inp // 32) * 2 * 2
    d, q, kv, f = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
    return q4(q + 2 * kv, d) + q4(d, q) + q4(2 * f, d) + (d * f + d * 4) + 2 * d * 4


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_gpu_layers_fill_the_budget_with_whole_layers_at_their_formats_bytes(fmt):
    """The top part (embeddings, head, final norm) first, then whole layers with their KV cache while the next fits:
    at exactly the top and k layers, k; a byte less, k - 1; below the top part, none; the whole model, all. Sizes
    from the shapes: float32 as ``solver.model_sizes`` counts them; int4 per ``int4_layer_bytes``, the head int8 per
    row with a float32 scale."""
    weights = dense(fmt).weights
    cfg = dataclasses.replace(dense(fmt).cfg, n_layers=4)
    weights = dataclasses.replace(weights, layers=weights.layers * 2)  # four layers
    d, v = cfg.d_model, cfg.vocab_size
    if fmt == "float":
        sizes = model_sizes(cfg, weight_bytes=4)
        top = sizes.embed_bytes + sizes.lm_head_bytes + sizes.other_bytes
        layer = sizes.layer_dense_bytes + cfg.d_ff * sizes.neuron_bytes
    else:
        top = v * d * 4 + (v * d + v * 4) + d * 4  # float embedding, int8 head, final norm
        layer = int4_layer_bytes(cfg)
    kv = 2 * cfg.kv_dim * 64 * 4  # 64 float32 positions
    for k in range(5):
        budget = top + k * (layer + kv)
        assert gpu_layers(weights, budget, kv) == k
        if k:
            assert gpu_layers(weights, budget - 1, kv) == k - 1
    assert gpu_layers(weights, top - 1, kv) == 0
    assert gpu_layers(weights, 10 * budget, kv) == 4


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_random_weights_are_drawn_in_the_format_with_the_float_draws_spread(fmt):
    """The GPU suite's random models in int8 / int4: ``models.quantized``'s layout (4-bit Q4_1 blocks where the inputs
    fill blocks of 32, int8 per row elsewhere and for the head, stored (vocab, d_model)), float arrays in the given
    dtype, and the float draw's spread: each matrix's weights have standard deviation 0.02 and mean ~0 (over 10^5+
    weights the sample's is within 2% of it)."""
    cfg = dataclasses.replace(TINY, n_layers=1)
    weights = random_weights(cfg, jnp.bfloat16, devices()[0], seed=3, fmt=fmt)
    assert quantized.weights_format(weights) == fmt and weights.dtype == jnp.bfloat16
    layer = weights.layers[0]
    four_bit = {"w_qkv": fmt == "int4", "wo": fmt == "int4", "w_gate_up": fmt == "int4", "w_down": False}  # d_ff 688
    for name, blocks in four_bit.items():
        w = getattr(layer, name)
        assert isinstance(w, Q4Matrix if blocks else Int8Matrix)
        if blocks:
            q4.check(w)
        values = np.asarray(quantized.as_float(w), np.float64)
        assert values.std() == pytest.approx(0.02, rel=0.02) and abs(values.mean()) < 0.002
    assert isinstance(weights.head, Int8Matrix) and weights.head.shape == (cfg.vocab_size, cfg.d_model)
    assert weights.embed.dtype == jnp.bfloat16 and layer.attn_norm.scale.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown weights format"):
        random_weights(cfg, jnp.bfloat16, devices()[0], fmt="int2")
