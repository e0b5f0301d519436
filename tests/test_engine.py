"""Engine: generation loop, sampling, stops, streaming and argument checks (tiny random models)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jpinfer import Engine, GenerationConfig, LoadedModel
from jpinfer.config import RopeScaling
from jpinfer.models import hf_loader, params
from jpinfer.runtime.generation import CACHE_ROUNDING, MIN_PROMPT_BUCKET, cache_capacity, generation_shapes
from jpinfer.runtime.sampling import ARGMAX_BLOCK, Sampler, argmax, sample

from hf_reference import make_model
from profiler_fixtures import tiny_engine


class CharTokenizer:
    """Token i <-> chr(ord('a') + i % 26); token 0 is EOS. Enough to test text handling."""

    eos_token_id = 0
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [1 + (ord(c) - ord("a")) % 26 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids if i != 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    ref = make_model("llama", directory)
    cfg, tensors = hf_loader.load_hf(directory)
    return ref, Engine(LoadedModel(cfg, params.build_weights(cfg, tensors), CharTokenizer(), str(directory)))


def test_greedy_matches_transformers_generate(tiny):
    ref, engine = tiny
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = [t for t in expected[0, len(prompt):].tolist()]
    result = engine.generate(prompt, max_new_tokens=12)
    eos = {0, *engine.cfg.eos_token_ids}  # the tokenizer's and the config's
    cut = [i for i, t in enumerate(expected) if t in eos]
    expected = expected[: cut[0]] if cut else expected  # EOS ends generation, and is not returned
    assert result.token_ids == expected
    assert result.finish_reason == ("eos" if len(expected) < 12 else "length")
    # One decode step per token after the first, plus the step that produced EOS.
    assert len(result.step_s) == len(result.token_ids) - (result.finish_reason == "length")


def test_same_seed_same_output_and_seeds_differ(tiny):
    _, engine = tiny
    runs = [engine.generate([5, 6, 7], max_new_tokens=20, temperature=1.5, seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_and_tiny_top_p_are_greedy(tiny):
    _, engine = tiny
    greedy = engine.generate([5, 6, 7], max_new_tokens=10).token_ids
    assert engine.generate([5, 6, 7], max_new_tokens=10, temperature=0.8, top_k=1, seed=3).token_ids == greedy
    assert engine.generate([5, 6, 7], max_new_tokens=10, temperature=0.8, top_p=1e-6, seed=3).token_ids == greedy


@pytest.mark.parametrize("vocab", [7, 2 * ARGMAX_BLOCK + 1, 49152, 32000])
def test_blockwise_argmax_equals_numpy_first_maximum(vocab):
    """Greedy's two-level argmax against numpy's argmax (first maximum, first NaN) on rows built to
    catch a wrong block or offset: ties across and within blocks, NaN, all -inf, the maximum in the last
    (padded) block, and random rows. Exact: the same comparisons on the same float32 values."""
    rng = np.random.default_rng(vocab)
    rows = [rng.standard_normal(vocab).astype(np.float32) for _ in range(4)]
    tie = rng.standard_normal(vocab).astype(np.float32)
    tie[[vocab // 3, vocab // 2, vocab - 1]] = 9.0
    nan = rng.standard_normal(vocab).astype(np.float32)
    nan[[vocab // 2, vocab - 1]] = np.nan
    nan[0] = np.inf
    last = np.full(vocab, -1.0, np.float32)
    last[-1] = 0.0
    rows += [tie, nan, last, np.full(vocab, -np.inf, np.float32)]
    logits = np.stack(rows)
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


def test_sampling_follows_filtered_softmax():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 20000)
    draw = jax.vmap(lambda k, s=None: sample(logits, k, Sampler(1.0, 0, 0.7)))
    counts = np.bincount(np.asarray(draw(keys)).ravel(), minlength=4) / 20000
    # top_p 0.7 keeps {0.5, 0.3}: renormalised 0.625 / 0.375. Frequencies of 20000 draws: binomial standard
    # deviation <= sqrt(0.25 / 20000) = 0.0035, so 0.015 is 4.2 sigma; the keys are fixed and threefry draws
    # the same bits on every machine, so the counts move only by draws that float32 rounding flips (near ties).
    np.testing.assert_allclose(counts, [0.625, 0.375, 0, 0], atol=0.015)
    draw_k = jax.vmap(lambda k: sample(logits, k, Sampler(1.0, 3, 1.0)))
    counts = np.bincount(np.asarray(draw_k(keys)).ravel(), minlength=4) / 20000
    np.testing.assert_allclose(counts, np.array([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.015)


def test_stop_string_cuts_text_and_stream_matches(tiny):
    _, engine = tiny
    full = engine.generate("hello", max_new_tokens=16, temperature=1.0, seed=7)
    assert len(full.text) >= 4, full.text
    stop = full.text[2:4]
    result = engine.generate("hello", max_new_tokens=16, temperature=1.0, seed=7, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.find(stop)]
    pieces = list(engine.stream("hello", max_new_tokens=16, temperature=1.0, seed=7, stop=[stop]))
    assert "".join(pieces) == result.text
    assert "".join(engine.stream("hello", max_new_tokens=16, temperature=1.0, seed=7)) == full.text


def test_list_of_prompts_gives_one_result_each(tiny):
    _, engine = tiny
    results = engine.generate(["abc", "xyz"], max_new_tokens=3)
    assert [r.text for r in results] == [engine.generate(p, max_new_tokens=3).text for p in ("abc", "xyz")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_generation_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_bad_prompts_are_value_errors(tiny):
    _, engine = tiny
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")
    with pytest.raises(ValueError, match="empty"):
        engine.generate([])
    with pytest.raises(ValueError, match="context"):
        engine.generate([1] * engine.cfg.max_position)
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([engine.cfg.vocab_size])
    with pytest.raises(ValueError, match="chat template"):
        engine.generate("abc", chat=True)


def test_the_smallest_prompt_bucket_fits_the_native_products():
    """Prompts of up to MIN_PROMPT_BUCKET tokens run the native products (1 to MAX_TOKENS tokens a call), and a
    bucket is a power of two: the first token of a short prompt then comes from them, not from XLA's GEMM."""
    from jpinfer.native.kernels import MAX_TOKENS
    from jpinfer.runtime.generation import prompt_bucket

    assert MIN_PROMPT_BUCKET <= MAX_TOKENS and MIN_PROMPT_BUCKET & (MIN_PROMPT_BUCKET - 1) == 0
    assert [prompt_bucket(n) for n in (1, MIN_PROMPT_BUCKET, MIN_PROMPT_BUCKET + 1)] == [
        MIN_PROMPT_BUCKET, MIN_PROMPT_BUCKET, 2 * MIN_PROMPT_BUCKET]


