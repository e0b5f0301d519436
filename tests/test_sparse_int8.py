"""The sparse mode with int8 weights: the int8 sparse FFN kernel (jpinfer.native.kernels.sparse_ffn_int8, native
and XLA) against an exact integer / float64 numpy reference written apart from the code, the full list against the
dense int8 FFN, the sparse int8 engine against the dense int8 one, and the errors for artifacts of another model.

Tolerances. The integer parts are exact: x is quantized per token with the same float32 operations as the kernel
(one product, one rounding: equal bits), the gate/up and down sums are exact int64 here and int32 there. What
rounds differently is the float32 activation (the kernel's exp and products against float64 here, a few u
relative) and so the activations' peak; each test first checks that no activation lies within 8 u * 127 (the
scaled activation's possible shift) of a rounding boundary, so both sides quantize them to the same integers.
Then y = acc * (activation scale * down scale) differs only by the scale's few roundings: |dy| <= 16 u |y|
(peak from a float32 activation ~5 u, its product with 1/127, the scale product and the final product: 1 u
each; 16 leaves a margin), plus u |y| for a b_down added after. A wrong, missing or doubled neuron moves y by a
whole int8 step of that neuron's activation times its down column, orders of magnitude more.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modes import PROMPT, all_active, assert_decodes_like
from test_native_kernels import BACKENDS, list_cases

import jpinfer
from jpinfer import GenerationConfig
from jpinfer.config import UNGATED_KINDS
from jpinfer.models import quantized, transformer
from jpinfer.modes import build_engine
from jpinfer.native import kernels as K
from jpinfer.predictor import PredictorMismatchError, TrainConfig, train_predictors
from jpinfer.profiler import ProfileMismatchError, ProfileSettings, profile
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.sparse import all_rows_ffn, neurons, sparse_ffn

from activation_reference import activation64
from native_threads import on_one_thread
from profiler_fixtures import ffn_inputs, tiny_engine
from tolerances import DECODER_ATOL, KERNEL_ATOL, KERNEL_RTOL

U = 2.0 ** -24  # float32 unit roundoff
N, D = 64, 100  # d not a multiple of 32: the integer dot products' scalar tails run
INV127 = np.float32(1 / 127)
# How near a rounding boundary a listed activation's scaled value (activation * 127 / peak, up to 127) may lie and
# still round as here: the kernel computes it in float32, a few roundings of at most u * 127 each from this float64
# value (8 allowed), so farther from a boundary its int8 activation is the one this reference takes.
MARGIN = 8 * U * 127


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))



def tokens32(x):
    """numpy float32 per token, the kernel's operations: q = rint(x * (127 / max|x|)), scale max|x| * (1/127)."""
    x = np.asarray(x, np.float32)
    peak = np.abs(x).max(-1)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, 1), 0).astype(np.float32)
    return np.clip(np.rint(x * inverse[:, None]), -127, 127).astype(np.int64), (peak * INV127).astype(np.float32)


def listed_positions(ids, count, n) -> tuple[list[int], list[int]]:
    """The valid listed ids among the first ``count`` (clamped) and their list positions."""
    positions = [p for p in range(int(np.clip(count, 0, len(ids)))) if 0 <= ids[p] < n]
    return [int(ids[p]) for p in positions], positions


def reference(rows, scales, down_scales, b_up, x, ids, count, kind, near=MARGIN, weights=None):
    """``down_reference`` over int8 bundles: gate/up exact int64 dots times the float32 scales (the float32
    products of the kernel)."""
    n, R, d = rows.shape
    q, ts = tokens32(x)
    listed, positions = listed_positions(ids, count, n)
    w = rows.astype(np.int64)
    h = [np.float32(q @ w[listed, s].T) * (ts[:, None] * scales[listed, s][None]) for s in range(R - 1)]  # (T, m)
    return down_reference(h, b_up, w[:, R - 1], down_scales, listed, positions, kind, near, weights)


