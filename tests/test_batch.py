"""Batched decoding (runtime/batch.py): several requests in one decode step, joining and leaving at step
boundaries, each giving what it gives alone, in every mode; the per-row sampler; the per-sequence decoder."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import half_masks, predictors_for, random_predictor

from jpinfer import GenerationConfig
from jpinfer.config import ModelConfig, RopeScaling
from jpinfer.models import quantized, transformer
from jpinfer.models.params import Norm
from jpinfer.modes import build_engine
from jpinfer.native import native_available
from jpinfer.profiler.sparsity import SparsityThresholds
from jpinfer.runtime.batch import MAX_SLOTS, BatchDecoder
from jpinfer.runtime.sampling import Sampler, sample_next, sample_rows

from profiler_fixtures import FALCON_LIKE, GEMMA2_LIKE, tiny_engine
from tolerances import DECODER_ATOL


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def thresholds(cfg, activation: float, input: float, qkv: float | None = None, o: float | None = None
               ) -> SparsityThresholds:
    full = lambda v: None if v is None else np.full(cfg.n_layers, v, np.float32)
    return SparsityThresholds(full(activation), full(input), {}, {}, "given", {}, full(qkv), full(o))


def engine_for(name: str):
    """The engines batched decoding must serve: every mode, and the decoder's position-dependent features."""
    if name == "gemma2-like":  # a sliding window in one layer, soft caps
        return tiny_engine("geglu", **GEMMA2_LIKE)
    if name == "falcon-like":
        return tiny_engine("relu", **FALCON_LIKE)
    if name == "learned-positions":  # OPT's position table
        return tiny_engine("relu", positions="learned", max_position=256, position_offset=2)
    if name == "dynamic-rope-experts":  # each sequence's own RoPE base past 8 positions; Mixtral-like experts
        return tiny_engine("swiglu", n_experts=4, experts_per_token=2,
                           rope_scaling=RopeScaling("dynamic", factor=3.0, original_max_position=8))
    dense = tiny_engine("swiglu", n_layers=3)
    cfg = dense.cfg
    if name == "dense":
        return dense
    if name == "int8":
        return type(dense)(dataclasses.replace(dense.model, weights=quantized.quantize_weights(dense.weights, "int8")))
    if name == "threshold":  # model-wide: the attention's products read by input rows too
        return build_engine(dense.model, "threshold", thresholds=thresholds(cfg, 0.05, 0.3, 0.3, 0.05))
    predictors = predictors_for(dense, [random_predictor(cfg, seed=20 + i) for i in range(cfg.n_layers)])
    if name == "sparse":
        return build_engine(dense.model, "sparse", predictors=predictors, capacity=cfg.d_ff)
    if name == "sparse-clipped":  # fewer neurons than predicted: the largest logits per token
        return build_engine(dense.model, "sparse", predictors=predictors, capacity=12)
    if name == "hybrid":
        return build_engine(dense.model, "hybrid", predictors=predictors, capacity=20,
                            placement=half_masks(cfg, seed=3))
    if name == "threshold-hybrid":
        return build_engine(dense.model, "hybrid", thresholds=thresholds(cfg, 0.05, 0.3),
                            placement=half_masks(cfg, seed=3))
    raise AssertionError(name)


def requests(engine, n: int) -> list[tuple[list[int], GenerationConfig]]:
    """n requests of different prompt lengths, lengths, seeds and sampling; the greedy ones that stop get a stop
    string taken from the middle of what they generate alone (two characters: two tokens, so the stop string
    spans a token boundary)."""
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(3, engine.cfg.vocab_size, size=3 + 5 * i % 17)]
        config = GenerationConfig(max_new_tokens=6 + 7 * i % 19, seed=i, ignore_eos=i % 2 == 0,
                                  temperature=0.9 if i % 3 == 2 else 0.0, top_p=0.8 if i % 6 == 5 else 1.0)
        if i % 3 == 1:
            text = engine.generate(prompt, config).text
            if len(text) >= 6:
                config = dataclasses.replace(config, stop=(text[3:5],))
        out.append((prompt, config))
    return out


