"""Weights of the dense reference model as registered pytree dataclasses.

Every projection is stored (out_features, in_features), like ``nn.Linear.weight``, and
applied as W @ x; projections that read the same input are fused into one matrix:
``w_qkv`` = [wq; wk; wv] and ``w_gate_up`` = [w_gate; w_up]. Measured on XLA:CPU (the
decode is a chain of matrix-vector products): x @ W over (in, out) matrices took 1.2-1.8x
as long as W @ x over (out, in) rows for a 7B FFN layer, and fusing (3 fewer products per
layer) cut a 30-layer stack at the default model's shapes by 9% on a quiet machine
(bench/results/weight_layout.md has the command and numbers).

Loaders produce a flat dict keyed like ``expected_shapes`` with the unfused (out, in)
tensors of Hugging Face's naming convention; ``build_weights`` fuses them.
The FFN of layer l: ``w_gate_up`` (2 d_ff, d_model) with the gate rows first (kind
``relu`` has no gate: (d_ff, d_model) up rows), ``w_down`` (d_model, d_ff). Neuron i is
gate row i, up row i and column i of ``w_down``; with experts (``ModelConfig.n_experts``) expert e
holds neurons e * expert_size .. (e + 1) * expert_size - 1 and ``router`` (n_experts, d_model) scores
the experts. Optional tensors (biases, norm bias, the input embedding when tied to the head) are ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig

# The fused projections and the separate (out, in) tensors each stacks, in row order (build_layer; gguf_loader's
# straight-to-quantized reader). A part a config lacks (the gate of kind relu) is left out.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "w_qkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",),
}

def _register(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_register
@dataclasses.dataclass
class Norm:
    scale: jax.Array
    bias: jax.Array | None = None  # LayerNorm only


@_register
@dataclasses.dataclass
class Layer:
    attn_norm: Norm
    w_qkv: jax.Array  # (q_dim + 2 kv_dim, d_model): query, key, value rows
    wo: jax.Array  # (d_model, q_dim)
    ffn_norm: Norm
    w_gate_up: jax.Array  # (2 d_ff, d_model): gate rows then up rows; (d_ff, d_model) up rows for kind relu
    w_down: jax.Array  # (d_model, d_ff)
    b_qkv: jax.Array | None = None
    bo: jax.Array | None = None
    q_norm: Norm | None = None  # (head_dim,) scales: ModelConfig.qk_norm (Qwen3); (q_dim,) qk_norm_whole (OLMoE)
    k_norm: Norm | None = None  # (head_dim,) or (kv_dim,)
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None
    attn_out_norm: Norm | None = None  # ModelConfig.sandwich_norms (Gemma 2): on the attention's output
    ffn_out_norm: Norm | None = None  # and on the FFN's
    router: jax.Array | None = None  # (n_experts, d_model): ModelConfig.n_experts (Mixtral)


@_register
@dataclasses.dataclass
class Weights:
    """The whole model. ``head`` is stored (d_model, vocab) and applied as h @ head: for the
    default model's 49152 x 576 head the (vocab, d_model) form (short rows) took 1.5x as long
    (bench/results/weight_layout.md). A tied model keeps only ``head``: its input embedding of
    token t is column t (``embed`` is then None, nothing is stored twice)."""

    head: jax.Array  # (d_model, vocab)
    layers: list[Layer]
    final_norm: Norm
    embed: jax.Array | None = None  # (vocab, d_model) input embedding; None when tied to head
    positions: jax.Array | None = None  # learned position table (OPT)

    @property
    def dtype(self):
        """The float dtype of activations and the KV cache (the norms' dtype: quantized weights,
        ``models.quantized``, keep their norms in float)."""
        return self.final_norm.scale.dtype



def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the config requires, keyed like ``tensor_names``.

    Loaders check incoming tensors against this so that a checkpoint that disagrees
    with its config is a clear error, not a broadcasting surprise deep inside.
    """
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, d), "final_norm.scale": (d,)}
    if cfg.norm_kind == "layernorm":
        shapes["final_norm.bias"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    if cfg.positions == "learned":
        shapes["positions"] = (cfg.max_position + cfg.position_offset, d)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        layer = {
            "attn_norm.scale": (d,),
            "ffn_norm.scale": (d,),
            "wq": (cfg.q_dim, d),
            "wk": (cfg.kv_dim, d),
            "wv": (cfg.kv_dim, d),
            "wo": (d, cfg.q_dim),
            "w_up": (f, d),
            "w_down": (d, f),
        }
        if cfg.norm_kind == "layernorm":
            layer |= {"attn_norm.bias": (d,), "ffn_norm.bias": (d,)}
        if cfg.has_gate:
            layer["w_gate"] = (f, d)
        if cfg.qkv_bias:
            layer |= {"bq": (cfg.q_dim,), "bk": (cfg.kv_dim,), "bv": (cfg.kv_dim,)}
        if cfg.attn_out_bias:
            layer["bo"] = (d,)
        if cfg.qk_norm:
            q_size, k_size = (cfg.q_dim, cfg.kv_dim) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
            layer |= {"q_norm.scale": (q_size,), "k_norm.scale": (k_size,)}
        if cfg.sandwich_norms:
            layer |= {"attn_out_norm.scale": (d,), "ffn_out_norm.scale": (d,)}
        if cfg.ffn_bias:
            layer |= {"b_up": (f,), "b_down": (d,)}
        if cfg.n_experts:
            layer["router"] = (cfg.n_experts, d)
        shapes |= {p + k: v for k, v in layer.items()}
    return shapes


def build_weights(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> Weights:
    """Assemble ``Weights`` (fused projections) from a flat dict keyed like ``expected_shapes``.

    Raises ValueError naming the tensor when one is missing or has the wrong shape.
    """
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} required by the model config")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, but the config implies {shape}"
            )

    get = lambda name: _get(tensors, expected, name, dtype)
    layers = [build_layer(cfg, tensors, i, dtype) for i in range(cfg.n_layers)]
    head = tensors["embed"] if cfg.tie_embeddings else tensors["lm_head"]
    return Weights(
        head=jnp.asarray(np.ascontiguousarray(np.asarray(head).T), dtype=dtype),
        layers=layers,
        final_norm=_norm(tensors, expected, "final_norm", dtype),
        embed=None if cfg.tie_embeddings else get("embed"),
        positions=get("positions"),
    )


