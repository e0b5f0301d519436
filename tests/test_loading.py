"""load_model: the GGUF cache under $JPINFER_CACHE and argument checks."""

import jax
import numpy as np
import pytest

from jpinfer.models import loading

import gguf_fixtures as fx


def test_gguf_cache_round_trip_and_invalidation(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))
    cfg = fx.tiny_config(tied=False)
    path = fx.write_gguf(tmp_path / "tiny.gguf", cfg, fx.random_tensors(cfg, seed=3))
    first = loading.load_model(path)
    entries = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / loading.CACHE_MANIFEST).exists()

    calls = []
    monkeypatch.setattr("jpinfer.models.gguf_loader.load_gguf", lambda *a, **k: calls.append(a))
    second = loading.load_model(path)
    assert calls == []  # served from the cache
    assert second.cfg == first.cfg
    for a, b in zip(jax.tree.leaves(first.weights), jax.tree.leaves(second.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = "hello world 123"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template

    monkeypatch.undo()
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))
    fx.write_gguf(path, cfg, fx.random_tensors(cfg, seed=4))  # a changed file is a new entry
    third = loading.load_model(path)
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
    assert not np.array_equal(np.asarray(third.weights.embed), np.asarray(first.weights.embed))


def test_bad_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        loading.parse_dtype("float8")
    with pytest.raises(ValueError, match="unsupported dtype int32"):
        loading.parse_dtype(np.int32)
