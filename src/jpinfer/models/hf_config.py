"""Hugging Face config.json -> ModelConfig: which architecture, and every feature it needs the decoder to read.

Supported: LlamaForCausalLM (hidden_act silu -> swiglu, relu -> reglu, GELU's tanh form -> geglu; this
covers ReluLLaMA and ProSparse-style ReLU checkpoints), MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
(q/k norms), Phi3ForCausalLM (q/k/v and gate/up fused in the checkpoint), Gemma2ForCausalLM (GeGLU, scaled
embeddings, norms on the attention's and FFN's outputs, soft-capped scores and logits, sliding windows in
every other layer), Gemma3ForCausalLM (Gemma 2 without the caps, with q/k norms, five sliding layers in six
and their own RoPE base), FalconForCausalLM (ReLU-Falcon and GELU Falcon: attention and FFN side by side,
the fused q/k/v of each layout), MixtralForCausalLM (a mixture of SwiGLU experts under a top-k router), the MoE families
Qwen3MoeForCausalLM (Qwen3's attention, top-k of a softmax renormalized only with norm_topk_prob),
OlmoeForCausalLM (q/k norms over the whole projections) and Qwen2MoeForCausalLM (a shared expert under a sigmoid
gate, held as more experts: ``config.ExpertRouting``), GraniteMoeForCausalLM (Mixtral's routing; embedding,
attention, residual and logits multipliers) and OPTForCausalLM (pre-LayerNorm variants). What is not
supported yet is refused with a CheckpointError that names it (``UNSUPPORTED`` says what for known families).
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

from jpinfer.config import ModelConfig, RopeScaling
from jpinfer.errors import CheckpointError
from jpinfer.models.rope import yarn_attention_factor

LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
              "Gemma3ForCausalLM": "gemma3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
              "OlmoeForCausalLM": "olmoe", "Qwen2MoeForCausalLM": "qwen2_moe", "GraniteMoeForCausalLM": "granitemoe"}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "gelu_pytorch_tanh": "geglu",
               "gelu_new": "geglu"}
SUPPORTED = sorted([*LLAMA_LIKE, "OPTForCausalLM", "FalconForCausalLM"])
GRANITE_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
# known families not supported yet: what they need that the decoder lacks
UNSUPPORTED = {
    "DeepseekV2ForCausalLM": "multi-head latent attention (compressed, low-rank keys and values with a decoupled "
                             "rotary part) and its grouped top-k routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention (compressed, low-rank keys and values with a decoupled "
                             "rotary part) and its sigmoid routing with a correction bias over expert groups",
}


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
    if rope_type in ("longrope", "su"):  # "su": its name in older Phi-3 configs
        return theta, _longrope(raw, scaling, path)
    if rope_type not in ("linear", "llama3", "yarn", "dynamic"):
        raise CheckpointError(f"{path}: RoPE scaling type {rope_type!r} is not supported yet "
                              "(supported: linear, llama3, yarn, dynamic, longrope)")
    original = scaling.get("original_max_position_embeddings")
    if rope_type == "dynamic":  # transformers stretches past the config's own context length
        original = raw["max_position_embeddings"]
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


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], path: pathlib.Path) -> RopeScaling:
    """Phi-3's LongRoPE as transformers reads it: the original context from the scaling or the config, the
    attention factor sqrt(1 + ln(s) / ln(original)) for the stretch s = max_position_embeddings / original
    unless given."""
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    try:
        factor = scaling.get("factor") or raw["max_position_embeddings"] / original
        attention = scaling.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return RopeScaling("longrope", factor=float(factor), original_max_position=original,
                           attention_factor=float(attention), frequency_factors=tuple(scaling["short_factor"]),
                           long_factors=tuple(scaling["long_factor"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: RoPE scaling 'longrope': {err!r}") from None


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
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM") or window is None:
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


def _shared_fields(raw: dict[str, Any], path: pathlib.Path) -> dict[str, Any]:
    """The ModelConfig fields every architecture reads the same way: vocabulary, depth, special ids, name."""
    eos = raw.get("eos_token_id")
    return dict(vocab_size=raw["vocab_size"], n_layers=raw["num_hidden_layers"], bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
                name=raw.get("_name_or_path") or path.name)


def parse_config(raw: dict[str, Any], path: pathlib.Path, ffn_kind: str | None = None) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in UNSUPPORTED:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported yet: it needs {UNSUPPORTED[arch]}; "
                              f"supported: {', '.join(SUPPORTED)}")
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
    experts = _experts(raw, path, arch)
    expert_size = experts.pop("expert_size") if experts else raw["intermediate_size"]
    granite = {k: float(raw[k]) for k in GRANITE_MULTIPLIERS
               if arch == "GraniteMoeForCausalLM" and raw.get(k) is not None}
    return ModelConfig(
        **_shared_fields(raw, path),
        d_model=raw["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
        d_ff=expert_size * max(experts.get("n_experts", 0), 1),  # every expert's neurons
        **experts,
        ffn_kind=ffn_kind,
        norm_kind="rmsnorm",
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        local_rope_theta=local_theta if window is not None else None,
        max_position=raw.get("max_position_embeddings", 2048),
        sliding_window=window,
        window_layers=window_layers,
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM"
                                                                  and bool(raw.get("qkv_bias", True))),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
        qk_norm_whole=arch == "OlmoeForCausalLM",
        attn_out_bias=attention_bias,
        attn_scale=(float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma
                    else granite.get("attention_multiplier")),
        attn_softcap=softcap("attn_logit_softcapping"),
        logit_softcap=softcap("final_logit_softcapping"),
        sandwich_norms=gemma,
        embed_scale=float(raw["hidden_size"]) ** 0.5 if gemma else granite.get("embedding_multiplier", 1.0),
        residual_scale=granite.get("residual_multiplier", 1.0),
        logit_divisor=granite.get("logits_scaling", 1.0),
        tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        architecture=LLAMA_LIKE[arch],
    )


def _experts(raw: dict[str, Any], path: pathlib.Path, arch: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts ({} for a dense FFN) plus ``expert_size`` (its neurons per
    expert; ``_parse_llama`` takes it out). Mixtral renormalizes its top-k; the Qwen-MoE families and OLMoE only
    with norm_topk_prob (transformers' default false); Qwen2-MoE's shared expert becomes
    shared_expert_intermediate_size / moe_intermediate_size more experts, each a piece of it under the one gate
    (its row repeated in the router: ``hf_loader``)."""
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):  # Granite: a softmax over the top-k scores, the same
        return dict(n_experts=int(raw["num_local_experts"]), experts_per_token=int(raw["num_experts_per_tok"]),
                    expert_size=raw["intermediate_size"])
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"):
        return {}
    if arch != "OlmoeForCausalLM":
        only_mlp, step = raw.get("mlp_only_layers") or [], raw.get("decoder_sparse_step", 1)
        if only_mlp or step != 1:
            raise CheckpointError(f"{path}: dense FFN layers among the experts' layers (mlp_only_layers={only_mlp}, "
                                  f"decoder_sparse_step={step}) are not supported: every layer must have experts")
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{path}: use_sliding_window is not supported for {arch}")
    elif raw.get("clip_qkv") is not None:
        raise CheckpointError(f"{path}: OLMoE's clip_qkv (clamped q/k/v) is not supported")
    size = raw["intermediate_size"] if arch == "OlmoeForCausalLM" else raw["moe_intermediate_size"]
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared_size = raw.get("shared_expert_intermediate_size") or 0
        if shared_size % size or not shared_size:
            raise CheckpointError(f"{path}: a shared expert of {shared_size} neurons is not a multiple of the "
                                  f"experts' {size} (moe_intermediate_size): not supported")
        shared = shared_size // size
    # the hub's configs name it num_experts, transformers 5 writes num_local_experts
    routed = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
    return dict(n_experts=routed + shared, experts_per_token=int(raw["num_experts_per_tok"]), expert_size=size,
                renormalize_experts=bool(raw.get("norm_topk_prob", False)), shared_experts=shared)


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
        **_shared_fields(raw, path),
        d_model=d,
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
        architecture="opt",
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
        **_shared_fields(raw, path),
        d_model=d,
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
        architecture="falcon",
    )
