"""The native CPU kernels (jpinfer.native) against float64 numpy references, and their fallback.

Tolerances: the float kernels sum in float32, so an output may differ from the float64 reference by
about (terms summed in sequence) * u * (sum of the magnitudes of the terms), u = 2^-24 (float32 unit
roundoff). The kernels sum a dot product over d in 8 lanes (d / 8 terms a lane, then 3 lane additions)
and a row sum over the listed rows in sequence (K terms, then at most 8 partial sums); each bound
below spells out its terms and adds 16 for the few roundings per term (products, the activation's
exp). The integer paths are exact: int8 results equal numpy's float32 formula bit for bit, 4-bit block
sums are exact int32 and only the per-block float32 scaling and the block sum carry the bound above.

Without the library (not built, or JPINFER_NATIVE=0) the kernel tests skip and the fallback tests
(native=False paths, a library that is missing or broken) still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.config import UNGATED_KINDS
from jpinfer.native import kernels as K
from jpinfer.native import library
from jpinfer.quant import int8, q4

from activation_reference import activation64
from native_threads import on_one_thread

U = 2.0 ** -24  # float32 unit roundoff


def quantize_int8(w) -> tuple[np.ndarray, np.ndarray]:
    """(values int8 (out, in), scales float32 (out,)): the project's quantizer (one scale per row), as numpy."""
    m = int8.quantize(np.asarray(w, np.float32))
    return np.array(m.values), np.array(m.scales)
NATIVE = library.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernels unavailable: {library.unavailable_reason()}")
BACKENDS = [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="xla")]


# ------------------------------------------------------------------ references (float64)


def _valid_positions(ids, count, n):
    ids = np.asarray(ids)
    c = int(np.clip(count, 0, ids.size))
    return [p for p in range(c) if 0 <= ids[p] < n]


def ffn_reference(rows, b_up, x, ids, count, kind):
    """(activations (T, K), y (T, d), bound on |float32 result - y| (T, d)) in float64. The bound: the down
    sum's error (listed terms in sequence, + 16) * u * sum |a_k down_k|, plus the dot products' error
    (d / 8 lane terms, + 16) * u times how far that moves each a_k (|da/dg| <= 1.1 |u| for silu and relu,
    |da/du| <= max(|g|, 1)) times |down_k|."""
    rows, x = np.asarray(rows, np.float64), np.asarray(x, np.float64)
    n, R, d = rows.shape
    T, Kn = x.shape[0], len(ids)
    a = np.zeros((T, Kn))
    y = np.zeros((T, d))
    mag = np.zeros((T, d))  # sum |a_k| |down_k|
    sens = np.zeros((T, d))  # sum |down_k| * (how much a_k moves per relative error of its dot products)
    pos = _valid_positions(ids, count, n)
    for p in pos:
        i = int(ids[p])
        up_row, down = rows[i, R - 2], rows[i, R - 1]
        u = x @ up_row + (0.0 if b_up is None else float(b_up[i]))
        g = x @ rows[i, 0] if R == 3 else np.zeros(T)
        a[:, p] = activation64(kind, g, u)
        y += a[:, p, None] * down
        G, Uu = np.abs(x) @ np.abs(rows[i, 0]) if R == 3 else np.zeros(T), np.abs(x) @ np.abs(up_row)
        s = 1.1 * np.abs(u) * G + np.maximum(np.abs(g), 1.0) * Uu
        mag += np.abs(a[:, p, None]) * np.abs(down)
        sens += s[:, None] * np.abs(down)
    bound = U * ((len(pos) + 16) * mag + (d / 8 + 16) * sens) + 1e-30
    return a, y, bound


