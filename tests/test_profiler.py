"""Profiler on tiny random models: counts, thresholds, samples, perplexity, save/load."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.ffn import evaluate, perplexity
from jpinfer.models import params, transformer
from jpinfer.profiler import (
    ActivationProfile,
    PredictorSamples,
    ProfileError,
    ProfileMismatchError,
    ProfileSettings,
    Sensitivity,
    calibrate,
    greedy,
    profile,
    score_histogram,
    uniform,
)
from jpinfer.profiler import calibration as calibration_module

from profiler_fixtures import ffn_inputs, reference_scores, reference_window_losses, thresholds_in_gaps, tiny_engine
from tolerances import PPL_RTOL, SPARSITY_ATOL, U32

KINDS = ("swiglu", "geglu", "reglu", "drelu", "relu", "gelu")
SMOOTH = ("swiglu", "geglu", "gelu")  # inactive neurons small but not zero: calibrated thresholds


def windows(n=5, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, 40, (n, t)).astype(np.int32)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", [kind if kind in ("swiglu", "relu", "gelu") else
                                  pytest.param(kind, marks=pytest.mark.slow)  # the same collector, another activation
                                  for kind in KINDS])
def test_counts_and_histogram_equal_brute_force(kind):
    engine, tokens = tiny_engine(kind), windows()
    scores = reference_scores(engine, tokens)
    if kind in SMOOTH:
        thr = thresholds_in_gaps(scores, 0.6)
        # 5 windows: a padded batch
        prof = profile(engine, tokens, ProfileSettings(batch_size=2), thresholds=thr, progress=False)
    else:
        thr = np.zeros(len(scores))
        prof = profile(engine, tokens, ProfileSettings(batch_size=2), progress=False)
    assert prof.n_tokens == tokens.size
    for layer, s in enumerate(scores):
        active = s > thr[layer]
        np.testing.assert_array_equal(prof.counts[layer], active.sum(0))
        per_token = np.bincount(active.sum(1), minlength=engine.cfg.d_ff + 1)
        np.testing.assert_array_equal(prof.active_hist[layer], per_token)
    if kind not in SMOOTH:  # ReLU kinds: active means a non-zero activation, and exact zeros are common
        assert np.all(prof.thresholds == 0)
        zeros = sum(int((s == 0).sum()) for s in scores)
        assert zeros > 0.2 * sum(s.size for s in scores)
        assert prof.counts.sum() == sum(int((s != 0).sum()) for s in scores)


def test_statistics_do_not_grow_with_the_corpus():
    engine = tiny_engine("relu")
    small = profile(engine, windows(2), progress=False)
    large = profile(engine, windows(12), progress=False)
    for name in ("counts", "active_hist", "thresholds"):
        assert getattr(small, name).shape == getattr(large, name).shape
    assert large.n_tokens == 6 * small.n_tokens


@pytest.mark.parametrize("score", ["product", "gate"])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_swiglu_thresholds_hit_the_requested_sparsity(sparsity, score):
    engine, tokens = tiny_engine("swiglu"), windows(8, 32, seed=3)
    cal = calibrate(engine, tokens, sparsity, score=score, batch_size=3)
    for layer, s in enumerate(reference_scores(engine, tokens, score)):
        assert abs((s <= cal.thresholds[layer]).mean() - sparsity) <= SPARSITY_ATOL
    prof = profile(engine, tokens, ProfileSettings(score=score), thresholds=cal, progress=False)
    np.testing.assert_allclose(prof.sparsity(), sparsity, atol=SPARSITY_ATOL)


def test_profile_calibrates_uniform_thresholds_on_its_first_tokens():
    engine, tokens = tiny_engine("swiglu"), windows(6, 32, seed=4)
    prof = profile(engine, tokens, ProfileSettings(sparsity=0.7, calibration_tokens=64), progress=False)
    assert prof.meta["calibration"]["calibration_tokens"] == 64
    for layer, s in enumerate(reference_scores(engine, tokens[:2])):
        assert abs((s <= prof.thresholds[layer]).mean() - 0.7) <= SPARSITY_ATOL


def test_histogram_bins_hold_their_values():
    edges = calibration_module.bin_edges()
    rng = np.random.default_rng(0)
    values = np.exp(rng.uniform(np.log(1e-9), np.log(1e4), 10000)).astype(np.float32)
    idx = np.asarray(calibration_module.bin_index(jnp.asarray(values)))
    assert np.all(edges[idx] <= values) and np.all(values < edges[idx + 1])
    assert np.all(np.diff(edges) > 0)
    # 64 equal steps per octave: the widest bin is an octave's first, 65/64 exactly; 1e-12 covers the float64
    # rounding of the other ratios (1e-16)
    assert np.all(edges[2:] / edges[1:-1] <= 1 + 1 / 64 + 1e-12)


def test_sensitivity_is_the_derivative_of_the_window_loss():
    """dL_w/dlambda from one float32 backward pass equals a float64 central difference of the loss when
    layer l's sub-threshold part is scaled away by lambda (a numpy forward apart from transformer.forward)."""
    engine, tokens = tiny_engine("swiglu", n_layers=3), windows(2, 12, seed=5)
    cfg = engine.cfg
    # levels 0, 0.5, 0.8, each threshold in a wide gap of the float64 scores (>= 2.6e-3 relative from any score,
    # where float32 scores are within 1.1e-5 relative of them): float32 and float64 remove the same parts
    ref0, scores = reference_window_losses(engine, tokens, 0, 0.0, 0.0)
    thr = np.stack([np.zeros(cfg.n_layers), thresholds_in_gaps(scores, 0.5), thresholds_in_gaps(scores, 0.8)], 1)
    for k in (1, 2):
        assert min(np.abs(s / t - 1).min() for s, t in zip(scores, thr[:, k])) > 1e-3
    got = np.asarray(calibration_module._window_derivatives(
        engine.weights, jnp.asarray(tokens), jnp.ones(2, bool), jnp.asarray(thr), cfg, "product"))
    np.testing.assert_array_equal(got[:, :, 0], 0.0)  # level 0 removes nothing: exact

    @dataclasses.dataclass(frozen=True)
    class Scaled:
        def __call__(self, i, layer, x, state):
            lam, tau = state  # this layer's scale of the removed part (scalar or per token and neuron), threshold
            a = transformer.ffn_activations(layer, x, cfg)
            return transformer.ffn_down(layer, a - lam * jnp.where(jnp.abs(a) <= tau, a, 0)), None

    @jax.jit
    def window_losses(lam, tau):  # float32, the model as the code runs it
        cache = transformer.KVCache.create(cfg, 2, tokens.shape[1])
        h, _, _ = transformer.forward(engine.weights, jnp.asarray(tokens), cache, cfg, Scaled(), list(zip(lam, tau)))
        lg = transformer.logits(engine.weights, h[:, :-1], cfg)
        return (jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]).sum(1)

    # float32 roundings along one forward pass (a length-n sum counts n): per layer norm 32, qkv 32, rope 2,
    # scores 8, softmax and weighted sum 2 * 12, wo 32, norm 32, gate/up 32, activation 3, down 48, residuals 2
    # (~250); 3 layers and the head (norm 32, logits 32, logsumexp 40): ~850.
    n_forward = 900
    # The reference is the function the code runs: the float32 loss is within n_forward * U32 (5e-5) relative.
    np.testing.assert_allclose(window_losses(np.zeros(cfg.n_layers), thr[:, 1]), ref0, rtol=n_forward * U32)

    # float64 central difference: rounding 1e-16 * |L| (~50) / eps = 5e-12; truncation eps^2 |L'''| / 6
    # (Richardson estimate with 2 eps: < 1e-6), both far below the float32 tolerance below.
    eps = 1e-3
    fd, scale = np.zeros_like(got, np.float64), np.zeros_like(got, np.float64)
    for k in (1, 2):
        for layer in range(cfg.n_layers):
            plus, minus = (reference_window_losses(engine, tokens, layer, s * eps, thr[layer, k])[0] for s in (1, -1))
            fd[:, layer, k] = (plus - minus) / (2 * eps)
        # The derivative is a float32 sum over (token, neuron) of the terms a_ti * (dL/dy_t . w_down[:, i]);
        # scale = sum |term| per window and layer, from the gradient of the float32 loss w.r.t. a per-term lambda.
        terms = jax.grad(lambda lam: window_losses(lam, thr[:, k]).sum())(
            jnp.zeros((cfg.n_layers, *tokens.shape, cfg.d_ff)))
        scale[:, :, k] = np.abs(np.asarray(terms, np.float64)).sum((2, 3)).T
    # float32 rounding of `got`: each term carries at most the roundings along the forward pass, the backward pass
    # (as many) and the final sum over T * d_ff terms, each u relative: |got - exact| <= n * U32 * scale with
    # n = 2 * 900 + 12 * 48 ~ 2400 (first-order worst case; 1.4e-4 * scale). Measured here: <= 9 * U32 * scale.
    tol = (2 * n_forward + tokens.shape[1] * cfg.d_ff) * U32 * scale
    np.testing.assert_array_less(np.abs(got - fd)[:, :, 1:], tol[:, :, 1:])
    # The check has teeth: twice the derivative, or another layer's, or another level's, would fail it (they are
    # off by >= 40x, 5x and 395x the tolerance here).
    assert np.all(np.abs(fd[:, :, 1:]) > tol[:, :, 1:])
    for other in range(1, cfg.n_layers):
        assert np.all(np.abs(np.roll(fd, other, 1) - fd)[:, :, 1:] > tol[:, :, 1:])
    assert np.all(np.abs(fd[:, :, 2] - fd[:, :, 1]) > tol[:, :, 1])


