"""Planted activity (``jpinfer.bench.planted``) and the random-weight GGUF files (``jpinfer.bench.random_gguf``)
that ``bench/cpu_7b.py`` measures with."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from jpinfer.bench import planted
from jpinfer.bench.random_gguf import FILE_TYPES, Shapes, random_ggufs, tensor_shapes
from jpinfer.models.gguf_loader import open_gguf, read_config
from jpinfer.models.loading import LoadedModel, load_quantized_gguf
from jpinfer.models.params import build_weights
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.runtime.generation import GenerationConfig

import gguf_fixtures as fx
from tolerances import KERNEL_ATOL, KERNEL_RTOL

TINY = Shapes("tiny-test", n_layers=2, d_model=64, d_ff=160, n_heads=4, n_kv_heads=2, vocab=300)


def test_one_neuron_sets_follow_the_weights_exactly():
    """k = 1: Efraimidis-Spirakis draws neuron i with probability w_i / sum(w)."""
    w = np.array([1.0, 2.0, 3.0, 4.0])
    n = 40000
    drawn = planted.planted_sets(w, 1, n, np.random.default_rng(0))[:, 0]
    p = w / w.sum()
    counts = np.bincount(drawn, minlength=4)
    assert np.all(np.abs(counts - n * p) <= 4 * np.sqrt(n * p * (1 - p)))  # 4 binomial sigmas


def test_sets_hold_distinct_sorted_ids_and_favour_popular_neurons():
    rng = np.random.default_rng(1)
    w = np.linspace(0.01, 1.0, 200)
    sets = planted.planted_sets(w, 20, 2000, rng)
    assert sets.shape == (2000, 20) and sets.dtype == np.int32
    assert np.all(np.diff(sets, axis=1) > 0)  # sorted, hence distinct
    counts = np.bincount(sets.ravel(), minlength=200)
    assert counts[-20:].sum() > 10 * counts[:20].sum()
    with pytest.raises(ValueError, match="0 < k"):
        planted.planted_sets(w, 0, 3, rng)
    with pytest.raises(ValueError, match="positive"):
        planted.planted_sets(np.zeros(5), 2, 3, rng)


def test_set_index_spreads_tokens_over_the_sets():
    xs = np.random.default_rng(2).standard_normal((500, 8)).astype(np.float32)
    picks = np.array([int(planted.set_index(jnp.asarray(x), 16)) for x in xs])
    assert picks.min() >= 0 and picks.max() < 16
    assert len(set(picks.tolist())) == 16  # every set used
    assert np.bincount(picks, minlength=16).max() < 500 / 16 * 2


@pytest.fixture(scope="module")
def float_model():
    cfg = fx.tiny_config()
    return LoadedModel(cfg, build_weights(cfg, fx.random_tensors(cfg, seed=7)), None, "tiny")


def test_a_decode_step_computes_exactly_its_planted_set(float_model):
    """The planted FFN of one token against float64 numpy over the set hash(x) picks: with a predictor the
    selection must return that same set (the predictor's logits are tiny next to the planted term)."""
    cfg, layer = float_model.cfg, float_model.weights.layers[0]
    ffns = planted.neuron_major(float_model)
    x = np.random.default_rng(3).standard_normal(cfg.d_model).astype(np.float32)
    gate_up = np.asarray(layer.w_gate_up, np.float64)
    down = np.asarray(layer.w_down, np.float64)
    for rank in (None, 8):
        engine = planted.planted_engine(float_model, 0.25, ffns, rank=rank)
        state = engine.ffn.state[0]
        y, _ = planted.PlantedFFN()(0, layer, jnp.asarray(x), state)
        ids = np.asarray(state.sets)[int(planted.set_index(jnp.asarray(x), state.sets.shape[0]))]
        assert len(ids) == 32  # 25% of 128
        g, u = gate_up[ids] @ x, gate_up[cfg.d_ff + ids] @ x
        want = down[:, ids] @ (g / (1 + np.exp(-g)) * u)
        np.testing.assert_allclose(np.asarray(y), want, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_with_and_without_a_predictor_decode_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path))
    path = random_ggufs(TINY, ("Q8_0",))["Q8_0"]
    model = load_quantized_gguf(path, "int8", tokenizer=False)
    ffns = planted.neuron_major(model)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    runs = {rank: planted.planted_engine(model, 0.1, ffns, rank=rank).generate([299, 5, 77], config).token_ids
            for rank in (None, 16)}
    assert runs[None] == runs[16]
    bench = planted.planted_bench_engine(model, 0.1, ffns, 16, "x")
    lighter = planted.planted_bench_engine(model, 0.1, ffns, None, "x")
    predictor = planted.random_predictor(TINY.d_model, TINY.d_ff, 16, np.random.default_rng(0), "int8")
    per_layer = sum(int(a.nbytes) for a in (predictor.w_in.values, predictor.w_in.scales, predictor.w_out.values,
                                            predictor.w_out.scales, predictor.b_in, predictor.b_out, predictor.cutoff))
    assert bench.weight_bytes_per_token - lighter.weight_bytes_per_token == TINY.n_layers * per_layer
    assert all(isinstance(state.predictor.w_out, Int8Matrix) for state in bench.engine.ffn.state)
    with pytest.raises(ValueError, match="fraction"):
        planted.planted_engine(model, 1.0, ffns)


