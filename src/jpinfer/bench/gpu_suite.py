"""jpinfer bench-gpu (``python -m jpinfer.bench gpu``): everything a lent GPU machine should measure, in one run.

Parts, in order, each started only when its estimated cost fits the time left (``--max-seconds``):
1. checks: every Pallas kernel variant and XLA's gather against a float64 reference of the listed-neuron
   FFN, the fixed-list decode (every neuron listed) and the hybrid (every neuron active) against the float32
   dense decode, in bfloat16 (``gpu_checks``: the tolerances and where they come from);
2. kernels: the accelerator table at the 7B layer shape (``chain_kernels``: dense, every variant, XLA's
   gather; 50/80/90/95% sparsity; 1 and 4 tokens);
3. fixed list: a 7B-shaped decode with fixed random neuron lists at 80 and 90% against dense (``fixed_list``);
4. hybrid, hybrid_int4: the budget sweep, 7B shapes in bfloat16 and in int4 (random weights drawn in the format):
   at each GPU budget of ``HYBRID_BUDGETS`` (fractions of the model's bytes in its format), hot neurons on the GPU
   and cold ones on the CPU against layer offload (whole layers, the rest on the CPU in the same format), with
   dense on the GPU (the whole model fits there: the upper bound) as each budget's reference (``synthetic``:
   synthetic activity, oracle predictors); each budget gets an equal share of the part's time left, and a
   budget or engine that does not fit its share is noted as skipped;
5. modes: the default model's dense, sparse and hybrid engines in bfloat16, budget 0.75 (``synthetic``); random
   weights of its shape where the model package is missing (the output says which).
A part's cost is estimated as its prior (seconds on an H200; ``--tiny``: on two CPU cores) scaled by the
measured/prior ratio of the parts already run; a part that would not fit is skipped with that reason, and
a part's inner loops (sparsities, engines, rounds) stop at its share of the time left. The markdown
(``gpu_suite.md``) and its data (``gpu_suite.json``, read by bench/report.py) are rewritten after every part
into ``--out``, so a run cut short still leaves what it measured.

``--tiny`` shrinks every shape so the whole suite runs on the CPU (Pallas in interpret mode, two
simulated CPU devices for the hybrid) as a check of the suite, not a timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench import chain_kernels, gpu_checks, synthetic
from jpinfer.bench.fixed_list import fixed_list_engine, fixed_list_name, listed_count
from jpinfer.bench.layer_offload import LLAMA2_7B, TINY, random_weights
from jpinfer.bench.protocol import interleaved_rounds, load_average, log, machine, machine_line, matching_prefix
from jpinfer.bench.results import command_line, error_text, markdown_table
from jpinfer.bench.results import format_cell as fmt
from jpinfer.config import ModelConfig
from jpinfer.errors import CheckpointError
from jpinfer.models.loading import LoadedModel
from jpinfer.modes.devices import default_devices
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import MIN_PROMPT_BUCKET, GenerationConfig

SUITE_VERSION = 1
MARKDOWN, DATA = "gpu_suite.md", "gpu_suite.json"
KERNEL_SPARSITIES = (0.5, 0.8, 0.9, 0.95)
DECODE_SPARSITIES = (0.8, 0.9)
# of the model's bytes in its format. bfloat16 7B: the hybrid's non-FFN part (embeddings, head, attention, KV cache)
# takes ~0.38 of the model, so 0.2 puts no neuron on the GPU; 0.4 was the first record's one budget (~11 of 32
# layers offloaded). Four budgets, not nine: each builds its engines, and the one-budget part took 148-213 s on the
# H200 (bench/results/gpu_suite.md)
HYBRID_BUDGETS = (0.2, 0.4, 0.6, 0.8)
HYBRID_FORMATS = {"hybrid": "float", "hybrid_int4": "int4"}  # part -> the weights format of its sweep
SWEEP_ENGINES = ("dense GPU", "hybrid", "layer offload")
FORMAT_NAMES = {"float": "bfloat16", "int4": "int4 (float arrays bfloat16)"}
MODES = ("dense GPU", "sparse GPU", "hybrid")  # the default model's modes (layer offload is not one of jpinfer's)
# The default pack's placement budget (bench/results/REPORT.md, "Pack"); at 0.4 the default model's non-FFN part
# (tied head, attention, predictors) alone would exceed the budget and no neuron would reach the GPU.
MODES_BUDGET = 0.75
CHECK_BUDGET = 0.75  # the checks' 2-layer model is mostly embeddings: a larger share leaves room for hot neurons
# SmolLM2-135M-Instruct's configuration (its GGUF's metadata), for random weights without the model package
DEFAULT_MODEL_SHAPE = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                  d_ff=1536, rope_theta=100000.0, max_position=8192, tie_embeddings=True,
                                  name="SmolLM2-135M shapes, random weights")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape and count of one run: the H200 run's, or the CPU check's (``--tiny``)."""

    decoder: ModelConfig  # the fixed-list and hybrid decodes
    check_decoder: ModelConfig  # the decode checks
    default_model: ModelConfig  # the modes' random-weight stand-in
    kernel_shape: tuple[int, int]  # (d_model, d_ff) of the kernel table and checks
    kernel_layers: int
    kernel_sparsities: tuple[float, ...]
    rounds: int
    kernel_rounds: int
    new_tokens: int
    rank: int  # the synthetic predictors'
    hybrid_budgets: tuple[float, ...]
    priors: dict[str, float]  # part -> its expected seconds


