"""The llama.cpp bench peer: the float32 GGUF it runs, and its greedy tokens against jpinfer's."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, LlamaFileType
from gguf.quants import dequantize

from jpinfer.bench import llama_cpp as peer
from jpinfer.models.gguf_loader import load_gguf

import gguf_fixtures as fx

FILE_TYPE = "general.file_type"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("JPINFER_CACHE", str(root))
    return root


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def quantized(request, tmp_path):
    """A tiny Q4_1 llama GGUF (embedding Q8_0, norms F32), like the default model's file."""
    cfg = fx.tiny_config(tied=request.param)
    path = fx.write_gguf(
        tmp_path / "tiny.Q4_1.gguf",
        cfg,
        fx.random_tensors(cfg, seed=3),
        Q.Q4_1,
        metadata={FILE_TYPE: int(LlamaFileType.MOSTLY_Q4_1)},
        type_overrides={"embed": Q.Q8_0},
    )
    return cfg, path


def _fields(reader: GGUFReader) -> dict:
    return {
        name: (tuple(f.types), f.contents())
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def test_float32_gguf_same_metadata_and_dequantized_tensors(cache, quantized):
    cfg, source = quantized
    target = peer.float32_gguf(source)
    assert target.parent == cache / "peers" and target.suffix == ".gguf"
    src, out = GGUFReader(source), GGUFReader(target)

    src_fields, out_fields = _fields(src), _fields(out)
    assert out_fields.pop(FILE_TYPE) == (src_fields.pop(FILE_TYPE)[0], int(LlamaFileType.ALL_F32))
    assert out_fields == src_fields  # tokenizer arrays, chat template, ... with their original types

    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    assert {t.tensor_type for t in src.tensors} == {Q.Q4_1, Q.Q8_0, Q.F32}
    for s, o in zip(src.tensors, out.tensors):
        assert o.tensor_type == Q.F32, o.name
        assert o.shape.tolist() == s.shape.tolist(), o.name  # same layout: no transposes or permutations
        expect = dequantize(s.data, s.tensor_type).reshape(tuple(reversed(s.shape.tolist())))
        np.testing.assert_array_equal(np.asarray(o.data).reshape(expect.shape), expect, err_msg=o.name)

    src_cfg, src_tensors, src_tok = load_gguf(source)
    out_cfg, out_tensors, out_tok = load_gguf(target)
    assert out_cfg == src_cfg == cfg
    assert out_tensors.keys() == src_tensors.keys()
    for name in src_tensors:
        np.testing.assert_array_equal(out_tensors[name], src_tensors[name], err_msg=name)
    text = "The quick brown fox, 12345 <think>"
    assert out_tok.encode(text) == src_tok.encode(text)


def test_float32_gguf_is_cached_and_keyed_on_the_source(cache, quantized):
    _, source = quantized
    first = peer.float32_gguf(source)
    mtime = first.stat().st_mtime_ns
    assert peer.float32_gguf(source) == first
    assert first.stat().st_mtime_ns == mtime  # not rewritten
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, f"{first.stem}.json"]  # copy, record

    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the source changed: a new copy
    second = peer.float32_gguf(source)
    assert second != first and second.is_file()


def test_interrupted_write_leaves_nothing(cache, quantized, monkeypatch):
    _, source = quantized

    def fail(src, tmp):
        tmp.write_bytes(b"GGUF partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(peer, "_write_float32", fail)
    with pytest.raises(KeyboardInterrupt):
        peer.float32_gguf(source)
    assert list((cache / "peers").iterdir()) == []


def test_weight_bytes_per_token(quantized):
    cfg, source = quantized
    reader = GGUFReader(source)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    embed = sizes["token_embd.weight"]
    expect = sum(sizes.values()) - (0 if cfg.tie_embeddings else embed)
    assert peer._weight_bytes_per_token(reader) == expect


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_match_jpinfer_on_float32_weights():
    pytest.importorskip("llama_cpp")
    import jpinfer
    from jpinfer.models.default_model import DefaultModelMissing, default_model_path

    try:
        source = default_model_path()
    except DefaultModelMissing as err:
        pytest.skip(str(err))
    engine = jpinfer.load()
    ids = engine.encode_prompt("Write a long story about a dragon.", chat=True)
    expect = engine.generate(ids, max_new_tokens=8).token_ids
    assert len(expect) == 8  # no end-of-sequence within the 8 tokens

    llama = peer.LlamaCppEngine(peer.float32_gguf(source), n_threads=2)
    assert llama.name == "llama.cpp F32 (2 threads)"
    stats = llama.run(ids, 8)
    assert stats.tokens == expect
    assert stats.n_prompt == len(ids) and len(stats.step_s) == len(stats.tokens) - 1
    assert llama.run(ids, 8).tokens == expect  # state is reset between prompts


class _FakeParams:
    use_extra_bufts = True


class _FakeLlama:
    """Records whether llama.cpp's weight repacking was on when each model was loaded (the
    parameters ``Llama`` reads from ``llama_cpp.llama_cpp.llama_model_default_params``)."""

    loads: list[bool] = []

    def __init__(self, model_path, n_ctx=512, **kwargs):
        import llama_cpp.llama_cpp as low

        _FakeLlama.loads.append(low.llama_model_default_params().use_extra_bufts)
        self._n_ctx = n_ctx
        self.scores = np.zeros((n_ctx, 5), np.float32)

    def n_ctx(self):
        return self._n_ctx

    def n_vocab(self):
        return 5

    def reset(self):
        pass

    def eval(self, tokens):
        pass

    def close(self):
        pass


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    import sys
    import types

    low = types.ModuleType("llama_cpp.llama_cpp")
    low.llama_model_default_params = _FakeParams
    top = types.ModuleType("llama_cpp")
    top.Llama, top.llama_cpp = _FakeLlama, low
    monkeypatch.setitem(sys.modules, "llama_cpp", top)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", low)
    _FakeLlama.loads = []
    return _FakeLlama


@pytest.mark.parametrize("repack", [True, False])
def test_perplexity_loads_the_model_as_its_engine_does(quantized, fake_llama_cpp, repack):
    """An engine that runs only without the weight repacking (where llama.cpp's repacking crashes)
    must measure its perplexity without it too: a perplexity model loaded with the repacking on
    killed the bench's llama.cpp rows on an Intel Xeon VM. Uniform logits give perplexity = vocab."""
    _, path = quantized
    engine = peer.LlamaCppEngine(path, n_threads=2, n_ctx=16, repack=repack)
    assert engine.perplexity(np.ones((2, 8), np.int64)) == pytest.approx(5.0)
    assert fake_llama_cpp.loads == [repack, repack]
    import llama_cpp.llama_cpp as low

    assert low.llama_model_default_params().use_extra_bufts  # the default restored after each load
