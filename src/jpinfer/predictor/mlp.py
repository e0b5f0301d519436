"""The per-layer activation predictor: Linear(d_model -> rank) -> ReLU -> Linear(rank -> d_ff).

Trained as a Flax nnx module (``train.LayerPredictor``); used at run time as plain arrays
(``PredictorWeights``, this module: no Flax import, so the decode step does not pay for it)
stored (out_features, in_features) and applied with ``transformer.linear`` like every other
projection of the model, so the decode step needs no Flax and the predictor's matrices get the
layout measured fastest for matrix-vector products (docs/architecture.md, "Weight layout"). A
neuron is predicted active when its logit exceeds the layer's ``cutoff``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ExpertRouting
from jpinfer.models.quantized import quantize_matrix
from jpinfer.models.transformer import expert_weights, linear
from jpinfer.ops.threshold import select_over


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PredictorWeights:
    """One layer's predictor as arrays: ``w_in`` (rank, d_model), ``b_in`` (rank,), ``w_out``
    (d_ff, rank), ``b_out`` (d_ff,), and the logit ``cutoff`` (a float32 scalar)."""

    w_in: jax.Array
    b_in: jax.Array
    w_out: jax.Array
    b_out: jax.Array
    cutoff: jax.Array

    @property
    def rank(self) -> int:
        return int(self.w_in.shape[0])

    @property
    def n_params(self) -> int:
        """Parameters read per prediction (the cut-off is one more number, not counted)."""
        return int(self.w_in.size + self.b_in.size + self.w_out.size + self.b_out.size)

    @classmethod
    def from_module(cls, module, cutoff: float) -> "PredictorWeights":
        """Arrays of a trained ``train.LayerPredictor``; nnx kernels are (in, out), so they are
        transposed once here."""
        return cls(
            jnp.asarray(module.hidden.kernel[...].T), jnp.asarray(module.hidden.bias[...]),
            jnp.asarray(module.out.kernel[...].T), jnp.asarray(module.out.bias[...]), jnp.float32(cutoff),
        )

    def in_format(self, fmt: str) -> "PredictorWeights":
        """These weights with ``w_in`` and ``w_out`` in a model's weights format ("float": as they are; "int8",
        "int4": ``quantized.quantize_matrix``), so a quantized model's decode step reads its predictors at the
        bytes per weight of its own projections. Measured (2-core Zen 4 VM, 2026-12-05;
        bench/results/predictor_formats.md): the default model's float-pack predictors on 16 WikiText-2 windows,
        perplexity of the sparse mode's FFN 29.804 float / 29.804 int8 / 29.798 4-bit, true active neurons kept
        754.80 / 754.79 / 754.48 of 762.3 a token and layer; a 7B-shaped model's rank-256 predictors over 32
        layers, one token: float 21.1 ms (496 MB), int8 6.9 ms (127 MB), 4-bit 4.6 ms (79 MB)."""
        if fmt == "float":
            return self
        if fmt not in ("int8", "int4"):
            raise ValueError(f"a weights format is 'float', 'int8' or 'int4', got {fmt!r}")
        return dataclasses.replace(self, w_in=quantize_matrix(self.w_in, fmt), w_out=quantize_matrix(self.w_out, fmt))

    def arrays(self) -> dict[str, np.ndarray]:
        """Host copies by field name (for saving and comparing)."""
        return {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}


def predict_logits(p: PredictorWeights, x: jax.Array) -> jax.Array:
    """Logits (..., d_ff) for normalised FFN inputs x (..., d_model)."""
    return linear(jax.nn.relu(linear(x, p.w_in, p.b_in)), p.w_out, p.b_out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Selection:
    """The neurons to compute for each token, as a padded list of static capacity K.

    ids (..., K) int32, of which the first ``count`` are valid (the rest is padding);
    ``wanted`` counts the logits over the cut-off: ``wanted - count`` neurons were predicted
    active but clipped by the capacity.
    """

    ids: jax.Array
    count: jax.Array
    wanted: jax.Array


def _select_one(logits: jax.Array, cutoff: jax.Array, capacity: int) -> Selection:
    every_one, wanted = select_over(logits, cutoff, capacity)

    def largest() -> jax.Array:
        return jax.lax.top_k(logits, capacity)[1].astype(jnp.int32)

    ids = jax.lax.cond(wanted <= capacity, lambda: every_one, largest)
    return Selection(ids, jnp.minimum(wanted, capacity), wanted)


def select_neurons(logits: jax.Array, cutoff: jax.Array, capacity: int) -> Selection:
    """At most ``capacity`` neurons over ``cutoff``, per token (logits (..., n)).

    A static capacity keeps shapes static (one compiled step for every token) and bounds the
    work per token. When the neurons over the cut-off fit, they are all kept, in index order
    (a compaction, ``ops.threshold.select_over``: one native pass on the CPU; XLA's took 1.2 ms per token for 30 layers
    of 1536 neurons with K = 1472, against 3.6 ms for a top-k; scratch probe, 2026-12-01); when they do
    not, the K largest logits are kept (the most confident predictions).
    """
    if logits.ndim == 1:  # one token: the cond runs one branch (under vmap it would run both)
        return _select_one(logits, cutoff, capacity)
    flat = logits.reshape(-1, logits.shape[-1])
    chosen = jax.vmap(lambda row: _select_one(row, cutoff, capacity))(flat)
    lead = logits.shape[:-1]
    return Selection(chosen.ids.reshape(*lead, capacity), chosen.count.reshape(lead), chosen.wanted.reshape(lead))


def routed_logits(logits: jax.Array, router: jax.Array | None, x: jax.Array, rule: ExpertRouting | None) -> jax.Array:
    """With experts (``router`` (n_experts, d_model) not None), the logits (..., d_ff) of the neurons whose experts
    the router does not pick for x (..., d_model) set to -inf: those neurons compute zero, so a selection spends no
    capacity on them. Without experts the logits as they are."""
    if router is None:
        return logits
    weights = expert_weights(router, x, rule)
    return jnp.where(jnp.repeat(weights, logits.shape[-1] // router.shape[0], axis=-1) > 0, logits, -jnp.inf)


def selection_mask(selection: Selection, n: int) -> jax.Array:
    """Boolean (..., n): True at the selection's valid ids (a scatter: a one-hot would be K x n per token).

    Padding may repeat a valid id (the compaction pads with id 0), so the scatter ORs its
    updates (``max``): with ``set``, a padding entry written after the valid one would drop it.
    """
    k = selection.ids.shape[-1]
    ids = selection.ids.reshape(-1, k)
    valid = jnp.arange(k) < selection.count.reshape(-1, 1)
    mask = jnp.zeros((ids.shape[0], n), bool).at[jnp.arange(ids.shape[0])[:, None], ids].max(valid)
    return mask.reshape(*selection.ids.shape[:-1], n)
