"""The threshold mode's head input sparsity: the head skips its inputs (the final hidden states) of magnitude at
most its threshold. Against float64 references that zero the same inputs, on the native kernel's path (1 to 8
tokens) and XLA's (more), for a float head and an int8 one (read through its input-major copy); its calibration,
storage and the pack's setting. Tolerances: tests/tolerances.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_int8 import int8_engine, reference_quantize, reference_tokens, rounding_margin
from test_modes import PROMPT, forced_logits
from test_threshold import given, windows

from jpinfer.errors import JpinferError
from jpinfer.ffn import ThresholdRowsFFN
from jpinfer.models import params, quantized, transformer
from jpinfer.modes import build_engine
from jpinfer.pack.settings import HEAD_AUTO_TARGET, PackSettings, stage_keys
from jpinfer.profiler import SparsityTargets, SparsityThresholds, calibrate_sparsity, profile

from profiler_fixtures import thresholds_in_gaps, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL, SPARSITY_ATOL, U32


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def final_states(engine, tokens: np.ndarray) -> np.ndarray:
    """The dense model's final hidden states (the head's inputs) over ``tokens`` (n, T), float64 (n, T, d)."""
    cfg = engine.cfg
    cache = transformer.KVCache.create(cfg, len(tokens), tokens.shape[1])
    return np.asarray(transformer.forward(engine.weights, jnp.asarray(tokens, jnp.int32), cache, cfg)[0], np.float64)


def head_only(threshold: float) -> SparsityThresholds:
    return SparsityThresholds(None, None, {}, {}, "given", head=threshold)


logits = jax.jit(transformer.logits, static_argnames=("cfg", "input_threshold"))


@pytest.mark.parametrize("tokens", [1, 3, 8, 12])  # up to 8: the native kernel (with the library); 12: XLA
def test_head_logits_equal_float64_zeroing_the_same_inputs(tokens):
    engine = tiny_engine("swiglu")
    h = final_states(engine, windows(2, 16, seed=2)).reshape(-1, engine.cfg.d_model)[:tokens]
    thr = float(thresholds_in_gaps([np.abs(h)], 0.3)[0])  # in a wide gap: float32 keeps the same inputs
    head = np.asarray(engine.weights.head, np.float64)  # (d, vocab)
    expected = np.where(np.abs(h) > thr, h, 0.0) @ head
    h32 = jnp.asarray(h, jnp.float32)
    # d = 32 products a logit: the sparse FFN's bound (KERNEL_RTOL's note) covers them
    np.testing.assert_allclose(np.asarray(logits(engine.weights, h32, engine.cfg, thr)), expected,
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    assert np.abs(expected - h @ head).max() > 100 * KERNEL_ATOL  # the zeroing matters
    np.testing.assert_array_equal(np.asarray(logits(engine.weights, h32, engine.cfg, None)),
                                  np.asarray(logits(engine.weights, h32, engine.cfg)))  # None: the dense head
    with_nan = h32.at[0, 0].set(jnp.nan)  # a NaN input is no input to skip: its token's logits are NaN
    got = np.asarray(logits(engine.weights, with_nan, engine.cfg, thr))
    assert np.isnan(got[0]).all() and np.isfinite(got[1:]).all()


def test_head_threshold_decodes_like_the_zeroed_float64_reference():
    """Only the head skips: every decode step's logits are the dense model's final states with the same entries
    zeroed, times the head in float64."""
    dense = tiny_engine("swiglu")
    forced = [4, 8, 15, 16, 23, 2, 7, 3]
    h = final_states(dense, np.asarray([PROMPT + forced]))[0, len(PROMPT):]  # the states after each forced token
    thr = float(thresholds_in_gaps([np.abs(final_states(dense, windows(2, 16, seed=4)))], 0.4)[0])
    engine = build_engine(dense.model, "threshold", thresholds=head_only(thr))
    assert engine.ffn.impl.head_threshold == thr
    head = np.asarray(dense.weights.head, np.float64)
    expected = np.where(np.abs(h) > thr, h, 0.0) @ head
    assert np.abs(expected - h @ head).max() > 100 * DECODER_ATOL  # the zeroing matters
    np.testing.assert_allclose(forced_logits(engine, PROMPT, forced), expected, rtol=0, atol=DECODER_ATOL)
    # every state met sits >= 1e-4 (relative) from the threshold, ~1000x float32's rounding of these values
    # (the decode steps and the one-pass reference differ by DECODER_ATOL): both keep the same inputs
    assert np.min(np.abs(np.abs(h) / thr - 1)) > 1e-4


def int8_head_reference(h: np.ndarray, float_head: np.ndarray, thr: float | None) -> np.ndarray:
    """float64, written apart from quant/int8.py: the float (d, vocab) head quantized per vocab entry, the kept
    entries of h quantized per token (numpy float32's rounding), exact integer sums, then both scales."""
    values, scales = reference_quantize(float_head.T, 0)  # (vocab, d) int64, (vocab,)
    kept = h if thr is None else np.where(np.abs(h) > thr, h, 0.0)
    q, token_scales = reference_tokens(kept)
    return (q @ values.T) * np.float64(token_scales)[:, None] * np.float64(scales)[None, :]


@pytest.mark.parametrize("tokens", [1, 3, 8, 12])  # up to 8: the native int8 rows kernel; 12: XLA's int8 product
def test_int8_head_logits_on_the_input_major_copy_equal_the_integer_reference(tokens):
    """The threshold mode's int8 head: the (vocab, d) int8 head's input-major copy reads the kept inputs' rows
    only; the same integers as the float64 reference that zeroes them, and as the (vocab, d) head given the same
    threshold."""
    float_engine, engine = tiny_engine("swiglu"), int8_engine("swiglu")
    h = final_states(float_engine, windows(2, 16, seed=2)).reshape(-1, engine.cfg.d_model)[:tokens]
    thr = float(thresholds_in_gaps([np.abs(h)], 0.3)[0])  # in a wide gap: float32 keeps the same inputs
    kept = np.where(np.abs(h) > thr, h, 0.0)
    assert rounding_margin(kept.astype(np.float32)) > 8 * U32 * 127  # both paths round to the same integers
    rows_head = engine.weights.head
    columns = dataclasses.replace(engine.weights, head=quantized.input_major_int8(rows_head))
    assert columns.head.scale_axis == 1 and columns.head.shape == rows_head.shape[::-1]
    float_head = np.asarray(float_engine.weights.head, np.float64)
    expected = int8_head_reference(h, float_head, thr)
    h32 = jnp.asarray(h, jnp.float32)
    # exact int32 sums, then acc * (token scale * vocab scale): two float32 roundings, far inside KERNEL_RTOL
    for weights in (columns, engine.weights):
        np.testing.assert_allclose(np.asarray(logits(weights, h32, engine.cfg, thr)), expected,
                                   rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    assert np.abs(expected - int8_head_reference(h, float_head, None)).max() > 100 * KERNEL_ATOL  # zeroing matters
    np.testing.assert_allclose(np.asarray(logits(columns, h32, engine.cfg)), int8_head_reference(h, float_head, None),
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)  # no threshold: every input's row
    with_nan = h32.at[0, 0].set(jnp.nan)  # a NaN input is no input to skip: its token's logits are NaN
    got = np.asarray(logits(columns, with_nan, engine.cfg, thr))
    assert np.isnan(got[0]).all() and np.isfinite(got[1:]).all()


def test_input_major_int8_takes_a_row_scaled_int8_matrix_only():
    w = int8_engine("swiglu").weights.head
    copy = quantized.input_major_int8(w)
    np.testing.assert_array_equal(np.asarray(copy.values), np.asarray(w.values).T)
    np.testing.assert_array_equal(np.asarray(copy.scales), np.asarray(w.scales))
    for bad in (copy, tiny_engine("swiglu").weights.head):  # already input-major; a float matrix
        with pytest.raises(ValueError, match="takes an int8 matrix with one scale per row"):
            quantized.input_major_int8(bad)


def test_tied_embedding_reads_the_input_major_int8_head():
    cfg = dataclasses.replace(tiny_engine("swiglu").cfg, tie_embeddings=True)
    w = quantized.quantize_weights(params.build_weights(cfg, params.init_random(cfg)), "int8")
    columns = dataclasses.replace(w, head=quantized.input_major_int8(w.head))
    tokens = jnp.asarray([[0, 5, 39, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(transformer.embed(columns, tokens, jnp.arange(4), cfg)),
                                  np.asarray(transformer.embed(w, tokens, jnp.arange(4), cfg)))


def test_int8_threshold_engine_reads_the_head_by_its_kept_inputs():
    """The int8 threshold engine holds the head's input-major copy in place of the (vocab, d) head and decodes
    what the (vocab, d) head computes with the same inputs skipped; without a head threshold it keeps the head."""
    dense = int8_engine("swiglu")
    thr = float(thresholds_in_gaps([np.abs(final_states(dense, windows(2, 16, seed=4)))], 0.4)[0])
    engine = build_engine(dense.model, "threshold", thresholds=head_only(thr))
    assert quantized.is_input_major_int8(engine.weights.head)
    assert engine.weights.head.nbytes == dense.weights.head.nbytes  # a replacement, not a second copy
    with_rows = type(engine)(dataclasses.replace(engine.model, weights=dataclasses.replace(
        engine.weights, head=dense.weights.head)), engine.ffn)
    forced = [4, 8, 15, 16, 23, 2, 7, 3]
    got, expected = forced_logits(engine, PROMPT, forced), forced_logits(with_rows, PROMPT, forced)
    np.testing.assert_allclose(got, expected, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)  # the same integers
    assert np.abs(expected - forced_logits(dense, PROMPT, forced)).max() > 100 * KERNEL_ATOL  # the skipping matters
    off = build_engine(dense.model, "threshold", thresholds=given(dense.cfg, 0.0, 0.0))  # no head threshold
    assert off.weights.head is dense.weights.head


@pytest.mark.parametrize("target", [0.2, 0.5])
def test_head_calibration_skips_the_target_fraction_and_travels_with_the_profile(target):
    dense = tiny_engine("swiglu")
    tokens = windows(8, 32, seed=3)
    th = calibrate_sparsity(dense, tokens, head=target)
    assert th.target == {"head": target} and th.n_layers is None and th.activation is None
    assert (np.abs(final_states(dense, tokens)) <= th.head).mean() == pytest.approx(target, abs=SPARSITY_ATOL)
    assert th.layer_sparsity["head"][0] == pytest.approx(target, abs=SPARSITY_ATOL)
    with_ffn = calibrate_sparsity(dense, tokens, activation=0.4, head=target)
    assert with_ffn.head == th.head and with_ffn.describe() == f"activation 40% + head {target:.0%} (uniform)"
    prof = profile(dense, tokens, targets=SparsityTargets(activation=0.4, head=target), progress=False)
    assert prof.sparsity_thresholds().head == th.head  # the profile calibrates on the same windows here
    back = SparsityThresholds.from_dict(th.to_dict())
    assert back.head == th.head and back.describe() == th.describe()  # float32 through JSON: exact
    older = {k: v for k, v in with_ffn.to_dict().items() if k != "head"}  # written before the head's threshold
    assert SparsityThresholds.from_dict(older).head is None
    wide = calibrate_sparsity(dense, tokens, model_wide=0.3, head=target, heldout=windows(4, 32, seed=5))
    assert wide.head == th.head and wide.describe().endswith(f"+ head {target:.0%} (greedy)")


def test_bad_head_settings_are_clear_errors():
    dense = tiny_engine("swiglu")
    with pytest.raises(ValueError, match="head sparsity is the fraction skipped"):
        calibrate_sparsity(dense, windows(), head=1.5)
    with pytest.raises(ValueError, match="head sparsity is the fraction skipped"):  # beside a model-wide target
        calibrate_sparsity(dense, windows(), model_wide=0.3, head=-0.1, heldout=windows(seed=2))
    with pytest.raises(ValueError, match="head sparsity is the fraction skipped"):  # before the model loads
        profile("/nonexistent/m.gguf", windows(), targets=SparsityTargets(model_wide=0.3, head=2.0), progress=False)
    with pytest.raises(ValueError, match="greedy allocation spreads per-layer kinds"):
        calibrate_sparsity(dense, windows(), head=0.2, method="greedy", heldout=windows(seed=2))
    with pytest.raises(ValueError, match="head's threshold must be finite"):
        head_only(float("nan"))
    with pytest.raises(JpinferError, match="head_threshold must be a finite number"):
        ThresholdRowsFFN(head_threshold=-1.0)
    with pytest.raises(JpinferError, match="head sparsity is the fraction skipped"):
        PackSettings(head_sparsity=1.0)


def test_pack_head_sparsity_keeps_the_other_stages():
    """Changing the head's target re-runs a pack's thresholds stage only; "auto" is HEAD_AUTO_TARGET with float
    weights and off with int8 and int4 (bench/results/experiments/threshold_int8_head.md); a given fraction serves
    them all."""
    keys = lambda s, weights="float": stage_keys(s, "swiglu", "float32", weights, "f" * 16)
    auto, off = keys(PackSettings()), keys(PackSettings(head_sparsity=None))
    other = keys(PackSettings(head_sparsity=0.3))
    assert len({auto["thresholds"], off["thresholds"], other["thresholds"]}) == 3
    assert all(auto[stage] == off[stage] == other[stage] for stage in auto if stage != "thresholds")
    for weights in ("int8", "int4"):
        assert keys(PackSettings(), weights) == keys(PackSettings(head_sparsity=None), weights)
        with_fraction = keys(PackSettings(head_sparsity=HEAD_AUTO_TARGET), weights)["thresholds"]
        assert with_fraction != keys(PackSettings(), weights)["thresholds"]