def down_reference(h, b_up, down, down_scales, listed, positions, kind, near=MARGIN, weights=None):
    """(y float64 (T, d), the smallest distance of a listed activation's scaled value to a rounding boundary,
    (T, d) what rounding the activations within ``near`` of a boundary the other way could move y by, and how
    many there are).

    h: the listed neurons' gate (if gated) and up values, each (T, m); down: (n, d) int64 down slots. The
    activation in float64 (times its list position's weight when ``weights`` (T, K) are given), the listed
    activations quantized per token in float64, exact int64 down sums."""
    T, d = h[-1].shape[0], down.shape[1]
    if not listed:
        return np.zeros((T, d)), np.inf, np.zeros((T, d)), 0
    up = h[-1].astype(np.float64) + (0 if b_up is None else b_up[listed].astype(np.float64))
    a = activation64(kind, h[0].astype(np.float64) if len(h) == 2 else None, up)
    if weights is not None:
        a = a * np.asarray(weights, np.float64)[:, positions]
    peak = np.abs(a).max(-1, keepdims=True)
    scaled = np.divide(a * 127, peak, out=np.zeros_like(a), where=peak > 0)
    qa = np.rint(scaled).astype(np.int64)
    distance = np.abs(np.abs(scaled) - np.floor(np.abs(scaled)) - 0.5)
    step = (peak / 127) * down_scales.astype(np.float64)[None]
    y = (qa @ down[listed]).astype(np.float64) * step
    flips = (distance <= near).astype(np.int64) @ np.abs(down[listed]) * step
    return y, float(distance.min()), flips, int((distance <= near).sum())


def bundles(kind, seed=0, n=N, d=D):
    """int8 bundles of a random layer quantized by the project's quantizer (one scale per row of w_gate_up and
    per output of w_down), a float32 b_up."""
    rng = np.random.default_rng(seed)
    R = 2 if kind in UNGATED_KINDS else 3
    gate_up = rng.standard_normal(((R - 1) * n, d)).astype(np.float32)
    down = rng.standard_normal((d, n)).astype(np.float32)
    down[:, ::9] *= 8  # a few strong neurons, as in real models
    from jpinfer.quant import int8

    gu, dn = int8.quantize(gate_up), int8.quantize(down)
    rows = np.concatenate([np.asarray(gu.values).reshape(R - 1, n, d).transpose(1, 0, 2),
                           np.asarray(dn.values).T[:, None]], axis=1)
    scales = np.asarray(gu.scales).reshape(R - 1, n).T.copy()
    b_up = (rng.standard_normal(n) * 0.1).astype(np.float32)
    return rows, scales, np.asarray(dn.scales), b_up


def assert_scaled_equal(y, ref, what, extra=0.0):
    y = np.asarray(y, np.float64)
    bound = 16 * U * np.abs(ref) + extra + 1e-30
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"{what}: error {err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}"


# ------------------------------------------------------------------ the kernel

@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("case", list(list_cases(N)))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_int8_kernel_lists(case, T, native):
    rows, scales, down_scales, b_up = bundles("swiglu")
    x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
    ids, count = list_cases(N)[case]
    ref, margin, _, _ = reference(rows, scales, down_scales, b_up, x, ids, count, "swiglu")
    assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
    y = K.sparse_ffn_int8(rows, scales, down_scales, x, ids, np.int32(count), kind="swiglu", b_up=b_up, native=native)
    assert y.shape == (T, D) and y.dtype == jnp.float32
    assert_scaled_equal(y, ref, f"{case} T={T}")


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 3])
def test_int8_kernel_weights_multiply_the_activations(T, native):
    """Weights by list position (a neuron's routing weight with experts) multiply each activation before the
    activations are quantized; some are 0 (an expert not picked), the list has a bad id and padding. The
    weights' product is one more float32 rounding of the activation, within the reference's 8 u margin."""
    rows, scales, down_scales, b_up = bundles("swiglu", seed=5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids = np.concatenate([rng.permutation(N)[:30], [N + 2, 0, 0]]).astype(np.int32)
    weights = np.where(rng.random((T, len(ids))) < 0.3, 0.0, rng.random((T, len(ids)))).astype(np.float32)
    ref, margin, _, _ = reference(rows, scales, down_scales, b_up, x, ids, 31, "swiglu", weights=weights)
    assert margin > MARGIN, "setup: an activation on a rounding boundary (change the seed)"
    unweighted, _, _, _ = reference(rows, scales, down_scales, b_up, x, ids, 31, "swiglu")
    assert np.abs(ref - unweighted).max() > 1000 * 16 * U * np.abs(ref).max()  # the weights matter
    y = K.sparse_ffn_int8(rows, scales, down_scales, x, ids, 31, kind="swiglu", b_up=b_up, weights=weights,
                          native=native)
    assert_scaled_equal(y, ref, f"weighted T={T}")


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("kind", list(K.KINDS))
def test_int8_kernel_kinds_bias_and_one_dimensional_x(kind, native):
    rows, scales, down_scales, b_up = bundles(kind, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, D)).astype(np.float32)
    b_down = rng.standard_normal(D).astype(np.float32)
    ids, count = rng.permutation(N)[:45].astype(np.int32), 40
    ref, margin, _, _ = reference(rows, scales, down_scales, b_up, x, ids, count, kind)
    assert margin > MARGIN
    y = K.sparse_ffn_int8(rows, scales, down_scales, x, ids, count, kind=kind, b_up=b_up, b_down=b_down,
                          native=native)
    assert_scaled_equal(y, ref + b_down, kind, extra=16 * U * np.abs(ref) + U * np.abs(ref + b_down))
    y1 = K.sparse_ffn_int8(rows, scales, down_scales, x[0], ids, count, kind=kind, b_up=b_up, native=native)
    assert y1.shape == (D,)
    assert_scaled_equal(y1, ref[0], kind + " 1-D")


