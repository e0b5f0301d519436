"""int8 weights (W8A8): quantization against float64/numpy references written apart from quant/int8.py, the
integer products exactly, the rescaled products within their rounding and quantization error bounds, the
straight-through derivative, models loaded with weights='int8' (dense and threshold modes) and their errors.
Tolerances: tests/tolerances.py and the derivations next to each check."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import PROMPT, assert_decodes_like, forced_logits
from test_threshold import given, windows

import jpinfer
from jpinfer import GenerationConfig, JpinferError
from jpinfer.cache import CacheWarning
from jpinfer.models import loading, params, quantized, smoothquant, transformer
from jpinfer.modes import build_engine
from jpinfer.profiler import ProfileMismatchError, SparsityTargets, profile, smoothing
from jpinfer.quant import int8
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.sparse import ROWS_BACKENDS, sparse_rows_product, threshold_ffn, threshold_layout

import gguf_fixtures as fx
from profiler_fixtures import ffn_inputs, thresholds_in_gaps, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL, U32

BACKENDS = [b for b in ROWS_BACKENDS if b != "auto"] + ["auto"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def reference_quantize(w: np.ndarray, scale_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """float64: per output (entry of axis ``scale_axis``) s = max|w| / 127 stored as float32, q = round(w / s)."""
    w = np.asarray(w, np.float64)
    outputs = w if scale_axis == 0 else w.T
    scales = np.array([np.float32(np.abs(row).max() / 127) for row in outputs])
    q = np.stack([np.round(row / s) if s > 0 else np.zeros_like(row) for row, s in zip(outputs, scales)])
    return (q if scale_axis == 0 else q.T).astype(np.int64), scales


def reference_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy float32, per token: q = round(x * (127 / max|x|)) (0 for an all-zero token), scale max|x| / 127."""
    x = np.asarray(x, np.float32)
    qs, scales = [], []
    for row in x:
        peak = np.abs(row).max()
        inverse = np.float32(127) / peak if peak > 0 else np.float32(0)
        qs.append(np.round(row * inverse))
        scales.append(peak / np.float32(127))
    return np.array(qs, np.int64), np.array(scales, np.float32)


def random_matrix(shape, seed=0, zero_output=None, scale_axis=0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    w[:, ::7] *= 20  # a few outlier inputs, as in real models: the scale follows the largest weight
    if zero_output is not None:
        if scale_axis == 0:
            w[zero_output] = 0
        else:
            w[:, zero_output] = 0
    return w


# ----- quantization

@pytest.mark.parametrize("scale_axis", [0, 1])
def test_quantize_equals_the_float64_reference(scale_axis):
    w = random_matrix((37, 29), zero_output=3, scale_axis=scale_axis)
    m = int8.quantize(w, scale_axis)
    q, s = reference_quantize(w, scale_axis)
    assert m.values.dtype == jnp.int8 and m.scales.dtype == jnp.float32 and m.scale_axis == scale_axis
    np.testing.assert_array_equal(np.asarray(m.values), q)
    np.testing.assert_array_equal(np.asarray(m.scales), s)
    peaks = np.abs(q).max(axis=1 - scale_axis)
    assert peaks[3] == 0 and np.all(np.delete(peaks, 3) == 127)  # the grid is used to its end, never -128


@pytest.mark.parametrize("scale_axis", [0, 1])
def test_dequantize_round_trip(scale_axis):
    w = random_matrix((40, 24), seed=1, scale_axis=scale_axis)
    m = int8.quantize(w, scale_axis)
    back = np.asarray(int8.dequantize(m), np.float64)
    s = np.expand_dims(np.asarray(m.scales, np.float64), 1 - scale_axis)
    # |q s - w| <= s / 2 exactly; dequantize rounds q * s once (u |w| relative), w is float32 already
    assert np.all(np.abs(back - w) <= s / 2 + 2 * U32 * np.abs(w))
    again = int8.quantize(back.astype(np.float32), scale_axis)  # the dequantized matrix is on the grid
    np.testing.assert_array_equal(np.asarray(again.values), np.asarray(m.values))
    np.testing.assert_allclose(np.asarray(again.scales), np.asarray(m.scales), rtol=4 * U32, atol=0)
    t = m.T
    assert t.shape == m.shape[::-1] and t.scale_axis == 1 - scale_axis
    np.testing.assert_array_equal(np.asarray(int8.dequantize(t)), np.asarray(int8.dequantize(m)).T)


def test_take_keeps_the_scales_of_what_it_takes():
    m = int8.quantize(random_matrix((10, 6), seed=2))
    ids = np.array([7, 2, 5])
    rows, columns = m.take(ids, 0), m.take(ids % 6, 1)
    np.testing.assert_array_equal(np.asarray(int8.dequantize(rows)), np.asarray(int8.dequantize(m))[ids])
    np.testing.assert_array_equal(np.asarray(int8.dequantize(columns)), np.asarray(int8.dequantize(m))[:, ids % 6])


def test_quantize_tokens_equals_numpy():
    x = np.random.default_rng(3).standard_normal((6, 50)).astype(np.float32) * np.float32(3)
    x[2] = 0  # an all-zero token: q = 0, scale 0, no nan
    q, scales = int8.quantize_tokens(jnp.asarray(x))
    ref_q, ref_scales = reference_tokens(x)
    assert q.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(q), ref_q)
    np.testing.assert_array_equal(np.asarray(scales), ref_scales)


