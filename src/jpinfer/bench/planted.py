"""Planted activity: a sparse engine whose active neurons follow a chosen law (benchmark only).

For speed at a scale and skew no checkpoint here has (``bench/cpu_7b.py``: random weights of Llama-2-7B's
shapes): what is measured is what reading the listed neurons costs, so the outputs are not a model's.

- Popularity: per layer, a power law at the skew PowerInfer reports for ReLU models
  (``solver.synthetic_frequencies``, its defaults: the neuron of rank r fires with probability min(1, c r^-s),
  s = 1.2 +-15% per layer), the mean rate set to the active fraction. At 10% active the hottest 28.6% of a
  layer's 11008 neurons carry 80% of its activations (21.4% at 5%, 38.0% at 20%; means over 32 layers), near
  the 26% the PowerInfer paper (Song et al., 2023) reports for OPT-30B.
- Active sets: ``N_SETS`` sets of exactly K = fraction * d_ff neurons per layer, each drawn without replacement
  with weights the frequencies (Efraimidis-Spirakis keys), sorted by id. A decode step takes set number
  hash(FFN input) mod ``N_SETS``: successive tokens read different sets, for a few integer operations.
- Layout: each layer's neurons stored hottest first (``popularity_order``), as a profile of the model would order
  them: the active sets then fall mostly in the front of each matrix, whose rows are read closer together. 7B
  int4 at 10% active (scratch A/B, 2-core Zen 4, 2026-12-05, 5 alternated rounds each,
  bench/results/experiments/popularity_order.md): 15.4 -> 16.1 tok/s (same-round ratios 1.01-1.11), with
  predictors 14.1 -> 14.5 (0.96-1.04). Every neuron's rows move together, so a set computes the same sums either way.
- Without a predictor the set goes to the sparse op as it is (the ``sparse`` mode's kernel over the layer's
  neuron-major FFN, ``sparse.neurons``: int8 bundles for an int8 model; for an int4 one its 4-bit gate/up rows
  in records by neuron and int8 down slots).
- With a predictor (``rank``), each step also does what the ``sparse`` mode does to choose: a per-layer MLP
  d_model -> rank -> d_ff (random weights in the model's format, as the ``sparse`` mode runs a quantized
  model's predictors: int8 per output row for an int8 model, 4-bit blocks for an int4 one), then
  ``select_neurons`` over its logits plus a planted term (+``PLANT`` on the set, -``PLANT`` elsewhere). The
  MLP's own logits are ~1e-2, so the selection returns exactly the planted set in id order: both forms compute
  the same neurons, and their difference is the predictor's and the selection's cost.
- A prompt computes every neuron, as the ``sparse`` mode does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.engines import JaxEngine, weights_read_per_token
from jpinfer.bench.fixed_list import listed_count
from jpinfer.config import ModelConfig
from jpinfer.host_heap import release_freed_heap
from jpinfer.models.loading import LoadedModel, load_quantized_gguf
from jpinfer.models.params import Layer, nbytes
from jpinfer.models.quantized import weights_format
from jpinfer.modes.engines import without_ffn
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, select_neurons
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.solver import synthetic_frequencies
from jpinfer.solver.frequencies import hottest_first
from jpinfer.sparse import NeuronFFN, all_rows_ffn, from_layer, sparse_ffn

N_SETS = 256  # active sets drawn per layer
PLANT = 1e3  # the planted term's size: far above the random predictor's logits (~1e-2)
PREDICTOR_LOGIT_SCALE = 1e-2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PlantedState:
    """One layer's state: its FFN neuron-major, its active sets (N_SETS, K) and, optionally, a predictor."""

    ffn: NeuronFFN
    sets: jax.Array
    predictor: PredictorWeights | None


def set_index(x: jax.Array, n_sets: int) -> jax.Array:
    """Which active set a token gets: a multiplicative hash of its FFN input's first two entries' bits."""
    bits = jax.lax.bitcast_convert_type(x[:2].astype(jnp.float32), jnp.uint32)
    mixed = (bits[0] ^ (bits[1] >> 7)) * jnp.uint32(2654435761)  # Knuth's multiplicative constant
    return ((mixed >> 8) % jnp.uint32(n_sets)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PlantedFFN:
    """Static ``ffn_impl``: a decode step computes a planted set (module docstring); a prompt every neuron."""

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: PlantedState) -> tuple[jax.Array, None]:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] > 1:
            return all_rows_ffn(state.ffn, tokens).reshape(x.shape), None
        token = tokens[0]
        ids = state.sets[set_index(token, state.sets.shape[0])]
        k = ids.shape[0]
        count = jnp.int32(k)
        if state.predictor is not None:
            planted = jnp.full((state.ffn.n_neurons,), -PLANT, jnp.float32).at[ids].set(PLANT)
            chosen = select_neurons(predict_logits(state.predictor, token) + planted, state.predictor.cutoff, k)
            ids, count = chosen.ids, chosen.count
        return sparse_ffn(state.ffn, token, ids, count).reshape(x.shape), None