def assert_within(got, ref, bound, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
    assert err.size == 0 or (err <= bound).all(), (
        f"{what}: error {err[worst]:.3g} over bound {bound[worst]:.3g} at {worst} (value {ref[worst]:.4g})")


def _ffn_case(rng, n, d, kind, bias=True):
    R = 2 if kind in UNGATED_KINDS else 3
    rows = (rng.standard_normal((n, R, d)) / np.sqrt(d)).astype(np.float32)
    b_up = rng.standard_normal(n).astype(np.float32) * 0.1 if bias else None
    return rows, b_up


N_SMALL, D_SMALL = 64, 100  # d not a multiple of 8: the kernels' scalar tails run


def list_cases(n):
    """name -> (ids, count)."""
    rng = np.random.default_rng(7)
    perm = rng.permutation(n).astype(np.int32)
    garbage = np.array([-7, n, n + 3, 2 ** 31 - 1, -2 ** 31], np.int32)
    return {
        "empty": (np.array([1, 2, 3], np.int32), 0),
        "one": (np.array([5], np.int32), 1),
        "full": (np.arange(n, dtype=np.int32), n),
        "padded_garbage": (np.concatenate([perm[:13], garbage, perm[13:20]]), 13),
        "count_past_list": (perm[:9].copy(), 50),
        "negative_count": (perm[:9].copy(), -4),
        "unsorted": (perm[:31].copy(), 31),
        "repeated": (np.array([3, 3, 3, 7, 7, 9, 3], np.int32), 7),
        "bad_ids_inside": (np.array([-1, 2, n, 5, 40, -2 ** 31, 11], np.int32), 7),
        "zero_length_list": (np.zeros((0,), np.int32), 0),
    }


# ------------------------------------------------------------------ sparse FFN

@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("case", list(list_cases(N_SMALL)))
def test_sparse_ffn_lists(case, native):
    rng = np.random.default_rng(1)
    rows, b_up = _ffn_case(rng, N_SMALL, D_SMALL, "swiglu")
    x = rng.standard_normal((3, D_SMALL)).astype(np.float32)
    ids, count = list_cases(N_SMALL)[case]
    a_ref, y_ref, bound = ffn_reference(rows, b_up, x, ids, count, "swiglu")
    y = K.sparse_ffn(rows, x, ids, np.int32(count), kind="swiglu", b_up=b_up, native=native)
    assert y.shape == (3, D_SMALL) and y.dtype == jnp.float32
    assert_within(y, y_ref, bound, case)
    a = K.sparse_activations(rows, x, ids, np.int32(count), kind="swiglu", b_up=b_up, native=native)
    assert a.shape == (3, len(ids))
    assert_within(a, a_ref, U * (D_SMALL / 8 + 16) * (np.abs(a_ref) + 10) + 1e-30, case + " activations")


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("kind", list(K.KINDS))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_sparse_ffn_kinds_tokens(kind, T, native):
    rng = np.random.default_rng(T)
    rows, b_up = _ffn_case(rng, N_SMALL, D_SMALL, kind, bias=T != 3)
    x = rng.standard_normal((T, D_SMALL)).astype(np.float32)
    ids, count = rng.permutation(N_SMALL)[:45].astype(np.int32), 40
    b_down = rng.standard_normal(D_SMALL).astype(np.float32)
    _, y_ref, bound = ffn_reference(rows, b_up, x, ids, count, kind)
    y = K.sparse_ffn(rows, x, ids, count, kind=kind, b_up=b_up, b_down=b_down, native=native)
    assert_within(y, y_ref + b_down, bound + U * np.abs(y_ref + b_down), f"{kind} T={T}")
    if T == 1:  # a 1-D x gives a 1-D result
        y1 = K.sparse_ffn(rows, x[0], ids, count, kind=kind, b_up=b_up, native=native)
        assert y1.shape == (D_SMALL,)
        assert_within(y1, y_ref[0], bound[0], f"{kind} 1-D")


@pytest.mark.parametrize("native", BACKENDS)
def test_listed_rows_sum(native):
    rng = np.random.default_rng(3)
    rows, _ = _ffn_case(rng, N_SMALL, D_SMALL, "swiglu")
    for name, (ids, count) in list_cases(N_SMALL).items():
        w = rng.standard_normal((3, len(ids))).astype(np.float32)
        pos = _valid_positions(ids, count, N_SMALL)
        down = rows[:, 2].astype(np.float64)
        ref = sum((w[:, p, None].astype(np.float64) * down[ids[p]] for p in pos), np.zeros((3, D_SMALL)))
        mag = sum((np.abs(w[:, p, None]) * np.abs(down[ids[p]]) for p in pos), np.zeros((3, D_SMALL)))
        bound = U * (len(pos) + 16) * mag + 1e-30
        assert_within(K.listed_rows_sum(rows, w, ids, count, native=native), ref, bound, name)
        plain = K.listed_rows_sum(np.ascontiguousarray(rows[:, 2]), w, ids, count, native=native)  # an (n, d) matrix
        assert_within(plain, ref, bound, name + " (n, d)")


@needs_native
def test_sparse_ffn_medium_threads_bit_identical():
    """A shape big enough to run on several threads (and several partial sums): the result does not
    depend on the thread count, and matches the reference; more than 8 tokens run as two calls."""
    rng = np.random.default_rng(5)
    n, d = 1536, 576
    rows, b_up = _ffn_case(rng, n, d, "swiglu")
    x = rng.standard_normal((11, d)).astype(np.float32)
    ids, count = rng.permutation(n).astype(np.int32), 1400
    xt = rng.standard_normal((8, n)).astype(np.float32)
    values, scales = quantize_int8(rows[:, 0])
    col_scales = rng.random(d).astype(np.float32)
    run = lambda: (np.asarray(K.sparse_ffn(rows, x, ids, count, kind="swiglu", b_up=b_up)),
                   np.asarray(K.threshold_rows_product(rows[:, 2], xt, 0.5)[0]),
                   np.asarray(K.threshold_rows_product_int8(values, col_scales, xt, 0.5)[0]),
                   np.asarray(K.int8_matvec(values, scales, x[:8])))
    one = on_one_thread(run)
    all_threads = run()
    for a, b in zip(one, all_threads):
        assert np.array_equal(a, b)
    many = all_threads[0]
    _, y_ref, bound = ffn_reference(rows, b_up, x, ids, count, "swiglu")
    assert_within(many, y_ref, bound, "medium")
    # a token's result does not depend on the other tokens of its call
    assert np.array_equal(many[:1], np.asarray(K.sparse_ffn(rows, x[:1], ids, count, kind="swiglu", b_up=b_up)))


@needs_native
def test_concurrent_callers_share_the_helpers():
    """Kernels called from several threads at once (XLA runs independent programs side by side) compete for
    the native helper threads (csrc/threads.cc): each call must still compute its own result, the same bits
    as alone on one thread. Products of 0.8 MB, past the size at which a sleeping helper is woken."""
    import concurrent.futures

    rng = np.random.default_rng(5)
    values = rng.integers(-127, 128, (1024, 768), dtype=np.int8)
    scales = (rng.random(1024) / 50).astype(np.float32)
    xs = rng.standard_normal((6, 3, 768)).astype(np.float32)
    product = jax.jit(lambda x: K.int8_matvec(values, scales, x))
    expect = [on_one_thread(lambda x=x: np.asarray(product(x))) for x in xs]

    def calls(i):
        return [np.array_equal(np.asarray(product(xs[i])), expect[i]) for _ in range(20)]

    with concurrent.futures.ThreadPoolExecutor(len(xs)) as pool:
        results = list(pool.map(calls, range(len(xs))))
    assert all(all(r) for r in results)
    assert np.array_equal(expect[0], int8_reference(values, scales, xs[0])[0])


@pytest.mark.parametrize("native", BACKENDS)
def test_sparse_ffn_jit_and_scan(native):
    """Under jit with traced ids and count, and chained over layers inside lax.scan."""
    rng = np.random.default_rng(11)
    L, n, d = 3, N_SMALL, D_SMALL
    rows = np.stack([_ffn_case(rng, n, d, "reglu")[0] for _ in range(L)])
    ids = np.stack([rng.permutation(n)[:20].astype(np.int32) for _ in range(L)])
    counts = np.array([20, 7, 0], np.int32)
    x = rng.standard_normal((3, d)).astype(np.float32)

    f = jax.jit(lambda r, x, i, c: K.sparse_ffn(r, x, i, c, kind="reglu", native=native))
    eager = [np.asarray(K.sparse_ffn(rows[0], x, ids[0], counts[0], kind="reglu", native=native))]
    assert np.array_equal(np.asarray(f(rows[0], x, ids[0], counts[0])), eager[0])

    def layer(h, inputs):
        r, i, c = inputs
        return K.sparse_ffn(r, h, i, c, kind="reglu", native=native) + h, None

    out, _ = jax.jit(lambda x: jax.lax.scan(layer, x, (rows, ids, counts)))(x)
    if native:  # the same calls one by one, outside jit: the same bits
        h32 = jnp.asarray(x)
        for l in range(L):
            h32 = K.sparse_ffn(rows[l], h32, ids[l], counts[l], kind="reglu", native=True) + h32
        assert np.array_equal(np.asarray(out), np.asarray(h32))
    # against float64: each layer's bound, plus what the earlier layers' errors may grow to (x4)
    h = x.astype(np.float64)
    bound_total = 0.0
    for l in range(L):
        _, y, bound = ffn_reference(rows[l], None, h.astype(np.float32), ids[l], counts[l], "reglu")
        h = y + h
        bound_total = bound_total + bound.max() + U * np.abs(h).max()
    assert np.abs(np.asarray(out, np.float64) - h).max() <= 4 * bound_total


# ------------------------------------------------------------------ threshold rows

def threshold_reference(m, x, thr):
    keep = np.abs(x) > np.float32(thr)  # the float32 comparison the kernel makes
    xk = np.where(keep, x, 0).astype(np.float64)
    y = xk @ m.astype(np.float64)
    rows_read = keep.any(0).sum()
    bound = U * (rows_read + 16) * (np.abs(xk) @ np.abs(m.astype(np.float64))) + 1e-30
    return y, keep.sum(-1), bound


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("shape", [(90, 70), (37, 300)])
def test_threshold_rows(shape, T, native):
    rng = np.random.default_rng(T)
    m = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((T, shape[0])).astype(np.float32)
    x[:, ::9] = 0.0  # zeros: dropped even at threshold 0
    for thr in (-np.inf, 0.0, 0.67, 10.0):  # everything kept, all non-zero, about half, nothing
        y_ref, counts_ref, bound = threshold_reference(m, x, thr)
        y, counts = K.threshold_rows_product(m, x, thr, native=native)
        assert counts.dtype == jnp.int32 and np.array_equal(np.asarray(counts), counts_ref)
        assert_within(y, y_ref, bound, f"thr={thr}")
    f = jax.jit(lambda m, x, t: K.threshold_rows_product(m, x, t, native=native))
    y, counts = f(m, x, jnp.float32(0.67))
    y_ref, counts_ref, bound = threshold_reference(m, x, 0.67)
    assert_within(y, y_ref, bound, "jit")
    if T == 1:
        y1, c1 = K.threshold_rows_product(m, x[0], 0.67, native=native)
        assert y1.shape == (shape[1],) and c1.shape == () and int(c1) == counts_ref[0]


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 3])
def test_threshold_rows_never_keep_a_nan(T, native):
    """A NaN entry of x is never kept, whatever the threshold (|NaN| > t is false), in the eight-entry blocks of
    one token's compaction and in the entries after them."""
    rng = np.random.default_rng(5)
    m = rng.standard_normal((45, 20)).astype(np.float32)
    x = rng.standard_normal((T, 45)).astype(np.float32)
    x[:, [0, 7, 19, 41, 44]] = np.nan
    for thr in (-np.inf, 0.5):
        y, counts = K.threshold_rows_product(m, x, thr, native=native)
        y_ref, counts_ref, bound = threshold_reference(m, np.nan_to_num(x, nan=0.0), thr)
        assert np.array_equal(np.asarray(counts), counts_ref - (thr < 0) * 5)  # the zeros stand in for NaNs
        assert_within(y, y_ref, bound, f"thr={thr}")