def test_bad_matrices_are_value_errors():
    with pytest.raises(ValueError, match="2-D matrix"):
        int8.quantize(np.zeros((2, 3, 4)))
    for bad in (np.nan, np.inf, -np.inf):  # anywhere in a line, whichever axis the scales run along
        for scale_axis in (0, 1):
            with pytest.raises(ValueError, match="inf or nan"):
                int8.quantize(np.array([[1.0, -2.0], [3.0, bad]]), scale_axis)
    with pytest.raises(ValueError, match="takes 5"):
        quantized.matmul(jnp.zeros((1, 4)), int8.quantize(np.ones((3, 5))))


# ----- products

@pytest.mark.parametrize("scale_axis", [0, 1])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_integer_product_is_exact(scale_axis, tokens):
    w = random_matrix((33, 70) if scale_axis == 0 else (70, 33), seed=4, scale_axis=scale_axis)
    m = int8.quantize(w, scale_axis)
    q = np.random.default_rng(5).integers(-127, 128, (tokens, 70)).astype(np.int8)
    got = int8.integer_product(jnp.asarray(q), m)
    values = np.asarray(m.values, np.int64)
    expected = q.astype(np.int64) @ (values.T if scale_axis == 0 else values)
    assert got.dtype == jnp.int32 and got.shape == (tokens, 33)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("scale_axis", [0, 1])
@pytest.mark.parametrize("tokens", [1, 3])
def test_matmul_within_rescaling_and_quantization_error(scale_axis, tokens):
    n_in, n_out = 64, 40
    w = random_matrix((n_out, n_in) if scale_axis == 0 else (n_in, n_out), seed=6, scale_axis=scale_axis)
    m = int8.quantize(w, scale_axis)
    x = np.random.default_rng(7).standard_normal((tokens, n_in)).astype(np.float32)
    got = np.asarray(quantized.matmul(jnp.asarray(x), m), np.float64)
    q_w, s_w = reference_quantize(w, scale_axis)
    w_out_in = q_w if scale_axis == 0 else q_w.T  # (out, in) integers
    q_x, s_x = reference_tokens(x)
    acc = q_x @ w_out_in.T  # exact
    same_integers = acc * s_x[:, None].astype(np.float64) * s_w[None, :].astype(np.float64)
    # the int32 -> float32 conversion (exact below 2^24: |acc| <= 127^2 * 64), the product of the two scales and
    # the product with it: three roundings of u each
    np.testing.assert_allclose(got, same_integers, rtol=3 * U32, atol=0)
    # against the float product W x: |w.x - w^.x^| <= sum |w - w^| |x| + sum |w^| |x - x^|, with |w - w^| <= s_w / 2
    # and |x - x^| <= s_x / 2 (each rounded to its grid)
    w_float = np.asarray(w, np.float64) if scale_axis == 0 else np.asarray(w, np.float64).T
    exact = x.astype(np.float64) @ w_float.T
    w_hat = w_out_in * s_w[:, None]
    bound = (s_w[None, :] / 2) * np.abs(x).sum(1, keepdims=True) + (s_x[:, None] / 2) * np.abs(w_hat).sum(1)[None]
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-6))
    assert np.abs(got - exact).max() > 0  # quantized, not float


