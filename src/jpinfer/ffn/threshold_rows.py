"""The ``threshold`` mode's FFN: training-free activation and input sparsity (no predictor).

Per layer the state (``ThresholdLayer``) is the FFN laid out for threshold sparsity
(``sparse.ThresholdLayout``: the decoder's FFN matrices are replaced, not copied), with the layer's
calibrated thresholds, and, where model-wide sparsity is on, the attention's q|k|v and output
products laid out for input sparsity (``sparse.ThresholdProjection``, through the decoder's
``project`` seam). One token reads only the kept rows; several (prefill) run dense products with
the same entries zeroed. Aux, per token: FFN input dimensions and neurons kept.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jpinfer.errors import JpinferError
from jpinfer.models import transformer
from jpinfer.models.params import Layer
from jpinfer.sparse import ROWS_BACKENDS, ThresholdLayout, ThresholdProjection, threshold_ffn, threshold_projection


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ThresholdLayer:
    """A layer's threshold-mode state: its FFN, and its attention's "qkv" and "o" products read by input
    rows (None: that product dense, from the decoder's matrix)."""

    ffn: ThresholdLayout
    qkv: ThresholdProjection | None = None
    o: ThresholdProjection | None = None


@dataclasses.dataclass(frozen=True)
class ThresholdRowsFFN:
    """Static ``ffn_impl``: the layer's ``ThresholdLayer`` state applied to x (and to the attention's
    products, ``project``); ``head_threshold``: the head skips its inputs of magnitude at most it (None: dense
    head; ``transformer.logits``). Static, as one value serves the whole model: a new one compiles anew."""

    backend: str = "auto"
    head_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in ROWS_BACKENDS:
            raise JpinferError(f"backend must be one of {ROWS_BACKENDS}, got {self.backend!r}")
        if self.head_threshold is not None and not (math.isfinite(self.head_threshold) and self.head_threshold >= 0):
            raise JpinferError(f"head_threshold must be a finite number >= 0 (or None: dense head), "
                               f"got {self.head_threshold!r}")

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: ThresholdLayer) -> tuple[jax.Array, dict]:
        return threshold_ffn(state.ffn, x, backend=self.backend)

    def project(self, i: int, layer: Layer, name: str, x: jax.Array, state: ThresholdLayer) -> jax.Array:
        """The attention's ``name`` product ("qkv" or "o") of x: its kept input rows, or dense."""
        return threshold_projections(layer, state.qkv, state.o, self.backend)(name, x)


def threshold_projections(layer: Layer, qkv: ThresholdProjection | None, o: ThresholdProjection | None,
                          backend: str = "auto") -> transformer.Projection:
    """The layer's attention products (``transformer.attention_block``'s ``project``): by their kept input rows
    where ``qkv`` / ``o`` are given, else the decoder's dense products."""
    chosen = {"qkv": qkv, "o": o}

    def project(name: str, x: jax.Array) -> jax.Array:
        proj = chosen[name]
        if proj is None:
            return transformer.dense_projection(layer, name, x)
        return threshold_projection(proj, x, backend=backend)[0]

    return project
