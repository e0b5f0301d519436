"""llama.cpp as a bench peer (optional extra ``peers``: the llama-cpp-python package).

jpinfer computes in float32 from dequantized weights, so the fair peer runs the same
float32 weights: ``float32_gguf`` writes (once, cached) a float32 copy of a quantized
GGUF file in llama.cpp's own layout, and ``LlamaCppEngine`` decodes greedily on token
ids with the same RunStats timings as the other bench engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import time
import weakref
from typing import Iterator

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

from jpinfer import artifacts
from jpinfer.bench.child import ChildEngine, EngineFailed
from jpinfer.bench.engines import RunStats
from jpinfer.cache import cache_dir

INSTALL_MESSAGE = (
    "the llama.cpp peer needs llama-cpp-python; install it with: pip install 'jpinfer[peers]' "
    "(it builds llama.cpp from source: about 15 minutes on 2 cores)"
)

_FILE_TYPE_KEY = "general.file_type"
_ARCH_KEY = "general.architecture"
_ALIGNMENT_KEY = "general.alignment"


def float32_gguf(source: os.PathLike | str) -> pathlib.Path:
    """A float32 GGUF with the same metadata and weights as ``source`` (cached; written once).

    Every tensor is dequantized with ``gguf.quants`` (as jpinfer's loader does) and kept in
    the file's own layout, so llama.cpp and jpinfer compute from identical float32 weights.
    """
    source = pathlib.Path(source).resolve()
    stat = source.stat()
    record = {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    target = cache_dir("peers") / f"{_peer_key(record)}.gguf"
    if not target.is_file():
        with artifacts.atomic_write(target) as tmp:  # an interrupted write never leaves a complete-looking file
            _write_float32(source, tmp)
    if not target.with_suffix(".json").is_file():  # also for a copy written before the records were
        with artifacts.atomic_write(target.with_suffix(".json")) as tmp:
            tmp.write_text(json.dumps({"source": record}))
    return target


def _peer_key(source: dict) -> str:
    """The peer files' name stem for a source GGUF (resolved path, size, modification time)."""
    return hashlib.sha256(f"{source['path']}\0{source['size']}\0{source['mtime_ns']}".encode()).hexdigest()[:16]


def peer_file_problem(path: pathlib.Path) -> str | None:
    """Why no bench can reach the peer file ``path`` (a float32 copy KEY.gguf, llama.cpp's quantization
    KEY-TYPE.gguf, or the record KEY.json naming their source) any more; None when it can. Files of a
    source that is gone or changed are orphans, and so are copies without a record (older jpinfer)."""
    key = path.name.split(".")[0].split("-")[0]
    try:
        source = json.loads((path.parent / f"{key}.json").read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no record of its source (written by an older jpinfer, or the record is damaged)"
    try:
        stat = os.stat(source["path"])
    except (OSError, KeyError, TypeError):
        return f"its source {source.get('path') if isinstance(source, dict) else source} is gone"
    if _peer_key({**source, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}) != key:
        return f"its source {source['path']} changed since"
    return None


def _write_float32(source: pathlib.Path, target: pathlib.Path) -> None:
    """Stream ``source``'s metadata and float32-dequantized tensors into ``target``."""
    reader = GGUFReader(source)
    arch = reader.fields[_ARCH_KEY].contents()
    writer = GGUFWriter(target, arch)
    if _ALIGNMENT_KEY in reader.fields:
        writer.data_alignment = int(reader.fields[_ALIGNMENT_KEY].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == _ARCH_KEY:  # header fields; the writer adds the architecture
            continue
        vtype = field.types[0]
        if name == _FILE_TYPE_KEY:
            writer.add_key_value(name, int(LlamaFileType.ALL_F32), vtype)
            continue
        value = field.contents()  # str, Python scalars, or lists of them
        if vtype == GGUFValueType.ARRAY:
            if len(field.types) > 2:
                raise ValueError(f"{source}: nested array field {name!r} cannot be copied")
            if not value:
                raise ValueError(f"{source}: empty array field {name!r} cannot be written by GGUFWriter")
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    if _FILE_TYPE_KEY not in reader.fields:
        writer.add_uint32(_FILE_TYPE_KEY, int(LlamaFileType.ALL_F32))

    shapes = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order
        shapes[t.name] = shape
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:  # one tensor in memory at a time
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shapes[t.name])
        writer.write_tensor_data(w)
    writer.close()


def _weight_bytes_per_token(reader: GGUFReader) -> int:
    """Tensor bytes one decode step reads: all, less the embedding table when ``output.weight`` is separate."""
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    return total - sizes.get("token_embd.weight", 0) if "output.weight" in sizes else total


def _file_type_label(reader: GGUFReader) -> str:
    """The file's weight type as in its name: F32, Q4_1, ..."""
    field = reader.fields.get(_FILE_TYPE_KEY)
    if field is None:
        return "GGUF"
    try:
        return LlamaFileType(int(field.contents())).name.split("_", 1)[1]
    except ValueError:
        return f"file type {int(field.contents())}"


@contextlib.contextmanager
def _weight_repacking(on: bool) -> Iterator[None]:
    """Models loaded in the block repack their weights for the CPU's extra buffer types (llama.cpp's
    default) or not (``use_extra_bufts`` false: what its AMX repacking needs where it crashes).
    llama-cpp-python's ``Llama`` takes no argument for it, so its default parameters are wrapped meanwhile."""
    import llama_cpp.llama_cpp as low

    if on:
        yield
        return
    defaults = low.llama_model_default_params
    if not hasattr(defaults(), "use_extra_bufts"):
        raise RuntimeError("this llama-cpp-python cannot turn llama.cpp's weight repacking off (no use_extra_bufts)")

    def without_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = without_repacking
    try:
        yield
    finally:
        low.llama_model_default_params = defaults


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) on CPU, greedy on token ids, timed like the other engines
    (exactly ``max_new_tokens`` tokens, end-of-sequence included, as every bench engine).

    Uses ``Llama.eval`` and argmax of the last logits row read straight from the context,
    so neither llama-cpp-python's sampler chain nor text (de)tokenization is timed.
    """

    def __init__(
        self,
        model_path: os.PathLike | str,
        n_threads: int = 2,
        label: str | None = None,
        n_ctx: int = 2048,
        repack: bool = True,
    ) -> None:
        import llama_cpp

        self.model_path = pathlib.Path(model_path)
        self.n_threads = n_threads
        self.repack = repack
        reader = GGUFReader(self.model_path)
        self.weight_bytes_per_token = _weight_bytes_per_token(reader)
        self.name = (f"llama.cpp {label or _file_type_label(reader)} ({n_threads} threads"
                     f"{'' if repack else ', no weight repacking'})")
        del reader
        self._llama_cpp = llama_cpp
        with _weight_repacking(repack):
            self.llm = llama_cpp.Llama(
                model_path=str(self.model_path),
                n_threads=n_threads,
                n_threads_batch=n_threads,
                n_ctx=n_ctx,
                verbose=False,
            )
        self.n_ctx = self.llm.n_ctx()
        self.n_vocab = self.llm.n_vocab()
        # Free the model when the engine goes, at the latest at interpreter exit: Llama.__del__
        # run during module teardown fails (TypeError on already torn-down ctypes bindings).
        weakref.finalize(self, self.llm.close)

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("llama_cpp") is not None

    def perplexity(self, windows: np.ndarray) -> float:
        """llama.cpp's own perplexity of this file on token ``windows`` (``perplexity``)."""
        return perplexity(self.model_path, windows, self.n_threads, repack=self.repack)

    def _greedy(self) -> int:
        """Argmax of the logits of the last evaluated token.

        ``Llama.scores``/``eval_logits`` are only filled with ``logits_all=True`` (which
        would compute the LM head for every prompt token), so read the context's row.
        """
        ptr = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return int(np.argmax(row))

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats:
        n = len(prompt_ids)
        if n >= self.n_ctx:
            raise ValueError(f"prompt has {n} tokens but the llama.cpp context is {self.n_ctx}")
        max_new = min(max_new_tokens, self.n_ctx - n)
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(prompt_ids))
        token = self._greedy()
        prefill_s = time.perf_counter() - t0
        tokens: list[int] = [token]
        step_s: list[float] = []
        while len(tokens) < max_new:
            t = time.perf_counter()
            self.llm.eval([token])
            token = self._greedy()
            step_s.append(time.perf_counter() - t)
            tokens.append(token)
        return RunStats(n, tokens, prefill_s, step_s)

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        self.run([0] * n_prompt, 2)