def assert_right_under_jit_and_scan(kernel, reference, xs, x11, ids):
    """``kernel(x, ids, count)`` inside a jitted lax.scan (the decode loop's form), one token of ``xs`` (5, d) a
    step with a traced count, and over the 11 tokens ``x11`` (several calls of up to 8), against
    ``reference(x, ids, count)`` (a ``down_reference`` result) within ``assert_scaled_equal``."""
    counts = np.array([0, 1, 17, 40, 64], np.int32)

    @jax.jit
    def run(xs, counts):
        return jax.lax.scan(lambda c, xc: (c, kernel(xc[0], ids, xc[1])), 0, (xs, counts))[1]

    got = np.asarray(run(xs, counts))
    for t in range(5):
        ref, margin, _, _ = reference(xs[t:t + 1], ids, counts[t])
        assert margin > MARGIN
        assert_scaled_equal(got[t], ref[0], f"step {t}")
    y = jax.jit(lambda x: kernel(x, ids, 50))(x11)
    ref, margin, _, _ = reference(x11, ids, 50)
    assert margin > MARGIN
    assert_scaled_equal(y, ref, "11 tokens")


@pytest.mark.parametrize("native", BACKENDS)
def test_int8_kernel_under_jit_and_scan(native):
    rows, scales, down_scales, b_up = bundles("swiglu", seed=5)
    rng = np.random.default_rng(6)
    xs = rng.standard_normal((5, D)).astype(np.float32)
    ids = rng.permutation(N).astype(np.int32)
    x11 = rng.standard_normal((11, D)).astype(np.float32)
    assert_right_under_jit_and_scan(
        lambda x, ids, count: K.sparse_ffn_int8(rows, scales, down_scales, x, ids, count, kind="swiglu", b_up=b_up,
                                                native=native),
        lambda x, ids, count: reference(rows, scales, down_scales, b_up, x, ids, count, "swiglu"), xs, x11, ids)


@pytest.mark.parametrize("native", [b for b in BACKENDS if b.values[0]])
def test_int8_kernel_is_deterministic_across_thread_counts(native):
    """A shape that runs on several threads and partial sums: 1 thread and all give the same bits."""

    rows, scales, down_scales, b_up = bundles("swiglu", seed=8, n=1536, d=576)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    ids, count = rng.permutation(1536).astype(np.int32), 1400
    assert_thread_independent(
        lambda: np.asarray(K.sparse_ffn_int8(rows, scales, down_scales, x, ids, count, kind="swiglu", b_up=b_up)),
        reference(rows, scales, down_scales, b_up, x, ids, count, "swiglu"))


def assert_thread_independent(run, reference_result):
    """``run()`` gives the same bits on one thread as on all, and matches ``reference_result`` (a
    ``down_reference`` result over a few thousand activations: a few lie within reach of a rounding boundary and
    each may round the other way, at most 8 of them)."""
    one = on_one_thread(run)
    np.testing.assert_array_equal(run(), one)
    ref, _, flips, n_near = reference_result
    assert n_near <= 8
    assert_scaled_equal(one, ref, "medium", extra=flips)


