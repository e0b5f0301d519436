"""jpinfer bench (python -m jpinfer.bench): every engine side by side on the paper's protocol.

Engines: jpinfer's modes (dense, sparse, hybrid, threshold; the sparse ones read a pack: the
default model's is built into the cache on first use), then the peers that are installed:
llama.cpp (extra ``peers``) on a float32 GGUF of the same weights and on the original file, each in
a process of its own (``child``: a peer that crashes or hangs is reported and dropped, the bench goes
on), and transformers' PyTorch eager model. Protocol (PowerInfer, Song et al., 2023): prompts of 8, 64
and 128 tokens sampled with a seed from the ChatGPT prompts and Alpaca (``prompts``), 128 greedy
output tokens, batch 1, plus one long prompt. Each round draws new prompts and runs every engine
on each (``protocol.interleaved_rounds``: the engine order rotating), so machine load hits all
alike; ratios to dense are medians of same-round ratios. Every engine compiles (or loads its
compiled programs) for each prompt length before the first round, untimed. Accuracy: WikiText-2
test perplexity of what each engine decodes with (``accuracy``), greedy agreement with dense
(``protocol.prefix_agreement``), neurons computed and clipped.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
from typing import Any, Mapping

import jax
import numpy as np
from tqdm.auto import tqdm

from jpinfer.bench.child import ChildEngine, EngineFailed
from jpinfer.bench.protocol import (
    AGREEMENT_LABELS,
    AGREEMENT_MEANINGS,
    TEST_WINDOWS,
    interleaved_rounds,
    load_average,
    machine,
    machine_line,
    prefix_agreement,
)
from jpinfer.bench.results import command_line, format_cell, markdown_table
from jpinfer.commands.args import add_mode_arguments, mode_options, prepare_devices
from jpinfer.config import WEIGHT_FORMATS
from jpinfer.modes import MODE_NAMES, REFERENCE_MODE, ModeInputs, get_mode

PEERS = ("llama.cpp", "transformers")
# Environment settings that change what the bench runs (the XLA path instead of the native kernels, another
# native library): the recorded command carries them, so that it reproduces the run.
RUN_SETTINGS = ("JPINFER_NATIVE", "JPINFER_NATIVE_LIBRARY")
LENGTHS = (8, 64, 128)
LONG_PROMPT = 1024


def _rss_mb() -> float:
    """The process's resident memory now (MB; Linux), or its peak so far elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        return _peak_rss_mb()