@needs_native
@pytest.mark.parametrize("shape", [(1536, 576), (64, 4608)], ids=["row pieces", "column pieces"])
def test_threshold_rows_token_alone_equals_it_in_a_batch(shape):
    """Each token of a batch keeps its own entries (so the call reads the union of the rows), yet its result is
    bit for bit what it gets alone: the float kernel's split depends on the matrix's width only (rows up to
    4096 columns, columns beyond), and a row another token keeps adds an exact zero. Batched decoding relies on
    it (a request's output must not depend on its batch); the thread count changes nothing either."""
    rng = np.random.default_rng(11)
    m = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((8, shape[0])).astype(np.float32)
    batch = np.asarray(K.threshold_rows_product(m, x, 0.5)[0])
    assert np.array_equal(batch, on_one_thread(lambda: np.asarray(K.threshold_rows_product(m, x, 0.5)[0])))
    for t in range(8):
        alone = np.asarray(K.threshold_rows_product(m, x[t:t + 1], 0.5)[0])
        assert np.array_equal(alone[0], batch[t]), t
    y_ref, _, bound = threshold_reference(m, x, 0.5)
    assert_within(batch, y_ref, bound)


def threshold_int8_reference(values, scales, x, thr):
    """numpy float32 emulation (exact integers) of the int8 threshold product: bit for bit."""
    x = np.asarray(x, np.float32)
    keep = np.abs(x) > np.float32(thr)
    peak = np.abs(x).max(-1)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(x * inverse[:, None]), -127, 127).astype(np.int64)
    acc = np.where(keep, q, 0) @ values.astype(np.int64)
    token_scale = (peak * np.float32(1 / 127)).astype(np.float32)
    return acc.astype(np.float32) * (token_scale[:, None] * scales[None, :]), keep.sum(-1)


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("shape", [(90, 70), (37, 300), (20, 9000)])  # 9000 columns: pieces of columns, a short last
def test_threshold_rows_int8_exact(shape, T, native):
    rng = np.random.default_rng(T)
    values = rng.integers(-128, 128, shape, dtype=np.int8)  # -128 included: exact all the same
    scales = rng.random(shape[1]).astype(np.float32) / 50
    x = rng.standard_normal((T, shape[0])).astype(np.float32)
    x[:, ::7] = 0.0
    for thr in (-np.inf, 0.0, 0.67, 10.0):
        ref, counts_ref = threshold_int8_reference(values, scales, x, thr)
        y, counts = K.threshold_rows_product_int8(values, scales, x, thr, native=native)
        assert np.array_equal(np.asarray(counts), counts_ref)
        same(y, ref, f"thr={thr}", native)
    y, _ = jax.jit(lambda v, s, x: K.threshold_rows_product_int8(v, s, x, 0.67, native=native))(values, scales, x)
    same(y, threshold_int8_reference(values, scales, x, 0.67)[0], "jit", native)


