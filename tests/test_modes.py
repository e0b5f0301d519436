"""Engine modes: sparse (one device) and hybrid (two simulated CPU devices) against dense and the
masked-dense reference. Tolerances: tests/tolerances.py (DECODER_ATOL: the same tiny decoder, neurons
summed in another order)."""

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpinfer
from jpinfer import GenerationConfig, JpinferError
from jpinfer.ffn import PredictorMaskFFN, layer_capacities, mask_states, part_capacities
from jpinfer.models import transformer
from jpinfer.models.identity import model_fingerprint, model_record
from jpinfer.modes import build_engine
from jpinfer.modes.placement import parse_budget
from jpinfer.predictor import Predictors, PredictorWeights, profile_fingerprint, select_neurons, selection_mask
from jpinfer.profiler import profile
from jpinfer.runtime.engine import FfnStrategy, FusedStepper
from jpinfer.runtime.generation import attend_length
from jpinfer.runtime.sampling import Sampler
from jpinfer.solver import InfeasibleBudgetError

from profiler_fixtures import FALCON_LIKE, GEMMA2_LIKE, GEMMA3_LIKE, tiny_engine
from tolerances import DECODER_ATOL

PROMPT = [1, 5, 9, 2, 7]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def predictors_for(engine, layers, prof=None) -> Predictors:
    meta = {"model_fingerprint": model_fingerprint(engine.cfg, engine.weights), "model_name": engine.cfg.name,
            "model": model_record(engine.model)}
    return Predictors(layers, meta | ({} if prof is None else {"profile_fingerprint": profile_fingerprint(prof)}))


def constant_predictor(cfg, keep: np.ndarray) -> PredictorWeights:
    """Predicts the same neurons (``keep``) for every input: a fixed mask."""
    r = 4
    return PredictorWeights(jnp.zeros((r, cfg.d_model)), jnp.zeros(r), jnp.zeros((cfg.d_ff, r)),
                            jnp.where(jnp.asarray(keep), 1.0, -1.0), jnp.float32(0.0))


def random_predictor(cfg, seed: int, r: int = 8) -> PredictorWeights:
    """An input-dependent predictor (random weights): about half of the logits over the cut-off."""
    rng = np.random.default_rng(seed)
    return PredictorWeights(jnp.asarray(rng.normal(size=(r, cfg.d_model)), jnp.float32), jnp.zeros(r),
                            jnp.asarray(rng.normal(size=(cfg.d_ff, r)), jnp.float32),
                            jnp.asarray(rng.normal(size=cfg.d_ff) * 0.1, jnp.float32), jnp.float32(0.5))


def all_active(engine, prof=None) -> Predictors:
    keep = np.ones(engine.cfg.d_ff, bool)
    return predictors_for(engine, [constant_predictor(engine.cfg, keep)] * engine.cfg.n_layers, prof)


def half_masks(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.random(cfg.d_ff) < 0.5 for _ in range(cfg.n_layers)]


@dataclasses.dataclass(frozen=True)
class DenseThenDecode:
    """Reference: dense prefill (several tokens), ``inner`` (e.g. the predicted-mask FFN) when decoding one token."""

    cfg: object
    inner: object

    def __call__(self, i, layer, x, state):
        if x.shape[1] > 1:
            return transformer.ffn_dense(layer, x, self.cfg), None
        return self.inner(i, layer, x, state)[0], None


def masked_reference(dense, predictors, capacity=None) -> jpinfer.Engine:
    impl = DenseThenDecode(dense.cfg, PredictorMaskFFN(dense.cfg, capacity))
    thresholds = np.zeros(dense.cfg.n_layers)
    return dense.with_ffn(FfnStrategy(impl, mask_states(predictors.layers, thresholds), "masked reference"))


def forced_logits(engine, prompt, forced) -> np.ndarray:
    """Prefill ``prompt``, then decode ``forced`` tokens one by one; the logits of every decode step. Attention
    reads the cache slots a generation reads at these positions (``attend_length``), so the prefill is the program
    ``engine.generate`` compiles for this prompt (compiled once for both)."""
    stepper = engine.stepper
    cache = stepper.new_cache(256)
    attend = attend_length(16 + len(forced), 256)  # covers every position written
    padded = jnp.asarray(np.pad(np.asarray(prompt, np.int32), (0, 16 - len(prompt)))[None])
    token, cache, _ = stepper.first(padded, jnp.int32(len(prompt)), cache, jax.random.PRNGKey(0), Sampler(), attend)
    out = []
    for t in forced:
        step, cache = stepper.step_logits(jnp.asarray([t], jnp.int32), cache, attend)
        out.append(np.asarray(step[0]))
    return np.stack(out)


