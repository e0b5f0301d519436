"""A model's identity: one digest of its architecture and weights, and what differs when it does not match.

Profiles, predictors, calibration peaks and packs remember the fingerprint of the model they
were made for, and each refuses another model's (a ``...MismatchError``); profiles, predictors and
packs also record ``model_record`` (name, weights format, FFN kind, source, dtype), so that the
refusal (``mismatch_message``, one for all of them) says what differs and what to run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.models import quantized
from jpinfer.models.params import Weights

if TYPE_CHECKING:
    from jpinfer.models.loading import LoadedModel

_FINGERPRINTS: dict[int, tuple[weakref.ref, ModelConfig, str]] = {}  # id(weights) -> (weights, cfg, digest)


def model_fingerprint(cfg: ModelConfig, weights: Weights) -> str:
    """Hex digest of the architecture and the weights rounded to bfloat16.

    Rounding makes the fingerprint the same whether the model was loaded in float32 or
    bfloat16, so a profile made at one precision serves the other. Remembered per weights
    object (their arrays are immutable): loading a pack's engine checks the pack, the profile
    and the predictors against one model, 1.2 s each for the default model.
    """
    key = id(weights)
    known = _FINGERPRINTS.get(key)
    if known is not None and known[0]() is weights and known[1] == cfg:
        return known[2]
    digest = _fingerprint(cfg, weights)
    _FINGERPRINTS[key] = (weakref.ref(weights, lambda _: _FINGERPRINTS.pop(key, None)), cfg, digest)
    return digest


# ModelConfig fields added after packs were made, with their defaults
LATER_FIELDS = {"rope_scaling": None, "qk_norm": False, "window_layers": None, "attn_scale": None,
                "attn_softcap": None, "logit_softcap": None, "sandwich_norms": False, "embed_scale": 1.0,
                "local_rope_theta": None, "parallel_block": False, "n_experts": 0, "experts_per_token": 0,
                "qk_norm_whole": False, "renormalize_experts": True, "shared_experts": 0,
                "residual_scale": 1.0, "logit_divisor": 1.0}
LATER_SCALING_FIELDS = {"long_factors": ()}  # the same for config.RopeScaling's


def _fingerprint(cfg: ModelConfig, weights: Weights) -> str:
    h = hashlib.blake2b(digest_size=16)
    # fields that came later are left out at their defaults, so that earlier models keep their fingerprints
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name" and LATER_FIELDS.get(k, ...) != v}
    if arch.get("rope_scaling"):
        arch["rope_scaling"] = {k: v for k, v in arch["rope_scaling"].items() if LATER_SCALING_FIELDS.get(k, ...) != v}
    h.update(json.dumps(arch, sort_keys=True, default=list).encode())
    for leaf in jax.tree_util.tree_leaves(weights):
        h.update(str(leaf.shape).encode())
        h.update(np.asarray(jnp.asarray(leaf).astype(jnp.bfloat16)).view(np.uint16).tobytes())
    return h.hexdigest()


# What an artifact made for one model records beside the fingerprint, in the order a mismatch names them
# (the name first: another model; then what makes the same model's weights differ).
DESCRIBED = {"name": "model", "weights": "weights format", "ffn_kind": "FFN kind", "source": "source",
             "dtype": "dtype"}


def model_record(model: LoadedModel) -> dict[str, str]:
    """What an artifact made for ``model`` records about it besides its fingerprint (``DESCRIBED``), so
    that refusing it for another model can say what differs (``mismatch_message``)."""
    return {"name": model.cfg.name, "weights": quantized.weights_format(model.weights),
            "ffn_kind": model.cfg.ffn_kind, "source": str(model.source), "dtype": jnp.dtype(model.weights.dtype).name}


def mismatch_message(subject: str, recorded: dict[str, Any], recorded_fingerprint: str, model: LoadedModel,
                     command: str) -> str:
    """The one message of every "made for another model" refusal (profiles, predictors, packs).

    ``subject`` says what was made ("this profile was made"), ``recorded`` is its ``model_record`` (an older
    artifact may lack fields: those are not compared), ``command`` what makes one for ``model`` (its
    ``--model``, ``--weights`` and ``--dtype`` flags are added). What differs: the model name when it does,
    else the weights format, FFN kind, source and dtype that do. The fingerprint rounds weights to
    bfloat16, so a dtype alone never makes a mismatch; it is named only beside another difference."""
    given = model_record(model)
    fingerprint = model_fingerprint(model.cfg, model.weights)
    known = {k: str(recorded[k]) for k in DESCRIBED if recorded.get(k) is not None}
    if known.get("name", given["name"]) != given["name"]:
        differs = "another model"
    else:
        changed = [f"{DESCRIBED[k]} {known[k]} there, {given[k]} here" for k in DESCRIBED
                   if k != "name" and k in known and known[k] != given[k]]
        if changed and all(c.startswith("dtype") for c in changed):
            changed = []  # the fingerprint does not see the dtype: the weights themselves differ
        if changed:
            differs = "it differs in " + "; ".join(changed)
        elif {"name", "weights"} <= known.keys():
            differs = ("the same name and format with other weight values (another file, or int8 weights "
                       "calibrated on other text)")
        else:
            differs = "its record says no more of that model (made by an older jpinfer)"

    def who(record: dict[str, str], digest: str) -> str:
        fmt = f"{record['weights']} weights, " if "weights" in record else ""
        name = f"model {record['name']!r}" if "name" in record else "a model"
        return f"{name} ({fmt}fingerprint {digest[:12]})"

    flags = "".join(f" --{flag} {value}" for flag, value, plain in (
        ("model", given["source"], _default_source()), ("weights", given["weights"], "float"),
        ("dtype", given["dtype"], "float32")) if value != plain)
    return f"{subject} for {who(known, recorded_fingerprint)}, not for {who(given, fingerprint)}: {differs}: " \
           f"make one for this model ({command}{flags})"


def _default_source() -> str | None:
    """The default model's file (what a missing --model loads), or None when it is not installed."""
    from jpinfer.models.default_model import DefaultModelMissing, default_model_path

    try:
        return str(default_model_path())
    except DefaultModelMissing:
        return None