def test_bad_int8_bundles_are_value_errors():
    rows, scales, down_scales, _ = bundles("swiglu")
    x, ids = np.zeros((1, D), np.float32), np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="int8"):
        K.sparse_ffn_int8(rows.astype(np.float32), scales, down_scales, x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="scales"):
        K.sparse_ffn_int8(rows, scales[:, :1], down_scales, x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="down_scales"):
        K.sparse_ffn_int8(rows, scales, down_scales[:5], x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="R|relu"):
        K.sparse_ffn_int8(rows, scales, down_scales, x, ids, 4, kind="relu")


# ------------------------------------------------------------------ the layout and the op

MIXTRAL_LIKE = dict(n_experts=4, experts_per_token=2)


def int8_engine(kind: str, seed: int = 0, **arch) -> jpinfer.Engine:
    model = tiny_engine(kind, seed, **arch).model
    return jpinfer.Engine(dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, "int8")))


@pytest.mark.parametrize("kind, arch", [("swiglu", {}), ("relu", {}), ("swiglu", MIXTRAL_LIKE)],
                         ids=["swiglu", "relu", "mixtral-like"])
@pytest.mark.parametrize("backend", ["auto", "xla", "gather"])
def test_the_full_list_is_the_dense_int8_ffn(kind, arch, backend):
    """Every neuron listed: the dense int8 FFN's integers (transformer.ffn_dense over the int8 layer), and the
    prefill form (all_rows_ffn) likewise; the bundles hold the dense model's own values and scales. With experts
    the activations are the routed ones (the kernel's weights), zero for the experts not picked."""
    engine = int8_engine(kind, **arch)
    layer = engine.weights.layers[1]
    x = ffn_inputs(tiny_engine(kind, **arch), np.random.default_rng(2).integers(0, 40, (2, 16)))[1][:3]
    x = x.astype(np.float32)
    ffn = neurons.from_layer(layer, kind, engine.cfg.experts)
    assert ffn.quantized and ffn.rows.dtype == jnp.int8
    n = engine.cfg.d_ff
    R = ffn.rows.shape[1]
    np.testing.assert_array_equal(np.asarray(ffn.rows[:, R - 1]), np.asarray(layer.w_down.values).T)
    np.testing.assert_array_equal(np.asarray(ffn.rows[:, R - 2]), np.asarray(layer.w_gate_up.values)[-n:])
    np.testing.assert_array_equal(np.asarray(ffn.scales[:, R - 2]), np.asarray(layer.w_gate_up.scales)[-n:])
    a = np.asarray(transformer.ffn_activations(layer, jnp.asarray(x), engine.cfg), np.float64)
    scaled = np.abs(a) * 127 / np.abs(a).max(-1, keepdims=True)
    assert np.abs(scaled - np.floor(scaled) - 0.5).min() > MARGIN  # setup: no activation on a boundary
    dense = np.asarray(transformer.ffn_dense(layer, jnp.asarray(x), engine.cfg), np.float64)
    b_down = 0 if layer.b_down is None else np.abs(np.asarray(layer.b_down, np.float64))
    extra = 32 * U * (np.abs(dense) + b_down)  # both sides add b_down after the scaled sum: u |y| each
    ids = jnp.arange(n, dtype=jnp.int32)
    for t in range(3):
        assert_scaled_equal(sparse_ffn(ffn, jnp.asarray(x[t]), ids, n, backend=backend), dense[t], kind, extra[t])
    assert_scaled_equal(all_rows_ffn(ffn, jnp.asarray(x)), dense, kind + " all rows", extra)


def test_subset_keeps_the_scales_of_its_neurons():
    """Hot and cold parts of int8 bundles add up to the whole layer's FFN over the same list."""
    engine = int8_engine("swiglu")
    ffn = neurons.from_layer(engine.weights.layers[0], "swiglu")
    part, table = ffn.subset(np.array([5, 1, 40], np.int32), with_b_down=False)
    np.testing.assert_array_equal(np.asarray(part.scales), np.asarray(ffn.scales)[[5, 1, 40]])
    np.testing.assert_array_equal(np.asarray(part.rows), np.asarray(ffn.rows)[[5, 1, 40]])
    assert part.down_scales is ffn.down_scales and table.tolist() == [5, 1, 40]


