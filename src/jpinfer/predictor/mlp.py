"""The per-layer activation predictor: Linear(d_model -> rank) -> ReLU -> Linear(rank -> d_ff).

Trained as a Flax nnx module (``train.LayerPredictor``); used at run time as plain arrays
(``PredictorWeights``, this module: no Flax import, so the decode step does not pay for it) stored (out_features, in_features) and applied with
``transformer.linear`` like every other projection of the model, so the decode step needs
no Flax and the predictor's matrices get the layout measured fastest for matrix-vector
products (docs/architecture.md, "Weight layout"). A neuron is predicted active when its
logit exceeds the layer's ``cutoff``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jpinfer.models.transformer import linear


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

    def arrays(self) -> dict[str, np.ndarray]:
        """Host copies by field name (for saving and comparing)."""
        return {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}


def predict_logits(p: PredictorWeights, x: jax.Array) -> jax.Array:
    """Logits (..., d_ff) for normalised FFN inputs x (..., d_model)."""
    return linear(jax.nn.relu(linear(x, p.w_in, p.b_in)), p.w_out, p.b_out)


def predict_active(p: PredictorWeights, x: jax.Array) -> jax.Array:
    """Boolean (..., d_ff): the neurons predicted active (logit over the cut-off)."""
    return predict_logits(p, x) > p.cutoff
