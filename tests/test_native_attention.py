"""The native cached attention (jpinfer_cached_attention) against a float64 numpy reference, and its
place in the model: decode steps with it equal the XLA attention's.

Tolerance: attention_reference.py's bound, with the kernel's sums: a score sums hd / 8 terms in each of
8 lanes, then 3 lane additions (dot_terms = hd / 8 + 3); at most 16 blocks of slots are combined with
their running maxima (combine_terms = 40).
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


@pytest.mark.parametrize("bad", ["q_rank", "cache_shape", "dtype", "head_dim", "tokens", "positions", "window",
                                 "softcap"])
def test_bad_operands_are_refused_clearly(bad):
    rng = np.random.default_rng(6)
    q, k, v = _operands(rng, 1, 1, 4, 2, 32, 16)
    positions, window, softcap = np.int32([5]), None, None
    if bad == "q_rank":
        q = q[0]
    elif bad == "cache_shape":
        v = v[:, :, :16]
    elif bad == "dtype":
        k = k.astype(np.float16)
    elif bad == "head_dim":
        q, k, v = q[..., :12], k[..., :12], v[..., :12]
    elif bad == "tokens":
        q = np.repeat(q, 9, axis=1)
        positions = np.arange(9, dtype=np.int32)
    elif bad == "positions":
        positions = np.int32([5, 6])
    elif bad == "softcap":
        softcap = 0.0
    else:
        window = 0
    with pytest.raises(ValueError):
        K.cached_attention(q, k, v, positions, window=window, softcap=softcap)


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
        monkeypatch.setattr(transformer, "native_available", lambda: native)
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
