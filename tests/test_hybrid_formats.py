"""The hybrid mode in every weights format: hot neurons on device 0, cold ones on device 1 (two simulated CPU
devices), int8 and int4 as well as float, chosen by predictors or by thresholds.

W8A8 (int8, and the int8 down slots of int4) quantizes a token's activations with one scale per call, the peak over
the neurons that call computes. Each part of a split layer is its own call, so it rounds its activations on its own
peak: the hybrid computes the same neurons as the one-device engine with a finer rounding of the activations, not
the same integers. The references are therefore per part: a layer against each part's float64 int8 reference
(test_sparse_int8.py / test_sparse_int4.py), a whole decode against the same parts computed on one device, and the
distance from the float model against the one-device int8 / int4 engine's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sparse_int4 as int4_reference
import test_sparse_int8 as int8_reference
from test_modes import PROMPT, all_active, assert_decodes_like, forced_logits, half_masks
from test_quantized import int4_engine as int4_blocks_engine
from test_sparse_int4 import int4_engine, integer_tokens
from test_sparse_int8 import MARGIN, U, assert_scaled_equal, int8_engine

import jpinfer
from jpinfer import GenerationConfig
from jpinfer.modes import build_engine
from jpinfer.profiler import SparsityThresholds
from jpinfer.quant import q4
from jpinfer.runtime.engine import FfnStrategy
from jpinfer.sparse import (
    NeuronFFN,
    ThresholdLayout,
    all_rows_ffn,
    neurons,
    sparse_ffn,
    threshold_ffn,
    threshold_layout,
)

from profiler_fixtures import ffn_inputs, tiny_engine
from tolerances import DECODER_ATOL

QUANTIZED = {"int8": int8_engine, "int4": int4_engine}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def part_ids(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.flatnonzero(mask).astype(np.int32), np.flatnonzero(~mask).astype(np.int32)


def part_reference(part: NeuronFFN, x: np.ndarray, kind: str) -> tuple[np.ndarray, float, np.ndarray]:
    """(y float64 (T, d), the smallest rounding margin, what rounding near a boundary could move y by) of a part's
    int8 (or int4 records') FFN over all its neurons, as the format's float64 reference computes it."""
    n = part.n_neurons
    ids = np.arange(n, dtype=np.int32)
    b_up = None if part.b_up is None else np.asarray(part.b_up)
    down_scales = np.asarray(part.down_scales)
    if part.gate_up is None:
        y, margin, flips, _ = int8_reference.reference(np.asarray(part.rows), np.asarray(part.scales), down_scales,
                                                       b_up, x, ids, n, kind)
    else:
        w = np.asarray(q4.dequantize(part.gate_up.matrix()), np.float64)
        y, margin, flips, _ = int4_reference.reference(w, np.asarray(part.rows[:, 0]), down_scales, b_up, x, ids, n,
                                                       kind)
    return y, margin, flips


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["swiglu", "relu"])
def test_a_hybrid_layer_is_the_sum_of_its_parts_float64_references(fmt, kind):
    """One decode token through one split layer of the hybrid (all neurons listed): the hot part's int8 FFN plus the
    cold part's, each its float64 reference (its own activation peak), plus b_down. The parts come from the model's
    own layer here, not from the engine, so a part that lost its integers or its scales on the way to its device
    fails. int4: tokens whose every block of 32 holds a +-127, so the kernel's per-block int8 input is exact."""
    dense = QUANTIZED[fmt](kind)
    cfg = dense.cfg
    masks = half_masks(cfg, seed=3)
    hybrid = build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=cfg.d_ff, placement=masks)
    accelerator, host = jax.devices("cpu")[:2]
    i = 1
    cold = hybrid.ffn.impl.cold[i]
    assert cold.rows.dtype == jnp.int8 and cold.rows.device == host
    assert hybrid.ffn.state[i].hot.rows.dtype == jnp.int8 and hybrid.ffn.state[i].hot.rows.device == accelerator
    rng = np.random.default_rng(4)
    x = (integer_tokens(rng, 1, cfg.d_model) if fmt == "int4" else
         ffn_inputs(tiny_engine(kind), rng.integers(0, 40, (1, 16)))[i][:1].astype(np.float32))
    layer = dense.weights.layers[i]
    whole = neurons.from_layer(layer, kind)
    expected, extra = 0.0, 0.0
    for ids, with_b_down in zip(part_ids(masks[i]), (True, False)):
        y, margin, flips = part_reference(whole.subset(ids, with_b_down=with_b_down)[0], x, kind)
        assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
        expected, extra = expected + y, extra + flips + 32 * U * np.abs(y)  # each part's sum scaled, then added
    if layer.b_down is not None:
        expected = expected + np.asarray(layer.b_down, np.float64)
    got, _ = hybrid.ffn.impl(i, hybrid.weights.layers[i], jax.device_put(jnp.asarray(x)[None], accelerator),
                             hybrid.ffn.state[i])
    assert_scaled_equal(np.asarray(got)[0], expected, f"{fmt} {kind}", extra)


