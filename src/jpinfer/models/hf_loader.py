"""Hugging Face checkpoint directories (config.json + safetensors) -> ModelConfig + tensors.

Reads safetensors with its JAX framework (bfloat16 included), never PyTorch.
Supported: LlamaForCausalLM (hidden_act silu -> swiglu, relu -> reglu, GELU's tanh form -> geglu; this
covers ReluLLaMA and ProSparse-style ReLU checkpoints), MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
(q/k norms), Phi3ForCausalLM (q/k/v and gate/up fused in the checkpoint), Gemma2ForCausalLM (GeGLU, scaled
embeddings, norms on the attention's and FFN's outputs, soft-capped scores and logits, sliding windows in
every other layer), Gemma3ForCausalLM (Gemma 2 without the caps, with q/k norms, five sliding layers in six
and their own RoPE base), FalconForCausalLM (ReLU-Falcon and GELU Falcon: attention and FFN side by side,
the fused q/k/v of each layout) and OPTForCausalLM (pre-LayerNorm variants).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from jpinfer.config import ModelConfig, RopeScaling
from jpinfer.errors import CheckpointError
from jpinfer.models.params import expected_shapes
from jpinfer.models.rope import yarn_attention_factor

LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
              "Gemma3ForCausalLM": "gemma3"}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Phi-3 stores these projections fused: the checkpoint's tensor -> the separate ones it stacks, in order
PHI3_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "gelu_pytorch_tanh": "geglu",
               "gelu_new": "geglu"}
SUPPORTED = sorted([*LLAMA_LIKE, "OPTForCausalLM", "FalconForCausalLM"])


def _rope(raw: dict[str, Any], path: pathlib.Path) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if any(d.get("partial_rotary_factor", 1.0) != 1.0 for d in (raw, params, scaling)):
        raise CheckpointError(f"{path}: partial rotary embedding (partial_rotary_factor) is not supported yet")
    if rope_type in ("default", None):
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn"):
        raise CheckpointError(f"{path}: RoPE scaling type {rope_type!r} is not supported yet "
                              "(supported: linear, llama3, yarn)")
    original = scaling.get("original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None and rope_type == "yarn" and original:  # transformers' default: the context's stretch
        factor = raw["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    try:
        if rope_type == "yarn" and attention_factor is None and mscale and mscale_all_dim:
            attention_factor = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
        return theta, RopeScaling(
            kind=rope_type, factor=float(factor), original_max_position=original,
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(scaling.get("truncate", True)))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: RoPE scaling {rope_type!r}: {err}") from None


def _gemma3_rope(raw: dict[str, Any], path: pathlib.Path) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE: the config with only the full-attention layers' parameters (any scaling is theirs), and
    the sliding layers' base (never scaled). transformers 5 writes them per layer type in rope_parameters,
    transformers 4 as rope_theta / rope_scaling and rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise CheckpointError(f"{path}: RoPE scaling in the sliding-window layers is not supported yet")
        return raw | {"rope_parameters": params["full_attention"], "rope_scaling": None}, float(
            sliding.get("rope_theta", 10000.0))
    return raw | {"rope_theta": raw.get("rope_theta", 1e6)}, float(raw.get("rope_local_base_freq", 10000.0))


def _sliding_window(raw: dict[str, Any], arch: str, path: pathlib.Path) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers that slide: None for all) as transformers applies them. Mistral and Phi-3 slide
    in every layer when a window is set; Qwen2 and Qwen3 only with use_sliding_window, and then in the layers from
    max_window_layers on (default 28); Gemma 2 in every other layer from the first, Gemma 3 in all but every
    sliding_window_pattern-th (default 6); ``layer_types``, where given, names each layer's kind."""
    window = raw.get("sliding_window")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM") or window is None:
        return window, None
    n = raw["num_hidden_layers"]
    if arch == "Gemma2ForCausalLM":
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif arch == "Gemma3ForCausalLM":
        pattern = raw.get("sliding_window_pattern", 6)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif raw.get("use_sliding_window", False):
        first = raw.get("max_window_layers", 28)
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    else:
        return None, None
    types = raw.get("layer_types") or default
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{path}: layer_types must name {n} layers, each sliding_attention or full_attention")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return None, None
    return window, None if len(sliding) == n else sliding


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_config(raw: dict[str, Any], path: pathlib.Path, ffn_kind: str | None = None) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise CheckpointError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED)}"
        )
    try:
        if arch == "OPTForCausalLM":
            return _parse_opt(raw, path, ffn_kind)
        if arch == "FalconForCausalLM":
            return _parse_falcon(raw, path, ffn_kind)
        return _parse_llama(raw, path, arch, ffn_kind)
    except KeyError as e:
        raise CheckpointError(f"{path}: config.json lacks the field {e.args[0]!r}") from None


