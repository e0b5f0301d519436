"""The public entry points ``load`` and ``generate`` (re-exported by ``jpinfer``).

``load`` is a lookup and a build: the mode object (``modes.get_mode``) checks its arguments before
the model loads, takes what is not given from a pack, and builds its engine.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import jax

from jpinfer.models.loading import LoadedModel, int4_model, load_model, parse_dtype
from jpinfer.modes import ModeInputs, get_mode
from jpinfer.profiler import ActivationProfile
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import GenerationConfig, GenerationResult

_engines: dict[str, Engine] = {}


def load(
    source: str | pathlib.Path | None = None,
    *,
    dtype: Any = "float32",
    ffn_kind: str | None = None,
    mode: str = "dense",
    pack: Any = None,
    predictors: Any = None,
    profile: ActivationProfile | str | pathlib.Path | None = None,
    capacity: str | float | int | Sequence[int] = "predicted",
    gpu_budget: str | int | float | None = None,
    placement: Any = None,
    thresholds: Any = None,
    weights: str = "float",
) -> Engine:
    """Load a checkpoint (HF directory, .gguf file, or None for the default model) as an Engine.

    ``mode``: ``"dense"`` (default), ``"sparse"`` (the predictor picks each token's neurons, one
    device) or ``"hybrid"`` (hot neurons on the accelerator, cold on the CPU; without a GPU two
    simulated CPU devices). Sparse modes need ``predictors`` (a ``Predictors`` or its directory).
    ``capacity``, the most neurons a token computes per layer: "predicted" (the 0.99 quantile
    of what the predictors pick on held-out samples), a float quantile of the ``profile``'s
    active counts, an int, or one int per layer. ``hybrid`` needs the ``profile`` (an
    ``ActivationProfile`` or its file) and ``gpu_budget`` ("6GB", "512MiB", bytes, or a
    fraction of the model's weights; the solver places the neurons), or a ``placement`` (a
    ``solver.Placement`` or one boolean mask per layer, True = accelerator). ``"threshold"``
    (training-free: small activations and FFN inputs skipped, and the attention products' small inputs
    where the thresholds have them: model-wide sparsity) needs ``thresholds`` (a
    ``profiler.SparsityThresholds``) or a ``profile`` carrying them; ``"hybrid"`` given
    ``thresholds`` (or ``"profile"``: the profile's) instead of predictors splits that mode over
    the accelerator and the CPU.

    ``pack`` (a directory made by ``jpinfer prepare``, or a ``pack.Pack``) supplies the profile,
    predictors, placement and thresholds a mode needs where they are not given (``dense`` ignores
    it). For the default model (``source`` None) the other modes use its default pack when none of
    ``pack``, ``predictors``, ``profile`` and ``placement`` is given (and ``thresholds`` is None or
    "profile"): the pack of the model in the ``weights`` format asked for, prepared into the cache on
    first use (about five minutes on two CPU cores), reused after.

    ``weights``: ``"float"`` (every tensor in ``dtype``), ``"int8"`` (W8A8: the projections and
    the head quantized at load, one scale per output, after SmoothQuant's migration calibrated on a
    few thousand tokens of bundled text, ``profiler.smoothing``; modes ``dense``, ``threshold`` and
    ``sparse``, whose profile and predictors must be made on the int8 model itself) or
    ``"int4"`` (W4A8: the projections in llama.cpp's 4-bit blocks of 32, a GGUF's own Q4_0 / Q4_1 blocks
    where it has them, else Q4_1 quantized at load; the head int8; modes ``dense``, ``sparse`` (its 4-bit
    gate/up rows read in place, its down columns int8 copies) and ``threshold`` (int8 copies of the 4-bit FFN
    matrices it reads by input rows): 4-bit blocks run along the input and cannot be read by input rows or
    cut into neuron columns). On the CPU the
    quantized products of a decode step run as native kernels (``jpinfer.native``).
    """
    chosen = get_mode(mode, thresholds=thresholds, weights=weights)  # before anything loads: fail fast
    inputs = ModeInputs(predictors, profile, placement, gpu_budget, thresholds, capacity)
    default_pack = chosen.uses_pack and pack is None and source is None and inputs.names_no_artifact()
    if chosen.uses_pack and pack is not None:
        from jpinfer.pack import Pack

        pack = pack if isinstance(pack, Pack) else Pack.load(pack)  # verified before the model loads
        inputs = chosen.from_pack(pack, parse_dtype(dtype), inputs)
    if not default_pack:  # before the model loads: fail fast
        chosen.check(inputs)
    if chosen.two_devices:  # load on the host: the accelerator receives only its share
        from jpinfer.modes.devices import default_devices

        with jax.default_device(default_devices()[1]):
            model = _load_model(source, dtype, ffn_kind, weights)
    else:
        model = _load_model(source, dtype, ffn_kind, weights)
    if default_pack:
        from jpinfer.pack import default_pack as cached_pack

        pack = cached_pack(model)
        inputs = chosen.from_pack(pack, parse_dtype(dtype), inputs)
        chosen.check(inputs)
    elif chosen.uses_pack and pack is not None:
        pack.check_model(model)
    return chosen.build(model, inputs)


def _load_model(source: Any, dtype: Any, ffn_kind: str | None, weights: str) -> LoadedModel:
    model = load_model(source, dtype=dtype, ffn_kind=ffn_kind)
    if weights == "int8":
        from jpinfer.profiler.smoothing import int8_model

        model = int8_model(model, progress=True)
    elif weights == "int4":
        model = int4_model(model)
    return model


def generate(
    prompt: str | Sequence[int] | Sequence[str],
    model: str | pathlib.Path | Engine | None = None,
    **kwargs: Any,
) -> GenerationResult | list[GenerationResult]:
    """Generate text. ``model`` is an Engine, a checkpoint path, or None for the default model
    (loaded once and reused). Keyword arguments are GenerationConfig fields."""
    config = GenerationConfig(**kwargs)
    if isinstance(model, Engine):
        engine = model
    else:
        key = str(model)
        if key not in _engines:
            _engines[key] = load(model)
        engine = _engines[key]
    return engine.generate(prompt, config)