def test_greedy_spends_the_budget_where_the_cost_is_least():
    engine, tokens = tiny_engine("swiglu", n_layers=3), windows(4, 32)
    hist = score_histogram(engine, tokens)
    levels = np.array([0.0, 0.25, 0.5, 0.75])
    # layer 1 is cheap to the end; layer 2 is cheap up to 0.5, then its last level (28) costs more
    # than layer 0's first (5): the six steps go 1, 1, 1, 2, 2, 0 (total cost 7.3, uniform 12.2)
    cost = np.array([[0, 5, 10, 20], [0, 0.1, 0.2, 0.3], [0, 1, 2, 30]], float)
    cal = greedy(hist, Sensitivity(levels, cost, 100), 0.5)
    # float64 sums of a few levels: exact up to ~1e-16, within approx's default 1e-6 and assert_allclose's 1e-7
    assert cal.layer_sparsity.mean() == pytest.approx(0.5)
    np.testing.assert_allclose(cal.layer_sparsity, [0.25, 0.75, 0.5])
    assert cal.thresholds[0] < cal.thresholds[2] < cal.thresholds[1]
    with pytest.raises(ValueError, match="at most"):
        greedy(hist, Sensitivity(levels, cost, 100), 0.8)
    with pytest.raises(ValueError, match="0 <= s < 1"):
        uniform(hist, 1.0)


