"""bench/hybrid_host.py and jpinfer.bench.host_half: the cold half it times is the FFN of the right neurons (the
planted set minus the hot ones) against float64 numpy references written apart from the code, its bytes per token
are a brute-force count of the bytes the list reads, the placement puts the non-FFN part first, and the script's
table has its columns (small shapes; no timing checked).

References: float weights against a float64 FFN over the neurons' rows (tolerance ``KERNEL_RTOL``/``KERNEL_ATOL``,
tests/tolerances.py: d = 256 inputs of O(1) sum with sigma ~ sqrt(256) u, ~70 neurons summed, still ~10x under it);
int8 bundles and int4 records against test_sparse_int8's and test_sparse_int4's exact-integer references (x of
integers with a +-127 in each block of 32, so its int8 quantization per token and per block is exact; the int4 block
scales are powers of two, so the 4-bit products are exact: their module docstrings), within their 16 u |y|.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
from test_sparse_int4 import integer_tokens
from test_sparse_int4 import reference as int4_reference
from test_sparse_int8 import MARGIN, assert_scaled_equal
from test_sparse_int8 import reference as int8_reference

from jpinfer.bench import host_half
from jpinfer.config import ModelConfig
from jpinfer.quant.q4 import QK
from jpinfer.sparse import from_layer

from activation_reference import activation64
from tolerances import KERNEL_ATOL, KERNEL_RTOL

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import hybrid_host  # noqa: E402

CFG = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=704,
                  ffn_kind="swiglu", name="test shapes")
TOKENS = 4
# of the weights: the non-FFN part (42%, a 1-token KV cache) first, then neurons; at these sizes a split layer
# never pays its synchronisation in the solver's cost model, so it places whole layers (here the second)
BUDGET = 0.8


def q4_values(matrix) -> np.ndarray:
    """A Q4_0 matrix's weights in float64, from its bytes: byte i of a block's 16 holds element i (low nibble) and
    element i + 16 (high), w = scale * (q - 8)."""
    packed = np.asarray(matrix.packed).reshape(matrix.outputs, -1, QK // 2)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)
    return (np.asarray(matrix.scales, np.float64)[..., None] * (q - 8)).reshape(matrix.outputs, -1)


def float_reference(layer, x: np.ndarray, neurons: list[int]) -> np.ndarray:
    gate_up, down = np.asarray(layer.w_gate_up, np.float64), np.asarray(layer.w_down, np.float64)
    n, x64 = down.shape[1], np.asarray(x, np.float64)
    act = activation64("swiglu", gate_up[neurons] @ x64, gate_up[[n + i for i in neurons]] @ x64)
    return down[:, neurons] @ act


@pytest.fixture(scope="module")
def setup():
    activity = host_half.Activity.planted(CFG, 0.1, TOKENS)
    out = {}
    for fmt in host_half.FORMATS:
        layer = host_half.random_ffn_layer(CFG, fmt, np.random.default_rng([7, host_half.FORMATS.index(fmt)]))
        sizes = host_half.accelerator_sizes(CFG, host_half.accelerator_weight_bytes(fmt, layer), context=1)
        out[fmt] = layer, from_layer(layer, CFG.ffn_kind), host_half.hot_set(activity.frequencies, sizes, BUDGET), sizes
    return activity, out


def cold_neurons(sets: np.ndarray, hot: np.ndarray, token: int) -> list[int]:
    """The brute-force cold list: the token's active neurons that are not hot, in id order."""
    hot_ids = {int(i) for i in np.flatnonzero(hot)}
    return sorted(int(i) for i in sets[token] if int(i) not in hot_ids)


