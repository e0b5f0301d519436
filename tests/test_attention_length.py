"""Attention over the used part of the KV cache: the ladder of lengths, and decoding across its
rungs equals scoring the whole sequence with full causal attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer import Engine, GenerationConfig, LoadedModel, ModelConfig
from jpinfer.models import params, transformer
from jpinfer.runtime.engine import MIN_ATTEND, attend_length

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