def test_greedy_calibration_end_to_end_hits_the_mean_sparsity():
    engine = tiny_engine("swiglu")
    cal = calibrate(engine, windows(2, 16, seed=6), 0.6, method="greedy", heldout=windows(2, 16, seed=7))
    assert cal.method == "greedy" and cal.layer_sparsity.mean() == pytest.approx(0.6)  # float64, ~1e-16
    with pytest.raises(ValueError, match="heldout"):
        calibrate(engine, windows(), 0.5, method="greedy")


def test_dense_perplexity_equals_numpy_from_logits():
    engine, tokens = tiny_engine("swiglu"), windows(5, 16)
    lg = np.asarray(transformer.score(engine.weights, jnp.asarray(tokens), engine.cfg), np.float64)[:, :-1]
    logp = lg - lg.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    assert perplexity(engine, tokens, batch_size=2) == pytest.approx(np.exp(nll), rel=PPL_RTOL)


@dataclasses.dataclass(frozen=True)
class _CountingFFN:
    """Dense FFN whose aux is, per token, its layer index + 1."""

    cfg: object

    def __call__(self, i, layer, x, state):
        return transformer.ffn_dense(layer, x, self.cfg), {"ones": jnp.full(x.shape[:-1], i + 1)}


def test_evaluate_sums_aux_over_real_tokens_only():
    """5 windows in batches of 2: the last batch is padded with a copy, which must not be counted."""
    engine, tokens = tiny_engine("swiglu"), windows(5, 16)
    ppl, sums = evaluate(engine, tokens, _CountingFFN(engine.cfg), batch_size=2)
    assert ppl == pytest.approx(perplexity(engine, tokens), rel=1e-6)  # same model, same batch shapes
    assert [s["ones"] for s in sums] == [(i + 1) * tokens.size for i in range(engine.cfg.n_layers)]


