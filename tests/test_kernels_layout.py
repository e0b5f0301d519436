"""Neuron-major FFN layout: bundles hold the right rows, subsets keep the id table."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.config import ModelConfig
from jpinfer.models import params
from jpinfer.sparse import neurons
from jpinfer.sparse.cpu_backend import huge_page_array, huge_page_ffn
from jpinfer.sparse.op import sparse_ffn

from tolerances import KERNEL_ATOL, KERNEL_RTOL


def _dense(rng, d=16, n=24, gate=True, bias=False):
    w = lambda *s: rng.standard_normal(s).astype(np.float32)
    # The decoder's (out, in) layout: gate/up (n, d), a row per neuron; down (d, n), a column per neuron.
    return (w(n, d) if gate else None), w(n, d), w(d, n), (w(n) if bias else None), (w(d) if bias else None)


def test_bundles_hold_gate_up_and_down_of_each_neuron():
    wg, wu, wd, _, _ = _dense(np.random.default_rng(0))
    ffn = neurons.from_arrays("swiglu", wg, wu, wd)
    rows = np.asarray(ffn.rows)
    assert rows.shape == (24, 3, 16)
    for i in (0, 7, 23):
        np.testing.assert_array_equal(rows[i, 0], wg[i])
        np.testing.assert_array_equal(rows[i, 1], wu[i])
        np.testing.assert_array_equal(rows[i, 2], wd[:, i])
    np.testing.assert_array_equal(np.asarray(ffn.ids), np.arange(24))


def test_relu_kind_bundles_up_and_down_with_biases():
    _, wu, wd, bu, bd = _dense(np.random.default_rng(1), gate=False, bias=True)
    ffn = neurons.from_arrays("relu", None, wu, wd, bu, bd)
    assert ffn.rows.shape == (24, 2, 16) and not ffn.gated
    np.testing.assert_array_equal(np.asarray(ffn.rows[5, 0]), wu[5])
    np.testing.assert_array_equal(np.asarray(ffn.rows[5, 1]), wd[:, 5])
    np.testing.assert_array_equal(np.asarray(ffn.b_up), bu)


def test_from_layer_uses_the_layer_ffn_tensors():
    cfg = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                      ffn_kind="drelu")
    layer = params.build_weights(cfg, params.init_random(cfg)).layers[0]
    ffn = neurons.from_layer(layer, "drelu")
    np.testing.assert_array_equal(np.asarray(ffn.rows[3, 0]), np.asarray(layer.w_gate_up[3]))  # gate row 3
    np.testing.assert_array_equal(np.asarray(ffn.rows[3, 1]), np.asarray(layer.w_gate_up[cfg.d_ff + 3]))  # up row 3
    np.testing.assert_array_equal(np.asarray(ffn.rows[3, 2]), np.asarray(layer.w_down[:, 3]))
    assert ffn.kind == "drelu"


def test_subset_table_composes_and_hot_plus_cold_equals_whole():
    rng = np.random.default_rng(2)
    wg, wu, wd, _, bd = _dense(rng, bias=True)
    ffn = neurons.from_arrays("reglu", wg, wu, wd, b_down=bd)
    hot_pos = np.array([20, 3, 9, 11], np.int32)
    hot, table = ffn.subset(hot_pos)
    np.testing.assert_array_equal(table, hot_pos)
    np.testing.assert_array_equal(np.asarray(hot.rows), np.asarray(ffn.rows)[hot_pos])
    inner, inner_table = hot.subset(np.array([2, 0]))
    np.testing.assert_array_equal(inner_table, [9, 20])  # compact positions -> original ids
    cold, cold_table = ffn.subset(np.setdiff1d(np.arange(24), hot_pos), with_b_down=False)
    assert cold.b_down is None and table.dtype == cold_table.dtype == np.int32

    x = jnp.asarray(rng.standard_normal(16), jnp.float32)
    whole = sparse_ffn(ffn, x, jnp.arange(24, dtype=jnp.int32), 24)
    split = (sparse_ffn(hot, x, jnp.arange(4, dtype=jnp.int32), 4)
             + sparse_ffn(cold, x, jnp.arange(20, dtype=jnp.int32), 20))
    # the same 24 neuron terms summed in two groups (unscaled weights: |y| 6..69, the rtol part dominates)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_bad_layouts_and_subsets_are_value_errors():
    wg, wu, wd, _, _ = _dense(np.random.default_rng(3))
    with pytest.raises(ValueError, match="kind"):
        neurons.from_arrays("gelu", wg, wu, wd)
    with pytest.raises(ValueError, match="gate"):
        neurons.from_arrays("relu", wg, wu, wd)
    with pytest.raises(ValueError, match="gate"):
        neurons.from_arrays("swiglu", None, wu, wd)
    with pytest.raises(ValueError, match="w_down"):
        neurons.from_arrays("swiglu", wg, wu, wd.T)
    ffn = neurons.from_arrays("swiglu", wg, wu, wd)
    with pytest.raises(ValueError, match=r"\[0, 24\)"):
        ffn.subset([0, 24])
    with pytest.raises(ValueError, match="repeat"):
        ffn.subset([1, 1])
    with pytest.raises(ValueError, match="integer"):
        ffn.subset([0.5])


def test_huge_page_copies_hold_the_same_values():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((300, 3, 40)).astype(np.float32)
    x = huge_page_array(a)
    np.testing.assert_array_equal(np.asarray(x), a)
    assert x.devices() == {jax.devices("cpu")[0]}
    if sys.platform.startswith("linux"):  # imported without a copy, at the mapping's 2 MiB-aligned start
        assert x.unsafe_buffer_pointer() % (2 << 20) == 0

    wg, wu, wd, _, _ = _dense(rng)
    ffn = neurons.from_arrays("swiglu", wg, wu, wd)
    xin = jnp.asarray(rng.standard_normal(16), jnp.float32)
    ids = jnp.asarray(rng.permutation(24)[:10].astype(np.int32))
    np.testing.assert_array_equal(np.asarray(sparse_ffn(huge_page_ffn(ffn), xin, ids, 7)),
                                  np.asarray(sparse_ffn(ffn, xin, ids, 7)))
