"""Tiny random models of every FFN kind and a float64 numpy reference of their FFN activations."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jpinfer import Engine, LoadedModel, ModelConfig
from jpinfer.models import params, transformer

from activation_reference import activation64, gate64


class CharTokenizer:
    """Character-level ids: 'a'..'z' -> 3..28, anything else -> 29; BOS 1, EOS 2."""

    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) - ord("a") if "a" <= c <= "z" else 29 for c in text.lower()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 3) if 3 <= i <= 28 else "?" for i in ids if i > 2 or not skip_special_tokens)


# Gemma 2's architecture features at tiny scale (every other layer slides over 4 positions; caps that bind)
GEMMA2_LIKE = dict(sandwich_norms=True, sliding_window=4, window_layers=(0,), attn_softcap=2.0, logit_softcap=3.0,
                   attn_scale=0.3, embed_scale=32**0.5, tie_embeddings=True)
# Gemma 3's: no caps; q/k norms, and the sliding layer rotates with a base of its own
GEMMA3_LIKE = GEMMA2_LIKE | dict(attn_softcap=None, logit_softcap=None, qk_norm=True, local_rope_theta=50.0)
# Falcon's (ReLU-Falcon): attention and FFN side by side, LayerNorms, biases, one key and value head
FALCON_LIKE = dict(parallel_block=True, norm_kind="layernorm", qkv_bias=True, attn_out_bias=True, n_kv_heads=1)


def tiny_engine(kind: str, seed: int = 0, n_layers: int = 2, **arch) -> Engine:
    """A tiny random model of FFN kind ``kind``; ``arch``: other ModelConfig fields (e.g. GEMMA2_LIKE)."""
    cfg = ModelConfig(**(dict(vocab_size=40, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8,
                              d_ff=48, ffn_kind=kind, ffn_bias=kind == "relu", bos_token_id=1, eos_token_ids=(2,),
                              name=f"tiny-{kind}") | arch))
    weights = params.build_weights(cfg, params.init_random(cfg, seed=seed, scale=0.2))
    return Engine(LoadedModel(cfg, weights, CharTokenizer(), cfg.name))


@dataclasses.dataclass(frozen=True)
class _Capture:
    """Dense FFN that returns its normalised input x as aux."""

    cfg: ModelConfig

    def __call__(self, i, layer, x, state):
        return transformer.ffn_dense(layer, x, self.cfg), x


def ffn_inputs(engine: Engine, tokens: np.ndarray) -> list[np.ndarray]:
    """Per layer, the normalised FFN inputs (n_tokens, d_model) of the dense model, window by window."""
    cfg = engine.cfg
    cache = transformer.KVCache.create(cfg, len(tokens), tokens.shape[1])
    _, _, xs = jax.jit(transformer.forward, static_argnames=("cfg", "ffn_impl"))(
        engine.weights, np.asarray(tokens, np.int32), cache, cfg, _Capture(cfg))
    return [np.asarray(x, np.float64).reshape(-1, cfg.d_model) for x in xs]


def reference_scores(engine: Engine, tokens: np.ndarray, score: str = "product") -> list[np.ndarray]:
    """Per layer (n_tokens, d_ff) float64 scores: |a| ('product') or |act(gate)| ('gate')."""
    cfg = engine.cfg
    out = []
    for layer, x in zip(engine.weights.layers, ffn_inputs(engine, tokens)):
        w_gate_up = np.asarray(layer.w_gate_up, np.float64)  # (out, in): gate rows, then up rows
        gate_rows, up_rows = (None, w_gate_up) if not cfg.has_gate else np.split(w_gate_up, 2)
        up = x @ up_rows.T + (0 if layer.b_up is None else np.asarray(layer.b_up, np.float64))
        relu = lambda v: np.maximum(v, 0.0)
        if not cfg.has_gate:
            out.append(np.abs(activation64(cfg.ffn_kind, None, up)))
            continue
        g = x @ gate_rows.T
        act_g = gate64(cfg.ffn_kind, g)
        if score == "gate":
            out.append(np.abs(act_g))
        else:
            out.append(np.abs(act_g * (relu(up) if cfg.ffn_kind == "drelu" else up)))
    return out


def thresholds_in_gaps(scores: list[np.ndarray], sparsity: float) -> np.ndarray:
    """Per layer, a threshold halfway between the two sorted scores around the quantile, so
    that float32 rounding cannot move any value across it."""
    out = []
    for s in scores:
        v = np.sort(s.ravel())
        k = int(sparsity * len(v))
        near = np.arange(max(k - 5, 1), min(k + 6, len(v)))
        k = near[np.argmax((v[near] - v[near - 1]) / v[near])]  # the widest relative gap nearby
        out.append((v[k - 1] + v[k]) / 2)
    return np.array(out, np.float32)


def reference_window_losses(engine: Engine, tokens: np.ndarray, layer: int, lam: float, tau: float,
                            on: str = "activation"):
    """float64 numpy forward of tiny_engine's architecture (RMSNorm, rotate-half RoPE, GQA, gated FFN, no
    biases), written out apart from transformer.forward: per window, the summed next-token NLL when layer
    ``layer``'s activations with |a| <= tau are scaled by (1 - lam). Also returns each layer's scores |a|.
    ``on="input"``: the FFN inputs with |x_j| <= tau are scaled instead, and the magnitudes |x| returned."""
    cfg = engine.cfg
    assert (cfg.norm_kind, cfg.positions, cfg.has_gate, cfg.qkv_bias, cfg.attn_out_bias, cfg.ffn_bias,
            cfg.tie_embeddings, cfg.sliding_window) == ("rmsnorm", "rope", True, False, False, False, False, None)
    w = jax.tree.map(lambda v: np.asarray(v, np.float64), engine.weights)
    b, t = tokens.shape
    hd, half, rep = cfg.head_dim, cfg.head_dim // 2, cfg.n_heads // cfg.n_kv_heads
    rms = lambda p, v: v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.norm_eps) * p.scale
    angle = np.arange(t)[:, None] * cfg.rope_theta ** -(np.arange(half) / half)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # (T, 1, half): broadcast over heads
    rope = lambda v: np.concatenate([v[..., :half] * cos - v[..., half:] * sin,
                                     v[..., half:] * cos + v[..., :half] * sin], -1)
    relu = lambda v: np.maximum(v, 0.0)
    act = {"swiglu": lambda g, u: g / (1 + np.exp(-g)) * u, "reglu": lambda g, u: relu(g) * u,
           "drelu": lambda g, u: relu(g) * relu(u)}[cfg.ffn_kind]
    h, scores = w.embed[tokens], []
    for i, lw in enumerate(w.layers):
        qkv = rms(lw.attn_norm, h) @ lw.w_qkv.T
        q = rope(qkv[..., :cfg.q_dim].reshape(b, t, cfg.n_heads, hd))
        k = rope(qkv[..., cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(b, t, cfg.n_kv_heads, hd))
        v = qkv[..., cfg.q_dim + cfg.kv_dim:].reshape(b, t, cfg.n_kv_heads, hd)
        s = np.einsum("bthd,bshd->bhts", q, np.repeat(k, rep, 2)) / np.sqrt(hd)  # query head h reads kv h // rep
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        h = h + np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True),
                          np.repeat(v, rep, 2)).reshape(b, t, -1) @ lw.wo.T
        x = rms(lw.ffn_norm, h)
        if on == "input":
            scores.append(np.abs(x))
            if i == layer:
                x = x - lam * np.where(np.abs(x) <= tau, x, 0.0)
        gate, up = np.split(x @ lw.w_gate_up.T, 2, -1)
        a = act(gate, up)
        if on != "input":
            scores.append(np.abs(a))
            if i == layer:
                a = a - lam * np.where(np.abs(a) <= tau, a, 0.0)
        h = h + a @ lw.w_down.T
    lg = rms(w.final_norm, h)[:, :-1] @ w.head  # head is stored (d_model, vocab)
    top = lg.max(-1, keepdims=True)
    nll = top[..., 0] + np.log(np.exp(lg - top).sum(-1)) - np.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]
    return nll.sum(1), scores
