"""Oracle-mask sparse FFN: the exact active set per token, run through the sparse op.

This proves the sparse path end to end before predictors exist: it computes every
neuron's activation densely (the oracle), keeps the active ones (ReLU kinds: non-zero;
SwiGLU: |silu(g) * u| above the layer's threshold), packs up to K of them by
magnitude into a padded id list and lets ``sparse_ffn`` compute the FFN output from
the neuron-major weights. With threshold -inf and K = d_ff it must equal the dense
decoder; with real thresholds it must equal the dense FFN with the same neurons masked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from jpinfer.sparse import neurons
from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Weights
from jpinfer.runtime.engine import FfnStrategy
from jpinfer.sparse.op import BACKENDS, sparse_ffn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OracleState:
    """Per-layer traced state: the neuron-major FFN and the activity threshold on |a|."""

    ffn: neurons.NeuronFFN
    threshold: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OracleAux:
    """Per layer, per token (flattened batch x time): the list used and the truly active count."""

    ids: jax.Array  # (M, K) int32, by decreasing |a|; entries >= count are padding
    count: jax.Array  # (M,) int32 valid entries
    n_active: jax.Array  # (M,) int32 neurons over the threshold (> count when K clipped)


def oracle_state(
    weights: Weights, cfg: ModelConfig, thresholds: float | Sequence[float] | None = None
) -> list[OracleState]:
    """Build the ``ffn_state`` list: neuron-major weights and a threshold per layer.

    The state holds a neuron-major copy of every FFN next to the dense weights (the
    oracle needs the dense ones for its activations), so FFN memory doubles: this mode
    proves exactness and makes masks, it is not a fast path.

    ``thresholds`` defaults to 0 for ReLU kinds (active = non-zero). SwiGLU activations
    are never exactly zero, so its thresholds must be given (calibrated values, or
    -inf to keep every neuron).
    """
    n = cfg.n_layers
    if thresholds is None:
        if cfg.ffn_kind == "swiglu":
            raise ValueError("SwiGLU needs per-layer thresholds on |silu(g)*u| (or -inf to keep every neuron)")
        thresholds = 0.0
    per_layer = [float(thresholds)] * n if isinstance(thresholds, (int, float)) else [float(t) for t in thresholds]
    if len(per_layer) != n:
        raise ValueError(f"got {len(per_layer)} thresholds for a model with {n} layers")
    if any(math.isnan(t) for t in per_layer):
        raise ValueError("thresholds must not be NaN")
    return [
        OracleState(neurons.from_layer(layer, cfg.ffn_kind), jnp.float32(t))
        for layer, t in zip(weights.layers, per_layer)
    ]


@dataclasses.dataclass(frozen=True)
class OracleFFN:
    """Static ``ffn_impl`` for ``transformer.forward``/``prefill``/``decode_step``.

    capacity: static list capacity K, one for all layers or one per layer (<= d_ff).
    """

    cfg: ModelConfig
    capacity: int | tuple[int, ...]
    backend: str = "auto"

    def __post_init__(self) -> None:
        caps = self.capacity if isinstance(self.capacity, tuple) else (self.capacity,) * self.cfg.n_layers
        if len(caps) != self.cfg.n_layers:
            raise ValueError(f"got {len(caps)} capacities for a model with {self.cfg.n_layers} layers")
        if any(not 1 <= k <= self.cfg.d_ff for k in caps):
            raise ValueError(f"capacities must lie in [1, d_ff={self.cfg.d_ff}], got {caps}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def layer_capacity(self, index: int) -> int:
        return self.capacity[index] if isinstance(self.capacity, tuple) else self.capacity

    def __call__(self, index: int, layer: Layer, x: jax.Array, state: OracleState) -> tuple[jax.Array, OracleAux]:
        tokens = x.reshape(-1, x.shape[-1])
        magnitude = jnp.abs(transformer.ffn_activations(layer, tokens, self.cfg).astype(jnp.float32))
        active = magnitude > state.threshold
        # Inactive neurons score -1 (magnitudes are >= 0), so top-k takes active ones first.
        _, ids = jax.lax.top_k(jnp.where(active, magnitude, -1.0), self.layer_capacity(index))
        n_active = active.sum(axis=-1, dtype=jnp.int32)
        count = jnp.minimum(n_active, ids.shape[-1])
        run = lambda xt, it, ct: sparse_ffn(state.ffn, xt, it, ct, backend=self.backend)
        y = jax.vmap(run)(tokens, ids.astype(jnp.int32), count)
        return y.reshape(x.shape), OracleAux(ids.astype(jnp.int32), count, n_active)


def oracle_strategy(
    model: LoadedModel,
    thresholds: float | Sequence[float] | None = None,
    capacity: int | tuple[int, ...] | None = None,
    backend: str = "auto",
) -> FfnStrategy:
    """The oracle as an engine FFN strategy: ``engine.with_ffn(oracle_strategy(engine.model))``.

    ``capacity`` defaults to d_ff (nothing is clipped).
    """
    impl = OracleFFN(model.cfg, model.cfg.d_ff if capacity is None else capacity, backend)
    return FfnStrategy(impl, oracle_state(model.weights, model.cfg, thresholds), name="oracle")