def test_cache_capacity_holds_the_positions_with_bounded_waste():
    for tokens in range(1, 3 * CACHE_ROUNDING):
        slots = cache_capacity(tokens, 4096)
        assert slots >= tokens
        if tokens <= CACHE_ROUNDING:  # a power of two, at most twice what it holds (or the smallest prompt bucket)
            assert slots & (slots - 1) == 0 and slots >= MIN_PROMPT_BUCKET
            assert slots < 2 * tokens or slots == MIN_PROMPT_BUCKET
        else:  # a multiple of CACHE_ROUNDING, less than one step of it to spare
            assert slots % CACHE_ROUNDING == 0 and slots - tokens < CACHE_ROUNDING
    assert cache_capacity(300, 200) == 200 and cache_capacity(20, 24) == 24  # never past the model's context
    # a 32-token prompt with 8 new tokens: 64 slots (it was 256 before the powers of two)
    assert generation_shapes(32, 8, 4096) == (32, 64, 8)


def test_generation_stops_at_context_end(tiny):
    _, engine = tiny
    n = engine.cfg.max_position - 3
    prompt = list(np.random.default_rng(0).integers(1, 90, n))
    result = engine.generate(prompt, max_new_tokens=50)
    assert len(result.token_ids) <= 3


def test_a_longrope_generation_that_can_cross_the_original_context_warns():
    """jpinfer keeps the keys cached before a LongRoPE generation crosses the original context (8 here), where
    transformers' Phi-3 re-encodes them: said when a generation can cross it, alone or in a batch; silent when
    it cannot (all on one side)."""
    scaling = RopeScaling("longrope", original_max_position=8, attention_factor=1.2,
                          frequency_factors=(1.0, 1.2, 1.5, 2.0), long_factors=(1.0, 2.0, 4.0, 8.0))
    engine = tiny_engine("swiglu", rope_scaling=scaling)
    with pytest.warns(UserWarning, match="8 positions of tiny-swiglu's original context"):
        engine.generate([1, 5, 9], max_new_tokens=8, ignore_eos=True)
    with pytest.warns(UserWarning, match="LongRoPE"):
        engine.batch_decoder(2, 64).add([1, 5, 9], GenerationConfig(max_new_tokens=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate([1, 5, 9], max_new_tokens=5, ignore_eos=True)  # reaches 8 positions: never past
        engine.generate(list(range(1, 11)), max_new_tokens=5, ignore_eos=True)  # past it from the prompt on