def assert_decodes_like(engine, reference, new_tokens: int, *, rtol: float, atol: float) -> None:
    """``engine`` generates ``reference``'s greedy tokens for PROMPT over ``new_tokens`` steps, and the logits of
    the first 8 of them, forced, agree within ``rtol`` / ``atol`` (the caller states where they come from)."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    tokens = reference.generate(PROMPT, config).token_ids
    assert engine.generate(PROMPT, config).token_ids == tokens
    np.testing.assert_allclose(forced_logits(engine, PROMPT, tokens[:8]), forced_logits(reference, PROMPT, tokens[:8]),
                               rtol=rtol, atol=atol)


MIXTRAL_LIKE = dict(n_experts=4, experts_per_token=2)  # tiny_engine's d_ff 48: 4 experts of 12 neurons, top 2


@pytest.mark.parametrize("kind, arch", [
    pytest.param("swiglu", {}, id="swiglu"), pytest.param("relu", {}, id="relu"),
    pytest.param("swiglu", MIXTRAL_LIKE, id="mixtral-like"),
    # slow: test_pack.py's test_every_stage_and_mode_runs_on_each_architecture runs every mode of these by default
    *(pytest.param(kind, arch, marks=pytest.mark.slow, id=name) for kind, arch, name in (
        ("geglu", GEMMA2_LIKE, "gemma2-like"), ("geglu", GEMMA3_LIKE, "gemma3-like"),
        ("relu", FALCON_LIKE, "relu-falcon-like"), ("gelu", FALCON_LIKE, "falcon-like")))])
def test_all_active_sparse_and_hybrid_decode_like_dense(kind, arch):
    """gemma2-like: the hybrid engine normalises the sum of its two partial FFN outputs (sandwich norms), each
    layer attends within its own window; falcon-like: the FFN reads the layer's input, beside the attention;
    mixtral-like: each part weights its neurons by their experts' routing, and selects among the picked experts'
    neurons only."""
    dense = tiny_engine(kind, **arch)
    predictors = all_active(dense)
    sparse = build_engine(dense.model, "sparse", predictors=predictors, capacity=dense.cfg.d_ff)
    hybrid = build_engine(dense.model, "hybrid", predictors=predictors, capacity=dense.cfg.d_ff,
                          placement=half_masks(dense.cfg))
    config = GenerationConfig(max_new_tokens=32)
    reference = dense.generate(PROMPT, config).token_ids
    assert len(reference) == 32
    assert sparse.generate(PROMPT, config).token_ids == reference
    assert hybrid.generate(PROMPT, config).token_ids == reference
    forced = reference[:12]
    expected = forced_logits(dense, PROMPT, forced)
    for engine in (sparse, hybrid):
        np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)


def test_fixed_masks_equal_the_masked_dense_reference():
    """Each layer computes only its masked neurons in the sparse and hybrid modes: the same logits as the
    dense FFN with the other neurons zeroed."""
    dense = tiny_engine("swiglu")
    cfg = dense.cfg
    keep = half_masks(cfg, seed=3)
    predictors = predictors_for(dense, [constant_predictor(cfg, m) for m in keep])
    reference = masked_reference(dense, predictors)
    forced = [4, 8, 15, 16, 23, 42 % 40, 7, 3]
    expected = forced_logits(reference, PROMPT, forced)
    assert np.abs(expected - forced_logits(dense, PROMPT, forced)).max() > 100 * DECODER_ATOL  # masks matter
    sparse = build_engine(dense.model, "sparse", predictors=predictors, capacity=cfg.d_ff)
    hybrid = build_engine(dense.model, "hybrid", predictors=predictors, capacity=cfg.d_ff, placement=half_masks(cfg))
    for engine in (sparse, hybrid):
        np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)


@pytest.mark.parametrize("arch", [{}, MIXTRAL_LIKE], ids=["swiglu", "mixtral-like"])
def test_clipping_capacity_keeps_the_largest_logits_like_the_reference(arch):
    """mixtral-like: the capacity goes to the picked experts' neurons (the reference masks the same logits)."""
    dense = tiny_engine("swiglu", **arch)
    cfg = dense.cfg
    predictors = predictors_for(dense, [random_predictor(cfg, seed=i) for i in range(cfg.n_layers)])
    capacity = (8, 16)
    sparse = build_engine(dense.model, "sparse", predictors=predictors, capacity=capacity)
    forced = [4, 8, 15, 16, 23, 2, 7, 3]
    expected = forced_logits(masked_reference(dense, predictors, capacity), PROMPT, forced)
    unclipped = forced_logits(masked_reference(dense, predictors), PROMPT, forced)
    assert np.abs(expected - unclipped).max() > 100 * DECODER_ATOL  # the capacity clipped something
    np.testing.assert_allclose(forced_logits(sparse, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)


@pytest.mark.parametrize("capacity", [1, 7, 20, 50])
def test_selection_keeps_every_neuron_over_the_cutoff_or_the_largest(capacity):
    """Brute force: the valid ids are the neurons over the cut-off when they fit, else the K largest logits;
    one token (the decode path) and a batch give the same sets."""
    logits = np.random.default_rng(capacity).normal(size=(4, 50)).astype(np.float32)
    batch = select_neurons(jnp.asarray(logits), jnp.float32(0.3), capacity)
    for t in range(4):
        one = select_neurons(jnp.asarray(logits[t]), jnp.float32(0.3), capacity)
        over = np.flatnonzero(logits[t] > 0.3)
        expected = set(over[np.argsort(-logits[t, over])][:capacity].tolist())
        for chosen in (one, jax.tree_util.tree_map(lambda a: a[t], batch)):
            assert chosen.ids.shape == (capacity,) and int(chosen.wanted) == over.size
            assert int(chosen.count) == min(over.size, capacity)
            assert set(np.asarray(chosen.ids[: int(chosen.count)]).tolist()) == expected


def test_selection_mask_keeps_a_selected_neuron_that_padding_repeats():
    """The compaction pads its list with id 0: the mask must keep neuron 0 when it is selected."""
    logits = np.full((2, 40), -1.0, np.float32)
    logits[:, [0, 7, 30]] = 1.0  # 3 over the cut-off, capacity 8: 5 padding entries, all id 0
    logits[1, 0] = -1.0
    mask = np.asarray(selection_mask(select_neurons(jnp.asarray(logits), jnp.float32(0.0), 8), 40))
    np.testing.assert_array_equal(mask, logits > 0)


def test_mask_ffn_counts_what_the_capacity_clipped():
    """Brute force in numpy: wanted = logits over the cut-off; kept = the K largest of them."""
    dense = tiny_engine("swiglu")
    cfg = dense.cfg
    p = random_predictor(cfg, seed=5)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, cfg.d_model)), jnp.float32)
    threshold = 0.05
    _, counts = PredictorMaskFFN(cfg, (10,) * cfg.n_layers)(0, dense.weights.layers[0], x,
                                                            mask_states([p], [threshold])[0])
    xs = np.asarray(x, np.float64)[0]
    hidden = np.maximum(xs @ np.asarray(p.w_in, np.float64).T + np.asarray(p.b_in), 0)
    logits = hidden @ np.asarray(p.w_out, np.float64).T + np.asarray(p.b_out)
    layer = dense.weights.layers[0]
    gate_up = xs @ np.asarray(layer.w_gate_up, np.float64).T
    g, u = gate_up[:, : cfg.d_ff], gate_up[:, cfg.d_ff :]
    active = np.abs(g / (1 + np.exp(-g)) * u) > threshold
    for t in range(xs.shape[0]):
        wanted = np.flatnonzero(logits[t] > 0.5)
        kept = wanted[np.argsort(-logits[t, wanted])[:10]]
        dropped = np.setdiff1d(wanted, kept)
        assert counts["predicted"][0, t] == kept.size
        assert counts["clipped"][0, t] == dropped.size
        assert counts["clipped_active"][0, t] == active[t, dropped].sum()
        assert counts["hits"][0, t] == active[t, kept].sum()
    assert int(counts["clipped"].sum()) > 0