def same(got, ref, what, native=True):
    """Bit-identical for the native kernel. XLA's fallback has the same integers and formula, but XLA:CPU
    was seen to round the final float32 product differently in a few entries of one case (1 ulp), so it
    gets 2 ulps."""
    got = np.asarray(got)
    if native:
        assert np.array_equal(got, ref), what
    else:
        assert np.allclose(got, ref, rtol=2 ** -22, atol=0), what


# ------------------------------------------------------------------ int8

def int8_reference(values, scales, x):
    """numpy float32 emulation of the W8A8 formula (exact integers): what the kernel must return bit for bit."""
    x = np.asarray(x, np.float32)
    peak = np.abs(x).max(-1)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(x * inverse[:, None]), -127, 127).astype(np.int64)
    acc = q @ values.astype(np.int64).T
    token_scale = (peak * np.float32(1 / 127)).astype(np.float32)  # XLA's peak / 127
    return acc.astype(np.float32) * (token_scale[:, None] * scales[None, :]), q


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("shape", [(37, 100), (64, 320)])
def test_int8_matvec_exact(shape, T, native):
    rng = np.random.default_rng(T)
    values, scales = quantize_int8(rng.standard_normal(shape).astype(np.float32))
    values[0, :5] = -128  # outside the symmetric grid, still exact (sign trick on the weights)
    x = rng.standard_normal((T, shape[1])).astype(np.float32)
    x[-1] = 0.0  # an all-zero token: scale 0, output 0
    ref, q = int8_reference(values, scales, x)
    kq, ks = int8.quantize_tokens(jnp.asarray(x))
    assert np.array_equal(np.asarray(kq), q)
    y = K.int8_matvec(values, scales, x, native=native)
    assert np.array_equal(np.asarray(y), ref)
    y = jax.jit(lambda v, s, x: K.int8_matvec(v, s, x, native=native))(values, scales, x)
    assert np.array_equal(np.asarray(y), ref)