def _packs(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    """Per weights format, the pack its sparse modes read (a ``pack.Pack``; none where they need none or were
    given their predictors and profile): --pack for every format (one prepared for another format is refused
    with what differs), or for the default model its pack in each format (built on first use: an int8 or int4
    model's from the quantized model itself, whose activations differ)."""
    from jpinfer.pack import Pack, default_pack

    if args.pack is not None:
        pack = Pack.load(args.pack)
        return {fmt: pack for fmt in args.weights}
    formats = list(args.weights) if any(get_mode(mode).uses_pack for mode in modes) else []
    if not formats or args.predictors or args.profile or args.model is not None:
        return {}
    from jpinfer.api import load

    packs = {}
    for fmt in formats:
        print(f"the sparse modes read the default model's pack of {fmt} weights (built once into the cache, "
              "reused after)", file=sys.stderr)
        packs[fmt] = default_pack(load(None, dtype=args.dtypes[0], weights=fmt).model, progress=args.progress)
    return packs


def _main_pack(packs: dict[str, Any]) -> Any:
    """The pack results describe first and whose thresholds say what "active" means: the float one if any."""
    return packs.get("float", next(iter(packs.values()), None))


def _activity_thresholds(args: argparse.Namespace, pack: Any) -> np.ndarray | None:
    """What "active" means for the clipped-active count: the pack's or --profile's thresholds."""
    if pack is not None:
        return pack.profile.thresholds
    if args.profile:
        from jpinfer.profiler import ActivationProfile

        return ActivationProfile.load(args.profile).thresholds
    return None


def _engines(args: argparse.Namespace, modes: list[str], packs: dict[str, Any]) -> list[tuple[Any, float]]:
    """(engine, resident MB it added) for the jpinfer engines, then the peers asked for and installed."""
    from jpinfer.api import load
    from jpinfer.bench.engines import JaxEngine, TransformersEager
    from jpinfer.bench.llama_cpp import INSTALL_MESSAGE, LlamaCppEngine, float32_gguf, peer_engine

    options = mode_options(args)
    out = []

    def add(make) -> None:
        before = _rss_mb()
        try:
            engine = make()
        except EngineFailed as failure:  # a peer that cannot even load is reported, and the bench goes on
            print(f"skipping {failure}", file=sys.stderr)
            return
        out.append((engine, None if isinstance(engine, ChildEngine) else _rss_mb() - before))

    for mode in modes:
        for dtype in args.dtypes:
            for weights in args.weights:
                label = f"jpinfer {mode} {dtype}" + ("" if weights == "float" else f" {weights} weights")
                print(f"loading {label} ...", file=sys.stderr)
                add(lambda: JaxEngine(label, load(args.model, dtype=dtype, mode=mode, weights=weights,
                                                          **options | {"pack": packs.get(weights)})))
    source = pathlib.Path(out[0][0].engine.source)
    if "llama.cpp" in args.peers:
        if not LlamaCppEngine.available():
            print(f"skipping llama.cpp: {INSTALL_MESSAGE}", file=sys.stderr)
        elif source.is_dir():
            print("skipping llama.cpp: it reads GGUF files and the model is a Hugging Face directory", file=sys.stderr)
        else:
            print("llama.cpp: a float32 GGUF of the same weights (written into the cache on first use) ...",
                  file=sys.stderr)
            f32 = float32_gguf(source)
            longest = max([*args.lengths, args.long_prompt]) + args.max_new_tokens
            for path in (f32, source):  # each in its own process: a crash there is that peer's alone
                add(lambda: peer_engine(path, n_threads=args.threads, n_ctx=max(2048, longest)))
            if len(out) > 1 and out[-1][0].name == out[-2][0].name:  # the file is float32 already
                out.pop()[0].close()
    if "transformers" in args.peers:
        if TransformersEager.available():
            add(lambda: TransformersEager(str(source)))
        else:
            print("skipping transformers eager: PyTorch is not installed (pip install 'jpinfer[bench]')",
                  file=sys.stderr)
    return out


def recorded_command(argv: list[str], environ: Mapping[str, str]) -> str:
    """The command that reproduces this run: ``RUN_SETTINGS`` that are set, then ``jpinfer bench`` and its
    arguments (``argv`` of ``jpinfer bench ...`` or of ``python -m jpinfer.bench ...``)."""
    settings = [f"{name}={shlex.quote(environ[name])}" for name in RUN_SETTINGS if name in environ]
    arguments = argv[2:] if argv[1:2] == ["bench"] else argv[1:]
    return " ".join([*settings, "jpinfer bench", *arguments])


def bench(args: argparse.Namespace) -> dict:
    """Run the protocol; returns everything measured (what --json writes)."""
    from jpinfer.bench import accuracy
    from jpinfer.bench.engines import dropped
    from jpinfer.bench.prompts import sample_prompts

    modes = args.modes
    packs = _packs(args, modes)
    pack = _main_pack(packs)
    load_before = load_average()
    loaded = _engines(args, modes, packs)
    engines = [engine for engine, _ in loaded]
    first = engines[0].engine
    lengths = list(args.lengths) + ([args.long_prompt] if args.long_prompt else [])
    prompts = sample_prompts(first.tokenizer, lengths, args.rounds, args.seed)
    total = args.rounds * len(lengths) * len(engines)
    with tqdm(total=total, desc="benchmarking", unit="run", disable=not args.progress) as bar:

        def run(engine: Any) -> Any:  # one round of an engine: every prompt length once, this round's prompts
            def call(r: int) -> dict[int, Any]:
                bar.set_postfix_str(f"round {r + 1}, {engine.name}")
                return {n: engine.run(prompts[n][r], args.max_new_tokens) for n in lengths}
            return call

        def warm(engine: Any) -> Any:  # compile (or load compiled programs) for every prompt length, untimed
            def call() -> None:
                for n in lengths:
                    bar.set_postfix_str(f"compiling {engine.name} for {n} tokens")
                    engine.warm(n, args.max_new_tokens)
            return call

        measured = interleaved_rounds({str(e): run(engine) for e, engine in enumerate(engines)}, args.rounds,
                                      warm={str(e): warm(engine) for e, engine in enumerate(engines)},
                                      after_run=lambda r, name, done: bar.update(len(lengths)),
                                      on_error=dropped(EngineFailed))  # a peer's failure is its own
    failures = {int(name): str(error) for name, error in measured.errors.items()}
    kept = [e for e in range(len(engines)) if e not in failures]
    runs = {e: {n: [res[n] for res in measured.results(str(e))] for n in lengths} for e in kept}  # length -> rounds

    scores = [None] * len(engines)
    window = min(accuracy.WINDOW, first.cfg.max_position)
    if args.ppl_windows:
        dense = _dense_model(engines, args)
        windows = accuracy.wikitext_windows(first.tokenizer, args.ppl_windows, window)
        activity = _activity_thresholds(args, pack)
        for e in tqdm(kept, desc="perplexity", unit="engine", disable=not args.progress):
            try:
                scores[e] = accuracy.score(engines[e], dense, windows, activity)
            except EngineFailed as failure:
                failures[e] = f"perplexity: {failure}"
                print(f"no perplexity for {failure}", file=sys.stderr)
    return _results(args, engines, [mb for _, mb in loaded], runs, lengths, scores, packs, load_before, window,
                    measured, failures)


def _dense_model(engines: list, args: argparse.Namespace) -> Any:
    """The dense float model the predictor modes are scored with: the dense engine's, or loaded now."""
    from jpinfer.bench.engines import JaxEngine
    from jpinfer.models import quantized

    for engine in engines:
        if isinstance(engine, JaxEngine) and engine.engine.stepper.name == REFERENCE_MODE and quantized.weights_format(
                engine.engine.weights) == "float":
            return engine.engine.model
    from jpinfer.models.loading import load_model

    return load_model(args.model, dtype=args.dtypes[0])


def _decode_rate(lengths: list[int]) -> Any:
    """A round's decode tok/s over the prompts of ``lengths`` (all its decode steps over their time)."""
    return lambda res: sum(len(res[n].step_s) for n in lengths) / sum(sum(res[n].step_s) for n in lengths)


def _e2e_rate(lengths: list[int]) -> Any:
    """A round's end-to-end tok/s over the prompts of ``lengths`` (tokens out over prefill and decode time)."""
    return lambda res: sum(len(res[n].tokens) for n in lengths) / sum(res[n].total_s for n in lengths)


def _results(args, engines, resident_mb, runs, lengths, scores, packs, load_before, window, measured,
             failures) -> dict:
    """Everything measured, for the engines that finished the rounds (``runs``' keys); ``failures``:
    engine index -> why it was dropped (or lost its perplexity); ``packs``: weights format -> pack."""
    pack = _main_pack(packs)
    rounds = range(args.rounds)
    decode, e2e = _decode_rate(lengths), _e2e_rate(lengths)
    ref = "0"  # the first engine: dense
    reference = {n: [runs[0][n][r].tokens for r in rounds] for n in lengths}
    summary = []
    for e in runs:
        engine = engines[e]
        every = [s for n in lengths for s in runs[e][n]]
        steps = np.concatenate([s.step_s for s in every])
        acc = scores[e]
        summary.append(dict(
            engine=engine.name,
            prefill_tok_s=sum(s.n_prompt for s in every) / sum(s.prefill_s for s in every),
            decode_tok_s=float(measured.median(str(e), decode)),
            e2e_tok_s=float(measured.median(str(e), e2e)),
            decode_vs_dense=float(measured.median_ratio(str(e), ref, decode)),
            e2e_vs_dense=float(measured.median_ratio(str(e), ref, e2e)),
            p50_ms=1e3 * float(np.percentile(steps, 50)), p99_ms=1e3 * float(np.percentile(steps, 99)),
            resident_mb=resident_mb[e],
            perplexity=None if acc is None else acc.perplexity,
            neurons=None if acc is None else acc.neurons, clipped=None if acc is None else acc.clipped,
            clipped_active=None if acc is None else acc.clipped_active,
            greedy_agreement=float(np.mean([prefix_agreement(runs[e][n][r].tokens, reference[n][r])
                                            for n in lengths for r in rounds])),
        ))
    m = machine(load_before) | {"peak_rss_mb": _peak_rss_mb()}
    dense_ppl = summary[0]["perplexity"]
    for row in summary:
        row["ppl_vs_dense"] = row["perplexity"] / dense_ppl if row["perplexity"] and dense_ppl else None
    per_length = [dict(engine=engine.name, length=n,
                       prefill_tok_s=n * len(rounds) / sum(s.prefill_s for s in runs[e][n]),
                       ttft_ms=1e3 * float(np.median([s.prefill_s for s in runs[e][n]])),
                       decode_tok_s=float(measured.median(str(e), _decode_rate([n]))),
                       e2e_tok_s=float(measured.median(str(e), _e2e_rate([n]))),
                       decode_vs_dense=float(measured.median_ratio(str(e), ref, _decode_rate([n]))))
                  for n in lengths for e in runs for engine in [engines[e]]]
    return {
        "date": m["date"],
        "command": recorded_command(sys.argv, os.environ),
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "pack": None if pack is None else {
            "path": str(pack.path), "settings": pack.manifest["settings"],
            "stage_seconds": {stage: entry["seconds"] for stage, entry in pack.manifest["stages"].items()}},
        "packs": {fmt: str(p.path) for fmt, p in packs.items()},
        "protocol": {"lengths": list(args.lengths), "long_prompt": args.long_prompt, "rounds": args.rounds,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed, "ppl_windows": args.ppl_windows,
                     "ppl_window_tokens": window, "greedy_agreement": "prefix"},
        "machine": m,
        "engines": summary,
        "per_length": per_length,
        "failures": [{"engine": engines[e].name, "error": error} for e, error in sorted(failures.items())],
        "runs": [{"engine": engines[e].name, "length": n, "round": r, "n_prompt": s.n_prompt, "tokens": s.tokens,
                  "prefill_s": s.prefill_s, "step_s": s.step_s}
                 for e in runs for n in lengths for r, s in enumerate(runs[e][n])],
    }


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _markdown(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Rows as a markdown table of columns (title, key, format spec)."""
    return "\n".join(markdown_table([title for title, _, _ in cols],
                                     [[format_cell(row[key], spec) for _, key, spec in cols] for row in rows]))


def _pack_paths(results: dict) -> str:
    """The packs read, by weights format where there are several (results of older runs name one)."""
    packs = results.get("packs") or ({"": results["pack"]["path"]} if results["pack"] else {})
    if len(set(packs.values())) <= 1:
        return next(iter(packs.values()), "none")
    return ", ".join(f"{path} ({fmt} weights)" for fmt, path in packs.items())


def report(results: dict) -> str:
    """The bench's markdown: protocol, one row per engine, then the speeds per prompt length."""
    p, m = results["protocol"], results["machine"]
    lengths = ", ".join(str(n) for n in p["lengths"]) + (f" and {p['long_prompt']}" if p["long_prompt"] else "")
    head = [
        f"# jpinfer bench: {results['model']}", "",
        f"{command_line(results['command'])} ({results['date']}).", machine_line(m),
        f"Protocol: prompts of {lengths} tokens (ChatGPT prompts and Alpaca instructions, seed {p['seed']}), "
        f"{p['max_new_tokens']} greedy output tokens, batch 1, {p['rounds']} interleaved rounds; decode and end-to-end "
        "tok/s: median over rounds; x dense: median of same-round ratios; p50/p99: per decode step.",
        (f"Accuracy: WikiText-2 test perplexity over {p['ppl_windows']} windows of {p['ppl_window_tokens']} tokens "
         "of what each engine decodes with; " if p["ppl_windows"] else "Accuracy: no perplexity (--ppl-windows 0); ")
        + "neurons / clipped: per token and layer (clipped active: of those, truly "
        f"active); {AGREEMENT_MEANINGS[prefix_agreement]} (dense's), mean over the prompts.",
        f"Pack: {_pack_paths(results)}. Resident MB: memory the process gained "
        f"loading the engine; process peak {m['peak_rss_mb']:.0f} MB.", "",
    ]
    main = _markdown(results["engines"], [
        ("engine", "engine", ""), ("decode tok/s", "decode_tok_s", ".1f"), ("x dense", "decode_vs_dense", ".2f"),
        ("end-to-end tok/s", "e2e_tok_s", ".1f"), ("x dense", "e2e_vs_dense", ".2f"),
        ("prefill tok/s", "prefill_tok_s", ".0f"), ("p50 ms", "p50_ms", ".2f"), ("p99 ms", "p99_ms", ".2f"),
        ("perplexity", "perplexity", ".2f"), ("x dense", "ppl_vs_dense", ".3f"),
        (AGREEMENT_LABELS[prefix_agreement], "greedy_agreement", ".2f"), ("neurons", "neurons", ".0f"),
        ("clipped", "clipped", ".1f"),
        ("clipped active", "clipped_active", ".1f"), ("resident MB", "resident_mb", ".0f"),
    ])
    by_length = _markdown(results["per_length"], [
        ("prompt tokens", "length", "d"), ("engine", "engine", ""), ("prefill tok/s", "prefill_tok_s", ".0f"),
        ("TTFT ms", "ttft_ms", ".1f"), ("decode tok/s", "decode_tok_s", ".1f"), ("x dense", "decode_vs_dense", ".2f"),
        ("end-to-end tok/s", "e2e_tok_s", ".1f"),
    ])
    failed = [f"Failed (left out above where it has no numbers): {f['engine']}: {f['error']}."
              for f in results.get("failures", [])]
    return "\n".join(head + failed) + "\n" + main + "\n\n## Per prompt length\n\n" + by_length + "\n"


def add_arguments(parser: argparse.ArgumentParser, command: str = "bench") -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    parser.add_argument(
        "--dtypes", nargs="+", default=None,
        help="dtypes to run each mode in (default: float32 on a CPU, where bfloat16 decodes 5-8x slower; float32 and "
             "bfloat16 on an accelerator)",
    )
    parser.add_argument("--weights", nargs="+", choices=WEIGHT_FORMATS, default=["float"],
                        help="weight formats to run each mode with (every mode runs each)")
    add_mode_arguments(parser, modes=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help=f"prompt lengths in tokens (default {' '.join(map(str, LENGTHS))})")
    parser.add_argument("--long-prompt", type=int, default=LONG_PROMPT,
                        help=f"one more, long prompt of this many tokens (default {LONG_PROMPT}; 0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="output tokens per prompt (default 128)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds, each with new prompts (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    parser.add_argument("--ppl-windows", type=int, default=TEST_WINDOWS,
                        help=f"WikiText-2 test windows of 512 tokens for perplexity (default {TEST_WINDOWS}; "
                             "0: no accuracy)")
    parser.add_argument(
        "--peers", nargs="*", choices=PEERS, default=list(PEERS),
        help="peer engines to run when installed (default: all; llama.cpp needs the 'peers' extra)",
    )
    parser.add_argument("--no-peers", dest="peers", action="store_const", const=[], help="run jpinfer only")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all cores)")
    parser.add_argument("--json", default=None, help="also write everything measured to this JSON file")
    parser.add_argument("--out", default=None, help="also write the markdown report to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def quiet_library_progress() -> None:
    """No progress bars from the libraries the bench's engines load in their child processes (spawned with
    this environment): tqdm reads TQDM_DISABLE when it is imported (each child imports it afresh),
    huggingface_hub and transformers read HF_HUB_DISABLE_PROGRESS_BARS. This process imported tqdm already:
    the transformers engine, which runs here, still shows its GGUF conversion bar."""
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def run(args: argparse.Namespace) -> int:
    if args.modes is None:  # every mode when a pack is at hand (the default model's is built if missing)
        args.modes = list(MODE_NAMES) if args.model is None or args.pack else [REFERENCE_MODE]
        if args.modes == [REFERENCE_MODE]:
            print("running dense only: give --pack DIR (jpinfer prepare --model ...) to add sparse, hybrid and "
                  "threshold", file=sys.stderr)
    for name in ("rounds", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.long_prompt < 0 or args.ppl_windows < 0 or min(args.lengths) < 1:
        raise ValueError("--lengths must be >= 1 and --long-prompt, --ppl-windows >= 0")
    if args.modes[0] != REFERENCE_MODE:
        raise ValueError(f"--modes must start with {REFERENCE_MODE}: every ratio and agreement is taken against it")
    uses_pack = args.pack is not None or args.model is None
    for mode in args.modes:  # before any model loads
        thresholds = mode_options(args)["thresholds"]
        chosen = get_mode(mode, thresholds=thresholds)
        if chosen.uses_pack and not uses_pack:
            chosen.check(ModeInputs(args.predictors, args.profile, None, args.gpu_budget, thresholds))
    if not args.progress:  # the peers' libraries' own bars too (transformers' GGUF conversion, the hub's)
        quiet_library_progress()
    prepare_devices(args.modes)
    if args.dtypes is None:
        args.dtypes = ["float32"] if jax.devices()[0].platform == "cpu" else ["float32", "bfloat16"]
    results = bench(args)
    text = report(results)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