def planted_sets(frequencies: np.ndarray, k: int, n_sets: int, rng: np.random.Generator) -> np.ndarray:
    """``n_sets`` sets of ``k`` distinct neuron ids (int32 (n_sets, k), each row sorted), each drawn without
    replacement with weights ``frequencies`` (Efraimidis-Spirakis: the k largest u^(1/w), u uniform)."""
    w = np.asarray(frequencies, np.float64)
    if w.ndim != 1 or not 0 < k <= w.size or (w <= 0).any():
        raise ValueError(f"need positive frequencies and 0 < k <= {w.size}, got k={k}")
    keys = np.log(rng.random((n_sets, w.size))) / w  # log of u^(1/w): same order, no underflow
    return np.sort(np.argpartition(-keys, k - 1, axis=1)[:, :k], axis=1).astype(np.int32)


def random_predictor(d_model: int, d_ff: int, rank: int, rng: np.random.Generator, fmt: str) -> PredictorWeights:
    """A predictor MLP of ``rank`` with random weights in the weights format ``fmt`` (as the ``sparse`` mode runs
    a model's predictors: ``PredictorWeights.in_format``) whose logits are ~``PREDICTOR_LOGIT_SCALE``."""
    w_in = rng.standard_normal((rank, d_model), np.float32) / np.float32(np.sqrt(d_model))
    w_out = rng.standard_normal((d_ff, rank), np.float32) * np.float32(PREDICTOR_LOGIT_SCALE / np.sqrt(rank))
    return PredictorWeights(jnp.asarray(w_in), jnp.zeros((rank,), jnp.float32), jnp.asarray(w_out),
                            jnp.zeros((d_ff,), jnp.float32), jnp.float32(0.0)).in_format(fmt)


def planted_name(fraction: float, rank: int | None) -> str:
    return f"planted {fraction:.0%} active" + (f" + predictor (rank {rank})" if rank else " (no predictor)")


def planted_frequencies(cfg: ModelConfig, fraction: float, seed: int = 0) -> list[np.ndarray]:
    """Per layer, each neuron's firing rate at ``fraction`` active (module docstring)."""
    return synthetic_frequencies(cfg.n_layers, cfg.d_ff, mean_active=fraction, seed=seed)


def popularity_order(cfg: ModelConfig, fraction: float, seed: int = 0) -> list[np.ndarray]:
    """Per layer, the neuron ids hottest first (int32) at ``fraction`` active. The power law's ranks fall on the
    same ids at every fraction, so this order is hottest first at any larger fraction too (more neurons tie at
    rate 1 there); take the smallest fraction a layout serves."""
    return [hottest_first(f) for f in planted_frequencies(cfg, fraction, seed)]


def neuron_major(model: LoadedModel, consume: bool = False, order: list[np.ndarray] | None = None
                 ) -> list[NeuronFFN]:
    """Every layer's FFN neuron-major (``sparse.from_layer``), its neurons in ``order`` (per layer, the ids in
    storage order: ``popularity_order``) or the model's. ``consume``: drop each layer's dense FFN from ``model``
    once converted, so a model nothing else holds has one layer in both forms at a time, not all."""
    out = []
    layers = model.weights.layers
    for i, layer in enumerate(layers):
        ffn = from_layer(layer, model.cfg.ffn_kind, model.cfg.experts)
        out.append(ffn if order is None else ffn.subset(order[i])[0])
        del ffn
        if consume:
            layers[i] = without_ffn(layer)
            del layer
            # the dense FFN's memory back to the OS now, not held free in the heap while the next layers' layouts
            # are made in fresh memory (a 7B int4 model's build peaked 0.7 GB higher, 6.11 against 5.38 GB)
            release_freed_heap()
    return out


def planted_neuron_sets(cfg: ModelConfig, fraction: float, n_sets: int = N_SETS, seed: int = 0) -> list[np.ndarray]:
    """Per layer, the planted engine's ``n_sets`` active sets at ``fraction`` active: int32 (n_sets, K) neuron ids,
    each row sorted, K = ``listed_count(d_ff, 1 - fraction)`` (module docstring). Drawn from the first of two
    streams of ``seed`` (the second draws the predictors), so the sets are the same with a predictor or without."""
    sets_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])
    k = listed_count(cfg.d_ff, 1 - fraction)
    return [planted_sets(np.maximum(f, 1e-12), k, n_sets, sets_rng) for f in planted_frequencies(cfg, fraction, seed)]


