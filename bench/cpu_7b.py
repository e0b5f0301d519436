"""CPU decode at Llama-2-7B's shapes: jpinfer dense and planted-sparse against llama.cpp on the same files.

Random weights, planted activity: no ReLU-family 7B checkpoint can be had on these machines, and decode speed
depends on shapes, bytes and which neurons are read, not on the weights' values. Protocol:
- files: ``jpinfer.bench.random_gguf`` writes once into the cache a GGUF of Llama-2-7B's shapes (32 layers,
  d 4096, FFN 11008, 32 heads, vocab 32000) per format (Q8_0, Q4_0; the head Q8_0 in both), quantized by the
  ``gguf`` package; llama.cpp (llama-cpp-python, in a process of its own) and jpinfer load the same file,
  jpinfer straight into its int8 (per output row, from the Q8_0 blocks) or 4-bit (the file's Q4_0 blocks as
  they are) format, one tensor in float at a time (``models.loading.load_quantized_gguf``);
- engines per format: llama.cpp dense; jpinfer dense; jpinfer planted-sparse at each ``--fractions`` active,
  without and with a predictor of ``--rank`` per layer (``jpinfer.bench.planted``: the same neurons either
  way). The sparse engines read int8 neuron bundles (Q8_0), or the 4-bit gate/up rows in records by neuron and
  int8 copies of the down columns (Q4_0), each layer's neurons stored hottest first (``planted.popularity_order``);
- speed: one prompt of ``--prompt-tokens`` random ids, ``--new-tokens`` greedy tokens, every engine once per
  round, ``--rounds`` interleaved rounds, median decode tok/s per engine and the median of same-round ratios to
  llama.cpp's (``x_llama_cpp``), the load average of each round;
- bytes bound: weight bytes one decode step reads (llama.cpp: every tensor but the embedding; jpinfer: its
  weights, the listed neurons' bundles, the predictors) over XLA's float32 matrix-vector read bandwidth
  measured at the start of the run (``bench.machine.matvec_read_bandwidth``);
- memory: each engine alone in a process of its own (load, build, ``MEMORY_TOKENS`` tokens): resident and
  peak bytes (VmRSS, VmHWM: llama.cpp's include the file pages it maps) against the file's tensor bytes.

    python bench/cpu_7b.py --out-dir bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import numpy as np
from gguf import GGUFReader

from jpinfer.bench.child import ChildEngine, EngineFailed
from jpinfer.bench.engines import JaxEngine, decode_tok_s, speed_rounds
from jpinfer.bench.llama_cpp import LlamaCppEngine, peer_engine
from jpinfer.bench.machine import matvec_read_bandwidth
from jpinfer.bench.planted import file_engine, neuron_major, planted_bench_engine, popularity_order
from jpinfer.bench.protocol import load_average, machine, machine_line, prefix_agreement
from jpinfer.bench.random_gguf import LLAMA2_7B, SPECIAL_TOKENS, Shapes, random_ggufs
from jpinfer.bench.results import command_line, markdown_table, publish
from jpinfer.models.loading import load_quantized_gguf
from jpinfer.runtime.engine import Engine

FORMATS = {"Q8_0": "int8", "Q4_0": "int4"}  # the file's type -> the jpinfer weights it loads into
MEMORY_TOKENS = 8
SMALL = Shapes("small-llama-shapes", n_layers=2, d_model=256, d_ff=704, n_heads=4, n_kv_heads=4, vocab=512)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def file_bytes(path: pathlib.Path) -> int:
    """The file's tensor bytes: what its weights take in memory."""
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def speed(path: pathlib.Path, file_type: str, args, prompt: list[int], bandwidth: float) -> list[dict]:
    """One format's interleaved rounds: a row per engine."""
    fmt = FORMATS[file_type]
    peer = peer_engine(path, args.threads, label=file_type, n_ctx=len(prompt) + args.new_tokens + 8)
    started = time.perf_counter()
    model = load_quantized_gguf(path, fmt, tokenizer=False, progress=True)
    print(f"loaded {path.name} into {fmt} in {time.perf_counter() - started:.0f} s", flush=True)
    dense = JaxEngine(f"jpinfer {fmt} dense", Engine(model))
    ffns = neuron_major(model, order=popularity_order(model.cfg, min(args.fractions)))
    engines = {peer.name: peer, dense.name: dense}
    for fraction in args.fractions:
        for rank in (None, args.rank):
            engine = planted_bench_engine(model, fraction, ffns, rank, f"jpinfer {fmt}")
            engines[engine.name] = engine
    rounds, loads = speed_rounds(engines, [prompt], args.new_tokens, args.rounds, drop=EngineFailed)
    peer_tokens = rounds.results(peer.name)[0][0].tokens if peer.name in rounds.names else None
    rows = []
    for name, engine in engines.items():
        if not rounds.values(name, decode_tok_s):
            continue
        tok_s = rounds.median(name, decode_tok_s)
        read = engine.weight_bytes_per_token
        row = {"format": file_type, "engine": name, "decode_tok_s": tok_s,
               "tok_s_rounds": rounds.values(name, decode_tok_s), "bytes_per_token": read,
               "bytes_bound_tok_s": bandwidth / read, "load_average": loads}
        if name != peer.name and peer.name in rounds.names:
            row["x_llama_cpp"] = rounds.median_ratio(name, peer.name, decode_tok_s)
            row["x_llama_cpp_rounds"] = rounds.ratios(name, peer.name, decode_tok_s)
        if name == dense.name and peer_tokens is not None:
            row["agreement_with_llama_cpp"] = prefix_agreement(rounds.results(name)[0][0].tokens, peer_tokens)
        rows.append(row)
    peer.close()
    return rows


