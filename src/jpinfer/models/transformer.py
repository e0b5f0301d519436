"""Dense reference decoder: Llama family (RoPE, GQA, RMSNorm, gated FFN), Gemma 2 and 3, Falcon and OPT.

Pure functions over the ``Weights`` pytree. The FFN is a pluggable step: ``forward``
takes a static ``ffn_impl`` and a traced ``ffn_state`` so that sparse FFNs (oracle
masks, predictors, hybrid placement) and the profiler replace the dense FFN per layer
without touching attention.

``ffn_impl(layer_index, layer, x, state) -> (y, aux)``: ``x`` is the normalised FFN
input (..., d_model), ``y`` the FFN output including ``b_down``, ``aux`` any pytree
(``None`` for nothing) that ``forward`` returns per layer. ``state`` is
``ffn_state[layer_index]`` (``None`` when no state is given).

The attention's two products have the same seam: an ``ffn_impl`` that also defines
``project(layer_index, layer, name, x, state) -> y`` computes the fused q|k|v product (name "qkv",
x the normalised attention input, y (..., q_dim + 2 kv_dim) with ``b_qkv``) and the output product
("o", x the attention's output (..., q_dim), y (..., d_model) with ``bo``) with the layer's state;
without it they are the decoder's ``linear`` (the threshold mode's input sparsity on q|k|v and o).
An ``ffn_impl`` with a ``head_threshold`` (a static float) skips the head's inputs of magnitude at most it
(``logits``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jpinfer.activations import activate
from jpinfer.config import ExpertRouting, ModelConfig
from jpinfer.models import quantized
from jpinfer.models.params import Layer, Norm, Weights
from jpinfer.models.rope import RopeTables, rope, rope_tables
from jpinfer.ops import dense, threshold
from jpinfer.ops.attention import cached_attention, softcap

FfnImpl = Callable[[int, Layer, jax.Array, Any], tuple[jax.Array, Any]]
# (name, x) -> y: a layer's attention product "qkv" or "o" with its bias (``layer_projection``)
Projection = Callable[[str, jax.Array], jax.Array]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "length"], meta_fields=[])
@dataclasses.dataclass
class KVCache:
    """Preallocated keys/values: per layer one (batch, n_kv_heads, capacity, head_dim) array each.

    Heads before positions: each head's keys are one contiguous (capacity, head_dim) matrix.
    One array per layer, not one stacked (n_layers, ...) array: reading layer i of a stacked
    cache after updating it made XLA:CPU copy the layer's whole slice, twice per layer and
    step (~24 MB per token on the default model, ~2.6 ms; docs/architecture.md).

    ``length`` is the number of positions already written: a scalar shared by the batch, or one per
    sequence, (batch,), when each sequence of a batch is at its own position (batched decoding: every
    step then takes per-sequence positions (B, T), writes each sequence's keys at its own offset and
    masks each sequence's attention by its own positions).
    """

    k: list[jax.Array]
    v: list[jax.Array]
    length: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32, *,
               per_sequence: bool = False) -> "KVCache":
        """An empty cache; ``per_sequence`` gives each sequence a length of its own."""
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        zeros = lambda: [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)]
        return cls(zeros(), zeros(), jnp.zeros((batch,) if per_sequence else (), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def fixed_order_sum(v: jax.Array) -> jax.Array:
    """Sum over the last axis (keepdims) by halving it, pairwise: every row gets the same additions whatever the
    leading shape. XLA:CPU's own row reductions do not: the mean of squares of 576 floats rounded differently in
    a batch of 8 rows than alone (2e-6 relative, jax 0.10), so a sequence's decode step in a batch was not its
    step alone, and in the threshold mode such differences flipped keep decisions (5 of 32 served greedy answers
    differed from the request alone, 2026-12-04). Each addition is an elementwise op, computed the same in any
    shape; odd lengths get an exact zero appended."""
    n = v.shape[-1]
    while n > 1:
        if n % 2:
            v = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], 1), v.dtype)], axis=-1)
            n += 1
        v = v[..., : n // 2] + v[..., n // 2 :]
        n //= 2
    return v


def norm(p: Norm, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm or LayerNorm, computed in float32 and returned in x's dtype; the row sums in a fixed order
    (``fixed_order_sum``), so a token's result does not depend on the rows beside it."""
    x32 = x.astype(jnp.float32)
    d = x32.shape[-1]
    if cfg.norm_kind == "layernorm":
        x32 = x32 - fixed_order_sum(x32) / d
    y = x32 * jax.lax.rsqrt(fixed_order_sum(x32 * x32) / d + cfg.norm_eps)
    y = y * p.scale.astype(jnp.float32)
    if p.bias is not None:
        y = y + p.bias.astype(jnp.float32)
    return y.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | quantized.QuantizedMatrix, b: jax.Array | None = None) -> jax.Array:
    """x (..., in) through an (out, in) weight: W @ x per token, plus the bias, in x's dtype. A quantized weight
    runs through ``quantized.matmul`` (W8A8, W4A8), a float one through ``ops.dense.float_product`` (which picks
    the native product for decode steps on the CPU)."""
    y = quantized.matmul(x, w).astype(x.dtype) if quantized.is_quantized(w) else dense.float_product(x, w)
    return y if b is None else y + b


