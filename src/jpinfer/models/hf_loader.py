"""Hugging Face checkpoint directories (config.json + safetensors) -> ModelConfig + tensors in our naming.

Reads safetensors with its JAX framework (bfloat16 included), never PyTorch. The config is read by
``hf_config`` (the supported architectures are listed there); this module maps each architecture's tensor
names onto the one layout of ``params.expected_shapes``: fused tensors split (Phi-3's, Falcon's q/k/v in
each of its layouts), MoE experts stacked into one FFN (a shared expert's after them), Gemma's norm offsets made scales.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from jpinfer.config import ModelConfig
from jpinfer.errors import CheckpointError
from jpinfer.models.hf_config import parse_config
from jpinfer.models.params import expected_shapes

# Phi-3 stores these projections fused: the checkpoint's tensor -> the separate ones it stacks, in order
PHI3_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _falcon_qkv_rows(raw: dict[str, Any], cfg: ModelConfig) -> np.ndarray:
    """The rows of Falcon's fused query_key_value in [q heads; k heads; v heads] order (transformers'
    ``FalconAttention._split_heads``): the new architecture groups each kv head's g queries with its key
    and value, the old one without multi-query interleaves q, k, v per head, multi-query stacks them."""
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = h // kv
    if raw.get("new_decoder_architecture"):
        def block(part: int, head: int) -> int:  # part 0: query head, 1: key, 2: value of kv head `head`
            return (head // g) * (g + 2) + head % g if part == 0 else head * (g + 2) + g + part - 1
    elif raw.get("multi_query", True):
        def block(part: int, head: int) -> int:
            return head if part == 0 else h + part - 1
    else:
        def block(part: int, head: int) -> int:
            return head * 3 + part
    blocks = [block(0, i) for i in range(h)] + [block(part, i) for part in (1, 2) for i in range(kv)]
    return (np.asarray(blocks)[:, None] * hd + np.arange(hd)).ravel()


def _fused_in_checkpoint(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Per layer, the checkpoint's fused tensors -> the separate ones they stack, in order (names under the
    layer prefix; the separate names are those ``_hf_to_ours`` maps)."""
    if cfg.architecture == "phi3":
        return PHI3_FUSED
    if cfg.architecture == "falcon":
        return {f"self_attention.query_key_value.{kind}": tuple(f"self_attention.{p}.{kind}" for p in "qkv")
                for kind in ("weight", "bias")}
    return {}


# MoE checkpoints keep one tensor per expert: our FFN tensor -> the experts' name and the axis they stack along (gate
# and up rows, down columns), in expert order; under the layer's Mixtral block or the other families' mlp
EXPERT_TENSORS = {"w_gate": ("w1", 0), "w_up": ("w3", 0), "w_down": ("w2", 1)}
MLP_EXPERT_TENSORS = {"w_gate": ("gate_proj", 0), "w_up": ("up_proj", 0), "w_down": ("down_proj", 1)}


def _experts_in_checkpoint(cfg: ModelConfig, layer_prefix: str) -> dict[str, tuple[list[str], int]]:
    """Per FFN tensor of ours and the router, the checkpoint's tensors it stacks (in order) and the axis; {} without
    experts. Qwen2-MoE's shared expert follows the routed ones whole (its rows are ``shared_experts`` experts'
    worth), and its gate's one row follows the router's, once per piece (``config.ExpertRouting``)."""
    if not cfg.n_experts or cfg.architecture == "granitemoe":  # GraniteMoE's are stacked: _granite_experts
        return {}
    block, tensors = ("block_sparse_moe.", EXPERT_TENSORS) if cfg.architecture == "mixtral" else (
        "mlp.", MLP_EXPERT_TENSORS)
    routed = cfg.n_experts - cfg.shared_experts
    out = {}
    for i in range(cfg.n_layers):
        prefix = layer_prefix.format(i) + block
        shared = [prefix + "shared_expert.{}.weight"] if cfg.shared_experts else []
        for ours, (theirs, axis) in tensors.items():
            out[f"layers.{i}.{ours}"] = ([f"{prefix}experts.{e}.{theirs}.weight" for e in range(routed)]
                                         + [name.format(theirs) for name in shared], axis)
        out[f"layers.{i}.router"] = ([prefix + "gate.weight"]
                                     + [prefix + "shared_expert_gate.weight"] * cfg.shared_experts, 0)
    return out


GRANITE_EXPERTS = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")


