"""The native attention kernels against a float64 numpy reference, and their place in the model: the
cached attention of decode steps (jpinfer_cached_attention), whose steps equal the XLA attention's, and
the prompts' tiled attention (jpinfer_prefill_attention), whose prefills and derivatives equal
blocked_attention's.

Tolerance: attention_reference.py's bound, with the kernels' sums. Cached attention: a score sums hd / 8
terms in each of 8 lanes, then 3 lane additions (dot_terms = hd / 8 + 3); at most 16 blocks of slots are
combined with their running maxima (combine_terms = 40). Prefill attention: a score is one chain of hd
products in its lane (dot_terms = hd); its running sums are rescaled once per key tile of 16 slots or more
(16 in the AVX2 build, 64 with AVX-512), 8 u each on top of 40, as for blocked_attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer import ModelConfig
from jpinfer.models import params, transformer
from jpinfer.native import kernels as K
from jpinfer.native import library
from jpinfer.ops import attention

from attention_reference import attention_reference
from native_threads import on_one_thread

pytestmark = pytest.mark.skipif(not library.native_available(),
                                reason=f"native kernels unavailable: {library.unavailable_reason()}")


def native_reference(q, k, v, positions, window, softcap=None):
    return attention_reference(q, k, v, positions, window, dot_terms=q.shape[-1] / 8 + 3, combine_terms=40,
                               softcap=softcap)


def _operands(rng, B, T, H, KV, S, hd):
    q = (rng.standard_normal((B, T, H, hd)) * 1.5).astype(np.float32)
    k = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    v = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    return q, k, v


CASES = [  # B, T, H, KV, S, hd, positions, window
    pytest.param(1, 1, 9, 3, 256, 64, [123], None, id="default-model-decode"),
    pytest.param(1, 1, 4, 4, 64, 8, [0], None, id="first-position"),
    pytest.param(2, 3, 8, 2, 700, 64, [600, 601, 602], None, id="batch2-three-blocks"),
    pytest.param(1, 8, 4, 1, 1200, 128, list(range(1000, 1008)), 300, id="eight-tokens-window"),
    pytest.param(1, 2, 2, 1, 16, 16, [20, 21], None, id="positions-past-the-cache"),
    pytest.param(1, 1, 2, 2, 600, 24, [599], 5, id="window-of-five-hd24"),
    pytest.param(1, 2, 16, 2, 40, 8, [30, 31], None, id="eight-queries-a-kv-head"),
]


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["", "softcap"])
@pytest.mark.parametrize("B, T, H, KV, S, hd, positions, window", CASES)
def test_cached_attention_matches_float64(B, T, H, KV, S, hd, positions, window, softcap):
    rng = np.random.default_rng(S + T)
    q, k, v = _operands(rng, B, T, H, KV, S, hd)
    attend = jax.jit(lambda *a: K.cached_attention(*a, window=window, softcap=softcap))
    got = np.asarray(attend(q, k, v, np.int32(positions)))
    ref, bound = native_reference(q, k, v, positions, window, softcap)
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / np.maximum(bound, 1e-30))


@pytest.mark.parametrize("window", [None, 100])
def test_per_sequence_positions_match_float64_and_each_row_alone(window):
    """Batched decoding: positions (B, T), one row per sequence, rows far apart (one spans three blocks of
    slots, one sees two slots): float64, and each row bit for bit what the kernel gives that row alone (a
    sequence's output does not depend on its batch)."""
    rng = np.random.default_rng(7)
    q, k, v = _operands(rng, 3, 2, 8, 2, 800, 64)
    positions = np.int32([[600, 601], [0, 1], [250, 251]])
    attend = jax.jit(lambda *a: K.cached_attention(*a, window=window))
    got = np.asarray(attend(q, k, v, positions))
    ref, bound = native_reference(q, k, v, positions, window)
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / np.maximum(bound, 1e-30))
    for b in range(3):
        alone = np.asarray(attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], positions[b]))
        np.testing.assert_array_equal(got[b], alone[0])


