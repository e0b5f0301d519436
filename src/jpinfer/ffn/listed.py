"""Listed strategies: per token and layer a list of at most K neurons, computed by the sparse op.

- ``OracleListFFN``: the exact active set (every activation computed densely, the active ones
  listed by magnitude): proves the sparse path end to end without a predictor. With threshold
  -inf and K = d_ff it equals the dense decoder; with real thresholds the dense FFN with the same
  neurons zeroed. Its state holds a neuron-major copy beside the dense weights (the oracle needs
  both), so it is a reference, not a fast path.
- ``PredictorListFFN``: the ``sparse`` mode's FFN. The predictor's logits over its cut-off pick at
  most K neurons (``select_neurons``) and the sparse op computes only those; the FFN is kept once,
  neuron-major. Several tokens at once (prefill) compute every neuron (``all_rows_ffn``): the union
  of what a prompt's tokens activate is nearly the whole layer (docs/architecture.md, "Engine
  modes"), so a list per token would only add work. One token of each of several sequences (batched
  decoding) reads every row once too, keeping each token's own selection (``all_rows_ffn``'s
  ``keep``), so a sequence's output is what it would be alone. With experts the selection is among
  the neurons of the experts the router picks (``routed_logits``: the others compute zero).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from jpinfer.activations import SMOOTH_KINDS
from jpinfer.config import ModelConfig
from jpinfer.errors import JpinferError
from jpinfer.ffn.capacity import per_layer
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Weights
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, routed_logits, select_neurons, selection_mask
from jpinfer.runtime.engine import FfnStrategy
from jpinfer.sparse import neurons
from jpinfer.sparse.op import BACKENDS, all_rows_ffn, sparse_ffn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OracleState:
    """Per-layer traced state of ``OracleListFFN``: the neuron-major FFN and the activity threshold on |a|."""

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
    """The ``ffn_state`` list of ``OracleListFFN``: neuron-major weights and a threshold per layer.

    ``thresholds`` defaults to 0 for ReLU kinds (active = non-zero). SwiGLU and GeGLU activations
    are never exactly zero, so their thresholds must be given (calibrated values, or
    -inf to keep every neuron).
    """
    n = cfg.n_layers
    if thresholds is None:
        if cfg.ffn_kind in SMOOTH_KINDS:
            raise JpinferError(f"{cfg.ffn_kind} needs per-layer thresholds on |act(g)*u| (or -inf to keep every "
                               "neuron)")
        thresholds = 0.0
    per_layer_thresholds = ([float(thresholds)] * n if isinstance(thresholds, (int, float))
                            else [float(t) for t in thresholds])
    if len(per_layer_thresholds) != n:
        raise JpinferError(f"got {len(per_layer_thresholds)} thresholds for a model with {n} layers")
    if any(math.isnan(t) for t in per_layer_thresholds):
        raise JpinferError("thresholds must not be NaN")
    return [OracleState(neurons.from_layer(layer, cfg.ffn_kind, cfg.experts), jnp.float32(t))
            for layer, t in zip(weights.layers, per_layer_thresholds)]


@dataclasses.dataclass(frozen=True)
class _ListedFFN:
    """What every listed strategy is given: at most ``capacity[layer]`` neurons per token (an int: the
    same for every layer; checked by ``capacity.per_layer``) through the sparse op's ``backend``."""

    cfg: ModelConfig
    capacity: tuple[int, ...]
    backend: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", per_layer(self.capacity, self.cfg))
        if self.backend not in BACKENDS:
            raise JpinferError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclasses.dataclass(frozen=True)
class OracleListFFN(_ListedFFN):
    """Static ``ffn_impl``: the exact active set, at most ``capacity[layer]`` of it by magnitude,
    through the sparse op. Aux per token: ``OracleAux``."""

    def __call__(self, index: int, layer: Layer, x: jax.Array, state: OracleState) -> tuple[jax.Array, OracleAux]:
        tokens = x.reshape(-1, x.shape[-1])
        magnitude = jnp.abs(transformer.ffn_activations(layer, tokens, self.cfg).astype(jnp.float32))
        active = magnitude > state.threshold
        # Inactive neurons score -1 (magnitudes are >= 0), so top-k takes active ones first.
        _, ids = jax.lax.top_k(jnp.where(active, magnitude, -1.0), self.capacity[index])
        n_active = active.sum(axis=-1, dtype=jnp.int32)
        count = jnp.minimum(n_active, ids.shape[-1])
        run = lambda xt, it, ct: sparse_ffn(state.ffn, xt, it, ct, backend=self.backend)
        y = jax.vmap(run)(tokens, ids.astype(jnp.int32), count)
        return y.reshape(x.shape), OracleAux(ids.astype(jnp.int32), count, n_active)


def oracle_strategy(
    model: LoadedModel,
    thresholds: float | Sequence[float] | None = None,
    capacity: int | Sequence[int] | None = None,
    backend: str = "auto",
) -> FfnStrategy:
    """The oracle as an engine FFN strategy: ``engine.with_ffn(oracle_strategy(engine.model))``.

    ``capacity`` defaults to d_ff (nothing is clipped).
    """
    impl = OracleListFFN(model.cfg, model.cfg.d_ff if capacity is None else capacity, backend)
    return FfnStrategy(impl, oracle_state(model.weights, model.cfg, thresholds), name="oracle")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PredictorListState:
    """One layer's traced state of ``PredictorListFFN``: its FFN neuron-major and its predictor."""

    ffn: neurons.NeuronFFN
    predictor: PredictorWeights


@dataclasses.dataclass(frozen=True)
class PredictorListFFN(_ListedFFN):
    """Static ``ffn_impl``: predictor -> at most ``capacity[layer]`` neurons -> sparse op.

    Output only (aux None): the engine discards it; ``masked.PredictorMaskFFN`` with the
    same capacities computes the same values densely and counts what was clipped.
    """

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: PredictorListState) -> tuple[jax.Array, None]:
        tokens = x.reshape(-1, x.shape[-1])
        if x.ndim > 1 and x.shape[-2] > 1:  # a prompt's positions
            return all_rows_ffn(state.ffn, tokens).reshape(x.shape), None
        # one token: its list (a 1-D selection runs one branch of its cond); one token per sequence of a
        # batch: each with its own neurons
        x_sel = tokens[0] if tokens.shape[0] == 1 else tokens
        logits = routed_logits(predict_logits(state.predictor, x_sel), state.ffn.router, x_sel,
                               state.ffn.routing_rule)
        chosen = select_neurons(logits, state.predictor.cutoff, self.capacity[i])
        if tokens.shape[0] > 1:
            keep = selection_mask(chosen, state.ffn.n_neurons)
            return all_rows_ffn(state.ffn, tokens, keep).reshape(x.shape), None
        return sparse_ffn(state.ffn, tokens[0], chosen.ids, chosen.count, backend=self.backend).reshape(x.shape), None
