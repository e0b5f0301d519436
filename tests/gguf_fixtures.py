"""Tiny GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter does.

Weights start in jpinfer's flat convention (projections (out, in), as GGUF stores them);
the writer permutes a llama's q/k rows for llama.cpp's adjacent-pair RoPE (qwen2 and qwen3 keep them), and
quantizes with gguf.quants.quantize. A small byte-level BPE is trained with `tokenizers`
so the file carries a real vocabulary, merges, token types and chat template.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jpinfer.config import ModelConfig
from jpinfer.models.params import init_random

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKEN = "<think>"
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.  Twice  the spaces,   thrice the fun.",
    "def main():\n    return [x ** 2 for x in range(10)]\n\n\tif a  1 == b:\n\t\tpass",
    "Numbers 12345 and 3.14159 and 2026-11-29; héllo wörld, naïve café, 日本語のテキスト.",
    "I'll say it's done, they're here, we've seen, you'd know, he'd've gone.",
] * 8


@functools.cache
def tokenizer_fields() -> dict[str, Any]:
    """GGUF tokenizer.* fields of a ~330-token byte-level BPE trained on a small corpus."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(_CORPUS, trainer)
    model = json.loads(raw.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.get) + [USER_DEFINED_TOKEN]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 4 if t == USER_DEFINED_TOKEN else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def tiny_config(tied: bool = False) -> ModelConfig:
    """A 2-layer GQA llama whose row lengths (64, 128) are multiples of the 32-wide quant blocks."""
    return ModelConfig(
        vocab_size=len(tokenizer_fields()["tokenizer.ggml.tokens"]),
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_position=256,
        tie_embeddings=tied,
        bos_token_id=tokenizer_fields()["tokenizer.ggml.bos_token_id"],
        eos_token_ids=(tokenizer_fields()["tokenizer.ggml.eos_token_id"],),
        name="tiny-llama",
    )


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (out, in): halves -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# jpinfer name suffix -> GGUF name suffix, for per-layer and global tensors (llama.cpp's names)
LAYER_NAMES = {
    "attn_norm.scale": "attn_norm.weight",
    "ffn_norm.scale": "ffn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm.scale": "attn_q_norm.weight",
    "k_norm.scale": "attn_k_norm.weight",
    "attn_out_norm.scale": "post_attention_norm.weight",  # gemma2 (its norms stored as 1 + w, jpinfer's scale)
    "ffn_out_norm.scale": "post_ffw_norm.weight",
}
GLOBAL_NAMES = {"embed": "token_embd", "final_norm.scale": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    """GGUF tensor name of a jpinfer flat tensor name."""
    if name.startswith("layers."):
        _, i, suffix = name.split(".", 2)
        return f"blk.{i}.{LAYER_NAMES[suffix]}"
    return f"{GLOBAL_NAMES[name]}.weight"


def to_gguf_layout(cfg: ModelConfig, name: str, w: np.ndarray, arch: str = "llama") -> np.ndarray:
    """A jpinfer tensor as llama.cpp stores it: a llama's q/k rows permuted."""
    if w.ndim == 1 or name == "embed" or arch != "llama":
        return w
    rows = w
    if name.endswith(".wq"):
        rows = llama_cpp_permute(rows, cfg.n_heads)
    elif name.endswith(".wk"):
        rows = llama_cpp_permute(rows, cfg.n_kv_heads)
    return np.ascontiguousarray(rows)


# phi3's files keep q/k/v and gate/up fused (gate rows first), as llama.cpp's converter writes them
PHI3_FUSED = {"attn_qkv": ("wq", "wk", "wv"), "ffn_up": ("w_gate", "w_up")}


def _file_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], arch: str):
    """(jpinfer name, array as stored, GGUF name) for each tensor of the file; a fused one is named after its
    first part (for ``type_overrides``)."""
    done = set()
    for name, w in tensors.items():
        if name in done:
            continue
        if arch == "phi3" and name.startswith("layers."):
            _, i, suffix = name.split(".", 2)
            fused = next(((g, parts) for g, parts in PHI3_FUSED.items() if suffix in parts), None)
            if fused is not None:
                parts = [f"layers.{i}.{part}" for part in fused[1]]
                done |= set(parts)
                yield parts[0], np.concatenate([tensors[p] for p in parts]), f"blk.{i}.{fused[0]}.weight"
                continue
        yield name, to_gguf_layout(cfg, name, w, arch), gguf_name(name)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    return init_random(cfg, seed=seed, scale=0.5)


def write_gguf(
    path: pathlib.Path,
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    arch: str = "llama",
    metadata: dict[str, Any] | None = None,
    type_overrides: dict[str, GGMLQuantizationType] | None = None,
    raw_tensors: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """Write a GGUF of architecture ``arch``: 2-D weights in ``qtype``, norms and biases in F32 (as llama.cpp
    does).

    ``tensors`` are in jpinfer's convention (any subset, to test missing tensors);
    ``raw_tensors`` are added as-is under GGUF names; ``metadata`` adds or replaces
    key/value fields (e.g. to disagree with the tensors, or with ``None`` to drop one).
    """
    fields: dict[str, Any] = {
        "general.name": cfg.name,
        f"{arch}.context_length": cfg.max_position,
        f"{arch}.embedding_length": cfg.d_model,
        f"{arch}.block_count": cfg.n_layers,
        f"{arch}.feed_forward_length": cfg.d_ff,
        f"{arch}.attention.head_count": cfg.n_heads,
        f"{arch}.attention.head_count_kv": cfg.n_kv_heads,
        f"{arch}.rope.freq_base": float(cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        f"{arch}.rope.dimension_count": cfg.head_dim,
    }
    if cfg.head_dim != cfg.d_model // cfg.n_heads:
        fields[f"{arch}.attention.key_length"] = fields[f"{arch}.attention.value_length"] = cfg.head_dim
    fields |= tokenizer_fields()
    fields |= metadata or {}
    writer = GGUFWriter(path, arch)
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    overrides = type_overrides or {}
    for name, stored, file_name in _file_tensors(cfg, tensors, arch):
        t = overrides.get(name, qtype if stored.ndim == 2 else GGMLQuantizationType.F32)
        data = quantize(stored, t)
        writer.add_tensor(file_name, data, raw_dtype=t if data.dtype == np.uint8 else None)
    for name, data in (raw_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