def peer_engine(model_path: os.PathLike | str, n_threads: int = 2, label: str | None = None,
                n_ctx: int = 2048) -> ChildEngine:
    """A ``LlamaCppEngine`` of context ``n_ctx`` in a process of its own (``child``), checked with one short
    decode. Where that
    decode kills the process (llama.cpp's AMX weight repacking segfaulted on an Intel Xeon VM,
    2026-12-02), it is tried once more without the repacking, and its name says so. ``EngineFailed``
    when neither runs."""
    try:
        engine = ChildEngine(LlamaCppEngine, model_path, n_threads=n_threads, label=label, n_ctx=n_ctx)
        engine.warm(8, 2)
        return engine
    except EngineFailed as failure:
        if "process died" not in str(failure):
            raise
        print(f"{failure}; trying again without llama.cpp's weight repacking", file=sys.stderr)
    engine = ChildEngine(LlamaCppEngine, model_path, n_threads=n_threads, label=label, n_ctx=n_ctx, repack=False)
    engine.warm(8, 2)
    return engine


def quantized_gguf(source: os.PathLike | str, file_type: str) -> pathlib.Path:
    """``source`` quantized by llama.cpp itself to ``file_type`` ("Q8_0", "Q4_1", ...; cached, written once).

    Quantized from the float32 copy (``float32_gguf``): the weights jpinfer computes from, so every
    peer file is the same model at another precision."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no file type {file_type!r} (e.g. Q8_0, Q4_0, Q4_1)")
    f32 = float32_gguf(source)
    target = cache_dir("peers") / f"{f32.stem}-{file_type}.gguf"
    if target.is_file():
        return target
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    with artifacts.atomic_write(target) as tmp:
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {f32} to {file_type}")
    return target


def perplexity(model_path: os.PathLike | str, windows: np.ndarray, n_threads: int = 2, repack: bool = True) -> float:
    """llama.cpp's perplexity on token ``windows`` (N, T) as ``profiler.evaluate`` counts it:
    exp(mean NLL) of every token after the first of each window, from llama.cpp's own logits.
    ``repack``: as ``LlamaCppEngine``'s (an engine that runs only without the repacking measures
    its perplexity without it too)."""
    import llama_cpp

    windows = np.asarray(windows)
    with _weight_repacking(repack):
        llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=windows.shape[1], n_batch=windows.shape[1],
                              n_threads=n_threads, n_threads_batch=n_threads, logits_all=True, verbose=False)
    try:
        total = 0.0
        for window in windows:
            llm.reset()
            llm.eval([int(t) for t in window])
            logits = np.asarray(llm.scores[: len(window) - 1], np.float64)  # row t predicts token t + 1
            peak = logits.max(-1, keepdims=True)
            lse = peak[:, 0] + np.log(np.exp(logits - peak).sum(-1))
            total += float((lse - logits[np.arange(len(window) - 1), window[1:]]).sum())
    finally:
        llm.close()
    return float(np.exp(total / (windows.shape[0] * (windows.shape[1] - 1))))