def run_batched(engine, todo, slots: int, join_every: int = 2):
    """Drive a BatchDecoder: request i may join from step i * join_every on (when a slot is free).
    Returns the results, the streamed texts and the most sequences that shared a step."""
    decoder = BatchDecoder(engine, slots, 256)
    pending = list(range(len(todo)))
    live, results, streamed, widest, step = {}, {}, {i: "" for i in range(len(todo))}, 0, 0

    def collect(i, request):
        streamed[i] += "".join(request.pieces)
        request.pieces.clear()
        if request.result is not None:
            results[i] = request.result
            live.pop(i, None)

    while pending or live:
        while pending and decoder.free_slots and pending[0] * join_every <= step:
            i = pending.pop(0)
            live[i] = decoder.add(*todo[i])
            collect(i, live[i])
        widest = max(widest, sum(r is not None for r in decoder.running))
        stepped = decoder.step()
        assert set(map(id, stepped)) == set(map(id, live.values()))
        for i, request in list(live.items()):
            collect(i, request)
        step += 1
    return [results[i] for i in range(len(todo))], [streamed[i] for i in range(len(todo))], widest


# the modes the issue names run by default; the other variants (each ~9 s) with the slow tests, in CI
ENGINES = ["dense", "int8", "threshold", "sparse", "hybrid"] + [
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("sparse-clipped", "threshold-hybrid", "gemma2-like", "falcon-like", "learned-positions",
                 "dynamic-rope-experts")]


@pytest.mark.parametrize("name", ENGINES)
def test_each_request_of_a_batch_gives_what_it_gives_alone(name):
    """Greedy and sampled requests, joining at different steps and leaving at different lengths, stop strings
    and EOS: every token and text equals the request run alone (``Engine.generate``), streamed or not."""
    engine = engine_for(name)
    todo = requests(engine, 7)
    alone = [engine.generate(p, c) for p, c in todo]
    assert {r.finish_reason for r in alone} >= {"length", "stop"}
    batched, streamed, widest = run_batched(engine, todo, slots=4)
    assert widest >= 3  # requests really shared steps
    for got, want, text in zip(batched, alone, streamed):
        assert got.token_ids == want.token_ids
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        assert text == want.text
        assert len(got.step_s) == len(want.step_s)


@pytest.mark.parametrize("slots", [1, 2, 5, MAX_SLOTS])
def test_every_batch_size_decodes_like_one_sequence(slots):
    """1..8 slots, all full: the batched step's logits equal each sequence's own decode step within float32
    summation order (a product of B rows is not B matrix-vector products: DECODER_ATOL)."""
    engine = engine_for("sparse-clipped")
    rng = np.random.default_rng(slots)
    prompts = [[int(t) for t in rng.integers(3, 40, size=2 + 3 * i)] for i in range(slots)]
    decoder = BatchDecoder(engine, slots, 256)
    for p in prompts:
        decoder.add(p, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    tokens = np.array([decoder.running[i].text.ids[-1] for i in range(slots)], np.int32)
    logits, _ = engine.stepper.step_logits(jnp.asarray(tokens), decoder.cache, 256)
    for i, p in enumerate(prompts):
        one = engine.stepper.new_cache(256)
        padded = jnp.asarray(np.pad(p, (0, 32 - len(p)))[None], jnp.int32)  # one bucket for all
        _, one = engine.stepper.first_logits(padded, jnp.int32(len(p)), one, 256)
        alone, _ = engine.stepper.step_logits(jnp.asarray(tokens[i : i + 1]), one, 256)
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(alone[0]), rtol=0, atol=DECODER_ATOL)


def test_generate_of_a_list_decodes_together_and_keeps_the_order():
    engine = engine_for("dense")
    prompts = ["abc", "hello", "z", "the quick brown fox", "jumps", "over", "the", "lazy dog", "again"]
    config = GenerationConfig(max_new_tokens=9, ignore_eos=True)
    together = engine.generate(prompts, config)
    assert [r.token_ids for r in together] == [engine.generate(p, config).token_ids for p in prompts]
    assert [r.prompt_token_ids for r in together] == [engine.encode_prompt(p) for p in prompts]