def attention_block(
    layer: Layer,
    x: jax.Array,
    positions: jax.Array,
    rope_cs: RopeTables | None,
    cache_k: jax.Array,
    cache_v: jax.Array,
    cfg: ModelConfig,
    attend: int | None = None,
    *,
    window: int | None,
    project: Projection | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal grouped-query attention over the layer's cache plus the T new positions, each query within
    the layer's ``window`` (``ModelConfig.layer_window``; None: every earlier position).

    x: (B, T, d) normalised input at ``positions`` (T,), or (B, T) one row per sequence, each written at its
    own offset; ``rope_cs`` from ``rope_tables``
    (None for learned positions). The new keys and values are written into the layer's
    cache in place (the caller donates it), so a step never copies the cache. Attention
    (``cached_attention``) reads at most the first ``attend`` cache slots (static; None = all),
    which must hold every position so far: a decode step at position 40 of a 2048-slot cache
    reads 128 slots (XLA) or 41 (the native kernel), not 2048. ``project`` computes the q|k|v and
    output products (``layer_projection``; None: ``linear`` with the layer's weights).
    Returns the output projection (B, T, d) and the layer's updated keys and values.
    """
    b, t, _ = x.shape
    project = project or functools.partial(dense_projection, layer)
    qkv = project("qkv", x)
    q, k = qkv[..., : cfg.q_dim], qkv[..., cfg.q_dim : cfg.q_dim + cfg.kv_dim]
    if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: over the whole projection, before it splits into heads
        q, k = norm(layer.q_norm, q, cfg), norm(layer.k_norm, k, cfg)
    q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = qkv[..., cfg.q_dim + cfg.kv_dim :].reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm and not cfg.qk_norm_whole:  # Qwen3, Gemma 3: per head
        q, k = norm(layer.q_norm, q, cfg), norm(layer.k_norm, k, cfg)
    if rope_cs is not None:
        tables = rope_cs.for_window(window)
        q = rope(q, tables)
        k = rope(k, tables)
    if cfg.attn_scale is not None:  # the attention kernels scale by head_dim ** -0.5: the rest goes to q
        q = q * jnp.asarray(cfg.attn_scale * cfg.head_dim**0.5, q.dtype)
    cache_k = _write(cache_k, k, positions)
    cache_v = _write(cache_v, v, positions)
    out = cached_attention(q, cache_k, cache_v, positions, cfg, attend, window=window)
    out = out.reshape(b, t, cfg.q_dim).astype(x.dtype)
    return project("o", out), cache_k, cache_v


def dense_projection(layer: Layer, name: str, x: jax.Array) -> jax.Array:
    """The layer's q|k|v ("qkv") or output ("o") product of x with its bias, as loaded."""
    w, b = (layer.w_qkv, layer.b_qkv) if name == "qkv" else (layer.wo, layer.bo)
    return linear(x, w, b)


def layer_projection(ffn_impl: FfnImpl | None, layer_index: int, layer: Layer, state: Any) -> Projection | None:
    """The attention products of layer ``layer_index`` under ``ffn_impl``: its ``project`` bound to the layer
    and its state, or None (the dense products) when it has none (module docstring)."""
    project = getattr(ffn_impl, "project", None)
    return None if project is None else functools.partial(project, layer_index, layer, state=state)


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """The layer's cache (B, KV, S, hd) with the new keys or values (B, T, KV, hd) written at ``positions``:
    one slice for a shared position row, a slice per sequence for (B, T) positions."""
    new = new.astype(cache.dtype).transpose(0, 2, 1, 3)
    if positions.ndim == 1:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, positions[0], 0))
    at_row = lambda c, n, p: jax.lax.dynamic_update_slice(c, n, (0, p[0], 0))
    return jax.vmap(at_row)(cache, new, positions)