# ------------------------------------------------------------------ float32, a few tokens

@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(37, 100), (130, 576), (6, 3)])
def test_float_matvec_matches_float64_and_each_token_alone(shape, T, native):
    """W @ x per token: within the dot-product bound of float64 (in / 8 terms a lane, 3 lane additions, the
    in % 8 tail, + 16), rows past a multiple of 4 and inputs past a multiple of 8 included; each token bit
    for bit what it gives alone (batched decoding's invariance), and for any thread count."""
    rng = np.random.default_rng(T + shape[0])
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((T, shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    bound = (shape[1] / 8 + 3 + shape[1] % 8 + 16) * 2.0**-24 * magnitude
    run = jax.jit(lambda w, x: K.float_matvec(w, x, native=native))
    y = np.asarray(run(w, x))
    assert y.shape == (T, shape[0]) and np.all(np.abs(y - ref) <= bound)
    if native:
        for t in range(T):
            np.testing.assert_array_equal(y[t], np.asarray(run(w, x[t : t + 1]))[0])
        np.testing.assert_array_equal(on_one_thread(lambda: np.asarray(run(w, x))), y)
    with pytest.raises(ValueError):
        K.float_matvec(w[0], x, native=native)
    with pytest.raises(ValueError):
        K.float_matvec(w, x[:, :-1], native=native)


# ------------------------------------------------------------------ 4-bit

def q8_blocks_reference(x):
    T, n = x.shape
    xb = x.reshape(T, n // 32, 32)
    peak = np.abs(xb).max(-1)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(xb * inverse[..., None]), -127, 127).astype(np.int64)
    return q, (peak * np.float32(1 / 127)).astype(np.float32)


def q4_reference(m: q4.Q4Matrix, x, float_gemm: bool = False):
    """(y, bound) in float64 from exact integer block sums and the stored scales.

    The native kernels sum each block exactly in int32 and round once per block and scale: (nb + 16) u of the
    block terms' magnitudes, where a q4_1 block has two terms rounded apart, d-term and min-term, which
    often cancel (w = d q + m with m < 0): their magnitudes add. The XLA form (``float_gemm``) multiplies
    the dequantized sides in one float32 GEMM:
    a float32 sum of ``in`` products (worst case in * u of the products' magnitudes) after rounding x's
    dequantized blocks (one rounding) and q4_1's d q + m (one): (in + 4) u of sum |x^_i w^_i|."""
    q = q4.unpack(np.asarray(m.packed)).astype(np.int64)  # (out, nb, 32)
    if m.kind == "q4_0":
        q = q - 8
    xq, xd = q8_blocks_reference(np.asarray(x, np.float32))
    isum = np.einsum("obj,tbj->tob", q, xq)
    dw = np.asarray(m.scales, np.float32).astype(np.float64)
    terms = dw[None] * xd[:, None, :].astype(np.float64) * isum
    magnitudes = np.abs(terms)
    w_hat = dw[..., None] * q
    if m.kind == "q4_1":
        mins = np.asarray(m.mins, np.float32).astype(np.float64)
        min_terms = mins[None] * xd[:, None, :] * xq.sum(-1)[:, None, :]
        terms, magnitudes = terms + min_terms, magnitudes + np.abs(min_terms)
        w_hat = w_hat + mins[..., None]
    nb = q.shape[1]
    if not float_gemm:
        return terms.sum(-1), U * (nb + 16) * magnitudes.sum(-1) + 1e-30
    x_hat = np.abs(xq * xd[..., None].astype(np.float64)).reshape(len(xq), -1)
    magnitude = x_hat @ np.abs(w_hat).reshape(len(w_hat), -1).T
    return terms.sum(-1), U * (nb * 32 + 4) * magnitude + 1e-30


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("inputs", [256, 576, 96, 480])  # whole octets of 8 blocks; 2, 3 (no octet), 7 left over
def test_q4_matvec(kind, T, native, inputs):
    rng = np.random.default_rng(T + inputs)
    w = rng.standard_normal((37, inputs)).astype(np.float32)
    m = q4.quantize_q4_0(w) if kind == "q4_0" else q4.quantize_q4_1(w)
    x = rng.standard_normal((T, inputs)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    ref, bound = q4_reference(m, x, float_gemm=not native)
    assert_within(K.q4_matvec(m, x, native=native), ref, bound, kind)
    y = jax.jit(lambda m, x: K.q4_matvec(m, x, native=native))(m, x)
    assert_within(y, ref, bound, kind + " jit")
    # and it approximates the float product of the dequantized matrix (4-bit weights, 8-bit inputs)
    dense = x.astype(np.float64) @ np.asarray(q4.dequantize(m)).T.astype(np.float64)
    assert np.abs(np.asarray(y) - dense).max() < 0.05 * np.abs(dense).max()


def test_q4_layout_is_llama_cpp_blocks():
    """A hand-made GGUF Q4_0 / Q4_1 block: byte i's low nibble is element i, the high nibble element
    i + 16; scale (and min) float16 first. q4_from_gguf reads it, q4_to_gguf writes it back."""
    rng = np.random.default_rng(0)
    qs = rng.integers(0, 256, (2, 16), dtype=np.uint8)  # two blocks: one row of 64
    d = np.array([0.5, -0.25], np.float16)
    mn = np.array([1.0, -2.0], np.float16)
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)  # (2 blocks, 32)
    raw0 = np.concatenate([np.concatenate([d[b:b + 1].view(np.uint8), qs[b]]) for b in range(2)])
    m0 = q4.from_gguf(raw0, (1, 64), "q4_0")
    assert np.array_equal(np.asarray(q4.dequantize(m0))[0], (d.astype(np.float32)[:, None] * (q - 8)).reshape(-1))
    assert np.array_equal(q4.to_gguf(m0), raw0)
    raw1 = np.concatenate([np.concatenate([d[b:b + 1].view(np.uint8), mn[b:b + 1].view(np.uint8), qs[b]])
                           for b in range(2)])
    m1 = q4.from_gguf(raw1, (1, 64), "q4_1")
    expect = (d.astype(np.float32)[:, None] * q + mn.astype(np.float32)[:, None]).reshape(-1)
    assert np.array_equal(np.asarray(q4.dequantize(m1))[0], expect)
    assert np.array_equal(q4.to_gguf(m1), raw1)


def test_q4_quantizers_and_q8_blocks():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    # q4_0: d = max / -8 puts the extreme at q = 0, its negation at 16, clamped to 15: error up to |d|;
    # q4_1: d = (max - min) / 15, rounding to nearest: error up to d / 2
    for m, bound in ((q4.quantize_q4_0(w), lambda b: np.abs(b).max(-1) / 8 * 1.01),
                     (q4.quantize_q4_1(w), lambda b: (b.max(-1) - b.min(-1)) / 30 * 1.01)):
        blocks = w.reshape(8, 2, 32)
        err = np.abs(np.asarray(q4.dequantize(m)).reshape(8, 2, 32) - blocks).max(-1)
        assert (err <= bound(blocks) + 1e-3).all(), m.kind
    x = rng.standard_normal((3, 64)).astype(np.float32)
    q, d, s = q4.quantize_blocks(jnp.asarray(x))
    q_ref, d_ref = q8_blocks_reference(x)
    assert np.array_equal(np.asarray(q).reshape(q_ref.shape), q_ref) and np.array_equal(np.asarray(d), d_ref)
    assert np.array_equal(np.asarray(s), q_ref.sum(-1))


# ------------------------------------------------------------------ neuron selection

def select_reference(logits: np.ndarray, cutoffs: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute force per row: the indices over the row's cut-off in increasing order, the first ``capacity`` of them
    then zeros; and how many are over (comparisons in numpy: a NaN is never over)."""
    rows = logits.reshape(-1, logits.shape[-1])
    ids = np.zeros((rows.shape[0], capacity), np.int32)
    wanted = np.zeros(rows.shape[0], np.int32)
    for r, (row, cutoff) in enumerate(zip(rows, np.broadcast_to(cutoffs, rows.shape[:1]))):
        with np.errstate(invalid="ignore"):
            over = np.flatnonzero(row > cutoff)
        ids[r, :min(over.size, capacity)] = over[:capacity]
        wanted[r] = over.size
    return ids.reshape(*logits.shape[:-1], capacity), wanted.reshape(logits.shape[:-1])


def _selection_logits(rng, shape, over_share):
    """Logits with about ``over_share`` of them over 0, ties at 0 itself, and a NaN per row."""
    logits = np.where(rng.random(shape) < over_share, 1.0, -1.0) * rng.random(shape)
    logits[rng.random(shape) < 0.05] = 0.0  # exactly the cut-off: not over it
    logits.reshape(-1, shape[-1])[:, shape[-1] // 2] = np.nan
    return logits.astype(np.float32)


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("n,capacity,over_share", [(13, 4, 0.5), (50, 50, 0.3), (50, 64, 0.9), (1536, 1447, 0.6),
                                                   (11008, 1101, 0.1), (11008, 1101, 0.2), (9, 1, 0.0)])
def test_select_over_matches_brute_force(native, n, capacity, over_share):
    """Every row's ids over the cut-off in order, capped at the capacity (fewer: zeros after them; more: the
    first ones, and ``wanted`` says how many there were); rows not a multiple of the 8 read at a time; one
    token, a batch, under jit."""
    rng = np.random.default_rng(n + capacity)
    for shape in ((n,), (3, n)):
        logits = _selection_logits(rng, shape, over_share)
        expected_ids, expected_wanted = select_reference(logits, np.float32(0.0), capacity)
        ids, wanted = jax.jit(lambda lg: K.select_over(lg, 0.0, capacity, native=native))(logits)
        assert ids.dtype == jnp.int32 and ids.shape == (*shape[:-1], capacity) and wanted.shape == shape[:-1]
        np.testing.assert_array_equal(np.asarray(ids), expected_ids)
        np.testing.assert_array_equal(np.asarray(wanted), expected_wanted)


@pytest.mark.parametrize("native", BACKENDS)
def test_select_over_under_vmap_and_scan_with_a_cutoff_per_row(native):
    """vmap over rows with a cut-off of each row's own, and inside a lax.scan: the same as brute force."""
    rng = np.random.default_rng(7)
    logits = _selection_logits(rng, (5, 200), 0.4)
    cutoffs = np.float32([-0.5, 0.0, 0.3, 2.0, np.nan])  # the last: nothing is over a NaN cut-off
    expected_ids, expected_wanted = select_reference(logits, cutoffs, 60)
    ids, wanted = jax.jit(jax.vmap(lambda lg, c: K.select_over(lg, c, 60, native=native)))(logits, cutoffs)
    np.testing.assert_array_equal(np.asarray(ids), expected_ids)
    np.testing.assert_array_equal(np.asarray(wanted), expected_wanted)
    assert int(wanted[-1]) == 0 and int(wanted[3]) == 0

    def step(carry, row):
        ids, wanted = K.select_over(row, 0.3, 60, native=native)
        return carry + wanted, ids

    total, scanned = jax.jit(lambda lg: jax.lax.scan(step, jnp.int32(0), lg))(logits)
    np.testing.assert_array_equal(np.asarray(scanned), select_reference(logits, np.float32(0.3), 60)[0])
    assert int(total) == int(select_reference(logits, np.float32(0.3), 60)[1].sum())


def test_select_over_input_checks():
    with pytest.raises(ValueError, match="float32"):
        K.select_over(np.zeros(8, np.float16), 0.0, 4)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        K.select_over(np.zeros(8, np.float32), 0.0, 0)
    with pytest.raises(ValueError, match="cutoff must be a scalar"):
        K.select_over(np.zeros(8, np.float32), np.zeros(2), 4)
    with pytest.raises(ValueError, match="n >= 1"):
        K.select_over(np.zeros((2, 0), np.float32), 0.0, 4)


# ------------------------------------------------------------------ input checks

def test_input_checks():
    rows, _ = _ffn_case(np.random.default_rng(0), 8, 16, "swiglu")
    x = np.zeros((2, 16), np.float32)
    ids = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match="float32"):
        K.sparse_ffn(rows.astype(np.float16), x, ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="unknown FFN kind"):
        K.sparse_ffn(rows, x, ids, 4, kind="silu")
    with pytest.raises(ValueError, match="neuron-major"):
        K.sparse_ffn(rows, x, ids, 4, kind="relu")  # relu bundles have R = 2
    with pytest.raises(ValueError, match=r"x must be \(T, 16\)"):
        K.sparse_ffn(rows, np.zeros((2, 15), np.float32), ids, 4, kind="swiglu")
    with pytest.raises(ValueError, match="ids must be a 1-D integer"):
        K.sparse_ffn(rows, x, ids.astype(np.float32), 4, kind="swiglu")
    with pytest.raises(ValueError, match="count must be an integer scalar"):
        K.sparse_ffn(rows, x, ids, np.array([1, 2]), kind="swiglu")
    with pytest.raises(ValueError, match="b_up must have shape"):
        K.sparse_ffn(rows, x, ids, 4, kind="swiglu", b_up=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="int8"):
        K.int8_matvec(np.zeros((4, 16), np.int16), np.ones(4, np.float32), x)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.quantize_q4_0(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="threshold must be a scalar"):
        K.threshold_rows_product(rows[:, 0], np.zeros((1, 8), np.float32), np.zeros(2))


# ------------------------------------------------------------------ build / fallback

_PROBE = textwrap.dedent("""
    # One process, three library states in turn (library._reset_for_tests forgets the last load).
    import json, os, sys, warnings
    import numpy as np
    from jpinfer.native import kernels as K, library
    results = []
    for env in json.loads(sys.argv[1]):
        os.environ.pop("JPINFER_NATIVE", None)
        os.environ.pop("JPINFER_NATIVE_LIBRARY", None)
        os.environ.update(env)
        library._reset_for_tests()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = library.native_available(), library.native_available()
            y = K.sparse_ffn(np.ones((4, 3, 8), np.float32), np.ones((1, 8), np.float32),
                             np.array([0, 1], np.int32), 2, kind="swiglu")
        warned = [str(w.message) for w in caught if issubclass(w.category, library.NativeUnavailableWarning)]
        results.append([first, second, warned, library.unavailable_reason(), float(np.asarray(y).sum())])
    print(json.dumps(results))
""")


def test_fallback_when_library_missing_broken_or_disabled(tmp_path):
    """A missing or broken library file: native_available() is False, one warning says why, the kernels
    run their XLA fallback (no crash); JPINFER_NATIVE=0: the same without a warning. In a subprocess,
    so that this process keeps its library."""
    broken = tmp_path / "libbroken.so"
    broken.write_bytes(b"\x7fELF not really a library")
    envs = [{"JPINFER_NATIVE_LIBRARY": str(tmp_path / "absent.so")}, {"JPINFER_NATIVE_LIBRARY": str(broken)},
            {"JPINFER_NATIVE": "0"}]
    foreign = _library_for_another_cpu(tmp_path)  # compiled for an instruction set this CPU lacks
    if foreign is not None:
        envs.append({"JPINFER_NATIVE_LIBRARY": str(foreign[0])})
    env = {k: v for k, v in os.environ.items() if not k.startswith("JPINFER_NATIVE")}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(envs)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    (missing, bad, off, *rest) = json.loads(out.stdout.strip().splitlines()[-1])
    expected_y = float(ffn_reference(np.ones((4, 3, 8)), None, np.ones((1, 8)), [0, 1], 2, "swiglu")[1].sum())
    for state, cause in ((missing, "does not exist"), (bad, "failed to load")):
        first, second, warned, reason, y = state
        assert not first and not second and len(warned) == 1 and cause in warned[0] and cause in reason, state
        assert "XLA fallback" in warned[0] and abs(y - expected_y) < 1e-3 * abs(expected_y), state
    first, second, warned, reason, y = off
    assert not first and not second and warned == [] and "JPINFER_NATIVE=0" in reason and abs(y - expected_y) < 1e-2
    if foreign is not None:  # the CPU check runs before any kernel: no SIGILL, one warning naming the feature
        first, second, warned, reason, y = rest[0]
        assert not first and not second and len(warned) == 1 and f"compiled for {foreign[1]}" in warned[0], rest[0]
        assert abs(y - expected_y) < 1e-3 * abs(expected_y)


def _library_for_another_cpu(tmp_path):
    """(path, feature) of a library holding only csrc/info.cc compiled with an instruction set this CPU
    lacks (AVX-512F, else AVX-VNNI), or None (no g++, no FFI headers, or a CPU that has both)."""
    try:
        flags = open("/proc/cpuinfo").read().split("\nflags")[1].split("\n")[0].split()
        include = jax.ffi.include_dir()
    except (OSError, IndexError, AttributeError):
        return None
    feature = next((f for f in ("avx512f", "avx_vnni") if f not in flags), None)
    if feature is None:
        return None
    src = os.path.join(os.path.dirname(library.__file__), "csrc", "info.cc")
    path = tmp_path / "libforeign.so"
    option = "-mavx512f" if feature == "avx512f" else "-mavxvnni"
    try:
        subprocess.run(["g++", "-O1", "-mavx2", "-mfma", "-mf16c", option, "-std=c++17", "-fPIC", "-shared", "-isystem",
                        include, src, "-o", str(path)], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, feature.replace("_", "")


@needs_native
def test_library_reports_its_build():
    f = library.features()
    assert {"avx2", "fma", "f16c"} <= set(f["compiled"]) <= set(f["cpu"])
    assert library.loaded_path() and os.path.isfile(library.loaded_path())


@pytest.mark.parametrize("fmt,inputs", [("int8", 100), ("q4_0", 96), ("q4_1", 256), ("q4_1", 1024)])
@pytest.mark.parametrize("T", [1, 3])
def test_many_rows_cut_in_pieces_compute_each_row_alone(fmt, inputs, T):
    """Short rows go to the threads in pieces of up to ``out / 8`` rows (quantized.cc, RowsPerPiece), four a pass at
    one token for 4-bit rows under 512 inputs: each output is still its row's sum in a fixed order, so the product
    of 1000 rows equals, bit for bit, its 37-row slices' products (one piece each)."""
    rng = np.random.default_rng(inputs + T)
    w = rng.standard_normal((1000, inputs)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((T, inputs)), jnp.float32)
    if fmt == "int8":
        m = int8.quantize(w)
        product = lambda m: np.asarray(K.int8_matvec(m.values, m.scales, x, native=True))
        pieces = [int8.Int8Matrix(m.values[r:r + 37], m.scales[r:r + 37], 0) for r in range(0, 1000, 37)]
    else:
        m = q4.quantize(w, fmt)
        product = lambda m: np.asarray(K.q4_matvec(m, x, native=True))
        pieces = [m.take(slice(r, r + 37)) for r in range(0, 1000, 37)]
    whole = product(m)
    np.testing.assert_array_equal(whole, np.concatenate([product(p) for p in pieces], axis=-1))
    matrix = int8.dequantize(m) if fmt == "int8" else q4.dequantize(m)
    dense = np.asarray(x, np.float64) @ np.asarray(matrix, np.float64).T
    assert np.abs(whole - dense).max() < 0.05 * np.abs(dense).max()  # and it is the product (8-bit inputs)
