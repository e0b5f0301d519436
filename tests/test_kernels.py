"""Sparse FFN kernels equal a float64 numpy reference; one compilation per shape and capacity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.config import FFN_KINDS, UNGATED_KINDS, ModelConfig
from jpinfer.models import params, transformer
from jpinfer.pallas import KERNELS, MAX_TOKENS, listed_ffn, sparse_rows_ffn
from jpinfer.sparse import neurons
from jpinfer.sparse.op import all_rows_ffn, sparse_ffn

from activation_reference import activation64
from tolerances import KERNEL_ATOL, KERNEL_RTOL

D, N = 192, 96  # d = 3 tiles of 64 in the Pallas kernel; N = 3 blocks / chunks of 32
BACKENDS = ["xla", "gather", "pallas"]


def _weights(kind, seed=0, d=D, n=N):
    rng = np.random.default_rng(seed)
    w = {
        "w_gate": None if kind in UNGATED_KINDS else rng.standard_normal((d, n)) / np.sqrt(d),
        "w_up": rng.standard_normal((d, n)) / np.sqrt(d),
        "w_down": rng.standard_normal((n, d)) / np.sqrt(n),
        "b_up": rng.standard_normal(n) if kind in UNGATED_KINDS else None,
        "b_down": rng.standard_normal(d) if kind in UNGATED_KINDS else None,
    }
    return w


def _layout(kind, w, dtype=np.float32):
    """The decoder's (out, in) layout of the reference's x @ W matrices, bundled neuron-major."""
    cast = {k: None if v is None else v.astype(dtype) for k, v in w.items()}
    out_in = {k: v.T for k, v in cast.items() if k.startswith("w_") and v is not None}
    return neurons.from_arrays(kind, **(cast | out_in))


def _reference(kind, w, x, ids, count):
    """float64: sum over ids[:count] of act_i(x) * w_down[i] (+ b_down)."""
    up = x @ w["w_up"] + (0.0 if w["b_up"] is None else w["b_up"])
    gate = None if w["w_gate"] is None else x @ w["w_gate"]
    act = activation64(kind, gate, up)
    sel = np.asarray(ids[:count], np.int64)
    y = act[..., sel] @ w["w_down"][sel]
    return y + (0.0 if w["b_down"] is None else w["b_down"])


def _lists(rng):
    """(name, ids, count) cases over capacity K = N, plus a few other capacities."""
    perm = rng.permutation(N).astype(np.int32)
    padded = perm.copy()
    padded[45:] = rng.integers(-5, 3 * N, size=N - 45)  # garbage padding, out of range too
    return [
        ("random_padded", padded, 45),
        ("empty", perm, 0),
        ("full", perm, N),
        ("one", np.array([17], np.int32), 1),
        ("one_of_capacity", perm, 1),
        ("capacity_not_block_multiple", perm[:50], 50),
        ("count_over_capacity_is_capacity", perm[:50], 70),
        ("zero_capacity", np.zeros((0,), np.int32), 0),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_equals_float64_reference(kind, backend):
    rng = np.random.default_rng(FFN_KINDS.index(kind))
    w = _weights(kind)
    ffn = _layout(kind, w)
    x_batch = rng.standard_normal((3, D))
    for name, ids, count in _lists(rng):
        for x in (x_batch[0], x_batch) if ids.shape[0] == N else (x_batch,):  # one token: same compile
            got = sparse_ffn(ffn, jnp.asarray(x, jnp.float32), jnp.asarray(ids), count, backend=backend)
            assert got.shape == x.shape and got.dtype == jnp.float32
            want = _reference(kind, w, x, ids, count)
            np.testing.assert_allclose(np.asarray(got), want, rtol=KERNEL_RTOL, atol=KERNEL_ATOL, err_msg=name)


# Per variant, one gated kind (swiglu) and one ungated (relu, with b_up) reach every branch of the kernels; the
# other kinds differ only in activations.activate, which test_equals_float64_reference checks through the op's
# default variant. They run with the slow tests (CI).
VARIANT_KINDS = [kind if kind in ("swiglu", "relu") else pytest.param(kind, marks=pytest.mark.slow)
                 for kind in FFN_KINDS]


@pytest.mark.parametrize("variant", sorted(KERNELS))
@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_every_kernel_variant_equals_float64_reference(kind, variant):
    """Each Pallas variant (interpret mode), not only the op's default: every list case, one token and
    a batch sharing the list, and a batch over MAX_TOKENS (run in groups)."""
    rng = np.random.default_rng(11 + FFN_KINDS.index(kind))
    w = _weights(kind)
    ffn = _layout(kind, w)
    kernel = KERNELS[variant]
    batches = (rng.standard_normal((1, D)), rng.standard_normal((3, D)), rng.standard_normal((MAX_TOKENS + 2, D)))
    for name, ids, count in _lists(rng):
        if ids.shape[0] == 0:
            continue  # sparse_ffn answers an empty list without a kernel
        for x in batches if name == "random_padded" else batches[1:2]:
            got = kernel(ffn.rows, ffn.b_up, jnp.asarray(x, jnp.float32), jnp.asarray(ids), jnp.int32(count), kind=kind,
                         interpret=True)
            assert got.shape == x.shape and got.dtype == jnp.float32
            want = _reference(kind, w, x, ids, count) - (0.0 if w["b_down"] is None else w["b_down"])
            np.testing.assert_allclose(np.asarray(got), want, rtol=KERNEL_RTOL, atol=KERNEL_ATOL,
                                       err_msg=f"{name}, {x.shape[0]} tokens")


@pytest.mark.parametrize("variant", ["split", "fused"])
def test_kernel_tiles_that_do_not_divide_the_list_or_d(variant):
    """Small blocks: many programs, the list padded to whole blocks, d in several tiles; a list
    with a repeated padding id past the count; every neuron listed in reverse."""
    kind = "swiglu"
    w = _weights(kind, seed=9)
    ffn = _layout(kind, w)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, D))
    small = dict(block_neurons=2, block_d=32, block_neurons_down=8, block_d_down=16)
    for ids, count in ((rng.permutation(N)[:37].astype(np.int32), 37), (np.arange(N, dtype=np.int32)[::-1].copy(), N),
                       (np.concatenate([rng.permutation(N)[:5], np.full(12, 3)]).astype(np.int32), 5)):
        got = listed_ffn(ffn.rows, None, jnp.asarray(x, jnp.float32), jnp.asarray(ids), count, kind=kind,
                         variant=variant, interpret=True, **small)
        np.testing.assert_allclose(np.asarray(got), _reference(kind, w, x, ids, count), rtol=KERNEL_RTOL,
                                   atol=KERNEL_ATOL)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_all_rows_equals_float64_reference_over_every_neuron_and_over_a_part(kind):
    """The prefill form: every row of a layout, one token or several (up to 8: the native kernels over the full list
    on the CPU; 12: the XLA products), with a list per token (``keep``: a batch's sequences); a compact part (hot +
    cold)."""
    rng = np.random.default_rng(7 + FFN_KINDS.index(kind))
    w = _weights(kind)
    ffn = _layout(kind, w)
    every = np.arange(N)
    for x in (rng.standard_normal(D), rng.standard_normal((5, D)), rng.standard_normal((12, D))):
        got = all_rows_ffn(ffn, jnp.asarray(x, jnp.float32))
        assert got.shape == x.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), _reference(kind, w, x, every, N), rtol=KERNEL_RTOL,
                                   atol=KERNEL_ATOL)
        if x.ndim == 2:
            keep = rng.random((len(x), N)) < 0.4
            got = np.asarray(all_rows_ffn(ffn, jnp.asarray(x, jnp.float32), jnp.asarray(keep)))
            for t in range(len(x)):
                kept = np.flatnonzero(keep[t])
                np.testing.assert_allclose(got[t], _reference(kind, w, x[t], kept, len(kept)), rtol=KERNEL_RTOL,
                                           atol=KERNEL_ATOL)
    x = rng.standard_normal((5, D))
    hot_ids = rng.permutation(N)[:40]
    hot, _ = ffn.subset(hot_ids)
    cold, _ = ffn.subset(np.setdiff1d(every, hot_ids), with_b_down=False)
    parts = all_rows_ffn(hot, jnp.asarray(x, jnp.float32)) + all_rows_ffn(cold, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(parts), _reference(kind, w, x, every, N), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    np.testing.assert_allclose(np.asarray(all_rows_ffn(hot, jnp.asarray(x, jnp.float32))),
                               _reference(kind, w, x, hot_ids, 40), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_auto_backend_on_cpu_is_the_native_kernel_else_the_xla_loop():
    """On the CPU "auto" runs the native fused kernel when the library is loaded (float32 rows), else the
    chunked XLA loop ("xla"); both match the float64 reference."""
    from jpinfer.native import kernels as native_kernels
    from jpinfer.native import native_available

    kind = "swiglu"
    w = _weights(kind)
    ffn = _layout(kind, w)
    x = jnp.asarray(np.random.default_rng(3).standard_normal(D), jnp.float32)
    ids = jnp.asarray(np.arange(N, dtype=np.int32)[::-1].copy())
    auto, loop = (np.asarray(sparse_ffn(ffn, x, ids, 60, backend=b)) for b in ("auto", "xla"))
    if native_available():
        expected = native_kernels.sparse_ffn(ffn.rows, x, ids, 60, kind=kind, b_up=ffn.b_up, b_down=ffn.b_down)
    else:
        expected = loop
    np.testing.assert_array_equal(auto, np.asarray(expected))
    for got in (auto, loop):
        np.testing.assert_allclose(got, _reference(kind, w, x, ids, 60), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def _count_backend_compiles():
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    return events, listener


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_compilation_per_shape_and_capacity(backend):
    kind = "reglu"
    w = _weights(kind, seed=5)
    ffn = _layout(kind, w)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(D), jnp.float32)
    lists = [(jnp.asarray(rng.permutation(N)[:64].astype(np.int32)), jnp.int32(c)) for c in (64, 3, 0, 40)]
    smaller = jnp.asarray(np.asarray(lists[0][0])[:48])
    events, listener = _count_backend_compiles()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = sparse_ffn._cache_size()
        outs = []
        for i, (ids, count) in enumerate(lists):
            outs.append(sparse_ffn(ffn, x, ids, count, backend=backend))
            assert len(events) == 1, f"list {i} compiled again"
        assert sparse_ffn._cache_size() == before + 1
        sparse_ffn(ffn, x, smaller, lists[1][1], backend=backend)  # new capacity
        assert len(events) == 2 and sparse_ffn._cache_size() == before + 2
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for (ids, count), got in zip(lists, outs):
        want = _reference(kind, w, np.asarray(x, np.float64), np.asarray(ids), int(count))
        np.testing.assert_allclose(np.asarray(got), want, rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_full_list_equals_decoder_dense_ffn(kind):
    cfg = ModelConfig(
        vocab_size=32, d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=32, d_ff=80,
        ffn_kind=kind, ffn_bias=kind in UNGATED_KINDS, norm_kind="layernorm" if kind in UNGATED_KINDS else "rmsnorm",
    )
    layer = params.build_weights(cfg, params.init_random(cfg, seed=2, scale=0.2)).layers[0]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 64)), jnp.float32)
    ffn = neurons.from_layer(layer, kind)
    got = sparse_ffn(ffn, x, jnp.arange(80, dtype=jnp.int32), 80)
    np.testing.assert_allclose(np.asarray(got), np.asarray(transformer.ffn_dense(layer, x, cfg)),
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)


def test_bfloat16_weights_accumulate_in_float32():
    kind = "swiglu"
    w = _weights(kind, seed=7)
    ffn = _layout(kind, w, dtype=jnp.bfloat16)
    x = np.random.default_rng(7).standard_normal(D)
    ids = np.random.default_rng(8).permutation(N).astype(np.int32)
    rounded = {k: None if v is None else np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64) for k, v in w.items()}
    xr = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    want = _reference(kind, rounded, xr, ids, 70)
    for backend in BACKENDS:
        got = sparse_ffn(ffn, jnp.asarray(xr, jnp.bfloat16), jnp.asarray(ids), 70, backend=backend)
        assert got.dtype == jnp.bfloat16
        # bf16 inputs exactly; error from rounding the activations and the output to bfloat16 (u = 2^-8 = 3.9e-3):
        # the output within u |y|, and the 70 rounded activation terms add up like a random walk,
        # ~sqrt(70) u * |w_down| |act| ~ u max|y|. 2e-2 is ~5 u (of |y| and of max|y|); measured 7% of it.
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_bad_inputs_are_value_errors():
    ffn = _layout("swiglu", _weights("swiglu"))
    x = jnp.zeros((D,), jnp.float32)
    ids = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="d_model"):
        sparse_ffn(ffn, jnp.zeros((D + 1,)), ids, 1)
    with pytest.raises(ValueError, match="integer"):
        sparse_ffn(ffn, x, ids.astype(jnp.float32), 1)
    with pytest.raises(ValueError, match="scalar"):
        sparse_ffn(ffn, x, ids, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="backend"):
        sparse_ffn(ffn, x, ids, 1, backend="cuda")
    with pytest.raises(ValueError, match="power of two"):
        sparse_rows_ffn(ffn.rows, None, x[None], ids, 1, kind="swiglu", block_k=24, interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        listed_ffn(ffn.rows, None, x[None], ids, 1, kind="swiglu", block_d=96, interpret=True)
    with pytest.raises(ValueError, match="variant"):
        listed_ffn(ffn.rows, None, x[None], ids, 1, kind="swiglu", variant="atomic", interpret=True)


# The NVIDIA GPU that the two tests below lower for, on any host. The Triton lowering needs a target compute
# capability: jax >= 0.11 takes it from the abstract mesh's device if one is set, else from the default device,
# and raises "No supported GPU devices found, please specify an abstract GPU device" when that is no GPU it
# knows: the CPU here, and on a GPU host too, where conftest.py keeps the tests on the CPU platform (and with a
# GPU platform, the abstract kind is used whenever it differs from the real one). jax 0.10 ignores the abstract
# device and takes the real GPU's capability, or 9.0 without one: H100/H200 are 9.0 too, so every combination
# lowers for sm_90. jax records the abstract mesh in each equation at trace time and lowers under it: trace
# inside the context. An empty mesh with no Explicit axes changes nothing else (jit keeps no context mesh).
GPU_TARGET = jax.sharding.AbstractMesh(
    (), (),
    abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"))


@pytest.mark.parametrize("variant", sorted(KERNELS))
@pytest.mark.parametrize("kind,d,n,bias,dtype", [("swiglu", 4096, 11008, False, jnp.bfloat16),
                                                 ("drelu", 576, 1536, False, jnp.float32),
                                                 ("relu", 40, 64, True, jnp.float32)])
def test_pallas_kernels_lower_for_triton(variant, kind, d, n, bias, dtype):
    """The Triton lowering (run here without a GPU) accepts every variant: power-of-two tiles, grid <= 3 dims,
    one token, a batch sharing the list (MAX_TOKENS, and more: groups), and under vmap (one list per token,
    as the oracle runs it)."""
    kernel = KERNELS[variant]
    rows = jax.ShapeDtypeStruct((n, 2 if kind == "relu" else 3, d), dtype)
    b_up = jax.ShapeDtypeStruct((n,), dtype) if bias else None
    ids = jax.ShapeDtypeStruct((1100,), jnp.int32)
    with jax.sharding.use_abstract_mesh(GPU_TARGET):
        shared = [jax.jit(lambda *a: kernel(*a, kind=kind)).trace(rows, b_up, jax.ShapeDtypeStruct((t, d), dtype), ids,
                                                                  jnp.int32(7))
                  for t in (1, MAX_TOKENS, MAX_TOKENS + 1)]
        per_token = jax.jit(jax.vmap(lambda r, b, x, i, c: kernel(r, b, x[None], i, c, kind=kind),
                                     (None, None, 0, 0, 0)))
        batched = per_token.trace(rows, b_up, jax.ShapeDtypeStruct((2, d), dtype),
                                  jax.ShapeDtypeStruct((2, 160), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
        for traced in (*shared, batched):
            assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_auto_backend_picks_the_kernel_per_lowering_platform():
    """One traced function: Triton kernel when lowered for a GPU; for the CPU the native kernel's custom call
    when the library is loaded, else the XLA loop."""
    from jpinfer.native import native_available

    ffn = jax.eval_shape(lambda: _layout("swiglu", _weights("swiglu")))
    with jax.sharding.use_abstract_mesh(GPU_TARGET):
        traced = jax.jit(lambda f, x, i, c: sparse_ffn(f, x, i, c)).trace(
            ffn, jax.ShapeDtypeStruct((D,), jnp.float32), jax.ShapeDtypeStruct((40,), jnp.int32), jnp.int32(3))
        gpu, cpu = [traced.lower(lowering_platforms=(p,)).as_text() for p in ("cuda", "cpu")]
    assert "triton" in gpu and "stablehlo.while" not in gpu
    assert "triton" not in cpu
    if native_available():
        assert "@jpinfer_sparse_ffn" in cpu and "stablehlo.while" not in cpu
    else:
        assert "stablehlo.while" in cpu


def test_auto_backend_falls_back_to_the_xla_gather_without_triton(monkeypatch):
    """A jax without the Pallas Triton lowering (deprecated since 0.11) still runs on a GPU: XLA's gather."""
    from jpinfer.ops import listed

    monkeypatch.setattr(listed, "triton_available", lambda: False)
    ffn = jax.eval_shape(lambda: _layout("swiglu", _weights("swiglu")))
    with jax.sharding.use_abstract_mesh(GPU_TARGET):
        traced = jax.jit(lambda f, x, i, c: sparse_ffn(f, x, i, c)).trace(  # a capacity no other test traces
            ffn, jax.ShapeDtypeStruct((D,), jnp.float32), jax.ShapeDtypeStruct((41,), jnp.int32), jnp.int32(3))
        gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in gpu and "stablehlo.gather" in gpu and "stablehlo.while" not in gpu