@pytest.mark.parametrize("fmt", host_half.FORMATS)
def test_the_timed_cold_half_is_the_cold_neurons_ffn(setup, fmt):
    activity, built = setup
    layer, full, _, _ = built[fmt]
    frequencies, sets = activity.frequencies[1], activity.sets[1]
    mask = frequencies >= np.quantile(frequencies, 0.7)  # the hottest 30% on the accelerator
    cold = host_half.cold_layer(full, mask, sets)
    rng = np.random.default_rng(3)  # O(1) inputs for float weights (the tolerance's), integer ones for the others
    xs = rng.standard_normal((TOKENS, CFG.d_model)) if fmt == "float" else integer_tokens(rng, TOKENS, CFG.d_model)
    xs = xs.astype(np.float32)
    for t in range(TOKENS):
        neurons = cold_neurons(sets, mask, t)
        assert 0 < len(neurons) < sets.shape[1], "setup: the token needs hot and cold active neurons"
        y = np.asarray(host_half.cold_call(cold, xs[t], t), np.float64)
        parts, ids, counts = host_half.chain_inputs([cold, cold], t)
        chained = host_half.cold_chain(parts, xs[t], ids, counts)  # the one-call variant: the same sums, in turn
        np.testing.assert_array_equal(np.asarray(chained), np.stack([y, y]).astype(np.float32))
        if cold.direct is not None:  # the direct host call: the same kernel, the same bits
            np.testing.assert_array_equal(host_half.cold_direct(cold, xs[t], t), y.astype(np.float32))
        if fmt == "float":
            ref = float_reference(layer, xs[t], neurons)
            np.testing.assert_allclose(y, ref, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
            continue
        ids, count = np.asarray(neurons, np.int32), len(neurons)
        down, down_scales = np.asarray(full.rows)[:, -1], np.asarray(full.down_scales)
        if fmt == "int8":
            ref, margin, _, _ = int8_reference(np.asarray(full.rows), np.asarray(full.scales), down_scales, None,
                                               xs[t][None], ids, count, "swiglu")
        else:
            ref, margin, _, _ = int4_reference(q4_values(layer.w_gate_up), down, down_scales, None, xs[t][None], ids,
                                               count, "swiglu")
        assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
        assert_scaled_equal(y[None], ref, f"{fmt} token {t}")


@pytest.mark.parametrize("fmt", host_half.FORMATS)
def test_bytes_per_token_count_the_rows_the_list_reads(setup, fmt):
    activity, built = setup
    _, full, hot, _ = built[fmt]
    for i, (mask, sets) in enumerate(zip(hot.masks, activity.sets)):
        cold = host_half.cold_layer(full, mask, sets)
        for t in range(TOKENS):
            neurons = cold_neurons(sets, mask, t)
            positions = cold.ids[t, :cold.counts[t]]
            assert np.asarray(cold.part.ids)[positions].tolist() == neurons
            records = None if cold.part.gate_up is None else cold.part.gate_up.records
            read = sum(np.asarray(a)[positions].nbytes for a in (cold.part.rows, cold.part.scales, records)
                       if a is not None)
            read += 0 if cold.part.down_scales is None else np.asarray(cold.part.down_scales).nbytes
            if not any(cold_neurons(sets, mask, s) for s in range(TOKENS)):  # no host call (capacity 0)
                assert not cold.calls_host
                read = 0
            assert cold.bytes_read(t) == read, f"layer {i} token {t}"


@pytest.mark.parametrize("fmt", host_half.FORMATS)
def test_the_placement_holds_the_non_ffn_part_first(setup, fmt):
    activity, built = setup
    _, _, hot, sizes = built[fmt]
    n_hot = sum(int(m.sum()) for m in hot.masks)
    assert hot.feasible and n_hot and hot.dense_bytes + n_hot * sizes.neuron_bytes <= hot.budget_bytes
    assert hot.dense_bytes == sizes.required_bytes + sizes.embed_bytes + sizes.lm_head_bytes
    below = host_half.hot_set(activity.frequencies, sizes, 0.5 * hot.dense_bytes / host_half.weights_bytes(sizes))
    assert not below.feasible and below.hot_share == 0


def test_the_script_records_every_budget_and_format(tmp_path):
    out = tmp_path / "host.md"
    budgets = ["0.3", "0.8"]  # below and above the non-FFN part
    assert hybrid_host.main(["--model", "small", "--layers", "2", "--tokens", "2", "--rounds", "2", "--copy-mib", "4",
                             "--context", "1", "--budgets", *budgets, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [(r["budget"], r["format"]) for r in data["rows"]] == [
        (float(b), f) for f in host_half.FORMATS for b in budgets]
    for row in data["rows"]:
        assert len(row["samples"]) == 2 * 2 and row["call_s"] > 0 and row["chain_s"] > 0 and row["direct_s"] > 0
        assert row["copy_rate"] > 0
    assert [r["feasible"] for r in data["rows"]][:2] == [False, True]
    text = out.read_text()
    assert "| " + " | ".join(hybrid_host.COLUMNS) + " |" in text and "Command: `python bench/hybrid_host.py" in text
