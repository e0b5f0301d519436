"""Attention over the used part of the KV cache: the ladder of lengths, and decoding across its
rungs equals scoring the whole sequence with full causal attention; long prompts' blocked attention
(ops.attention.blocked_attention) against float64 and against the one-softmax form."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer import Engine, GenerationConfig, LoadedModel, ModelConfig
from jpinfer.models import params, transformer
from jpinfer.ops import attention
from jpinfer.runtime.generation import MIN_ATTEND, attend_length

from attention_reference import U, attention_reference
from tolerances import DECODER_ATOL  # logits of a tiny 2-layer, d=32 decoder, as derived there; attending

# over up to 200 positions adds ~sqrt(200) u relative rounding to an attention output, far below it


def test_attend_length_ladder():
    capacity = 4096
    lengths = [attend_length(n, capacity) for n in range(1, capacity + 1)]
    for n, length in enumerate(lengths, start=1):
        assert n <= length <= capacity  # sees every position, never past the cache
        assert length <= max(MIN_ATTEND, 1.5 * n)  # reads at most 1.5x the used cache
    assert lengths == sorted(lengths)
    assert len(set(lengths)) <= 11  # one compiled step per rung: 128, 192, ..., 3072, 4096
    assert attend_length(300, 256) == 256 and attend_length(1, 16) == 16


def _model(sliding_window=None):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                      max_position=512, sliding_window=sliding_window, eos_token_ids=())
    return cfg, params.build_weights(cfg, params.init_random(cfg, seed=5, scale=0.3))


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_decoding_across_rungs_equals_scoring_the_whole_sequence(sliding_window):
    cfg, weights = _model(sliding_window)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=200).astype(np.int32)
    full = np.asarray(transformer.score(weights, jnp.asarray(tokens[None]), cfg))[0]  # (200, V), cache = 200
    n_prompt, capacity = 20, 256
    cache = transformer.KVCache.create(cfg, 1, capacity)
    padded = np.zeros((1, 32), np.int32)
    padded[0, :n_prompt] = tokens[:n_prompt]
    logits, cache = transformer.prefill(weights, jnp.asarray(padded), jnp.int32(n_prompt), cache, cfg,
                                        attend=attend_length(32, capacity))
    np.testing.assert_allclose(np.asarray(logits)[0], full[n_prompt - 1], atol=DECODER_ATOL, rtol=0)
    rungs = set()
    for pos in range(n_prompt, len(tokens)):  # crosses the rungs 128, 192, 256
        attend = attend_length(pos + 1, capacity)
        rungs.add(attend)
        logits, cache = transformer.decode_step(weights, jnp.asarray(tokens[pos : pos + 1]), cache, cfg,
                                                attend=attend)
        np.testing.assert_allclose(np.asarray(logits)[0], full[pos], atol=DECODER_ATOL, rtol=0, err_msg=str(pos))
    assert rungs == {128, 192, 256}


def test_engine_generation_across_rungs_is_greedy_under_full_attention():
    """The engine's position bookkeeping: 150 greedy tokens (positions 20..169) are the argmax
    of full-sequence scoring wherever the top two logits are further apart than the logit
    tolerance (so the comparison cannot flip on another CPU)."""
    cfg, weights = _model()
    engine = Engine(LoadedModel(cfg, weights, None, "tiny"))
    prompt = list(np.random.default_rng(1).integers(0, cfg.vocab_size, size=20))
    out = engine.generate(prompt, GenerationConfig(max_new_tokens=150)).token_ids
    assert len(out) == 150
    full = np.asarray(transformer.score(weights, jnp.asarray([prompt + out[:-1]]), cfg))[0, len(prompt) - 1 :]
    top2 = np.sort(full, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * DECODER_ATOL
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(np.asarray(out)[clear], full.argmax(-1)[clear])


BLOCKED_CASES = [  # T, S (cache slots), first position, H, KV, hd, window
    pytest.param(600, 700, 0, 9, 3, 64, None, id="default-model-heads-partial-blocks"),
    pytest.param(513, 1100, 200, 4, 2, 32, None, id="later-start-three-key-blocks"),
    pytest.param(700, 900, 100, 4, 1, 16, 300, id="sliding-window-skips-early-blocks"),
    pytest.param(300, 300, 0, 2, 2, 8, None, id="cache-shorter-than-a-key-block"),
]


@pytest.mark.parametrize("T, S, start, H, KV, hd, window", BLOCKED_CASES)
def test_blocked_attention_matches_float64(T, S, start, H, KV, hd, window):
    """Tolerance: attention_reference.py's bound with XLA's sums in any order (dot_terms = hd) and a
    rescale of the running sums per key block (8 u each) on top of its 40."""
    assert T > attention.QUERY_BLOCK  # several query blocks
    cfg = ModelConfig(vocab_size=8, d_model=H * hd, n_layers=1, n_heads=H, n_kv_heads=KV, head_dim=hd, d_ff=8,
                      max_position=4096, sliding_window=window)
    rng = np.random.default_rng(T + S)
    q = (rng.standard_normal((1, T, H, hd)) * 1.5).astype(np.float32)
    k, v = (rng.standard_normal((1, KV, S, hd)).astype(np.float32) for _ in range(2))
    positions = np.arange(start, start + T, dtype=np.int32)
    got = np.asarray(jax.jit(lambda *a: attention.blocked_attention(*a, cfg, window=window))(q, k, v, positions))
    key_blocks = -(-S // attention.KEY_BLOCK)
    ref, bound = attention_reference(q, k, v, positions, window, dot_terms=hd, combine_terms=40 + 8 * key_blocks)
    assert np.all(np.abs(got - ref) <= bound), float((np.abs(got - ref) / np.maximum(bound, 1e-30)).max())


def test_long_prompt_blocked_equals_one_softmax(monkeypatch):
    """A 600-token prompt through the tiny decoder: scoring and a prefill (blocked attention) equal the
    same model with one softmax over all positions, and decoding goes on from the prefilled cache."""
    cfg, weights = _model()
    cfg = dataclasses.replace(cfg, max_position=1024)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 600)).astype(np.int32)
    blocked = np.asarray(transformer.score(weights, jnp.asarray(tokens), cfg))[0]
    cache = transformer.KVCache.create(cfg, 1, 1024)
    prefilled, cache = transformer.prefill(weights, jnp.asarray(tokens[:, :599]), jnp.int32(599), cache, cfg,
                                           attend=attend_length(599, 1024))
    following, _ = transformer.decode_step(weights, jnp.asarray(tokens[:, 599]), cache, cfg,
                                           attend=attend_length(600, 1024))
    monkeypatch.setattr(attention, "ONE_SOFTMAX_TOKENS", 10**6)  # the one softmax (unjitted: traced anew)
    cache = transformer.KVCache.create(cfg, 1, 600)
    h, _, _ = transformer.forward(weights, jnp.asarray(tokens), cache, cfg)
    one = np.asarray(transformer.logits(weights, h, cfg))[0]
    np.testing.assert_allclose(blocked, one, atol=DECODER_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(prefilled)[0], one[598], atol=DECODER_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(following)[0], one[599], atol=DECODER_ATOL, rtol=0)


def test_blocked_attention_gradient_matches_float64(monkeypatch):
    """The calibration's gradients run through long windows: d sum(out) / dq of the blocked form against
    the one-softmax form in float64. Tolerance: each gradient entry sums S + hd products whose magnitudes
    stay within a few times the largest entry for these operands, so 8 (S + hd) u of that entry."""
    cfg = ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=8,
                      max_position=1024)
    rng = np.random.default_rng(3)
    T = S = 600
    q = rng.standard_normal((1, T, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, 8)).astype(np.float32) for _ in range(2))
    positions = np.arange(T, dtype=np.int32)
    grad = np.asarray(jax.grad(lambda q: attention.blocked_attention(q, k, v, positions, cfg, window=None).sum())(q))
    monkeypatch.setattr(attention, "ONE_SOFTMAX_TOKENS", 10**6)  # the one softmax
    with jax.enable_x64(True):
        k64, v64 = jnp.asarray(k, jnp.float64), jnp.asarray(v, jnp.float64)
        one = lambda q: attention.xla_cached_attention(q, k64, v64, jnp.asarray(positions), cfg=cfg,
                                                         attend=None, window=None).sum()
        ref = np.asarray(jax.grad(one)(jnp.asarray(q, jnp.float64)))
    assert ref.dtype == np.float64
    np.testing.assert_allclose(grad, ref, atol=8 * (S + 8) * U * np.abs(ref).max(), rtol=0)
