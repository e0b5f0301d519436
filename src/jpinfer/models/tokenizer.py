"""Tokenizers: built from a GGUF file's own fields, or loaded from a Hugging Face directory (tokenizer.json,
or SentencePiece's tokenizer.model alone; none at all: a model of token ids).

transformers can read a GGUF tokenizer only with PyTorch installed; jpinfer must not
need PyTorch at run time, so the tokenizer a GGUF describes is rebuilt here with the
``tokenizers`` library and wrapped as a transformers fast tokenizer, which brings
encode/decode/apply_chat_template: a byte-level BPE (``gpt2``: tokens, merges, token types,
pre-tokenizer name) or a SentencePiece BPE (``llama``: tokens, scores, token types; Llama 2's,
Gemma's, Phi-3's), with the special ids and the chat template.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from jpinfer.errors import CheckpointError

Tokenizer = PreTrainedTokenizerFast

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's word boundary mark

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


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], need, source: str) -> RawTokenizer:
    """llama.cpp's ``gpt2`` tokenizer model: byte-level BPE with the file's merges and pre-tokenizer."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    merges = [tuple(m.split(" ", 1)) for m in need("tokenizer.ggml.merges")]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.Sequence(_PRE_TOKENIZERS[pre]())
    raw.decoder = decoders.ByteLevel()
    return raw


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int], need,
                       source: str) -> RawTokenizer:
    """llama.cpp's ``llama`` tokenizer model: SentencePiece BPE, whose pieces merge in the order of the merged
    piece's score (highest first), with byte fallback (<0xNN> pieces), spaces written as U+2581 and, unless
    the file says otherwise, one prepended to the text. The merges are read off the scores as transformers'
    SentencePiece converter reads them: every split of a normal piece into two pieces of the vocabulary."""
    scores = [float(x) for x in need("tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise CheckpointError(f"{source}: {len(scores)} token scores for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind != _NORMAL:
            continue
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += [(score, vocab[left], vocab[right], left, right) for left, right in local]
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=True,
                                  byte_fallback=True, unk_token=None if unk is None else tokens[int(unk)]))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    raw.normalizer = normalizers.Sequence(([normalizers.Prepend(_SPACE)] if prefix else [])
                                          + [normalizers.Replace(" ", _SPACE)])
    raw.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return raw


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF's ``tokenizer.*`` fields describe: byte-level BPE (``gpt2``) or SentencePiece BPE
    (``llama``).

    ``metadata`` maps GGUF keys to plain values (arrays as lists); ``source`` names the
    file in error messages.
    """

    def need(key: str):
        if key not in metadata:
            raise CheckpointError(f"{source}: tokenizer field {key!r} is missing")
        return metadata[key]

    kind = need("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{source}: tokenizer model {kind!r} is not supported; jpinfer builds byte-level BPE "
                              "('gpt2') and SentencePiece BPE ('llama') tokenizers")
    tokens: list[str] = list(need("tokenizer.ggml.tokens"))
    types = list(metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    raw = (_byte_level_bpe(metadata, tokens, need, source) if kind == "gpt2"
           else _sentencepiece_bpe(metadata, tokens, types, need, source))
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

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))  # llama.cpp's defaults
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
    # imported here: AutoTokenizer brings transformers' configuration code and with it PyTorch where installed
    # (0.18 GB of a process's peak, bench/results/experiments/load_memory.md), which a GGUF's tokenizer, built from
    # ``tokenizers`` alone, never needs
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, ImportError) as err:
        raise CheckpointError(f"{directory}: cannot load the tokenizer ({err})") from err
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise CheckpointError(f"{directory}: loaded a {type(tok).__name__}, not a fast tokenizer")
    return tok