def test_hybrid_on_two_devices_equals_sparse_on_one():
    dense = tiny_engine("swiglu", n_layers=3)
    cfg = dense.cfg
    predictors = predictors_for(dense, [random_predictor(cfg, seed=10 + i) for i in range(cfg.n_layers)])
    masks = half_masks(cfg, seed=1)
    masks[1][:] = True  # one layer wholly on the accelerator, one wholly on the host
    masks[2][:] = False
    sparse = build_engine(dense.model, "sparse", predictors=predictors, capacity=cfg.d_ff)
    hybrid = build_engine(dense.model, "hybrid", predictors=predictors, capacity=cfg.d_ff, placement=masks)
    accelerator, host = jax.devices("cpu")[:2]
    parts, cold = hybrid.ffn.state, hybrid.ffn.impl.cold
    assert {parts[0].hot.rows.device} == {accelerator} and cold[0].rows.device == host
    assert parts[0].hot.n_neurons == masks[0].sum() and cold[0].n_neurons == (~masks[0]).sum()
    assert cold[1].n_neurons == 0 and parts[2].hot.n_neurons == 0
    config = GenerationConfig(max_new_tokens=32)
    assert hybrid.generate(PROMPT, config).token_ids == sparse.generate(PROMPT, config).token_ids
    forced = sparse.generate(PROMPT, config).token_ids[:10]
    np.testing.assert_allclose(forced_logits(hybrid, PROMPT, forced), forced_logits(sparse, PROMPT, forced), rtol=0,
                               atol=DECODER_ATOL)


