"""The ``threshold`` mode's FFN: training-free activation and input sparsity (no predictor).

Per layer the state is the FFN laid out for threshold sparsity (``sparse.ThresholdLayout``: the
decoder's FFN matrices are replaced, not copied), with the layer's calibrated thresholds. One
token reads only the kept rows; several (prefill) run dense products with the same entries
zeroed (``sparse.threshold_ffn``). Aux, per token: FFN input dimensions and neurons kept.
"""

from __future__ import annotations

import dataclasses

import jax

from jpinfer.errors import JpinferError
from jpinfer.models.params import Layer
from jpinfer.sparse import ROWS_BACKENDS, ThresholdLayout, threshold_ffn


@dataclasses.dataclass(frozen=True)
class ThresholdRowsFFN:
    """Static ``ffn_impl``: the layer's ``ThresholdLayout`` state applied to x."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ROWS_BACKENDS:
            raise JpinferError(f"backend must be one of {ROWS_BACKENDS}, got {self.backend!r}")

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: ThresholdLayout) -> tuple[jax.Array, dict]:
        return threshold_ffn(state, x, backend=self.backend)