def test_slots_after_the_last_position_are_never_read():
    """Garbage (NaN) in every slot after the last position changes nothing, and neither do slots a
    window hides: the kernel reads only visible rows."""
    rng = np.random.default_rng(3)
    q, k, v = _operands(rng, 1, 2, 4, 2, 300, 32)
    clean = np.asarray(K.cached_attention(q, k, v, np.int32([200, 201]), window=50))
    k[:, :, 202:], v[:, :, 202:] = np.nan, np.nan
    k[:, :, :150], v[:, :, :150] = np.nan, np.nan  # before both tokens' windows (slots 151.. and 152..)
    np.testing.assert_array_equal(np.asarray(K.cached_attention(q, k, v, np.int32([200, 201]), window=50)), clean)


def test_a_token_that_sees_nothing_gets_zeros():
    rng = np.random.default_rng(4)
    q, k, v = _operands(rng, 1, 2, 2, 1, 16, 8)
    out = np.asarray(K.cached_attention(q, k, v, np.int32([-5, 3])))
    assert np.all(out[0, 0] == 0) and np.all(np.isfinite(out[0, 1])) and np.any(out[0, 1] != 0)


def test_inside_scan_and_bit_identical_for_any_thread_count():
    rng = np.random.default_rng(5)
    q, k, v = _operands(rng, 1, 1, 8, 2, 2048, 64)
    positions = np.int32([[100], [700], [1500], [2047]])

    def run():
        step = lambda carry, p: (carry, K.cached_attention(q, k, v, p))
        return np.asarray(jax.jit(lambda ps: jax.lax.scan(step, 0, ps)[1])(positions))

    one = on_one_thread(run)
    np.testing.assert_array_equal(run(), one)
    for i, p in enumerate(positions[:, 0]):
        ref, bound = native_reference(q, k, v, [p], None)
        assert np.all(np.abs(one[i] - ref) <= bound)


@pytest.mark.parametrize("kernel, bad", [
    *((kernel, bad) for kernel in ("cached", "prefill")
      for bad in ("q_rank", "cache_shape", "dtype", "head_dim", "positions", "window", "softcap")),
    ("cached", "tokens")])
def test_bad_operands_are_refused_clearly(kernel, bad):
    """Each kernel refuses what it does not take with a ValueError: the cached kernel 1-8 tokens, head dim a
    multiple of 8, positions (T,) or (B, T); the prefill kernel any T, head dim a multiple of 16, one row (T,)."""
    rng = np.random.default_rng(6)
    T = 1 if kernel == "cached" else 20
    q, k, v = _operands(rng, 1, T, 4, 2, 32, 16)
    positions, window, softcap = np.arange(5, 5 + T, dtype=np.int32), None, None
    if bad == "q_rank":
        q = q[0]
    elif bad == "cache_shape":
        v = v[:, :, :16]
    elif bad == "dtype":
        k = k.astype(np.float16)
    elif bad == "head_dim":  # a multiple of 4 for the cached kernel; of 8, not 16, for the prefill one
        q, k, v = _operands(rng, 1, T, 4, 2, 32, 12 if kernel == "cached" else 24)
    elif bad == "tokens":
        q = np.repeat(q, 9, axis=1)
        positions = np.arange(9, dtype=np.int32)
    elif bad == "positions":  # the prefill kernel takes no row per sequence
        positions = np.arange(T + 1, dtype=np.int32) if kernel == "cached" else positions[None]
    elif bad == "softcap":
        softcap = 0.0 if kernel == "cached" else -1.0
    else:
        window = 0
    call = K.cached_attention if kernel == "cached" else K.prefill_attention
    with pytest.raises(ValueError):
        call(q, k, v, positions, window=window, softcap=softcap)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_decode_steps_with_native_attention_equal_the_xla_attention(sliding_window, monkeypatch):
    """Decode steps of a tiny GQA decoder: the native attention's logits equal the XLA attention's within
    tolerances.DECODER_ATOL (both float32; the attention sums in another order), over 60 positions
    that cross the XLA path's attention lengths and the window."""
    from tolerances import DECODER_ATOL

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                      max_position=512, sliding_window=sliding_window, eos_token_ids=())
    weights = params.build_weights(cfg, params.init_random(cfg, seed=7, scale=0.3))
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, size=60).astype(np.int32)

    def decode(native: bool) -> np.ndarray:
        monkeypatch.setattr(attention, "native_available", lambda: native)
        # a fresh jit per backend: decode_step's own cache would reuse the other backend's compilation
        step = jax.jit(lambda w, tok, c: transformer.decode_step.__wrapped__(w, tok, c, cfg))
        cache = transformer.KVCache.create(cfg, 1, 128)
        hlo = step.lower(weights, jnp.asarray(tokens[:1]), cache).as_text()
        assert ("jpinfer_cached_attention" in hlo) == native
        out = []
        for token in tokens:
            logits, cache = step(weights, jnp.asarray([token]), cache)
            out.append(np.asarray(logits)[0])
        return np.stack(out)

    np.testing.assert_allclose(decode(True), decode(False), atol=DECODER_ATOL, rtol=0)