def test_a_dropped_hybrid_engine_frees_its_host_part():
    """The compiled step stays in jax's caches after the engine is gone; it must not keep the cold neurons (a 7B
    model's are ~17 GB of host memory) alive with it."""
    dense = tiny_engine("swiglu")
    hybrid = build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=48,
                          placement=half_masks(dense.cfg))
    assert len(hybrid.generate(PROMPT, max_new_tokens=4).token_ids) == 4  # compiled and run
    cold_rows = weakref.ref(hybrid.ffn.impl.cold[0].rows)
    del hybrid
    gc.collect()
    assert cold_rows() is None


def test_sparse_mode_keeps_one_copy_of_the_ffn():
    dense = tiny_engine("swiglu")
    sparse = build_engine(dense.model, "sparse", predictors=all_active(dense), capacity=dense.cfg.d_ff)
    assert isinstance(sparse.stepper, FusedStepper) and sparse.ffn.name == "sparse"
    assert all(layer.w_gate_up is None and layer.w_down is None for layer in sparse.weights.layers)
    assert "ffn=sparse" in repr(sparse)
    device_s, dispatch_s = sparse.step_times(PROMPT, 3)
    assert device_s > 0 and dispatch_s > 0
    with pytest.raises(ValueError, match="one-device engine"):
        build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=48,
                     placement=half_masks(dense.cfg)).with_ffn(FfnStrategy())


def test_capacities_from_the_profile_and_split_by_activation_share():
    dense = tiny_engine("swiglu")
    windows = np.random.default_rng(1).integers(0, 40, (32, 32)).astype(np.int32)
    prof = profile(dense, windows, progress=False)
    ks = layer_capacities(dense.cfg, 0.99, prof)
    assert ks == tuple(int(k) for k in prof.capacity(0.99, multiple=32))
    assert layer_capacities(dense.cfg, 20, prof) == (20, 20)
    scored = all_active(dense, prof)
    scored.meta["held_out_scores"] = [{"predicted_q99": 33}, {"predicted_q99": 5}]
    assert layer_capacities(dense.cfg, "predicted", prof, scored) == (48, 32)  # blocks of 32, at most d_ff
    hot = np.zeros(48, bool)
    hot[:16] = True
    freq = np.zeros((1, 48))
    freq[0, :16] = 3.0  # the hot third carries 3/4 of the activations
    freq[0, 16:] = 0.5
    assert part_capacities([40], [hot], freq) == ((16, 32),)  # 30 -> 32 > 16 hot neurons; 10 -> 32 cold
    assert part_capacities([48], [hot], freq) == ((16, 32),)  # K = d_ff: both parts whole
    assert part_capacities([16], [hot], freq) == ((16, 32),)
    hot64 = np.zeros(256, bool)
    hot64[:128] = True
    freq64 = np.where(hot64, 3.0, 1.0)[None]
    assert part_capacities([128], [hot64], freq64) == ((96, 32),)  # 96 and 32: shares 3/4 and 1/4


