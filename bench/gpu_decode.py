"""End-to-end decode with fixed neuron lists: what the GPU sparse FFN kernel gives a whole decoder.

Protocol: Llama-2-7B shapes with random bfloat16 weights (``jpinfer.bench.layer_offload``; ``--tiny``:
4 small layers in float32); per layer a fixed random list of (1 - s) * d_ff neurons, the same for
every token (no predictor: this isolates the FFN kernel from prediction); the decoder's dense FFN
matrices dropped, the FFN kept neuron-major. Engines ``dense`` and ``sparse s=..`` (``sparse_ffn``
with ``backend="auto"``: the Pallas kernel on a GPU, the chunked XLA loop on the CPU), greedy,
``--new-tokens`` after a 16-token random prompt, every engine once per round, ``--rounds``
interleaved rounds (``jpinfer.bench.protocol``, the order rotating), median decode tok/s and the
median of same-round ratios to dense. The target on one H200: >= 2x dense
at s = 0.9.

On the GPU machine (a few minutes; with the kernel table first):

    python -m jpinfer.bench --kernels --tokens 1 4 --out $OUT/gpu_kernels.md
    python bench/gpu_decode.py --out $OUT/gpu_decode.md

Here, on the CPU (a check of the script):

    JAX_PLATFORMS=cpu python bench/gpu_decode.py --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.layer_offload import LLAMA2_7B, TINY, random_weights
from jpinfer.bench.protocol import interleaved_rounds, load_average, log, machine, machine_line
from jpinfer.bench.results import publish
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer
from jpinfer.modes.engines import without_ffn
from jpinfer.runtime.engine import MIN_PROMPT_BUCKET, Engine, FfnStrategy, GenerationConfig
from jpinfer.sparse import NeuronFFN, all_rows_ffn, from_layer, sparse_ffn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FixedList:
    """One layer's state: its FFN neuron-major and the neurons every token computes."""

    ffn: NeuronFFN
    ids: jax.Array


@dataclasses.dataclass(frozen=True)
class FixedListFFN:
    """Static ``ffn_impl``: a decode step computes the layer's fixed list; a prompt every neuron."""

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: FixedList) -> tuple[jax.Array, None]:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] > 1:
            return all_rows_ffn(state.ffn, tokens).reshape(x.shape), None
        return sparse_ffn(state.ffn, tokens[0], state.ids, state.ids.shape[0]).reshape(x.shape), None


def fixed_list_engine(model: LoadedModel, sparsity: float, seed: int) -> Engine:
    cfg, rng = model.cfg, np.random.default_rng(seed)
    k = max(1, round(cfg.d_ff * (1 - sparsity)))
    states = [FixedList(from_layer(layer, cfg.ffn_kind), jnp.asarray(rng.permutation(cfg.d_ff)[:k].astype(np.int32)))
              for layer in model.weights.layers]
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    sparse = LoadedModel(cfg, weights, None, model.source)
    return Engine(sparse, FfnStrategy(FixedListFFN(), states, f"sparse s={sparsity:g} (K={k})"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.8, 0.9])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    if any(not 0 <= s < 1 for s in args.sparsity):
        raise SystemExit(f"error: --sparsity values must lie in [0, 1), got {args.sparsity}")
    cfg = TINY if args.tiny else LLAMA2_7B
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    load_before = load_average()
    device = jax.devices()[0]
    log(f"jax {jax.__version__} on {device.device_kind}; {cfg.name}")
    model = LoadedModel(cfg, jax.block_until_ready(random_weights(cfg, dtype, device, args.seed)), None, cfg.name)
    engines = {"dense": Engine(model)} | {e.ffn.name: e for e in (fixed_list_engine(model, s, args.seed)
                                                                     for s in args.sparsity)}
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, MIN_PROMPT_BUCKET).tolist()
    def warm(name: str, engine: Engine):
        def call() -> None:
            engine.warmup(len(prompt), config)
            log(f"{name}: compiled")
        return call

    rate = lambda result: result.decode_tokens_per_s
    measured = interleaved_rounds(
        {name: (lambda r, e=engine: e.generate(prompt, config)) for name, engine in engines.items()}, args.rounds,
        warm={name: warm(name, engine) for name, engine in engines.items()},
        after_round=lambda r, so_far: log(f"round {r + 1}: " + ", ".join(
            f"{n} {rate(run.result):.1f} tok/s" for n, run in so_far.rounds[r].items())))
    speeds = {name: measured.values(name, rate) for name in engines}
    median = {name: measured.median(name, rate) for name in engines}
    vs_dense = {name: measured.median_ratio(name, "dense", rate) for name in engines}
    lines = [f"# Fixed-list sparse decode: {cfg.name}", "",
             f"- {machine_line(machine(load_before))}",
             f"- {device.device_kind} ({device.platform}); {jnp.dtype(dtype).name}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- greedy, {args.new_tokens} new tokens after a {len(prompt)}-token random prompt; median of "
             f"{args.rounds} interleaved rounds (order rotating); vs dense: median of same-round ratios", "",
             "| engine | decode tok/s | vs dense |", "|---|---|---|"]
    lines += [f"| {name} | {v:.1f} | {vs_dense[name]:.2f}x |" for name, v in median.items()]
    publish("\n".join(lines), args.out, dict(device=device.device_kind, jax=jax.__version__, model=cfg.name,
                                             new_tokens=args.new_tokens, speeds=speeds, median=median,
                                             vs_dense=vs_dense, machine=machine(load_before)))


if __name__ == "__main__":
    main()