def _parse_llama(raw: dict[str, Any], path: pathlib.Path, arch: str, ffn_kind: str | None) -> ModelConfig:
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")  # Gemma 2 names it hidden_activation
    if ffn_kind is None:
        if act not in ACTIVATIONS:
            raise CheckpointError(
                f"{path}: unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)} "
                "(or pass ffn_kind= to override)"
            )
        ffn_kind = ACTIVATIONS[act]
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias=true is not supported")
    n_heads = raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{path}: bidirectional attention (an embedding model) is not supported")
    window, window_layers = _sliding_window(raw, arch, path)
    rope_raw, local_theta = _gemma3_rope(raw, path) if arch == "Gemma3ForCausalLM" else (raw, None)
    theta, rope_scaling = _rope(rope_raw, path)
    gemma = arch in GEMMA
    softcap = lambda field: float(raw[field]) if gemma and raw.get(field) else None
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
        d_ff=raw["intermediate_size"],
        ffn_kind=ffn_kind,
        norm_kind="rmsnorm",
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        local_rope_theta=local_theta if window is not None else None,
        max_position=raw.get("max_position_embeddings", 2048),
        sliding_window=window,
        window_layers=window_layers,
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        attn_out_bias=attention_bias,
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=softcap("attn_logit_softcapping"),
        logit_softcap=softcap("final_logit_softcapping"),
        sandwich_norms=gemma,
        embed_scale=float(raw["hidden_size"]) ** 0.5 if gemma else 1.0,
        tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        architecture=LLAMA_LIKE[arch],
        name=raw.get("_name_or_path") or path.name,
    )


def _parse_opt(raw: dict[str, Any], path: pathlib.Path, ffn_kind: str | None) -> ModelConfig:
    if not raw.get("do_layer_norm_before", True):
        raise CheckpointError(f"{path}: OPT with do_layer_norm_before=false (opt-350m) is not supported")
    d = raw["hidden_size"]
    if raw.get("word_embed_proj_dim", d) != d:
        raise CheckpointError(f"{path}: OPT with word_embed_proj_dim != hidden_size is not supported")
    act = raw.get("activation_function", "relu")
    if act != "relu" or ffn_kind not in (None, "relu"):
        raise CheckpointError(f"{path}: OPT activation {act!r} is not supported (relu only)")
    if not raw.get("enable_bias", True):
        raise CheckpointError(f"{path}: OPT without biases is not supported")
    n_heads = raw["num_attention_heads"]
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        d_model=d,
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d // n_heads,
        d_ff=raw["ffn_dim"],
        ffn_kind="relu",
        norm_kind="layernorm",
        norm_eps=1e-5,
        positions="learned",
        max_position=raw["max_position_embeddings"],
        position_offset=2,
        qkv_bias=True,
        attn_out_bias=True,
        ffn_bias=True,
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        architecture="opt",
        name=raw.get("_name_or_path") or path.name,
    )


def _parse_falcon(raw: dict[str, Any], path: pathlib.Path, ffn_kind: str | None) -> ModelConfig:
    """Falcon's three layouts (transformers' FalconModel): the new decoder architecture (grouped q/k/v, one or
    two LayerNorms side by side), the old one with multi-query attention (Falcon-7B) or one key and value per
    head; attention and FFN side by side (``parallel_block``) except in the old layout without parallel_attn."""
    if raw.get("alibi"):
        raise CheckpointError(f"{path}: Falcon with ALiBi positions is not supported (rotary only)")
    act = raw.get("activation", "gelu")
    if act not in ("relu", "gelu") or ffn_kind not in (None, act):
        raise CheckpointError(f"{path}: Falcon activation {act!r} is not supported (relu: ReLU-Falcon, gelu)")
    new = bool(raw.get("new_decoder_architecture", False))
    parallel = bool(raw.get("parallel_attn", True))
    if new and not parallel and raw.get("num_ln_in_parallel_attn") == 1:
        raise CheckpointError(f"{path}: Falcon's new architecture with one LayerNorm needs parallel_attn")
    d, n_heads = raw["hidden_size"], raw["num_attention_heads"]
    if new:
        n_kv = raw.get("num_kv_heads") or n_heads
    else:
        n_kv = 1 if raw.get("multi_query", True) else n_heads
    bias = bool(raw.get("bias", False))
    theta, rope_scaling = _rope(raw, path)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        d_model=d,
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=d // n_heads,
        d_ff=raw.get("ffn_hidden_size") or 4 * d,
        ffn_kind=act,
        norm_kind="layernorm",
        norm_eps=float(raw.get("layer_norm_epsilon") or 1e-5),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position=raw.get("max_position_embeddings", 2048),
        qkv_bias=bias,
        attn_out_bias=bias,
        ffn_bias=bias,
        parallel_block=new or parallel,
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        architecture="falcon",
        name=raw.get("_name_or_path") or path.name,
    )


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
    mapping = {k: v for k, v in names.items() if k in expected_shapes(cfg)}
    fused = {layer_prefix.format(i) + name: [layer_prefix.format(i) + part for part in parts]
             for i in range(cfg.n_layers) for name, parts in _fused_in_checkpoint(cfg).items()}
    found = _read_tensors(_safetensor_files(path), set(mapping.values()) | set(fused))
    falcon_rows = _falcon_qkv_rows(raw, cfg) if cfg.architecture == "falcon" else None
    for name, parts in fused.items():  # split into the separate projections (build_weights fuses them again)
        if name in found:
            if falcon_rows is not None and found[name].shape[0] == falcon_rows.size:
                found[name] = found[name][falcon_rows]
            ours = {theirs: k for k, theirs in mapping.items()}
            sizes = [expected_shapes(cfg)[ours[part]][0] for part in parts]
            if found[name].shape[0] != sum(sizes):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {found[name].shape}; the config implies "
                                      f"{sum(sizes)} rows ({' + '.join(map(str, sizes))})")
            found |= dict(zip(parts, np.split(found.pop(name), np.cumsum(sizes)[:-1])))
    tensors = {}
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
