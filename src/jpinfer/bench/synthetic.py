"""A model's engines under one GPU budget, with synthetic activity: hot neurons on the accelerator and
cold ones on the host (the hybrid mode) against offloading whole layers (llama.cpp's ``-ngl``).

The GPU suite (``jpinfer.bench.gpu_suite``) runs it. Protocol:
- activity: per layer a Zipf-like law (``jpinfer.solver.synthetic_frequencies``: neuron of rank r
  active with probability min(1, c r^-s), skew s = 1.5 puts ~80% of the activations in the hottest
  20% of neurons, mean active 10% of the neurons per token, both varied +-15% per layer). Predictors
  (rank 128; 32 for small models) follow it: random ``w_in``/``w_out``, so the chosen set changes with
  the input, and ``b_out`` set per neuron so that, on the model's own FFN inputs for random tokens,
  the logit exceeds the cut-off 0 with the neuron's frequency. Capacity K per layer: the 0.99 quantile
  of the neurons selected per token on held-out tokens, rounded up to 32. The predictors are an
  oracle of the synthetic law, not trained ones: speeds measured with them are upper bounds;
- GPU budget: a fraction of the model's bytes in its weights format (float, int8 or int4, scales
  included). The hybrid keeps everything but the FFN on the GPU (embeddings, head, attention, norms,
  predictors, the KV cache the run allocates) and fills the rest with the hottest neurons of the whole
  model (``jpinfer.solver.baselines.greedy``), each at its FFN matrices' bytes in the format; when that
  fixed part alone exceeds the budget, no neuron goes to the GPU. The layer offload keeps embeddings
  and head on the GPU with the first n whole layers (weights and KV cache), n as large as the budget
  allows (``layer_offload.gpu_layers``), and runs the other layers dense on the CPU in the same format;
- CPU side's float arrays in float32 by default: on a 2-core AVX-512-BF16 machine (jax 0.10.2) XLA:CPU ran a
  bfloat16 matrix-vector product 11x and the sparse CPU kernel 40x slower than in float32, which
  would measure that, not the placement;
- ``all_active``: cut-off -inf and K = d_ff, so every engine computes the dense model (a check).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import ndtri

from jpinfer.bench.layer_offload import gpu_layers, offload_engine, step_inputs
from jpinfer.config import ModelConfig
from jpinfer.ffn import part_capacities, whole_blocks
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Weights, nbytes
from jpinfer.modes.engines import hybrid_engine, sparse_engine
from jpinfer.predictor.mlp import PredictorWeights
from jpinfer.predictor.store import Predictors
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import generation_shapes
from jpinfer.solver import synthetic_frequencies
from jpinfer.solver.baselines import greedy

PROMPT_TOKENS = 16  # a power of two: a whole prompt bucket, no padding
# random sequences x tokens whose FFN inputs calibrate the predictors: hidden states within a sequence are alike,
# so many short sequences; the last HELD_OUT of them only count the selected neurons
CALIBRATION, HELD_OUT = (16, 64), 4
ENGINES = ("dense GPU", "hybrid", "layer offload", "sparse GPU")  # in build order: sparse (one more FFN copy) last
SKEW, MEAN_ACTIVE = 1.5, 0.1


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


# ----- model and activity


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _layer_and_ffn_input(layer: Layer, h, positions, rope_cs, *, cfg: ModelConfig, window: int | None):
    """One dense layer over whole sequences (a fresh cache); returns its output and its FFN input."""
    empty = jnp.zeros((h.shape[0], cfg.n_kv_heads, h.shape[1], cfg.head_dim), h.dtype)
    h, x, _, _ = transformer.attention_residual(layer, h, positions, rope_cs, empty, empty, cfg, window=window)
    return transformer.ffn_residual(layer, h, transformer.ffn_dense(layer, x, cfg), cfg), x


def ffn_inputs(cfg: ModelConfig, weights: Weights, seed: int, device: Any) -> list[np.ndarray]:
    """Per layer the FFN inputs (tokens, d_model) of random token sequences (on ``device``, the weights'), as
    float32."""
    batch, length = CALIBRATION
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length), np.int32)
    h, positions, rope_cs = step_inputs(weights, jax.device_put(tokens, device), jnp.int32(0), cfg=cfg)
    out = []
    for i, layer in enumerate(weights.layers):
        h, x = _layer_and_ffn_input(layer, h, positions, rope_cs, cfg=cfg, window=cfg.layer_window(i))
        out.append(np.asarray(x.astype(jnp.float32)).reshape(-1, cfg.d_model))
    return out


@dataclasses.dataclass
class Activity:
    """Synthetic predictors following the frequencies, and what they select on held-out tokens."""

    predictors: list[PredictorWeights]
    capacity: tuple[int, ...]  # K per layer
    selected: np.ndarray  # (layers,) mean neurons selected per held-out token


def synthetic_predictors(freqs: list[np.ndarray], inputs: list[np.ndarray], rank: int, seed: int,
                         all_active: bool) -> Activity:
    """Per layer: logits = w_out relu(w_in x) + b_out with random w_in, w_out; b_out = -mean +
    std * probit(frequency) of the random part over calibration inputs, so that each neuron's
    logit exceeds 0 on about its frequency of tokens. K: 0.99 quantile of the held-out counts."""
    rng = np.random.default_rng(seed)
    held = HELD_OUT * CALIBRATION[1]
    predictors, ks, selected = [], [], []
    for f, x in zip(freqs, inputs):
        d_ff, d = f.size, x.shape[1]
        w_in = rng.standard_normal((rank, d), np.float32) / np.float32(math.sqrt(d))
        w_out = rng.standard_normal((d_ff, rank), np.float32) / np.float32(math.sqrt(rank))
        calib = np.maximum(x[:-held] @ w_in.T, 0) @ w_out.T
        b_out = (-calib.mean(0) + calib.std(0) * ndtri(np.clip(f, 1e-4, 1 - 1e-4))).astype(np.float32)
        counts = ((np.maximum(x[-held:] @ w_in.T, 0) @ w_out.T + b_out) > 0).sum(-1)
        k = d_ff if all_active else min(d_ff, whole_blocks(np.quantile(counts, 0.99)))
        cutoff = -np.inf if all_active else 0.0
        predictors.append(PredictorWeights(jnp.asarray(w_in), jnp.zeros((rank,), jnp.float32), jnp.asarray(w_out),
                                           jnp.asarray(b_out), jnp.float32(cutoff)))
        ks.append(k)
        selected.append(d_ff if all_active else counts.mean())
    return Activity(predictors, tuple(ks), np.asarray(selected))


# ----- budget


@dataclasses.dataclass
class Budget:
    """Accelerator bytes of each engine under one budget."""

    n_layers: int
    model: int  # all weights
    budget: int
    top: int  # embeddings, head, final norm
    attention: int  # per layer: attention projections and norms
    ffn: int  # per layer
    kv: int  # per layer, the run's KV cache
    predictors: int  # all layers
    neuron: int  # one FFN neuron (gate row, up row, down column)

    @property
    def hybrid_fixed(self) -> int:
        return self.top + self.n_layers * (self.attention + self.kv) + self.predictors

    def hot_neurons(self) -> int:
        return max(0, self.budget - self.hybrid_fixed) // self.neuron


def budget_of(cfg: ModelConfig, weights: Weights, predictors: list[PredictorWeights], fraction: float,
              kv_slots: int) -> Budget:
    layer = weights.layers[0]
    itemsize = jnp.dtype(weights.dtype).itemsize
    model, ffn = nbytes(weights), nbytes((layer.w_gate_up, layer.w_down))
    return Budget(
        n_layers=cfg.n_layers, model=model, budget=int(fraction * model),
        top=nbytes(dataclasses.replace(weights, layers=[])),
        attention=nbytes(dataclasses.replace(layer, w_gate_up=None, w_down=None)),
        ffn=ffn,
        kv=2 * cfg.kv_dim * kv_slots * itemsize,
        predictors=nbytes(predictors),
        neuron=math.ceil(ffn / cfg.d_ff),  # in the weights' format, its scales included
    )



@dataclasses.dataclass
class Plan:
    """One engine to build: how, its accelerator bytes, what it keeps there."""

    build: Callable[[], Engine]
    gpu_bytes: int
    where: str


@dataclasses.dataclass
class BudgetSetup:
    """The engines of one model under one GPU budget, and what the header of their table says."""

    plans: dict[str, Plan]  # in the order of ENGINES
    facts: list[str]  # markdown bullets: activity, budget, placement
    data: dict[str, Any]  # the same as numbers, for the JSON
    neuron_major_bytes: int  # the sparse GPU engine's extra copy of the FFNs


def budget_setup(model: LoadedModel, fraction: float, devices: tuple[Any, Any], *, new_tokens: int, rank: int,
                 host_dtype: Any = jnp.float32, all_active: bool = False, seed: int = 0) -> BudgetSetup:
    """Synthetic activity and predictors for ``model`` (see the module), the hybrid's placement and the layer
    offload's split under ``fraction`` of the model's bytes; nothing is built until a plan's ``build`` runs."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the GPU budget must be a fraction in (0, 1], got {fraction}")
    cfg, weights = model.cfg, model.weights
    accelerator = devices[0]
    freqs = synthetic_frequencies(cfg.n_layers, cfg.d_ff, skew=SKEW, mean_active=MEAN_ACTIVE, seed=seed)
    activity = synthetic_predictors(freqs, ffn_inputs(cfg, weights, seed, accelerator), rank, seed, all_active)
    predictors = Predictors([jax.device_put(p, accelerator) for p in activity.predictors],
                            {"model_name": cfg.name, "synthetic": True})
    ks = activity.capacity
    kv_slots = generation_shapes(PROMPT_TOKENS, new_tokens, cfg.max_position)[1]  # the cache Engine allocates
    b = budget_of(cfg, weights, predictors.layers, fraction, kv_slots)
    masks = greedy(freqs, b.hot_neurons())
    n_hot = int(sum(m.sum() for m in masks))
    hot_fraction = n_hot / (cfg.n_layers * cfg.d_ff)
    share = float(sum(f[m].sum() for f, m in zip(freqs, masks)) / sum(f.sum() for f in freqs))
    n_gpu = gpu_layers(weights, b.budget, b.kv)
    top20 = float(np.mean([np.sort(f)[::-1][: f.size // 5].sum() / f.sum() for f in freqs]))
    selected = float(activity.selected.mean() / cfg.d_ff)
    facts = [
        (f"activity: power law exponent {SKEW}, mean active {MEAN_ACTIVE:.0%} (+-15% per layer); hottest 20% of "
         f"neurons carry {top20:.1%} of activations; synthetic predictors (rank {rank}, an oracle of that law: "
         f"speeds are upper bounds) select {selected:.1%} of the neurons per held-out token; K per layer "
         f"{min(ks)}..{max(ks)}" + (" (all active: cut-off -inf, K = d_ff)" if all_active else "")),
        (f"GPU budget: {fraction:g} of the model = {gib(b.budget)}; the hybrid's non-FFN part {gib(b.hybrid_fixed)}"
         + (" (exceeds the budget: no neuron on the GPU)" if b.hybrid_fixed > b.budget else "")),
        (f"hybrid: {n_hot} neurons on the GPU ({hot_fraction:.2%} of the FFN neurons, {share:.2%} of the "
         f"activations); layer offload: {n_gpu} of {cfg.n_layers} layers on the GPU; CPU side in "
         f"{jnp.dtype(host_dtype).name}"),
    ]
    data = dict(budget=fraction, budget_bytes=b.budget, hot_neurons=n_hot, hot_fraction=hot_fraction,
                gpu_activation_share=share, offload_layers=n_gpu, selected_fraction=selected, capacity=list(ks),
                skew=SKEW, mean_active=MEAN_ACTIVE, rank=rank, all_active=all_active, upper_bound=True)
    plans = {
        "dense GPU": Plan(lambda: Engine(model), b.model + cfg.n_layers * b.kv, "everything"),
        "hybrid": Plan(lambda: hybrid_engine(model, predictors, masks, part_capacities(ks, masks, freqs), devices,
                                             host_dtype),
                       b.hybrid_fixed + n_hot * b.neuron,
                       f"non-FFN + {hot_fraction:.1%} of the neurons ({share:.1%} of activations)"),
        "layer offload": Plan(lambda: offload_engine(model, n_gpu, devices, host_dtype),
                              b.top + n_gpu * (b.attention + b.ffn + b.kv),
                              f"embeddings, head, layers 0..{n_gpu - 1}" if n_gpu else "embeddings, head"),
        "sparse GPU": Plan(lambda: sparse_engine(model, predictors, ks), b.model + b.predictors + cfg.n_layers * b.kv,
                           "everything, neuron-major"),
    }
    return BudgetSetup(plans, facts, data, cfg.n_layers * b.ffn)