def test_sample_rows_gives_each_row_what_sample_next_gives_it_alone():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 300)) * 3, jnp.float32)
    samplers = [Sampler(), Sampler(0.7), Sampler(1.3, top_k=5), Sampler(1.0, top_p=0.6), Sampler(0.5, 7, 0.9),
                Sampler(2.0, top_k=400)]
    keys = jnp.stack([jax.random.PRNGKey(s) for s in range(6)])
    for _ in range(3):  # the keys each row carries on give the same draws too
        tokens, new_keys = sample_rows(logits, keys, jnp.asarray([s.temperature for s in samplers], jnp.float32),
                                       jnp.asarray([s.top_k for s in samplers], jnp.int32),
                                       jnp.asarray([s.top_p for s in samplers], jnp.float32))
        for i, s in enumerate(samplers):
            token, key = sample_next(logits[i : i + 1], keys[i], s)
            assert int(tokens[i]) == int(token[0])
            np.testing.assert_array_equal(np.asarray(new_keys[i]), np.asarray(key))
        keys = new_keys
    all_greedy, _ = sample_rows(logits, keys, jnp.zeros(6), jnp.zeros(6, jnp.int32), jnp.ones(6))
    np.testing.assert_array_equal(np.asarray(all_greedy), np.argmax(np.asarray(logits), axis=-1))


def test_per_sequence_positions_equal_shared_ones_row_by_row():
    """The decoder with a length per sequence: each row's logits equal that sequence decoded with the shared
    length (its own cache), with rows at different positions, under XLA's attention and the native kernel."""
    engine = tiny_engine("swiglu", **GEMMA2_LIKE)
    cfg, weights = engine.cfg, engine.weights
    rng = np.random.default_rng(1)
    lengths = [3, 9, 1]
    rows = [rng.integers(3, 40, size=n + 1) for n in lengths]
    batch = transformer.KVCache.create(cfg, 3, 32, per_sequence=True)
    singles = []
    for b, seq in enumerate(rows):
        one = transformer.KVCache.create(cfg, 1, 32)
        _, one = transformer.prefill(weights, jnp.asarray(seq[None, :-1]), jnp.int32(len(seq) - 1), one, cfg)
        singles.append(one)
        batch = transformer.KVCache([k.at[b].set(o[0]) for k, o in zip(batch.k, one.k)],
                                    [v.at[b].set(o[0]) for v, o in zip(batch.v, one.v)],
                                    batch.length.at[b].set(one.length))
    last = jnp.asarray([seq[-1] for seq in rows], jnp.int32)
    for attend in (None, 32):
        copy = lambda cache: jax.tree.map(jnp.copy, cache)  # a step donates its cache
        logits, advanced = transformer.decode_step(weights, last, copy(batch), cfg, attend=attend)
        np.testing.assert_array_equal(np.asarray(advanced.length), np.array(lengths) + 1)
        for b, one in enumerate(singles):
            alone, _ = transformer.decode_step(weights, last[b : b + 1], copy(one), cfg, attend=attend)
            np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(alone[0]), rtol=0, atol=DECODER_ATOL)


def test_decoder_arguments_and_slots():
    engine = engine_for("dense")
    with pytest.raises(ValueError, match="slots"):
        BatchDecoder(engine, 0, 256)
    with pytest.raises(ValueError, match="slots"):
        BatchDecoder(engine, MAX_SLOTS + 1, 256)
    decoder = BatchDecoder(engine, 2, 200)
    assert decoder.capacity == 256  # rounded up like a one-sequence cache
    with pytest.raises(ValueError, match="256 tokens"):
        decoder.add([3] * 256, GenerationConfig())
    config = GenerationConfig(max_new_tokens=1000, ignore_eos=True)
    first = decoder.add([5, 6, 7], config)
    assert first.max_new == 256 - 3  # cut to what the slots hold, as generate cuts to the model's context
    decoder.add([8, 9], config)
    with pytest.raises(RuntimeError, match="no free slot"):
        decoder.add([1], config)
    decoder.remove(first)
    assert decoder.free_slots == 1
    assert first not in decoder.step()
    third = decoder.add([4, 4, 4], GenerationConfig(max_new_tokens=1))
    assert third.result is not None and third.result.finish_reason == "length" and decoder.free_slots == 1


