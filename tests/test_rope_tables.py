"""The rotary tables of a prompt are computed once per step, not once per layer that reads them, and are the
same numbers either way (rope._tables)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer import ModelConfig
from jpinfer.models import params, rope, transformer


@pytest.mark.parametrize("n_layers", [2, 6])
def test_a_prompts_tables_are_computed_once_whatever_the_layers(n_layers):
    """XLA fused cos and sin into each layer's q and k rotation (2 x n_layers copies) until the tables were
    computed behind a conditional: the compiled prefill holds one cosine and one sine per branch."""
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                      max_position=256, eos_token_ids=())
    weights = params.build_weights(cfg, params.init_random(cfg, seed=1, scale=0.3))
    tokens = jnp.zeros((1, 64), jnp.int32)
    cache = transformer.KVCache.create(cfg, 1, 64)
    hlo = transformer.prefill.lower(weights, tokens, jnp.int32(64), cache, cfg).compile().as_text()
    assert 1 <= hlo.count(" cosine(") <= 2 and 1 <= hlo.count(" sine(") <= 2


@pytest.mark.parametrize("shape", [(3,), (64,), (2, 40)])
@pytest.mark.parametrize("scale", [1.0, 1.25])
def test_tables_are_cos_and_sin_of_the_angles_exactly(shape, scale):
    """Both sides of ONCE_ABOVE_POSITIONS, shared and per-sequence positions: the same bits as cos and sin
    of the angles computed directly (the conditional changes where XLA computes them, not how)."""
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 4000, size=shape), jnp.int32)
    inverse = 1.0 / (10000.0 ** (jnp.arange(0, 16, dtype=jnp.float32) / 16))
    cos, sin = jax.jit(lambda p: rope._tables(p, inverse, scale))(positions)
    angles = positions.astype(jnp.float32)[..., None] * inverse
    want = jax.jit(lambda a: (jnp.cos(a) * scale, jnp.sin(a) * scale) if scale != 1.0 else (jnp.cos(a), jnp.sin(a)))
    want_cos, want_sin = want(angles)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(want_cos))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(want_sin))
