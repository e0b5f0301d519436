"""The tokenizer forms a checkpoint comes in besides tokenizer.json and byte-level BPE GGUFs: SentencePiece's
tokenizer.model alone (Llama 2 fine-tunes, ReluLLaMA) and SentencePiece GGUFs, against the sentencepiece
library itself; and none at all, a model of token ids, against transformers' generate."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers

import jpinfer
from jpinfer.data import WIKITEXT2_TEST, WIKITEXT2_VALID
from jpinfer.models.gguf_loader import load_gguf_tokenizer
from jpinfer.models.tokenizer import load_hf_tokenizer

import gguf_fixtures as fx
from hf_reference import TINY, make_model

VOCAB = 600  # a byte-fallback BPE: every held-out character encodes (no unknown ids)


@pytest.fixture(scope="module")
def sentencepiece_checkpoint(tmp_path_factory):
    """A tiny random Llama whose only tokenizer file is a SentencePiece model trained here on WikiText-2's
    validation text; returns (directory, the model in PyTorch, the trained processor)."""
    root = tmp_path_factory.mktemp("sentencepiece")
    spm.SentencePieceTrainer.train(input=str(WIKITEXT2_VALID), model_prefix=str(root / "sp"), vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.9995, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    directory = root / "checkpoint"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY | {"vocab_size": VOCAB}), intermediate_size=48, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(root / "sp.model", directory / "tokenizer.model")
    return directory, model, spm.SentencePieceProcessor(model_file=str(root / "sp.model"))


def held_out_lines(n: int = 40) -> list[str]:
    """Long lines of WikiText-2's test text without its "<unk>" marker: transformers matches the special
    tokens' text (<unk>, <s>, </s>) as those tokens, sentencepiece encodes it as plain text."""
    lines = [line.strip() for line in WIKITEXT2_TEST.read_text(encoding="utf-8").splitlines()
             if len(line) > 80 and "<" not in line]
    return lines[:n]


def test_a_sentencepiece_only_directory_tokenizes_like_sentencepiece(sentencepiece_checkpoint):
    directory, _, processor = sentencepiece_checkpoint
    assert sorted(p.name for p in directory.iterdir() if "token" in p.name) == ["tokenizer.model"]
    tok = load_hf_tokenizer(directory)
    lines = held_out_lines()
    for line in lines:
        ids = tok.encode(line, add_special_tokens=False)
        assert ids == processor.encode(line)
        assert tok.decode(ids) == processor.decode(ids)
    assert sum(tok.decode(tok.encode(line, add_special_tokens=False)) == line for line in lines) > 0.9 * len(lines)


def test_a_sentencepiece_only_checkpoint_generates_from_text_like_transformers(sentencepiece_checkpoint):
    directory, model, processor = sentencepiece_checkpoint
    engine = jpinfer.load(directory)
    text = held_out_lines(1)[0][:60]
    ids = engine.encode_prompt(text)
    assert ids in (processor.encode(text), [processor.bos_id(), *processor.encode(text)])  # BOS as transformers adds
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    result = engine.generate(text, max_new_tokens=8, ignore_eos=True)
    assert result.token_ids == expected[0, len(ids):].tolist()
    assert result.text == processor.decode(result.token_ids)


def test_a_directory_without_a_tokenizer_loads_and_generates_from_ids(tmp_path):
    model = make_model("phi3", tmp_path)
    assert not any("token" in p.name for p in tmp_path.iterdir())
    engine = jpinfer.load(tmp_path)
    assert engine.tokenizer is None
    prompt = [5, 17, 3, 88]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    result = engine.generate(np.asarray(prompt), max_new_tokens=6, ignore_eos=True)
    assert result.token_ids == expected[0, 4:].tolist() and result.text == ""
    with pytest.raises(ValueError, match="loaded without a tokenizer: pass token ids"):
        engine.generate("some text", max_new_tokens=2)


@pytest.fixture(scope="module")
def llama2_style_gguf(tmp_path_factory):
    """A SentencePiece BPE trained like Llama 2's tokenizer (identity normalization, whitespace kept, byte
    fallback, a space prefix) and a GGUF carrying it as llama.cpp's converter writes one (tokenizer model
    ``llama``: pieces, scores, token types); returns (the GGUF's path, the trained processor)."""
    root = tmp_path_factory.mktemp("llama2_tokenizer")
    spm.SentencePieceTrainer.train(input=str(WIKITEXT2_VALID), model_prefix=str(root / "sp"), vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.9995,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "sp.model"))
    ids = range(sp.get_piece_size())
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
              "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in ids], "tokenizer.ggml.token_type": kinds,
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
              "tokenizer.ggml.merges": None, "tokenizer.ggml.pre": None, "tokenizer.ggml.padding_token_id": None,
              "tokenizer.ggml.add_bos_token": None, "tokenizer.chat_template": None}
    cfg = dataclasses.replace(fx.tiny_config(), vocab_size=sp.get_piece_size())
    return fx.write_gguf(root / "llama2.gguf", cfg, fx.random_tensors(cfg), metadata=fields), sp


def test_a_sentencepiece_gguf_tokenizes_like_sentencepiece(llama2_style_gguf):
    """llama.cpp's ``llama`` tokenizer model rebuilt with `tokenizers` (merges from the scores): the ids and
    the text of held-out lines, and of whitespace the identity normalization keeps, equal sentencepiece's;
    a BOS is added by default, as llama.cpp does for this model."""
    path, sp = llama2_style_gguf
    tok = load_gguf_tokenizer(path)
    for text in [*held_out_lines(), "  two  spaces\tand\ttabs\n\nnew lines ", "naïve café 東京 🙂", "x"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text, text
    assert tok.encode("Hello") == [sp.bos_id(), *sp.encode("Hello")]