def test_budget_in_user_terms():
    assert parse_budget("6GB", 10) == 6 * 10**9
    assert parse_budget("512MiB", 10) == 512 * 2**20
    assert parse_budget(0.4, 1000) == 400
    assert parse_budget(1234, 10) == 1234
    assert parse_budget("0.4", 1000) == 400 and parse_budget("1234", 10) == 1234  # the command line's strings
    for bad in ("six GB", "6 parsecs", -1, 1.5, 0.0, "1.5", "0", "0GB"):
        with pytest.raises(JpinferError):
            parse_budget(bad, 10)


def test_gpu_budget_places_the_hottest_neurons_and_refuses_what_cannot_fit():
    dense = tiny_engine("swiglu")
    windows = np.random.default_rng(1).integers(0, 40, (32, 32)).astype(np.int32)
    prof = profile(dense, windows, progress=False)
    predictors = all_active(dense, prof)
    with pytest.raises(InfeasibleBudgetError, match="minimum") as info:
        build_engine(dense.model, "hybrid", predictors=predictors, profile=prof, gpu_budget=0.1, capacity=48)
    minimum = info.value.minimum_bytes
    neuron_bytes = 3 * dense.cfg.d_model * 4
    budget = minimum + 60 * neuron_bytes
    hybrid = build_engine(dense.model, "hybrid", predictors=predictors, profile=prof, gpu_budget=budget,
                          capacity=dense.cfg.d_ff)
    hot = [part.hot_ids for part in hybrid.ffn.state]
    assert 0 < sum(h.size for h in hot) <= 60
    freq = prof.frequency()
    for layer, ids in enumerate(hot):  # the mass objective takes each layer's most frequent neurons first
        cold = np.setdiff1d(np.arange(dense.cfg.d_ff), np.asarray(ids))
        if ids.size and cold.size:
            assert freq[layer, np.asarray(ids)].min() >= freq[layer, cold].max() - 1e-12
    assert hybrid.generate(PROMPT, max_new_tokens=16).token_ids == dense.generate(PROMPT, max_new_tokens=16).token_ids


def test_bad_mode_arguments_are_clear_errors():
    dense = tiny_engine("swiglu")
    with pytest.raises(JpinferError, match="unknown mode"):
        build_engine(dense.model, "turbo")
    with pytest.raises(JpinferError, match="unknown mode"):
        jpinfer.load(mode="turbo")
    with pytest.raises(JpinferError, match="needs predictors"):
        build_engine(dense.model, "sparse")
    predictors = all_active(dense)
    with pytest.raises(JpinferError, match="capacity='predicted' needs predictors scored"):
        build_engine(dense.model, "sparse", predictors=predictors)
    with pytest.raises(JpinferError, match="needs the profile"):
        build_engine(dense.model, "sparse", predictors=predictors, capacity=0.99)
    with pytest.raises(JpinferError, match=r"capacities must lie in \[1, d_ff=48\]"):
        build_engine(dense.model, "sparse", predictors=predictors, capacity=49)
    with pytest.raises(JpinferError, match="needs a placement"):
        build_engine(dense.model, "hybrid", predictors=predictors, capacity=48)
    with pytest.raises(JpinferError, match="one boolean mask"):
        build_engine(dense.model, "hybrid", predictors=predictors, capacity=48, placement=[np.ones(48, bool)])
    other = tiny_engine("swiglu", seed=1)
    with pytest.raises(JpinferError, match="trained for model"):
        build_engine(other.model, "sparse", predictors=predictors, capacity=48)


def test_hybrid_without_a_second_device_says_how_to_get_one(monkeypatch):
    from jpinfer.modes.devices import default_devices

    one = jax.devices("cpu")[:1]
    monkeypatch.setattr(jax, "devices", lambda *backend: one)
    with pytest.raises(JpinferError, match="jax_num_cpu_devices"):
        default_devices()


def test_a_16_bit_model_keeps_its_cold_neurons_in_float32_on_the_cpu():
    """XLA:CPU runs bfloat16 products several times slower than float32 (modes/devices.py): the host part is
    float32, the accelerator's part keeps the model's dtype, and decoding still runs."""
    from jpinfer.models import params
    from jpinfer.models.loading import LoadedModel

    tiny = tiny_engine("swiglu")
    weights = params.build_weights(tiny.cfg, params.init_random(tiny.cfg, seed=0, scale=0.2), dtype=jnp.bfloat16)
    model = LoadedModel(tiny.cfg, weights, tiny.tokenizer, "tiny-bf16")
    predictors = predictors_for(jpinfer.Engine(model), [constant_predictor(tiny.cfg, np.ones(48, bool))] * 2)
    hybrid = build_engine(model, "hybrid", predictors=predictors, capacity=48, placement=half_masks(tiny.cfg))
    assert hybrid.ffn.impl.cold[0].rows.dtype == jnp.float32
    assert hybrid.ffn.state[0].hot.rows.dtype == jnp.bfloat16
    assert len(hybrid.generate(PROMPT, max_new_tokens=8).token_ids) == 8


