"""The GPU suite's checks: every sparse FFN op and the sparse decodes against references, in bfloat16.

Kernels: every Pallas variant (``pallas.KERNELS``) and XLA's gather (``sparse_ffn(backend=
"gather")``) over a random list whose last entries are padding (``count`` < K), for 1 and 4 tokens,
against a float64 numpy evaluation of the listed-neuron FFN on the same bfloat16 values. The
tolerance is a worst-case rounding bound (``listed_ffn_bound``) built from bfloat16's and float32's
unit roundoffs and the sums' lengths: a wrong neuron, a dropped block or a wrong padding mask exceeds
it by orders of magnitude.

Decodes: the fixed-list engine with every neuron listed and the hybrid with every neuron active (cut-off
-inf, K = d_ff) compute the dense model; their logits after a prompt are compared with the float32
decode of the same weights (``highest`` matmul precision). Tolerance: twice the dense bfloat16 decode's
own distance from that reference (the rounding a bfloat16 decoder of this model carries; an engine that
rounds at most as often as dense stays within it, the factor 2 allowing other summation orders) plus
bfloat16's unit roundoff times the reference's norm (a floor where dense happens to land close).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.chain_kernels import sparse_ops
from jpinfer.bench.fixed_list import fixed_list_engine
from jpinfer.bench.results import error_text
from jpinfer.models.loading import LoadedModel
from jpinfer.modes.devices import cast_floats
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import MIN_PROMPT_BUCKET, GenerationConfig, attend_length, cache_capacity
from jpinfer.sparse import NeuronFFN

BF16_U = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, round to nearest
F32_U = 2.0**-24  # float32's
# The largest |derivative| of the activations' nonlinear factor: silu' peaks at 1.0998 (x ~ 2.4), relu' is 1.
ACT_LIPSCHITZ = 1.1
CHECK_TOKENS = (1, 4)
PADDING = 3  # listed entries past ``count``: garbage ids the ops must ignore


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound on a recursive sum of n terms, each rounded."""
    if n * u >= 1:
        raise ValueError(f"no rounding bound for a sum of {n} terms at unit roundoff {u}")
    return n * u / (1 - n * u)


