"""Decoder FFN strategies: every way jpinfer computes a layer's FFN, in one place.

A strategy is a static, hashable ``ffn_impl`` (part of the compiled step) with a traced per-layer
state, handed to the decoder as a ``runtime.FfnStrategy`` (the dense FFN is ``ffn_impl`` None).
Named by what each computes:

- ``listed``: a list of at most K neurons per token through the sparse op. ``PredictorListFFN``
  (the ``sparse`` mode: the predictor picks the list), ``OracleListFFN`` (the exact active set: a
  reference for the sparse path, ``oracle_strategy``).
- ``threshold_rows``: ``ThresholdRowsFFN`` (the ``threshold`` mode: only the rows whose input or
  activation passes a calibrated threshold are read; no lists, nothing clipped).
- ``masked``: the dense FFN with neurons zeroed, at dense speed, to measure accuracy:
  ``ScoreMaskFFN`` (activity score over a threshold: the oracle), ``PredictorMaskFFN`` (the
  predictor's picks, within capacities: the predictor modes' decode step over whole windows).
- ``capacity``: the one validated capacity type (one K per layer) and how K is derived.
- ``perplexity``: ``evaluate`` (a model's perplexity with any strategy) and ``perplexity`` (dense,
  or oracle-sparse at given thresholds).

The hybrid mode's two-device step (``modes.hybrid``) applies the same layouts per part.
"""

from jpinfer.ffn.capacity import BLOCK, Capacity, layer_capacities, part_capacities, per_layer, whole_blocks
from jpinfer.ffn.listed import (
    OracleAux,
    OracleListFFN,
    OracleState,
    PredictorListFFN,
    PredictorListState,
    oracle_state,
    oracle_strategy,
)
from jpinfer.ffn.masked import MaskState, PredictorMaskFFN, ScoreMaskFFN, mask_states
from jpinfer.ffn.perplexity import evaluate, perplexity
from jpinfer.ffn.threshold_rows import ThresholdLayer, ThresholdRowsFFN, threshold_projections

__all__ = [
    "BLOCK", "Capacity", "layer_capacities", "part_capacities", "per_layer", "whole_blocks",
    "OracleAux", "OracleListFFN", "OracleState", "PredictorListFFN", "PredictorListState", "oracle_state",
    "oracle_strategy", "MaskState", "PredictorMaskFFN", "ScoreMaskFFN", "mask_states", "evaluate", "perplexity",
    "ThresholdLayer",
    "ThresholdRowsFFN",
    "threshold_projections",
]
