"""Engine modes on the default model: `sparse` against `dense`, and `hybrid` on two simulated devices.

Protocol (CPU; device 0 plays the accelerator, device 1 the host):
- profile and predictors as bench/predictors.py (cached under $JPINFER_CACHE/bench; trained
  when missing), cut-offs re-chosen for each operating point in ``--points`` (recall / strong
  recall), capacities from ``--capacities`` (a quantile of the profile's active counts, or
  ``predicted``: the 0.99 quantile of what the predictors pick on held-out samples, or ``full``:
  K = d_ff, nothing clipped);
- quality: WikiText-2 test perplexity of exactly what the sparse engine computes (the
  predicted-mask FFN with the same capacities), neurons per token, clipped and clipped-active
  rates; greedy agreement (positions) with dense on ``--prompts`` ChatGPT prompts;
- speed: decode tok/s over the same prompts, every engine once per round, ``--rounds``
  interleaved rounds (``jpinfer.bench.engines.speed_rounds``), median per engine; medians of
  same-round ratios to dense;
- where a step's time goes: device step times of the dense step, the step without FFN,
  with the predictor and selection but no FFN, the sparse step; the head alone; the host
  loop's share (dispatch, reading tokens);
- hybrid: placement by the solver for ``--budget`` (fraction of the model's bytes), tokens
  against sparse with nothing clipped, share of FFN neurons computed on each side, the step
  on two devices against the same split on one device, transfer and sync costs.

    python bench/modes.py --out bench/results/modes.md
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jpinfer  # noqa: E402
from jpinfer.bench.accuracy import cached_profile, trained, wikitext_windows  # noqa: E402
from jpinfer.bench.engines import JaxEngine, decode_tok_s, prefill_tok_s, speed_rounds  # noqa: E402
from jpinfer.bench.protocol import (  # noqa: E402
    AGREEMENT_LABELS,
    AGREEMENT_MEANINGS,
    TEST_WINDOWS,
    interleaved_rounds,
    load_average,
    machine,
    machine_line,
    pooled_positions_agreement,
    positions_agreement,
)
from jpinfer.bench.results import command_line, publish  # noqa: E402
from jpinfer.data import chatgpt_prompts  # noqa: E402
from jpinfer.ffn import PredictorMaskFFN, evaluate, layer_capacities, mask_states, part_capacities  # noqa: E402
from jpinfer.models import transformer  # noqa: E402
from jpinfer.models.params import nbytes  # noqa: E402
from jpinfer.modes import build_engine  # noqa: E402
from jpinfer.modes.placement import choose_placement  # noqa: E402
from jpinfer.predictor import predict_logits, select_neurons  # noqa: E402
from jpinfer.predictor.fit import retune  # noqa: E402
from jpinfer.solver import measure_hardware  # noqa: E402


@dataclasses.dataclass(frozen=True)
class NoFfn:
    """The step without its FFN (attention, norms, head and the loop only)."""

    def __call__(self, i, layer, x, state):
        return jnp.zeros_like(x), None


@dataclasses.dataclass(frozen=True)
class PredictOnly:
    """The predictor and the selection, but no FFN: the output depends on the list and its count
    (0 * them, which XLA does not fold for floats), so the selection is not removed as dead code."""

    capacity: tuple[int, ...]

    def __call__(self, i, layer, x, state):
        if x.size != x.shape[-1]:  # prefill: not timed
            return jnp.zeros_like(x), None
        chosen = select_neurons(predict_logits(state.predictor, x.reshape(-1)), state.predictor.cutoff,
                                self.capacity[i])
        used = (chosen.count + chosen.ids.sum()).astype(x.dtype)
        return jnp.zeros_like(x) + 0.0 * used, None


@dataclasses.dataclass(frozen=True)
class SideCounts:
    """Dense FFN; aux: the neurons the hybrid selects on each side per token (same capacities)."""

    cfg: object
    capacity: tuple[tuple[int, int], ...]

    def __call__(self, i, layer, x, state):
        predictor, hot_ids, cold_ids = state
        logits = predict_logits(predictor, x)
        counts = {}
        for side, ids, k in (("hot", hot_ids, self.capacity[i][0]), ("cold", cold_ids, self.capacity[i][1])):
            counts[side] = (select_neurons(logits[..., ids], predictor.cutoff, k).count if k
                            else jnp.zeros(x.shape[:-1], jnp.int32))
        return transformer.ffn_dense(layer, x, self.cfg), counts


@dataclasses.dataclass(frozen=True)
class PredictedUnion:
    """Dense FFN; aux: per window, the neurons predicted active for at least one of its tokens
    (spread over the window's tokens, so the evaluator's sum over tokens is the sum over windows)."""

    cfg: object

    def __call__(self, i, layer, x, predictor):
        union = (predict_logits(predictor, x) > predictor.cutoff).any(axis=1).sum(-1)  # (B,)
        y = transformer.ffn_dense(layer, x, self.cfg)
        return y, jnp.broadcast_to((union / x.shape[1])[:, None], x.shape[:2])


def capacity_arg(text: str, cfg):
    return cfg.d_ff if text == "full" else text if text == "predicted" else float(text)


def median_steps(engines: dict, prompt, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Medians over interleaved rounds of each engine's device step time (no host round trip)
    and of the host's time to dispatch a step."""
    measured = interleaved_rounds({name: (lambda r, e=engine: e.step_times(prompt, 32)) for name, engine in
                                   engines.items()}, rounds)
    step = {name: measured.median(name, lambda t: t[0]) for name in engines}
    return step, {name: measured.median(name, lambda t: t[1]) for name in engines}


