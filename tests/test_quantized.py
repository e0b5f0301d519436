"""Quantized decoder weights (models/quantized.py): the one product of int8 and 4-bit matrices (native kernel on
the CPU for up to 8 tokens, XLA otherwise) against float64 references written in the kernel tests, its dispatch,
its straight-through derivative; int4 weights quantized at load and read straight from a GGUF's Q4_0 / Q4_1
blocks (checked against gguf's own dequantizer); int4 engines decoding like the float model they stand for."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_int8 import reference_quantize, reference_tokens
from test_modes import forced_logits
from test_native_kernels import BACKENDS, assert_within, q4_reference

import jpinfer
from jpinfer import GenerationConfig, JpinferError
from jpinfer.models import gguf_loader, loading, params, quantized
from jpinfer.native import kernels as native_kernels
from jpinfer.native import library
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix

import gguf_fixtures as fx
from profiler_fixtures import tiny_engine
from tolerances import U32

U = U32


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def native(request, monkeypatch):
    """Parametrized by BACKENDS: True runs the native kernels (skipped where the library is missing), False forces
    the XLA forms the way a missing library does."""
    if not request.param:
        monkeypatch.setattr(quantized, "native_available", lambda: False)
    return request.param


def matrix_of(kind: str, seed: int = 0, shape=(37, 256)):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    w[:, ::9] *= 8  # outlier inputs
    return w, (int8.quantize(w) if kind == "int8" else q4.quantize(w, kind))


def reference(kind: str, w: np.ndarray, m, x: np.ndarray, native: bool) -> tuple[np.ndarray, np.ndarray]:
    """(y, error bound) in float64: the exact integer sums scaled by the stored scales; the bound of the native
    kernel or of the XLA form (``q4_reference``)."""
    if kind != "int8":
        return q4_reference(m, x, float_gemm=not native)
    q_w, s_w = reference_quantize(w, 0)
    q_x, s_x = reference_tokens(x)
    y = (q_x @ q_w.T) * s_x[:, None].astype(np.float64) * s_w[None, :].astype(np.float64)
    return y, 3 * U * np.abs(y) + 1e-30  # int32 -> float32 (exact here), two products: three roundings


@pytest.mark.parametrize("native", BACKENDS, indirect=True)
@pytest.mark.parametrize("kind", ["int8", "q4_0", "q4_1"])
@pytest.mark.parametrize("T", [1, 3, 8, 11])
def test_matmul_equals_the_integer_reference(kind, T, native):
    """1..8 tokens run the native kernel where present; 11 run the XLA form either way."""
    w, m = matrix_of(kind, seed=T)
    x = np.random.default_rng(100 + T).standard_normal((T, 256)).astype(np.float32)
    ref, bound = reference(kind, w, m, x, native and T <= native_kernels.MAX_TOKENS)
    assert_within(quantized.matmul(jnp.asarray(x), m), ref, bound, f"{kind} eager")
    assert_within(jax.jit(quantized.matmul)(jnp.asarray(x), m), ref, bound, f"{kind} jit")
    batched = jnp.asarray(x).reshape(1, T, 256)  # leading axes are flattened into tokens
    assert_within(quantized.matmul(batched, m)[0], ref, bound, f"{kind} (1, T, d)")

    def body(carry, xt):  # one token a step, as the decode loop runs it
        return carry, quantized.matmul(xt[None], m)[0]

    _, scanned = jax.lax.scan(body, 0, jnp.asarray(x))
    assert_within(scanned, ref, bound, f"{kind} scan")


@pytest.mark.skipif(not library.native_available(), reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int8", "q4_1"])
def test_the_native_kernel_serves_decode_steps_and_xla_longer_prompts(kind):
    _, m = matrix_of(kind)
    name = "jpinfer_int8_matvec" if kind == "int8" else "jpinfer_q4_1_matvec"

    def lowered(T):
        return jax.jit(quantized.matmul).lower(jnp.zeros((T, 256)), m).as_text()

    assert name in lowered(1) and name in lowered(native_kernels.MAX_TOKENS)
    assert name not in lowered(native_kernels.MAX_TOKENS + 1)
    transposed = int8.quantize(np.ones((256, 37), np.float32), scale_axis=1)  # input-major: no native form
    assert "jpinfer_int8_matvec" not in jax.jit(quantized.matmul).lower(jnp.zeros((1, 256)), transposed).as_text()


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_q4_derivative_is_straight_through(kind):
    w, m = matrix_of(kind, seed=3, shape=(12, 64))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 64)), jnp.float32)
    g = np.random.default_rng(5).standard_normal((3, 12))
    grad = jax.grad(lambda v: jnp.sum(quantized.matmul(v, m) * g))(x)
    expected = g @ np.asarray(q4.dequantize(m), np.float64)
    # float32 sums of 12 products of O(1) gradients with weights of O(8): well inside 1e-5 (1 + |expected|)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-5 * 8)


# ----- int4 weights

def test_quantize_weights_int4_uses_blocks_where_the_width_allows():
    """The tiny decoder's d_ff (48) is not a multiple of 32: its down projection stays int8, the rest 4-bit."""
    dense = tiny_engine("swiglu")
    w = quantized.quantize_weights(dense.weights, "int4")
    assert quantized.weights_format(w) == "int4"
    layer, ref = w.layers[1], dense.weights.layers[1]
    for name in ("w_qkv", "wo", "w_gate_up"):
        got, want = getattr(layer, name), q4.quantize(np.asarray(getattr(ref, name)), quantized.INT4_KIND)
        assert isinstance(got, Q4Matrix) and got.kind == quantized.INT4_KIND
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(layer.w_down, Int8Matrix)
    np.testing.assert_array_equal(np.asarray(layer.w_down.values), reference_quantize(ref.w_down, 0)[0])
    assert isinstance(w.head, Int8Matrix)
    with pytest.raises(ValueError, match="int4 already"):
        quantized.quantize_weights(w, "int4")
    narrow = dataclasses.replace(dense.cfg, d_model=24, n_heads=3, n_kv_heads=3, d_ff=40)
    with pytest.raises(ValueError, match="multiple of 32 inputs"):
        quantized.quantize_weights(params.build_weights(narrow, params.init_random(narrow)), "int4")


