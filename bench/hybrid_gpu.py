"""Hybrid decoding on a real accelerator: hot neurons on the GPU, cold ones on the CPU, against
offloading whole layers (llama.cpp's ``-ngl``) under the same GPU budget.

Protocol, one run:
- model: Llama-2-7B shapes (vocab 32000, d_model 4096, 32 layers of 32 heads of 128, d_ff 11008,
  SwiGLU, RoPE) with random bfloat16 weights (normal, scale 0.02), drawn per tensor on the
  accelerator; ``--tiny``: 4 layers, d_model 256, d_ff 688, vocab 1000, float32;
- activity: per layer a Zipf-like law (``jpinfer.solver.synthetic_frequencies``: neuron of rank r
  active with probability min(1, c r^-s), ``--skew`` s = 1.5 puts ~80% of the activations in the
  hottest 20% of neurons, ``--mean-active`` 10% of the neurons per token, both varied +-15% per
  layer). Predictors (rank 128; 32 with ``--tiny``) follow it: random ``w_in``/``w_out``, so the
  chosen set changes with the input, and ``b_out`` set per neuron so that, on the model's own FFN
  inputs for random tokens, the logit exceeds the cut-off 0 with the neuron's frequency. Capacity
  K per layer: the 0.99 quantile of the neurons selected per token on held-out tokens, rounded up
  to 32;
- GPU budget: ``--budget`` of the model's bytes (0.4; 0.75 with ``--tiny``, whose embeddings and
  KV cache weigh more). The hybrid keeps everything but the FFN on the GPU (embeddings, head,
  attention, norms, predictors, the KV cache the run allocates) and fills the rest with the
  hottest neurons of the whole model (``jpinfer.solver.baselines.greedy``); when that fixed part
  alone exceeds the budget, it is used as the budget and no neuron goes to the GPU. The layer
  offload keeps embeddings and head on the GPU with the first n whole layers (weights and KV
  cache), n as large as the budget allows, and runs the other layers dense on the CPU;
- CPU side in float32 by default (``--host-dtype``): on a 2-core AVX-512-BF16 machine (jax
  0.10.2) XLA:CPU ran a bfloat16 matrix-vector product 11x and the sparse CPU kernel 40x slower
  than in float32, which would measure that, not the placement;
- engines, all greedy: ``hybrid`` (``jpinfer.modes.engines.hybrid_engine``), ``layer offload``
  (``jpinfer.bench.layer_offload``), ``dense GPU`` and ``sparse GPU`` (the whole model and its
  sparse FFN on the GPU; sparse is skipped when the GPU lacks room for its neuron-major copy);
- speed: decode tok/s of ``--new-tokens`` 64 after a 16-token prompt, every engine once per round,
  ``--rounds`` interleaved rounds (``jpinfer.bench.protocol.interleaved_rounds``, the order rotating),
  median, and the median of same-round ratios to dense; greedy agreement (prefix) with dense, as
  tokens equal before the first difference; then ``Engine.step_times`` (device step, host dispatch
  per step) and the hybrid's CPU side alone (every layer's cold FFN, dispatched back to back);
- ``--all-active``: cut-off -inf and K = d_ff, so every engine computes the dense model; their
  greedy tokens must equal dense's (asserted for a float32 model, i.e. ``--tiny``).
``--max-seconds`` bounds the run: engines not built, rounds and step timings not started in time
are skipped, and the table is rewritten after every round.

On the GPU machine (at most about 7 minutes, ``--max-seconds`` 420; the table goes to --out):

    python3 bench/hybrid_gpu.py --out $OUT/hybrid_gpu.md

Here, on the CPU (two simulated devices: device 0 plays the accelerator, device 1 the host):

    JAX_PLATFORMS=cpu python bench/hybrid_gpu.py --tiny
    JAX_PLATFORMS=cpu python bench/hybrid_gpu.py --tiny --all-active
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax

jax.config.update("jax_num_cpu_devices", 2)  # before any other use of JAX: device 1 plays the host without a GPU

import jax.numpy as jnp
import numpy as np
from scipy.special import ndtri

from jpinfer.bench.layer_offload import LLAMA2_7B, TINY, offload_engine, random_weights, step_inputs
from jpinfer.bench.protocol import Rounds, interleaved_rounds, load_average, log, machine, machine_line, matching_prefix
from jpinfer.bench.results import publish
from jpinfer.config import ModelConfig
from jpinfer.ffn import part_capacities, whole_blocks
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, Weights, nbytes
from jpinfer.modes import hybrid
from jpinfer.modes.devices import default_devices
from jpinfer.modes.engines import hybrid_engine, sparse_engine
from jpinfer.predictor.mlp import PredictorWeights
from jpinfer.predictor.store import Predictors
from jpinfer.runtime.engine import CACHE_ROUNDING, MIN_PROMPT_BUCKET, Engine, GenerationConfig
from jpinfer.solver import synthetic_frequencies
from jpinfer.solver.baselines import greedy
from jpinfer.sparse import sparse_ffn

T0 = time.perf_counter()

PROMPT_TOKENS = MIN_PROMPT_BUCKET  # a whole prompt bucket: no padding
# random sequences x tokens whose FFN inputs calibrate the predictors: hidden states within a sequence are alike,
# so many short sequences; the last HELD_OUT of them only count the selected neurons
CALIBRATION, HELD_OUT = (16, 64), 4
ENGINES = ("dense GPU", "hybrid", "layer offload", "sparse GPU")  # in build order: sparse (one more FFN copy) last

def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


# ----- model and activity


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_and_ffn_input(layer: Layer, h, positions, rope_cs, *, cfg: ModelConfig):
    """One dense layer over whole sequences (a fresh cache); returns its output and its FFN input."""
    empty = jnp.zeros((h.shape[0], cfg.n_kv_heads, h.shape[1], cfg.head_dim), h.dtype)
    h, x, _, _ = transformer.attention_residual(layer, h, positions, rope_cs, empty, empty, cfg)
    return h + transformer.ffn_dense(layer, x, cfg).astype(h.dtype), x


def ffn_inputs(cfg: ModelConfig, weights: Weights, seed: int) -> list[np.ndarray]:
    """Per layer the FFN inputs (tokens, d_model) of random token sequences, as float32."""
    batch, length = CALIBRATION
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length), np.int32))
    h, positions, rope_cs = step_inputs(weights, jax.device_put(tokens, weights.head.device), jnp.int32(0), cfg=cfg)
    out = []
    for layer in weights.layers:
        h, x = _layer_and_ffn_input(layer, h, positions, rope_cs, cfg=cfg)
        out.append(np.asarray(x.astype(jnp.float32)).reshape(-1, cfg.d_model))
    return out


@dataclasses.dataclass
class Activity:
    """Synthetic predictors following the frequencies, and what they select on held-out tokens."""

    predictors: list[PredictorWeights]
    capacity: tuple[int, ...]  # K per layer
    selected: np.ndarray  # (layers,) mean neurons selected per held-out token
    held_out: list[np.ndarray]  # per layer held-out FFN inputs (tokens, d_model)


def synthetic_predictors(freqs: list[np.ndarray], inputs: list[np.ndarray], rank: int, seed: int,
                         all_active: bool) -> Activity:
    """Per layer: logits = w_out relu(w_in x) + b_out with random w_in, w_out; b_out = -mean +
    std * probit(frequency) of the random part over calibration inputs, so that each neuron's
    logit exceeds 0 on about its frequency of tokens. K: 0.99 quantile of the held-out counts."""
    rng = np.random.default_rng(seed)
    held = HELD_OUT * CALIBRATION[1]
    predictors, ks, selected, held_out = [], [], [], []
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
        held_out.append(x[-held:])
    return Activity(predictors, tuple(ks), np.asarray(selected), held_out)


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

    def offload_layers(self) -> int:
        return int(min(self.n_layers, max(0, self.budget - self.top) // (self.attention + self.ffn + self.kv)))


def budget_of(cfg: ModelConfig, weights: Weights, predictors: list[PredictorWeights], fraction: float,
              kv_slots: int) -> Budget:
    nbytes = lambda tree: int(sum(a.nbytes for a in jax.tree_util.tree_leaves(tree)))
    layer = weights.layers[0]
    itemsize = jnp.dtype(weights.dtype).itemsize
    model = nbytes(weights)
    return Budget(
        n_layers=cfg.n_layers, model=model, budget=int(fraction * model),
        top=nbytes(dataclasses.replace(weights, layers=[])),
        attention=nbytes(dataclasses.replace(layer, w_gate_up=None, w_down=None)),
        ffn=nbytes((layer.w_gate_up, layer.w_down)),
        kv=2 * cfg.kv_dim * kv_slots * itemsize,
        predictors=nbytes(predictors),
        neuron=3 * cfg.d_model * itemsize,
    )


def cold_side_seconds(stepper: hybrid.HybridStepper, held_out: list[np.ndarray], rounds: int = 5) -> float:
    """One token's cold FFNs of every layer on the host alone, dispatched back to back (median
    over rounds), through the sparse op the engine's cold FFN runs. Each layer's list is what its
    predictor selects for a held-out FFN input (computed here with numpy, as ``select_neurons``:
    the top K of the cold part's logits, the count over the cut-off)."""
    calls = []
    for part, cold, (_, k_cold), x in zip(stepper.layers, stepper.cold, stepper.capacity, held_out):
        if not (cold.n_neurons and k_cold):
            continue
        p = part.predictor.arrays()
        logits = (p["w_out"] @ np.maximum(p["w_in"] @ x[0] + p["b_in"], 0) + p["b_out"])[np.asarray(part.cold_ids)]
        ids = np.argsort(-logits, kind="stable")[:k_cold].astype(np.int32)
        chosen = (ids, np.int32((logits[ids] > p["cutoff"]).sum()))
        calls.append((cold, *jax.device_put((x[:1, None].astype(stepper.top.dtype), chosen), stepper.host)))
    if not calls:
        return 0.0
    one_token = lambda r: jax.block_until_ready([sparse_ffn(cold, x[0, 0], *chosen) for cold, x, chosen in calls])
    return interleaved_rounds({"cold side": one_token}, rounds).median("cold side")  # after one untimed call


# ----- measurement


@dataclasses.dataclass
class Row:
    engine: str
    gpu_bytes: int
    where: str
    tps: dict[int, float] = dataclasses.field(default_factory=dict)  # round -> decode tok/s
    tokens: list[int] | None = None
    step: tuple[float, float] | None = None  # (device step s, dispatch s) from Engine.step_times
    note: str = ""


def agreement(tokens: list[int] | None, reference: list[int] | None) -> str:
    """Greedy agreement (prefix) as a count: tokens equal to the reference before the first difference / its length."""
    if tokens is None or reference is None:
        return "-"
    return f"{matching_prefix(tokens, reference)}/{len(reference)}"


def vs_dense(row: Row, ref: Row | None) -> str:
    """Median of the same-round ratios of the row's tok/s to dense's."""
    rounds = [r for r in row.tps if ref is not None and r in ref.tps]
    return f"{statistics.median(row.tps[r] / ref.tps[r] for r in rounds):.3f}" if rounds else "-"


def table(rows: list[Row], header: list[str]) -> str:
    ref = next((r for r in rows if r.engine == "dense GPU" and r.tps), None)
    columns = ("engine", "GPU bytes", "on the GPU", "decode tok/s (median)", "rounds", "vs dense", "device step ms",
               "dispatch ms/step", "greedy agreement (prefix): tokens = dense", "note")
    align = ("---", "---:", "---", "---:", "---", "---:", "---:", "---:", "---:", "---")
    lines = [*header, "", "| " + " | ".join(columns) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        tps = statistics.median(r.tps.values()) if r.tps else None
        lines.append(" | ".join([
            f"| {r.engine}", gib(r.gpu_bytes), r.where, f"{tps:.1f}" if tps else "-",
            ", ".join(f"{t:.1f}" for t in r.tps.values()) or "-", vs_dense(r, ref),
            f"{r.step[0] * 1e3:.2f}" if r.step else "-", f"{r.step[1] * 1e3:.2f}" if r.step else "-",
            agreement(r.tokens, ref.tokens if ref else None), r.note or "",
        ]) + " |")
    return "\n".join(lines) + "\n"


def write(text: str, out: pathlib.Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def failed(row: Row, err: Exception) -> None:
    """An engine's error as its row's note (one table cell): one run on the GPU must give every row it can."""
    message = (str(err).splitlines() or [""])[0][:200].replace("|", "/")
    row.note = f"failed: {type(err).__name__}: {message}"
    log(f"{row.engine}: {row.note}")


def build_and_compile(row: Row, build: Callable[[], Engine], warm: GenerationConfig) -> Engine | None:
    log(f"{row.engine}: building")
    try:
        engine = build()
        log(f"{row.engine}: compiling")
        engine.warmup(PROMPT_TOKENS, warm)
    except Exception as err:  # noqa: BLE001 -- see failed
        failed(row, err)
        return None
    log(f"{row.engine}: ready")
    return engine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small float32 model (CPU check)")
    parser.add_argument("--budget", type=float, default=None, help="GPU budget, fraction of the model's bytes "
                        "(default 0.4; 0.75 with --tiny)")
    parser.add_argument("--skew", type=float, default=1.5, help="power-law exponent of the neuron frequencies")
    parser.add_argument("--mean-active", type=float, default=0.1, help="mean fraction of neurons active per token")
    parser.add_argument("--rank", type=int, default=None, help="predictor rank (default 128; 32 with --tiny)")
    parser.add_argument("--host-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the weights on the CPU side (see the protocol)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per Engine.step_times measurement")
    parser.add_argument("--all-active", action="store_true", help="every neuron selected: all engines compute the "
                        "dense model, and their greedy tokens are checked against dense")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="wall-clock bound of the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="markdown file (default $OUT/hybrid_gpu.md when OUT is set)")
    args = parser.parse_args()
    args.engines = [name.strip() for name in args.engines.split(",")]
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if args.out is None and os.environ.get("OUT"):
        args.out = pathlib.Path(os.environ["OUT"]) / "hybrid_gpu.md"
    return args


def main() -> None:
    args = parse_args()
    cfg = TINY if args.tiny else LLAMA2_7B
    dtype = jnp.dtype(jnp.float32 if args.tiny else jnp.bfloat16)
    host_dtype = jnp.dtype(args.host_dtype)
    fraction = args.budget if args.budget is not None else (0.75 if args.tiny else 0.4)
    rank = args.rank or (32 if args.tiny else 128)
    left = lambda: args.max_seconds - (time.perf_counter() - T0)

    load_before = load_average()
    devices = default_devices()
    accelerator, host = devices
    log(f"jax {jax.__version__}; accelerator {accelerator} ({accelerator.device_kind}), host {host}")
    if accelerator.platform == "cpu" and not args.tiny:
        log("no GPU: the full model on simulated CPU devices is very slow; --tiny checks the script")

    weights = jax.block_until_ready(random_weights(cfg, dtype, accelerator, args.seed))
    n_params = sum(a.size for a in jax.tree_util.tree_leaves(weights))
    log(f"weights: {cfg.name}, {n_params / 1e9:.3f} B parameters, {gib(nbytes(weights))} {dtype.name}")
    model = LoadedModel(cfg, weights, None, cfg.name)

    freqs = synthetic_frequencies(cfg.n_layers, cfg.d_ff, skew=args.skew, mean_active=args.mean_active,
                                  seed=args.seed)
    activity = synthetic_predictors(freqs, ffn_inputs(cfg, weights, args.seed), rank, args.seed, args.all_active)
    predictors = Predictors([jax.device_put(p, accelerator) for p in activity.predictors],
                            {"model_name": cfg.name, "synthetic": True})
    ks = activity.capacity
    top20 = np.mean([np.sort(f)[::-1][: f.size // 5].sum() / f.sum() for f in freqs])
    log(f"predictors: rank {rank}, K per layer {min(ks)}..{max(ks)}, "
        f"selected per held-out token {activity.selected.mean():.0f} of {cfg.d_ff}")

    kv_slots = -(-(PROMPT_TOKENS + args.new_tokens) // CACHE_ROUNDING) * CACHE_ROUNDING  # the cache Engine allocates
    b = budget_of(cfg, weights, predictors.layers, fraction, kv_slots)
    masks = greedy(freqs, b.hot_neurons())
    n_hot = int(sum(m.sum() for m in masks))
    hot_fraction = n_hot / (cfg.n_layers * cfg.d_ff)
    share = sum(f[m].sum() for f, m in zip(freqs, masks)) / sum(f.sum() for f in freqs)
    n_gpu = b.offload_layers()
    log(f"budget {gib(b.budget)}: hybrid {n_hot} hot neurons ({hot_fraction:.2%}, {share:.2%} of activations); "
        f"layer offload {n_gpu}/{cfg.n_layers} layers on the GPU")

    all_active = " (all active: cut-off -inf, K = d_ff)" if args.all_active else ""
    header = [
        f"# Hybrid decode: {cfg.name}",
        "",
        f"- {machine_line(machine(load_before))}",
        (f"- accelerator: {accelerator.device_kind} ({accelerator.platform}); "
         f"host: {host.device_kind} ({host.platform}, {os.cpu_count()} cores)"),
        f"- command: `{' '.join([pathlib.Path(sys.executable).name, *sys.argv])}`",
        f"- model: {n_params / 1e9:.3f} B parameters, {gib(b.model)} in {dtype.name}; CPU side in {host_dtype.name}",
        (f"- activity: power law exponent {args.skew}, mean active {args.mean_active:.0%} (+-15% per layer); "
         f"hottest 20% of neurons carry {top20:.1%} of activations; predictors (rank {rank}) select "
         f"{activity.selected.mean() / cfg.d_ff:.1%} of the neurons per held-out token; K per layer "
         f"{min(ks)}..{max(ks)} (mean {np.mean(ks):.0f}){all_active}"),
        (f"- GPU budget: {fraction:g} of the model = {b.budget} B ({gib(b.budget)}); the hybrid's non-FFN part "
         f"{gib(b.hybrid_fixed)} (attention and norms {gib(cfg.n_layers * b.attention)}, embeddings and head "
         f"{gib(b.top)}, predictors {gib(b.predictors)}, KV cache of {kv_slots} positions "
         f"{gib(cfg.n_layers * b.kv)})"),
        (f"- hybrid: {n_hot} neurons on the GPU ({hot_fraction:.2%} of the FFN neurons), activation share on the "
         f"GPU {share:.2%}; layer offload: {n_gpu} of {cfg.n_layers} layers on the GPU"),
        (f"- decode: greedy, {args.new_tokens} new tokens after a {PROMPT_TOKENS}-token random prompt, median of "
         "interleaved rounds (order rotating), vs dense: median of same-round ratios; device step and dispatch per "
         f"step from Engine.step_times over {args.steps} steps"),
    ]
    if b.hybrid_fixed > b.budget:
        header.append("- note: the hybrid's non-FFN part exceeds the budget: it uses that minimum, no neuron on the "
                      "GPU")

    warm = GenerationConfig(max_new_tokens=args.new_tokens)
    plans = {  # in the order of ENGINES
        "dense GPU": (lambda: Engine(model), b.model + cfg.n_layers * b.kv, "everything"),
        "hybrid": (lambda: hybrid_engine(model, predictors, masks, part_capacities(ks, masks, freqs), devices,
                                         host_dtype),
                   b.hybrid_fixed + n_hot * b.neuron,
                   f"non-FFN + {hot_fraction:.1%} of the neurons ({share:.1%} of activations)"),
        "layer offload": (lambda: offload_engine(model, n_gpu, devices, host_dtype),
                          b.top + n_gpu * (b.attention + b.ffn + b.kv),
                          f"embeddings, head, layers 0..{n_gpu - 1}" if n_gpu else "embeddings, head"),
        "sparse GPU": (lambda: sparse_engine(model, predictors, ks), b.model + b.predictors + cfg.n_layers * b.kv,
                       "everything, neuron-major"),
    }
    rows: dict[str, Row] = {}
    engines: dict[str, Engine] = {}
    for name, (build, gpu_bytes, where) in plans.items():
        if name not in args.engines:
            continue
        row = rows[name] = Row(name, gpu_bytes, where)
        stats = accelerator.memory_stats() or {}  # None on the CPU
        room = stats.get("bytes_limit", math.inf) - stats.get("bytes_in_use", 0)
        if name == "sparse GPU" and room < 1.2 * cfg.n_layers * b.ffn:
            row.note = "skipped: no room on the GPU for a neuron-major copy of the FFNs"
        elif left() < 0.4 * args.max_seconds:
            row.note = "skipped: --max-seconds"
        elif engine := build_and_compile(row, build, warm):
            engines[name] = engine
        if row.note.startswith("skipped"):
            log(f"{name}: {row.note}")
        gc.collect()

    prompt = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, PROMPT_TOKENS).tolist()

    def time_left(r: int, so_far: Rounds) -> bool:
        round_s = sum(run.seconds for run in so_far.rounds[-1].values()) if so_far.rounds else 0.0
        if r and round_s > left() - 30:
            log(f"rounds stopped after {r}: --max-seconds")
            return False
        return True

    def record(r: int, so_far: Rounds) -> None:
        done = so_far.rounds[r]
        for name, run in done.items():
            rows[name].tps[r] = run.result.decode_tokens_per_s
            rows[name].tokens = rows[name].tokens or run.result.token_ids
        log(f"round {r + 1} ({sum(run.seconds for run in done.values()):.1f} s): "
            + ", ".join(f"{n} {rows[n].tps[r]:.1f} tok/s" for n in done))
        write(table(list(rows.values()), header), args.out)

    def drop(name: str, err: BaseException) -> None:
        failed(rows[name], err)
        del engines[name]

    interleaved_rounds({name: (lambda r, e=engine: e.generate(prompt, warm)) for name, engine in engines.items()},
                       args.rounds, warm={name: (lambda: None) for name in engines},  # compiled when built
                       before_round=time_left, after_round=record, on_error=drop)

    for name, engine in engines.items():
        if left() < 5 + (args.steps + 2) / statistics.median(rows[name].tps.values() or [1.0]):
            log(f"{name}: step times skipped: --max-seconds")
            continue
        rows[name].step = engine.step_times(prompt, args.steps)
        log(f"{name}: device step {rows[name].step[0] * 1e3:.2f} ms, dispatch {rows[name].step[1] * 1e3:.2f} ms")
    if "hybrid" in engines and left() > 10:
        cold = cold_side_seconds(engines["hybrid"].stepper, activity.held_out)
        rows["hybrid"].note = f"CPU side alone {cold * 1e3:.2f} ms/token"
        log(f"hybrid: {rows['hybrid'].note}")

    differ = [n for n in engines if "dense GPU" in engines and rows[n].tokens != rows["dense GPU"].tokens]
    if args.all_active:
        verdict = ("no dense engine to compare with" if "dense GPU" not in engines else
                   f"tokens differ from dense: {', '.join(differ)}" if differ else "every engine gave the dense tokens")
        header.append(f"- all active: {verdict}")
        log(verdict)
    publish(table(list(rows.values()), header), args.out,
            {"machine": machine(load_before), "model": cfg.name, "budget": fraction, "new_tokens": args.new_tokens,
             "rows": [dataclasses.asdict(r) for r in rows.values()]})
    if args.all_active and dtype == jnp.float32:  # exact arithmetic up to summation order: the tokens must agree
        assert "dense GPU" in engines and not differ, verdict
    log(f"done{f', table in {args.out}' if args.out else ''}")


if __name__ == "__main__":
    main()