def test_oracle_sparse_perplexity_zeroes_inactive_neurons():
    engine, tokens = tiny_engine("swiglu"), windows(3, 16)
    n = engine.cfg.n_layers
    # thresholds above every score zero every neuron: the model without FFNs
    no_ffn = dataclasses.replace(engine.weights, layers=[dataclasses.replace(l, w_down=jnp.zeros_like(l.w_down))
                                                         for l in engine.weights.layers])
    expected = perplexity(dataclasses.replace(engine.model, weights=no_ffn), tokens)
    # Exact: both sides run the same float32 operations on the same values (masked or zero-weight FFN outputs are
    # exact zeros; a threshold of 0 keeps every non-zero activation as is), with reductions of the same shapes,
    # compiled for the same CPU (measured difference 0); 1e-6 (~17 u) is a few units of slack.
    assert perplexity(engine, tokens, np.full(n, 1e9)) == pytest.approx(expected, rel=1e-6)
    assert perplexity(engine, tokens, np.zeros(n)) == pytest.approx(perplexity(engine, tokens), rel=1e-6)
    with pytest.raises(ValueError, match="one value per layer"):
        perplexity(engine, tokens, np.zeros(n + 1))


def test_oracle_sparse_perplexity_matches_a_precomputed_mask():
    """One layer: the FFN input is the dense one, so the float64 reference mask applies."""
    engine, tokens = tiny_engine("swiglu", n_layers=1), windows(3, 16)
    cfg = engine.cfg
    scores = reference_scores(engine, tokens)
    thr = thresholds_in_gaps(scores, 0.7)
    keep = jnp.asarray((scores[0] > thr[0]).reshape(*tokens.shape, cfg.d_ff))

    @dataclasses.dataclass(frozen=True)
    class Masked:
        def __call__(self, i, layer, x, state):
            return transformer.ffn_down(layer, transformer.ffn_activations(layer, x, cfg) * keep), None

    lg = np.asarray(transformer.score(engine.weights, jnp.asarray(tokens), cfg, Masked()), np.float64)[:, :-1]
    logp = lg - lg.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    expected = np.exp(-np.take_along_axis(logp, tokens[:, 1:, None], -1).mean())
    assert perplexity(engine, tokens, thr) == pytest.approx(expected, rel=PPL_RTOL)
    # the mask matters (+2.5% here): 10x PPL_RTOL, the float32 noise
    assert perplexity(engine, tokens, thr) > perplexity(engine, tokens) * (1 + 10 * PPL_RTOL)


def test_predictor_samples_are_real_tokens_with_their_masks(tmp_path):
    engine, tokens = tiny_engine("reglu"), windows(5, 16)
    prof = profile(engine, tokens, ProfileSettings(n_samples=30, batch_size=2), progress=False)
    assert prof.meta["samples"].startswith(str(tmp_path / "cache" / "samples"))
    samples = PredictorSamples.open(prof.meta["samples"])
    assert len(samples) == 30
    xs, scores = ffn_inputs(engine, tokens), reference_scores(engine, tokens)
    for layer in range(engine.cfg.n_layers):
        x, active = samples.layer(layer)
        ref_x = xs[layer].astype(np.float16).astype(np.float32)
        rows = [int(np.argmin(np.abs(ref_x - row).sum(1))) for row in x]
        assert len(set(rows)) == 30  # sampled without replacement
        # float16, give or take one unit: 2^-10 relative for normal numbers, 2^-24 absolute for subnormals
        np.testing.assert_allclose(x, ref_x[rows], rtol=2**-10, atol=2**-24)
        np.testing.assert_array_equal(active, scores[layer][rows] != 0)