def sizes(tiny: bool) -> Sizes:
    if tiny:
        small_default = dataclasses.replace(DEFAULT_MODEL_SHAPE, vocab_size=256, d_model=64, n_layers=2, n_heads=2,
                                            n_kv_heads=1, head_dim=32, d_ff=256, name="tiny default-model shapes")
        two_layers = dataclasses.replace(TINY, n_layers=2, name="tiny (2 layers), random weights")
        return Sizes(decoder=two_layers, check_decoder=two_layers, default_model=small_default, kernel_shape=(256, 512),
                     kernel_layers=2, kernel_sparsities=(0.5, 0.9), rounds=2, kernel_rounds=2, new_tokens=8, rank=16,
                     hybrid_budgets=(0.5, CHECK_BUDGET),
                     priors=dict(checks=15, kernels=15, fixed_list=10, hybrid=15, hybrid_int4=15, modes=10))
    return Sizes(decoder=LLAMA2_7B,
                 check_decoder=dataclasses.replace(LLAMA2_7B, n_layers=2, name="Llama-2-7B shapes, 2 layers"),
                 default_model=DEFAULT_MODEL_SHAPE, kernel_shape=(LLAMA2_7B.d_model, LLAMA2_7B.d_ff), kernel_layers=8,
                 kernel_sparsities=KERNEL_SPARSITIES, rounds=3, kernel_rounds=5, new_tokens=32, rank=128,
                 hybrid_budgets=HYBRID_BUDGETS,
                 # seconds the parts took on one H200 (2026-12-04, bench/results/gpu_suite.md: 39-46, 27, 30; the
                 # hybrid at one budget 148-213 and the modes 38-108 with engines skipped for time, so rounded up);
                 # the int4 sweep not measured yet: the bfloat16 one's. A sweep takes the share it is given.
                 priors=dict(checks=45, kernels=30, fixed_list=30, hybrid=170, hybrid_int4=170, modes=110))


