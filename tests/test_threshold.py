"""The training-free threshold mode: the input-sparse row product, the threshold FFN against float64 numpy
references that zero the same entries, the engine against dense at zero thresholds, calibration, storage in
the profile and the mode's arguments. Tolerances: tests/tolerances.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import PROMPT, all_active, forced_logits

import jpinfer
from jpinfer import GenerationConfig, JpinferError
from jpinfer.models import transformer
from jpinfer.modes import build_engine
from jpinfer.profiler import (
    ActivationProfile,
    ProfileError,
    SparsityTargets,
    SparsityThresholds,
    calibrate_sparsity,
    profile,
)
from jpinfer.profiler import calibration as calibration_module
from jpinfer.runtime.engine import FfnStrategy
from jpinfer.sparse import ROWS_BACKENDS, sparse_rows_product, threshold_ffn, threshold_layout

from activation_reference import activation64
from profiler_fixtures import GEMMA2_LIKE, ffn_inputs, reference_window_losses, thresholds_in_gaps, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL, SPARSITY_ATOL, U32

BACKENDS = [b for b in ROWS_BACKENDS if b != "auto"] + ["auto"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def windows(n=4, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, 40, (n, t)).astype(np.int32)


def given(cfg, activation=None, input=None) -> SparsityThresholds:
    full = lambda v: None if v is None else np.broadcast_to(np.asarray(v, np.float32), (cfg.n_layers,)).copy()
    return SparsityThresholds(full(activation), full(input), {}, {}, "given")


# ----- the row product

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["some", "padded", "empty list", "count 0", "full", "one", "tokens", "bf16"])
def test_rows_product_equals_float64(backend, case):
    rng = np.random.default_rng(len(case))
    n, m, t = 70, 48, 3 if case == "tokens" else 1
    matrix = rng.standard_normal((n, m)).astype(np.float32)
    x = rng.standard_normal((t, n)).astype(np.float32)
    ids = rng.permutation(n)[:40].astype(np.int32)
    count = {"some": 40, "padded": 23, "empty list": 0, "count 0": 0, "full": n, "one": 1, "tokens": 17,
             "bf16": 31}[case]
    if case == "full":
        ids = rng.permutation(n).astype(np.int32)
    if case == "empty list":
        ids = ids[:0]
    if case == "padded":
        ids[count:] = 10**6  # padding may hold any value: clamped, never read into the result
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    if case == "bf16":  # the reference reads the same bf16 values in float64
        matrix = np.asarray(jnp.asarray(matrix, dtype).astype(jnp.float32))
        x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    got = sparse_rows_product(jnp.asarray(matrix, dtype), jnp.asarray(x, dtype), jnp.asarray(ids), count,
                              backend=backend)
    keep = ids[:count]
    expected = x[:, keep].astype(np.float64) @ matrix[keep].astype(np.float64)
    assert got.shape == (t, m) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    if count:  # a missing row would be caught: each moves the result by ~1
        assert np.abs(expected - x[:, keep[1:]].astype(np.float64) @ matrix[keep[1:]]).max() > 100 * KERNEL_ATOL


def test_rows_product_rejects_bad_shapes_and_backends():
    m, x, ids = jnp.zeros((4, 3)), jnp.zeros((1, 4)), jnp.arange(2)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_rows_product(m, x, ids, 1, backend="pallas")
    with pytest.raises(ValueError, match=r"need matrix \(n, m\) and x \(T, n\)"):
        sparse_rows_product(m, jnp.zeros((1, 5)), ids, 1)
    with pytest.raises(ValueError, match="1-D integer"):
        sparse_rows_product(m, x, jnp.zeros(2), 1)


# ----- one layer against numpy

def numpy_threshold_ffn(layer, kind, x, input_thr, act_thr):
    """float64: the FFN with inputs |x_j| <= input_thr and activations |a_i| <= act_thr zeroed (None: kept)."""
    w = lambda v: None if v is None else np.asarray(v, np.float64)
    x = np.asarray(x, np.float64)
    if input_thr is not None:
        x = np.where(np.abs(x) > input_thr, x, 0.0)
    h = x @ w(layer.w_gate_up).T
    n = layer.w_down.shape[1]
    up = h[:, -n:] + (0 if layer.b_up is None else w(layer.b_up))
    a = activation64(kind, h[:, :n], up)
    if act_thr is not None:
        a = np.where(np.abs(a) > act_thr, a, 0.0)
    return a @ w(layer.w_down).T + (0 if layer.b_down is None else w(layer.b_down))


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "relu", "drelu", "gelu"])
@pytest.mark.parametrize("kinds", ["activation", "input", "both"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_threshold_ffn_equals_numpy_zeroing_the_same_entries(kind, kinds, tokens):
    engine = tiny_engine(kind)
    layer = engine.weights.layers[1]
    x = ffn_inputs(engine, windows(2, 16, seed=2))[1][:tokens]
    # thresholds in wide gaps of the float64 values (thresholds_in_gaps), so float32 rounding keeps the same entries
    input_thr = float(thresholds_in_gaps([np.abs(x)], 0.4)[0]) if kinds != "activation" else None
    ref_a = np.asarray(transformer.ffn_activations(layer, jnp.asarray(
        np.where(np.abs(x) > (input_thr or -1), x, 0), jnp.float32), engine.cfg), np.float64)
    nonzero = np.abs(ref_a)[ref_a != 0]  # ReLU kinds: about half are exact zeros, which any threshold skips
    act_thr = float(thresholds_in_gaps([nonzero], 0.5)[0]) if kinds != "input" else None
    ffn = threshold_layout.from_layer(layer, kind, input_threshold=input_thr, activation_threshold=act_thr)
    expected = numpy_threshold_ffn(layer, kind, x, input_thr, act_thr)
    for backend in BACKENDS:
        y, kept = threshold_ffn(ffn, jnp.asarray(x, jnp.float32), backend=backend)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    dense = numpy_threshold_ffn(layer, kind, x, None, None)
    assert np.abs(expected - dense).max() > 100 * KERNEL_ATOL  # the zeroing matters
    n_inputs = (np.abs(x) > input_thr).sum(-1) if input_thr is not None else np.full(tokens, x.shape[1])
    np.testing.assert_array_equal(np.asarray(kept["inputs"]), n_inputs)
    n_neurons = (np.abs(ref_a) > act_thr).sum(-1) if act_thr is not None else np.full(tokens, ref_a.shape[1])
    np.testing.assert_array_equal(np.asarray(kept["neurons"]), n_neurons)


@pytest.mark.parametrize("kinds", ["activation", "input", "both"])
def test_nothing_kept_leaves_only_the_bias(kinds):
    engine = tiny_engine("relu")  # OPT-like: has b_up and b_down
    layer = engine.weights.layers[0]
    huge = 1e30
    ffn = threshold_layout.from_layer(layer, "relu", input_threshold=huge if kinds != "activation" else None,
                               activation_threshold=huge if kinds != "input" else None)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32)), jnp.float32)
    y, kept = threshold_ffn(ffn, x)
    expected = numpy_threshold_ffn(layer, "relu", np.asarray(x), huge if kinds != "activation" else None,
                                   huge if kinds != "input" else None)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    if kinds != "input":
        np.testing.assert_allclose(np.asarray(y)[0], np.asarray(layer.b_down), rtol=0, atol=0)
        assert int(kept["neurons"][0]) == 0


def test_layout_replaces_the_matrices_it_reads_sparsely():
    engine = tiny_engine("swiglu")
    layer = engine.weights.layers[0]
    both = threshold_layout.from_layer(layer, "swiglu", input_threshold=0.1, activation_threshold=0.1)
    assert both.gate_up.shape == (32, 96) and both.down.shape == (48, 32)  # input-major, neuron-major
    off = threshold_layout.from_layer(layer, "swiglu", input_threshold=None, activation_threshold=None)
    assert off.gate_up.shape == (96, 32) and off.down.shape == (32, 48)  # the decoder's (out, in)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite number >= 0"):
            threshold_layout.from_layer(layer, "swiglu", input_threshold=bad, activation_threshold=None)


# ----- the engine

def assert_decodes_alike(engine, reference, n_tokens: int, n_forced: int) -> None:
    """The same greedy tokens, and teacher-forced logits within DECODER_ATOL (the same values summed in
    another order)."""
    config = GenerationConfig(max_new_tokens=n_tokens)
    tokens = reference.generate(PROMPT, config).token_ids
    assert engine.generate(PROMPT, config).token_ids == tokens
    forced = tokens[:n_forced]
    np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), forced_logits(reference, PROMPT, forced),
                               rtol=0, atol=DECODER_ATOL)


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
@pytest.mark.parametrize("kinds", ["activation", "input", "both"])
def test_zero_thresholds_decode_like_dense(kind, kinds):
    """Threshold 0 keeps every non-zero entry: the sparse path computes the dense FFN, summed in another order."""
    dense = tiny_engine(kind)
    thresholds = given(dense.cfg, 0.0 if kinds != "input" else None, 0.0 if kinds != "activation" else None)
    assert_decodes_alike(build_engine(dense.model, "threshold", thresholds=thresholds), dense, 32, 12)


@dataclasses.dataclass(frozen=True)
class ZeroedReference:
    """The dense FFN with the same entries zeroed, written apart from sparse/threshold_layout.py: masks on x, then on
    a, then the decoder's own (out, in) products. Aux: the smallest relative distance of any magnitude to its
    threshold (a setup check: float32 paths that differ by rounding must keep the same entries)."""

    cfg: object

    def __call__(self, i, layer, x, state):
        input_thr, act_thr = state
        x = jnp.where(jnp.abs(x) > input_thr, x, 0)
        a = transformer.ffn_activations(layer, x, self.cfg)
        margin = jnp.minimum(jnp.min(jnp.abs(jnp.abs(x) / input_thr - 1)), jnp.min(jnp.abs(jnp.abs(a) / act_thr - 1)))
        return transformer.ffn_down(layer, jnp.where(jnp.abs(a) > act_thr, a, 0)), margin


def test_given_thresholds_decode_like_the_zeroed_reference():
    dense = tiny_engine("swiglu")
    cfg = dense.cfg
    x = ffn_inputs(dense, windows(2, 16, seed=4))
    input_thr = thresholds_in_gaps([np.abs(v) for v in x], 0.3)
    act_thr = thresholds_in_gaps([np.abs(np.asarray(transformer.ffn_activations(layer, jnp.asarray(v, jnp.float32),
                                                                                  cfg))) for layer, v in
                                  zip(dense.weights.layers, x)], 0.5)
    engine = build_engine(dense.model, "threshold", thresholds=SparsityThresholds(act_thr, input_thr, {}, {}, "given"))
    state = [(jnp.float32(i), jnp.float32(a)) for i, a in zip(input_thr, act_thr)]
    reference = dense.with_ffn(FfnStrategy(ZeroedReference(cfg), state, "zeroed reference"))
    forced = [4, 8, 15, 16, 23, 2 % 40, 7, 3]
    expected = forced_logits(reference, PROMPT, forced)
    assert np.abs(expected - forced_logits(dense, PROMPT, forced)).max() > 100 * DECODER_ATOL  # the zeroing matters
    np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)
    config = GenerationConfig(max_new_tokens=24)
    assert engine.generate(PROMPT, config).token_ids == reference.generate(PROMPT, config).token_ids
    # every magnitude the reference met while scoring the prompt and forced tokens sits >= 1e-4 (relative) from its
    # threshold, ~1000x float32's rounding of these values: the two paths cannot keep different entries
    tokens = np.asarray([PROMPT + forced], np.int32)
    cache = transformer.KVCache.create(cfg, 1, tokens.shape[1])
    _, _, aux = jax.jit(transformer.forward, static_argnames=("cfg", "ffn_impl"))(
        dense.weights, jnp.asarray(tokens), cache, cfg, ZeroedReference(cfg), state)
    assert min(float(m) for m in aux) > 1e-4


def test_prefill_masks_each_token_like_decoding():
    """Several tokens at once (dense products with the entries zeroed) equal one token at a time."""
    dense = tiny_engine("swiglu")
    x = ffn_inputs(dense, windows(1, 16, seed=5))[0]
    ffn = threshold_layout.from_layer(dense.weights.layers[0], "swiglu", input_threshold=0.3, activation_threshold=0.02)
    together, kept = threshold_ffn(ffn, jnp.asarray(x, jnp.float32))
    one_by_one = [threshold_ffn(ffn, jnp.asarray(x[t : t + 1], jnp.float32)) for t in range(len(x))]
    np.testing.assert_allclose(np.asarray(together), np.concatenate([np.asarray(y) for y, _ in one_by_one]),
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    np.testing.assert_array_equal(np.asarray(kept["inputs"]), [int(k["inputs"][0]) for _, k in one_by_one])


# ----- calibration and storage

@pytest.mark.parametrize("target", [0.3, 0.6])
def test_uniform_calibration_skips_the_target_fraction_of_both_kinds(target):
    dense = tiny_engine("swiglu")
    tokens = windows(8, 32, seed=3)
    th = calibrate_sparsity(dense, tokens, activation=target, input=target)
    assert th.method == "uniform" and th.target == {"activation": target, "input": target}
    xs = ffn_inputs(dense, tokens)
    for layer, (lw, x) in enumerate(zip(dense.weights.layers, xs)):
        a = np.asarray(transformer.ffn_activations(lw, jnp.asarray(x, jnp.float32), dense.cfg))
        assert (np.abs(x) <= th.input[layer]).mean() == pytest.approx(target, abs=SPARSITY_ATOL)
        assert (np.abs(a) <= th.activation[layer]).mean() == pytest.approx(target, abs=SPARSITY_ATOL)


def test_greedy_calibration_averages_the_target_per_kind():
    dense = tiny_engine("swiglu", n_layers=3)
    th = calibrate_sparsity(dense, windows(2, 16, seed=6), activation=0.5, input=0.4, method="greedy",
                            heldout=windows(2, 16, seed=7))
    for kind, target in (("activation", 0.5), ("input", 0.4)):
        assert th.layer_sparsity[kind].mean() == pytest.approx(target)  # float64 sums of levels, ~1e-16
    assert th.activation is not None and th.input is not None
    with pytest.raises(ValueError, match="heldout"):
        calibrate_sparsity(dense, windows(), input=0.4, method="greedy")
    with pytest.raises(ValueError, match="0 <= s < 1"):
        calibrate_sparsity(dense, windows(), input=1.0)
    with pytest.raises(ValueError, match="activation=, input=, attention= and/or head="):
        calibrate_sparsity(dense, windows())
    with pytest.raises(ValueError, match="activation=0.0"):
        calibrate_sparsity(tiny_engine("relu"), windows(), activation=0.5)


def test_input_sensitivity_is_the_derivative_of_the_window_loss():
    """For input sparsity, dL_w/dlambda (removing lambda times the sub-threshold FFN inputs) from one float32
    backward pass equals a float64 central difference of a numpy forward (profiler_fixtures)."""
    engine, tokens = tiny_engine("swiglu", n_layers=2), windows(2, 12, seed=5)
    cfg = engine.cfg
    _, xs = reference_window_losses(engine, tokens, 0, 0.0, 0.0, on="input")
    thr = np.stack([np.zeros(cfg.n_layers), thresholds_in_gaps(xs, 0.5)], 1)
    got = np.asarray(calibration_module._window_derivatives(
        engine.weights, jnp.asarray(tokens), jnp.ones(2, bool), jnp.asarray(thr), cfg, calibration_module.INPUT))
    np.testing.assert_array_equal(got[:, :, 0], 0.0)  # level 0 removes nothing: exact
    eps = 1e-3  # float64 central difference: rounding ~1e-16 * 50 / eps, truncation ~eps^2: both < 1e-6
    fd = np.zeros(got.shape[:2])
    for layer in range(cfg.n_layers):
        plus, minus = (reference_window_losses(engine, tokens, layer, s * eps, thr[layer, 1], on="input")[0]
                       for s in (1, -1))
        fd[:, layer] = (plus - minus) / (2 * eps)

    @dataclasses.dataclass(frozen=True)
    class ScaledInput:
        def __call__(self, i, layer, x, lam):  # lam per token and input dimension of this layer
            return transformer.ffn_dense(layer, x - lam * jnp.where(jnp.abs(x) <= thr[i, 1], x, 0), cfg), None

    @jax.jit  # one program, as in test_profiler.py (op by op, jax.grad below compiled ~200 small programs)
    def window_losses(lam):
        cache = transformer.KVCache.create(cfg, 2, tokens.shape[1])
        h, _, _ = transformer.forward(engine.weights, jnp.asarray(tokens), cache, cfg, ScaledInput(), list(lam))
        lg = transformer.logits(engine.weights, h[:, :-1], cfg)
        return (jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]).sum()

    # The derivative is a float32 sum over (token, dimension) of the terms x_tj * dL/dx_tj; scale = sum |term| per
    # window and layer (the gradient of the float32 loss w.r.t. a per-term lambda). Each term carries the roundings
    # of a forward and a backward pass (~600 each for 2 layers and the head: test_profiler.py counts ~250 a layer),
    # the sum over T * d = 384 terms one each: |got - exact| <= (2 * 600 + 384) * U32 * scale (first order).
    terms = jax.grad(window_losses)(jnp.zeros((cfg.n_layers, *tokens.shape, cfg.d_model)))
    scale = np.abs(np.asarray(terms, np.float64)).sum((2, 3)).T
    tol = (2 * 600 + tokens.shape[1] * cfg.d_model) * U32 * scale
    np.testing.assert_array_less(np.abs(got[:, :, 1] - fd), tol)
    assert np.all(np.abs(fd) > tol)  # the check has teeth: a zero derivative would fail it
    assert np.all(np.abs(np.roll(fd, 1, 1) - fd) > tol)  # and so would another layer's


def test_thresholds_round_trip_through_the_profile_and_load_the_mode(tmp_path):
    dense = tiny_engine("swiglu")
    prof = profile(dense, windows(), progress=False)
    with pytest.raises(ProfileError, match="no threshold-mode thresholds"):
        prof.sparsity_thresholds()
    th = calibrate_sparsity(dense, windows(4, 16, seed=9), activation=0.4, input=0.2)
    path = prof.with_sparsity_thresholds(th).save(tmp_path / "prof.npz")
    back = ActivationProfile.load(path, dense).sparsity_thresholds()
    np.testing.assert_array_equal(back.activation, th.activation)  # float32 through JSON: exact
    np.testing.assert_array_equal(back.input, th.input)
    assert (back.target == th.target and back.method == "uniform"
            and back.describe() == "activation 40% + input 20% (uniform)")
    from_profile = build_engine(dense.model, "threshold", profile=ActivationProfile.load(path, dense))
    direct = build_engine(dense.model, "threshold", thresholds=th)
    config = GenerationConfig(max_new_tokens=16)
    assert from_profile.generate(PROMPT, config).token_ids == direct.generate(PROMPT, config).token_ids
    with pytest.raises(ValueError, match="for 3 layers"):
        prof.with_sparsity_thresholds(given(tiny_engine("swiglu", n_layers=3).cfg, 0.1))


def test_profile_calibrates_the_threshold_mode_like_calibrate_sparsity():
    """profile(targets=SparsityTargets(activation=, input=)) calibrates on its calibration windows (here all of them)
    from the histogram pass it takes for its own thresholds: the same thresholds as calibrate_sparsity there.
    mode="hybrid" then reads them with thresholds="profile"."""
    dense = tiny_engine("swiglu")
    tokens = windows(4, 16, seed=9)
    prof = profile(dense, tokens, targets=SparsityTargets(activation=0.4, input=0.2), progress=False)
    expected = calibrate_sparsity(dense, tokens, activation=0.4, input=0.2)
    np.testing.assert_array_equal(prof.sparsity_thresholds().activation, expected.activation)
    np.testing.assert_array_equal(prof.sparsity_thresholds().input, expected.input)
    two = build_engine(dense.model, "hybrid", thresholds="profile", profile=prof,
                       placement=[np.random.default_rng(1).random(48) < 0.5] * 2)
    assert_decodes_alike(two, build_engine(dense.model, "threshold", thresholds=expected), 16, 8)
    with pytest.raises(ValueError, match="greedy allocation holds out"):
        profile(dense, tokens, targets=SparsityTargets(input=0.2, allocation="greedy"), progress=False)


def test_bad_threshold_mode_arguments_are_clear_errors():
    dense = tiny_engine("swiglu")
    with pytest.raises(JpinferError, match="threshold sparsity needs thresholds"):
        build_engine(dense.model, "threshold")
    with pytest.raises(JpinferError, match="needs no predictors"):
        build_engine(dense.model, "threshold", predictors=all_active(dense), thresholds=given(dense.cfg, 0.1))
    with pytest.raises(JpinferError, match="chooses neurons with predictors"):
        build_engine(dense.model, "sparse", predictors=all_active(dense), thresholds=given(dense.cfg, 0.1))
    with pytest.raises(JpinferError, match="threshold sparsity needs thresholds"):
        jpinfer.load("/nonexistent/m.gguf", mode="threshold")  # before any model loads (the default model has a pack)
    with pytest.raises(JpinferError, match="needs a placement"):
        build_engine(dense.model, "hybrid", thresholds=given(dense.cfg, 0.1))
    with pytest.raises(JpinferError, match="for 3 layers"):
        build_engine(dense.model, "threshold", thresholds=given(tiny_engine("swiglu", n_layers=3).cfg, 0.1))
    with pytest.raises(ValueError, match="at least one kind"):
        SparsityThresholds(None, None, {}, {}, "given")
    with pytest.raises(ValueError, match="finite and >= 0"):
        given(dense.cfg, -1.0)
    with pytest.raises(jpinfer.profiler.ProfileMismatchError):
        other = tiny_engine("swiglu", seed=1)
        prof = profile(other, windows(), progress=False).with_sparsity_thresholds(given(dense.cfg, 0.1))
        build_engine(dense.model, "threshold", profile=prof)


@pytest.mark.parametrize("kinds", [*(pytest.param(kinds, marks=pytest.mark.slow)  # each alone: "both" runs the two
                                      for kinds in ("activation", "input")), "both", "model-wide"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_hybrid_threshold_on_two_devices_equals_one_device(kinds, arch):
    """Hot neurons on device 0, cold on device 1, each part applying the thresholds: the parts add up to the
    one-device threshold FFN (a layer wholly hot, one wholly cold, and a split one); model-wide, the attention and the
    head on device 0 apply their own. gemma2: a GeGLU model whose layers normalise their FFN's output (the two parts'
    sum), with a window in one layer."""
    dense = tiny_engine("swiglu", n_layers=3) if arch == "llama" else tiny_engine("geglu", n_layers=3, **GEMMA2_LIKE)
    cfg = dense.cfg
    th = calibrate_sparsity(dense, windows(4, 16, seed=8), activation=0.5 if kinds != "input" else None,
                            input=0.3 if kinds != "activation" else None,
                            **(dict(attention=0.3, head=0.3) if kinds == "model-wide" else {}))
    one = build_engine(dense.model, "threshold", thresholds=th)
    masks = [np.ones(cfg.d_ff, bool), np.zeros(cfg.d_ff, bool), np.random.default_rng(2).random(cfg.d_ff) < 0.5]
    two = build_engine(dense.model, "hybrid", thresholds=th, placement=masks)
    assert two.ffn.impl.cold[2].d_ff + two.ffn.state[2].hot.d_ff == cfg.d_ff
    assert all((layer.w_qkv is None) == (kinds == "model-wide") for layer in two.weights.layers)
    assert two.ffn.impl.head_threshold == one.ffn.impl.head_threshold == th.head  # None but model-wide
    assert_decodes_alike(two, one, 24, 10)
