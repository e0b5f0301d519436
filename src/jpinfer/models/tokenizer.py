"""Tokenizers: built from a GGUF file's own fields, or loaded from a Hugging Face directory (tokenizer.json,
or SentencePiece's tokenizer.model alone; none at all: a model of token ids).

transformers can read a GGUF tokenizer only with PyTorch installed; jpinfer must not
need PyTorch at run time, so the byte-level BPE a GGUF describes (tokens, merges, token
types, pre-tokenizer name, special ids, chat template) is rebuilt here with the
``tokenizers`` library and wrapped as a transformers fast tokenizer, which brings
encode/decode/apply_chat_template.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from jpinfer.errors import CheckpointError

Tokenizer = PreTrainedTokenizerFast

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Llama-3's split regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> list:
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _digits_then_gpt2_split() -> list:
    # llama.cpp: first isolate every \p{N} character, then apply GPT-2's regex to the rest
    # (the same as the original SmolLM / StarCoder tokenizer.json).
    return [pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()]


def _llama3_split() -> list:
    return [
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


# tokenizer.ggml.pre -> pre-tokenizer steps, following llama.cpp's grouping of these names.
_PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split,
    "codeshell": _digits_then_gpt2_split,
    "llama-bpe": _llama3_split,
    "llama3": _llama3_split,
    "llama-v3": _llama3_split,
}


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF's ``tokenizer.*`` fields describe (byte-level BPE only).

    ``metadata`` maps GGUF keys to plain values (arrays as lists); ``source`` names the
    file in error messages.
    """

    def need(key: str):
        if key not in metadata:
            raise CheckpointError(f"{source}: tokenizer field {key!r} is missing")
        return metadata[key]

    kind = need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer model {kind!r} is not supported; jpinfer builds byte-level BPE ('gpt2') tokenizers"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    tokens: list[str] = list(need("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in need("tokenizer.ggml.merges")]
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.Sequence(_PRE_TOKENIZERS[pre]())
    raw.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) and user-defined ones are matched whole in raw text.
    raw.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    raw.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    def token_of(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        if idx is None:
            return None
        if not 0 <= int(idx) < len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.{key} = {idx} is outside the vocabulary of {len(tokens)}")
        return tokens[int(idx)]

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    specials = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
    }
    for flag, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and specials[name] is None:
            raise CheckpointError(f"{source}: asks to add a {name} but names no {name} id")
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in specials.items() if v is not None},
    )


# What a Hugging Face directory's tokenizer is read from: tokenizer.json (fast), tokenizer.model (SentencePiece,
# converted by transformers with the sentencepiece package), vocab.json + merges.txt (byte-level BPE)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_hf_tokenizer(directory: os.PathLike | str) -> Tokenizer | None:
    """The fast tokenizer of a local Hugging Face checkpoint directory (never the network); None for a
    directory with none of ``TOKENIZER_FILES`` (the model then takes token ids, not text)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: tokenizer directory not found")
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, ImportError) as err:
        raise CheckpointError(f"{directory}: cannot load the tokenizer ({err})") from err
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise CheckpointError(f"{directory}: loaded a {type(tok).__name__}, not a fast tokenizer")
    return tok