def test_matmul_of_zeros_is_zero():
    m = int8.quantize(random_matrix((8, 16), seed=8))
    y = np.asarray(quantized.matmul(jnp.zeros((2, 16)), m))
    assert np.array_equal(y, np.zeros((2, 8)))


def test_matmul_derivative_is_straight_through():
    """Rounding has a zero derivative; the loss sensitivities (profiler.calibration) need the dequantized matrix's."""
    w = random_matrix((12, 20), seed=9)
    m = int8.quantize(w)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((3, 20)), jnp.float32)
    g = np.random.default_rng(11).standard_normal((3, 12))
    grad = jax.grad(lambda v: jnp.sum(quantized.matmul(v, m) * g))(x)
    expected = g @ np.asarray(int8.dequantize(m), np.float64)
    # float32 products of 12 terms of O(1) times weights of O(20): 12 u |terms| each, well inside 1e-5 (1 + |g|)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL * 20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_int8_rows_product_is_exact(backend, tokens):
    rng = np.random.default_rng(12)
    n, m = 70, 48
    matrix = rng.integers(-127, 128, (n, m)).astype(np.int8)
    x = rng.integers(-127, 128, (tokens, n)).astype(np.int8)
    ids = rng.permutation(n)[:40].astype(np.int32)
    ids[29:] = 10**6  # padding
    got = sparse_rows_product(jnp.asarray(matrix), jnp.asarray(x), jnp.asarray(ids), 29, backend=backend)
    keep = ids[:29]
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), x[:, keep].astype(np.int64) @ matrix[keep].astype(np.int64))


# ----- models

def int8_engine(kind: str) -> jpinfer.Engine:
    dense = tiny_engine(kind)
    model = dense.model
    return jpinfer.Engine(dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, "int8")))


def test_quantize_weights_quantizes_every_projection_and_the_head():
    dense = tiny_engine("swiglu")
    w = quantized.quantize_weights(dense.weights, "int8")
    layer, ref = w.layers[1], dense.weights.layers[1]
    for name in ("w_qkv", "wo", "w_gate_up", "w_down"):
        got = getattr(layer, name)
        assert isinstance(got, Int8Matrix) and got.scale_axis == 0
        np.testing.assert_array_equal(np.asarray(got.values), reference_quantize(getattr(ref, name), 0)[0])
        assert got.nbytes < getattr(ref, name).nbytes / 3
    np.testing.assert_array_equal(np.asarray(w.head.values), reference_quantize(np.asarray(dense.weights.head).T, 0)[0])
    assert w.dtype == jnp.float32 and quantized.weights_format(w) == "int8"
    assert quantized.weights_format(dense.weights) == "float"
    np.testing.assert_array_equal(np.asarray(w.embed), np.asarray(dense.weights.embed))  # untied: stays float
    with pytest.raises(ValueError, match="int8 already"):
        quantized.quantize_weights(w, "int8")


def test_tied_embedding_reads_the_int8_head_rows():
    cfg = dataclasses.replace(tiny_engine("swiglu").cfg, tie_embeddings=True)
    w = quantized.quantize_weights(params.build_weights(cfg, params.init_random(cfg)), "int8")
    assert w.embed is None  # tied: the input embedding is the head
    tokens = np.array([[0, 5, 39, 5]], np.int32)
    got = transformer.embed(w, jnp.asarray(tokens), jnp.arange(4), cfg)
    rows = np.asarray(int8.dequantize(w.head))[tokens[0]]
    np.testing.assert_array_equal(np.asarray(got)[0], rows)


def test_int8_model_follows_the_float_model():
    """A sanity bound, not a rounding bound: W8A8 moves each product by ~1% (quantization steps 1/127 of the
    peaks); over the tiny decoder's two layers the logits moved by 1.3% of their spread (measured), and the
    bound 5% catches a wrong scale or axis (which moves them by their whole spread)."""
    dense, int8_form = tiny_engine("swiglu"), int8_engine("swiglu")
    tokens = int8_form.generate(PROMPT, GenerationConfig(max_new_tokens=12)).token_ids
    assert len(tokens) == 12
    ref, got = forced_logits(dense, PROMPT, tokens), forced_logits(int8_form, PROMPT, tokens)
    spread = ref.max() - ref.min()
    assert np.abs(got - ref).max() < 0.05 * spread
    assert np.abs(got - ref).max() > 0