def test_accelerator_bench_runs_and_its_sparse_ops_equal_dense_over_every_neuron(tmp_path):
    """The GPU table's script, here in interpret mode (a smoke test, not a timing): it writes a row for dense and
    for every sparse op; and over the full list each op's chain of layers equals the dense chain."""
    import json

    from jpinfer.bench import chain_kernels
    from jpinfer.cli import main

    out = tmp_path / "chain.md"
    assert main(["bench-kernels", "--chain", "--shapes", "tiny", "--layers", "1", "--sparsity", "0.9",
                 "--tokens", "2", "--rounds", "1", "--dtype", "float32", "--out", str(out)]) == 0
    (table,) = json.loads(out.with_suffix(".json").read_text())["tables"]
    ops = [r["op"] for r in table["rows"]]
    assert ops == ["dense", *chain_kernels.sparse_ops("swiglu", 1, True)] and all("ms" in r for r in table["rows"])
    assert "pallas split" in out.read_text()

    chain = chain_kernels.random_chain(64, 96, "swiglu", 3, jnp.float32, seed=1)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 64)), jnp.float32)
    every = [jnp.arange(96, dtype=jnp.int32)[::-1]] * 3
    dense = chain_kernels.chained(lambda layer, y, ids: transformer.ffn_dense(layer, y, chain.cfg))(
        chain.dense, x, [None] * 3)
    for name, op in chain_kernels.sparse_ops("swiglu", 96, True).items():
        got = chain_kernels.chained(op)(chain.ffns, x, every)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=KERNEL_RTOL, atol=KERNEL_ATOL, err_msg=name)