def prefill_reference(q, k, v, positions, window, softcap=None):
    key_tiles = -(-k.shape[2] // 16)
    return attention_reference(q, k, v, positions, window, dot_terms=q.shape[-1], combine_terms=40 + 8 * key_tiles,
                               softcap=softcap)


PREFILL_CASES = [  # B, T, H, KV, S, hd, first position, window
    pytest.param(1, 600, 9, 3, 700, 64, 0, None, id="default-model-heads"),
    pytest.param(2, 130, 4, 2, 400, 32 + 16, 200, None, id="batch2-later-start-hd48"),
    pytest.param(1, 300, 4, 1, 500, 80, 100, 70, id="window-hd80"),
    pytest.param(1, 70, 8, 8, 90, 16, 40, None, id="one-query-a-kv-head-positions-past-the-cache"),
    pytest.param(1, 1, 6, 2, 50, 128, 49, None, id="one-token"),
]


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["", "softcap"])
@pytest.mark.parametrize("B, T, H, KV, S, hd, start, window", PREFILL_CASES)
def test_prefill_attention_matches_float64(B, T, H, KV, S, hd, start, window, softcap):
    rng = np.random.default_rng(S + T + hd)
    q, k, v = _operands(rng, B, T, H, KV, S, hd)
    positions = np.arange(start, start + T, dtype=np.int32)
    attend = jax.jit(lambda *a: K.prefill_attention(*a, window=window, softcap=softcap))
    got = np.asarray(attend(q, k, v, positions))
    ref, bound = prefill_reference(q, k, v, positions, window, softcap)
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / np.maximum(bound, 1e-30))


def test_prefill_tokens_do_not_depend_on_the_other_tokens_of_the_call():
    """Any position row, unsorted, a token seeing nothing (-3) among them: each token's output is bit for bit
    its output alone, and the one-token outputs equal float64 within the bound."""
    rng = np.random.default_rng(11)
    q, k, v = _operands(rng, 1, 40, 6, 2, 300, 64)
    positions = rng.permutation(300)[:40].astype(np.int32)
    positions[7] = -3
    attend = jax.jit(lambda *a: K.prefill_attention(*a, window=None))
    together = np.asarray(attend(q, k, v, positions))
    assert np.all(together[0, 7] == 0)
    for t in (0, 7, 21, 39):
        alone = np.asarray(attend(q[:, t : t + 1], k, v, positions[t : t + 1]))
        np.testing.assert_array_equal(together[:, t], alone[:, 0])
    ref, bound = prefill_reference(q, k, v, positions, None)
    assert np.all(np.abs(together - ref) <= bound)


def test_prefill_reads_no_slot_after_the_last_position_or_before_the_first_key_tile():
    """NaN in every slot after the last position, and before the first key tile any token's window
    reaches, changes nothing (inside a tile the kernel reads the slots of its tile and weights the
    invisible ones by zero)."""
    rng = np.random.default_rng(12)
    q, k, v = _operands(rng, 1, 100, 4, 2, 400, 32)
    positions = np.arange(200, 300, dtype=np.int32)
    clean = np.asarray(K.prefill_attention(q, k, v, positions, window=60))
    k[:, :, 300:], v[:, :, 300:] = np.nan, np.nan
    k[:, :, :128], v[:, :, :128] = np.nan, np.nan  # the first token (200) sees slots 141..200: key tiles from 128
    np.testing.assert_array_equal(np.asarray(K.prefill_attention(q, k, v, positions, window=60)), clean)


