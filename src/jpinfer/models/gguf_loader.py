"""Load a GGUF file (llama.cpp's format) of architecture llama, qwen2, qwen3, phi3, gemma2, gemma3 or falcon into
jpinfer's flat tensor dict.

The weights come back dequantized to float numpy arrays keyed and shaped like
``jpinfer.models.params.expected_shapes(cfg)`` (projections (out, in)), with the
ModelConfig read from the file's metadata and the tokenizer built from its own fields.
No PyTorch: reading is the ``gguf`` package, dequantization ``gguf.quants``. The file's
Q4_0 / Q4_1 projections can also be read as they are, into ``quant.q4`` blocks (``read_q4_blocks``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jpinfer.config import ModelConfig, RopeScaling
from jpinfer.errors import CheckpointError
from jpinfer.models import quantized
from jpinfer.models.params import FUSED_PROJECTIONS, Norm, Weights, build_layer, expected_shapes
from jpinfer.models.quantized import INT4_KIND
from jpinfer.models.tokenizer import Tokenizer, tokenizer_from_gguf_metadata
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix

GGUF_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp: per-frequency divisors of the RoPE frequencies (Llama 3.1)

SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)

# GGUF layer tensor -> jpinfer name. Both are (out, in) in numpy order: nothing is transposed.
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "attn_norm.scale",
    "ffn_norm.weight": "ffn_norm.scale",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "attn_q.bias": "bq",  # qwen2
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm.scale",  # qwen3
    "attn_k_norm.weight": "k_norm.scale",
    "post_attention_norm.weight": "attn_out_norm.scale",  # gemma2: the norms on the attention's and FFN's outputs
    "post_ffw_norm.weight": "ffn_out_norm.scale",
}
# The architectures read (general.architecture, also the prefix of their metadata keys). llama.cpp's converter
# permutes llama's q/k rows for its adjacent-pair RoPE; the others keep Hugging Face's halves (NEOX). Gemma's norm
# weights (q/k norms too) are stored as 1 + w, the scale jpinfer applies (its converter adds the 1).
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "falcon")
# What a Gemma file does not hold, llama.cpp fixes by architecture: the 27B models (by their layer count) scale
# queries by (d_model / heads) ** -0.5, the others by head_dim ** -0.5; Gemma 2 slides in every other layer from the
# first, Gemma 3 in five layers of six, at a RoPE base of 10000, unscaled
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# Falcon as llama.cpp runs it: attention and FFN side by side on LayerNorms (with biases), an ungated GELU FFN, no
# projection biases. Its GGUF names the norms by position, not use: attn_norm feeds the FFN (and the attention too
# when the file has no attn_norm_2: Falcon-7B's one LayerNorm), attn_norm_2 the attention (Falcon-40B's ln_attn).
# The FFN is Hugging Face's GELU, the erf form (llama.cpp's graph computes the tanh approximation).
_FALCON_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "ffn_norm.scale", "attn_norm.bias": "ffn_norm.bias",
    "attn_norm_2.weight": "attn_norm.scale", "attn_norm_2.bias": "attn_norm.bias",
    "attn_output.weight": "wo", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
# Phi-3's files keep q/k/v and gate/up fused, as its checkpoints do (gate rows first), and Falcon's q/k/v (its
# converter reorders each kv group's queries, key and value into [all queries; all keys; all values]): the layer
# tensor -> the separate tensors it stacks, in order (split on load; params.build_weights fuses them again)
_FUSED_IN_FILE: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")},
    "falcon": {"attn_qkv.weight": ("wq", "wk", "wv")},
}
# LongRoPE (Phi-3's 128k-context models): per-frequency factors for short and long contexts
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "embed",
    "output_norm": "final_norm.scale",
    "output": "lm_head",
}


class GGUFError(CheckpointError):
    """A GGUF file that jpinfer cannot load; the message names the file and the problem."""

    def __init__(self, path: os.PathLike | str, problem: str):
        super().__init__(f"{path}: {problem}")


def load_gguf(
    path: os.PathLike | str, dtype=jnp.float32
) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Read a GGUF (``ARCHITECTURES``): (config, tensors keyed like ``expected_shapes(cfg)``, tokenizer).

    Quantized tensors are dequantized to float32 and then cast to ``dtype`` (a numpy or
    JAX dtype, e.g. ``jnp.bfloat16``). A llama file's q/k projections are un-permuted from llama.cpp's
    interleaved RoPE layout to Hugging Face's rotate-half layout.
    """
    path = pathlib.Path(path)
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    tokenizer = tokenizer_from_gguf_metadata(read_metadata(reader), source=str(path))
    tensors = read_tensors(reader, cfg, path, dtype)
    return cfg, tensors, tokenizer


