"""The direct host calls of the native sparse FFNs (jpinfer.native.host, through sparse.host_sparse_ffn) against the
jitted FFI kernels (native.kernels) on the same operands: the same C++ functions underneath, so the same bits, for
each format (float32 rows, int8 bundles, Q4_0 / Q4_1 records with int8 down slots), list (empty, one, partial with
padding and bad ids, full, repeated ids, counts outside [0, K]) and token count. The FFI kernels are checked against
float64 references in test_native_kernels.py, test_sparse_int8.py and test_sparse_int4.py; here a difference in one
bit fails. A medium shape spreads over the helper threads (its work is above the kernels' inline limit)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_native_kernels import _ffn_case, list_cases, needs_native
from test_sparse_int4 import integer_tokens, q4_ffn
from test_sparse_int8 import bundles

from jpinfer.native import host
from jpinfer.native import kernels as K
from jpinfer.sparse import NeuronFFN, host_sparse_ffn, sparse_ffn

pytestmark = needs_native

N, D = 64, 320  # d a multiple of 32 (the 4-bit blocks), not of 256: the kernels' tails run
CASES = list_cases(N)


def _same(direct, ffi, what):
    assert direct.dtype == np.float32 and direct.shape == ffi.shape, what
    np.testing.assert_array_equal(direct, np.asarray(ffi), err_msg=what)


def _tokens(T, d=D, seed=3):
    return np.random.default_rng(seed).standard_normal((T, d)).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["swiglu", "relu"])
def test_float_rows(case, T, kind):
    rows, b_up, *_ = _ffn_case(np.random.default_rng(0), N, D, kind)
    ids, count = CASES[case]
    x = _tokens(T)
    call = host.float_ffn(rows, b_up, kind=kind)
    _same(call(x, ids, count), K.sparse_ffn(rows, x, ids, count, kind=kind, b_up=b_up, native=True), case)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["swiglu", "relu"])
def test_int8_bundles(case, T, kind):
    rows, scales, down_scales, b_up = bundles(kind, n=N, d=D)
    ids, count = CASES[case]
    x = _tokens(T)
    call = host.int8_ffn(rows, scales, down_scales, b_up, kind=kind)
    want = K.sparse_ffn_int8(rows, scales, down_scales, x, ids, count, kind=kind, b_up=b_up, native=True)
    _same(call(x, ids, count), want, case)
    weights = np.random.default_rng(4).uniform(0, 1, (T, ids.shape[0])).astype(np.float32)
    want = K.sparse_ffn_int8(rows, scales, down_scales, x, ids, count, kind=kind, b_up=b_up, weights=weights,
                             native=True)
    _same(call(x, ids, count, weights), want, f"{case}, weights")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_q4_records(case, T, fmt):
    gate_up, _, down, down_scales, b_up = q4_ffn("swiglu", fmt)
    ids, count = CASES[case]
    x = integer_tokens(np.random.default_rng(5), T)
    call = host.q4_ffn(gate_up.records, fmt, down, down_scales, b_up, kind="swiglu")
    want = K.sparse_ffn_q4(gate_up, down, down_scales, x, ids, count, kind="swiglu", b_up=b_up, native=True)
    _same(call(x, ids, count), want, case)


@pytest.mark.parametrize("fmt", ["float", "int8", "q4_0"])
def test_layouts_through_host_sparse_ffn_on_the_helper_threads(fmt):
    """A medium layout (a partial and the full list: MBs, so the helpers take part) through ``host_sparse_ffn``,
    b_down included, against the jitted ``sparse_ffn`` as the hybrid's fallback runs it."""
    n, d = 512, 1024
    rng = np.random.default_rng(6)
    b_down = rng.standard_normal(d).astype(np.float32)
    if fmt == "float":
        rows, b_up, *_ = _ffn_case(rng, n, d, "swiglu")
        ffn = NeuronFFN(jnp.asarray(rows), jnp.arange(n, dtype=jnp.int32), jnp.asarray(b_up), jnp.asarray(b_down),
                        "swiglu")
    elif fmt == "int8":
        rows, scales, down_scales, b_up = bundles("swiglu", n=n, d=d)
        ffn = NeuronFFN(jnp.asarray(rows), jnp.arange(n, dtype=jnp.int32), jnp.asarray(b_up), jnp.asarray(b_down),
                        "swiglu", scales=jnp.asarray(scales), down_scales=jnp.asarray(down_scales))
    else:
        gate_up, _, down, down_scales, b_up = q4_ffn("swiglu", fmt, n=n, d=d)
        ffn = NeuronFFN(jnp.asarray(down[:, None]), jnp.arange(n, dtype=jnp.int32), jnp.asarray(b_up),
                        jnp.asarray(b_down), "swiglu", down_scales=jnp.asarray(down_scales), gate_up=gate_up)
    call = host_sparse_ffn(ffn)
    x = _tokens(1, d)[0]
    for ids, count in [(rng.permutation(n)[:300].astype(np.int32), 211), (np.arange(n, dtype=np.int32), n)]:
        _same(call(x, ids, count), sparse_ffn(ffn, jnp.asarray(x), jnp.asarray(ids), jnp.int32(count)), f"{count}")


def test_direct_calls_refuse_what_they_do_not_take():
    rows, b_up, *_ = _ffn_case(np.random.default_rng(0), N, D, "swiglu")
    call = host.float_ffn(rows, b_up, kind="swiglu")
    with pytest.raises(ValueError, match="tokens"):
        call(_tokens(9), np.arange(4, dtype=np.int32), 4)
    with pytest.raises(ValueError, match="weights"):
        call(_tokens(1), np.arange(4, dtype=np.int32), 4, np.ones((1, 4), np.float32))
    bad = host.float_ffn(rows[:, :2], b_up, kind="swiglu")  # R = 2 rows for a gated kind
    with pytest.raises(ValueError, match="R must be 3"):
        bad(_tokens(1), np.arange(4, dtype=np.int32), 4)
