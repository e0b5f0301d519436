"""Causal grouped-query attention in float64 numpy, with a derived bound on a float32 kernel's error, for
the attention tests (the native kernel's, test_native_attention.py; XLA's blocked form,
test_attention_length.py).

Bound, per output element (derived, not measured; u = 2^-24): a score is a float32 dot product of hd terms
scaled once; summed with at most ``dot_terms`` additions in a row it is off by at most
ds = (dot_terms + 16) u sum_i |q_i k_i| / sqrt(hd) (the 16 for the products and the scaling). Shifting every
score of a query by at most ds moves each probability by a factor within e^(2 ds), and the exponential
adds a few u; the probabilities' sum and the weighted value sum (n terms in sequence) add n u of
sum_s p_s |v_s|, and whatever combines partial results (blocks, rescaled running sums) adds
``combine_terms`` u more. So |out - ref| <= (2.2 ds + (n + combine_terms) u) sum_s p_s |v_s|, with n the
query's visible slots. A soft cap c (scores made c tanh(s / c)) does not enlarge a score's error (the slope of
c tanh(s / c) is at most 1) and adds its own division, tanh (a few ulp) and product: 6 u c more in ds.
"""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24


def attention_reference(q, k, v, positions, window, *, dot_terms: float, combine_terms: float,
                        softcap: float | None = None):
    """(out float64 (B, T, H, hd), bound (B, T, H, hd)) for q (B, T, H, hd) at ``positions`` (T,) or (B, T) over
    caches k, v (B, KV, S, hd), scores soft-capped with ``softcap``; a query that sees no slot gets zeros
    (bound 0)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, hd = q.shape
    G = H // k.shape[1]
    out, bound = np.zeros(q.shape), np.zeros(q.shape)
    slots = np.arange(k.shape[2])
    positions = np.broadcast_to(np.asarray(positions), (B, T))
    for b in range(B):
        for t in range(T):
            visible = slots <= positions[b, t]
            if window:
                visible &= slots > positions[b, t] - window
            n = int(visible.sum())
            if n == 0:
                continue
            for h in range(H):
                keys, values = k[b, h // G][visible], v[b, h // G][visible]
                scores = keys @ q[b, t, h] / np.sqrt(hd)
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[b, t, h] = p @ values
                ds = (dot_terms + 16) * U * (np.abs(keys) @ np.abs(q[b, t, h])).max() / np.sqrt(hd)
                ds += 6 * U * (softcap or 0.0)
                bound[b, t, h] = (2.2 * ds + (n + combine_terms) * U) * (p @ np.abs(values))
    return out, bound