def memory(path: pathlib.Path, file_type: str, args, prompt: list[int]) -> list[dict]:
    """Each engine alone in a child process: resident and peak bytes after loading and a short decode."""
    fmt = FORMATS[file_type]
    plans = [(LlamaCppEngine, (path,), dict(n_threads=args.threads, label=file_type, n_ctx=len(prompt) + 16)),
             (file_engine, (str(path), fmt), {}),
             (file_engine, (str(path), fmt), dict(fraction=0.1, rank=args.rank))]
    rows = []
    for factory, positional, keywords in plans:
        try:
            engine = ChildEngine(factory, *positional, **keywords)
            engine.run(prompt, MEMORY_TOKENS)
        except EngineFailed as failure:
            print(f"memory: {failure}", flush=True)
            continue
        rows.append({"format": file_type, "engine": engine.name, **engine.memory()})
        print(f"memory: {engine.name}: {rows[-1]}", flush=True)
        engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    parser.add_argument("--rank", type=int, default=256, help="the predictors' width")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (jpinfer uses every core)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-engine memory runs")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a check that everything runs")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args()

    shapes = SMALL if args.small else LLAMA2_7B
    load_before = load_average()
    started = time.perf_counter()
    paths = random_ggufs(shapes, tuple(args.formats), progress=lambda done, total: print(
        f"\rwriting random {shapes.name} files: tensor {done}/{total}", end="\n" if done == total else "",
        flush=True))
    files = {ft: {"path": f"$JPINFER_CACHE/random_gguf/{p.name}", "bytes": p.stat().st_size,
                  "tensor_bytes": file_bytes(p),
                  **json.loads(p.with_suffix(".json").read_text())} for ft, p in paths.items()}
    bandwidth = matvec_read_bandwidth()
    print(f"XLA float32 matrix-vector read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(len(SPECIAL_TOKENS) + 256, shapes.vocab,
                                                                 args.prompt_tokens)]
    rows, memory_rows = [], []
    for ft, path in paths.items():
        rows += speed(path, ft, args, prompt, bandwidth)
        if not args.no_memory:
            memory_rows += memory(path, ft, args, prompt)
    m = machine(load_before)
    data = {"machine": m, "shapes": dataclasses.asdict(shapes), "files": files, "bandwidth": bandwidth,
            "args": {k: v if not isinstance(v, pathlib.Path) else str(v) for k, v in vars(args).items()},
            "rows": rows, "memory": memory_rows, "seconds": time.perf_counter() - started}
    publish(report(data), None if args.out_dir is None else args.out_dir / "cpu_7b.md", data)