def listed_ffn_reference(rows: np.ndarray, x: np.ndarray, ids: np.ndarray, count: int,
                         kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(sum over the first ``count`` listed neurons of act_j(x) * down_j, its elementwise error bound), float64.

    rows (n, R, d), x (T, d): the op's bfloat16 values, exact in float64. The bound assumes what every op
    here does: products summed in float32 (gate/up dots of d terms, the down sum of ``count`` terms), the
    dots, activations and output possibly rounded to bfloat16 once each (XLA's gather rounds the
    activations, ``sparse_ffn`` its output). Per neuron j and token: e_h = gamma_d(u32) sum|w x| + u_bf16 |h|
    for each of gate and up; e_a = L e_g |u| + |sigma(g)| e_u + (u_bf16 + 4 u32) |a| (L: ACT_LIPSCHITZ; 4 u32:
    float32's evaluation of the activation); then e_out = sum_j |down_j| e_a_j + gamma_count(u32)
    sum_j |a_j down_j| + u_bf16 |out|.
    """
    listed = rows[ids[:count]].astype(np.float64)  # (k, R, d)
    x = x.astype(np.float64)
    n_in = rows.shape[1] - 1
    d = rows.shape[2]
    h = np.einsum("krd,td->rtk", listed[:, :n_in], x)  # (n_in, T, k)
    e_h = gamma(d, F32_U) * np.einsum("krd,td->rtk", np.abs(listed[:, :n_in]), np.abs(x)) + BF16_U * np.abs(h)
    up, e_up = h[n_in - 1], e_h[n_in - 1]
    if n_in == 2:
        gate, e_gate = h[0], e_h[0]
        sig = {"swiglu": gate / (1 + np.exp(-gate)), "reglu": np.maximum(gate, 0),
               "drelu": np.maximum(gate, 0)}[kind]
        up_factor = np.maximum(up, 0) if kind == "drelu" else up
        act = sig * up_factor
        e_act = ACT_LIPSCHITZ * e_gate * np.abs(up_factor) + np.abs(sig) * e_up
    else:
        act, e_act = np.maximum(up, 0), e_up
    e_act = e_act + (BF16_U + 4 * F32_U) * np.abs(act)
    down = listed[:, n_in]  # (k, d)
    out = act @ down
    size = np.abs(act) @ np.abs(down)
    bound = e_act @ np.abs(down) + gamma(max(count, 1), F32_U) * size + BF16_U * np.abs(out)
    return out, bound


@dataclasses.dataclass
class Check:
    """One check's outcome: ``worst`` is the largest |error| / tolerance (<= 1 passes)."""

    name: str
    passed: bool
    worst: float
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.name}: {self.detail}"


def compare(name: str, got: np.ndarray, ref: np.ndarray, tol: np.ndarray) -> Check:
    """|got - ref| <= tol everywhere (NaN fails)."""
    err = np.abs(np.asarray(got, np.float64) - ref)
    ratio = np.where(tol > 0, err / np.maximum(tol, 1e-300), np.where(err > 0, np.inf, 0.0))
    worst = float(np.nanmax(ratio)) if np.isfinite(ratio).all() else float("inf")
    passed = bool(np.isfinite(np.asarray(got, np.float64)).all() and worst <= 1.0)
    return Check(name, passed, worst, f"max |error| {err.max():.3g}, max |error| / tolerance {worst:.3g}")


FfnOp = Callable[[NeuronFFN, jax.Array, jax.Array], jax.Array]  # (ffn, x (T, d), ids) -> (T, d)


def kernel_checks(d_model: int, d_ff: int, sparsity: float, interpret: bool, seed: int = 0, kind: str = "swiglu",
                  ops: Callable[[str, int, bool], dict[str, FfnOp]] = sparse_ops) -> list[Check]:
    """Every op of ``ops(kind, count, interpret)`` (default: every Pallas variant and XLA's gather) on one random
    bfloat16 layer against ``listed_ffn_reference``, per token count."""
    rng = np.random.default_rng(seed)
    n_rows = 2 if kind == "relu" else 3
    rows_np = (rng.standard_normal((d_ff, n_rows, d_model)) / np.sqrt(d_model)).astype(jnp.bfloat16)
    ffn = NeuronFFN(rows=jnp.asarray(rows_np), ids=jnp.arange(d_ff, dtype=jnp.int32), b_up=None, b_down=None,
                    kind=kind)
    k = max(PADDING + 1, round(d_ff * (1 - sparsity)))
    ids = rng.permutation(d_ff)[:k].astype(np.int32)
    count = k - PADDING
    out = []
    for tokens in CHECK_TOKENS:
        x_np = rng.standard_normal((tokens, d_model)).astype(jnp.bfloat16)
        ref, bound = listed_ffn_reference(rows_np, x_np, ids, count, kind)
        for name, op in ops(kind, count, interpret).items():
            label = f"{name}, {tokens} token(s), K={k} (count {count}), d_model {d_model}, d_ff {d_ff}"
            try:
                got = np.asarray(op(ffn, jnp.asarray(x_np), jnp.asarray(ids)).astype(jnp.float32))
            except Exception as err:  # a variant that does not compile is a failed check, not a crash
                out.append(Check(label, False, float("inf"), error_text(err)))
                continue
            out.append(compare(label, got.reshape(ref.shape), ref, bound))
    return out


def next_logits(engine: Engine, prompt: list[int], token: int) -> np.ndarray:
    """float32 logits (vocab,) of decoding ``token`` after ``prompt`` (one bucket long) with the engine's own
    stepper: the prefill fills the cache, then one decode step."""
    n = len(prompt)
    capacity = cache_capacity(n + 1, engine.cfg.max_position)
    stepper = engine.stepper
    cache = stepper.new_cache(capacity)
    _, cache, _ = stepper.first(jnp.asarray([prompt], jnp.int32), jnp.int32(n), cache, jax.random.PRNGKey(0),
                                GenerationConfig(max_new_tokens=1).sampler, attend_length(n, capacity))
    logits, _ = stepper.step_logits(jnp.asarray([token], jnp.int32), cache, attend_length(n + 1, capacity))
    return np.asarray(logits[0], np.float64)


def decode_checks(model: LoadedModel, engines: dict[str, Callable[[], Engine]], seed: int = 0) -> list[Check]:
    """Each engine's next-token logits against the float32 decode of ``model``'s weights (see the module)."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, MIN_PROMPT_BUCKET).tolist()
    token = int(rng.integers(0, cfg.vocab_size))
    with jax.default_matmul_precision("highest"):
        f32 = LoadedModel(cfg, cast_floats(model.weights, jnp.float32), None, model.source)
        ref = next_logits(Engine(f32), prompt, token)
        del f32
    dense_err = float(np.linalg.norm(next_logits(Engine(model), prompt, token) - ref))
    tol = 2 * dense_err + BF16_U * float(np.linalg.norm(ref))
    out = []
    for name, build in engines.items():
        try:
            err = float(np.linalg.norm(next_logits(build(), prompt, token) - ref))
        except Exception as e:  # an engine that fails to build or run is a failed check
            out.append(Check(name, False, float("inf"), error_text(e)))
            continue
        out.append(Check(name, err <= tol, err / tol, f"|logits - float32| {err:.4g}, dense bf16's {dense_err:.4g}, "
                                                       f"tolerance {tol:.4g}"))
    return out


def full_list_engine(model: LoadedModel) -> Engine:
    """The fixed-list engine with every neuron listed: the dense model through the sparse path."""
    return fixed_list_engine(model, 0.0, seed=0)

