"""What one layer's trip from the accelerator to the CPU device and back costs, against the accelerator alone.

Why: the GPU suite's hybrid decodes the default model's shapes at 0.02x dense on an H200 (18 tok/s against
780, 2026-12-04, `gpu_suite.md`), with ~1% of the FFN's reads left on the host: the time goes to something
other than reading weights. The hybrid step (`jpinfer.modes.hybrid`) dispatches, per layer, two jitted calls
on the accelerator, moves x to the host (``jax.device_put``), runs a jitted call there, and moves its output
back. This script times that skeleton with the arithmetic taken out (each call adds a constant to a vector of
the model's width), so what remains is dispatch, synchronisation and copies; and, for comparison, the same
layers as one jitted accelerator step whose host part is a ``jax.pure_callback`` (the host work called from
inside the step, with no Python dispatch per layer).

Variants, each a step of ``--layers`` layers, timed end to end (median of ``--steps`` steps after a warm-up):
- ``accelerator only``: two jitted calls per layer on the accelerator;
- ``hybrid hops``: the same plus the host round trip per layer, as the hybrid step does it;
- ``one jit, host callback``: one jitted accelerator step, a ``pure_callback`` per layer running numpy, a jitted
  call on the CPU device (the hybrid's fallback), or a direct call of the native sparse FFN on host arrays with an
  empty list (``sparse.host_sparse_ffn``: what the hybrid's callback runs for a decode token, its arithmetic taken
  out; without the native library this variant is left out);
- ``one jit, no host``: that step without the callbacks (the floor of the one-jit form).
And the latency of a single blocked copy each way.

    PYTHONPATH=src python bench/hybrid_hops.py --out bench/results/hybrid_hops.md

Without a GPU, CPU device 0 plays the accelerator and CPU device 1 the host (as in the tests).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.protocol import load_average, machine, machine_line
from jpinfer.bench.results import command_line, markdown_table, publish
from jpinfer.modes.devices import default_devices
from jpinfer.sparse import NeuronFFN, host_sparse_ffn


def _step_seconds(step, steps: int) -> float:
    """Median wall seconds of ``step()`` (which blocks on its result) after two warm-up calls."""
    step(), step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(width: int, layers: int, steps: int) -> dict:
    """Per-layer microseconds of each variant (dict of name -> us) on the default devices."""
    accelerator, host = default_devices()[:2]
    bump = jax.jit(lambda v: v + 1.0)
    x_acc = jax.device_put(jnp.zeros((1, width), jnp.float32), accelerator)
    x_host = jax.device_put(jnp.zeros((1, width), jnp.float32), host)

    def accelerator_only():
        v = x_acc
        for _ in range(layers):
            v = bump(bump(v))
        v.block_until_ready()

    def hybrid_hops():
        v = x_acc
        for _ in range(layers):
            v = bump(bump(v))
            v = v + jax.device_put(bump(jax.device_put(v, host)), accelerator)
        v.block_until_ready()

    host_parts = {"numpy": lambda a: np.asarray(a) + np.float32(1.0),
                  "jit": lambda a: np.asarray(bump(jax.device_put(a, host)))}  # the hybrid's callback's fallback
    one_neuron = jax.device_put(NeuronFFN(jnp.zeros((1, 3, width), jnp.float32), jnp.zeros((1,), jnp.int32), None,
                                          None, "swiglu"), host)
    direct, no_ids = host_sparse_ffn(one_neuron), np.zeros((1,), np.int32)
    if direct is not None:  # the hybrid's callback for a decode token: the native kernel on host arrays, empty list
        host_parts["direct"] = lambda a: direct(np.asarray(a), no_ids, 0) + np.asarray(a) + np.float32(1.0)

    def one_jit(host_part: str | None):
        def body(v):
            for _ in range(layers):
                v = v + 1.0
                v = v * 1.0 + 1.0  # the hot part's place: a second dependent op
                if host_part:
                    v = v + jax.pure_callback(host_parts[host_part], jax.ShapeDtypeStruct(v.shape, v.dtype), v)
            return v
        fn = jax.jit(body)
        return lambda: fn(x_acc).block_until_ready()

    per_layer = lambda seconds: seconds / layers * 1e6
    result = {
        "accelerator only": per_layer(_step_seconds(accelerator_only, steps)),
        "hybrid hops": per_layer(_step_seconds(hybrid_hops, steps)),
        "one jit, host callback (numpy)": per_layer(_step_seconds(one_jit("numpy"), steps)),
        "one jit, host callback (a jitted host call)": per_layer(_step_seconds(one_jit("jit"), steps)),
        **({"one jit, host callback (a direct native call)": per_layer(_step_seconds(one_jit("direct"), steps))}
           if "direct" in host_parts else {}),
        "one jit, no host": per_layer(_step_seconds(one_jit(None), steps)),
    }
    copies = {
        "accelerator -> host copy": lambda: jax.device_put(x_acc, host).block_until_ready(),
        "host -> accelerator copy": lambda: jax.device_put(x_host, accelerator).block_until_ready(),
    }
    for name, copy in copies.items():
        result[name] = _step_seconds(copy, steps * layers) * 1e6
    return dict(accelerator=str(accelerator.device_kind), host=str(host), per_layer_us=result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="markdown path (its .json beside it)")
    ap.add_argument("--widths", type=int, nargs="+", default=[576, 4096], help="vector widths (d_model)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    try:  # before JAX starts: without a GPU, CPU device 1 plays the host
        jax.config.update("jax_num_cpu_devices", 2)
    except RuntimeError:
        pass
    load_before = load_average()
    runs = [dict(width=w, **measure(w, args.layers, args.steps)) for w in args.widths]
    m = machine(load_before)
    names = list(runs[0]["per_layer_us"])
    lines = ["# The hybrid step's device crossings, per layer", "", f"- {machine_line(m)}",
             "- " + command_line(f"python bench/hybrid_hops.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
             f"- accelerator {runs[0]['accelerator']}, host {runs[0]['host']}; {args.layers} layers a step, median of "
             f"{args.steps} steps; microseconds per layer (the copies: per copy, of one float32 vector)", ""]
    lines += markdown_table(["variant", *[f"width {r['width']}" for r in runs]],
                            [[n, *[f"{r['per_layer_us'][n]:.1f}" for r in runs]] for n in names])
    publish("\n".join(lines) + "\n", args.out, dict(machine=m, layers=args.layers, steps=args.steps, runs=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