def test_save_load_round_trip_and_model_check(tmp_path):
    engine = tiny_engine("swiglu")
    prof = profile(engine, windows(), ProfileSettings(sparsity=0.4), progress=False)
    path = prof.save(tmp_path / "profile")
    assert path.suffix == ".npz"
    back = ActivationProfile.load(path, model=engine)
    for name in ("counts", "active_hist", "thresholds"):
        np.testing.assert_array_equal(getattr(back, name), getattr(prof, name))
    assert (back.n_tokens, back.meta, back.model_fingerprint) == (prof.n_tokens, prof.meta, prof.model_fingerprint)
    # the same weights at another precision are the same model
    ActivationProfile.load(path,
                           model=dataclasses.replace(engine.model, weights=params.cast(engine.weights, jnp.bfloat16)))
    with pytest.raises(ProfileMismatchError, match="the same name and format with other weight values .*: make "
                                                   r"one for this model \(jpinfer profile --out PATH --model "
                                                   r"tiny-swiglu\)"):
        ActivationProfile.load(path, model=tiny_engine("swiglu", seed=1))
    with pytest.raises(ProfileMismatchError, match="not for model 'tiny-reglu' .*: another model: "):
        ActivationProfile.load(path, model=tiny_engine("reglu"))
    (tmp_path / "junk.npz").write_bytes(b"not a profile")
    with pytest.raises(ProfileError, match="not a jpinfer"):
        ActivationProfile.load(tmp_path / "junk.npz")
    with pytest.raises(ProfileError, match="no such"):
        ActivationProfile.load(tmp_path / "missing.npz")


def test_profile_summaries():
    counts = np.array([[8, 0, 2, 0], [4, 4, 4, 4]])
    hist = np.zeros((2, 5), np.int64)
    hist[0, [1, 2, 3]] = [6, 3, 1]  # 10 tokens: 1 active on 6, 2 on 3, 3 on 1
    hist[1, 4] = 10
    prof = ActivationProfile("m", "f", "relu", counts, 10, hist, np.zeros(2))
    # ratios of small integers, float64: exact up to ~1e-16, within assert_allclose's default 1e-7
    np.testing.assert_allclose(prof.neurons_for_share(0.5), [0.25, 0.5])
    np.testing.assert_allclose(prof.neurons_for_share(0.9), [0.5, 1.0])
    np.testing.assert_array_equal(prof.capacity(0.6), [1, 4])
    np.testing.assert_array_equal(prof.capacity(0.95), [3, 4])
    np.testing.assert_array_equal(prof.capacity(0.8, multiple=2), [2, 4])
    np.testing.assert_allclose(prof.sparsity(), [1 - 10 / 40, 1 - 16 / 40])


def test_bad_arguments_are_clear_errors():
    engine = tiny_engine("relu")
    with pytest.raises(ValueError, match="non-zero"):
        profile(engine, windows(), thresholds=np.zeros(2), progress=False)
    with pytest.raises(ValueError, match="gated FFN"):
        calibrate(engine, windows(), 0.5, score="gate")
    swiglu = tiny_engine("swiglu")
    with pytest.raises(ValueError, match="one per layer"):
        profile(swiglu, windows(), thresholds=np.zeros(3), progress=False)
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        profile(swiglu, windows() + 40, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        profile(swiglu, windows(), ProfileSettings(batch_size=0), progress=False)
    with pytest.raises(ValueError, match="unknown activity score"):
        profile(swiglu, windows(), ProfileSettings(score="up"), progress=False)