def test_decode_equivalent_computes_what_each_decode_step_computes():
    """``modes.evaluation.decode_equivalent`` (the perplexity view of an engine): decoding one token through its
    strategy equals the engine's decode step, for the sparse and hybrid modes with clipping capacities (their
    prefill is dense, so is the reference's) and the threshold mode split over two devices (it skips in prefill
    too), model-wide as well."""
    from jpinfer.modes.evaluation import decode_equivalent
    from jpinfer.profiler import SparsityThresholds

    dense = tiny_engine("swiglu", n_layers=3)
    cfg = dense.cfg
    predictors = predictors_for(dense, [random_predictor(cfg, seed=20 + i) for i in range(cfg.n_layers)])
    thresholds = SparsityThresholds(np.full(cfg.n_layers, 0.02, np.float32), np.full(cfg.n_layers, 0.3, np.float32),
                                    {}, {}, "given")
    model_wide = dataclasses.replace(thresholds, qkv=np.full(cfg.n_layers, 0.3, np.float32),
                                     o=np.full(cfg.n_layers, 0.05, np.float32))
    engines = [
        build_engine(dense.model, "sparse", predictors=predictors, capacity=(8, 16, 24)),
        build_engine(dense.model, "hybrid", predictors=predictors, capacity=16, placement=half_masks(cfg, seed=2)),
        build_engine(dense.model, "hybrid", predictors=predictors, capacity=cfg.d_ff, placement=half_masks(cfg)),
        build_engine(dense.model, "hybrid", thresholds=thresholds, placement=half_masks(cfg, seed=2)),
        build_engine(dense.model, "hybrid", thresholds=model_wide, placement=half_masks(cfg, seed=2)),
    ]
    forced = [4, 8, 15, 16, 23, 2, 7, 3]
    plain = forced_logits(dense, PROMPT, forced)
    for engine, dense_prefill in zip(engines, (True, True, True, False, False)):
        model, strategy = decode_equivalent(engine, dense.model, np.zeros(cfg.n_layers))
        impl = DenseThenDecode(cfg, strategy.impl) if dense_prefill else strategy.impl
        reference = jpinfer.Engine(model, FfnStrategy(impl, strategy.state))
        expected = forced_logits(reference, PROMPT, forced)
        assert np.abs(expected - plain).max() > 100 * DECODER_ATOL  # the sparsity changed something
        np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)
    dense_model, dense_strategy = decode_equivalent(dense, dense.model)
    assert dense_model is dense.model and dense_strategy.impl is None


def test_the_mode_catalog_names_each_mode_once_and_picks_the_threshold_variant_of_the_hybrid():
    """Modes are objects looked up by name: the CLI's choices are the catalog's names, the hybrid given thresholds is
    its threshold variant, and an unknown weights format is refused before anything loads."""
    from jpinfer.modes import MODE_NAMES, MODES, ModeInputs, get_mode

    assert MODE_NAMES == ("dense", "sparse", "hybrid", "threshold")
    assert all(MODES[name].name == name for name in MODE_NAMES)
    assert get_mode("hybrid").label == "hybrid"
    assert get_mode("hybrid", thresholds="profile").label == "hybrid (threshold)"
    assert get_mode("sparse", thresholds="profile") is get_mode("sparse")  # no variant: its check refuses thresholds
    assert [get_mode(name).two_devices for name in MODE_NAMES] == [False, False, True, False]
    assert get_mode("hybrid", thresholds="profile").two_devices and not get_mode("dense").uses_pack
    assert get_mode("hybrid", thresholds="profile", weights="int4").label == "hybrid (threshold)"
    with pytest.raises(JpinferError, match="unknown weights format"):
        get_mode("dense", weights="int2")
    with pytest.raises(JpinferError, match="needs no predictors"):
        get_mode("hybrid", thresholds="profile").check(ModeInputs(predictors="p", profile="q"))
