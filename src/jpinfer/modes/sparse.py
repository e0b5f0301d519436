"""The sparse FFN of the `sparse` mode: the predictor picks the neurons, the sparse op computes them.

Per layer the state holds the FFN neuron-major (``NeuronFFN``: the model's dense FFN
matrices are not kept beside it, so memory does not grow) and the layer's predictor. A
decode step (one token) computes the predictor's logits, keeps at most K neurons over the
cut-off (``select_neurons``: static capacity K per layer) and runs ``sparse_ffn`` over that
list. Several tokens at once (prefill) compute every neuron (``all_rows_ffn``): the union of
the neurons a prompt's tokens activate is nearly the whole layer (docs/architecture.md,
"Engine modes"), so a list per token would only add work.
"""

from __future__ import annotations

import dataclasses

import jax

from jpinfer.config import ModelConfig
from jpinfer.models.params import Layer
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, select_neurons
from jpinfer.sparse import NeuronFFN, all_rows_ffn, sparse_ffn
from jpinfer.sparse.op import BACKENDS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SparseLayer:
    """One layer's traced state: its FFN neuron-major and its predictor."""

    ffn: NeuronFFN
    predictor: PredictorWeights


@dataclasses.dataclass(frozen=True)
class PredictedSparseFFN:
    """Static ``ffn_impl``: predictor -> at most ``capacity[layer]`` neurons -> sparse op.

    Output only (aux None): the engine discards it; ``predictor.PredictedMaskFFN`` with the
    same capacities computes the same values densely and counts what was clipped.
    """

    cfg: ModelConfig
    capacity: tuple[int, ...]
    backend: str = "auto"

    def __post_init__(self) -> None:
        if len(self.capacity) != self.cfg.n_layers:
            raise ValueError(f"got {len(self.capacity)} capacities for a model with {self.cfg.n_layers} layers")
        if any(not 1 <= k <= self.cfg.d_ff for k in self.capacity):
            raise ValueError(f"capacities must lie in [1, d_ff={self.cfg.d_ff}], got {self.capacity}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: SparseLayer) -> tuple[jax.Array, None]:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] > 1:
            return all_rows_ffn(state.ffn, tokens).reshape(x.shape), None
        chosen = select_neurons(predict_logits(state.predictor, tokens[0]), state.predictor.cutoff, self.capacity[i])
        return sparse_ffn(state.ffn, tokens[0], chosen.ids, chosen.count, backend=self.backend).reshape(x.shape), None
