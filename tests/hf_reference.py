"""Tiny random Hugging Face models (PyTorch) saved as safetensors: the independent reference."""

from __future__ import annotations

import pathlib

import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


MOE = ("mixtral", "qwen3_moe", "qwen3_moe_norm", "olmoe", "qwen2_moe", "granitemoe")


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    """A tiny config for each supported architecture, varied to exercise GQA, biases, ties."""
    if arch == "llama":
        return transformers.LlamaConfig(**TINY, intermediate_size=48, num_key_value_heads=2, rope_theta=500.0,
                                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "llama_relu":
        return transformers.LlamaConfig(**TINY, intermediate_size=48, num_key_value_heads=4, hidden_act="relu",
                                        tie_word_embeddings=True)
    if arch == "llama_drelu":  # dReLU has no transformers class: patched MLP below
        return transformers.LlamaConfig(**TINY, intermediate_size=48, num_key_value_heads=1, hidden_act="relu")
    if arch == "llama3_rope":  # Llama 3.1's scaling with a short original context: 3 of 4 frequencies move
        return transformers.LlamaConfig(**TINY, intermediate_size=48, num_key_value_heads=2, rope_theta=500.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if arch == "dynamic_rope":  # dynamic NTK past a context of 8 (a generation of 14 reaches 6 bases past it)
        return transformers.LlamaConfig(**(TINY | {"max_position_embeddings": 8}), intermediate_size=48,
                                        num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 3.0})
    if arch == "phi3_longrope":  # LongRoPE: short factors up to 8 positions, long ones past them; attention factor
        # sqrt(1 + ln 8 / ln 8) from the stretch 64 / 8
        return transformers.Phi3Config(**TINY, intermediate_size=40, num_key_value_heads=2, pad_token_id=0,
                                       original_max_position_embeddings=8, rope_parameters={
                                           "rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]})
    if arch == "linear_rope":
        return transformers.LlamaConfig(**TINY, intermediate_size=48, num_key_value_heads=4,
                                        rope_scaling={"rope_type": "linear", "factor": 3.0})
    if arch == "yarn_rope":  # Qwen2 with YaRN (Qwen2.5's long-context setting), cos/sin scaled
        return transformers.Qwen2Config(**TINY, intermediate_size=40, num_key_value_heads=2, rope_theta=300.0,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16})
    if arch == "qwen2_window":  # the window in the layers from max_window_layers on only (layer 1 of 2)
        return transformers.Qwen2Config(**TINY, intermediate_size=40, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=1)
    if arch == "qwen3":  # q/k norms; head_dim 12 is not hidden_size / heads (8)
        return transformers.Qwen3Config(**TINY, intermediate_size=40, num_key_value_heads=2, head_dim=12,
                                        tie_word_embeddings=True)
    if arch == "gemma2":  # small soft caps, so that both bind; layers 0 and 2 slide over 4 positions; head_dim 16:
        # decode steps run the native attention (head_dim a multiple of 8), soft cap included
        return transformers.Gemma2Config(**(TINY | {"num_hidden_layers": 3}), intermediate_size=40,
                                         num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20,
                                         sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    if arch == "gemma3":  # layers 0, 1 and 3 slide over 4 positions with their own base; layer 2 is global, scaled
        return transformers.Gemma3TextConfig(
            **(TINY | {"num_hidden_layers": 4}), intermediate_size=40, num_key_value_heads=2, head_dim=12,
            query_pre_attn_scalar=20, sliding_window=4, sliding_window_pattern=3,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
    if arch == "falcon_new":  # ReLU-Falcon, the new layout: grouped q/k/v (2 kv heads), two LayerNorms side by side
        return transformers.FalconConfig(**TINY, num_kv_heads=2, new_decoder_architecture=True, activation="relu",
                                         ffn_hidden_size=48, bias=True)
    if arch == "falcon_7b":  # the old layout: multi-query, one LayerNorm for attention and FFN, no biases
        return transformers.FalconConfig(**TINY, new_decoder_architecture=False, multi_query=True,
                                         parallel_attn=True, activation="relu", ffn_hidden_size=48)
    if arch == "falcon_sequential":  # the old layout without parallel_attn: one key and value per head
        return transformers.FalconConfig(**TINY, new_decoder_architecture=False, multi_query=False,
                                         parallel_attn=False, activation="relu", bias=True)
    if arch == "falcon_gelu":  # Falcon's own FFN: GELU (the erf form), no gate; the new layout on one LayerNorm
        return transformers.FalconConfig(**TINY, num_kv_heads=2, new_decoder_architecture=True,
                                         num_ln_in_parallel_attn=1, activation="gelu", ffn_hidden_size=48)
    if arch == "phi3":  # q/k/v and gate/up fused in the checkpoint; a window in every layer
        return transformers.Phi3Config(**TINY, intermediate_size=40, num_key_value_heads=2, sliding_window=5,
                                       pad_token_id=0)
    if arch == "mixtral":  # 4 experts of 24 neurons, the top 2 per token
        return transformers.MixtralConfig(**TINY, intermediate_size=24, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2)
    if arch == "qwen3_moe":  # Qwen3's per-head q/k norms, 4 experts of 12 neurons, the top 2 kept as the softmax gave
        return transformers.Qwen3MoeConfig(**TINY, num_key_value_heads=2, head_dim=12, moe_intermediate_size=12,
                                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    if arch == "qwen3_moe_norm":  # the same renormalized over the top 2 (Mixtral's routing)
        return transformers.Qwen3MoeConfig(**TINY, num_key_value_heads=2, head_dim=12, moe_intermediate_size=12,
                                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    if arch == "olmoe":  # q/k norms over the whole projections; 4 experts of 12 neurons, the top 2 not renormalized
        return transformers.OlmoeConfig(**TINY, num_key_value_heads=2, intermediate_size=12, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=False, eos_token_id=None)
    if arch == "qwen2_moe":  # 4 routed experts of 12 neurons, top 2; a shared expert of 24 under its sigmoid gate
        return transformers.Qwen2MoeConfig(**TINY, num_key_value_heads=2, moe_intermediate_size=12,
                                           shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                           norm_topk_prob=False)
    if arch == "granitemoe":  # 4 experts of 12 neurons, top 2; every multiplier away from 1 so that each binds
        return transformers.GraniteMoeConfig(**TINY, num_key_value_heads=2, intermediate_size=12, num_local_experts=4,
                                             num_experts_per_tok=2, embedding_multiplier=3.0, attention_multiplier=0.2,
                                             residual_multiplier=0.5, logits_scaling=2.5)
    if arch == "mistral":
        return transformers.MistralConfig(**TINY, intermediate_size=40, num_key_value_heads=2, sliding_window=5)
    if arch == "qwen2":
        return transformers.Qwen2Config(**TINY, intermediate_size=40, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "opt":
        return transformers.OPTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32)
    raise ValueError(arch)


def _drelu_forward(mlp):
    def forward(x):
        return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))

    return forward


def make_model(arch: str, directory: pathlib.Path, seed: int = 0, **changes) -> torch.nn.Module:
    """Build a random model (``changes``: config fields to set), perturb norms and biases so they matter, save
    it, return it (eval mode)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    for field, value in changes.items():
        setattr(cfg, field, value)
    cfg._attn_implementation = "eager"
    if arch in MOE:  # their default grouped product takes no float64 (the reference runs in float64)
        cfg._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    if arch == "llama_drelu":
        for layer in model.model.layers:
            layer.mlp.forward = _drelu_forward(layer.mlp)
    return model