@pytest.mark.skipif(not native_available(), reason="native kernels unavailable")
def test_a_batch_step_runs_the_native_few_token_products_and_keeps_nan_rows():
    """2-8 tokens: every float32 projection and the head through the native few-token products (their
    numerics: tests/test_native_kernels.py); a NaN hidden state still gives NaN logits (the head's rows
    product skips nothing for it)."""
    engine = engine_for("dense")
    cfg, weights = engine.cfg, engine.weights
    cache = transformer.KVCache.create(cfg, 3, 32, per_sequence=True)
    hlo = jax.jit(lambda w, t, c: transformer.decode_step(w, t, c, cfg)).lower(
        weights, jnp.zeros(3, jnp.int32), cache).as_text()
    assert "jpinfer_float_matvec" in hlo and "jpinfer_threshold_rows" in hlo
    h = jnp.asarray(np.random.default_rng(0).normal(size=(3, cfg.d_model)), jnp.float32).at[1, 4].set(jnp.nan)
    logits = np.asarray(transformer.logits(weights, h, cfg))
    assert np.isnan(logits[1]).all() and np.isfinite(logits[[0, 2]]).all()
    expected = np.asarray(h)[[0, 2]] @ np.asarray(weights.head)
    np.testing.assert_allclose(logits[[0, 2]], expected, rtol=0, atol=DECODER_ATOL)


@pytest.mark.skipif(not native_available(), reason="the native kernels' fixed-order products are what make it exact")
def test_a_batched_step_is_each_sequence_alone_bit_for_bit_at_a_real_width():
    """On the CPU every product of a decode step is a native kernel with fixed-order sums and the norms sum in
    a fixed order (``transformer.fixed_order_sum``), so a sequence's logits in a batch of 8 are its logits
    alone exactly, here at the default model's width (576, where XLA's own row reduction for the norms
    rounds a batch of 8 rows differently from one; with it, the real model's threshold mode flipped keep
    decisions and 5 of 32 served greedy answers differed from the request alone)."""
    engine = tiny_engine("swiglu", d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=96, n_layers=2)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 40, size=3 + 2 * i)] for i in range(MAX_SLOTS)]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    decoder = BatchDecoder(engine, MAX_SLOTS, 256)
    for p in prompts:
        decoder.add(p, config)
    tokens = np.array([request.text.ids[-1] for request in decoder.running], np.int32)
    logits, _ = engine.stepper.step_logits(jnp.asarray(tokens), decoder.cache, 128)
    for i, p in enumerate(prompts):
        alone = BatchDecoder(engine, 1, 256)
        alone.add(p, config)
        one, _ = engine.stepper.step_logits(jnp.asarray(tokens[i : i + 1]), alone.cache, 128)
        np.testing.assert_array_equal(np.asarray(logits[i]), np.asarray(one[0]))


@pytest.mark.parametrize("kind, d", [("rmsnorm", 576), ("layernorm", 577), ("rmsnorm", 1)])
def test_norms_sum_each_row_in_one_order_for_any_batch(kind, d):
    """``transformer.norm`` of 8 rows equals the norm of each row alone bit for bit, and a float64 norm within
    float32 rounding (pairwise sums: a relative error of a few u)."""
    cfg = ModelConfig(vocab_size=8, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=8,
                      norm_kind=kind, norm_eps=1e-5)
    rng = np.random.default_rng(d)
    x = rng.standard_normal((8, 1, d)).astype(np.float32) * 3
    p = Norm(jnp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32)),
             jnp.asarray(rng.standard_normal(d).astype(np.float32)) if kind == "layernorm" else None)
    f = jax.jit(lambda x: transformer.norm(p, x, cfg))
    together = np.asarray(f(jnp.asarray(x)))
    for i in range(8):
        np.testing.assert_array_equal(together[i], np.asarray(f(jnp.asarray(x[i : i + 1])))[0])
    x64 = x.astype(np.float64)
    if kind == "layernorm":
        x64 = x64 - x64.mean(-1, keepdims=True)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * np.asarray(p.scale, np.float64)
    if p.bias is not None:
        want = want + np.asarray(p.bias, np.float64)
    # float32 rounding: ~log2(d) roundings in each pairwise sum, a few more in rsqrt and the products; 1e-5 is
    # far above that (u = 6e-8) and far below any wrong formula
    np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-5)
