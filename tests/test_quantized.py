"""Quantized decoder weights (models/quantized.py): the one product of int8 and 4-bit matrices (native kernel on
the CPU for up to 8 tokens, XLA otherwise) against float64 references written in the kernel tests, its dispatch,
its straight-through derivative; int4 weights quantized at load and read straight from a GGUF's Q4_0 / Q4_1
blocks (checked against gguf's own dequantizer); int4 engines decoding like the float model they stand for; the
threshold mode in int4 (int8 copies of the matrices it reads by rows) against float64 references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_int8 import reference_quantize, reference_tokens, rounding_margin
from test_modes import PROMPT, assert_decodes_like, forced_logits
from test_native_kernels import BACKENDS, assert_within, q4_reference
from test_threshold import given

import jpinfer
from jpinfer import GenerationConfig
from jpinfer.models import gguf_loader, loading, params, quantized, transformer
from jpinfer.modes import build_engine
from jpinfer.native import kernels as native_kernels
from jpinfer.native import library
from jpinfer.ops import dense
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.sparse import ROWS_BACKENDS, threshold_ffn, threshold_layout

import gguf_fixtures as fx
from profiler_fixtures import thresholds_in_gaps, tiny_engine
from tolerances import KERNEL_ATOL, KERNEL_RTOL, U32

U = U32


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def native(request, monkeypatch):
    """Parametrized by BACKENDS: True runs the native kernels (skipped where the library is missing), False forces
    the XLA forms the way a missing library does."""
    if not request.param:
        monkeypatch.setattr(dense, "native_available", lambda: False)
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
    """int8: the native kernel for 1-8 tokens (decode steps), XLA's integer product beyond; 4-bit: the native
    kernel (in groups of 8) up to ``Q4_NATIVE_PROMPT_TOKENS`` (short prompts too), XLA's dequantized GEMM beyond."""
    _, m = matrix_of(kind)
    name = "jpinfer_int8_matvec" if kind == "int8" else "jpinfer_q4_1_matvec"
    limit = native_kernels.MAX_TOKENS if kind == "int8" else dense.Q4_NATIVE_PROMPT_TOKENS

    def lowered(T):
        return jax.jit(quantized.matmul).lower(jnp.zeros((T, 256)), m).as_text()

    assert name in lowered(1) and name in lowered(native_kernels.MAX_TOKENS) and name in lowered(limit)
    assert name not in lowered(limit + 1)
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

def test_a_prompt_dequantizes_one_4bit_matrix_at_a_time():
    """The XLA product of a prompt (more than 8 tokens) dequantizes each 4-bit matrix once its tokens exist: the
    compiled temporaries of a stack of layers stay near one layer's float32 matrix, whatever the depth (they grew
    with it, a whole model's float weights at once, before ``q4.product`` used ``ordering.after``)."""
    rng = np.random.default_rng(0)
    d = 256
    one_layer = 4 * d * d * 4  # a (4d, d) float32 matrix

    def temporaries(n_layers: int) -> int:
        ms = [q4.quantize(rng.standard_normal((4 * d, d)).astype(np.float32), "q4_0") for _ in range(n_layers)]

        def stack(x, ms):
            for m in ms:
                x = jnp.tanh(q4.product(m, x))[:, :d]
            return x

        compiled = jax.jit(stack).lower(jnp.ones((32, d), jnp.float32), ms).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    shallow, deep = temporaries(2), temporaries(8)
    assert deep < 2 * one_layer, (deep, one_layer)
    assert deep <= shallow + one_layer // 4


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
            patch.setattr(dense, "native_available", lambda: False)
            xla_engine = jpinfer.load(path, weights="int4")
            assert xla_engine.generate(prompt, config).token_ids == tokens
            np.testing.assert_allclose(forced_logits(xla_engine, prompt, tokens), got, rtol=1e-5, atol=1e-5)


# ----- the threshold mode in int4: int8 copies of the matrices it reads by rows

def int4_engine(kind: str) -> jpinfer.Engine:
    """tiny_engine's decoder with d_ff 64, so that gate/up and down both take multiples of 32 inputs: int4 weights
    with every FFN matrix 4-bit (Q4_1, quantized at load)."""
    tiny = tiny_engine(kind)
    cfg = dataclasses.replace(tiny.cfg, d_ff=64)
    weights = quantized.quantize_weights(params.build_weights(cfg, params.init_random(cfg, seed=0, scale=0.2)), "int4")
    return jpinfer.Engine(dataclasses.replace(tiny.model, cfg=cfg, weights=weights))


def gguf_dequantized(m: Q4Matrix) -> np.ndarray:
    """The (out, in) float matrix of 4-bit blocks by gguf's own dequantizer (written apart from quant/q4.py)."""
    from gguf.quants import dequantize

    return dequantize(np.asarray(q4.to_gguf(m)), Q[m.kind.upper()]).reshape(m.shape).astype(np.float64)


def int8_copy(m: Q4Matrix) -> Int8Matrix:
    """The int8 copy (one scale per output) of a 4-bit matrix, by the float64 reference quantizer of test_int8."""
    q, s = reference_quantize(gguf_dequantized(m), 0)
    return Int8Matrix(jnp.asarray(q.astype(np.int8)), jnp.asarray(s, jnp.float32))


def w8a8_reference(v: np.ndarray, m: Int8Matrix) -> np.ndarray:
    """float64: v (T, in) quantized per token as the decoder does (test_int8.reference_tokens), exact integer sums
    with the (out, in) int8 matrix, scaled by both scales."""
    q_v, s_v = reference_tokens(v)
    q_w, s_w = np.asarray(m.values, np.int64), np.asarray(m.scales, np.float64)
    return (q_v @ q_w.T) * s_v[:, None].astype(np.float64) * s_w[None, :]


