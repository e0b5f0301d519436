"""Profiling text -> fixed-length token windows.

A corpus is a local file (text, JSON/JSONL, CSV/TSV), a bundled name (``jpinfer.data``:
``wikitext2-valid``, ``wikitext2-test``, ``chatgpt-prompts``) or any ``datasets`` name
(``split`` may slice, e.g. ``"train[:5%]"``). Everything is read through
``datasets.load_dataset``. A text file is one document (its raw text, line breaks kept);
JSON/CSV files and hub datasets give one document per record, the chosen fields joined
by newlines. Documents are tokenised in order (shuffled with ``seed`` when given), joined
with the tokenizer's EOS id, and the stream is cut into non-overlapping windows.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from jpinfer.data import BUNDLED_CORPORA
from jpinfer.errors import JpinferError

BUILDERS = {
    ".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv",
}


class CorpusError(JpinferError):
    """The corpus cannot give the requested token windows; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where profiling text comes from. ``fields`` name the text columns of JSON/CSV/hub records."""

    source: str
    fields: tuple[str, ...] = ()
    split: str = "train"
    subset: str | None = None  # a hub dataset's configuration name

    @classmethod
    def of(cls, corpus: "Corpus | str | os.PathLike", fields: Sequence[str] | str | None = None) -> "Corpus":
        """A Corpus from a Corpus, a path or a name; ``fields`` overrides the corpus' own."""
        if isinstance(fields, str):
            fields = (fields,)
        if isinstance(corpus, Corpus):
            return corpus if fields is None else dataclasses.replace(corpus, fields=tuple(fields))
        if not isinstance(corpus, (str, os.PathLike)):
            raise CorpusError(f"corpus must be a file path, a dataset name or a Corpus, got {type(corpus).__name__}")
        return cls(str(corpus), tuple(fields or ()))

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"fields": list(self.fields)}


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Token windows (n_windows, window) int32 and how they were made (stored in profiles)."""

    tokens: np.ndarray
    origin: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


def _load(corpus: Corpus):
    """(datasets.Dataset, text fields) for a corpus; every failure is a CorpusError."""
    import datasets

    source, fields = corpus.source, corpus.fields
    if source in BUNDLED_CORPORA:
        path, default_fields = BUNDLED_CORPORA[source]
        source, fields = str(path), fields or default_fields
    path = pathlib.Path(source).expanduser()
    looks_like_path = path.suffix.lower() in BUILDERS or os.sep in source or source.startswith(("~", "."))
    if not path.exists() and looks_like_path:
        raise CorpusError(f"corpus file {str(path)!r} does not exist")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            raise CorpusError(f"corpus {str(path)!r} is a directory: give a .txt, .json, .jsonl or .csv file")
        if path.exists():
            builder = BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise CorpusError(
                    f"cannot read corpus file {str(path)!r}: use a {', '.join(BUILDERS)} file"
                )
            if builder == "text" and fields not in ((), ("text",)):
                raise CorpusError(f"{str(path)!r} is a plain text file: it has no fields, drop fields={list(fields)}")
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            if path.suffix.lower() == ".tsv":
                kwargs["delimiter"] = "\t"
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
            where = f"corpus file {str(path)!r}"
        else:
            dataset = datasets.load_dataset(source, corpus.subset, split=corpus.split)
            where = f"dataset {source!r} (split {corpus.split!r})"
    except CorpusError:
        raise
    except Exception as e:  # datasets raises many kinds: missing hub name, no network, bad JSON
        raise CorpusError(f"could not read corpus {corpus.source!r} through datasets: {type(e).__name__}: {e}") from e
    columns = list(dataset.column_names)
    if not fields:
        if "text" not in columns:
            raise CorpusError(f"{where} has no 'text' column: choose fields from {columns}")
        fields = ("text",)
    missing = [f for f in fields if f not in columns]
    if missing:
        raise CorpusError(f"{where} has no field(s) {missing}: choose fields from {columns}")
    return dataset, fields


def documents(corpus: Corpus, seed: int | None = None) -> Iterator[str]:
    """The corpus' non-empty documents, in file order or shuffled with ``seed``."""
    dataset, fields = _load(corpus)
    if seed is not None:
        dataset = dataset.shuffle(seed=seed)
    for record in dataset:
        text = "\n".join(str(record[f]) for f in fields if record[f] not in (None, ""))
        if text.strip():
            yield text


def token_windows(
    corpus: Corpus | str | os.PathLike,
    tokenizer: Any,
    *,
    window: int = 512,
    n_tokens: int | None = None,
    seed: int | None = None,
    bos: bool = False,
    fields: Sequence[str] | str | None = None,
) -> TokenWindows:
    """Cut the corpus into ``n_tokens // window`` windows of ``window`` tokens.

    ``n_tokens=None`` takes every full window. ``seed=None`` takes windows from the start
    (the perplexity protocol); an integer shuffles documents and picks a random subset of
    windows. ``bos`` starts every window with the BOS token. Fewer windows than asked
    (but at least one) is a warning; none is a CorpusError.
    """
    corpus = Corpus.of(corpus, fields)
    if tokenizer is None:
        raise CorpusError("text corpora need a tokenizer: load the model with its tokenizer or pass token windows")
    if not isinstance(window, int) or window < 2:
        raise CorpusError(f"window must be an integer >= 2, got {window!r}")
    if n_tokens is not None and n_tokens < window:
        raise CorpusError(f"n_tokens ({n_tokens}) is less than one window ({window}): raise n_tokens or lower window")
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is None:
        raise CorpusError("bos=True, but the tokenizer has no BOS token")
    body = window - int(bos)
    wanted = None if n_tokens is None else n_tokens // window
    eos_id = getattr(tokenizer, "eos_token_id", None)

    stream: list[int] = []
    for doc in documents(corpus, seed):
        if stream and eos_id is not None:
            stream.append(int(eos_id))
        stream.extend(int(i) for i in tokenizer.encode(doc, add_special_tokens=False))
        if wanted is not None and len(stream) >= wanted * body:
            break
    if not stream:
        fields = list(corpus.fields) or ["text"]
        raise CorpusError(f"corpus {corpus.source!r} is empty: it holds no text in fields {fields}")
    available = len(stream) // body
    if available == 0:
        raise CorpusError(
            f"corpus {corpus.source!r} has {len(stream)} tokens, fewer than one window of {body}: "
            "give more text or lower window"
        )
    n = available if wanted is None else min(wanted, available)
    if n < (wanted or 0):
        warnings.warn(
            f"corpus {corpus.source!r} holds {available} windows of {window} tokens; using all of them, not {wanted}"
        )
    chosen = np.arange(n) if seed is None else np.sort(np.random.default_rng(seed).choice(available, n, replace=False))
    tokens = np.asarray(stream[: available * body], np.int32).reshape(available, body)[chosen]
    if bos:
        tokens = np.concatenate([np.full((n, 1), bos_id, np.int32), tokens], axis=1)
    origin = corpus.describe() | {
        "window": window, "seed": seed, "bos": bos, "n_windows": n, "windows_available": available,
    }
    return TokenWindows(tokens, origin)