def _get(tensors: dict, expected: dict, name: str, dtype):
    return jnp.asarray(tensors[name], dtype=dtype) if name in expected else None


def _norm(tensors: dict, expected: dict, prefix: str, dtype) -> Norm:
    get = lambda name: _get(tensors, expected, prefix + name, dtype)
    return Norm(scale=get(".scale"), bias=get(".bias"))


def build_layer(cfg: ModelConfig, tensors: dict[str, np.ndarray], i: int, dtype=jnp.float32,
                projections: dict | None = None) -> Layer:
    """Layer ``i`` from a flat dict keyed like ``expected_shapes`` (not checked here: ``build_weights`` checks).
    ``projections``: fused matrices made elsewhere (``w_qkv``, ``wo``, ``w_gate_up``, ``w_down``, e.g. quantized
    ones read straight from a file), used as they are in place of those fused from ``tensors``."""
    expected = expected_shapes(cfg)
    projections = projections or {}
    p = f"layers.{i}."
    get = lambda name: _get(tensors, expected, p + name, dtype)
    norm = lambda name: _norm(tensors, expected, p + name, dtype)

    def fused(name: str, *parts: str):
        if name in projections:
            return projections[name]
        present = [np.asarray(tensors[p + n]) for n in parts if p + n in expected]
        if not present:
            return None
        return jnp.asarray(present[0] if len(present) == 1 else np.concatenate(present), dtype=dtype)

    return Layer(
        attn_norm=norm("attn_norm"),
        w_qkv=fused("w_qkv", *FUSED_PROJECTIONS["w_qkv"]),
        b_qkv=fused("b_qkv", "bq", "bk", "bv"),
        wo=fused("wo", *FUSED_PROJECTIONS["wo"]),
        bo=get("bo"),
        ffn_norm=norm("ffn_norm"),
        w_gate_up=fused("w_gate_up", *FUSED_PROJECTIONS["w_gate_up"]),
        b_up=get("b_up"),
        w_down=fused("w_down", *FUSED_PROJECTIONS["w_down"]),
        b_down=get("b_down"),
        q_norm=norm("q_norm") if cfg.qk_norm else None,
        k_norm=norm("k_norm") if cfg.qk_norm else None,
        attn_out_norm=norm("attn_out_norm") if cfg.sandwich_norms else None,
        ffn_out_norm=norm("ffn_out_norm") if cfg.sandwich_norms else None,
        router=get("router"),
    )


def init_random(cfg: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 tensors for every name in ``expected_shapes`` (tests, benches)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.scale"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def cast(weights: Weights, dtype) -> Weights:
    """Weights with every float array cast to ``dtype`` (int8 values of quantized weights stay int8)."""
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, weights)


def nbytes(tree: Any) -> int:
    """Bytes of every array in a pytree: weights, a layer, predictors (quantized matrices count their scales)."""
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))
