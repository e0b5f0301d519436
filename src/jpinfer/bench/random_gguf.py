"""GGUF files of random weights in a real model's shapes, for speed at a scale no checkpoint here has.

Decode speed depends on the shapes, the bytes and (for the sparse engines) which neurons are read, not on
the weights' values, so a Llama-2-7B-shaped file of random weights measures what a 7B model costs on this
machine (``bench/cpu_7b.py``). The file is an ordinary ``llama`` GGUF that jpinfer
(``models.loading.load_quantized_gguf``) and llama.cpp both load: its tokenizer is a placeholder
SentencePiece vocabulary (the three special tokens, the 256 byte tokens, then pieces ``▁w0``, ``▁w1``, ...),
so prompts are token ids. The tensors are quantized by the ``gguf`` package's own quantizer
(``gguf.quants.quantize``), written one at a time, and the file is kept in the cache
(``$JPINFER_CACHE/random_gguf``), written once per shape, type and seed.

Scales keep the activations finite through every layer: the projections reading the normalized stream
(q, k, v, gate, up) have variance 1 / in; those writing back into the residual stream (o, down) are also divided by
sqrt(2 n_layers), so the stream grows by about one unit of variance over the whole model (GPT-2's
initialisation, Radford et al., 2019); norm scales are 1, the embedding of variance 1, the head 1 / d. The
weights are uniform of those variances (numpy draws uniform floats several times faster than normal ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import time
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quant_shape_to_byte_shape, quantize

from jpinfer import artifacts
from jpinfer.cache import cache_dir

FILE_TYPES = {"Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
              "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
# The head keeps 8 bits in every file, as llama.cpp keeps its output matrix at 6 to 8 bits in 4-bit files
HEAD_TYPE = GGMLQuantizationType.Q8_0
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
NORM_EPS = 1e-5
CHUNK_WEIGHTS = 1 << 22  # weights drawn and quantized at a time (16 MB of float32)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes of a Llama-family decoder (SwiGLU FFN, RMSNorm, RoPE, untied head)."""

    name: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context: int = 4096

    def __post_init__(self) -> None:
        if min(self.n_layers, self.d_model, self.d_ff, self.n_heads, self.n_kv_heads) < 1:
            raise ValueError(f"every size must be positive: {self}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model must split into an even head size, heads into kv groups: {self}")
        if self.d_model % 32 or self.d_ff % 32:
            raise ValueError(f"d_model and d_ff must be multiples of 32 (the quantized blocks): {self}")
        if self.vocab < len(SPECIAL_TOKENS) + 256 + 1:
            raise ValueError(f"the vocabulary needs room for the special and byte tokens: {self}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


LLAMA2_7B = Shapes("llama-2-7b-shapes", n_layers=32, d_model=4096, d_ff=11008, n_heads=32, n_kv_heads=32, vocab=32000)


def tensor_shapes(shapes: Shapes) -> dict[str, tuple[int, int] | tuple[int]]:
    """Every tensor of the file in numpy order ((out, in) for a matrix), by its GGUF name, in file order."""
    d, f, kv = shapes.d_model, shapes.d_ff, shapes.n_kv_heads * shapes.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shapes.vocab, d), "output_norm.weight": (d,),
                                       "output.weight": (shapes.vocab, d)}
    for i in range(shapes.n_layers):
        out |= {f"blk.{i}.{name}": shape for name, shape in (
            ("attn_norm.weight", (d,)), ("attn_q.weight", (d, d)), ("attn_k.weight", (kv, d)),
            ("attn_v.weight", (kv, d)), ("attn_output.weight", (d, d)), ("ffn_norm.weight", (d,)),
            ("ffn_gate.weight", (f, d)), ("ffn_up.weight", (f, d)), ("ffn_down.weight", (d, f)))}
    return out


def _scale(name: str, shape: tuple[int, ...], n_layers: int) -> float:
    """The standard deviation of a tensor's random weights (module docstring)."""
    if name == "token_embd.weight":
        return 1.0
    scale = 1.0 / math.sqrt(shape[1])
    return scale / math.sqrt(2 * n_layers) if name.endswith(("attn_output.weight", "ffn_down.weight")) else scale


def vocabulary(n: int) -> tuple[list[str], list[float], list[int]]:
    """A placeholder SentencePiece vocabulary of ``n`` pieces: tokens, scores, token types."""
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = [f"\u2581w{i}" for i in range(n - len(SPECIAL_TOKENS) - len(pieces))]
    tokens = [*SPECIAL_TOKENS, *pieces, *words]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256 + \
        [TokenType.NORMAL] * len(words)
    scores = [0.0] * (len(SPECIAL_TOKENS) + 256) + [-float(i) for i in range(len(words))]
    return tokens, scores, [int(t) for t in types]


