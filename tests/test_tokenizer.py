"""The GGUF tokenizer built with `tokenizers` against transformers' own GGUF tokenizer (PyTorch)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import regex
from transformers import AutoTokenizer  # reads GGUF tokenizers only with PyTorch (test extra)

from jpinfer.models.default_model import default_model_path
from jpinfer.models.gguf_loader import load_gguf, load_gguf_tokenizer
from jpinfer.models.tokenizer import Tokenizer, load_hf_tokenizer

import gguf_fixtures as fx

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 * 12?"},
    {"role": "assistant", "content": "144."},
    {"role": "user", "content": "And  in   words?\n"},
]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'll say it's done; they're here, we've seen, you'd know.",
    "héllo wörld, naïve café, “quotes” — Ελληνικά, русский, 日本語のテキスト, 🙂👍🏽",
    "def main():\n    return [x ** 2 for x in range(10)]  # squares\n\n\tif a != b:\n\t\tpass\n",
    "a   b\t\tc\n\n\nd    e  ",
    "   leading and trailing   ",
    "Numbers 12345 and 3.14159, 2026-11-29, x1y22z333, x²+y³=z¹",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think> keep me whole </think>",
    "",
]
# Where isolating digits changes the result: llama.cpp's `smollm` pre-tokenizer (like the original
# SmolLM tokenizer.json) splits off every \p{N} character first, so a whitespace run before a digit
# stays one piece and a space never merges with a non-ASCII digit's first byte; transformers' GGUF
# reader uses plain GPT-2 splitting for `smollm`. See digit_first_reference.
DIGIT_SPLIT_CASES = ["a  1", "x =   42;", "line\n\n1. item", "tabs\t\t7", "  9 lives", "n =\n    10", "x ² + y ³",
                     ", ٣٤٥"]

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def digit_first_reference(reference: Tokenizer, text: str) -> list[int]:
    """llama.cpp's `smollm` rule spelled out: split off every \\p{N} char, split the rest with
    GPT-2's regex, then run the byte-level BPE (transformers') on each piece alone."""
    pieces = [p for part in regex.split(r"(\p{N})", text) for p in regex.findall(_GPT2_SPLIT, part)]
    return [i for p in pieces for i in reference.encode(p, add_special_tokens=False)]


def transformers_gguf_tokenizer(path: pathlib.Path) -> Tokenizer:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_tiny(tmp_path, **metadata) -> pathlib.Path:
    cfg = fx.tiny_config()
    return fx.write_gguf(tmp_path / "tok.gguf", cfg, fx.random_tensors(cfg), metadata=metadata)


def assert_same_tokenizer(mine: Tokenizer, theirs: Tokenizer, texts) -> None:
    for text in texts:
        ids = mine.encode(text)
        assert ids == theirs.encode(text), text
        assert mine.decode(ids) == theirs.decode(ids) == text, text
        assert mine.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(mine, attr) == getattr(theirs, attr), attr
    assert sorted(mine.all_special_ids) == sorted(theirs.all_special_ids)
    assert len(mine) == len(theirs)


def assert_same_chat(mine: Tokenizer, theirs: Tokenizer) -> None:
    for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]):
        for gen in (True, False):
            text = mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert mine.encode(text) == theirs.encode(text)


# ---- a tiny GGUF with a trained byte-level BPE ----


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe"])
def test_tiny_ids_equal_transformers(tmp_path, pre):
    path = write_tiny(tmp_path, **{"tokenizer.ggml.pre": pre})
    assert_same_tokenizer(load_gguf_tokenizer(path), transformers_gguf_tokenizer(path), TEXTS)


def test_tiny_chat_template_equals_transformers(tmp_path):
    path = write_tiny(tmp_path)
    assert_same_chat(load_gguf_tokenizer(path), transformers_gguf_tokenizer(path))


def test_tiny_smollm_isolates_digits_like_llama_cpp(tmp_path):
    path = write_tiny(tmp_path)
    mine, theirs = load_gguf_tokenizer(path), transformers_gguf_tokenizer(path)
    for text in DIGIT_SPLIT_CASES + TEXTS[:7]:
        assert mine.encode(text) == digit_first_reference(theirs, text), text


def test_tiny_special_and_user_defined_tokens(tmp_path):
    tok = load_gguf_tokenizer(write_tiny(tmp_path))
    start, think = tok.convert_tokens_to_ids(["<|im_start|>", fx.USER_DEFINED_TOKEN])
    ids = tok.encode("<|im_start|>x<think>y")
    assert ids[0] == start and think in ids
    assert start in tok.all_special_ids and think not in tok.all_special_ids
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y"


def test_tiny_add_bos_token(tmp_path):
    path = write_tiny(tmp_path, **{"tokenizer.ggml.add_bos_token": True})
    mine, theirs = load_gguf_tokenizer(path), transformers_gguf_tokenizer(path)
    assert mine.encode("hi")[0] == mine.bos_token_id
    assert mine.encode("hi there") == theirs.encode("hi there")
    assert mine.encode("hi", add_special_tokens=False) == theirs.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tokenizer.ggml.model": "llama"}, "tokenizer field 'tokenizer.ggml.scores' is missing"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0]}, "1 token scores for"),
        ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2' is not supported"),
        ({"tokenizer.ggml.merges": None}, "tokenizer field 'tokenizer.ggml.merges' is missing"),
        ({"tokenizer.ggml.bos_token_id": 100000}, "tokenizer.ggml.bos_token_id = 100000 is outside the vocabulary"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "2 token types for"),
    ],
    ids=["unknown-model", "spm-no-scores", "spm-scores", "pre", "no-merges", "bos-range", "types"],
)
def test_tokenizer_errors_name_the_file(tmp_path, fields, problem):
    path = write_tiny(tmp_path, **fields)
    with pytest.raises(ValueError, match=regex.escape(f"{path}: {problem}")):
        load_gguf(path)


def test_load_hf_tokenizer_round_trip(tmp_path):
    tok = load_gguf_tokenizer(write_tiny(tmp_path))
    tok.save_pretrained(tmp_path / "hf")
    again = load_hf_tokenizer(tmp_path / "hf")
    assert isinstance(again, Tokenizer)
    assert_same_tokenizer(again, tok, TEXTS)
    assert_same_chat(again, tok)


def test_load_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="tokenizer directory not found"):
        load_hf_tokenizer(tmp_path / "missing")
    assert load_hf_tokenizer(tmp_path) is None  # no tokenizer files: a model of token ids
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        load_hf_tokenizer(tmp_path)


# ---- the default model's tokenizer ----


@pytest.fixture(scope="module")
def default_pair() -> tuple[Tokenizer, Tokenizer]:
    path = default_model_path()
    return load_gguf_tokenizer(path), transformers_gguf_tokenizer(path)


def test_default_ids_and_decode_equal_transformers(default_pair):
    mine, theirs = default_pair
    chat = mine.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert_same_tokenizer(mine, theirs, TEXTS + [chat])


def test_default_chat_template_equals_transformers(default_pair):
    mine, theirs = default_pair
    assert mine.chat_template == theirs.chat_template
    assert_same_chat(mine, theirs)


def test_default_digits_follow_llama_cpp_smollm(default_pair):
    mine, theirs = default_pair
    for text in DIGIT_SPLIT_CASES + TEXTS[:7]:
        ids = mine.encode(text)
        assert ids == digit_first_reference(theirs, text), text
        assert mine.decode(ids) == text


def test_a_gguf_and_its_tokenizer_load_without_pytorch(tmp_path):
    """A GGUF's model and tokenizer load without importing PyTorch: transformers' AutoTokenizer import brings it in
    where it is installed (0.18 GB of a process's peak, 0.05 of a 7B 4-bit file's bytes), so only the Hugging Face
    tokenizer path imports it. Checked in a fresh interpreter (this one has PyTorch loaded for the references)."""
    path = write_tiny(tmp_path)
    code = ("import sys; from jpinfer.models.gguf_loader import load_gguf; "
            f"cfg, tensors, tokenizer = load_gguf({str(path)!r}); assert tokenizer.encode('x y'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
