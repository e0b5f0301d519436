"""The hybrid's host half alone: the cold neurons' FFN on the CPU per decode token, at each GPU budget and weights
format, against the host's copy bandwidth measured in the same run.

Why: a hybrid token is the accelerator's half plus the host's; the host's half needs no GPU, so it is measured on
every machine, and the GPU runs only have to measure the rest. What runs is what the hybrid's host call runs
(``jpinfer.bench.host_half``: the cold part of each layer, ``sparse_ffn`` on the CPU, the native kernels):

- model: Llama-2-7B's shapes (``--model 13b``: Llama-2-13B's), random weights; ``--layers`` layers spread over the
  model are built and timed (each its own arrays, so the caches do not hold one layer for all), and per-token
  figures are scaled to the model's layers (times n_layers / layers);
- activity: the planted bench's (``jpinfer.bench.planted``), ``--active`` of the neurons a token; token t reads
  planted set t of each layer, ``--tokens`` tokens;
- budgets: ``--budgets`` fractions of the model's weights' bytes in its format; the solver places the non-FFN
  part (attention, norms, embedding, head, a ``--context``-token KV cache) first, then the hottest neurons;
  the cold part is the rest;
- timing, per (budget, format): ``--rounds`` rounds, each over the tokens, settings of one format taking turns
  (those whose cold parts fit ``--memory-gib`` together; the order rotating each round). Per token: a copy of
  ``--copy-mib`` MiB (the host's copy bandwidth, and it flushes the caches), then the cold half with a jitted call
  a layer, each waited for (the hybrid's host call before the direct call, now its fallback), then another copy,
  then the same layers in one jitted call (the kernels without a dispatch a layer), then another copy, then a direct
  host call a layer (``host_half.cold_direct``: numpy in and out, as the hybrid's host callback now runs it). Times
  and rates are medians over the tokens of all rounds; "x copy" is the median of each token's rate over the copy's
  just before it;
- XLA's float32 matrix-vector read bandwidth (``bench.machine.matvec_read_bandwidth``) before and after.

    PYTHONPATH=src python bench/hybrid_host.py --out bench/results/hybrid_host.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

from jpinfer.bench import host_half
from jpinfer.bench.layer_offload import LLAMA2_7B
from jpinfer.bench.machine import HostCopy, matvec_read_bandwidth
from jpinfer.bench.planted import neuron_bytes
from jpinfer.bench.protocol import load_average, log, machine, machine_line, rotation
from jpinfer.bench.results import command_line, markdown_table, publish
from jpinfer.config import ModelConfig

LLAMA2_13B = ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128,
                         d_ff=13824, ffn_kind="swiglu", max_position=4096, name="Llama-2-13B shapes, random weights")
SMALL = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=704,
                    ffn_kind="swiglu", max_position=4096, name="small shapes, random weights")  # a check, tests
MODELS = {"7b": LLAMA2_7B, "13b": LLAMA2_13B, "small": SMALL}
COLUMNS = ["budget", "format", "hot neurons", "activations on GPU", "cold neurons/token", "cold MB/token",
           "ms/token (a call a layer)", "GB/s", "x copy", "ms/token (one call)", "GB/s (one call)",
           "x copy (one call)", "ms/token (direct)", "GB/s (direct)", "x copy (direct)", "copy GB/s", "load (1 min)"]


def setting_rows(cfg: ModelConfig, fmt: str, fulls: dict, weight_bytes: float, activity: host_half.Activity,
                 args: argparse.Namespace, copy: HostCopy) -> list[dict]:
    """Every budget's row of one format: the hot sets, the cold layers in groups that fit ``--memory-gib``, each
    group's settings timed in interleaved rounds."""
    sizes = host_half.accelerator_sizes(cfg, weight_bytes, args.context)
    layers = list(fulls)
    per_neuron = neuron_bytes(next(iter(fulls.values())))
    hot = {b: host_half.hot_set(activity.frequencies, sizes, b) for b in args.budgets}
    cold_bytes = {b: sum(int((~hot[b].masks[i]).sum()) for i in layers) * per_neuron for b in args.budgets}
    groups, group = [], []
    for b in args.budgets:
        if group and sum(cold_bytes[g] for g in group) + cold_bytes[b] > args.memory_gib * 2**30:
            groups.append(group)
            group = []
        group.append(b)
    groups.append(group)
    rows = []
    for group in groups:
        cold = {b: [host_half.cold_layer(fulls[i], hot[b].masks[i], activity.sets[i]) for i in layers] for b in group}
        rows += [dict(budget=b, format=fmt, **summary(cfg, hot[b], sizes, cold[b], samples, loads, copy.n_bytes))
                 for b, (samples, loads) in time_group(cold, args, copy).items()]
        del cold
    return rows


