"""The rotary tables of a prompt are computed once per step, not once per layer that reads them, and are the
same numbers either way (rope._tables)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer import ModelConfig
from jpinfer.config import RopeScaling
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
@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", factor=4.0, original_max_position=64,
                                                       attention_factor=1.25)])
def test_tables_are_cos_and_sin_of_the_angles_exactly(shape, scaling):
    """Both sides of ONCE_ABOVE_POSITIONS, shared and per-sequence positions, unscaled and scaled tables: the
    same bits as cos and sin of the angles computed directly (the conditional changes where XLA computes them,
    not how)."""
    cfg = ModelConfig(vocab_size=32, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=32, d_ff=48,
                      max_position=4096, rope_scaling=scaling, eos_token_ids=())
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 4000, size=shape), jnp.int32)
    cos, sin = jax.jit(lambda p: rope.rope_tables(p, cfg).full)(positions)
    scale = rope.table_scale(cfg)
    assert scale == (1.0 if scaling is None else 1.25)

    def direct(p):
        angles = p.astype(jnp.float32)[..., None] * rope.inverse_frequencies(cfg)
        return (jnp.cos(angles), jnp.sin(angles)) if scale == 1.0 else (jnp.cos(angles) * scale,
                                                                         jnp.sin(angles) * scale)

    want_cos, want_sin = jax.jit(direct)(positions)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(want_cos))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(want_sin))
