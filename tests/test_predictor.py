"""Activation predictors: learning a known active set, the cut-off search, adaptive sizing,
the predicted-mask FFN against a float64 reference, and the checkpoint round trip (damaged
checkpoints: tests/test_artifacts.py, with every other artifact kind)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.ffn import PredictorMaskFFN, evaluate, mask_states
from jpinfer.models.quantized import as_float
from jpinfer.predictor import (
    LayerData,
    PredictorMismatchError,
    Predictors,
    PredictorWeights,
    TrainConfig,
    cutoff_for_recall,
    predict_logits,
    sizing,
    train_layer,
    train_predictors,
)
from jpinfer.predictor.fit import retune
from jpinfer.profiler import ProfileSettings, profile

from profiler_fixtures import ffn_inputs, tiny_engine
from tolerances import KERNEL_ATOL, KERNEL_RTOL


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def windows(n, t=32, seed=1):
    return np.random.default_rng(seed).integers(0, 40, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def relu_setup(tmp_path_factory):
    """A tiny ReLU model (a neuron is active iff up . x + b > 0: a known, linear function of the
    FFN input), profiled with samples, and predictors trained on them."""
    mp = pytest.MonkeyPatch()
    mp.setenv("JPINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
    engine = tiny_engine("relu")
    prof = profile(engine, windows(192), ProfileSettings(n_samples=6144), progress=False)
    config = TrainConfig(recall=0.97, max_epochs=30, batch_size=128, learning_rate=1e-2)  # ~1200 steps
    predictors = train_predictors(engine, prof, ranks=32, config=config,
                                  progress=False)
    yield engine, prof, predictors
    mp.undo()


def test_predictor_learns_a_known_active_set(relu_setup):
    engine, prof, predictors = relu_setup
    for scores in predictors.meta["held_out_scores"]:
        assert scores["recall"] >= 0.97
        assert scores["precision"] > 0.95
    # fresh text: the predicted-mask model counts predicted / truly active / both per token
    ppl, sums = evaluate(engine, windows(16, seed=7), PredictorMaskFFN(engine.cfg),
                         mask_states(predictors.layers, prof.thresholds))
    assert math.isfinite(ppl)
    for layer in sums:
        assert layer["hits"] / layer["active"] > 0.95
        assert layer["hits"] / layer["predicted"] > 0.95


def test_an_untrained_predictor_does_not_pass_the_learning_bar(relu_setup):
    """The bar above can fail: random weights with a recall-0.97 cut-off are far less precise."""
    _, prof, predictors = relu_setup
    rng = np.random.default_rng(0)
    random_layers = [
        PredictorWeights(*(jnp.asarray(rng.normal(size=np.shape(a)), jnp.float32)
                           for a in (p.w_in, p.b_in, p.w_out, p.b_out)),
                         p.cutoff)
        for p in predictors.layers
    ]
    samples = _layer_data(prof, 0)
    _, scores = _retuned(random_layers[0], samples, 0.97)
    assert scores.precision < 0.9


def _layer_data(prof, layer):
    return LayerData(*prof.samples().arrays(layer), prof.d_ff)


def _retuned(weights, data, recall):
    from jpinfer.predictor.train import with_cutoff

    return with_cutoff(weights, data, recall)


def test_predicted_mask_ffn_equals_a_float64_reference():
    """Dense activations with unpredicted neurons zeroed, against numpy float64."""
    engine = tiny_engine("swiglu", n_layers=1)
    cfg, layer = engine.cfg, engine.weights.layers[0]
    tokens = windows(2, t=8, seed=3)
    x = ffn_inputs(engine, tokens)[0]  # (16, d_model) float64
    rng = np.random.default_rng(1)
    rank = 8
    arrays = [rng.normal(size=s) * 0.5 for s in ((rank, cfg.d_model), (rank,), (cfg.d_ff, rank), (cfg.d_ff,))]
    p = PredictorWeights(*(jnp.asarray(a, jnp.float32) for a in arrays), jnp.float32(0.3))
    w_in, b_in, w_out, b_out = arrays
    logits = np.maximum(x @ w_in.T + b_in, 0) @ w_out.T + b_out
    keep = logits > 0.3
    # the float32 run may decide differently only for logits within float32 rounding of the
    # cut-off: require a clear margin so the reference decides the same on any CPU
    assert np.min(np.abs(logits - 0.3)) > 1e-3
    w = np.asarray(layer.w_gate_up, np.float64)
    gate, up = x @ w[: cfg.d_ff].T, x @ w[cfg.d_ff :].T
    a = gate / (1 + np.exp(-gate)) * up
    expected = (a * keep) @ np.asarray(layer.w_down, np.float64).T
    state = mask_states([p], [0.0])[0]
    y, counts = PredictorMaskFFN(cfg)(0, layer, jnp.asarray(x, jnp.float32), state)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)  # a tiny-model FFN
    assert np.array_equal(np.asarray(counts["predicted"]), keep.sum(-1))
    assert np.array_equal(np.asarray(counts["active"]), (np.abs(a) > 0).sum(-1))


def test_all_active_predictor_decodes_like_dense():
    engine = tiny_engine("swiglu")
    cfg = engine.cfg
    d = cfg.d_model
    keep_all = PredictorWeights(jnp.zeros((4, d)), jnp.zeros(4), jnp.zeros((cfg.d_ff, 4)), jnp.zeros(cfg.d_ff),
                                jnp.float32(-1.0))
    from jpinfer import FfnStrategy

    strategy = FfnStrategy(PredictorMaskFFN(cfg), mask_states([keep_all] * cfg.n_layers, [0.0] * cfg.n_layers), "all")
    prompt = [3, 4, 5, 6, 7]
    dense = engine.generate(prompt, max_new_tokens=12).token_ids
    masked = engine.with_ffn(strategy).generate(prompt, max_new_tokens=12).token_ids
    assert masked == dense


# ----- cut-off search

@pytest.mark.parametrize("recall", [0.5, 0.9, 0.97, 0.99, 1.0])
def test_cutoff_is_the_largest_that_meets_the_recall_target(recall):
    rng = np.random.default_rng(0)
    active = rng.random((300, 40)) < 0.3
    logits = (rng.normal(size=active.shape) + 1.5 * active).astype(np.float32)
    logits[0, :5] = logits[1, :5]  # ties
    c = cutoff_for_recall(logits, active, recall)
    positives = logits[active]
    assert np.mean(positives > c) >= recall
    # brute force: every larger candidate (the next distinct positive logit up) misses the target
    larger = np.unique(positives[positives > c])
    assert np.mean(positives > larger[0]) < recall if larger.size else True
    assert np.mean(positives > np.nextafter(np.float32(c), np.float32(np.inf))) < recall or c == np.max(positives)


def test_cutoff_without_active_pairs_predicts_nothing():
    assert cutoff_for_recall(np.zeros((3, 4)), np.zeros((3, 4), bool), 0.99) == math.inf


def test_retuned_cutoffs_meet_their_targets_on_held_out_samples(relu_setup):
    engine, prof, predictors = relu_setup
    lower = retune(engine, predictors, prof, 0.8)
    for p, q, scores in zip(predictors.layers, lower.layers, lower.meta["held_out_scores"]):
        assert float(q.cutoff) >= float(p.cutoff)
        assert scores["recall"] >= 0.8
        assert scores["predicted"] <= scores["active"] * 1.05


# ----- adaptive sizing

def _trial_table(costs: dict[int, dict[int, float]]):
    calls = []

    def trial(layer, rank):
        calls.append((layer, rank))
        n_params = rank * 10
        return sizing.Trial(rank, n_params, 0.0, costs[layer][rank])
    return trial, calls


def test_sizing_finds_each_layers_cheapest_width_on_unimodal_costs():
    ranks = (16, 32, 64, 128, 256)
    rng = np.random.default_rng(0)
    costs = {}
    for layer in range(6):
        best = int(rng.integers(0, len(ranks)))
        costs[layer] = {r: float(abs(k - best) + rng.random() * 0.1) for k, r in enumerate(ranks)}
    trial, calls = _trial_table(costs)
    start = [64] * 6
    chosen, trials = sizing.search(6, trial, start, budget_params=10**9, ranks=ranks)
    assert chosen == [min(costs[layer], key=costs[layer].get) for layer in range(6)]  # brute force
    assert len(calls) == len(set(calls)) < 6 * len(ranks)  # each pair trained at most once, not all of them


def test_sizing_shrinks_the_cheapest_layers_to_fit_the_budget():
    ranks = (16, 32, 64)
    # layer 0 gains little from width, layer 1 a lot: the budget must cut layer 0 first
    costs = {0: {16: 10.0, 32: 9.9, 64: 9.8}, 1: {16: 10.0, 32: 5.0, 64: 1.0}}
    trial, _ = _trial_table(costs)
    chosen, _ = sizing.search(2, trial, [64, 64], budget_params=(16 + 64) * 10, ranks=ranks)
    assert chosen == [16, 64]
    # brute force over all pairs within the budget agrees
    feasible = [(a, b) for a in ranks for b in ranks if (a + b) * 10 <= (16 + 64) * 10]
    assert tuple(chosen) == min(feasible, key=lambda ab: costs[0][ab[0]] + costs[1][ab[1]])
    with pytest.raises(ValueError, match="budget"):
        sizing.search(2, trial, [64, 64], budget_params=100, ranks=ranks)


def test_adaptive_training_stays_within_its_budget(relu_setup):
    engine, prof, _ = relu_setup
    from jpinfer.predictor import SearchConfig
    from jpinfer.predictor.fit import model_params

    predictors = train_predictors(engine, prof, budget=0.2, config=TrainConfig(max_epochs=2),
                                  search=SearchConfig(samples=2048, max_epochs=1, start_rank=32), progress=False)
    assert predictors.n_params <= 0.2 * model_params(engine)
    assert all(r in sizing.RANKS for r in predictors.ranks)
    assert predictors.meta["sizing"]["trials"]


# ----- files

def test_save_and_load_round_trip_bit_exactly(relu_setup, tmp_path):
    engine, prof, predictors = relu_setup
    path = predictors.save(tmp_path / "pred")
    loaded = Predictors.load(path, engine, prof)
    assert loaded.meta == json.loads(json.dumps(predictors.meta))
    for a, b in zip(predictors.layers, loaded.layers):
        for name, value in a.arrays().items():
            other = b.arrays()[name]
            assert other.dtype == value.dtype and np.array_equal(other, value)


def test_foreign_model_or_profile_is_refused(relu_setup, tmp_path):
    engine, prof, predictors = relu_setup
    path = predictors.save(tmp_path / "pred")
    with pytest.raises(PredictorMismatchError, match="trained for model"):
        Predictors.load(path, tiny_engine("relu", seed=5))
    other_profile = profile(engine, windows(16, seed=4), progress=False)
    with pytest.raises(PredictorMismatchError, match="another profile"):
        Predictors.load(path, engine, other_profile)


def test_training_rejects_bad_input(relu_setup):
    engine, prof, _ = relu_setup
    with pytest.raises(ValueError, match="recall"):
        TrainConfig(recall=1.5)
    with pytest.raises(ValueError, match="rank"):
        train_layer(_layer_data(prof, 0), 0)
    with pytest.raises(ValueError, match="ranks"):
        train_predictors(engine, prof, ranks=[8], progress=False)
    no_samples = profile(engine, windows(8), progress=False)
    with pytest.raises(ValueError, match="n_samples"):
        train_predictors(engine, no_samples, progress=False)
    with pytest.raises(ValueError, match="budget"):
        train_predictors(engine, prof, budget=0, progress=False)


def test_logits_from_the_exported_arrays_equal_the_trained_module():
    from flax import nnx

    from jpinfer.predictor import LayerPredictor

    module = LayerPredictor(6, 4, 10, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 6)), jnp.float32)
    exported = PredictorWeights.from_module(module, 0.0)
    # two float32 programs summing the same <= 6 O(1) products in other orders: |error| ~ 6 u ~ 7e-7 per logit
    # (|logits| <~ 3); 1e-5 absolute is over 10x that, a wrong layout or missing transpose moves logits by ~1
    np.testing.assert_allclose(np.asarray(predict_logits(exported, x)), np.asarray(module(x)), rtol=0, atol=1e-5)


# ----- strong (large-contribution) pairs

def test_strong_masks_hold_the_largest_contributions():
    from jpinfer.predictor.fit import STRONG_QUANTILE, strong_limit, strong_masks

    engine = tiny_engine("swiglu", n_layers=1)
    cfg, layer = engine.cfg, engine.weights.layers[0]
    x = ffn_inputs(engine, windows(24, t=32, seed=5))[0]  # (768, d_model) float64
    w = np.asarray(layer.w_gate_up, np.float64)
    gate, up = x @ w[: cfg.d_ff].T, x @ w[cfg.d_ff :].T
    contribution = (np.abs(gate / (1 + np.exp(-gate)) * up)
                    * np.linalg.norm(np.asarray(layer.w_down, np.float64), axis=0))
    active = np.abs(gate / (1 + np.exp(-gate)) * up) > np.median(np.abs(gate / (1 + np.exp(-gate)) * up))
    inputs, packed = x.astype(np.float16), np.packbits(active, axis=-1)
    limit = strong_limit(engine.model, 0, inputs[:256], packed[:256])
    strong = np.unpackbits(strong_masks(engine.model, 0, inputs, packed, limit, chunk=100), axis=-1,
                           count=cfg.d_ff).astype(bool)
    assert not np.any(strong & ~active)
    # about the top 10% of active pairs (the limit is estimated on the first 256 samples)
    assert abs(strong.sum() / active.sum() - (1 - STRONG_QUANTILE)) < 0.02
    # every strong pair contributes more than every other active pair, up to the float16 inputs' rounding
    # (relative 2^-11 per input, carried through two products: 1e-2 relative is a wide bound)
    assert contribution[strong].min() > contribution[active & ~strong].max() * (1 - 1e-2)


def test_cutoff_keeps_both_recall_targets():
    from jpinfer.predictor.train import with_cutoff

    rng = np.random.default_rng(4)
    n, d, d_ff, rank = 400, 6, 16, 3
    x = rng.normal(size=(n, d)).astype(np.float16)
    active = rng.random((n, d_ff)) < 0.4
    strong = active & (rng.random((n, d_ff)) < 0.2)
    data = LayerData(x, np.packbits(active, axis=-1), d_ff, np.packbits(strong, axis=-1))
    p = PredictorWeights(*(jnp.asarray(rng.normal(size=s), jnp.float32)
                           for s in ((rank, d), (rank,), (d_ff, rank), (d_ff,))),
                         jnp.float32(0))
    _, only_recall = with_cutoff(p, data, 0.6)
    tuned, both = with_cutoff(p, data, 0.6, strong_recall=0.99)
    assert both.recall >= 0.6 and both.strong_recall >= 0.99
    assert only_recall.strong_recall is not None and both.predicted >= only_recall.predicted
    logits = np.asarray(predict_logits(tuned, jnp.asarray(x, jnp.float32)))
    assert np.mean(logits[strong] > float(tuned.cutoff)) >= 0.99


# ----- a quantized model's predictors

@pytest.mark.parametrize("fmt,rank,w_out_type", [("int8", 32, "Int8Matrix"), ("int4", 32, "Q4Matrix"),
                                                 ("int4", 16, "Int8Matrix")])
def test_a_predictor_in_a_weights_format_computes_its_stored_matrices(fmt, rank, w_out_type):
    """``in_format``: the two matrices in the model's format (4-bit blocks need 32 inputs: a rank of 16 keeps w_out
    int8), biases and cut-off as they were; its logits are the float64 MLP of the matrices it stores, to the
    rounding of the activations each product quantizes (per token or per block of 32, int8: |error| <= max|x| /
    254 an input, so sum_j |W_ij| max|x| / 254 an output; the hidden layer's error passes ReLU and the second
    product's |W|)."""
    rng = np.random.default_rng(7)
    d_model, d_ff = 64, 96
    p = PredictorWeights(jnp.asarray(rng.normal(size=(rank, d_model)) / 8, jnp.float32),
                         jnp.asarray(rng.normal(size=rank) * 0.1, jnp.float32),
                         jnp.asarray(rng.normal(size=(d_ff, rank)) / 4, jnp.float32),
                         jnp.asarray(rng.normal(size=d_ff) * 0.1, jnp.float32), jnp.float32(0.25))
    assert p.in_format("float") is p
    q = p.in_format(fmt)
    assert type(q.w_in).__name__ == ("Int8Matrix" if fmt == "int8" else "Q4Matrix")
    assert type(q.w_out).__name__ == w_out_type
    for name in ("b_in", "b_out", "cutoff"):
        np.testing.assert_array_equal(np.asarray(getattr(q, name)), np.asarray(getattr(p, name)))
    w_in, w_out = (np.asarray(as_float(m), np.float64) for m in (q.w_in, q.w_out))
    x = rng.normal(size=(3, d_model))
    hidden = np.maximum(x @ w_in.T + np.asarray(p.b_in, np.float64), 0)
    reference = hidden @ w_out.T + np.asarray(p.b_out, np.float64)
    hidden_error = np.abs(x).max(-1, keepdims=True) @ np.abs(w_in).sum(-1)[None] / 254
    bound = ((np.abs(hidden).max(-1, keepdims=True) + hidden_error.max(-1, keepdims=True)) / 254
             * np.abs(w_out).sum(-1)[None] + hidden_error @ np.abs(w_out).T)
    logits = np.asarray(predict_logits(q, jnp.asarray(x, jnp.float32)), np.float64)
    # plus float32 rounding of sums of <= 64 terms: 1e-5 of the logits' size, far under the bound (~1e-2)
    assert np.all(np.abs(logits - reference) <= bound + 1e-5 * (1 + np.abs(reference)))
    # the weights' own rounding: the stored matrices stand for the float ones
    assert np.abs(w_out - np.asarray(p.w_out)).max() < 0.1 * np.abs(np.asarray(p.w_out)).max()
    with pytest.raises(ValueError, match="'float', 'int8' or 'int4'"):
        p.in_format("int3")