def time_group(cold: dict, args: argparse.Namespace, copy: HostCopy) -> dict:
    """budget -> (per-token samples of every round, the 1-minute load at each round's start of that setting)."""
    d = next(iter(cold.values()))[0].part.d_model
    host_xs = np.random.default_rng(args.seed).standard_normal((args.tokens, d), np.float32)
    xs = [jax.numpy.asarray(x) for x in host_xs]
    chains = {b: [host_half.chain_inputs(layers, t) for t in range(args.tokens)] for b, layers in cold.items()}
    calls = {b: [layer for layer in layers if layer.calls_host] for b, layers in cold.items()}  # as the hybrid calls
    for b in cold:  # compile, first touch
        for t in range(args.tokens):
            [host_half.cold_call(layer, xs[t], t).block_until_ready() for layer in calls[b]]
            host_half.cold_chain(chains[b][t][0], xs[t], *chains[b][t][1:]).block_until_ready()
            [host_half.cold_direct(layer, host_xs[t], t) for layer in calls[b]]
    out = {b: ([], []) for b in cold}
    for r in range(args.rounds):
        for b in rotation(list(cold), r):
            layers = cold[b]
            out[b][1].append(load_average()[:1])
            for t in range(args.tokens):
                copy_call = copy.seconds()
                start = time.perf_counter()
                for layer in calls[b]:
                    host_half.cold_call(layer, xs[t], t).block_until_ready()
                call = time.perf_counter() - start
                copy_chain = copy.seconds()
                parts, ids, counts = chains[b][t]
                start = time.perf_counter()
                host_half.cold_chain(parts, xs[t], ids, counts).block_until_ready()
                chain = time.perf_counter() - start
                copy_direct = copy.seconds()
                start = time.perf_counter()
                for layer in calls[b]:
                    host_half.cold_direct(layer, host_xs[t], t)
                direct = time.perf_counter() - start
                out[b][0].append(dict(token=t, round=r, bytes=sum(layer.bytes_read(t) for layer in layers),
                                      neurons=int(sum(layer.counts[t] for layer in layers)), call_s=call,
                                      chain_s=chain, direct_s=direct, copy_call_s=copy_call, copy_chain_s=copy_chain,
                                      copy_direct_s=copy_direct))
        log(f"round {r + 1}/{args.rounds}: budgets {', '.join(f'{b:g}' for b in cold)}")
    return out