def _granite_experts(found: dict[str, np.ndarray], cfg: ModelConfig, layer_prefix: str,
                     path: pathlib.Path) -> dict[str, np.ndarray]:
    """GraniteMoE keeps a layer's experts in two 3-D tensors (``GRANITE_EXPERTS``): input_linear (n, 2 f, d), each
    expert's gate rows then its up rows, and output_linear (n, d, f); taken out of ``found`` as our gate, up and
    down of every expert's neurons in expert order."""
    n, f, d = cfg.n_experts, cfg.expert_size, cfg.d_model
    out = {}
    for i in range(cfg.n_layers):
        names = [layer_prefix.format(i) + name for name in GRANITE_EXPERTS]
        for name, shape in zip(names, ((n, 2 * f, d), (n, d, f))):
            if name not in found:
                raise CheckpointError(f"{path}: missing tensor {name!r} (layer {i}'s experts)")
            if found[name].shape != shape:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {found[name].shape}; the config implies "
                                      f"{shape}")
        gate_up, down = found.pop(names[0]), found.pop(names[1])
        out |= {f"layers.{i}.w_gate": gate_up[:, :f].reshape(n * f, d), f"layers.{i}.w_up": gate_up[:, f:].reshape(
            n * f, d), f"layers.{i}.w_down": down.transpose(1, 0, 2).reshape(d, n * f)}
    return out