def test_the_pallas_backend_refuses_int8_bundles():
    ffn = neurons.from_layer(int8_engine("swiglu").weights.layers[0], "swiglu")
    with pytest.raises(ValueError, match="Pallas kernels take float rows"):
        sparse_ffn(ffn, jnp.zeros(ffn.d_model), jnp.arange(4, dtype=jnp.int32), 4, backend="pallas")


# ------------------------------------------------------------------ the mode

@pytest.mark.parametrize("arch", [{}, MIXTRAL_LIKE], ids=["swiglu", "mixtral-like"])
def test_all_active_sparse_int8_decodes_like_dense_int8(arch):
    dense = int8_engine("swiglu", **arch)
    sparse = build_engine(dense.model, "sparse", predictors=all_active(dense), capacity=dense.cfg.d_ff)
    assert all(state.ffn.quantized for state in sparse.ffn.state)
    assert_decodes_like(sparse, dense, 24, rtol=KERNEL_RTOL, atol=max(KERNEL_ATOL, DECODER_ATOL))


def test_int8_needs_its_own_profile_and_predictors():
    """The int8 model's FFN inputs are its own (the migration rescales them): a float model's predictors or
    profile are refused with the commands that make the right ones; predictors trained on the int8 model's
    profile run."""
    float_engine, int8_form = tiny_engine("relu"), int8_engine("relu")
    with pytest.raises(PredictorMismatchError, match=r"differs in weights format float there, int8 here: make one for "
                                                     r"this model \(jpinfer train-predictors.* --weights int8"):
        build_engine(int8_form.model, "sparse", predictors=all_active(float_engine))
    tokens = np.random.default_rng(1).integers(0, 40, (48, 32)).astype(np.int32)
    with pytest.raises(ProfileMismatchError, match=r"make one for this model \(jpinfer profile.* --weights int8"):
        build_engine(int8_form.model, "sparse", predictors=all_active(int8_form),
                     profile=profile(float_engine, tokens[:4], progress=False))
    prof = profile(int8_form, tokens, ProfileSettings(n_samples=1024), progress=False)
    predictors = train_predictors(int8_form, prof, ranks=8, config=TrainConfig(max_epochs=1), progress=False)
    assert predictors.meta["model"]["weights"] == "int8"
    engine = build_engine(int8_form.model, "sparse", predictors=predictors, profile=prof)
    assert all(isinstance(state.predictor.w_out, Int8Matrix) for state in engine.ffn.state)  # the model's format
    assert len(engine.generate(PROMPT, GenerationConfig(max_new_tokens=6)).token_ids) == 6
    with pytest.raises(PredictorMismatchError, match=r"trained for model 'tiny-relu' \(int8 weights"):
        build_engine(float_engine.model, "sparse", predictors=predictors)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float32], ids=["int8", "float32"])
def test_a_prompt_copies_one_layer_of_bundle_blocks_at_a_time(dtype):
    """``all_rows_ffn`` (a prompt) copies the gate, up and down column blocks out of each layer's bundles only once
    that layer's tokens exist: the compiled temporaries of a stack of layers do not grow with its depth (every
    layer's blocks were copied at the start of the step and held at once before ``ordering.after``)."""
    rng = np.random.default_rng(0)
    n, d = 1024, 128

    def bundle() -> neurons.NeuronFFN:
        if dtype == jnp.int8:
            return neurons.NeuronFFN(jnp.asarray(rng.integers(-127, 128, (n, 3, d), dtype=np.int8)),
                                     jnp.arange(n, dtype=jnp.int32), None, None, "swiglu",
                                     jnp.asarray(rng.random((n, 2), np.float32)),
                                     jnp.asarray(rng.random(d, np.float32)))
        return neurons.NeuronFFN(jnp.asarray(rng.standard_normal((n, 3, d), np.float32)),
                                 jnp.arange(n, dtype=jnp.int32), None, None, "swiglu")

    def temporaries(n_layers: int) -> int:
        ffns = [bundle() for _ in range(n_layers)]

        def stack(x, ffns):
            for ffn in ffns:
                x = x + all_rows_ffn(ffn, x) * 1e-3
            return x

        compiled = jax.jit(stack).lower(jnp.ones((32, d), jnp.float32), ffns).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    layer_bytes = 3 * n * d * jnp.dtype(dtype).itemsize
    assert temporaries(8) <= temporaries(2) + layer_bytes // 4