def random_gguf_path(shapes: Shapes, file_type: str, seed: int = 0) -> pathlib.Path:
    """Where the file of these shapes, type and seed lives in the cache (written or not)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    return cache_dir("random_gguf") / f"{shapes.name}-{file_type}-seed{seed}.gguf"


def random_ggufs(shapes: Shapes, file_types: tuple[str, ...], seed: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, pathlib.Path]:
    """The cached GGUFs of random weights in ``shapes``, one per file type ("Q8_0", "Q4_0"), those missing written
    now in one pass over the weights (``progress(done, total)`` after each tensor; beside each file a JSON record
    of its shapes, seed and the seconds the pass took). One seed gives the same float weights for every type: the
    files are one model at several precisions."""
    paths = {ft: random_gguf_path(shapes, ft, seed) for ft in dict.fromkeys(file_types)}
    missing = {ft: path for ft, path in paths.items() if not path.is_file()}
    if missing:
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:  # an interrupted write never leaves a complete-looking file
            temps = {ft: stack.enter_context(artifacts.atomic_write(path)) for ft, path in missing.items()}
            write_random_ggufs(temps, shapes, seed, progress)
        record = {"shapes": dataclasses.asdict(shapes), "seed": seed, "written_with": sorted(missing),
                  "write_s": time.perf_counter() - started}
        for ft, path in missing.items():
            path.with_suffix(".json").write_text(json.dumps(record | {"file_type": ft}))
    return paths


def write_random_ggufs(targets: dict[str, pathlib.Path], shapes: Shapes, seed: int,
                       progress: Callable[[int, int], None] | None = None) -> None:
    """Write one file per type (``targets``: file type -> path), one tensor in memory at a time; the float weights
    are drawn ``CHUNK_WEIGHTS`` at a time (uniform, of the standard deviation of the module docstring) and every
    type is quantized from the same draw."""
    layout = tensor_shapes(shapes)
    writers = {ft: _start_file(path, shapes, ft, layout) for ft, path in targets.items()}
    rng = np.random.default_rng(seed)
    for done, (name, shape) in enumerate(layout.items(), 1):
        if len(shape) == 1:
            for writer in writers.values():
                writer.write_tensor_data(np.ones(shape, np.float32))
        else:
            half_width = np.float32(math.sqrt(3.0) * _scale(name, shape, shapes.n_layers))  # uniform: var = a^2 / 3
            rows = max(1, CHUNK_WEIGHTS // shape[1])
            parts: dict[str, list[np.ndarray]] = {ft: [] for ft in writers}
            for start in range(0, shape[0], rows):
                w = rng.random((min(rows, shape[0] - start), shape[1]), np.float32)
                w = (w - np.float32(0.5)) * (2 * half_width)
                for ft in writers:
                    parts[ft].append(quantize(w, _tensor_type(name, ft)))
            for ft, writer in writers.items():
                writer.write_tensor_data(np.concatenate(parts[ft]))
        if progress is not None:
            progress(done, len(layout))
    for writer in writers.values():
        writer.close()


def _tensor_type(name: str, file_type: str) -> GGMLQuantizationType:
    return HEAD_TYPE if name == "output.weight" else FILE_TYPES[file_type][0]


def _start_file(path: pathlib.Path, shapes: Shapes, file_type: str,
                layout: dict[str, tuple[int, ...]]) -> GGUFWriter:
    """A writer with the file's metadata and tensor table written, ready for the tensors' data."""
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"{shapes.name} (random weights)")
    writer.add_context_length(shapes.context)
    writer.add_embedding_length(shapes.d_model)
    writer.add_block_count(shapes.n_layers)
    writer.add_feed_forward_length(shapes.d_ff)
    writer.add_rope_dimension_count(shapes.head_dim)
    writer.add_head_count(shapes.n_heads)
    writer.add_head_count_kv(shapes.n_kv_heads)
    writer.add_layer_norm_rms_eps(NORM_EPS)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(int(FILE_TYPES[file_type][1]))
    tokens, scores, types = vocabulary(shapes.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, shape in layout.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            kind = _tensor_type(name, file_type)
            byte_shape = tuple(quant_shape_to_byte_shape(shape, kind))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer
