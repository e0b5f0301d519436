"""Oracle-mask decode: the sparse op inside the decoder equals dense / masked-dense."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.config import ModelConfig
from jpinfer.ffn import OracleListFFN, oracle_state
from jpinfer.models import params, transformer

from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL


def _model(kind="swiglu", d_ff=48):
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=d_ff, ffn_kind=kind,
        ffn_bias=kind == "relu", norm_kind="layernorm" if kind == "relu" else "rmsnorm",
        positions="learned" if kind == "relu" else "rope", max_position=64,
    )
    return cfg, params.build_weights(cfg, params.init_random(cfg, seed=3, scale=0.3))


@dataclasses.dataclass(frozen=True)
class _MaskedDense:
    """Reference ``ffn_impl``: dense activations times a given 0/1 mask, dense down projection."""

    cfg: ModelConfig

    def __call__(self, index, layer, x, mask):
        act = transformer.ffn_activations(layer, x, self.cfg) * mask.reshape(*x.shape[:-1], -1)
        return transformer.ffn_down(layer, act), None


def _greedy(weights, cfg, prompt, steps, ffn_impl=None, ffn_state=None):
    cache = transformer.KVCache.create(cfg, batch=1, capacity=len(prompt) + steps)
    step_logits, cache = transformer.prefill(
        weights, jnp.asarray([prompt]), jnp.int32(len(prompt)), cache, cfg, ffn_impl, ffn_state)
    out, logits = [], [np.asarray(step_logits)]
    for _ in range(steps):
        token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
        out.append(int(token[0]))
        step_logits, cache = transformer.decode_step(weights, token, cache, cfg, ffn_impl, ffn_state)
        logits.append(np.asarray(step_logits))
    return out, np.stack(logits)


@pytest.mark.parametrize("kind", ["swiglu", "drelu"])
def test_full_list_decoder_equals_dense(kind):
    cfg, weights = _model(kind)
    oracle = OracleListFFN(cfg, capacity=cfg.d_ff)
    state = oracle_state(weights, cfg, float("-inf"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 10)))
    dense = transformer.score(weights, tokens, cfg)
    sparse = transformer.score(weights, tokens, cfg, oracle, state)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), atol=DECODER_ATOL, rtol=0)

    prompt = [1, 5, 9, 2]
    dense_tokens, dense_logits = _greedy(weights, cfg, prompt, 32)
    sparse_tokens, sparse_logits = _greedy(weights, cfg, prompt, 32, oracle, state)
    # well posed: logits within DECODER_ATOL whose top two lie more than twice that apart (>= 0.018 here) pick
    # the same token, on any machine
    top2 = np.sort(dense_logits.reshape(-1, cfg.vocab_size), -1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * DECODER_ATOL
    assert sparse_tokens == dense_tokens
    np.testing.assert_allclose(sparse_logits, dense_logits, atol=DECODER_ATOL, rtol=0)


def test_relu_kind_oracle_is_exact_without_threshold():
    """Inactive ReLU neurons contribute exactly zero: non-zero set only, full capacity = dense."""
    cfg, weights = _model("relu")
    oracle = OracleListFFN(cfg, capacity=cfg.d_ff)
    state = oracle_state(weights, cfg)  # threshold 0: active = non-zero
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(1, 12)))
    cache = transformer.KVCache.create(cfg, 1, 12)
    h, _, aux = transformer.forward(weights, tokens, cache, cfg, oracle, state)
    h_dense, _, _ = transformer.forward(weights, tokens, transformer.KVCache.create(cfg, 1, 12), cfg)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_dense), atol=DECODER_ATOL, rtol=0)
    active_share = np.mean([np.asarray(a.n_active).mean() / cfg.d_ff for a in aux])
    assert 0.2 < active_share < 0.8  # the test really skips neurons


@pytest.mark.parametrize("kind,threshold,capacity", [("swiglu", 0.02, 20), ("reglu", 0.0, 48), ("drelu", 0.0, 10)])
def test_oracle_masks_equal_masked_dense_decoder(kind, threshold, capacity):
    cfg, weights = _model(kind)
    oracle = OracleListFFN(cfg, capacity=capacity)
    state = oracle_state(weights, cfg, threshold)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, 9)))
    cache = transformer.KVCache.create(cfg, 2, 9)
    h, _, aux = transformer.forward(weights, tokens, cache, cfg, oracle, state)

    masks = []
    for a in aux:
        ids, count = np.asarray(a.ids), np.asarray(a.count)
        mask = np.zeros((ids.shape[0], cfg.d_ff), np.float32)
        for m in range(ids.shape[0]):
            mask[m, ids[m, : count[m]]] = 1
        masks.append(jnp.asarray(mask))
        assert (count <= np.asarray(a.n_active)).all()
    clipped = sum(int((np.asarray(a.n_active) - np.asarray(a.count)).sum()) for a in aux)
    assert (clipped > 0) == (capacity < cfg.d_ff)  # small capacities really clip some tokens

    h_ref, _, _ = transformer.forward(weights, tokens, transformer.KVCache.create(cfg, 2, 9), cfg, _MaskedDense(cfg),
                                      masks)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), atol=DECODER_ATOL, rtol=0)
    if kind == "swiglu":  # the masks matter: dropping neurons moved the hidden states (by 0.48), 100x DECODER_ATOL
        h_dense, _, _ = transformer.forward(weights, tokens, transformer.KVCache.create(cfg, 2, 9), cfg)
        assert np.abs(np.asarray(h) - np.asarray(h_dense)).max() > 100 * DECODER_ATOL


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_oracle_layer_selects_exact_active_set(backend):
    """One layer, float64 numpy: the list is the top-K of |a| over the threshold, the output its masked sum."""
    cfg, weights = _model("swiglu")
    layer = weights.layers[0]
    x = np.random.default_rng(4).standard_normal((3, cfg.d_model))
    gate_rows, up_rows = np.split(np.asarray(layer.w_gate_up, np.float64), 2)  # (out, in) rows
    g, u = x @ gate_rows.T, x @ up_rows.T
    mag = np.abs(g / (1 + np.exp(-g)) * u)
    srt = np.sort(mag.ravel())
    threshold = (srt[len(srt) // 2] + srt[len(srt) // 2 + 1]) / 2  # half active, away from any value
    capacity = 20
    oracle = OracleListFFN(cfg, capacity=capacity, backend=backend)
    state = oracle_state(weights, cfg, threshold)[0]
    y, aux = oracle(0, layer, jnp.asarray(x, jnp.float32), state)

    active = mag > threshold
    np.testing.assert_array_equal(np.asarray(aux.n_active), active.sum(-1))
    for m in range(3):
        want = np.argsort(-np.where(active[m], mag[m], -1))[: min(active[m].sum(), capacity)]
        got = np.asarray(aux.ids[m, : int(aux.count[m])])
        np.testing.assert_array_equal(np.sort(got), np.sort(want))
        ref = (g[m, want] / (1 + np.exp(-g[m, want])) * u[m, want]) @ np.asarray(layer.w_down, np.float64)[:, want].T
        np.testing.assert_allclose(np.asarray(y[m]), ref, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_bad_oracle_settings_are_value_errors():
    cfg, weights = _model("swiglu")
    with pytest.raises(ValueError, match="thresholds"):
        oracle_state(weights, cfg)
    with pytest.raises(ValueError, match="2 layers"):
        oracle_state(weights, cfg, [0.1])
    with pytest.raises(ValueError, match="capacities"):
        OracleListFFN(cfg, capacity=cfg.d_ff + 1)
    with pytest.raises(ValueError, match="2 layers"):
        OracleListFFN(cfg, capacity=(4, 4, 4))