def gate_and_up(layer: Layer, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array | None, jax.Array]:
    """Gate (None for kind relu) and up projections (..., d_ff) of x, from one fused product."""
    h = linear(x, layer.w_gate_up)
    gate, up = (h[..., : cfg.d_ff], h[..., cfg.d_ff :]) if cfg.has_gate else (None, h)
    return gate, up if layer.b_up is None else up + layer.b_up


def expert_weights(router: jax.Array, x: jax.Array, rule: ExpertRouting) -> jax.Array:
    """(..., n_experts) float32 routing weights of normalised input x under ``rule`` (``config.ExpertRouting``): a
    softmax over the routed experts' scores whose top ``rule.top_k`` are kept, renormalized to sum 1 with
    ``rule.renormalize`` (Mixtral's router; Qwen-MoE's and OLMoE's norm_topk_prob), the others zeroed (ties go to
    the lower expert, as ``torch.topk``'s); then each of the last ``rule.shared`` experts (a shared expert's pieces)
    weighed by the sigmoid of its own score (Qwen2-MoE's shared_expert_gate). Sums in a fixed order
    (``fixed_order_sum``): a token's routing does not depend on the rows beside it."""
    scores = linear(x, router).astype(jnp.float32)
    n_routed = router.shape[0] - rule.shared
    routed = scores[..., :n_routed]
    exp = jnp.exp(routed - routed.max(-1, keepdims=True))
    probs = exp / fixed_order_sum(exp)
    top, picked = jax.lax.top_k(probs, rule.top_k)
    chosen = jax.nn.one_hot(picked, n_routed, dtype=jnp.bool_).any(-2)
    weights = jnp.where(chosen, probs, 0.0)
    if rule.renormalize:
        weights = weights / fixed_order_sum(top)
    if rule.shared:
        weights = jnp.concatenate([weights, jax.nn.sigmoid(scores[..., n_routed:])], axis=-1)
    return weights


def expert_routing(layer: Layer, x: jax.Array, cfg: ModelConfig) -> jax.Array | None:
    """Per neuron (..., d_ff) its expert's routing weight (``expert_weights``) in x's dtype; None without experts."""
    if not cfg.n_experts:
        return None
    weights = expert_weights(layer.router, x, cfg.routing_rule)
    return jnp.repeat(weights, cfg.expert_size, axis=-1).astype(x.dtype)