def int4_threshold_reference(layer, kind: str, x: np.ndarray, input_thr: float, act_thr: float | None):
    """float64 threshold FFN over the int8 copies of the layer's 4-bit gate/up and down: x's entries at most
    ``input_thr`` zeroed, then a's at most ``act_thr`` (None: none); (y, a before its zeroing)."""
    n = layer.w_down.inputs
    h = w8a8_reference(np.where(np.abs(x) > input_thr, x, 0), int8_copy(layer.w_gate_up))
    up = h[:, -n:] + (0 if layer.b_up is None else np.asarray(layer.b_up, np.float64))
    a = np.maximum(up, 0) if kind == "relu" else h[:, :n] / (1 + np.exp(-h[:, :n])) * up
    a_kept = a if act_thr is None else np.where(np.abs(a) > act_thr, a, 0)
    y = w8a8_reference(a_kept, int8_copy(layer.w_down))
    return y + (0 if layer.b_down is None else np.asarray(layer.b_down, np.float64)), a


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_int4_threshold_ffn_equals_the_zeroed_reference_over_int8_copies(kind, tokens):
    """Both kinds on: the layout holds the int8 copies of the dequantized 4-bit gate/up and down (exactly the
    reference's integers and scales) and computes the float64 reference that zeroes the same entries. The
    thresholds sit in gaps of the scores and every quantized value lies > 8 u * 127 from a rounding boundary
    (test_int8.rounding_margin), so both sides keep and round alike: the same integer sums, float parts within
    KERNEL_RTOL / KERNEL_ATOL (tolerances.py)."""
    engine = int4_engine(kind)
    layer = engine.weights.layers[1]
    assert isinstance(layer.w_gate_up, Q4Matrix) and isinstance(layer.w_down, Q4Matrix)
    x = np.random.default_rng(tokens).standard_normal((tokens, engine.cfg.d_model)).astype(np.float32)
    input_thr = float(thresholds_in_gaps([np.abs(x)], 0.3)[0])
    _, a = int4_threshold_reference(layer, kind, x, input_thr, None)
    act_thr = float(thresholds_in_gaps([np.abs(a)[a != 0]], 0.5)[0])
    expected, _ = int4_threshold_reference(layer, kind, x, input_thr, act_thr)
    x_kept, a_kept = np.where(np.abs(x) > input_thr, x, 0), np.where(np.abs(a) > act_thr, a, 0)
    assert min(rounding_margin(x_kept), rounding_margin(a_kept)) > 8 * U * 127
    ffn = threshold_layout.from_layer(layer, kind, input_threshold=input_thr, activation_threshold=act_thr)
    for got, matrix in ((ffn.gate_up, layer.w_gate_up), (ffn.down, layer.w_down)):
        want = int8_copy(matrix)
        assert isinstance(got, Int8Matrix) and got.scale_axis == 1  # input-major / neuron-major, one scale per output
        np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want.values).T)
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    for backend in ROWS_BACKENDS:
        y, kept = threshold_ffn(ffn, jnp.asarray(x), backend=backend)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL, err_msg=backend)
        np.testing.assert_array_equal(np.asarray(kept["neurons"]), (np.abs(a) > act_thr).sum(-1))
        np.testing.assert_array_equal(np.asarray(kept["inputs"]), (np.abs(x) > input_thr).sum(-1))


def test_int4_threshold_layout_keeps_a_matrix_it_reads_densely_4bit():
    """Activation sparsity alone reads only down by rows: gate/up stays the layer's 4-bit matrix (its product the
    decoder's W4A8 one), so the layout's FFN equals the decoder's FFN with down's int8 copy and a zeroed."""
    engine = int4_engine("swiglu")
    layer = engine.weights.layers[0]
    ffn = threshold_layout.from_layer(layer, "swiglu", input_threshold=None, activation_threshold=0.0)
    assert ffn.gate_up is layer.w_gate_up and isinstance(ffn.down, Int8Matrix)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, engine.cfg.d_model)), jnp.float32)
    copy = dataclasses.replace(layer, w_down=int8_copy(layer.w_down))
    # zero threshold: every non-zero activation kept, the same products in the same order as the dense FFN
    expected = np.asarray(transformer.ffn_dense(copy, x, engine.cfg))
    np.testing.assert_allclose(np.asarray(threshold_ffn(ffn, x)[0]), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def int8_copies_engine(engine: jpinfer.Engine) -> jpinfer.Engine:
    """The dense engine of ``engine``'s int4 model with every FFN matrix replaced by its int8 copy."""
    layers = [dataclasses.replace(layer, w_gate_up=int8_copy(layer.w_gate_up), w_down=int8_copy(layer.w_down))
              for layer in engine.weights.layers]
    return jpinfer.Engine(dataclasses.replace(engine.model, weights=dataclasses.replace(engine.weights, layers=layers)))


def test_int4_threshold_engine_at_zero_thresholds_decodes_like_the_int8_copies():
    """Zero thresholds skip nothing: the threshold engine of an int4 model is the dense decoder over the int8 copies
    (the same W8A8 integers; logits within KERNEL tolerances as in test_int8), and positive thresholds decode."""
    engine = int4_engine("swiglu")
    copies = int8_copies_engine(engine)
    threshold = build_engine(engine.model, "threshold", thresholds=given(engine.cfg, 0.0, 0.0))
    assert_decodes_like(threshold, copies, 16, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    sparse = build_engine(engine.model, "threshold", thresholds=given(engine.cfg, 0.05, 0.1))
    assert len(sparse.generate(PROMPT, GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids) == 16