@dataclasses.dataclass(frozen=True)
class PartsOnOneDevice:
    """Reference FFN strategy: each layer's hot and cold parts (state: the pair) computed on one device and added,
    as the hybrid computes each part: a prompt over every neuron, a decode token over its full list; a threshold
    part keeps what its thresholds keep."""

    def __call__(self, i, layer, x, state):
        tokens = x.reshape(-1, x.shape[-1])
        total = 0.0
        for part in state:
            if isinstance(part, ThresholdLayout):
                y = threshold_ffn(part, tokens)[0]
            elif tokens.shape[0] > 1:
                y = all_rows_ffn(part, tokens)
            else:
                y = sparse_ffn(part, tokens[0], jnp.arange(part.n_neurons, dtype=jnp.int32), part.n_neurons)
            total = total + y.reshape(x.shape)
        return total, None


def thresholds_for(cfg) -> SparsityThresholds:
    """Per-layer FFN thresholds that skip some of the tiny model's inputs and activations (activations ~0.1, inputs
    ~1 in size)."""
    full = lambda v: np.full(cfg.n_layers, v, np.float32)
    return SparsityThresholds(full(0.02), full(0.3), {}, {}, "given")


def split_reference(dense: jpinfer.Engine, masks: list[np.ndarray], thresholds: SparsityThresholds | None
                    ) -> jpinfer.Engine:
    """``dense`` with every layer's FFN the sum of its two parts on one device, built from the model's layers."""
    cfg, states = dense.cfg, []
    for i, (layer, mask) in enumerate(zip(dense.weights.layers, masks)):
        hot_ids, cold_ids = part_ids(mask)
        if thresholds is None:
            whole = neurons.from_layer(layer, cfg.ffn_kind)
            states.append((whole.subset(hot_ids)[0], whole.subset(cold_ids, with_b_down=False)[0]))
        else:
            split = lambda ids, with_b_down: threshold_layout.from_layer(
                layer, cfg.ffn_kind, input_threshold=float(thresholds.input[i]),
                activation_threshold=float(thresholds.activation[i]), neurons=ids, with_b_down=with_b_down)
            states.append((split(hot_ids, True), split(cold_ids, False)))
    return dense.with_ffn(FfnStrategy(PartsOnOneDevice(), states, "parts on one device"))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("chooser", ["predictors", "thresholds"])
