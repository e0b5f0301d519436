"""A GGUF read straight into int8 / int4 (``load_quantized_gguf``) against the float path quantized afterwards.

The float path (``load_gguf`` dequantizes every tensor, ``quantize_weights`` quantizes the float model) is the
independent reference: reading one tensor at a time, in chunks of rows, must give the same integers and scales
bit for bit (rows are quantized independently), and a 4-bit file's blocks must arrive untouched.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jpinfer.errors import CheckpointError, JpinferError
from jpinfer.models import loading, quantized, transformer
from jpinfer.models.gguf_loader import load_gguf, read_q4_blocks
from jpinfer.models.loading import LoadedModel, load_quantized_gguf
from jpinfer.models.params import build_weights
from jpinfer.quant import int8
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import GenerationConfig

import gguf_fixtures as fx

PROJECTIONS = ("w_qkv", "wo", "w_gate_up", "w_down")


def assert_same_matrix(got, want, what: str) -> None:
    assert type(got) is type(want), what
    if isinstance(want, Int8Matrix):
        assert got.scale_axis == want.scale_axis == 0, what
        np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want.values), err_msg=what)
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales), err_msg=what)
    else:
        assert got.kind == want.kind, what
        for part in ("packed", "scales", "mins"):
            a, b = getattr(got, part), getattr(want, part)
            assert (a is None) == (b is None), what
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what}.{part}")


def reference(path, fmt: str):
    """The float path: every tensor dequantized, the float model quantized."""
    cfg, tensors, _ = load_gguf(path)
    weights = build_weights(cfg, tensors)
    blocks = read_q4_blocks(path, cfg) if fmt == "int4" else None
    return cfg, tensors, quantized.quantize_weights(weights, fmt, blocks)


@pytest.mark.parametrize("qtype,fmt", [(Q.Q8_0, "int8"), (Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.F32, "int8"),
                                       (Q.Q8_0, "int4"), (Q.Q4_0, "int8")], ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_straight_read_equals_the_float_path_quantized(tmp_path, monkeypatch, qtype, fmt, tied):
    cfg = fx.tiny_config(tied=tied)
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, fx.random_tensors(cfg, seed=3), qtype)
    monkeypatch.setattr(quantized, "CONVERT_WEIGHTS", 3 * cfg.d_ff)  # several chunks per matrix, one ragged
    got = load_quantized_gguf(path, fmt)
    ref_cfg, tensors, want = reference(path, fmt)
    assert got.cfg == ref_cfg
    assert quantized.weights_format(got.weights) == fmt
    for i, (a, b) in enumerate(zip(got.weights.layers, want.layers)):
        for name in PROJECTIONS:
            assert_same_matrix(getattr(a, name), getattr(b, name), f"layer {i} {name}")
        np.testing.assert_array_equal(np.asarray(a.attn_norm.scale), np.asarray(b.attn_norm.scale))
        np.testing.assert_array_equal(np.asarray(a.ffn_norm.scale), np.asarray(b.ffn_norm.scale))
    assert_same_matrix(got.weights.head, want.head, "head")
    if tied:
        assert got.weights.embed is None
    elif fmt == "int4" and qtype in (Q.Q4_0, Q.Q4_1):  # the untied embedding: the file's 4-bit blocks as they are
        assert got.weights.embed.kind == qtype.name.lower()
        rows = quantized.rows(got.weights.embed, jnp.arange(cfg.vocab_size))
        np.testing.assert_array_equal(np.asarray(rows), tensors["embed"])
    else:  # int8 rows of the file's table (the float path keeps it float)
        assert_same_matrix(got.weights.embed, int8.quantize(tensors["embed"]), "embed")
    if fmt == "int4" and qtype in (Q.Q4_0, Q.Q4_1):  # the file's own blocks, not quantized again
        assert got.weights.layers[0].w_gate_up.kind == qtype.name.lower()
    assert got.tokenizer is not None


def test_an_int8_embedding_is_its_dequantized_rows(tmp_path):
    cfg = fx.tiny_config()
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, fx.random_tensors(cfg, seed=4), Q.Q8_0)
    model = load_quantized_gguf(path, "int8", tokenizer=False)
    tokens = jnp.asarray([[3, 0, 17, 3]])
    h = transformer.embed(model.weights, tokens, jnp.arange(4), cfg)
    table = np.asarray(model.weights.embed.values, np.float64) * np.asarray(model.weights.embed.scales)[:, None]
    np.testing.assert_array_equal(np.asarray(h[0]), table[[3, 0, 17, 3]].astype(np.float32))


def test_a_straight_read_model_decodes_as_the_float_path_does(tmp_path):
    """Same weights, same engine: the tokens of a greedy decode agree with the float path's int8 model given the
    same int8 embedding rows."""
    cfg = fx.tiny_config()
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, fx.random_tensors(cfg, seed=5), Q.Q8_0)
    got = load_quantized_gguf(path, "int8", tokenizer=False)
    _, tensors, want = reference(path, "int8")
    dequantized_embed = quantized.as_float(int8.quantize(tensors["embed"]))
    want_model = LoadedModel(cfg, dataclasses.replace(want, embed=dequantized_embed), None, str(path))
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    assert Engine(got).generate([5, 9, 2], config).token_ids == Engine(want_model).generate([5, 9, 2],
                                                                                             config).token_ids


def test_a_fused_matrix_of_two_4bit_types_is_quantized_anew(tmp_path):
    """Gate rows Q4_0 and up rows Q4_1: the blocks cannot stack, so w_gate_up is quantized to int4's own kind from
    the dequantized rows, as the float path does (``read_q4_blocks`` leaves such a matrix out)."""
    cfg = fx.tiny_config()
    overrides = {f"layers.{i}.w_up": Q.Q4_1 for i in range(cfg.n_layers)}
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, fx.random_tensors(cfg, seed=8), Q.Q4_0, type_overrides=overrides)
    got = load_quantized_gguf(path, "int4", tokenizer=False)
    _, _, want = reference(path, "int4")
    for i, (a, b) in enumerate(zip(got.weights.layers, want.layers)):
        assert a.w_gate_up.kind == quantized.INT4_KIND
        for name in PROJECTIONS:
            assert_same_matrix(getattr(a, name), getattr(b, name), f"layer {i} {name}")


def test_refusals(tmp_path):
    cfg = fx.tiny_config()
    tensors = fx.random_tensors(cfg, seed=6)
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, tensors, Q.Q8_0)
    with pytest.raises(JpinferError, match="weights must be 'int8' or 'int4'"):
        load_quantized_gguf(path, "int3")
    missing = fx.write_gguf(tmp_path / "missing.gguf", cfg,
                            {k: v for k, v in tensors.items() if k != "layers.1.w_up"}, Q.Q8_0)
    with pytest.raises(CheckpointError, match="blk.1.ffn_up.weight"):
        load_quantized_gguf(missing, "int8")
    with pytest.raises(CheckpointError, match="file not found"):
        load_quantized_gguf(tmp_path / "nope.gguf", "int8")
    assert isinstance(load_quantized_gguf(path, "int4").weights.layers[0].w_down, Q4Matrix)


def test_reading_hands_the_freed_heap_back(tmp_path, monkeypatch):
    """The straight read trims the C heap once it has dropped the file's metadata (the tokenizer's fields), after
    each layer's conversion and once it has converted the file (host_heap: glibc's ``malloc_trim``)."""
    cfg = fx.tiny_config(tied=True)
    path = fx.write_gguf(tmp_path / "m.gguf", cfg, fx.random_tensors(cfg, seed=3), Q.Q8_0)
    calls = []
    monkeypatch.setattr(loading, "release_freed_heap", lambda: calls.append(1) or True)
    load_quantized_gguf(path, "int8", tokenizer=False)
    assert len(calls) == 2 + cfg.n_layers