def summary(cfg: ModelConfig, hot: host_half.HotSet, sizes, layers: list, samples: list[dict], loads: list,
            copy_bytes: int) -> dict:
    """One row's numbers: per token of the whole model (the measured layers' times n_layers / layers); rates and
    their ratios to the copy just before each token (medians over the tokens)."""
    scale = cfg.n_layers / len(layers)
    median = lambda values: statistics.median(list(values))
    rate = lambda s, key: s["bytes"] / s[key]
    return dict(
        hot_share=hot.hot_share, activation_share=hot.activation_share, feasible=hot.feasible,
        budget_bytes=hot.budget_bytes, dense_bytes=hot.dense_bytes, model_bytes=host_half.weights_bytes(sizes),
        cold_neurons_per_token=statistics.mean(s["neurons"] for s in samples) * scale,
        cold_bytes_per_token=statistics.mean(s["bytes"] for s in samples) * scale,
        call_s=median(s["call_s"] for s in samples) * scale, chain_s=median(s["chain_s"] for s in samples) * scale,
        direct_s=median(s["direct_s"] for s in samples) * scale,
        call_rate=median(rate(s, "call_s") for s in samples), chain_rate=median(rate(s, "chain_s") for s in samples),
        direct_rate=median(rate(s, "direct_s") for s in samples),
        copy_rate=median(copy_bytes / s[key] for s in samples
                         for key in ("copy_call_s", "copy_chain_s", "copy_direct_s")),
        call_x_copy=median(rate(s, "call_s") * s["copy_call_s"] / copy_bytes for s in samples),
        chain_x_copy=median(rate(s, "chain_s") * s["copy_chain_s"] / copy_bytes for s in samples),
        direct_x_copy=median(rate(s, "direct_s") * s["copy_direct_s"] / copy_bytes for s in samples),
        layers=[dict(cold_neurons=layer.part.n_neurons, capacity=int(layer.ids.shape[1]),
                     mean_count=float(layer.counts.mean())) for layer in layers],
        loads=[x for load in loads for x in load], samples=samples)


