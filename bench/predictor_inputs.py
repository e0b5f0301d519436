"""Which input predicts a layer's active FFN neurons best? (default model)

For a few layers, three candidate inputs on the same tokens, each feeding an equal-width
predictor trained the same way (``jpinfer.predictor.train_layer``):

- ``ffn``: the layer's normalised FFN input (available only after attention);
- ``lookahead``: the residual stream before the layer's attention, normalised as attention
  sees it (available one attention block earlier: Deja Vu's lookahead);
- ``previous``: the previous layer's normalised FFN input.

Labels: |silu(g)*u| over the layer's threshold for ``--sparsity`` (uniform calibration on
the first windows). Tokens: ``--windows`` random windows of WikiText-2 valid, split in
corpus order (the tail is held out). Reported on the held-out tail: the fraction of neurons
that must be computed to reach recall 0.9 / 0.99, and precision at recall 0.74 (the
baseline measured before predictors existed: recall 0.69-0.74 at precision ~0.75).

    python bench/predictor_inputs.py --out bench/results/predictor_inputs.md
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import jpinfer
from jpinfer.bench.protocol import machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.models import transformer
from jpinfer.predictor import LayerData, TrainConfig, cutoff_for_recall, predict_logits, train_layer
from jpinfer.predictor.train import score
from jpinfer.profiler import calibrate, token_windows
from jpinfer.profiler.activity import activation_and_score

RECALLS = (0.74, 0.9, 0.99)


@dataclasses.dataclass(frozen=True)
class _Capture:
    """ffn_impl returning the dense FFN and, as aux, its input and the active mask."""

    cfg: jpinfer.ModelConfig

    def __call__(self, i, layer, x, threshold):
        a, s = activation_and_score(layer, x, self.cfg, "product")
        return transformer.ffn_down(layer, a), (x.astype(jnp.float16), s > threshold)


def collect(model, tokens, thresholds, layers, batch_size):
    """Per layer: FFN inputs, previous layer's FFN inputs, lookahead inputs (float16) and masks."""
    cfg, weights = model.cfg, model.weights
    capture = _Capture(cfg)
    run = jax.jit(lambda w, t, thr: transformer.forward(
        w, t, transformer.KVCache.create(cfg, t.shape[0], t.shape[1], w.dtype), cfg, capture, thr)[2])
    heads = {layer: jax.jit(lambda w, t, layer=layer: transformer.forward(
        dataclasses.replace(w, layers=w.layers[:layer], final_norm=w.layers[layer].attn_norm), t,
        transformer.KVCache.create(cfg, t.shape[0], t.shape[1], w.dtype), cfg)[0].astype(jnp.float16))
        for layer in layers}
    out = {layer: {"ffn": [], "previous": [], "lookahead": [], "masks": []} for layer in layers}
    thr = jnp.asarray(thresholds, jnp.float32)
    for start in range(0, len(tokens), batch_size):
        chunk = jnp.asarray(tokens[start : start + batch_size])
        aux = run(weights, chunk, thr)
        for layer in layers:
            out[layer]["ffn"].append(np.asarray(aux[layer][0]).reshape(-1, cfg.d_model))
            out[layer]["previous"].append(np.asarray(aux[layer - 1][0]).reshape(-1, cfg.d_model))
            out[layer]["masks"].append(np.packbits(np.asarray(aux[layer][1]).reshape(-1, cfg.d_ff), axis=-1))
            out[layer]["lookahead"].append(np.asarray(heads[layer](weights, chunk)).reshape(-1, cfg.d_model))
    return {layer: {k: np.concatenate(v) for k, v in parts.items()} for layer, parts in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--windows", type=int, default=96, help="windows of 512 tokens (the tail 15%% is held out)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    if min(layers) < 1:
        raise SystemExit("layers must be >= 1 (layer 0 has no previous layer)")

    t0 = time.perf_counter()
    model = jpinfer.load_model(None)
    windows = token_windows("wikitext2-valid", model.tokenizer, window=512, n_tokens=args.windows * 512, seed=0)
    cal = calibrate(model, windows.tokens[:8], args.sparsity, progress=False)
    data = collect(model, windows.tokens, cal.thresholds, layers, args.batch_size)
    config = TrainConfig(max_epochs=args.epochs)
    rows = []
    for layer in layers:
        for name in ("ffn", "lookahead", "previous"):
            sample = LayerData(data[layer][name], data[layer]["masks"], model.cfg.d_ff)
            result = train_layer(sample, args.rank, config, progress=False)
            _, held = sample.split(config.held_out)
            logits = np.asarray(predict_logits(result.weights, jnp.asarray(held.inputs, jnp.float32)))
            active = held.active()
            at = {r: score(logits, active, cutoff_for_recall(logits, active, r)) for r in RECALLS}
            rows.append((layer, name, at, result))
            print(layer, name, {r: (round(s.precision, 3), round(s.predicted, 3)) for r, s in at.items()}, flush=True)

    lines = [
        "# Predictor input: FFN input vs lookahead vs previous layer (default model)", "",
        command_line(f"python bench/predictor_inputs.py --layers {args.layers} --rank {args.rank} --windows "
                     f"{args.windows} --sparsity {args.sparsity} --epochs {args.epochs}"), "",
        f"{machine_line(machine())} {args.windows * 512} tokens of WikiText-2 valid (held-out tail "
        f"{config.held_out:.0%}), labels at "
        f"{args.sparsity:.0%} uniform sparsity, width {args.rank}, {time.perf_counter() - t0:.0f} s.", "",
        "| layer | input | precision @ recall 0.74 | computed @ recall 0.9 | computed @ recall 0.99 | held-out loss |",
        "|---|---|---|---|---|---|",
    ]
    for layer, name, at, result in rows:
        lines.append(f"| {layer} | {name} | {at[0.74].precision:.3f} | {at[0.9].predicted:.3f} | "
                     f"{at[0.99].predicted:.3f} | {min(result.held_out_loss):.4f} |")
    lines += ["", "\"computed\": mean fraction of the layer's neurons over the cut-off that reaches the recall "
              "(lower is better; the truly active fraction is about 1 - sparsity)."]
    publish("\n".join(lines) + "\n", args.out, {"machine": machine(), "rows": [
        {"layer": layer, "input": name, "held_out_loss": min(result.held_out_loss),
         **{f"recall_{r}": {"precision": s.precision, "predicted": s.predicted} for r, s in at.items()}}
        for layer, name, at, result in rows]})


if __name__ == "__main__":
    main()