def q4_gguf(tmp_path, qtype=Q.Q4_1, **kwargs):
    cfg = fx.tiny_config(tied=True)
    return cfg, fx.write_gguf(tmp_path / "tiny-q4.gguf", cfg, fx.random_tensors(cfg, seed=7), qtype, **kwargs)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_blocks_are_read_as_stored(tmp_path, qtype):
    """Fused and un-permuted like the float tensors, the blocks dequantize to exactly what gguf's own dequantizer
    gives (the float model). A fused matrix with one part of another type is left out (quantized at load)."""
    cfg, path = q4_gguf(tmp_path, qtype, type_overrides={"layers.0.wk": Q.Q8_0})
    blocks = gguf_loader.read_q4_blocks(path, cfg)
    assert "layers.0.w_qkv" not in blocks and "layers.1.w_qkv" in blocks
    assert {b.kind for b in blocks.values()} == {qtype.name.lower()}
    float_model = loading.load_model(path)
    for key, m in blocks.items():
        _, i, name = key.split(".")
        want = np.asarray(getattr(float_model.weights.layers[int(i)], name))
        np.testing.assert_array_equal(np.asarray(q4.dequantize(m)), want, err_msg=key)
    engine = jpinfer.load(path, weights="int4")
    for key, m in blocks.items():
        _, i, name = key.split(".")
        for a, b in zip(jax.tree.leaves(getattr(engine.weights.layers[int(i)], name)), jax.tree.leaves(m)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rebuilt = engine.weights.layers[0].w_qkv  # Q8_0 k: the fused matrix quantized from float at load
    want = q4.quantize(np.asarray(float_model.weights.layers[0].w_qkv), quantized.INT4_KIND)
    np.testing.assert_array_equal(np.asarray(rebuilt.packed), np.asarray(want.packed))


def test_int4_model_follows_the_float_model_it_stands_for(tmp_path):
    """Against the float model of the same (dequantized) weights, only the activations' 8-bit blocks differ:
    ~0.4% per product (steps of 1/127 of each block's peak); the logits of the 2-layer model moved by <1% of
    their spread (measured), and 5% catches a wrong scale, block order or nibble (which moves them by their
    whole spread). Native and XLA products decode the same greedy tokens."""
    _, path = q4_gguf(tmp_path)
    engine = jpinfer.load(path, weights="int4")
    config = GenerationConfig(max_new_tokens=12)
    prompt = engine.encode_prompt("hello world")
    tokens = engine.generate(prompt, config).token_ids
    assert len(tokens) == 12
    float_weights = jax.tree.map(lambda m: quantized.as_float(m) if quantized.is_quantized(m) else m,
                                 engine.weights, is_leaf=quantized.is_quantized)
    float_weights = dataclasses.replace(float_weights, head=float_weights.head.T)  # params.Weights: (d, vocab)
    reference = jpinfer.Engine(dataclasses.replace(engine.model, weights=float_weights))
    ref, got = forced_logits(reference, prompt, tokens), forced_logits(engine, prompt, tokens)
    spread = ref.max() - ref.min()
    assert 0 < np.abs(got - ref).max() < 0.05 * spread
    if library.native_available():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantized, "native_available", lambda: False)
            xla_engine = jpinfer.load(path, weights="int4")
            assert xla_engine.generate(prompt, config).token_ids == tokens
            np.testing.assert_allclose(forced_logits(xla_engine, prompt, tokens), got, rtol=1e-5, atol=1e-5)


def test_int4_runs_in_the_dense_and_sparse_modes_only():
    with pytest.raises(JpinferError, match="int4 weights run in the modes dense and sparse; mode 'threshold'"):
        jpinfer.load("/no/such/checkpoint", weights="int4", mode="threshold", thresholds="profile")
    with pytest.raises(JpinferError, match="int4 weights run in the modes dense and sparse; mode 'hybrid'"):
        jpinfer.load("/no/such/checkpoint", weights="int4", mode="hybrid", predictors="/no/such/predictors",
                     placement=[])