def ffn_activations(layer: Layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Per-neuron activation a (..., d_ff), with experts times the routing weight (``expert_routing``); the FFN
    output is ``ffn_down(layer, a)``."""
    a = activate(cfg.ffn_kind, *gate_and_up(layer, x, cfg))
    routing = expert_routing(layer, x, cfg)
    return a if routing is None else a * routing


def ffn_down(layer: Layer, a: jax.Array) -> jax.Array:
    """The FFN output for (possibly masked) activations a (..., d_ff): W_down @ a + b_down."""
    return linear(a, layer.w_down, layer.b_down)


def ffn_dense(layer: Layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The dense FFN output for normalised input x."""
    return ffn_down(layer, ffn_activations(layer, x, cfg))


def _dense_ffn_impl(cfg: ModelConfig) -> FfnImpl:
    return lambda i, layer, x, state: (ffn_dense(layer, x, cfg), None)


def embed(weights: Weights, tokens: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Input embeddings (B, T, d): rows of ``embed`` (int8 rows when read straight from a file into int8,
    ``gguf_loader.read_quantized_weights``), or columns of the tied ``head``."""
    if weights.embed is not None and quantized.is_quantized(weights.embed):
        h = quantized.rows(weights.embed, tokens, weights.dtype)
    elif weights.embed is not None:
        h = weights.embed[tokens]
    elif quantized.is_quantized(weights.head):  # the tied head's (vocab, d) quantized rows
        h = quantized.rows(weights.head, tokens, weights.dtype)
    else:
        h = jnp.moveaxis(jnp.take(weights.head, tokens, axis=1), 0, -1)
    if cfg.positions == "learned":
        h = h + weights.positions[positions + cfg.position_offset]  # (T, d) or (B, T, d): broadcasts
    if cfg.embed_scale != 1.0:
        h = h * jnp.asarray(cfg.embed_scale, h.dtype)
    return h


def step_inputs(
    weights: Weights, tokens: jax.Array, start: jax.Array, cfg: ModelConfig, n_valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, RopeTables | None]:
    """Embeddings (B, T, d) of T new tokens after ``start`` cached positions, their positions
    (T,) and the rotary tables the layers share (None for learned positions). A ``start`` per sequence
    (B,) gives positions (B, T). ``n_valid``: how many of the T are real (a right-padded prompt; default T): the
    length the step reaches, which dynamic RoPE scaling reads."""
    positions = start[..., None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = embed(weights, tokens, positions, cfg)
    length = start + (tokens.shape[1] if n_valid is None else n_valid)
    rope_cs = rope_tables(positions, cfg, length) if cfg.positions == "rope" else None
    return h, positions, rope_cs


def attention_residual(
    layer: Layer,
    h: jax.Array,
    positions: jax.Array,
    rope_cs: RopeTables | None,
    cache_k: jax.Array,
    cache_v: jax.Array,
    cfg: ModelConfig,
    attend: int | None = None,
    *,
    window: int | None,
    project: Projection | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A layer up to its FFN: h + attention(norm(h)) (times ``residual_scale``) within ``window`` (the layer's
    ``ModelConfig.layer_window``), the attention's output normalised too with ``sandwich_norms``.
    Returns that residual stream, the normalised FFN input x (of the layer's input h itself with
    ``parallel_block``) and the layer's updated keys and values; the layer's output is ``ffn_residual``
    of the FFN of x (``forward``; the bench's layer offload and the profiler's smoothing pass call both
    themselves). ``project`` as in
    ``attention_block``."""
    attn, k, v = attention_block(layer, norm(layer.attn_norm, h, cfg), positions, rope_cs, cache_k, cache_v, cfg,
                                 attend, window=window, project=project)
    if cfg.sandwich_norms:
        attn = norm(layer.attn_out_norm, attn, cfg)
    x = norm(layer.ffn_norm, h, cfg) if cfg.parallel_block else None
    h = h + _residual_scaled(attn, cfg)
    return h, norm(layer.ffn_norm, h, cfg) if x is None else x, k, v


def ffn_residual(layer: Layer, h: jax.Array, y: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The layer's output: the residual stream h plus its whole FFN output y (normalised first with
    ``sandwich_norms``: a norm of the sum, so a split FFN adds its parts before this)."""
    if cfg.sandwich_norms:
        y = norm(layer.ffn_out_norm, y, cfg)
    return h + _residual_scaled(y.astype(h.dtype), cfg)


def _residual_scaled(y: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A block's output as added to the residual stream: times ``residual_scale`` (GraniteMoE), else as it is."""
    return y if cfg.residual_scale == 1.0 else y * jnp.asarray(cfg.residual_scale, y.dtype)


def forward(
    weights: Weights,
    tokens: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    ffn_impl: FfnImpl | None = None,
    ffn_state: Any = None,
    attend: int | None = None,
    n_valid: jax.Array | None = None,
) -> tuple[jax.Array, KVCache, list[Any]]:
    """Run T new tokens (B, T) after ``cache.length`` cached positions.

    ``attend`` (static): cache slots attention reads, at least ``cache.length + T``
    (None = the whole cache); ``n_valid``: the real tokens of a right-padded T (``step_inputs``).
    Returns the final-normalised hidden states (B, T, d), the cache with the new positions
    written (``length`` advanced by T) and the per-layer FFN aux outputs.
    """
    impl = ffn_impl or _dense_ffn_impl(cfg)
    start = cache.length
    h, positions, rope_cs = step_inputs(weights, tokens, start, cfg, n_valid)
    aux, keys, values = [], [], []
    for i, layer in enumerate(weights.layers):
        state = None if ffn_state is None else ffn_state[i]
        h, x, k, v = attention_residual(layer, h, positions, rope_cs, cache.k[i], cache.v[i], cfg, attend,
                                        window=cfg.layer_window(i), project=layer_projection(ffn_impl, i, layer, state))
        keys.append(k)
        values.append(v)
        y, aux_i = impl(i, layer, x, state)
        h = ffn_residual(layer, h, y, cfg)
        aux.append(aux_i)
    cache = KVCache(keys, values, start + tokens.shape[1])
    return norm(weights.final_norm, h, cfg), cache, aux


def head_threshold(ffn_impl: FfnImpl | None) -> float | None:
    """The head's input threshold under ``ffn_impl`` (its static ``head_threshold``; None: the dense head)."""
    return getattr(ffn_impl, "head_threshold", None)


def logits(weights: Weights, h: jax.Array, cfg: ModelConfig, input_threshold: float | None = None) -> jax.Array:
    """Float32 logits from final hidden states: h @ head, head (d, vocab) (see params.Weights), or
    a quantized head's (vocab, d) rows (``quantized.matmul``), or an int8 head's input-major (d, vocab) copy
    (the threshold mode's, ``modes.engines.threshold_engine``); soft-capped with ``logit_softcap``, divided by
    ``logit_divisor`` (GraniteMoE).

    ``input_threshold``: the entries of h of magnitude at most it are skipped (the threshold mode's head input
    sparsity; ``ops.threshold.head_product`` picks the kernel)."""
    out = softcap(threshold.head_product(h, weights.head, input_threshold), cfg.logit_softcap)
    return out if cfg.logit_divisor == 1.0 else out / cfg.logit_divisor


def next_token_nll(weights: Weights, h: jax.Array, tokens: jax.Array, cfg: ModelConfig,
                   head_input_threshold: float | None = None) -> jax.Array:
    """(B, T - 1) float32 negative log-likelihood of each next token given the final hidden states h (B, T, d)
    of ``tokens`` (B, T); ``head_input_threshold`` as ``logits``' ``input_threshold``."""
    lg = logits(weights, h[:, :-1], cfg, head_input_threshold)
    return jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl", "attend"), donate_argnames=("cache",))
def prefill(
    weights: Weights,
    tokens: jax.Array,
    n_valid: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    ffn_impl: FfnImpl | None = None,
    ffn_state: Any = None,
    attend: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """Process a right-padded prompt (B, T_bucket) of which ``n_valid`` tokens are real.

    Padding positions are written to the cache but ``length`` ends at ``start + n_valid``,
    so decoding overwrites them and attention never sees them. Returns the logits (B, V)
    at the last real position. ``attend`` as in ``forward``.
    """
    start = cache.length
    h, cache, _ = forward(weights, tokens, cache, cfg, ffn_impl, ffn_state, attend, n_valid)
    last = jax.lax.dynamic_index_in_dim(h, n_valid - 1, axis=1, keepdims=False)
    cache = dataclasses.replace(cache, length=start + n_valid)
    return logits(weights, last, cfg, head_threshold(ffn_impl)), cache


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl", "attend"), donate_argnames=("cache",))
def decode_step(
    weights: Weights,
    token: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    ffn_impl: FfnImpl | None = None,
    ffn_state: Any = None,
    attend: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """One decoding step for tokens (B,); returns logits (B, V) and the advanced cache.
    ``attend`` as in ``forward`` (at least ``cache.length + 1``)."""
    h, cache, _ = forward(weights, token[:, None], cache, cfg, ffn_impl, ffn_state, attend)
    return logits(weights, h[:, 0], cfg, head_threshold(ffn_impl)), cache


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl"))
def score(
    weights: Weights,
    tokens: jax.Array,
    cfg: ModelConfig,
    ffn_impl: FfnImpl | None = None,
    ffn_state: Any = None,
) -> jax.Array:
    """Logits (B, T, V) for every position of full sequences (perplexity, parity tests)."""
    cache = KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, _, _ = forward(weights, tokens, cache, cfg, ffn_impl, ffn_state)
    return logits(weights, h, cfg, head_threshold(ffn_impl))
