"""The sparse FFN of an int4 model: its 4-bit gate/up rows in records by neuron and int8 down slots
(jpinfer.native.kernels.sparse_ffn_q4, native and XLA) against a float64 numpy reference written apart from the
code, the layout (sparse.neurons) against the dense int4 FFN, and the sparse int4 engine against the dense one.

Exact gate/up. The inputs are chosen so that every float operation of the 4-bit products is exact: x holds
integers in [-127, 127] with a +-127 in each block of 32 (so each block's int8 quantization is x itself with scale
127 * fl(1/127) = 1.0 exactly), the blocks' scales and mins are powers of two (2^-7..2^-10), and d <= 576 keeps
every partial sum a multiple of 2^-10 below 576 * (15 * 2^-7 + 2^-8) * 127 < 2^14, so within float32's 24 bits:
the kernel's block sums, scalings and float32 accumulations in any order give the float64 value exactly. What
remains is the int8 tests' situation (test_sparse_int8.py: the float32 activation against float64, an activation
near a rounding boundary checked away, |dy| <= 16 u |y|).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import all_active, assert_decodes_like
from test_native_kernels import BACKENDS, list_cases
from test_sparse_int8 import (
    MARGIN,
    U,
    assert_right_under_jit_and_scan,
    assert_scaled_equal,
    assert_thread_independent,
    down_reference,
    listed_positions,
)

import jpinfer
from jpinfer.config import UNGATED_KINDS
from jpinfer.models import quantized, transformer
from jpinfer.modes import build_engine
from jpinfer.native import kernels as K
from jpinfer.quant import int8, q4
from jpinfer.quant.q4 import QK, Q4Bundles, Q4Matrix
from jpinfer.sparse import all_rows_ffn, neurons, sparse_ffn

from profiler_fixtures import ffn_inputs, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL

N = 64
D = 320  # 10 blocks: one octet of eight, then two tail blocks one at a time


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def records_of(packed: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, slots: int) -> np.ndarray:
    """The records (n, bytes) of a (slots n, d) 4-bit matrix's rows as Q4Bundles' docstring lays them out, written
    here with numpy: neuron i's rows i, n + i, ... packed, then their float16 scales as bytes, then their mins."""
    n = packed.shape[0] // slots
    by_neuron = lambda a: np.concatenate([a[s * n:(s + 1) * n] for s in range(slots)], axis=1)
    halves = lambda a: np.ascontiguousarray(a, np.float16).view(np.uint8)
    parts = [by_neuron(packed), by_neuron(halves(scales))] + ([] if mins is None else [by_neuron(halves(mins))])
    return np.concatenate(parts, axis=1)