def transfer_seconds(d: int, n_layers: int, accelerator, host, rounds: int = 50) -> float:
    """One token's transfers: per layer a hidden state to the host and one back, chained."""
    x = jax.device_put(jnp.ones((1, 1, d), jnp.float32), accelerator)

    def one_token(r: int) -> None:
        y = x
        for _ in range(n_layers):
            y = jax.device_put(jax.device_put(y, host), accelerator)
        y.block_until_ready()
    return interleaved_rounds({"transfers": one_token}, rounds).median("transfers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=65536, help="predictor samples per layer (profile)")
    parser.add_argument("--points", default="0.99/0.999,0.9/0.995", help="recall/strong recall operating points")
    parser.add_argument("--capacities", default="predicted,0.99",
                        help="capacities: predicted, quantiles of the profile's active counts, or full (K = d_ff)")
    parser.add_argument("--test-windows", type=int, default=TEST_WINDOWS, help="WikiText-2 test windows of 512 tokens")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.75, help="hybrid accelerator budget, fraction of the model")
    parser.add_argument("--out", default=None, help="markdown file (a .json with the rows is written beside it)")
    args = parser.parse_args()

    load_before = load_average()
    dense = jpinfer.load()
    cfg = dense.cfg
    prof = cached_profile(dense, args.samples)
    predictors, _ = trained(dense, prof, "adaptive", reuse=True)
    test = wikitext_windows(dense.tokenizer, args.test_windows)
    prompts = [dense.encode_prompt(t, chat=True)[:128] for t in chatgpt_prompts()[: args.prompts]]
    dense_ppl, _ = evaluate(dense, test, progress=True)

    rows, engines, tuned_points = [], {"dense": dense}, {}
    for point in args.points.split(","):
        recall, strong = (float(v) for v in point.split("/"))
        tuned = retune(dense, predictors, prof, recall, strong)
        tuned_points[point] = tuned
        for cap in args.capacities.split(","):
            ks = layer_capacities(dense.cfg, capacity_arg(cap, cfg), prof, tuned)
            ppl, sums = evaluate(dense, test, PredictorMaskFFN(cfg, ks), mask_states(tuned.layers, prof.thresholds),
                                 progress=True)
            per_token = {k: sum(layer[k] for layer in sums) / (test.size * cfg.n_layers) for k in sums[0]}
            name = f"sparse {point} K={cap}"
            engines[name] = build_engine(dense.model, "sparse", predictors=tuned, profile=prof, capacity=ks)
            rows.append(dict(engine=name, recall=recall, strong_recall=strong, capacity=cap,
                             mean_capacity=float(np.mean(ks)), ppl=ppl, ppl_ratio=ppl / dense_ppl, **per_token))

    # hybrid: the first operating point's predictors, placed by the solver
    point0 = args.points.split(",")[-1]
    tuned = tuned_points[point0]
    placement = choose_placement(dense.model, prof, tuned, args.budget)
    masks = placement.masks()
    ks = layer_capacities(dense.cfg, capacity_arg(args.capacities.split(",")[0], cfg), prof, tuned)
    split = part_capacities(ks, masks, prof.frequency())
    hybrid_name = f"hybrid {point0} K={args.capacities.split(',')[0]}"
    engines[hybrid_name] = build_engine(dense.model, "hybrid", predictors=tuned, profile=prof, capacity=ks,
                                        placement=placement)
    full_sparse = build_engine(dense.model, "sparse", predictors=tuned, profile=prof, capacity=cfg.d_ff)
    full_hybrid = build_engine(dense.model, "hybrid", predictors=tuned, profile=prof, capacity=cfg.d_ff,
                               placement=placement)
    accelerator, host = jax.devices("cpu")[:2]
    one_device = build_engine(dense.model, "hybrid", predictors=tuned, profile=prof, capacity=ks, placement=placement,
                              devices=(accelerator, accelerator))

    # speed: interleaved rounds over the prompts
    runners = {name: JaxEngine(name, engine) for name, engine in engines.items()}
    measured, loads = speed_rounds(runners, prompts, args.new_tokens, args.rounds)
    speed = {name: measured.median(name, decode_tok_s) for name in runners}
    prefill = {name: measured.median(name, prefill_tok_s) for name in runners}
    first_round = {name: [s.tokens for s in measured.results(name)[0]] for name in runners}
    ref = first_round["dense"]
    for row in rows:
        row["tok_s"] = speed[row["engine"]]
        row["speedup"] = measured.median_ratio(row["engine"], "dense", decode_tok_s)
        row["agreement"] = pooled_positions_agreement(first_round[row["engine"]], ref)
        row["identical"] = sum(x == y for x, y in zip(ref, first_round[row["engine"]]))

    # where the step's time goes (dense and the sparse engine of the last point, first capacity)
    main_name = f"sparse {point0} K={args.capacities.split(',')[0]}"
    sparse_engine = engines[main_name]
    states = sparse_engine.ffn.state
    variants = {
        "dense": dense, "sparse": sparse_engine,
        "no FFN": sparse_engine.with_ffn(jpinfer.FfnStrategy(NoFfn(), states, "no ffn")),
        "predictor only": sparse_engine.with_ffn(jpinfer.FfnStrategy(PredictOnly(ks), states, "predict only")),
        "hybrid (2 devices)": engines[hybrid_name], "hybrid split on 1 device": one_device,
    }
    step, dispatch = median_steps(variants, prompts[0], args.rounds)
    head = jax.jit(transformer.logits, static_argnames=("cfg",))
    h = jnp.ones((1, cfg.d_model), jnp.float32)
    head(dense.weights, h, cfg).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(50):
        head(dense.weights, h, cfg).block_until_ready()
    head_s = (time.perf_counter() - t0) / 50
    transfer_s = transfer_seconds(cfg.d_model, cfg.n_layers, accelerator, host)
    hardware = measure_hardware(devices=(accelerator, host), array_mib=32)

    # prefill: neurons a prompt-sized window predicts active for at least one token
    union = {}
    for length in (16, 64):
        windows = test[:8, :length]
        _, sums = evaluate(dense, windows, PredictedUnion(cfg), tuned.layers)
        union[length] = sum(sums) / (windows.shape[0] * cfg.n_layers * cfg.d_ff)

    # hybrid correctness and its work split
    equal_tokens = [full_hybrid.generate(p, max_new_tokens=args.new_tokens).token_ids
                    == full_sparse.generate(p, max_new_tokens=args.new_tokens).token_ids for p in prompts]
    side_state = [(p, jnp.asarray(np.flatnonzero(m), jnp.int32), jnp.asarray(np.flatnonzero(~m), jnp.int32))
                  for p, m in zip(tuned.layers, masks)]
    _, side_sums = evaluate(dense, test[:4], SideCounts(cfg, split), side_state)
    hot_work = sum(s["hot"] for s in side_sums)
    cold_work = sum(s["cold"] for s in side_sums)

    report = dict(
        machine=machine(load_before), loads=loads, greedy_agreement="positions", dense_ppl=dense_ppl,
        dense_tok_s=speed["dense"], rows=rows,
        prefill_tok_s=prefill, prefill_union=union,
        step_ms={k: v * 1e3 for k, v in step.items()}, head_ms=head_s * 1e3,
        dispatch_ms={k: v * 1e3 for k, v in dispatch.items()},
        hybrid=dict(name=hybrid_name, tok_s=speed[hybrid_name],
                    speedup=measured.median_ratio(hybrid_name, "dense", decode_tok_s),
                    budget_fraction=args.budget, budget_bytes=placement.budget_bytes,
                    model_bytes=nbytes(dense.weights),
                    hot_neurons=int(sum(m.sum() for m in masks)), neurons=cfg.n_layers * cfg.d_ff,
                    accel_share_profile=placement.accel_share, hot_work_share=hot_work / (hot_work + cold_work),
                    tokens_equal_sparse=f"{sum(equal_tokens)}/{len(equal_tokens)}",
                    transfer_ms_per_token=transfer_s * 1e3, link_latency_us=hardware.link_latency * 1e6,
                    sync_us=hardware.sync_cost * 1e6, capacities=[list(c) for c in split]),
    )
    publish(render(report, args), args.out, report)


