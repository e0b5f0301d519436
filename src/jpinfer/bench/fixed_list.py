"""Decode with fixed neuron lists: what the accelerator's sparse FFN kernel gives a whole decoder.

Per layer a fixed random list of (1 - s) * d_ff neurons, the same for every token (no predictor:
this isolates the FFN kernel from prediction); the decoder's dense FFN matrices dropped, the FFN
kept neuron-major and computed by ``sparse_ffn`` (``backend="auto"``: the Pallas kernel on a GPU,
the native or chunked XLA loop on the CPU). A prompt computes every neuron. With s = 0 every
neuron is listed and the engine computes the dense model (the GPU suite's check).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer
from jpinfer.modes.engines import without_ffn
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.sparse import NeuronFFN, all_rows_ffn, from_layer, sparse_ffn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FixedList:
    """One layer's state: its FFN neuron-major and the neurons every token computes."""

    ffn: NeuronFFN
    ids: jax.Array


@dataclasses.dataclass(frozen=True)
class FixedListFFN:
    """Static ``ffn_impl``: a decode step computes the layer's fixed list; a prompt every neuron."""

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: FixedList) -> tuple[jax.Array, None]:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] > 1:
            return all_rows_ffn(state.ffn, tokens).reshape(x.shape), None
        return sparse_ffn(state.ffn, tokens[0], state.ids, state.ids.shape[0]).reshape(x.shape), None


def fixed_list_name(sparsity: float, k: int) -> str:
    """The engine's name in results: ``sparse s=S (K=K)`` (bench/modelled_speed.py parses it)."""
    return f"sparse s={sparsity:g} (K={k})"


def listed_count(d_ff: int, sparsity: float) -> int:
    """Neurons a fixed list holds at ``sparsity``: (1 - sparsity) * d_ff, at least one."""
    return max(1, round(d_ff * (1 - sparsity)))


def fixed_list_engine(model: LoadedModel, sparsity: float, seed: int) -> Engine:
    """An engine computing (1 - sparsity) * d_ff random neurons per layer (at least one), fixed for every token."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity}")
    cfg, rng = model.cfg, np.random.default_rng(seed)
    k = listed_count(cfg.d_ff, sparsity)
    states = [FixedList(from_layer(layer, cfg.ffn_kind, cfg.experts),
                        jnp.asarray(rng.permutation(cfg.d_ff)[:k].astype(np.int32)))
              for layer in model.weights.layers]
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    sparse = LoadedModel(cfg, weights, None, model.source)
    return Engine(sparse, FfnStrategy(FixedListFFN(), states, fixed_list_name(sparsity, k)))