class Clock:
    """The run's time budget: estimates from priors scaled by what ran, and each part's share of what is left."""

    def __init__(self, max_seconds: float, priors: dict[str, float]) -> None:
        self.start = time.perf_counter()
        self.max_seconds = max_seconds
        self.priors = priors
        self.spent: dict[str, float] = {}  # part -> measured seconds (parts that ran)
        self.done: set[str] = set()  # parts run or skipped
        self.deadline = self.part_deadline = self.began = self.window_began = self.start

    def left(self) -> float:
        return self.max_seconds - (time.perf_counter() - self.start)

    def scale(self) -> float:
        """Measured over prior seconds of the parts run so far (1 before any): the machine's pace against the
        priors' (at least 0.25: one fast part does not make the rest free)."""
        if not self.spent:
            return 1.0
        return max(0.25, sum(self.spent.values()) / sum(self.priors[p] for p in self.spent))

    def estimate(self, part: str) -> float:
        return self.priors[part] * self.scale()

    def begin(self, part: str) -> None:
        """Start ``part``: its inner loops may use its share of the time left (proportional to its prior among
        the parts not run yet), at least its estimate."""
        rest = [p for p in self.priors if p not in self.done]
        share = self.left() * self.priors[part] / sum(self.priors[p] for p in rest)
        self.deadline = self.part_deadline = time.perf_counter() + min(self.left(), max(share, self.estimate(part)))
        self.began = self.window_began = time.perf_counter()

    def share(self, cells: int) -> bool:
        """Narrow the running part's deadline to the next of its ``cells`` inner cells left (a sweep's budgets): an
        equal share of the part's time left, so an early cell cannot take a later one's (what a cell leaves goes to
        the cells after it). False when the part's time is spent."""
        now = time.perf_counter()
        self.window_began, self.deadline = now, now + max(0.0, self.part_deadline - now) / cells
        return self.deadline > now

    def end(self, part: str) -> float:
        self.done.add(part)
        self.spent[part] = time.perf_counter() - self.began
        return self.spent[part]

    def skip(self, part: str) -> None:
        self.done.add(part)

    def part_left(self) -> float:
        return self.deadline - time.perf_counter()


# ----- decodes: engines built in turn, then interleaved rounds