def planted_engine(model: LoadedModel, fraction: float, ffns: list[NeuronFFN], *, rank: int | None = None,
                   n_sets: int = N_SETS, seed: int = 0) -> Engine:
    """The planted engine at ``fraction`` active (module docstring) over ``ffns`` (``neuron_major(model)``,
    shared by several engines, in any neuron order: each set lists the rows holding its neurons, ``rows_of``),
    with a predictor of ``rank`` per layer or none."""
    if not 0 < fraction < 1:
        raise ValueError(f"the active fraction must lie in (0, 1), got {fraction}")
    if rank is not None and rank < 1:
        raise ValueError(f"the predictor's rank must be positive, got {rank}")
    cfg = model.cfg
    predictor_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])
    fmt = weights_format(model.weights)
    predictor = lambda: None if rank is None else random_predictor(cfg.d_model, cfg.d_ff, rank, predictor_rng, fmt)
    states = [PlantedState(ffn, jnp.asarray(rows_of(ffn, sets)), predictor())
              for ffn, sets in zip(ffns, planted_neuron_sets(cfg, fraction, n_sets, seed))]
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    return Engine(LoadedModel(cfg, weights, None, model.source), FfnStrategy(PlantedFFN(), states,
                                                                          planted_name(fraction, rank)))


def rows_of(ffn: NeuronFFN, sets: np.ndarray) -> np.ndarray:
    """Sets of neuron ids as the rows of ``ffn`` that hold those neurons (its ``ids``: row -> neuron), each
    set sorted."""
    row = np.empty(ffn.n_neurons, np.int32)
    row[np.asarray(ffn.ids)] = np.arange(ffn.n_neurons, dtype=np.int32)
    return np.sort(row[sets], axis=1)


def neuron_bytes(ffn: NeuronFFN) -> int:
    """Bytes of one neuron of ``ffn``: its bundle's rows and row scales, or an int4 layout's 4-bit record (P rows'
    packed bytes and block scales, and mins) and int8 down slot."""
    per_neuron = int(ffn.rows[0].nbytes) + (0 if ffn.scales is None else int(ffn.scales[0].nbytes))
    return per_neuron + (0 if ffn.gate_up is None else ffn.gate_up.nbytes // ffn.n_neurons)


def listed_bytes(ffn: NeuronFFN, count: int) -> int:
    """Weight bytes the sparse FFN reads over ``count`` listed neurons of ``ffn``: their bundles
    (``neuron_bytes``) and, for int8 down slots, the down projection's scales (read by any list)."""
    return count * neuron_bytes(ffn) + (0 if ffn.down_scales is None else int(ffn.down_scales.nbytes))


def planted_bytes_per_token(engine: Engine) -> int:
    """Weight bytes one decode step of a planted engine reads: the weights outside the FFN, and per layer the
    listed neurons' bundles (their rows and row scales, or 4-bit rows and block scales), the down projection's
    scales and the predictor."""
    total = weights_read_per_token(engine)
    for state in engine.ffn.state:
        total += listed_bytes(state.ffn, state.sets.shape[1])
        if state.predictor is not None:
            total += nbytes(state.predictor)
    return total


def planted_bench_engine(model: LoadedModel, fraction: float, ffns: list[NeuronFFN], rank: int | None,
                         label: str) -> JaxEngine:
    """``planted_engine`` as a bench engine named ``{label} {planted_name}``, its bytes per token counted."""
    engine = planted_engine(model, fraction, ffns, rank=rank)
    bench = JaxEngine(f"{label} {engine.ffn.name}", engine)
    bench.weight_bytes_per_token = planted_bytes_per_token(engine)
    return bench


def file_engine(path: str, fmt: str, fraction: float | None = None, rank: int | None = None) -> JaxEngine:
    """A bench engine over a GGUF file read straight into ``fmt`` ("int8" or "int4"): dense, or planted at
    ``fraction`` active with predictors of ``rank`` (or none), its dense FFN dropped a layer at a time as it is
    converted (so its memory is its own: ``bench/cpu_7b.py`` runs each in a process of its own)."""
    model = load_quantized_gguf(path, fmt, tokenizer=False)
    label = f"jpinfer {fmt}"
    if fraction is None:
        return JaxEngine(f"{label} dense", Engine(model))
    ffns = neuron_major(model, consume=True, order=popularity_order(model.cfg, fraction))
    return planted_bench_engine(model, fraction, ffns, rank, label)