def test_the_hybrid_decodes_like_its_parts_on_one_device(fmt, chooser):
    """Every neuron listed (predictors) or the thresholds' choice: the two-device hybrid's greedy tokens and forced
    logits are those of the same parts computed on one device (the same products; DECODER_ATOL for the order of the
    final sums). Against the float model its logits stay within twice the one-device quantized engine's distance:
    each part's activation rounding is no coarser than the whole layer's, and the weights' and inputs' rounding is
    the same, so the split at most doubles the one term it changes."""
    dense = QUANTIZED[fmt]("swiglu")
    masks = half_masks(dense.cfg, seed=5)
    thresholds = thresholds_for(dense.cfg) if chooser == "thresholds" else None
    if thresholds is None:
        hybrid = build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=dense.cfg.d_ff,
                              placement=masks)
        one_device = build_engine(dense.model, "sparse", predictors=all_active(dense), capacity=dense.cfg.d_ff)
    else:
        hybrid = build_engine(dense.model, "hybrid", thresholds=thresholds, placement=masks)
        one_device = build_engine(dense.model, "threshold", thresholds=thresholds)
    assert all(part.n_neurons for part in hybrid.ffn.impl.cold)
    assert_decodes_like(hybrid, split_reference(dense, masks, thresholds), 16, rtol=0, atol=DECODER_ATOL)
    forced = dense.generate(PROMPT, GenerationConfig(max_new_tokens=8)).token_ids
    float_logits = forced_logits(tiny_engine("swiglu"), PROMPT, forced)
    hybrid_error = np.abs(forced_logits(hybrid, PROMPT, forced) - float_logits).max()
    one_device_error = np.abs(forced_logits(one_device, PROMPT, forced) - float_logits).max()
    assert hybrid_error <= 2 * one_device_error


def test_a_layer_wholly_on_one_device_leaves_an_empty_4bit_part_that_runs():
    """A layer whose neurons all sit on one device leaves the other part empty: with d_ff a whole number of 4-bit
    blocks the down matrix is 4-bit too, and an empty part's prompt reads an empty 4-bit matrix. Each part of a
    whole layer is the layer itself, so the hybrid computes the one-device engine's integers (DECODER_ATOL for the
    order of the final sums)."""
    dense = int4_blocks_engine("swiglu")
    cfg = dense.cfg
    assert cfg.d_ff % q4.QK == 0
    masks = [np.zeros(cfg.d_ff, bool), np.ones(cfg.d_ff, bool)]  # layer 0 wholly on the host, layer 1 wholly not
    hybrid = build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=cfg.d_ff, placement=masks)
    assert hybrid.ffn.state[0].hot.n_neurons == 0 and hybrid.ffn.impl.cold[1].n_neurons == 0
    sparse = build_engine(dense.model, "sparse", predictors=all_active(dense), capacity=cfg.d_ff)
    assert_decodes_like(hybrid, sparse, 8, rtol=0, atol=DECODER_ATOL)


def test_the_host_half_called_directly_decodes_as_its_jitted_call(monkeypatch):
    """The hybrid's host callback runs each decode token's cold list through the direct host call of the native
    kernel (``sparse.host_sparse_ffn``); with it replaced by the jitted ``sparse_ffn`` on the host device (no direct
    calls), the greedy tokens and the forced logits are the same bits: the same kernel underneath. int4 (its records
    and the down slots' view); every format's direct call against its FFI kernel: test_native_host.py, and the
    other hybrid tests run the direct calls too."""
    dense = int4_engine("relu")
    masks = half_masks(dense.cfg, seed=5)
    build = lambda: build_engine(dense.model, "hybrid", predictors=all_active(dense), capacity=dense.cfg.d_ff,
                                 placement=masks)
    import jpinfer.modes.hybrid as hybrid_module  # noqa: PLC0415

    calls, original = [], hybrid_module.host_sparse_ffn

    def counted(ffn):
        call = original(ffn)
        return call and (lambda *a: calls.append(1) or call(*a))

    with monkeypatch.context() as patch:
        patch.setattr(hybrid_module, "host_sparse_ffn", counted)
        direct = build()
    assert all(call is not None for call in direct.ffn.impl.held().direct)
    with monkeypatch.context() as patch:
        patch.setattr(hybrid_module, "host_sparse_ffn", lambda ffn: None)
        jitted = build()
    assert_decodes_like(direct, jitted, 8, rtol=0, atol=0)
    assert len(calls) >= 8 * dense.cfg.n_layers  # every decode step's every layer called its host half directly