def test_load_int8_from_a_gguf_file(tmp_path):
    """load(weights='int8') = the float model, migrated with peaks of the bundled calibration text, quantized."""
    cfg = fx.tiny_config(tied=True)
    path = fx.write_gguf(tmp_path / "tiny.gguf", cfg, fx.random_tensors(cfg, seed=3))
    engine = jpinfer.load(path, weights="int8")
    assert quantized.weights_format(engine.weights) == "int8"
    model = loading.load_model(path)
    peaks = smoothing.channel_peaks(model, smoothing.calibration_windows(model.tokenizer))
    expected = quantized.quantize_weights(smoothquant.smooth(model.weights, peaks, smoothing.ALPHA), "int8")
    for got, want in zip(jax.tree.leaves(engine.weights), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert engine.weights.embed is not None  # the tied head was migrated: the embedding keeps the head as it was
    np.testing.assert_array_equal(np.asarray(engine.weights.embed), np.asarray(model.weights.head).T)
    result = engine.generate("hello world", GenerationConfig(max_new_tokens=5))
    assert len(result.token_ids) == 5


# ----- SmoothQuant's migration

def random_peaks(cfg, seed=0) -> smoothquant.ChannelPeaks:
    rng = np.random.default_rng(seed)
    peak = lambda *shape: np.exp(rng.standard_normal(shape))  # positive, spread over e^(+-2)
    return smoothquant.ChannelPeaks(peak(cfg.n_layers, cfg.d_model), peak(cfg.n_layers, cfg.d_model),
                             peak(cfg.n_layers, cfg.d_ff), peak(cfg.d_model))


def test_migration_scales_follow_the_formula():
    w = np.array([[1.0, -4.0, 0.0], [2.0, 0.5, 0.0]])
    peaks = np.array([9.0, 1.0, 3.0])
    s = smoothquant.migration_scales(peaks, w, 0.5)
    np.testing.assert_allclose(s, [np.sqrt(9.0) / np.sqrt(2.0), np.sqrt(1.0) / np.sqrt(4.0), 1.0], rtol=1e-15)
    assert smoothquant.migration_scales(np.zeros(3), w, 0.5).tolist() == [1.0, 1.0, 1.0]  # a channel that never fired
    with pytest.raises(ValueError, match="alpha must lie in"):
        smoothquant.smooth(tiny_engine("swiglu").weights, random_peaks(tiny_engine("swiglu").cfg), 1.5)


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
@pytest.mark.parametrize("tied", [False, True])
def test_migration_keeps_the_float_model(kind, tied):
    """Exact in real arithmetic: only float32 rounding of the rescaled weights and norms (a few u relative each,
    over the decoder's ~500 roundings) separates the logits, within DECODER_ATOL (tests/tolerances.py)."""
    dense = tiny_engine(kind)  # relu: OPT-like, with up and down biases
    cfg = dataclasses.replace(dense.cfg, tie_embeddings=tied)
    weights = params.build_weights(cfg, params.init_random(cfg, seed=1, scale=0.2))
    smoothed = smoothquant.smooth(weights, random_peaks(cfg), 0.6)
    tokens = jnp.asarray(windows(2, 12, seed=3))
    ref = np.asarray(transformer.score(weights, tokens, cfg))
    np.testing.assert_allclose(np.asarray(transformer.score(smoothed, tokens, cfg)), ref, rtol=0, atol=DECODER_ATOL)
    moved = np.abs(np.asarray(smoothed.layers[0].w_qkv) - np.asarray(weights.layers[0].w_qkv)).max()
    assert moved > 0.01  # the weights did change


def test_channel_peaks_equal_the_captured_inputs():
    engine = tiny_engine("swiglu")
    cfg, weights = engine.cfg, engine.weights
    tokens = windows(3, 16, seed=5)
    peaks = smoothing.channel_peaks(engine.model, tokens, batch_size=2)  # 3 windows: the last batch is padded
    xs = ffn_inputs(engine, tokens)
    for i, (layer, x) in enumerate(zip(weights.layers, xs)):
        np.testing.assert_allclose(peaks.ffn[i], np.abs(x).max(0), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
        a = np.asarray(transformer.ffn_activations(layer, jnp.asarray(x, jnp.float32), cfg))
        np.testing.assert_allclose(peaks.down[i], np.abs(a).max(0), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    e = np.asarray(weights.embed, np.float64)[tokens]  # layer 0's attention input: the normed embedding
    normed = e / np.sqrt((e * e).mean(-1, keepdims=True) + cfg.norm_eps) * np.asarray(weights.layers[0].attn_norm.scale)
    np.testing.assert_allclose(peaks.attention[0], np.abs(normed).max((0, 1)), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    cache = transformer.KVCache.create(cfg, 3, 16)
    h, _, _ = jax.jit(transformer.forward, static_argnames=("cfg",))(weights, jnp.asarray(tokens), cache, cfg)
    np.testing.assert_allclose(peaks.head, np.abs(np.asarray(h)).max((0, 1)), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    with pytest.raises(ValueError, match="float model"):
        smoothing.channel_peaks(int8_engine("swiglu").model, tokens)


def test_migration_cuts_the_int8_error_of_outlier_channels():
    """Channels 3 and 17 made 40x larger in every norm's output (as in real models): per-token int8 then rounds the
    other channels to a few levels; the migration (alpha 0.6: the outliers shrink 40^0.6 = 9x, their weight columns
    grow as much) brings the int8 logits closer to the float ones: the largest error fell to 0.59x (measured)."""
    dense = tiny_engine("swiglu")
    cfg, weights = dense.cfg, dense.weights
    boost = np.ones(cfg.d_model, np.float32)
    boost[[3, 17]] = 40
    loud = lambda norm: dataclasses.replace(norm, scale=norm.scale * boost)
    weights = dataclasses.replace(weights, layers=[dataclasses.replace(l, attn_norm=loud(l.attn_norm),
                                                                       ffn_norm=loud(l.ffn_norm))
                                                   for l in weights.layers])
    model = loading.LoadedModel(cfg, weights, dense.tokenizer, "loud")
    tokens = jnp.asarray(windows(2, 16, seed=6))
    ref = np.asarray(transformer.score(weights, tokens, cfg))
    error = lambda m: np.abs(np.asarray(transformer.score(m.weights, tokens, cfg)) - ref).max()
    plain = error(loading.LoadedModel(cfg, quantized.quantize_weights(weights, "int8"), None, "plain"))
    smoothed = error(smoothing.int8_model(model, windows(4, 16, seed=7)))
    assert smoothed < 0.75 * plain


def test_bad_weights_arguments_fail_before_loading():
    with pytest.raises(JpinferError, match="unknown weights format 'int2'; choose one of float, int8, int4"):
        jpinfer.load("/no/such/checkpoint", weights="int2")


# ----- the threshold mode in int8

def rounding_margin(v: np.ndarray) -> float:
    """The smallest distance of v * 127 / max|v| (per token) to a rounding boundary (a half-integer): a setup check
    that two float32 paths that round v differently quantize it to the same integers. Such paths differ by a few
    roundings of u relative, at most ~8 u * 127 = 6e-5 on the scaled value (<= 127)."""
    scaled = np.abs(np.asarray(v, np.float64)) * 127 / np.abs(v).max(-1, keepdims=True)
    return float(np.abs(scaled - np.floor(scaled) - 0.5).min())


def zeroed_int8_reference(layer, kind, cfg, x, input_thr, act_thr):
    """The int8 FFN with the skipped entries zeroed, written apart from sparse/threshold_layout.py: masks on x,
    then on a, then the decoder's own W8A8 products (int8.matmul, exact in its integers above)."""
    x = jnp.where(jnp.abs(x) > (input_thr if input_thr is not None else -1), x, 0)
    a = transformer.ffn_activations(layer, x, cfg)
    a_kept = jnp.where(jnp.abs(a) > (act_thr if act_thr is not None else -1), a, 0)
    return transformer.ffn_down(layer, a_kept), x, a


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
@pytest.mark.parametrize("kinds", ["activation", "input", "both"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_int8_threshold_ffn_equals_the_zeroed_int8_ffn(kind, kinds, tokens):
    engine = int8_engine(kind)
    layer = engine.weights.layers[1]
    x = ffn_inputs(tiny_engine(kind), windows(2, 16, seed=2))[1][:tokens]
    input_thr = float(thresholds_in_gaps([np.abs(x)], 0.4)[0]) if kinds != "activation" else None
    _, x_kept, a = zeroed_int8_reference(layer, kind, engine.cfg, jnp.asarray(x, jnp.float32), input_thr, None)
    a = np.asarray(a, np.float64)
    act_thr = float(thresholds_in_gaps([np.abs(a)[a != 0]], 0.5)[0]) if kinds != "input" else None
    expected, _, _ = zeroed_int8_reference(layer, kind, engine.cfg, jnp.asarray(x, jnp.float32), input_thr, act_thr)
    a_kept = np.where(np.abs(a) > (act_thr or -1), a, 0)
    assert min(rounding_margin(np.asarray(x_kept)), rounding_margin(a_kept)) > 8 * U32 * 127
    ffn = threshold_layout.from_layer(layer, kind, input_threshold=input_thr, activation_threshold=act_thr)
    assert isinstance(ffn.gate_up, Int8Matrix) and isinstance(ffn.down, Int8Matrix)
    for backend in BACKENDS:
        y, kept = threshold_ffn(ffn, jnp.asarray(x, jnp.float32), backend=backend)
        # the same integers (test_int8_rows_product_is_exact); the float parts round alike
        np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    n_neurons = (np.abs(a) > act_thr).sum(-1) if act_thr is not None else np.full(tokens, a.shape[1])
    np.testing.assert_array_equal(np.asarray(kept["neurons"]), n_neurons)


def test_int8_threshold_engine_at_zero_thresholds_decodes_like_int8_dense():
    dense = int8_engine("swiglu")
    engine = build_engine(dense.model, "threshold", thresholds=given(dense.cfg, 0.0, 0.0))
    assert_decodes_like(engine, dense, 24, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_the_int8_model_is_profiled_on_its_own():
    """The threshold mode's thresholds compare the int8 model's own activations (the migration rescales them),
    so a float model's profile is refused with the command that makes the right one."""
    dense, int8_form = tiny_engine("swiglu"), int8_engine("swiglu")
    tokens = windows(4, 16, seed=8)
    with pytest.raises(ProfileMismatchError, match=r"differs in weights format float there, int8 here: make one for "
                                                   r"this model \(jpinfer profile --out PATH --model tiny-swiglu "
                                                   r"--weights int8\)"):
        build_engine(int8_form.model, "threshold",
                     profile=profile(dense, tokens, targets=SparsityTargets(activation=0.4), progress=False))
    prof = profile(int8_form, tokens, targets=SparsityTargets(activation=0.4), progress=False)
    engine = build_engine(int8_form.model, "threshold", profile=prof)
    assert engine.stepper.name == "threshold"
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=6)).token_ids


def test_calibration_peaks_are_cached(tmp_path, monkeypatch):
    """Keyed by the weights and the token windows; a damaged entry is reported, removed and recomputed."""
    engine = tiny_engine("swiglu")
    tokens = windows(4, 16, seed=9)
    real, calls = smoothing.channel_peaks, []
    monkeypatch.setattr(smoothing, "channel_peaks", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = smoothing.cached_channel_peaks(engine.model, tokens)
    root = tmp_path / "cache" / "int8"
    (entry,) = root.iterdir()
    again = smoothing.cached_channel_peaks(engine.model, tokens)
    assert len(calls) == 1  # served from the cache
    for field in ("attention", "ffn", "down", "head"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    smoothing.cached_channel_peaks(engine.model, windows(4, 16, seed=10))  # other text: its own entry
    smoothing.cached_channel_peaks(tiny_engine("swiglu", seed=1).model, tokens)  # other weights: too
    assert len(calls) == 3 and len(list(root.iterdir())) == 3
    entry.write_bytes(b"not an npz")
    with pytest.warns(CacheWarning, match="removing it and calibrating again"):
        rebuilt = smoothing.cached_channel_peaks(engine.model, tokens)
    assert len(calls) == 4
    np.testing.assert_array_equal(rebuilt.down, first.down)


def test_concatenate_stacks_rows_with_their_scales():
    """Rows are quantized independently, so stacking quantized parts equals quantizing the stacked floats."""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal((3, 16)).astype(np.float32)
    got = int8.concatenate([int8.quantize(a), int8.quantize(b)])
    want = int8.quantize(np.concatenate([a, b]))
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    with pytest.raises(ValueError, match="one scale per row"):
        int8.concatenate([int8.quantize(a), int8.quantize(a.T, scale_axis=1)])
