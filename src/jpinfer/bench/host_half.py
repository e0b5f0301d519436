"""The hybrid's cold half alone on the CPU: what a decode token costs the host at a GPU budget, per weights format.

The hybrid mode (``modes.hybrid``) keeps each layer's hot neurons on the accelerator and computes the others on
the host: per layer and token, ``sparse_ffn`` over the cold part (a ``NeuronFFN.subset`` of the layer, on the CPU
device, the native kernels) with the list of its predicted neurons, called directly on the part's host arrays
(``cold_direct``) or as a jitted call (``cold_call``). This module makes that cold half for a model's
shapes without a model or an accelerator, so the host's share of a token is measured on every machine and only the
accelerator's needs a GPU (``bench/hybrid_host.py`` times it):

- weights: random, one FFN-only ``Layer`` per measured layer (``random_ffn_layer``) in a weights format: "float"
  (float32 on the host, what the hybrid casts a float model's cold part to), "int8" (int8 rows with a scale each:
  ``NeuronFFN`` int8 bundles) or "int4" (Q4_0 blocks: the layout's 4-bit gate/up records and int8 down slots,
  ``sparse.neurons``). Speed depends on the bytes and which rows are read, not on the values;
- activity: the planted bench's (``bench.planted``: per layer a power law at PowerInfer's skew, ``N_SETS`` active
  sets of K neurons drawn from it); token t reads set t of each layer;
- placement: the accelerator's bytes are the model's in the format (``solver.model_sizes``; "float" as a bfloat16
  model, the accelerator's float form, its KV cache bfloat16 too); at a budget, a fraction of the model's weights'
  bytes, the solver (``solve_placement``, the hybrid's "mass" objective, strict dense policy, as
  ``modes.placement.choose_placement`` runs it) places the non-FFN part first, then the neurons carrying most
  activations (the planted frequencies: an exact profile). A budget below the non-FFN part places no neuron: the
  hybrid then computes every active neuron on the host;
- cold lists: per layer and token, the planted set minus the hot neurons, as positions in the cold part (which
  holds the cold neurons in id order, as ``modes.engines.hybrid_engine`` makes it), padded to the layer's largest
  count over the tokens with the count traced, as the hybrid's static capacity does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.planted import listed_bytes, planted_frequencies, planted_neuron_sets
from jpinfer.config import ModelConfig
from jpinfer.models.params import Layer, Weights
from jpinfer.models.quantized import bytes_per_weight
from jpinfer.ordering import after
from jpinfer.quant.int8 import QMAX, Int8Matrix
from jpinfer.quant.q4 import QK, Q4Matrix
from jpinfer.solver import InfeasibleBudgetError, ModelSizes, model_sizes, preset, solve_placement
from jpinfer.sparse import NeuronFFN, from_layer, host_sparse_ffn, sparse_ffn

FORMATS = ("float", "int8", "int4")
ACCELERATOR_FLOAT = jnp.bfloat16  # the float model's dtype on the accelerator (the GPU suite's), and its KV cache's
# Q4_0 block scales: powers of two 2^-9..2^-8, so a weight d (q - 8) has a standard deviation near 1 / sqrt(4096)
# (Llama-2-7B's inputs); powers of two also keep a test's float64 reference of the 4-bit products exact
Q4_SCALE_EXPONENTS = (8, 9)


def random_ffn_layer(cfg: ModelConfig, fmt: str, rng: np.random.Generator) -> Layer:
    """A decoder layer holding only its FFN (``w_gate_up``, ``w_down``; gated kinds), random weights in ``fmt``:
    float32 uniform of variance 1 / inputs; int8 values uniform in [-127, 127] with a float32 scale per output row
    (the same variance); Q4_0 nibbles uniform with block scales ``Q4_SCALE_EXPONENTS``. Drawn as the format's own
    values, not quantized from floats: a 7B layer in seconds, without float64 temporaries."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}; choose from {', '.join(FORMATS)}")
    if not cfg.has_gate:
        raise ValueError("random_ffn_layer makes gated FFNs (gate and up rows) only")
    d, f = cfg.d_model, cfg.d_ff

    def matrix(rows: int, inputs: int):
        bound = math.sqrt(3 / inputs)  # uniform on [-b, b] has variance b^2 / 3
        if fmt == "float":
            w = rng.random((rows, inputs), np.float32)
            w *= np.float32(2 * bound)
            w -= np.float32(bound)
            return jnp.asarray(w)
        if fmt == "int8":
            values = rng.integers(-QMAX, QMAX + 1, (rows, inputs), np.int8)
            scales = rng.uniform(0.5, 1.5, rows).astype(np.float32) * np.float32(bound / QMAX)
            return Int8Matrix(jnp.asarray(values), jnp.asarray(scales), 0)
        if inputs % QK:
            raise ValueError(f"int4 weights need inputs in whole blocks of {QK}, got {inputs}")
        packed = rng.integers(0, 256, (rows, inputs // 2), np.uint8)
        scales = 2.0 ** -rng.integers(Q4_SCALE_EXPONENTS[0], Q4_SCALE_EXPONENTS[1] + 1, (rows, inputs // QK))
        return Q4Matrix(jnp.asarray(packed), jnp.asarray(scales.astype(np.float16)), None, "q4_0")

    return Layer(attn_norm=None, w_qkv=None, wo=None, ffn_norm=None, w_gate_up=matrix(2 * f, d),
                 w_down=matrix(d, f))


def accelerator_weight_bytes(fmt: str, layer: Layer) -> float:
    """Bytes a weight takes on the accelerator in ``fmt``: the float model's as ``ACCELERATOR_FLOAT``; a quantized
    one's as the placement sizes it (``models.quantized.bytes_per_weight`` of its FFN matrices, scales included)."""
    if fmt == "float":
        return float(jnp.dtype(ACCELERATOR_FLOAT).itemsize)
    return bytes_per_weight(Weights(head=None, layers=[layer], final_norm=None))


def accelerator_sizes(cfg: ModelConfig, weight_bytes: float, context: int) -> ModelSizes:
    """The placement's sizes of ``cfg`` at ``weight_bytes`` a weight, a ``context``-token KV cache in
    ``ACCELERATOR_FLOAT``, no predictors (the planted sets need none)."""
    return model_sizes(cfg, weight_bytes=weight_bytes, context=context, kv_bytes=jnp.dtype(ACCELERATOR_FLOAT).itemsize)


def weights_bytes(sizes: ModelSizes) -> int:
    """The model's weights (its FFN, attention and norms, embedding, head): what a budget is a fraction of."""
    return (sizes.ffn_bytes + sizes.n_layers * sizes.layer_dense_bytes + sizes.embed_bytes + sizes.lm_head_bytes
            + sizes.other_bytes)


@dataclasses.dataclass(frozen=True)
class HotSet:
    """The placement at one budget: per layer the accelerator's neurons (boolean (d_ff,)), and what it says."""

    masks: list[np.ndarray]
    budget_bytes: int
    dense_bytes: int  # the non-FFN part the accelerator holds first
    activation_share: float  # of the planted activations, on the accelerator
    feasible: bool  # False: the non-FFN part alone exceeds the budget, no neuron is hot

    @property
    def hot_share(self) -> float:
        return float(sum(m.sum() for m in self.masks) / sum(m.size for m in self.masks))


def hot_set(frequencies: Sequence[np.ndarray], sizes: ModelSizes, fraction: float) -> HotSet:
    """The solver's accelerator neurons under ``fraction`` of the model's weights' bytes (module docstring)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the budget must be a fraction in (0, 1], got {fraction}")
    budget = int(fraction * weights_bytes(sizes))
    base = preset("rtx4090")  # the bandwidths do not enter the "mass" objective
    hardware = dataclasses.replace(base.replace(accel_memory=budget, reserved=0), name=f"budget {budget} B")
    dense = sizes.required_bytes + sizes.embed_bytes + sizes.lm_head_bytes
    try:
        placement = solve_placement(frequencies, sizes, hardware, objective="mass", dense_policy="strict")
    except InfeasibleBudgetError:
        return HotSet([np.zeros(f.size, bool) for f in frequencies], budget, dense, 0.0, False)
    return HotSet(placement.masks(), budget, dense, float(placement.accel_share), True)


@dataclasses.dataclass
class ColdLayer:
    """One layer's cold half: its cold part (own arrays on the host) and per token its list (positions in the part,
    (tokens, capacity) int32, padded with 0) and valid count ((tokens,) int32); ``direct``: the part's direct host
    call (``sparse.host_sparse_ffn``: the hybrid's host callback's; None without the native library)."""

    part: NeuronFFN
    ids: np.ndarray
    counts: np.ndarray
    direct: Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None = None

    @property
    def calls_host(self) -> bool:
        """Whether the hybrid calls the host for this layer: not when its cold part is empty or its capacity 0."""
        return self.part.n_neurons > 0 and self.ids.shape[1] > 0

    def bytes_read(self, token: int) -> int:
        """Weight bytes the token's list reads (``planted.listed_bytes``; none without a host call)."""
        return listed_bytes(self.part, int(self.counts[token])) if self.calls_host else 0


def cold_lists(sets: np.ndarray, hot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token (a row of ``sets``, neuron ids), the active neurons not in ``hot`` as positions in the cold part
    (cold neurons in id order), padded with 0 to the largest count (the capacity): (positions (tokens, capacity)
    int32, counts)."""
    cold_ids = np.flatnonzero(~hot)
    lists = [np.searchsorted(cold_ids, row[~hot[row]]) for row in np.asarray(sets)]
    counts = np.array([len(p) for p in lists], np.int32)
    ids = np.zeros((len(lists), counts.max(initial=0)), np.int32)
    for t, p in enumerate(lists):
        ids[t, :len(p)] = p
    return ids, counts


def cold_layer(full: NeuronFFN, hot: np.ndarray, sets: np.ndarray) -> ColdLayer:
    """The cold half of a layer (``full``: its neuron-major FFN, neurons in id order) with ``hot`` on the accelerator,
    for the tokens' active ``sets``: the part as ``hybrid_engine`` cuts it (``subset``, no ``b_down``: the hot part
    adds it)."""
    part = full.subset(np.flatnonzero(~hot).astype(np.int32), with_b_down=False)[0]
    return ColdLayer(part, *cold_lists(sets, hot), host_sparse_ffn(part))


def cold_call(layer: ColdLayer, x: jax.Array, token: int) -> jax.Array:
    """One layer's cold FFN output for ``x`` (d_model,) and the token's list: the hybrid's jitted host call
    (``modes.hybrid``'s ``_part_ffn`` on the cold part for one token: ``sparse_ffn``, jitted, the native kernels; its
    fallback where no direct call is made, ``cold_direct``), made only for a layer that ``calls_host``."""
    return sparse_ffn(layer.part, x, jnp.asarray(layer.ids[token]), jnp.int32(layer.counts[token]))


def cold_direct(layer: ColdLayer, x: np.ndarray, token: int) -> np.ndarray:
    """``cold_call`` as the hybrid's host callback now makes it: the direct host call of the native kernel on the
    part's host arrays (numpy in and out, no jax dispatch), for a layer that ``calls_host`` and has ``direct``."""
    return layer.direct(x, layer.ids[token], int(layer.counts[token]))


@jax.jit
def cold_chain(parts: tuple[NeuronFFN, ...], x: jax.Array, ids: tuple[jax.Array, ...], counts: jax.Array
               ) -> jax.Array:
    """Every layer's cold FFN output (layers, d_model) for ``x`` in one jitted call, the layers one after another:
    the kernels without a dispatch a layer (what the host's half costs a token when its kernels are called
    straight). ``chain_inputs`` gives the parts and a token's lists, of the layers that call the host."""
    outputs = []
    for i, part in enumerate(parts):
        xi = x if not outputs else after(x, outputs[-1])  # layer i after layer i - 1: the calls in turn, not at once
        outputs.append(sparse_ffn(part, xi, ids[i], counts[i]))
    return jnp.stack(outputs) if outputs else jnp.zeros((0, x.shape[-1]), x.dtype)


def chain_inputs(layers: Sequence[ColdLayer], token: int) -> tuple[tuple[NeuronFFN, ...], tuple[jax.Array, ...],
                                                                      jax.Array]:
    """``cold_chain``'s parts, lists and counts for ``token`` (made before a timed call), of the layers that call the
    host."""
    layers = [layer for layer in layers if layer.calls_host]
    return (tuple(layer.part for layer in layers), tuple(jnp.asarray(layer.ids[token]) for layer in layers),
            jnp.asarray([layer.counts[token] for layer in layers], jnp.int32))


def representative_layers(n_layers: int, count: int) -> list[int]:
    """``count`` layer indices spread evenly over the model's (first and last included)."""
    if not 1 <= count <= n_layers:
        raise ValueError(f"need 1..{n_layers} layers, got {count}")
    return sorted({int(round(i)) for i in np.linspace(0, n_layers - 1, count)})


@dataclasses.dataclass(frozen=True)
class Activity:
    """The planted activity of a model: per layer its neurons' frequencies and its active sets (neuron ids)."""

    frequencies: list[np.ndarray]
    sets: list[np.ndarray]

    @staticmethod
    def planted(cfg: ModelConfig, fraction: float, tokens: int, seed: int = 0) -> "Activity":
        """The planted bench's activity at ``fraction`` active (``planted_neuron_sets``), the first ``tokens`` sets."""
        sets = planted_neuron_sets(cfg, fraction, seed=seed)
        if tokens > sets[0].shape[0]:
            raise ValueError(f"the planted bench draws {sets[0].shape[0]} sets a layer, asked for {tokens} tokens")
        return Activity(planted_frequencies(cfg, fraction, seed), [s[:tokens] for s in sets])


def neuron_layout(cfg: ModelConfig, fmt: str, seed: int, layer: int) -> tuple[NeuronFFN, float]:
    """Layer ``layer``'s random FFN in ``fmt``, neuron-major as the hybrid holds it (``sparse.from_layer``, neurons in
    id order), and its accelerator bytes a weight (``accelerator_weight_bytes``)."""
    dense = random_ffn_layer(cfg, fmt, np.random.default_rng([seed, layer]))
    return from_layer(dense, cfg.ffn_kind), accelerator_weight_bytes(fmt, dense)
