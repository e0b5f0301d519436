"""Cached attention: the grouped-query attention of new queries over a layer's KV cache, and its forms.

``cached_attention`` is the product the decoder calls; it picks (``ops.table``, product "attention") per lowering
platform between the native kernels on the CPU (a decode step's ``native.kernels.cached_attention``, a long
prompt's tiled ``native.kernels.prefill_attention`` with ``blocked_attention``'s derivatives) and the XLA forms,
which run everywhere and are the native kernels' reference: one softmax over the first ``attend`` slots
(``xla_cached_attention``) up to ``ONE_SOFTMAX_TOKENS`` tokens, ``blocked_attention`` past them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.native import kernels as native_kernels
from jpinfer.native import native_available
from jpinfer.ops.table import dispatch, pick

# Steps of more than ONE_SOFTMAX_TOKENS tokens run blocked_attention (QUERY_BLOCK queries, KEY_BLOCK keys a
# block), or its native form on the CPU (``cached_attention``). Up to 512 (the perplexity, profiling and
# SmoothQuant calibration windows) the one softmax stays: those results, and what the cache keeps of them
# (channel peaks, profiles), stay bit for bit what they were (the blocked form sums in another order, and a
# rounding-level change in the int8 migration flipped a greedy answer of the int8 threshold mode); at 512
# tokens the blocks saved only ~10%.
ONE_SOFTMAX_TOKENS = 512
QUERY_BLOCK = 256
KEY_BLOCK = 512


def cached_attention(
    q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array, cfg: ModelConfig,
    attend: int | None = None, *, window: int | None,
) -> jax.Array:
    """Causal grouped-query attention of the queries q (B, T, H, hd) at ``positions`` (T,), or (B, T) one
    row per sequence, over a layer's cache (B, KV, S, hd) that already holds their keys and values:
    (B, T, H, hd), float32 sums. Each query sees the keys of the last ``window`` positions (the layer's
    ``ModelConfig.layer_window``; None: all).

    On the CPU, for decode-sized steps (T <= 8, float32, head_dim a multiple of 8) with the native
    kernels: one call that reads the cache in place up to the last position (``native.kernels.
    cached_attention``, soft cap included); for prompts of more than ``ONE_SOFTMAX_TOKENS`` tokens at one
    position row (float32, head_dim a multiple of 16) the native tiled kernel (``native.kernels.
    prefill_attention``, ``blocked_attention``'s derivatives). XLA otherwise: it reads the
    first ``attend`` slots (static; None = all), which must hold every position so far. XLA:CPU copied
    those slots before its products, which with the softmax cost 1.4 of the default model's 8.7 ms int8
    decode step (docs/architecture.md).
    """
    xla = functools.partial(xla_cached_attention, cfg=cfg, attend=attend, window=window)
    native = None
    if native_kernels.cached_attention_fits(q, cache_k, cache_v) and native_available():
        native = functools.partial(native_kernels.cached_attention, window=window, softcap=cfg.attn_softcap)
    elif (q.shape[1] > ONE_SOFTMAX_TOKENS and positions.ndim == 1
          and native_kernels.prefill_attention_fits(q, cache_k, cache_v) and native_available()):
        native = functools.partial(_native_prefill_attention, cfg, window)
    choice = lambda p: pick("attention", "float", p, native=native is not None)
    return dispatch(choice, {"native": native, "xla": xla}, q, cache_k, cache_v, positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _native_prefill_attention(cfg: ModelConfig, window: int | None, q: jax.Array, cache_k: jax.Array,
                              cache_v: jax.Array, positions: jax.Array) -> jax.Array:
    """``native.kernels.prefill_attention`` (the attention of prompts longer than ``ONE_SOFTMAX_TOKENS`` on the
    CPU: 2.1-3.8x faster than ``blocked_attention`` at 600-4096 tokens of the default model's heads, 2-core
    Intel Xeon VM, 2026-12-06, bench/results/machines/xeon/prefill_attention.md) with the derivatives of
    ``blocked_attention``, the same function (the threshold calibration differentiates through long windows)."""
    return native_kernels.prefill_attention(q, cache_k, cache_v, positions, window=window, softcap=cfg.attn_softcap)


def _native_prefill_forward(cfg, window, q, cache_k, cache_v, positions):
    return _native_prefill_attention(cfg, window, q, cache_k, cache_v, positions), (q, cache_k, cache_v, positions)


def _native_prefill_backward(cfg, window, operands, grad):
    q, cache_k, cache_v, positions = operands
    xla = lambda q, k, v: blocked_attention(q, k, v, positions, cfg, window=window)
    return (*jax.vjp(xla, q, cache_k, cache_v)[1](grad), None)


_native_prefill_attention.defvjp(_native_prefill_forward, _native_prefill_backward)


def xla_cached_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array, *,
                         cfg: ModelConfig, attend: int | None, window: int | None) -> jax.Array:
    """``cached_attention`` in XLA on any platform and for any T and dtype (bench/native_kernels.py times it
    against the native kernel). Up to ``ONE_SOFTMAX_TOKENS`` tokens: one softmax over the first ``attend``
    slots; longer prompts: ``blocked_attention``."""
    keys, values = cache_k[:, :, :attend], cache_v[:, :, :attend]
    if q.shape[1] > ONE_SOFTMAX_TOKENS:
        if positions.ndim != 1:
            raise ValueError("steps of more than ONE_SOFTMAX_TOKENS tokens take one position row (a prefill)")
        return blocked_attention(q, keys, values, positions, cfg, window=window)
    return _one_softmax_attention(q, keys, values, positions, cfg, window)


def _one_softmax_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array,
                           cfg: ModelConfig, window: int | None) -> jax.Array:
    b, t = q.shape[:2]
    groups = cfg.n_heads // cfg.n_kv_heads
    qg = q.reshape(b, t, cfg.n_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = softcap(scores * (cfg.head_dim**-0.5), cfg.attn_softcap)
    visible = _visible(jnp.arange(keys.shape[2]), positions, window)  # (T, S) or (B, T, S)
    scores = jnp.where(visible[None, None, None] if visible.ndim == 2 else visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bksh->btkgh", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, cfg.n_heads, cfg.head_dim)


def _visible(key_positions: jax.Array, positions: jax.Array, window: int | None) -> jax.Array:
    """(..., T, S) for positions (..., T): which keys each query sees (causal, and within the sliding window)."""
    visible = key_positions <= positions[..., None]
    if window is not None:
        visible &= key_positions > positions[..., None] - window
    return visible


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): Gemma 2's soft bound on attention scores and logits (None: x unchanged)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def blocked_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array,
                      cfg: ModelConfig, *, window: int | None) -> jax.Array:
    """``xla_cached_attention`` for long prompts: blocks of ``QUERY_BLOCK`` queries, each over blocks of
    ``KEY_BLOCK`` keys with a running max and sum (the softmax of Milakov and Gimelshein, 2018), visiting
    only the key blocks its positions can see. One softmax over all T x S scores held (T, S) floats per
    head in memory and computed the masked upper triangle: a 1024-token prefill of the default model took
    2.3-2.5 s, 4096 tokens 44 s (2-core EPYC, 2026-12-03); bench/results/long_context.md has the blocked
    figures. Loops, not unrolled blocks: unrolling 16 query blocks a layer took 9 s to compile at 1024
    tokens and 55 s at 4096. Equal to the one-softmax form within float32 rounding (another sum order)."""
    b, t, n_heads, hd = q.shape
    kv, slots = keys.shape[1], keys.shape[2]
    groups = n_heads // kv
    kb = min(KEY_BLOCK, slots)
    nq = -(-t // QUERY_BLOCK)
    pad = nq * QUERY_BLOCK - t
    # padded queries repeat the last position (their outputs are dropped)
    pos = jnp.concatenate([positions, jnp.broadcast_to(positions[-1], (pad,))]).reshape(nq, QUERY_BLOCK)
    # (nq, b, kv, g * Q, hd): a kv head's queries of a block are one matrix against each key block
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nq, QUERY_BLOCK, kv, groups, hd)
    qb = qb.transpose(1, 0, 3, 4, 2, 5).reshape(nq, b, kv, groups * QUERY_BLOCK, hd) * jnp.asarray(hd**-0.5, q.dtype)

    def query_block(args):
        qi, pi = args  # (b, kv, g * Q, hd), (Q,)
        first = 0 if window is None else jnp.maximum(pi[0] - window + 1, 0) // kb
        last = pi[-1] // kb + 1  # key blocks [first, last) hold every key these queries see

        def key_block(j, carry):
            return jax.lax.cond((j >= first) & (j < last), add_key_block, lambda j, carry: carry, j, carry)

        def add_key_block(j, carry):
            m, denom, acc = carry
            start = jnp.minimum(j * kb, slots - kb)  # a last block past the cache overlaps the one before:
            k = jax.lax.dynamic_slice_in_dim(keys, start, kb, axis=2)  # its keys before j * kb are masked
            v = jax.lax.dynamic_slice_in_dim(values, start, kb, axis=2)
            key_pos = start + jnp.arange(kb)
            visible = _visible(key_pos, pi, window) & (key_pos >= j * kb)[None, :]  # (Q, K)
            scores = softcap(jnp.einsum("bkqh,bksh->bkqs", qi, k, preferred_element_type=jnp.float32),
                              cfg.attn_softcap)
            scores = jnp.where(jnp.tile(visible, (groups, 1))[None, None], scores, -jnp.inf)
            m_new = jnp.maximum(m, scores.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen nothing yet
            p = jnp.exp(scores - safe[..., None])
            rescale = jnp.exp(m - safe)
            acc = acc * rescale[..., None] + jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), v,
                                                        preferred_element_type=jnp.float32)
            return m_new, denom * rescale + p.sum(-1), acc

        shape = (b, kv, groups * QUERY_BLOCK)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, hd), jnp.float32))
        # a static count (a scan: reverse-mode derivatives work, and the calibration's over long windows run here);
        # the cond skips the key blocks no query of this block sees
        _, denom, acc = jax.lax.fori_loop(0, -(-slots // kb), key_block, init)
        return acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # a query that sees nothing: zeros

    out = jax.lax.map(query_block, (qb, pos)).reshape(nq, b, kv, groups, QUERY_BLOCK, hd)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * QUERY_BLOCK, n_heads, hd)
    return out[:, :t]

