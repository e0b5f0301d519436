"""Offline profiler: neuron activity statistics, calibrated thresholds, predictor samples.

``profile(model, corpus, ProfileSettings(...), targets=SparsityTargets(...)) -> ActivationProfile`` is the
entry point (jpinfer.profile).
Modules: corpus (text -> token windows), activity (what "active" means), passes (batched
jitted passes), calibration (thresholds for a target sparsity), collect (the profiling
pass), stats (ActivationProfile and its file format), samples (predictor training
samples), sparsity (the threshold mode's thresholds).
"""

from jpinfer.profiler.calibration import (
    Calibration,
    ScoreHistogram,
    Sensitivity,
    calibrate,
    greedy,
    histograms,
    score_histogram,
    sensitivity,
    uniform,
)
from jpinfer.profiler.collect import ProfileSettings, profile
from jpinfer.profiler.corpus import Corpus, CorpusError, TokenWindows, token_windows
from jpinfer.profiler.samples import PredictorSamples, SamplesError
from jpinfer.profiler.sparsity import SparsityTargets, SparsityThresholds, calibrate_sparsity
from jpinfer.profiler.stats import ActivationProfile, ProfileError, ProfileMismatchError

__all__ = [
    "profile", "ProfileSettings", "SparsityTargets", "ActivationProfile", "ProfileError", "ProfileMismatchError",
    "Corpus", "CorpusError", "TokenWindows", "token_windows",
    "Calibration", "ScoreHistogram", "Sensitivity", "calibrate", "score_histogram", "uniform", "sensitivity", "greedy",
    "PredictorSamples", "SamplesError",
    "SparsityThresholds", "calibrate_sparsity", "histograms",
]