def _hf_to_ours(cfg: ModelConfig, raw: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Our tensor name -> Hugging Face name (both (out, in), nothing is transposed), and the prefix of a layer's
    names (``{}`` the layer's index)."""
    names: dict[str, str] = {}
    if cfg.architecture == "falcon":
        names |= {"embed": "transformer.word_embeddings.weight", "final_norm.scale": "transformer.ln_f.weight",
                  "final_norm.bias": "transformer.ln_f.bias"}
        if raw.get("new_decoder_architecture") and raw.get("num_ln_in_parallel_attn") in (None, 2):
            norms = {"attn_norm": "ln_attn", "ffn_norm": "ln_mlp"}
        elif cfg.parallel_block:  # one LayerNorm feeds both
            norms = {"attn_norm": "input_layernorm", "ffn_norm": "input_layernorm"}
        else:
            norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        per_layer = {f"{ours}.{p}": f"{theirs}.{kind}" for ours, theirs in norms.items()
                     for p, kind in (("scale", "weight"), ("bias", "bias"))}
        per_layer |= {"wq": "self_attention.q.weight", "wk": "self_attention.k.weight",
                      "wv": "self_attention.v.weight", "bq": "self_attention.q.bias", "bk": "self_attention.k.bias",
                      "bv": "self_attention.v.bias", "wo": "self_attention.dense.weight",
                      "bo": "self_attention.dense.bias", "w_up": "mlp.dense_h_to_4h.weight",
                      "b_up": "mlp.dense_h_to_4h.bias", "w_down": "mlp.dense_4h_to_h.weight",
                      "b_down": "mlp.dense_4h_to_h.bias"}
        layer_prefix = "transformer.h.{}."
    elif cfg.architecture == "opt":
        base = "model.decoder."
        names |= {
            "embed": base + "embed_tokens.weight",
            "positions": base + "embed_positions.weight",
            "final_norm.scale": base + "final_layer_norm.weight",
            "final_norm.bias": base + "final_layer_norm.bias",
        }
        per_layer = {
            "attn_norm.scale": "self_attn_layer_norm.weight",
            "attn_norm.bias": "self_attn_layer_norm.bias",
            "ffn_norm.scale": "final_layer_norm.weight",
            "ffn_norm.bias": "final_layer_norm.bias",
            "wq": "self_attn.q_proj.weight",
            "wk": "self_attn.k_proj.weight",
            "wv": "self_attn.v_proj.weight",
            "wo": "self_attn.out_proj.weight",
            "bq": "self_attn.q_proj.bias",
            "bk": "self_attn.k_proj.bias",
            "bv": "self_attn.v_proj.bias",
            "bo": "self_attn.out_proj.bias",
            "w_up": "fc1.weight",
            "b_up": "fc1.bias",
            "w_down": "fc2.weight",
            "b_down": "fc2.bias",
        }
        layer_prefix = base + "layers.{}."
    else:
        names |= {
            "embed": "model.embed_tokens.weight",
            "final_norm.scale": "model.norm.weight",
        }
        per_layer = {
            "attn_norm.scale": "input_layernorm.weight",
            "ffn_norm.scale": "post_attention_layernorm.weight",
            "wq": "self_attn.q_proj.weight",
            "wk": "self_attn.k_proj.weight",
            "wv": "self_attn.v_proj.weight",
            "wo": "self_attn.o_proj.weight",
            "bq": "self_attn.q_proj.bias",
            "bk": "self_attn.k_proj.bias",
            "bv": "self_attn.v_proj.bias",
            "bo": "self_attn.o_proj.bias",
            "q_norm.scale": "self_attn.q_norm.weight",
            "k_norm.scale": "self_attn.k_norm.weight",
            "w_gate": "mlp.gate_proj.weight",
            "w_up": "mlp.up_proj.weight",
            "w_down": "mlp.down_proj.weight",
        }
        if cfg.n_experts:  # the experts' tensors and the router stacked (_experts_in_checkpoint)
            per_layer = {k: v for k, v in per_layer.items() if k not in EXPERT_TENSORS}
        if cfg.architecture == "granitemoe":
            per_layer["router"] = "block_sparse_moe.router.layer.weight"
        if cfg.sandwich_norms:  # Gemma: its post_attention_layernorm is on the attention's output
            per_layer |= {"attn_out_norm.scale": "post_attention_layernorm.weight",
                          "ffn_norm.scale": "pre_feedforward_layernorm.weight",
                          "ffn_out_norm.scale": "post_feedforward_layernorm.weight"}
        layer_prefix = "model.layers.{}."
    names["lm_head"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = layer_prefix.format(i) + theirs
    return names, layer_prefix


def _safetensor_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files found")
    return files


def _read_tensors(files: list[pathlib.Path], wanted: set[str]) -> dict[str, np.ndarray]:
    """Read the wanted tensors (by Hugging Face name, with or without a 'model.' prefix)."""
    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as st:
                for key in st.keys():
                    name = key if key in wanted else "model." + key
                    if name in wanted:
                        out[name] = np.asarray(st.get_tensor(key).astype("float32"))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    return out


def load_hf(path: str | pathlib.Path, ffn_kind: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load a Hugging Face checkpoint directory as (config, float32 tensors in our naming).

    ``ffn_kind`` overrides the activation kind read from config.json (e.g. ``"drelu"``
    for dReLU checkpoints whose config names a custom activation).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: invalid JSON ({e})") from None
    cfg = parse_config(raw, path, ffn_kind)
    names, layer_prefix = _hf_to_ours(cfg, raw)
    shapes = expected_shapes(cfg)
    mapping = {k: v for k, v in names.items() if k in shapes}
    fused = {layer_prefix.format(i) + name: [layer_prefix.format(i) + part for part in parts]
             for i in range(cfg.n_layers) for name, parts in _fused_in_checkpoint(cfg).items()}
    experts = _experts_in_checkpoint(cfg, layer_prefix)
    granite = [layer_prefix.format(i) + name for i in range(cfg.n_layers) for name in GRANITE_EXPERTS
               if cfg.architecture == "granitemoe"]
    found = _read_tensors(_safetensor_files(path), set(mapping.values()) | set(fused) | set(granite)
                          | {name for parts, _ in experts.values() for name in parts})
    falcon_rows = _falcon_qkv_rows(raw, cfg) if cfg.architecture == "falcon" else None
    rows_of = {theirs: shapes[ours][0] for ours, theirs in mapping.items()}  # a separate tensor's row count
    for name, parts in fused.items():  # split into the separate projections (build_weights fuses them again)
        if name in found:
            if falcon_rows is not None and found[name].shape[0] == falcon_rows.size:
                found[name] = found[name][falcon_rows]
            sizes = [rows_of[part] for part in parts]
            if found[name].shape[0] != sum(sizes):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {found[name].shape}; the config implies "
                                      f"{sum(sizes)} rows ({' + '.join(map(str, sizes))})")
            found |= dict(zip(parts, np.split(found.pop(name), np.cumsum(sizes)[:-1])))
    tensors = _granite_experts(found, cfg, layer_prefix, path) if granite else {}
    for ours, (parts, axis) in experts.items():
        missing = [part for part in parts if part not in found]
        if missing:
            raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (an expert of {ours})")
        tensors[ours] = np.concatenate([found[part] for part in parts], axis=axis)  # a gate row may repeat
        for part in set(parts):
            found.pop(part)
    for ours, theirs in mapping.items():
        if theirs not in found:
            if ours == "lm_head":  # some checkpoints tie without saying so
                continue
            raise CheckpointError(f"{path}: missing tensor {theirs!r} (needed for {ours})")
        tensors[ours] = found[theirs]
    if "lm_head" in mapping and "lm_head" not in tensors:
        raise CheckpointError(f"{path}: missing tensor 'lm_head.weight' and tie_word_embeddings is false")
    if cfg.architecture in ("gemma2", "gemma3"):  # Gemma's RMSNorm weights are offsets: it scales by 1 + w
        tensors = {k: v + np.float32(1.0) if k.endswith("norm.scale") else v for k, v in tensors.items()}
    return cfg, tensors