def test_prefill_inside_scan_and_bit_identical_for_any_thread_count():
    rng = np.random.default_rng(13)
    q, k, v = _operands(rng, 1, 200, 9, 3, 1000, 64)
    starts = np.int32([0, 300, 800])

    def run():
        step = lambda carry, s: (carry, K.prefill_attention(q, k, v, s + jnp.arange(200, dtype=jnp.int32)))
        return np.asarray(jax.jit(lambda ss: jax.lax.scan(step, 0, ss)[1])(starts))

    one = on_one_thread(run)
    np.testing.assert_array_equal(run(), one)
    ref, bound = prefill_reference(q, k, v, np.arange(800, 1000), None)
    assert np.all(np.abs(one[2] - ref) <= bound)


def _long_prompt_model(sliding_window=None):
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48,
                      max_position=1024, sliding_window=sliding_window, eos_token_ids=())
    return cfg, params.build_weights(cfg, params.init_random(cfg, seed=9, scale=0.3))


@pytest.mark.parametrize("sliding_window", [None, 200])
def test_long_prefill_with_native_attention_equals_blocked_attention(sliding_window, monkeypatch):
    """A 700-token prompt (past ONE_SOFTMAX_TOKENS) through a tiny decoder with hd 16: the prefill's logits
    with the native tiled attention equal blocked_attention's within tolerances.DECODER_ATOL, and the next
    decode step from each prefilled cache too."""
    from tolerances import DECODER_ATOL

    cfg, weights = _long_prompt_model(sliding_window)
    tokens = np.random.default_rng(10).integers(0, cfg.vocab_size, size=(1, 701)).astype(np.int32)
    assert tokens.shape[1] - 1 > attention.ONE_SOFTMAX_TOKENS

    def prefill_and_step(native: bool) -> np.ndarray:
        monkeypatch.setattr(attention, "native_available", lambda: native)
        prefill = jax.jit(lambda w, tok, c: transformer.prefill.__wrapped__(w, tok, jnp.int32(700), c, cfg))
        step = jax.jit(lambda w, tok, c: transformer.decode_step.__wrapped__(w, tok, c, cfg))
        cache = transformer.KVCache.create(cfg, 1, 768)
        assert ("jpinfer_prefill_attention" in prefill.lower(weights, jnp.asarray(tokens[:, :700]), cache).as_text()
                ) == native
        first, cache = prefill(weights, jnp.asarray(tokens[:, :700]), cache)
        second, _ = step(weights, jnp.asarray(tokens[:, 700]), cache)
        return np.stack([np.asarray(first)[0], np.asarray(second)[0]])

    np.testing.assert_allclose(prefill_and_step(True), prefill_and_step(False), atol=DECODER_ATOL, rtol=0)


def test_long_prompt_derivatives_through_the_native_attention_are_blocked_attentions():
    """Reverse mode through the model's attention of a 600-token step (the threshold calibration's
    derivatives): the native forward carries blocked_attention's derivatives, equal to them computed
    directly within float32 rounding of the same sums (the forward values differ by the attention's
    rounding, 1e-6 relative, which the derivatives see through the loss's square)."""
    cfg, _ = _long_prompt_model()
    rng = np.random.default_rng(15)
    q, k, v = _operands(rng, 1, 600, 4, 2, 600, 16)
    positions = jnp.arange(600, dtype=jnp.int32)
    loss = lambda attend: lambda q, k: (attend(q, k) ** 2).sum()
    model = loss(lambda q, k: attention.cached_attention(q, k, v, positions, cfg, window=None))
    blocked = loss(lambda q, k: attention.blocked_attention(q, k, v, positions, cfg, window=None))
    assert "jpinfer_prefill_attention" in jax.jit(model).lower(q, k).as_text()
    got = jax.jit(jax.grad(model, argnums=(0, 1)))(q, k)
    want = jax.jit(jax.grad(blocked, argnums=(0, 1)))(q, k)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4 * float(jnp.abs(w).max()), rtol=0)