def q4_ffn(kind: str, fmt: str = "q4_0", seed: int = 0, n: int = N, d: int = D):
    """(gate_up Q4Bundles (n records of P rows of d), its float64 weights (P n, d), int8 down (n, d), down scales
    (d,), b_up): random nibbles, block scales 2^-7..2^-10 and (q4_1) mins +-2^-8..2^-10, so every product of the
    kernel is exact (module docstring); the down slots quantized by the project's int8 quantizer with a few strong
    neurons."""
    rng = np.random.default_rng(seed)
    rows = (1 if kind in UNGATED_KINDS else 2) * n
    nibbles = rng.integers(0, 16, (rows, d // QK, QK))
    scales = 2.0 ** -rng.integers(7, 11, (rows, d // QK))
    mins = rng.choice([-1, 1], (rows, d // QK)) * 2.0 ** -rng.integers(8, 11, (rows, d // QK))
    if fmt == "q4_0":
        w = scales[..., None] * (nibbles - 8)
    else:
        w = scales[..., None] * nibbles + mins[..., None]
    # byte i of a block: element i in the low nibble, element i + 16 in the high one (llama.cpp's order)
    packed = (nibbles[..., :16] | nibbles[..., 16:] << 4).astype(np.uint8).reshape(rows, d // 2)
    slots = rows // n
    gate_up = Q4Bundles(jnp.asarray(records_of(packed, scales, mins if fmt == "q4_1" else None, slots)), d, slots, fmt)
    down = rng.standard_normal((d, n)).astype(np.float32)
    down[:, ::9] *= 8
    dn = int8.quantize(down)
    b_up = (rng.standard_normal(n) * 0.5).astype(np.float32)
    return gate_up, w.reshape(rows, d), np.asarray(dn.values).T.copy(), np.asarray(dn.scales), b_up


def integer_tokens(rng, T: int, d: int = D) -> np.ndarray:
    """x (T, d) float32 integers in [-127, 127], each block of 32 holding a +-127 (its int8 scale is exactly 1)."""
    x = rng.integers(-127, 128, (T, d // QK, QK))
    x[..., 0] = rng.choice([-127, 127], (T, d // QK))
    return rng.permuted(x, axis=-1).reshape(T, d).astype(np.float32)


def reference(w, down, down_scales, b_up, x, ids, count, kind, weights=None):
    """``down_reference`` with gate/up the exact float64 products of the 4-bit rows' values (module docstring)."""
    n = down.shape[0]
    listed, positions = listed_positions(ids, count, n)
    h = [np.asarray(x, np.float64) @ w[np.asarray(listed, np.int64) + s * n].T
         for s in range(w.shape[0] // n)]  # (T, m) each: gate, up
    return down_reference(h, b_up, down.astype(np.int64), down_scales, listed, positions, kind, weights=weights)


# ------------------------------------------------------------------ the kernel

@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("case", list(list_cases(N)))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_q4_kernel_lists(case, T, fmt, native):
    gate_up, w, down, down_scales, b_up = q4_ffn("swiglu", fmt)
    x = integer_tokens(np.random.default_rng(T), T)
    ids, count = list_cases(N)[case]
    ref, margin, _, _ = reference(w, down, down_scales, b_up, x, ids, count, "swiglu")
    assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
    y = K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, np.int32(count), kind="swiglu", b_up=b_up, native=native)
    assert y.shape == (T, D) and y.dtype == jnp.float32
    assert_scaled_equal(y, ref, f"{fmt} {case} T={T}")


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("kind", list(K.KINDS))
def test_q4_kernel_kinds_bias_weights_and_one_dimensional_x(kind, native):
    """Every activation kind (relu and gelu: up rows only), b_up and b_down, weights by list position (the routing
    weights with experts; some 0) over a list with a bad id and padding, at d 576 (two octets: the one-token
    kernel's pairs of octets, then two tail blocks), and a 1-D x."""
    d = 576
    gate_up, w, down, down_scales, b_up = q4_ffn(kind, "q4_1", seed=4, d=d)
    rng = np.random.default_rng(4)
    x = integer_tokens(rng, 3, d)
    b_down = rng.standard_normal(d).astype(np.float32)
    ids = np.concatenate([rng.permutation(N)[:40], [N + 2, 0, 0]]).astype(np.int32)
    weights = np.where(rng.random((3, len(ids))) < 0.3, 0.0, rng.random((3, len(ids)))).astype(np.float32)
    ref, margin, _, _ = reference(w, down, down_scales, b_up, x, ids, 41, kind, weights=weights)
    assert margin > MARGIN
    y = K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, 41, kind=kind, b_up=b_up, b_down=b_down, weights=weights,
                        native=native)
    assert_scaled_equal(y, ref + b_down, kind, extra=16 * U * np.abs(ref) + U * np.abs(ref + b_down))
    ref1, margin1, _, _ = reference(w, down, down_scales, b_up, x[:1], ids, 41, kind)
    assert margin1 > MARGIN
    y1 = K.sparse_ffn_q4(gate_up, down, down_scales, x[0], ids, 41, kind=kind, b_up=b_up, native=native)
    assert y1.shape == (d,)
    assert_scaled_equal(y1, ref1[0], kind + " 1-D")


@pytest.mark.parametrize("native", BACKENDS)
def test_q4_kernel_under_jit_and_scan(native):
    gate_up, w, down, down_scales, b_up = q4_ffn("swiglu", seed=5)
    rng = np.random.default_rng(6)
    xs = integer_tokens(rng, 5)
    ids = rng.permutation(N).astype(np.int32)
    x11 = integer_tokens(rng, 11)
    assert_right_under_jit_and_scan(
        lambda x, ids, count: K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, count, kind="swiglu", b_up=b_up,
                                              native=native),
        lambda x, ids, count: reference(w, down, down_scales, b_up, x, ids, count, "swiglu"), xs, x11, ids)


@pytest.mark.parametrize("native", [b for b in BACKENDS if b.values[0]])
def test_q4_kernel_is_deterministic_across_thread_counts(native):
    """A list long enough for several pieces and partial sums: 1 thread and all give the same bits."""
    gate_up, w, down, down_scales, b_up = q4_ffn("swiglu", seed=8, n=1536, d=576)
    rng = np.random.default_rng(9)
    x = integer_tokens(rng, 4, 576)
    ids, count = rng.permutation(1536).astype(np.int32), 1400
    assert_thread_independent(
        lambda: np.asarray(K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, count, kind="swiglu", b_up=b_up)),
        reference(w, down, down_scales, b_up, x, ids, count, "swiglu"))


def test_bad_q4_operands_are_value_errors():
    gate_up, _, down, down_scales, _ = q4_ffn("swiglu")
    x, ids = np.zeros((1, D), np.float32), np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="down must be int8"):
        K.sparse_ffn_q4(gate_up, down.astype(np.float32), down_scales, x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="gate_up must hold 64 records of 1 4-bit rows of 320"):
        K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, 4, kind="relu")
    with pytest.raises(ValueError, match="gate_up must hold 32 records"):
        K.sparse_ffn_q4(gate_up, down[:32], down_scales, x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="down_scales"):
        K.sparse_ffn_q4(gate_up, down, down_scales[:5], x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="Q4Bundles"):
        K.sparse_ffn_q4(gate_up.matrix(), down, down_scales, x, ids, 4, kind="swiglu")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_bundles_hold_each_neurons_rows_in_one_record(fmt):
    """Q4Bundles.from_matrix writes the records as laid out independently here (records_of), matrix() gives the
    matrix back bit for bit, take picks records; a matrix that does not split into the slots is refused."""
    m = q4.quantize(np.random.default_rng(11).standard_normal((2 * 5, 64)).astype(np.float32), fmt)
    bundles = Q4Bundles.from_matrix(m, 2)
    mins = None if m.mins is None else np.asarray(m.mins)
    expected = records_of(np.asarray(m.packed), np.asarray(m.scales), mins, 2)
    assert bundles.records.dtype == jnp.uint8 and bundles.nbytes == m.nbytes
    np.testing.assert_array_equal(np.asarray(bundles.records), expected)
    back = bundles.matrix()
    pairs = [(back.packed, m.packed), (back.scales, m.scales)] + ([] if mins is None else [(back.mins, m.mins)])
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    picked = bundles.take(jnp.asarray([3, 0]))
    np.testing.assert_array_equal(np.asarray(picked.records), expected[[3, 0]])
    np.testing.assert_array_equal(np.asarray(picked.matrix().packed), np.asarray(m.packed)[[3, 0, 8, 5]])
    with pytest.raises(ValueError, match="does not split into 3 blocks"):
        Q4Bundles.from_matrix(m, 3)


# ------------------------------------------------------------------ the layout, the op and the mode

def int4_engine(kind: str, seed: int = 0, **arch) -> jpinfer.Engine:
    """A tiny model in int4 (d_model 32: w_gate_up in 4-bit blocks; d_ff 48 is no whole number of blocks, so w_down
    is int8, and its int8 copy is itself)."""
    model = tiny_engine(kind, seed, **arch).model
    return jpinfer.Engine(dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, "int4")))


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
def test_the_layout_holds_the_4bit_rows_and_the_full_list_is_the_dense_ffn(kind):
    """The layout's records hold the model's own 4-bit w_gate_up (the same bits) and its int8 down columns; every
    neuron listed it computes the dense int4 FFN (the same integers: one block of 32 inputs, whose 4-bit product both
    compute with the same operations), and the prefill form likewise."""
    engine = int4_engine(kind)
    layer = engine.weights.layers[1]
    assert isinstance(layer.w_gate_up, Q4Matrix)
    ffn = neurons.from_layer(layer, kind)
    assert ffn.quantized and ffn.rows.shape == (engine.cfg.d_ff, 1, 32)
    held = ffn.gate_up.matrix()
    for a, b in ((held.packed, layer.w_gate_up.packed), (held.scales, layer.w_gate_up.scales)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ffn.rows[:, 0]), np.asarray(quantized.int8_copy(layer.w_down).values).T)
    x = ffn_inputs(tiny_engine(kind), np.random.default_rng(2).integers(0, 40, (2, 16)))[1][:3].astype(np.float32)
    a = np.asarray(transformer.ffn_activations(layer, jnp.asarray(x), engine.cfg), np.float64)
    scaled = np.abs(a) * 127 / np.abs(a).max(-1, keepdims=True)
    assert np.abs(scaled - np.floor(scaled) - 0.5).min() > MARGIN  # setup: no activation on a boundary
    dense = np.asarray(transformer.ffn_dense(layer, jnp.asarray(x), engine.cfg), np.float64)
    b_down = 0 if layer.b_down is None else np.abs(np.asarray(layer.b_down, np.float64))
    extra = 32 * U * (np.abs(dense) + b_down)  # both sides add b_down after the scaled sum: u |y| each
    n = engine.cfg.d_ff
    for t in range(3):
        y = sparse_ffn(ffn, jnp.asarray(x[t]), jnp.arange(n, dtype=jnp.int32), n)
        assert_scaled_equal(y, dense[t], kind, extra[t])
    assert_scaled_equal(all_rows_ffn(ffn, jnp.asarray(x)), dense, kind + " all rows", extra)


def test_subset_takes_its_neurons_gate_and_up_rows():
    """A part's records are its neurons' (their gate rows, then their up rows); with the whole layer's down slots it
    computes the layer's FFN over the same list."""
    ffn = neurons.from_layer(int4_engine("swiglu").weights.layers[0], "swiglu")
    n = ffn.n_neurons
    picked = np.array([5, 1, 40], np.int32)
    part, table = ffn.subset(picked, with_b_down=False)
    rows = np.concatenate([picked, picked + n])
    np.testing.assert_array_equal(np.asarray(part.gate_up.records), np.asarray(ffn.gate_up.records)[picked])
    held, whole = part.gate_up.matrix(), ffn.gate_up.matrix()
    np.testing.assert_array_equal(np.asarray(held.packed), np.asarray(whole.packed)[rows])
    np.testing.assert_array_equal(np.asarray(held.scales), np.asarray(whole.scales)[rows])
    np.testing.assert_array_equal(np.asarray(part.rows), np.asarray(ffn.rows)[picked])
    assert part.down_scales is ffn.down_scales and table.tolist() == [5, 1, 40]
    x = jnp.asarray(np.random.default_rng(3).standard_normal(ffn.d_model), jnp.float32)
    whole = sparse_ffn(dataclasses.replace(ffn, b_down=None), x, jnp.asarray(picked), 3)
    np.testing.assert_array_equal(np.asarray(sparse_ffn(part, x, jnp.arange(3, dtype=jnp.int32), 3)),
                                  np.asarray(whole))


@pytest.mark.parametrize("T", [3, 12])
def test_all_rows_with_a_list_per_token_is_each_tokens_sparse_ffn(T):
    """all_rows_ffn over the records with ``keep`` (a batch's lists, one per token): every token equals the float64
    reference over its own kept neurons, for a decode step's few tokens (the sparse op over the full list, ``keep``
    as weights) and for a prompt's many (the dense 4-bit product over the records' matrix)."""
    gate_up, w, down, down_scales, b_up = q4_ffn("swiglu", "q4_1", seed=12)
    ffn = neurons.NeuronFFN(rows=jnp.asarray(down)[:, None, :], ids=jnp.arange(N, dtype=jnp.int32),
                            b_up=jnp.asarray(b_up), b_down=None, kind="swiglu", down_scales=jnp.asarray(down_scales),
                            gate_up=gate_up)
    rng = np.random.default_rng(13)
    x = integer_tokens(rng, T)
    keep = rng.random((T, N)) < 0.4
    y = np.asarray(all_rows_ffn(ffn, jnp.asarray(x), jnp.asarray(keep)))
    for t in range(T):
        ids = np.flatnonzero(keep[t]).astype(np.int32)
        ref, margin, _, _ = reference(w, down, down_scales, b_up, x[t:t + 1], ids, len(ids), "swiglu")
        assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
        assert_scaled_equal(y[t], ref[0], f"token {t} of {T}")


def test_the_pallas_backend_refuses_4bit_rows():
    ffn = neurons.from_layer(int4_engine("swiglu").weights.layers[0], "swiglu")
    with pytest.raises(ValueError, match="Pallas kernels take float rows"):
        sparse_ffn(ffn, jnp.zeros(ffn.d_model), jnp.arange(4, dtype=jnp.int32), 4, backend="pallas")


def test_all_active_sparse_int4_decodes_like_dense_int4():
    """All neurons listed, the sparse int4 engine decodes like the dense int4 model (its int8 down matrix is the
    layout's down slots: the same integers; test_sparse_int8.py's tolerances)."""
    dense = int4_engine("swiglu")
    sparse = build_engine(dense.model, "sparse", predictors=all_active(dense), capacity=dense.cfg.d_ff)
    assert all(isinstance(state.ffn.gate_up, Q4Bundles) for state in sparse.ffn.state)
    # the predictors in the model's format: w_in (rank, d_model) in 4-bit blocks, w_out (d_ff, rank 4) int8
    assert all(isinstance(state.predictor.w_in, Q4Matrix) and isinstance(state.predictor.w_out, int8.Int8Matrix)
               for state in sparse.ffn.state)
    assert_decodes_like(sparse, dense, 24, rtol=KERNEL_RTOL, atol=max(KERNEL_ATOL, DECODER_ATOL))
