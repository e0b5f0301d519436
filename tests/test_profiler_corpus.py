"""Corpus input: files and bundled names through datasets, windows, and every bad-input error."""

import csv
import json

import numpy as np
import pytest

from jpinfer.data import BUNDLED_CORPORA, CHATGPT_PROMPTS, WIKITEXT2_VALID
from jpinfer.profiler import Corpus, CorpusError, ProfileSettings, profile, token_windows

from profiler_fixtures import CharTokenizer, tiny_engine

TOK = CharTokenizer()
PROMPT_JSON = json.dumps([{"prompt": "abc"}])


def ids(text):
    return TOK.encode(text)


def test_text_file_is_one_raw_document(tmp_path):
    text = "hello world\n\nsecond line\n" * 3
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    out = token_windows(path, TOK, window=10)
    expected = np.array(ids(text)[: len(text) // 10 * 10]).reshape(-1, 10)
    np.testing.assert_array_equal(out.tokens, expected)
    assert out.origin["windows_available"] == len(text) // 10
    first = token_windows(path, TOK, window=10, n_tokens=25)  # two windows from the start
    np.testing.assert_array_equal(first.tokens, expected[:2])


def test_seed_picks_distinct_windows_reproducibly(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), 400)))
    full = token_windows(path, TOK, window=8).tokens
    a = token_windows(path, TOK, window=8, n_tokens=80, seed=3).tokens
    b = token_windows(path, TOK, window=8, n_tokens=80, seed=3).tokens
    c = token_windows(path, TOK, window=8, n_tokens=80, seed=4).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    rows = {tuple(r) for r in full}
    assert len({tuple(r) for r in a}) == 10 and all(tuple(r) in rows for r in a)


def test_json_records_join_fields_and_documents_with_eos(tmp_path):
    records = [{"instruction": "ab", "input": "cd", "output": "x"}, {"instruction": "ef", "input": "", "output": "y"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    out = token_windows(path, TOK, window=4, fields=["instruction", "input"])
    stream = ids("ab\ncd") + [TOK.eos_token_id] + ids("ef")
    np.testing.assert_array_equal(out.tokens.ravel(), stream[:8])


def test_bos_starts_every_window(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("abcdefghij")
    out = token_windows(path, TOK, window=4, bos=True)
    np.testing.assert_array_equal(out.tokens, [[1, *ids("abc")], [1, *ids("def")], [1, *ids("ghi")]])


def test_bundled_corpora_resolve_by_name():
    assert set(BUNDLED_CORPORA) == {"wikitext2-valid", "wikitext2-test", "chatgpt-prompts"}
    out = token_windows("chatgpt-prompts", TOK, window=64, n_tokens=128)
    with CHATGPT_PROMPTS.open(newline="", encoding="utf-8") as f:
        first = next(csv.DictReader(f))["prompt"]
    np.testing.assert_array_equal(out.tokens[0], ids(first)[:64])
    wiki = token_windows("wikitext2-valid", TOK, window=64, n_tokens=64)
    np.testing.assert_array_equal(wiki.tokens[0], ids(WIKITEXT2_VALID.read_text(encoding="utf-8"))[:64])


def test_csv_and_tsv_fields(tmp_path):
    (tmp_path / "p.csv").write_text('act,prompt\nx,"hello there"\ny,"general kenobi"\n')
    (tmp_path / "p.tsv").write_text("act\tprompt\nx\thello there\n")
    out = token_windows(tmp_path / "p.csv", TOK, window=5, fields="prompt")
    np.testing.assert_array_equal(out.tokens.ravel(), (ids("hello there") + [2] + ids("general kenobi"))[:25])
    np.testing.assert_array_equal(token_windows(tmp_path / "p.tsv", TOK, window=11, fields="prompt").tokens[0],
                                  ids("hello there"))


def test_profile_reads_a_corpus_file(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("the quick brown fox jumps over the lazy dog " * 4)
    prof = profile(tiny_engine("relu"), path, ProfileSettings(window=16, n_tokens=64, seed=None), progress=False)
    assert prof.n_tokens == 64 and prof.meta["corpus"]["source"] == str(path)


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda d: d / "missing.txt", {}, "does not exist"),
    (lambda d: d / "no" / "such" / "file.json", {"fields": "text"}, "does not exist"),
    (lambda d: d, {}, "is a directory"),
    (lambda d: _write(d / "c.parquet", "x"), {}, "cannot read corpus file"),
    (lambda d: _write(d / "c.json", PROMPT_JSON), {"fields": "text"}, r"no field\(s\) \['text'\].*'prompt'"),
    (lambda d: _write(d / "c.json", PROMPT_JSON), {}, "no 'text' column.*'prompt'"),
    (lambda d: _write(d / "c.csv", "a,b\n1,2\n"), {"fields": ["a", "c"]}, r"no field\(s\) \['c'\]"),
    (lambda d: _write(d / "c.txt", "abc"), {"fields": "prompt"}, "plain text file"),
    (lambda d: _write(d / "c.txt", ""), {}, "is empty"),
    (lambda d: _write(d / "c.txt", "  \n\n "), {}, "is empty"),
    (lambda d: _write(d / "c.json", json.dumps([{"text": ""}, {"text": None}])), {}, "is empty"),
    (lambda d: _write(d / "c.txt", "abc"), {}, "fewer than one window"),
    (lambda d: _write(d / "c.txt", "a" * 100), {"n_tokens": 10}, "less than one window"),
    (lambda d: _write(d / "c.txt", "a" * 100), {"window": 1}, "window must be"),
    (lambda d: _write(d / "c.json", "{not json"), {}, "could not read corpus"),
])
def test_bad_corpus_is_a_clear_error(tmp_path, make, kwargs, message):
    kwargs = {"window": 16} | kwargs
    with pytest.raises(CorpusError, match=message):
        token_windows(make(tmp_path), TOK, **kwargs)


def test_fewer_windows_than_asked_warns_and_uses_all(tmp_path):
    path = _write(tmp_path / "c.txt", "a" * 40)
    with pytest.warns(UserWarning, match="using all"):
        out = token_windows(path, TOK, window=16, n_tokens=160)
    assert out.tokens.shape == (2, 16)


def test_corpus_arguments():
    with pytest.raises(CorpusError, match="need a tokenizer"):
        token_windows("wikitext2-valid", None)
    with pytest.raises(CorpusError, match="must be a file path"):
        Corpus.of(3)
    assert Corpus.of("x.json", "a").fields == ("a",)


def _write(path, text):
    path.write_text(text)
    return path