def report(data: dict) -> str:
    args, cfg = data["args"], data["model"]
    mb = lambda n: f"{n / 1e6:.1f}"
    lines = ["# The hybrid's host half: the cold neurons' FFN on the CPU, per GPU budget and weights format", "",
             machine_line(data["machine"]), "",
             command_line(data["command"]) + f" ({data['seconds'] / 60:.1f} min).", "",
             f"- model: {cfg['name']} ({cfg['n_layers']} layers, d {cfg['d_model']}, d_ff {cfg['d_ff']}); "
             f"{len(data['layers'])} layers timed (layers {', '.join(map(str, data['layers']))}, each its own "
             f"arrays), per-token figures scaled to {cfg['n_layers']} layers;",
             f"- activity: planted, {args['active']:.0%} of the neurons a token (the planted bench's power law and "
             f"sets); {args['tokens']} tokens (planted sets 0..{args['tokens'] - 1}) x {args['rounds']} rounds;",
             f"- placement: the solver's (objective mass, strict) under a budget, a fraction of the model's weights in "
             f"its format; first the non-FFN part with a {args['context']}-token bfloat16 KV cache; float is a "
             "bfloat16 model on the accelerator, its cold part float32 on the host (as the hybrid casts it); int4 is "
             "Q4_0 (on the host: 4-bit gate/up records, int8 down slots). A budget below the non-FFN part places no "
             "neuron: every active neuron is cold;",
             "- the cold half as the hybrid's host call runs it: `sparse_ffn` over each layer's cold part (native "
             "kernels), a jitted call a layer, each waited for (the hybrid's fallback); 'one call': the same layers in "
             "one jitted call; 'direct': a direct host call of the kernel a layer (numpy in and out, no jax dispatch: "
             "what the hybrid's host callback runs);",
             f"- host copy: {data['copy_mib']} MiB copied on {data['copy_threads']} threads (np.copyto) before each "
             f"timed variant, bytes copied per second (each byte read and written); XLA's float32 matrix-vector read "
             f"bandwidth {data['matvec_before'] / 1e9:.1f} GB/s before the run, {data['matvec_after'] / 1e9:.1f} "
             "after; 'x copy': each token's rate over the copy just before it (median over tokens).", ""]
    lines += markdown_table(["format", "model's weights GB", "non-FFN part GB (of the weights)", "host bytes a neuron"],
                            [[f["format"], f"{f['model_bytes'] / 1e9:.2f}",
                              f"{f['dense_bytes'] / 1e9:.2f} ({f['dense_bytes'] / f['model_bytes']:.0%})",
                              f["neuron_bytes"]] for f in data["formats"]])
    lines += ["", "## The cold half per token", ""]
    load = lambda r: f"{min(r['loads']):.1f}-{max(r['loads']):.1f}" if r["loads"] else "n/a"
    lines += markdown_table(COLUMNS, [
        [f"{r['budget']:g}", r["format"], f"{r['hot_share']:.1%}" + ("" if r["feasible"] else " (below non-FFN)"),
         f"{r['activation_share']:.1%}", f"{r['cold_neurons_per_token']:.0f}", mb(r["cold_bytes_per_token"]),
         f"{r['call_s'] * 1e3:.2f}", f"{r['call_rate'] / 1e9:.1f}", f"{r['call_x_copy']:.2f}",
         f"{r['chain_s'] * 1e3:.2f}", f"{r['chain_rate'] / 1e9:.1f}", f"{r['chain_x_copy']:.2f}",
         f"{r['direct_s'] * 1e3:.2f}", f"{r['direct_rate'] / 1e9:.1f}", f"{r['direct_x_copy']:.2f}",
         f"{r['copy_rate'] / 1e9:.1f}", load(r)] for r in data["rows"]])
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, command: str) -> dict:
    """The run (the module docstring): every format's rows, the copy and matrix-vector bandwidths, the machine."""
    started = time.perf_counter()
    load_before = load_average()
    cfg = MODELS[args.model]
    matvec_before = matvec_read_bandwidth()
    layers = host_half.representative_layers(cfg.n_layers, args.layers)
    activity = host_half.Activity.planted(cfg, args.active, args.tokens, args.seed)
    copy = HostCopy(args.copy_mib << 20)
    rows, formats = [], []
    for fmt in args.formats:
        built = time.perf_counter()
        fulls, weight_bytes = {}, None
        for i in layers:
            fulls[i], weight_bytes = host_half.neuron_layout(cfg, fmt, args.seed, i)
        log(f"{fmt}: {len(layers)} layers built in {time.perf_counter() - built:.0f} s")
        fmt_rows = setting_rows(cfg, fmt, fulls, weight_bytes, activity, args, copy)
        rows += fmt_rows
        formats.append(dict(format=fmt, weight_bytes=weight_bytes, neuron_bytes=neuron_bytes(fulls[layers[0]]),
                            model_bytes=fmt_rows[0]["model_bytes"], dense_bytes=fmt_rows[0]["dense_bytes"]))
        del fulls
    copy.close()
    matvec_after = matvec_read_bandwidth()
    return dict(machine=machine(load_before), command=command, args=vars(args), model=dict(
        name=cfg.name, n_layers=cfg.n_layers, d_model=cfg.d_model, d_ff=cfg.d_ff), layers=layers,
        copy_mib=args.copy_mib, copy_threads=copy.threads, matvec_before=matvec_before, matvec_after=matvec_after,
        formats=formats, rows=rows, seconds=time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="markdown path (its .json beside it)")
    ap.add_argument("--model", choices=list(MODELS), default="7b")
    ap.add_argument("--formats", nargs="+", choices=host_half.FORMATS, default=list(host_half.FORMATS))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2, 0.4, 0.6, 0.8, 0.9])
    ap.add_argument("--active", type=float, default=0.1, help="planted active fraction")
    ap.add_argument("--layers", type=int, default=4, help="layers built and timed")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048, help="the accelerator's KV cache, tokens")
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--memory-gib", type=float, default=4.0, help="cold parts held at once")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    command = f"python bench/hybrid_host.py {' '.join(sys.argv[1:] if argv is None else argv)}".strip()
    with jax.default_device(jax.devices("cpu")[0]):  # the host's half: on the CPU where jax defaults to a GPU too
        data = measure(args, command)
    publish(report(data), args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