def render(r: dict, args) -> str:
    lines = [
        "# Engine modes on the default model (CPU)", "",
        command_line("python bench/modes.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None)), "",
        f"{machine_line(r['machine'])} WikiText-2 test perplexity over {args.test_windows} windows of 512 tokens; "
        f"decode tok/s median of {args.rounds} interleaved rounds (the order rotating) over {args.prompts} ChatGPT "
        f"prompts x {args.new_tokens} tokens; vs dense: median of same-round ratios. "
        f"{AGREEMENT_MEANINGS[positions_agreement]} (dense's), over all the prompts' tokens of the first round.", "",
        f"Dense: perplexity {r['dense_ppl']:.2f}, {r['dense_tok_s']:.1f} tok/s.", "",
        "| engine | neurons / token | clipped / token | clipped active / token | perplexity | ppl / dense "
        f"| {AGREEMENT_LABELS[positions_agreement]} | identical prompts | tok/s | vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['engine']} | {row['predicted']:.0f} | {row['clipped']:.1f} | {row['clipped_active']:.1f} | "
            f"{row['ppl']:.2f} | {row['ppl_ratio']:.3f} | {row['agreement']:.1%} | {row['identical']} | "
            f"{row['tok_s']:.1f} | {row['speedup']:.2f}x |")
    hy = r["hybrid"]
    lines += [
        f"| {hy['name']} (2 devices) | | | | | | | | {hy['tok_s']:.1f} | {hy['speedup']:.2f}x |", "",
        "## Prefill", "",
        "Prefill tok/s (median over rounds; prompts of at most 128 tokens): " + ", ".join(
            f"{k} {v:.0f}" for k, v in r["prefill_tok_s"].items()) + ".",
        "Neurons predicted active for at least one token of a window (the last operating point), "
        "share of all: " + ", ".join(f"{n} tokens {u:.1%}" for n, u in r["prefill_union"].items())
        + ": a prompt needs nearly every neuron, so sparse modes prefill densely (every neuron of each part).", "",
    ]
    lines += [
        "## Where a decode step's time goes (device step time, median of interleaved rounds)", "",
        "| step | device ms | host dispatch ms |", "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} | {r['dispatch_ms'][k]:.2f} |" for k, v in r["step_ms"].items()]
    lines += [f"| head alone (logits of one token) | {r['head_ms']:.2f} | |", "",
              "Host dispatch: time for the step call to return (it returns before the device finishes, unless the "
              "step waits on a transfer).", ""]
    lines += [
        "## Hybrid on two simulated CPU devices", "",
        f"- budget {hy['budget_fraction']:.0%} of the model's {hy['model_bytes'] / 1e6:.0f} MB: "
        f"{hy['hot_neurons']} of {hy['neurons']} neurons on the accelerator, carrying "
        f"{hy['accel_share_profile']:.1%} of the profile's activations;",
        f"- share of the FFN neurons computed on the accelerator (test text, same capacities): "
        f"{hy['hot_work_share']:.1%};",
        f"- greedy tokens equal to `sparse` on one device (nothing clipped): {hy['tokens_equal_sparse']} prompts;",
        f"- transfers per token (a hidden state to the host and back, per layer, chained): "
        f"{hy['transfer_ms_per_token']:.2f} ms; measure_hardware between the devices: link latency "
        f"{hy['link_latency_us']:.0f} us, sync {hy['sync_us']:.0f} us.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
