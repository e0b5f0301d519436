"""Mixtral-style experts as neurons of one FFN: the router and the routed activations against a float64 numpy
mixture of experts written from Mixtral's definition (each picked expert's FFN output times its renormalized
router weight), the threshold mode within experts, the sparse op over listed neurons of experts (the predictor
modes' FFN), SmoothQuant's migration and calibration on a model with experts. The sparse and hybrid modes decode
a model with experts like dense: tests/test_modes.py (float) and tests/test_sparse_int8.py (int8). Parity with
transformers' Mixtral: tests/test_transformer_parity.py and tests/test_gguf.py. Tolerances: tests/tolerances.py."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_int8 import random_peaks
from test_modes import all_active, half_masks
from test_threshold import BACKENDS, assert_decodes_alike, windows

from jpinfer.models import params, smoothquant, transformer
from jpinfer.modes import build_engine
from jpinfer.predictor import routed_logits
from jpinfer.profiler import SparsityThresholds, calibrate_sparsity
from jpinfer.sparse import all_rows_ffn, neurons, sparse_ffn, threshold_ffn, threshold_layout

from profiler_fixtures import thresholds_in_gaps, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL, SPARSITY_ATOL

MOE = dict(n_experts=4, experts_per_token=2)  # tiny_engine's d_ff 48: 4 experts of 12 neurons, the top 2 per token


def numpy_moe(layer, x: np.ndarray, cfg, input_threshold: float = -1.0, activation_threshold: float = -1.0):
    """float64 Mixtral FFN of tokens x (T, d): per token the router's softmax, its top experts_per_token weights
    renormalized, each picked expert's SwiGLU output times its weight. With thresholds, the threshold mode's
    skipping: gate and up read the inputs with |x_j| over the input threshold (the router reads them all), and a
    neuron contributes when its routed activation |w_e a_i| is over the activation threshold. Also returns the
    routed activations (T, d_ff), zero for the experts not picked."""
    x = np.asarray(x, np.float64)
    router = np.asarray(layer.router, np.float64)
    w_gate_up, w_down = np.asarray(layer.w_gate_up, np.float64), np.asarray(layer.w_down, np.float64)
    f, n = cfg.expert_size, cfg.d_ff
    ys, routed = [], np.zeros((len(x), n))
    for t, xt in enumerate(x):
        scores = router @ xt
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[: cfg.experts_per_token]
        xs = np.where(np.abs(xt) > input_threshold, xt, 0.0)
        y = np.zeros(cfg.d_model)
        for e in top:
            gate, up = w_gate_up[e * f:(e + 1) * f] @ xs, w_gate_up[n + e * f:n + (e + 1) * f] @ xs
            a = probs[e] / probs[top].sum() * gate / (1 + np.exp(-gate)) * up
            routed[t, e * f:(e + 1) * f] = a
            y += w_down[:, e * f:(e + 1) * f] @ np.where(np.abs(a) > activation_threshold, a, 0.0)
        ys.append(y)
    return np.stack(ys), routed


def test_routed_ffn_equals_a_float64_mixture_of_experts():
    """The decoder's FFN (experts as neurons, routed activations) and the threshold mode's (thresholds in wide gaps
    of the values, so rounding cannot flip a decision; the input threshold's skipping and the activation
    threshold's both matter) against ``numpy_moe`` to KERNEL_RTOL / KERNEL_ATOL."""
    engine = tiny_engine("swiglu", **MOE)
    cfg, layer = engine.cfg, engine.weights.layers[1]
    x = np.random.default_rng(0).standard_normal((5, cfg.d_model)).astype(np.float32)
    expected, routed = numpy_moe(layer, x, cfg)
    assert np.all((routed != 0).reshape(5, 4, -1).any(-1).sum(-1) == 2)  # two experts per token
    np.testing.assert_allclose(np.asarray(transformer.ffn_dense(layer, jnp.asarray(x), cfg)), expected,
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    input_threshold = float(thresholds_in_gaps([np.abs(x)], 0.3)[0])
    _, routed = numpy_moe(layer, x, cfg, input_threshold)
    picked = np.abs(routed[routed != 0])
    activation_threshold = float(thresholds_in_gaps([picked], 0.4)[0])
    expected, _ = numpy_moe(layer, x, cfg, input_threshold, activation_threshold)
    assert np.abs(expected - numpy_moe(layer, x, cfg, input_threshold)[0]).max() > 100 * KERNEL_ATOL
    for backend in BACKENDS:
        ffn = threshold_layout.from_layer(layer, cfg.ffn_kind, input_threshold=input_threshold,
                                          activation_threshold=activation_threshold, experts=cfg.experts)
        for tokens in (x[:1], x):  # one token reads rows, several run zeroed dense products
            y, counts = threshold_ffn(ffn, jnp.asarray(tokens), backend=backend)
            np.testing.assert_allclose(np.asarray(y), expected[: len(tokens)], rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
            # the down rows read: the picked experts' neurons over the threshold, never an expert not picked
            _, routed = numpy_moe(layer, tokens, cfg, input_threshold)
            np.testing.assert_array_equal(np.asarray(counts["neurons"]), (np.abs(routed) > activation_threshold).sum(1))
    with pytest.raises(ValueError, match="router"):
        threshold_layout.from_layer(layer, cfg.ffn_kind, input_threshold=None, activation_threshold=0.0)


def test_threshold_mode_within_experts_decodes_like_dense_at_threshold_zero():
    """Threshold 0 keeps every non-zero routed activation and input: dense, summed in another order; the experts not
    picked are skipped (their activations are exactly zero)."""
    dense = tiny_engine("swiglu", **MOE)
    cfg = dense.cfg
    zeros = np.zeros(cfg.n_layers, np.float32)
    engine = build_engine(dense.model, "threshold", thresholds=SparsityThresholds(zeros, zeros, {}, {}, "given"))
    assert_decodes_alike(engine, dense, 24, 8)


def test_calibration_counts_the_experts_not_picked_as_skipped():
    """Half the neurons (2 experts of 4) are exactly zero on every token: a target of 0.7 calibrates a threshold
    over zero that skips 0.7 of the neurons within the histogram's resolution; 0.3 falls among the zeros, in the
    histogram's lowest bin (below 2^-31: no routed activation of these models is that small)."""
    dense = tiny_engine("swiglu", **MOE)
    tokens = windows(8, 32, seed=3)
    th = calibrate_sparsity(dense, tokens, activation=0.7)
    assert np.all(th.activation > 0)
    np.testing.assert_allclose(th.layer_sparsity["activation"], 0.7, atol=SPARSITY_ATOL)
    assert np.all(calibrate_sparsity(dense, tokens, activation=0.3).activation < 2.0**-31)


SPARSE_BACKENDS = ("auto", "xla", "gather")  # the Pallas kernels take no routing weights (refused below)


def test_listed_neurons_of_experts_equal_a_float64_mixture_of_experts():
    """The sparse op over a list of an expert layout's neurons (the predictor modes' FFN): each listed neuron's
    activation times its expert's routing weight, the others absent. Against ``numpy_moe``'s routed activations
    with the unlisted neurons zeroed, for a list in any order with padding and an id out of range, the whole
    layer, and every row at once (``all_rows_ffn``, prefill) with and without a mask per token."""
    engine = tiny_engine("swiglu", **MOE)
    cfg, layer = engine.cfg, engine.weights.layers[1]
    ffn = neurons.from_layer(layer, cfg.ffn_kind, cfg.experts)
    x = np.random.default_rng(1).standard_normal((4, cfg.d_model)).astype(np.float32)
    _, routed = numpy_moe(layer, x, cfg)
    down = np.asarray(layer.w_down, np.float64)
    rng = np.random.default_rng(2)
    listed = rng.permutation(cfg.d_ff)[:20]
    ids = np.concatenate([listed, [cfg.d_ff + 3, 0, 0]]).astype(np.int32)  # a bad id and padding after count 21
    for token in range(len(x)):
        expected = down[:, listed] @ routed[token, listed]
        assert np.abs(expected - down @ routed[token]).max() > 100 * KERNEL_ATOL  # the list matters
        for backend in SPARSE_BACKENDS:
            y = sparse_ffn(ffn, jnp.asarray(x[token]), jnp.asarray(ids), 21, backend=backend)
            np.testing.assert_allclose(np.asarray(y), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
            y = sparse_ffn(ffn, jnp.asarray(x[token]), jnp.arange(cfg.d_ff, dtype=jnp.int32), cfg.d_ff,
                           backend=backend)
            np.testing.assert_allclose(np.asarray(y), down @ routed[token], rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    np.testing.assert_allclose(np.asarray(all_rows_ffn(ffn, jnp.asarray(x))), routed @ down.T,
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    keep = rng.random((len(x), cfg.d_ff)) < 0.5
    np.testing.assert_allclose(np.asarray(all_rows_ffn(ffn, jnp.asarray(x), jnp.asarray(keep))),
                               np.where(keep, routed, 0.0) @ down.T, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    with pytest.raises(ValueError, match="routing weights"):
        sparse_ffn(ffn, jnp.asarray(x[0]), jnp.asarray(ids), 21, backend="pallas")
    with pytest.raises(ValueError, match="router"):
        neurons.from_layer(layer, cfg.ffn_kind)


def test_selection_spends_no_capacity_on_experts_not_picked():
    """``routed_logits`` leaves the logits of the picked experts' neurons and sets the others' to -inf (numpy_moe's
    routed activations say which experts are picked)."""
    engine = tiny_engine("swiglu", **MOE)
    cfg, layer = engine.cfg, engine.weights.layers[0]
    x = np.random.default_rng(3).standard_normal((6, cfg.d_model)).astype(np.float32)
    _, routed = numpy_moe(layer, x, cfg)
    picked = np.repeat((routed != 0).reshape(6, cfg.n_experts, -1).any(-1), cfg.expert_size, axis=1)
    logits = np.random.default_rng(4).standard_normal((6, cfg.d_ff)).astype(np.float32)
    out = np.asarray(routed_logits(jnp.asarray(logits), layer.router, jnp.asarray(x), cfg.routing_rule))
    np.testing.assert_array_equal(out, np.where(picked, logits, -np.inf))
    np.testing.assert_array_equal(np.asarray(routed_logits(jnp.asarray(logits), None, jnp.asarray(x), None)), logits)


def test_migration_scales_the_router_with_the_ffn_input():
    """SmoothQuant divides the FFN input by s (through the norm) and multiplies gate/up's columns by s; the router
    reads the same input, so its columns too: the smoothed float model scores like the original within
    DECODER_ATOL (float32 rounding of the rescaled weights), and routes the same."""
    cfg = tiny_engine("swiglu", **MOE).cfg
    weights = params.build_weights(cfg, params.init_random(cfg, seed=1, scale=0.2))
    smoothed = smoothquant.smooth(weights, random_peaks(cfg), 0.6)
    tokens = jnp.asarray(windows(2, 12, seed=3))
    np.testing.assert_allclose(np.asarray(transformer.score(smoothed, tokens, cfg)),
                               np.asarray(transformer.score(weights, tokens, cfg)), rtol=0, atol=DECODER_ATOL)
    assert np.abs(np.asarray(smoothed.layers[0].router) - np.asarray(weights.layers[0].router)).max() > 0.01
    unscaled = dataclasses.replace(smoothed, layers=[dataclasses.replace(s, router=w.router)
                                                     for s, w in zip(smoothed.layers, weights.layers)])
    assert np.abs(np.asarray(transformer.score(unscaled, tokens, cfg))
                  - np.asarray(transformer.score(weights, tokens, cfg))).max() > 100 * DECODER_ATOL


# The MoE families beside Mixtral, on tiny_engine's d_ff 48 (4 experts of 12 neurons): Qwen3-MoE's per-head q/k norms
# and top 2 kept as the softmax gave them; OLMoE's q/k norms over the whole projections; Qwen2-MoE's q/k/v biases, 3
# routed experts (top 2) and the last expert a shared one under its sigmoid gate; GraniteMoE's Mixtral routing under its
# embedding, attention, residual and logits multipliers.
FAMILIES = {"qwen3-moe-like": dict(n_experts=4, experts_per_token=2, renormalize_experts=False, qk_norm=True),
            "olmoe-like": dict(n_experts=4, experts_per_token=2, renormalize_experts=False, qk_norm=True,
                               qk_norm_whole=True),
            "qwen2-moe-like": dict(n_experts=4, experts_per_token=2, renormalize_experts=False, shared_experts=1,
                                   qkv_bias=True),
            "granitemoe-like": dict(n_experts=4, experts_per_token=2, embed_scale=3.0, attn_scale=0.2,
                                    residual_scale=0.5, logit_divisor=2.5)}


@pytest.mark.parametrize("family", [  # slow: ~40 s each on 2 shared cores; qwen2-moe-like carries both routing changes
    pytest.param("qwen3-moe-like", marks=pytest.mark.slow), pytest.param("olmoe-like", marks=pytest.mark.slow),
    pytest.param("granitemoe-like", marks=pytest.mark.slow), "qwen2-moe-like"])
def test_every_mode_decodes_each_family_like_dense(family):
    """Sparse with all-active predictors, threshold 0 and the hybrid (half the neurons on each simulated device) give
    the dense model's greedy tokens and its forced logits within DECODER_ATOL (the same values summed in another
    order): each carries the family's routing rule (weights not renormalized; the shared expert's gate) to its
    neurons. A rule other than Mixtral's binds: the routing weights differ from Mixtral's."""
    dense = tiny_engine("swiglu", **FAMILIES[family])
    cfg, layer = dense.cfg, dense.weights.layers[0]
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, cfg.d_model)), jnp.float32)
    mixtral = dataclasses.replace(cfg.routing_rule, renormalize=True, shared=0)
    if cfg.routing_rule != mixtral:
        routed = transformer.expert_weights(layer.router, x, cfg.routing_rule)
        assert np.abs(np.asarray(routed - transformer.expert_weights(layer.router, x, mixtral))).max() > 0.05
    predictors = all_active(dense)
    zeros = np.zeros(cfg.n_layers, np.float32)
    engines = (build_engine(dense.model, "sparse", predictors=predictors, capacity=cfg.d_ff),
               build_engine(dense.model, "threshold", thresholds=SparsityThresholds(zeros, zeros, {}, {}, "given")),
               build_engine(dense.model, "hybrid", predictors=predictors, capacity=cfg.d_ff,
                            placement=half_masks(cfg)))
    for engine in engines:
        assert_decodes_alike(engine, dense, 24, 8)
