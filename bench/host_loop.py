"""What a host loop over layers costs: one jit per step against per-layer calls and device hops.

A hybrid step (hot neurons on the accelerator, cold ones on the CPU device) cannot be
one jitted function, since a computation belongs to one device; it is a Python loop of
per-layer calls with the hidden state moving between devices. This measures the fixed
cost of that structure on layers too small for their arithmetic to matter:

- ``one jit``: all layers in one jitted function on the accelerator;
- ``per-layer calls``: a Python loop of one jitted call per layer, same device;
- ``+ device hop``: per layer, the hot part on the accelerator, the hidden state copied to
  the CPU device, a cold part there, its result copied back and merged (JAX's
  asynchronous dispatch lets the two parts overlap).

The accelerator is ``jax.devices()[0]`` and the host ``jax.devices("cpu")[0]``; on a
machine without a GPU two simulated CPU devices play the two roles (device 0 and 1).
Median milliseconds per step over ``--steps`` steps.

    python bench/host_loop.py
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 2)  # before first use; ignored by a GPU accelerator

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpinfer.bench.protocol import interleaved_rounds, machine, machine_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    n, d = args.layers, args.d_model

    accel = jax.devices()[0]
    cpus = jax.devices("cpu")
    host = cpus[1] if accel.platform == "cpu" else cpus[0]
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((d, d), dtype=np.float32) / np.sqrt(d) for _ in range(n)]
    hot = [jax.device_put(w, accel) for w in weights]
    cold = [jax.device_put(w, host) for w in weights]
    x = jax.device_put(jnp.ones((d,), jnp.float32), accel)

    layer = jax.jit(lambda w, h: h + jnp.tanh(w @ h))
    part = jax.jit(lambda w, h: jnp.tanh(w @ h))
    merge = jax.jit(lambda h, a, b: h + 0.5 * (a + b))

    @jax.jit
    def whole(ws, h):
        for w in ws:
            h = h + jnp.tanh(w @ h)
        return h

    def loop():
        h = x
        for w in hot:
            h = layer(w, h)
        return h

    def hop():
        h = x
        for w_hot, w_cold in zip(hot, cold):
            h_host = jax.device_put(h, host)
            a = part(w_hot, h)
            b = jax.device_put(part(w_cold, h_host), accel)
            h = merge(h, a, b)
        return h

    print(machine_line(machine()))
    print(f"accelerator {accel}, host {host}; {n} layers of ({d}, {d})")
    steps = {"one jit": lambda: whole(hot, x), "per-layer calls": loop, "+ device hop": hop}
    measured = interleaved_rounds({name: (lambda r, f=f: jax.block_until_ready(f())) for name, f in steps.items()},
                                  args.steps)
    for name in steps:
        t = measured.median(name) * 1e3
        print(f"  {name:<16} {t:7.3f} ms per step  {t / n * 1e3:7.1f} us per layer")


if __name__ == "__main__":
    main()