def test_popularity_order_is_hottest_first_at_every_larger_fraction():
    cfg = fx.tiny_config()
    order = planted.popularity_order(cfg, 0.05)
    assert len(order) == cfg.n_layers
    for fraction in (0.05, 0.1, 0.3):
        for ids, f in zip(order, planted.planted_frequencies(cfg, fraction)):
            assert sorted(ids.tolist()) == list(range(cfg.d_ff))
            assert np.all(np.diff(f[ids]) <= 0), fraction


@pytest.mark.parametrize("file_type,fmt", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_a_layout_in_popularity_order_computes_the_same_sums(tmp_path, monkeypatch, file_type, fmt):
    """Neurons stored hottest first: each step lists the rows holding its planted set's neurons, so the FFN
    output is the model order's exactly (the int8 and 4-bit kernels sum integers: no order in the rounding)."""
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path))
    model = load_quantized_gguf(random_ggufs(TINY, (file_type,))[file_type], fmt, tokenizer=False)
    order = planted.popularity_order(model.cfg, 0.1)
    engines = {name: planted.planted_engine(model, 0.1, planted.neuron_major(model, order=o), rank=8)
               for name, o in (("model", None), ("popular", order))}
    ffn, moved = engines["model"].ffn.state[0], engines["popular"].ffn.state[0]
    # the predictor in the model's format (a rank of 8 is under one 4-bit block: its w_out stays int8)
    assert isinstance(ffn.predictor.w_in, {"int8": Int8Matrix, "int4": Q4Matrix}[fmt])
    assert np.array_equal(np.asarray(moved.ffn.ids), order[0])
    assert not np.array_equal(np.asarray(moved.sets), np.asarray(ffn.sets))  # other rows, the same neurons
    neurons = lambda state: np.sort(np.asarray(state.ffn.ids)[np.asarray(state.sets)], axis=1)
    np.testing.assert_array_equal(neurons(moved), neurons(ffn))
    layer = model.weights.layers[0]
    for x in np.random.default_rng(4).standard_normal((4, TINY.d_model)).astype(np.float32):
        y = {name: np.asarray(planted.PlantedFFN()(0, layer, jnp.asarray(x), e.ffn.state[0])[0])
             for name, e in engines.items()}
        np.testing.assert_array_equal(y["popular"], y["model"])
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    tokens = {name: e.generate([299, 5, 77], config).token_ids for name, e in engines.items()}
    assert tokens["popular"] == tokens["model"]


def test_random_files_are_one_model_in_two_formats(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path))
    paths = random_ggufs(TINY, tuple(FILE_TYPES), seed=4)
    stamp = {ft: p.stat().st_mtime_ns for ft, p in paths.items()}
    assert random_ggufs(TINY, tuple(FILE_TYPES), seed=4) == paths  # cached: not written again
    assert {ft: p.stat().st_mtime_ns for ft, p in paths.items()} == stamp
    cfg = read_config(open_gguf(paths["Q8_0"]), paths["Q8_0"])
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (2, 64, 160, 4, 2,
                                                                                                300)
    readers = {ft: {t.name: t for t in GGUFReader(p).tensors} for ft, p in paths.items()}
    for name, shape in tensor_shapes(TINY).items():
        q8, q4 = readers["Q8_0"][name], readers["Q4_0"][name]
        if len(shape) == 1:
            assert q8.tensor_type == q4.tensor_type == Q.F32
            continue
        assert q8.tensor_type == Q.Q8_0
        assert q4.tensor_type == (Q.Q8_0 if name == "output.weight" else Q.Q4_0)
        a = dequantize(q8.data, q8.tensor_type).reshape(shape)
        b = dequantize(q4.data, q4.tensor_type).reshape(shape)
        # one draw quantized twice: Q4_0's error is at most 1.1/8 of a block's largest magnitude (test_gguf.py)
        assert np.abs(a - b).max() <= (1.1 / 8 + 1 / 127) * np.abs(a).max(), name
        # the stated spread: variance 1/in (1/(in * 2 n_layers) for o and down; 1 for the embedding)
        want = 1.0 if name == "token_embd.weight" else 1 / shape[1] / (
            2 * TINY.n_layers if name.endswith(("attn_output.weight", "ffn_down.weight")) else 1)
        assert abs(a.var() / want - 1) < 0.1, name


def test_shapes_refuse_what_the_files_cannot_hold():
    with pytest.raises(ValueError, match="multiples of 32"):
        Shapes("x", 1, 64, 100, 4, 4, 400)
    with pytest.raises(ValueError, match="even head size"):
        Shapes("x", 1, 96, 128, 5, 5, 400)
    with pytest.raises(ValueError, match="room for the special"):
        Shapes("x", 1, 64, 128, 4, 4, 100)