def read_config(reader: GGUFReader, path: os.PathLike | str) -> ModelConfig:
    """The ModelConfig of an open GGUF file (its metadata and the tensors that carry RoPE scaling)."""
    by_name = _tensor_map(reader)
    freqs = by_name.get(ROPE_FREQS)
    factors = None if freqs is None else tuple(
        float(f) for f in dequantize(_tensor_data(path, freqs), freqs.tensor_type).ravel())
    return config_from_metadata(read_metadata(reader), has_output="output.weight" in by_name, path=path,
                                rope_factors=factors, longrope=any(name in by_name for name in _LONGROPE_TENSORS))


def _tensor_data(path: os.PathLike | str, t) -> np.ndarray:
    """A tensor's stored data, read from the file into memory of its own (shaped and typed like the reader's
    ``t.data``). The reader's ``t.data`` is a view of the whole file mapped in memory: every page a conversion
    touches would stay in this process's resident set until the reader goes, so a 7 GB file converted tensor by
    tensor would count twice at its peak."""
    return _tensor_rows(path, t, 0, t.data.shape[0])


def _tensor_rows(path: os.PathLike | str, t, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of a tensor's stored data (its outermost axis), read from the file alone: a conversion a
    few rows at a time never holds the whole stored tensor (a 7B head stored Q8_0 is 139 MB)."""
    shape = t.data.shape
    row_bytes = int(t.n_bytes) // shape[0]
    with open(path, "rb") as f:
        f.seek(int(t.data_offset) + r0 * row_bytes)
        raw = np.fromfile(f, np.uint8, (r1 - r0) * row_bytes)
    if raw.size != (r1 - r0) * row_bytes:
        raise GGUFError(path, f"truncated GGUF file: tensor {t.name!r} is cut short")
    return raw.view(t.data.dtype).reshape(r1 - r0, *shape[1:])


def drop_metadata(reader: GGUFReader) -> None:
    """Forget an open file's key/value fields once its config is read, keeping its tensors' descriptions: the
    reader holds a tokenizer's vocabulary as small numpy arrays, several per token (Llama-2's 32000 tokens: the
    7B-shaped file's reader took 0.16 GB, reading the config 0.13 GB more; dropping the fields then
    ``release_freed_heap`` gave back 0.19 GB of it; scratch probe, 2-core Zen 4, 2026-12-05), which would
    otherwise be held all the while the tensors are read."""
    reader.fields.clear()


def load_gguf_tokenizer(path: os.PathLike | str) -> Tokenizer:
    """Only the tokenizer of a GGUF file (its weights are not read)."""
    path = pathlib.Path(path)
    return tokenizer_from_gguf_metadata(read_metadata(open_gguf(path)), source=str(path))


def open_gguf(path: pathlib.Path) -> GGUFReader:
    """A GGUFReader on ``path``; a GGUFError for a missing, foreign, or truncated file."""
    if not path.exists():
        raise GGUFError(path, "file not found")
    if path.is_dir():
        raise GGUFError(path, "is a directory; pass the path of the .gguf file itself")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(path, f"not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        # A short file makes the reader's views of the header or of a tensor come out short.
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as err:
        raise GGUFError(path, f"truncated or corrupt GGUF file ({err})") from err


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field of the file as plain Python values (lists for arrays)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def config_from_metadata(metadata: dict[str, Any], has_output: bool, path: os.PathLike | str,
                         rope_factors: tuple[float, ...] | None = None, longrope: bool = False) -> ModelConfig:
    """ModelConfig from llama.cpp's metadata keys (and the file's ``rope_freqs`` tensor, ``rope_factors``:
    how llama.cpp carries Llama 3.1's RoPE scaling; ``longrope``: whether it has LongRoPE's factor tensors);
    GGUFError for what jpinfer cannot run."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(path, f"unsupported architecture {arch!r}; jpinfer reads GGUF files of architecture "
                              f"{', '.join(ARCHITECTURES)}")

    def need(key: str):
        if key not in metadata:
            raise GGUFError(path, f"metadata key {key!r} is missing")
        return metadata[key]

    n_experts = int(metadata.get(f"{arch}.expert_count", 0))
    if n_experts and arch != "llama":
        raise GGUFError(path, f"mixture-of-experts {arch} models are not supported (Mixtral's, architecture llama, "
                              "are)")
    if longrope:
        raise GGUFError(path, "LongRoPE scaling (rope_factors_long / rope_factors_short tensors) is not supported")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(path, f"RoPE scaling {scaling!r} is not supported (unscaled, linear, or {ROPE_FREQS})")
    if scaling == "linear" and rope_factors is not None:
        raise GGUFError(path, f"both linear RoPE scaling and {ROPE_FREQS}: which one applies is not defined")
    tokens = need("tokenizer.ggml.tokens")
    d_model = int(need(f"{arch}.embedding_length"))
    n_heads = int(need(f"{arch}.attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", d_model // n_heads))
    rot_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise GGUFError(path, f"partial RoPE (rope.dimension_count {rot_dim} != head dim {head_dim}) is not supported")
    if metadata.get(f"{arch}.vocab_size", len(tokens)) != len(tokens):
        raise GGUFError(
            path, f"{arch}.vocab_size {metadata[f'{arch}.vocab_size']} disagrees with the {len(tokens)} tokens listed"
        )
    eos_ids = tuple(
        dict.fromkeys(int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                      if k in metadata)
    )
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    norm_key = "layer_norm_epsilon" if arch == "falcon" else "layer_norm_rms_epsilon"
    norm_eps = _float32_decimal(need(f"{arch}.attention.{norm_key}"))
    rope_theta = _float32_decimal(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = None
    n_layers = int(need(f"{arch}.block_count"))
    windowed = arch in ("phi3", *GEMMA_WINDOW_PATTERN)
    window = _optional_int(metadata.get(f"{arch}.attention.sliding_window")) if windowed else None
    gemma = dict(ffn_kind="gelu", norm_kind="layernorm", parallel_block=True) if arch == "falcon" else {}
    if arch in GEMMA_WINDOW_PATTERN:
        softcap = lambda key: float(metadata[key]) if metadata.get(key) else None
        scalar = d_model / n_heads if n_layers == GEMMA_27B_LAYERS[arch] else head_dim  # query_pre_attn_scalar
        pattern = GEMMA_WINDOW_PATTERN[arch]
        gemma = dict(ffn_kind="geglu", sandwich_norms=True, embed_scale=float(d_model) ** 0.5,
                     attn_scale=float(scalar) ** -0.5, attn_softcap=softcap(f"{arch}.attn_logit_softcapping"),
                     logit_softcap=softcap(f"{arch}.final_logit_softcapping"),
                     window_layers=None if window is None else tuple(i for i in range(n_layers)
                                                                     if i % pattern < pattern - 1))
        if arch == "gemma3" and window is not None:
            gemma["local_rope_theta"] = GEMMA3_LOCAL_ROPE_THETA
    try:
        if scaling == "linear":
            rope_scaling = RopeScaling("linear", factor=float(need(f"{arch}.rope.scaling.factor")))
        elif rope_factors is not None:
            rope_scaling = RopeScaling("factors", frequency_factors=rope_factors)
        fields = dict(
            vocab_size=len(tokens),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ff=int(need(f"{arch}.feed_forward_length")) * max(n_experts, 1),  # every expert's neurons
            n_experts=n_experts,
            experts_per_token=int(need(f"{arch}.expert_used_count")) if n_experts else 0,
            ffn_kind="swiglu",
            norm_kind="rmsnorm",
            norm_eps=norm_eps,
            positions="rope",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position=int(need(f"{arch}.context_length")),
            sliding_window=window,  # phi3: in every layer; Gemma: in some (GEMMA_WINDOW_PATTERN)
            tie_embeddings=not has_output,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            architecture=arch,
            name=str(metadata.get("general.name", pathlib.Path(path).stem)),
        )
        return ModelConfig(**(fields | gemma))
    except ValueError as err:
        raise GGUFError(path, f"inconsistent model metadata: {err}") from err


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float32_decimal(value: float) -> float:
    """The shortest decimal that rounds to this float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def read_tensors(reader: GGUFReader, cfg: ModelConfig, path: os.PathLike | str,
                 dtype=jnp.float32, skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Dequantized tensors keyed like ``expected_shapes(cfg)``, checked against it; the file's tensors named in
    ``skip`` are left out (read another way by the caller)."""
    by_name = _tensor_map(reader)
    plan = _tensor_plan(cfg, set(by_name))
    unknown = sorted(set(by_name) - set(plan) - {ROPE_FREQS})  # rope_freqs: the config's (load_gguf)
    if unknown:
        raise GGUFError(path, f"unsupported tensors for a {cfg.architecture} model: {', '.join(unknown[:5])}")
    expected = expected_shapes(cfg)
    np_dtype = np.dtype(dtype)
    out: dict[str, np.ndarray] = {}
    for gguf_name, entry in plan.items():
        if gguf_name in skip:
            continue
        t = _stored(by_name, gguf_name, path)
        target = entry.names[0] if isinstance(entry, _Shared) else entry.name if isinstance(entry, _Experts) else entry
        parts = (target,) if isinstance(target, str) else target  # a fused tensor stacks its parts' rows
        rows = [expected[name][0] for name in parts]
        implied = (sum(rows), *expected[parts[0]][1:])
        if isinstance(entry, _Experts):  # (n_experts, expert rows, d_model); down: (n_experts, d_model, expert cols)
            down = target.endswith(".w_down")
            implied = (cfg.n_experts, *((implied[0], cfg.expert_size) if down else (cfg.expert_size, implied[1])))
        stored = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order: (out, in)
        if stored != implied:
            raise GGUFError(path, f"tensor {gguf_name!r} has shape {stored}, but the metadata implies {implied}")
        w = dequantize(_tensor_data(path, t), t.tensor_type).reshape(stored)
        if isinstance(entry, _Experts):  # every expert's neurons in expert order
            w = (w.transpose(1, 0, 2) if down else w).reshape(expected[target])
        for name, part in zip(parts, np.split(w, np.cumsum(rows)[:-1])):
            if name.endswith(".wq") and _permuted(cfg):
                part = unpermute_rope_rows(part, cfg.n_heads)
            elif name.endswith(".wk") and _permuted(cfg):
                part = unpermute_rope_rows(part, cfg.n_kv_heads)
            out[name] = np.array(part, dtype=np_dtype, order="C")  # a copy: no view of the file
        if isinstance(entry, _Shared):
            out |= {name: out[target].copy() for name in entry.names[1:]}
    return out


def _stored(by_name: dict, name: str, path: os.PathLike | str):
    """The file's tensor ``name``; a GGUFError when it is missing or of a type jpinfer does not read."""
    t = by_name.get(name)
    if t is None:
        raise GGUFError(path, f"missing tensor {name!r}")
    if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(q.name for q in SUPPORTED_TENSOR_TYPES)
        raise GGUFError(path, f"tensor {name!r} has type {t.tensor_type.name}; supported types: {supported}")
    return t


_Q4_TYPES = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1"}
# jpinfer's fused projections (params.build_weights) and the GGUF tensors they stack, in order (phi3's files hold
# two of them fused already)
_FUSED_TENSORS: dict[str, tuple[str, ...]] = {
    "w_qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w_gate_up": ("ffn_gate", "ffn_up"),
    "w_down": ("ffn_down",),
}
_FUSED_TENSORS_OF: dict[str, dict[str, tuple[str, ...]]] = {  # falcon's ffn_up: the up rows alone (no gate)
    arch: _FUSED_TENSORS | {"w_qkv": ("attn_qkv",), "w_gate_up": ("ffn_up",)} for arch in ("phi3", "falcon")
}


def read_q4_blocks(path: os.PathLike | str, cfg: ModelConfig) -> dict[str, q4.Q4Matrix]:
    """The file's 4-bit projections as they are stored (``quant.q4.from_gguf``: no float round trip),
    fused like ``params.build_weights`` and keyed ``layers.{i}.{w_qkv|wo|w_gate_up|w_down}``: those whose
    parts are all Q4_0 or all Q4_1 (a fused matrix of mixed types is left out, to be quantized from
    float). q/k rows are un-permuted like the float ones (``unpermute_rope_rows``: whole rows move)."""
    path = pathlib.Path(path)
    by_name = _tensor_map(open_gguf(path))
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads} if _permuted(cfg) else {}
    out: dict[str, q4.Q4Matrix] = {}
    for i in range(cfg.n_layers):
        for fused, parts in _FUSED_TENSORS_OF.get(cfg.architecture, _FUSED_TENSORS).items():
            tensors = [by_name.get(f"blk.{i}.{part}.weight") for part in parts]
            kinds = {_Q4_TYPES.get(t.tensor_type) if t is not None else None for t in tensors}
            if len(kinds) != 1 or None in kinds:
                continue
            kind = kinds.pop()
            matrices = []
            for part, t in zip(parts, tensors):
                m = q4.from_gguf(_tensor_data(path, t), (int(t.shape[1]), int(t.shape[0])), kind)
                matrices.append(_permute_matrix_rows(m, heads[part]) if part in heads else m)
            out[f"layers.{i}.{fused}"] = matrices[0] if len(matrices) == 1 else q4.concatenate(matrices)
    return out


def read_quantized_weights(reader: GGUFReader, cfg: ModelConfig, path: os.PathLike | str, fmt: str,
                           progress: Callable[[int], None] | None = None) -> Weights:
    """The file's weights straight in a quantized format, one tensor in memory at a time: a model too large for
    memory in float (a 7B model is 27 GB in float32) loads in about its own file's size.

    ``fmt`` "int8": every projection, the head and an untied input embedding per output row
    (``quant.int8``, no SmoothQuant migration: that needs the float model and calibration text); "int4": the
    projections in 4-bit blocks, the file's own Q4_0 / Q4_1 blocks as they are (``quant.q4.from_gguf``), others
    quantized to ``quantized.INT4_KIND``; the head int8 as for "int8", and the embedding too unless it is untied and
    stored Q4_0 / Q4_1 (its blocks then, as they are). A tensor stored in another type is dequantized and quantized
    again ``quantized.CONVERT_WEIGHTS`` at a time (rows are quantized independently, so the result is that of
    quantizing the whole float tensor). Norms and biases stay float32. ``progress`` is called
    with each layer done."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"fmt must be 'int8' or 'int4', got {fmt!r}")
    if cfg.n_experts:
        raise GGUFError(path, "a mixture-of-experts file cannot be read straight into int8 or int4 weights; "
                              "load it in float")
    by_name = _tensor_map(reader)
    fusions = _FUSED_TENSORS_OF.get(cfg.architecture, _FUSED_TENSORS)
    tables = {"token_embd.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
    projections = {f"blk.{i}.{part}.weight" for i in range(cfg.n_layers) for parts in fusions.values()
                   for part in parts}
    small = read_tensors(reader, cfg, path, jnp.float32, skip=frozenset(projections | tables))
    expected = expected_shapes(cfg)
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads} if _permuted(cfg) else {}

    def matrix(name: str, form: str, rows_of: int | None = None, keep_blocks: bool = True):
        t = _stored(by_name, name, path)
        stored = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order: (out, in)
        if len(stored) != 2 or (rows_of is not None and stored[0] % rows_of):
            raise GGUFError(path, f"tensor {name!r} has shape {stored}, not a projection of this model")
        m = _quantized_matrix(path, t, stored, form, keep_blocks)
        return m if rows_of is None else _permute_matrix_rows(m, rows_of)

    def checked(name: str, m, shape: tuple[int, ...]):
        if tuple(m.shape) != shape:
            raise GGUFError(path, f"{name} has shape {tuple(m.shape)}, but the metadata implies {shape}")
        return m

    layers = []
    for i in range(cfg.n_layers):
        fused = {}
        for target, parts in fusions.items():
            want = [expected[f"layers.{i}.{n}"] for n in FUSED_PROJECTIONS[target] if f"layers.{i}.{n}" in expected]
            names = [f"blk.{i}.{part}.weight" for part in parts]
            # 4-bit blocks of two types do not stack: a fused matrix of mixed types is quantized anew
            one_type = len({getattr(by_name.get(name), "tensor_type", None) for name in names}) == 1
            ms = [matrix(name, fmt, heads.get(part), one_type) for name, part in zip(names, parts)]
            fused[target] = checked(f"layer {i}'s {'+'.join(parts)}", ms[0] if len(ms) == 1 else _stack(ms),
                                    (sum(w[0] for w in want), want[0][1]))
        layers.append(build_layer(cfg, small, i, jnp.float32, projections=fused))
        if progress is not None:
            progress(i + 1)
    vocab_rows = (cfg.vocab_size, cfg.d_model)
    # an untied input table is read a row a token: a 4-bit file's own blocks for "int4" (7B: 74 MB, not 131 MB in
    # int8, and no second rounding); the head, and a table tied to it, read whole by each step's head product,
    # stay int8
    in_blocks = fmt == "int4" and not cfg.tie_embeddings and _stored(by_name, "token_embd.weight", path
                                                                      ).tensor_type in _Q4_TYPES
    embed = checked("token_embd.weight", matrix("token_embd.weight", "int4" if in_blocks else "int8"), vocab_rows)
    head = embed if cfg.tie_embeddings else checked("output.weight", matrix("output.weight", "int8"), vocab_rows)
    bias = small.get("final_norm.bias")
    return Weights(head=head, layers=layers,
                   final_norm=Norm(jnp.asarray(small["final_norm.scale"]), None if bias is None else jnp.asarray(bias)),
                   embed=None if cfg.tie_embeddings else embed)


def _quantized_matrix(path: os.PathLike | str, t, shape: tuple[int, int], form: str,
                      keep_blocks: bool = True) -> Int8Matrix | q4.Q4Matrix:
    """One (out, in) tensor of the file in ``form`` ("int8" or "int4"; ``read_quantized_weights``); a Q4_0 / Q4_1
    tensor's blocks are kept as they are for "int4" unless ``keep_blocks`` is false."""
    kind = _Q4_TYPES.get(t.tensor_type)
    if form == "int4" and kind is not None and keep_blocks:
        return q4.from_gguf(_tensor_data(path, t), shape, kind)
    float_rows = lambda r0, r1: dequantize(_tensor_rows(path, t, r0, r1), t.tensor_type).reshape(-1, shape[1])
    if form != "int4" or shape[1] % q4.QK:
        return quantized.int8_by_rows(shape, float_rows)
    return _stack([q4.quantize(float_rows(r0, r1), INT4_KIND) for r0, r1 in quantized.row_chunks(shape)])


def _stack(parts: list) -> Int8Matrix | q4.Q4Matrix:
    """The rows of several row-quantized matrices of one format stacked (one part as it is)."""
    if len(parts) == 1:
        return parts[0]
    return q4.concatenate(parts) if isinstance(parts[0], q4.Q4Matrix) else int8.concatenate(parts)


def _permute_matrix_rows(m: Int8Matrix | q4.Q4Matrix, n_heads: int) -> Int8Matrix | q4.Q4Matrix:
    """``unpermute_rope_rows`` on a row-quantized matrix: whole rows move, with their scales."""
    move = lambda a: None if a is None else jnp.asarray(unpermute_rope_rows(np.asarray(a), n_heads))
    if isinstance(m, q4.Q4Matrix):
        return q4.Q4Matrix(move(m.packed), move(m.scales), move(m.mins), m.kind)
    return Int8Matrix(move(m.values), move(m.scales), 0)


def _tensor_map(reader: GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


# Mixtral's experts, each GGUF tensor all of a layer's experts stacked (n_experts, rows, cols): our FFN tensor it
# becomes (the experts' neurons in expert order: gate and up rows, down columns)
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "w_gate", "ffn_up_exps.weight": "w_up", "ffn_down_exps.weight": "w_down"}


@dataclasses.dataclass(frozen=True)
class _Experts:
    """A GGUF tensor of stacked experts read into one FFN tensor of ours."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Shared:
    """One file tensor read into several jpinfer tensors (Falcon-7B's one LayerNorm: the attention's and FFN's)."""

    names: tuple[str, ...]


def _tensor_plan(cfg: ModelConfig, in_file: set[str]) -> dict[str, str | tuple[str, ...] | _Shared | _Experts]:
    """GGUF tensor name -> jpinfer name for every tensor the config needs (a fused tensor: its parts' names); what
    the file holds (``in_file``) decides only whether a Falcon's attention has a LayerNorm of its own."""
    plan = {f"{g}.weight": v for g, v in _GLOBAL_TENSORS.items() if not (g == "output" and cfg.tie_embeddings)}
    if cfg.norm_kind == "layernorm":
        plan["output_norm.bias"] = "final_norm.bias"
    needed = expected_shapes(cfg)
    fused = _FUSED_IN_FILE.get(cfg.architecture, {})
    in_fused = {part for parts in fused.values() for part in parts}
    if cfg.n_experts:  # the experts' stacked tensors hold the FFN
        in_fused |= set(_EXPERT_TENSORS.values())
    layer_tensors = _FALCON_LAYER_TENSORS if cfg.architecture == "falcon" else _LAYER_TENSORS
    for i in range(cfg.n_layers):
        plan |= {f"blk.{i}.{g}": f"layers.{i}.{n}" for g, n in layer_tensors.items()
                 if f"layers.{i}.{n}" in needed and n not in in_fused and g not in fused}
        plan |= {f"blk.{i}.{g}": tuple(f"layers.{i}.{n}" for n in parts) for g, parts in fused.items()}
        if cfg.n_experts:
            plan[f"blk.{i}.ffn_gate_inp.weight"] = f"layers.{i}.router"
            plan |= {f"blk.{i}.{g}": _Experts(f"layers.{i}.{n}") for g, n in _EXPERT_TENSORS.items()}
        if cfg.architecture == "falcon" and f"blk.{i}.attn_norm_2.weight" not in in_file:
            for kind, ours in (("weight", "scale"), ("bias", "bias")):
                del plan[f"blk.{i}.attn_norm_2.{kind}"]
                plan[f"blk.{i}.attn_norm.{kind}"] = _Shared((f"layers.{i}.ffn_norm.{ours}",
                                                             f"layers.{i}.attn_norm.{ours}"))
    return plan


def _permuted(cfg: ModelConfig) -> bool:
    """Whether llama.cpp's converter permuted the file's q/k rows (llama only: ``unpermute_rope_rows``)."""
    return cfg.architecture == "llama"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation of an (out, in) projection.

    llama.cpp's converter reorders each head's output rows so that RoPE rotates adjacent
    pairs (2i, 2i+1); Hugging Face rotates halves (i, i + head_dim/2). Row 2i + j of a
    head in the GGUF is row j * head_dim/2 + i in Hugging Face's layout.
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