def test_chained_bench_passes_the_caches_and_reports_each_sparsity():
    """bench-kernels' chained form: enough layers for min_bytes (at least 2), one row per sparsity with K, the
    chain's length and efficiency = speedup x (1 - s), with or without huge pages."""
    from jpinfer.bench.kernels import SHAPES, Shape, bench_chained, chain_layers

    tiny = SHAPES["tiny"]
    layer_bytes = 3 * tiny.d_model * tiny.d_ff * 4
    assert chain_layers(tiny, 1) == 2 and chain_layers(tiny, 2 * layer_bytes + 1) == 3
    assert chain_layers(Shape("relu", tiny.d_model, tiny.d_ff, "relu"), 2 * layer_bytes + 1) == 4  # 2 rows a neuron
    for huge_pages in (False, True):
        rows = bench_chained(tiny, (0.5, 0.9), rounds=1, seed=0, huge_pages=huge_pages, min_bytes=2 * layer_bytes + 1)
        assert [(r["s"], r["k"], r["layers"]) for r in rows] == [(0.5, 344, 3), (0.9, 69, 3)]
        for r in rows:
            assert r["dense_ms"] > 0 and r["sparse_ms"] > 0
            assert r["speedup"] == pytest.approx(r["dense_ms"] / r["sparse_ms"])
            assert r["efficiency"] == pytest.approx(r["speedup"] * (1 - r["s"]))