def decode_rows(builds: dict[str, tuple[Callable[[], Engine], dict]], vocab_size: int, clock: Clock, rounds: int,
                new_tokens: int, seed: int) -> list[dict]:
    """One row per engine (``builds``: name -> (build, extra fields of its row); "dense"-like first, the
    reference): decode tok/s per round and their median, the median of same-round ratios to the first
    engine, greedy agreement (prefix) with it. Engines not built in time, rounds not started in time and
    engines that fail are noted in their rows."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    prompt = np.random.default_rng(seed + 1).integers(0, vocab_size, MIN_PROMPT_BUCKET).tolist()
    rows = {name: dict(engine=name, **extra, tok_s=None, rounds=[], vs_dense=None, agreement=None, note="")
            for name, (_, extra) in builds.items()}
    engines = {}
    for name, (build, _) in builds.items():
        if clock.part_left() < 0.3 * (clock.deadline - clock.window_began):
            rows[name]["note"] = "skipped: time (its part's share of --max-seconds)"
            log(f"{name}: {rows[name]['note']}")
            continue
        log(f"{name}: building and compiling")
        try:
            engine = build()
            engine.warmup(len(prompt), config)
        except Exception as err:  # one failed engine must not cost the others' rows
            rows[name]["note"] = f"failed: {error_text(err)}"
            log(f"{name}: {rows[name]['note']}")
            continue
        engines[name] = engine
        gc.collect()

    def in_time(r: int, so_far) -> bool:
        last = sum(run.seconds for run in so_far.rounds[-1].values()) if so_far.rounds else 0.0
        if r and last > clock.part_left():
            log(f"rounds stopped after {r}: time")
            return False
        return True

    def drop(name: str, err: BaseException) -> None:
        rows[name]["note"] = f"failed: {error_text(err)}"
        log(f"{name}: {rows[name]['note']}")

    measured = interleaved_rounds({n: (lambda r, e=e: e.generate(prompt, config)) for n, e in engines.items()},
                                  rounds, warm={n: (lambda: None) for n in engines}, before_round=in_time,
                                  on_error=drop, after_round=lambda r, so_far: log(f"round {r + 1}: " + ", ".join(
                                      f"{n} {run.result.decode_tokens_per_s:.1f} tok/s"
                                      for n, run in so_far.rounds[r].items())))
    rate = lambda result: result.decode_tokens_per_s
    reference = next(iter(builds))
    ref_result = (measured.results(reference) or [None])[0]
    for name in engines:
        if not measured.values(name, rate):
            continue
        row = rows[name]
        row.update(rounds=measured.values(name, rate), tok_s=measured.median(name, rate))
        if measured.ratios(name, reference, rate):
            row["vs_dense"] = measured.median_ratio(name, reference, rate)
        tokens = measured.results(name)[0].token_ids
        if ref_result is not None:
            row["agreement"] = f"{matching_prefix(tokens, ref_result.token_ids)}/{len(ref_result.token_ids)}"
    return list(rows.values())


def random_model(cfg: ModelConfig, device: Any, seed: int, fmt: str = "float") -> LoadedModel:
    """A LoadedModel of ``cfg``'s shapes with random weights on ``device`` in ``fmt`` (its float arrays bfloat16;
    tied: no input embedding)."""
    weights = jax.block_until_ready(random_weights(cfg, jnp.bfloat16, device, seed, fmt=fmt))
    if cfg.tie_embeddings:
        weights = dataclasses.replace(weights, embed=None)
    return LoadedModel(cfg, weights, None, cfg.name)


# ----- the parts


def part_checks(s: Sizes, args: argparse.Namespace, devices: tuple[Any, Any], interpret: bool) -> dict:
    d_model, d_ff = s.kernel_shape
    checks = gpu_checks.kernel_checks(d_model, d_ff, 0.9, interpret, args.seed)
    for c in checks:
        log(c.line())
    model = random_model(s.check_decoder, devices[0], args.seed)
    setup = synthetic.budget_setup(model, CHECK_BUDGET, devices, new_tokens=1, rank=s.rank, all_active=True,
                                   seed=args.seed)
    decodes = gpu_checks.decode_checks(model, {
        "fixed-list decode, every neuron listed": lambda: gpu_checks.full_list_engine(model),
        f"hybrid decode, every neuron active ({setup.data['hot_neurons']} hot on the accelerator)":
            setup.plans["hybrid"].build}, args.seed)
    for c in decodes:
        log(c.line())
    rows = [dataclasses.asdict(c) for c in checks + decodes]
    return dict(passed=all(r["passed"] for r in rows), rows=rows, decode_model=s.check_decoder.name)


def part_kernels(s: Sizes, args: argparse.Namespace, clock: Clock, interpret: bool) -> dict:
    device = jax.devices()[0]
    d_model, d_ff = s.kernel_shape
    bandwidth = chain_kernels.copy_bandwidth(device, n_bytes=(1 << 24) if args.tiny else (1 << 30))
    chain = chain_kernels.random_chain(d_model, d_ff, "swiglu", s.kernel_layers, jnp.bfloat16, args.seed)
    tables = []
    for tokens in (1, 4):
        if clock.part_left() <= 0:
            log(f"kernels, {tokens} tokens: skipped (time)")
            break
        rows = chain_kernels.chain_rows(chain, s.kernel_sparsities, tokens, s.kernel_rounds, bandwidth, interpret,
                                        args.seed, log=log, stop=lambda: clock.part_left() <= 0)
        tables.append(dict(tokens=tokens, rows=rows))
    return dict(d_model=d_model, d_ff=d_ff, layers=s.kernel_layers, dtype="bfloat16", copy_bandwidth=bandwidth,
                sparsities=list(s.kernel_sparsities), tables=tables)


def part_fixed_list(s: Sizes, args: argparse.Namespace, clock: Clock, devices: tuple[Any, Any]) -> dict:
    model = random_model(s.decoder, devices[0], args.seed)
    builds = {"dense": (lambda: Engine(model), {})}
    for sparsity in DECODE_SPARSITIES:
        k = listed_count(s.decoder.d_ff, sparsity)
        builds[fixed_list_name(sparsity, k)] = (lambda sparsity=sparsity: fixed_list_engine(model, sparsity, args.seed),
                                                dict(sparsity=sparsity, k=k))
    rows = decode_rows(builds, s.decoder.vocab_size, clock, s.rounds, s.new_tokens, args.seed)
    # the fields bench/modelled_speed.py compares with its cost model
    return dict(device=devices[0].device_kind, model=s.decoder.name, dtype="bfloat16", new_tokens=s.new_tokens,
                median={r["engine"]: r["tok_s"] for r in rows if r["tok_s"] is not None}, rows=rows)


def budget_rows(model: Any, s: Sizes, args: argparse.Namespace, clock: Clock, devices: tuple[Any, Any],
                fractions: tuple[float, ...], engines: tuple[str, ...] | None = None) -> dict:
    """The engines (default: all) of ``synthetic.budget_setup`` timed side by side at each budget of ``fractions``
    (each an equal share of the part's time left; sparse GPU skipped without room); a row per engine and budget."""
    facts, setups, rows = [], [], []
    for i, fraction in enumerate(fractions):
        if not clock.share(len(fractions) - i):
            rows.append(dict(engine="every engine", budget=fraction,
                             note="skipped: time (its part's share of --max-seconds)"))
            log(f"budget {fraction:g}: skipped (time)")
            continue
        setup = synthetic.budget_setup(model, fraction, devices, new_tokens=s.new_tokens, rank=s.rank, seed=args.seed)
        stats = devices[0].memory_stats() or {}  # None on the CPU
        room = stats.get("bytes_limit", float("inf")) - stats.get("bytes_in_use", 0)
        plans = {name: plan for name, plan in setup.plans.items() if engines is None or name in engines}
        skipped = []
        if "sparse GPU" in plans and room < 1.2 * setup.neuron_major_bytes:
            del plans["sparse GPU"]
            skipped.append(dict(engine="sparse GPU", note="skipped: no room on the GPU for a neuron-major copy"))
        builds = {name: (p.build, dict(budget=fraction, gpu_bytes=p.gpu_bytes, where=p.where))
                  for name, p in plans.items()}
        rows += decode_rows(builds, model.cfg.vocab_size, clock, s.rounds, s.new_tokens, args.seed)
        rows += [dict(row, budget=fraction) for row in skipped]
        facts += setup.facts
        setups.append(setup.data)
        gc.collect()  # the budget's engines (their host copies) before the next budget's
    return dict(model=model.cfg.name, new_tokens=s.new_tokens, facts=list(dict.fromkeys(facts)), setups=setups,
                rows=rows)


def part_hybrid(s: Sizes, args: argparse.Namespace, clock: Clock, devices: tuple[Any, Any], fmt: str) -> dict:
    model = random_model(s.decoder, devices[0], args.seed, fmt)
    out = budget_rows(model, s, args, clock, devices, s.hybrid_budgets, engines=SWEEP_ENGINES)
    return dict(out, format=fmt)


def default_model(s: Sizes, args: argparse.Namespace, device: Any) -> tuple[LoadedModel, str]:
    """(the default model in bfloat16, where it came from): its weights where it loads (not with --tiny), else
    random weights of its shape, the reason said."""
    if args.tiny:
        reason = "--tiny"
    else:
        try:  # imported here: loading a model needs packages (gguf, transformers) the rest of the suite does not
            from jpinfer.api import load

            with jax.default_device(device):
                return load(dtype="bfloat16").model, "the default model's weights"
        except (ImportError, CheckpointError) as err:  # no model package (the GPU machine), or no GGUF reader
            reason = error_text(err)
            log(f"default model: {reason}; random weights of its shape")
    return random_model(s.default_model, device, args.seed), f"random weights of its shape ({reason})"


def part_modes(s: Sizes, args: argparse.Namespace, clock: Clock, devices: tuple[Any, Any]) -> dict:
    model, source = default_model(s, args, devices[0])
    out = budget_rows(model, s, args, clock, devices, (MODES_BUDGET,), engines=MODES)
    return dict(out, weights=source)


# ----- output


def decode_table(rows: list[dict]) -> list[str]:
    """Rows of ``decode_rows``; with a budget column where they hold budgets (a sweep: vs dense is against the
    dense row of the same budget's rounds)."""
    budgets = any("budget" in r for r in rows)
    return markdown_table(
        ["budget"] * budgets + ["engine", "on the GPU", "decode tok/s (median)", "rounds", "vs dense",
                               "greedy agreement (prefix)", "note"],
        [[fmt(r.get("budget"), "g")] * budgets + [
            r["engine"], r.get("where", "everything"), fmt(r.get("tok_s"), ".1f"),
            ", ".join(f"{t:.1f}" for t in r.get("rounds", [])) or "-", fmt(r.get("vs_dense"), ".3f"),
            r.get("agreement") or "-", r.get("note", "")] for r in rows])


def part_note(part: dict) -> str:
    """A part's reason (skipped, failed) and, for a part kept by ``--update``, the run that measured it."""
    run = part.get("run")
    earlier = f"measured by an earlier run: {machine_line(run['machine'])} `{run['command']}`" if run else ""
    return "; ".join(text for text in (part.get("reason", ""), earlier) if text)


def markdown(data: dict) -> str:
    lines = ["# GPU suite", "", f"- {machine_line(data['machine'])}", f"- {command_line(data['command'])}",
             f"- --max-seconds {data['max_seconds']:g}; elapsed {data['elapsed_s']:.0f} s"
             + ("; --tiny: shrunk shapes on the CPU, Pallas in interpret mode: a check of the suite, not a timing"
                if data["tiny"] else ""), "", "| part | status | seconds (estimate) | note |", "|---|---|---|---|"]
    lines += [f"| {p['name']} | {p['status']} | {fmt(p.get('seconds'), '.0f')} ({p['estimate_s']:.0f}) | "
              f"{part_note(p)} |" for p in data["parts"]]
    if checks := data.get("checks"):
        lines += ["", "## Checks (bfloat16)", "", f"All passed: {'yes' if checks['passed'] else 'NO'}.", ""]
        lines += [f"- {'PASS' if c['passed'] else 'FAIL'} {c['name']}: {c['detail']}" for c in checks["rows"]]
    if kernels := data.get("kernels"):
        lines += ["", f"## Sparse FFN kernels: d_model {kernels['d_model']}, d_ff {kernels['d_ff']}, "
                  f"{kernels['layers']} layers chained, bfloat16", "",
                  f"Copy bandwidth {kernels['copy_bandwidth'] / 1e12:.3f} TB/s. effic. = speedup over dense x (1 - s).",
                  ""]
        for t in kernels["tables"]:
            lines += [f"{t['tokens']} token(s):", "", chain_kernels.table(t["rows"]), ""]
    if fixed := data.get("fixed_list"):
        lines += ["", f"## Fixed-list sparse decode: {fixed['model']}", "",
                  f"Random fixed lists per layer, greedy, {fixed['new_tokens']} new tokens after a 16-token prompt; "
                  "median of interleaved rounds; vs dense: median of same-round ratios.", ""]
        lines += decode_table(fixed["rows"])
    for key, title in (("hybrid", "Hybrid against layer offload"), ("hybrid_int4", "Hybrid against layer offload"),
                       ("modes", "The default model's modes")):
        if part := data.get(key):
            weights = f", {FORMAT_NAMES[part['format']]}" if "format" in part else ""
            lines += ["", f"## {title}: {part['model']}{weights}", ""]
            if "weights" in part:
                lines += [f"- weights: {part['weights']}, bfloat16"]
            lines += [f"- {fact}" for fact in part["facts"]] + [""]
            lines += decode_table(part["rows"])
    return "\n".join(lines) + "\n"


def earlier_record(args: argparse.Namespace) -> dict | None:
    """The record ``--update`` keeps parts of (None without --update); refused where it cannot be merged."""
    if not args.update:
        return None
    path = None if args.out is None else args.out / DATA
    if not args.parts or path is None or not path.is_file():
        raise ValueError(f"--update needs --parts and a {DATA} in --out to update")
    earlier = json.loads(path.read_text())
    if earlier.get("version") != SUITE_VERSION or earlier.get("tiny") != args.tiny:
        raise ValueError(f"{path} is of another suite version or size (--tiny); run the whole suite instead")
    return earlier


def carried(data: dict, earlier: dict | None, s: Sizes) -> dict:
    """``data`` with the parts it did not run (or skipped for time) taken from ``earlier`` (``--update``), in the
    suite's order; each carried part keeps the machine and command of the run that measured it."""
    if earlier is None:
        return data
    now = {p["name"]: p for p in data["parts"]}
    old = {p["name"]: p for p in earlier["parts"]}
    merged = dict(data, parts=[])
    measured = lambda entry: entry is not None and entry["status"] != "skipped"
    for name in s.priors:
        if measured(old.get(name)) and not measured(now.get(name)):
            entry = dict(old[name])
            entry.setdefault("run", dict(machine=earlier["machine"], command=earlier["command"]))
            merged["parts"].append(entry)
            if name in earlier:
                merged[name] = earlier[name]
        elif name in now:
            merged["parts"].append(now[name])
    return merged


def write(data: dict, out: pathlib.Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKDOWN).write_text(markdown(data))
        (out / DATA).write_text(json.dumps(data, indent=1, default=float))


# ----- the command


def add_arguments(ap: argparse.ArgumentParser, command: str = "bench-gpu") -> None:
    ap.add_argument("--out", type=pathlib.Path, help=f"directory for {MARKDOWN} and {DATA}")
    ap.add_argument("--max-seconds", type=float, default=420.0, help="wall-clock bound of the whole suite")
    ap.add_argument("--tiny", action="store_true", help="shrunk shapes on the CPU: a check of the suite, not a timing")
    ap.add_argument("--parts", nargs="+", choices=["checks", "kernels", "fixed_list", *HYBRID_FORMATS, "modes"],
                    help="run only these parts (default: all)")
    ap.add_argument("--update", action="store_true",
                    help=f"with --parts: keep the other parts' results from the {DATA} already in --out (each part "
                         "then names the run that measured it)")
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """The suite; exit status 1 when a check failed (the timings still run and are written)."""
    try:  # before JAX starts: without a GPU, CPU device 1 plays the host
        jax.config.update("jax_num_cpu_devices", 2)
    except RuntimeError:  # JAX started with another count: default_devices says what to do
        pass
    if args.max_seconds <= 0:
        raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
    earlier = earlier_record(args)
    load_before = load_average()
    start = time.perf_counter()
    s = sizes(args.tiny)
    chosen = args.parts or list(s.priors)
    clock = Clock(args.max_seconds, {p: s.priors[p] for p in chosen})
    devices = default_devices()
    interpret = devices[0].platform == "cpu"
    if interpret and not args.tiny:
        log("no GPU: the full shapes on the CPU take hours; --tiny checks the suite")
    log(f"jax {jax.__version__}; accelerator {devices[0].device_kind} ({devices[0].platform}), host {devices[1]}")
    command = " ".join(["python -m jpinfer.bench gpu", *sys.argv[2:]]) if sys.argv[1:2] == ["gpu"] else \
        " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]])
    data: dict[str, Any] = dict(suite="gpu", version=SUITE_VERSION, command=command, tiny=args.tiny,
                                max_seconds=args.max_seconds, elapsed_s=0.0, parts=[],
                                machine=machine(load_before))
    parts: dict[str, Callable[[], dict]] = {
        "checks": lambda: part_checks(s, args, devices, interpret),
        "kernels": lambda: part_kernels(s, args, clock, interpret),
        "fixed_list": lambda: part_fixed_list(s, args, clock, devices),
        **{part: lambda fmt=fmt: part_hybrid(s, args, clock, devices, fmt) for part, fmt in HYBRID_FORMATS.items()},
        "modes": lambda: part_modes(s, args, clock, devices),
    }
    for name in chosen:
        estimate = clock.estimate(name)
        entry: dict[str, Any] = dict(name=name, estimate_s=estimate)
        data["parts"].append(entry)
        if estimate > clock.left():
            entry.update(status="skipped", reason=f"estimated {estimate:.0f} s (prior {clock.priors[name]:g} s x "
                         f"{clock.scale():.2f}, the measured/prior ratio so far) > {clock.left():.0f} s left")
            clock.skip(name)
            log(f"{name}: {entry['reason']}")
            continue
        log(f"{name}: starting (estimate {estimate:.0f} s, {clock.left():.0f} s left)")
        clock.begin(name)
        try:
            data[name] = parts[name]()
            entry["status"] = "ran"
        except Exception as err:  # one part's failure must not cost the others' results
            entry.update(status="failed", reason=error_text(err))
            log(f"{name}: failed: {entry['reason']}")
        entry["seconds"] = clock.end(name)
        gc.collect()
        data["machine"] = machine(load_before)
        data["elapsed_s"] = time.perf_counter() - start
        write(carried(data, earlier, s), args.out)
    data["elapsed_s"] = time.perf_counter() - start
    data = carried(data, earlier, s)
    write(data, args.out)
    print(markdown(data))
    checks = data.get("checks")
    return 1 if checks is not None and not checks["passed"] else 0