def report(data: dict) -> str:
    args, shapes = data["args"], data["shapes"]
    lines = [f"# CPU decode at {shapes['name']}: random weights, planted activity", "",
             machine_line(data["machine"]), "",
             command_line(f"python bench/cpu_7b.py{' --small' if args['small'] else ''} --out-dir bench/results")
             + f" ({args['rounds']} interleaved rounds, one prompt of {args['prompt_tokens']} random ids, "
             f"{args['new_tokens']} greedy tokens, llama.cpp on {args['threads']} threads; predictors of rank "
             f"{args['rank']}; {data['seconds'] / 60:.0f} min). XLA float32 matrix-vector read bandwidth "
             f"{data['bandwidth'] / 1e9:.1f} GB/s (the bytes bound's reference).", ""]
    lines += [f"- {ft}: {f['path']} ({gb(f['bytes'])} GB on disk, {gb(f['tensor_bytes'])} GB of tensors; written "
              f"with {' and '.join(f['written_with'])} in one pass of {f['write_s']:.0f} s, gguf's quantizer)"
              for ft, f in data["files"].items()]
    lines += ["", "jpinfer reads int8 rows with one scale each (1 byte a weight) from Q8_0's blocks (1.0625); its "
              "sparse engines read int8 neuron bundles from Q8_0, and from Q4_0 the file's 4-bit gate/up rows in "
              "place with int8 copies of the down columns (4-bit blocks run along the input, so a neuron's down "
              "column cuts across them). 'of bound' over 1 means the engine read faster than XLA's float32 "
              "matrix-vector product, the reference."]
    lines += ["", "## Decode speed", ""]
    lines += markdown_table(
        ["format", "engine", "decode tok/s", "x llama.cpp (same round)", "GB read/token", "bytes bound tok/s",
         "of bound"],
        [[r["format"], r["engine"], f"{r['decode_tok_s']:.2f}",
          f"{r['x_llama_cpp']:.2f}" if "x_llama_cpp" in r else "-", gb(r["bytes_per_token"]),
          f"{r['bytes_bound_tok_s']:.2f}", f"{r['decode_tok_s'] / r['bytes_bound_tok_s']:.2f}"]
         for r in data["rows"]])
    agreement = [f"{r['engine']}: {r['agreement_with_llama_cpp']:.2f}" for r in data["rows"]
                 if "agreement_with_llama_cpp" in r]
    if agreement:
        lines += ["", "Greedy agreement (prefix) of jpinfer dense with llama.cpp on the same file (one model; "
                  "random weights have near-tied logits, so an early difference is rounding): " + "; ".join(agreement)]
    loads = sorted({round(x, 1) for r in data["rows"] for x in r["load_average"]})
    lines += ["", f"Load average at the rounds' starts: {', '.join(map(str, loads))}."]
    if data["memory"]:
        sizes = {ft: f["tensor_bytes"] for ft, f in data["files"].items()}
        lines += ["", "## Memory (each engine alone in its process, after loading and "
                  f"{MEMORY_TOKENS} tokens)", ""]
        lines += markdown_table(
            ["format", "engine", "resident GB", "peak GB", "peak / file tensors"],
            [[r["format"], r["engine"], gb(r["rss"]), gb(r["peak"]), f"{r['peak'] / sizes[r['format']]:.2f}"]
             for r in data["memory"] if "peak" in r])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
