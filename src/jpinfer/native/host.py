"""Direct host calls of the native sparse FFNs: the kernels on host arrays from plain Python, no jax dispatch.

The hybrid's host half (``modes.hybrid``) runs each layer's cold neurons from a host callback inside the
accelerator's step. As a jitted call on the CPU device (``jax.device_put`` of x and the list, the call, its output
back to numpy) that cost ~350 us a layer more than the same kernels in one jitted call over every layer: int8 at
7B shapes and a 0.9 budget, 19.9 against 8.5 ms a token (bench/results/hybrid_host.md, "a call a layer" against
"one call"). Here the same C++ functions the FFI handlers run (``csrc/sparse_ffn.cc``: ``FloatFfn``, ``Int8Ffn``,
``Q4Ffn``) are exported as plain C functions (``jpinfer_host_sparse_ffn*``) and called through ctypes, which
releases the GIL for the call, on numpy views of the layout's arrays taken once (``HostFfn``): the same bits as the
jitted kernel, at a Python call's cost.

The kernels spread over ``host_threads()`` workers (the calling thread and jpinfer's helper threads), the count
XLA's CPU intra-op pool has in a process that did not change it, so the direct call and the FFI call cut their work
alike. Without the library (``native_available``) nothing here is built; the caller keeps its jitted path.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from jpinfer.native.kernels import KINDS, MAX_TOKENS
from jpinfer.native.library import loaded_library

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
# argument types after (threads, *operands, x, T, ids, K, count[, weights], y, kind), per exported function
_SIGNATURES = {
    "jpinfer_host_sparse_ffn": [_I32, _P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I32],
    "jpinfer_host_sparse_ffn_int8": [_I32, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _P, _P, _I32],
    "jpinfer_host_sparse_ffn_q4": [_I32, _I32, _P, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _P, _P,
                                   _I32],
}


def host_threads() -> int:
    """The workers a direct call spreads over: the CPUs this process may run on (XLA's CPU pool's default size)."""
    return len(os.sched_getaffinity(0))


def _function(name: str):
    """The exported C function ``name`` with its argument types set, or None without the library."""
    lib = loaded_library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _SIGNATURES[name], ctypes.c_char_p
    return fn


def _view(a, dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A host array (a jax array on the CPU device, or numpy) as a C-contiguous numpy view of ``dtype`` (a copy only
    where it is not one already)."""
    v = np.ascontiguousarray(np.asarray(a), dtype=dtype)
    if shape is not None and v.shape != shape:
        raise ValueError(f"expected shape {shape}, got {v.shape}")
    return v


def _pointer(a: np.ndarray | None) -> int | None:
    """The address of a's data (``__array_interface__``: a fifth of ``a.ctypes.data``'s ~1 us a call)."""
    return None if a is None else a.__array_interface__["data"][0]


class HostFfn:
    """One layout's listed sparse FFN as a direct host call: ``call(x, ids, count)`` is the FFI kernel's float32
    (T, d) for x (T, d) (or (d,): then (d,)), ids (K,) int32 positions in the layout, ``count`` valid ones, without
    ``b_down``. Holds its arrays' views (and so their buffers) while it lives.

    The layout's addresses are bound once, and the output is written to a buffer of its own (its address bound too)
    and copied out: taking an array's address costs ~1.5 us (``a.ctypes.data`` or its ``__array_interface__``), the
    C call itself ~2 us, the whole call with an empty list ~9 us. That is with the caches warm; after a 64 MiB copy
    (or 5 ms idle on a busy machine) the same empty call took ~165 us, ~30 of them the C call through libffi and the
    rest this wrapper's few numpy operations, 15-65 us each when cold (scratch timings, 2-core Zen 3 at load ~3.5):
    a host call's fixed cost is mostly cold code and data, not the kernel (whose own work for an empty list is a
    fill of y). A lock keeps two threads from sharing the output buffer at once."""

    def __init__(self, name: str, d: int, kind: str, operands: tuple, held: tuple, weighted: bool) -> None:
        self._fn = _function(name)
        self.d = d
        self._held = held  # the arrays the operands' addresses point into
        self._weighted = weighted
        self._y = np.zeros((MAX_TOKENS, d), np.float32)
        self._head = (host_threads(), *operands)  # the arguments before x
        self._tail = (_pointer(self._y), KINDS[kind])
        self._lock = threading.Lock()

    def __call__(self, x: np.ndarray, ids: np.ndarray, count: int, weights: np.ndarray | None = None) -> np.ndarray:
        x = np.asarray(x)
        x2 = np.ascontiguousarray(x.reshape(-1, self.d), np.float32)
        ids = np.ascontiguousarray(ids, np.int32)
        T, K = x2.shape[0], ids.shape[-1] if ids.ndim else -1
        if not 1 <= T <= MAX_TOKENS or ids.ndim != 1:
            raise ValueError(f"a direct call takes 1..{MAX_TOKENS} tokens and ids (K,), got x {x.shape}, ids "
                             f"{ids.shape}")
        if weights is not None and not self._weighted:
            raise ValueError("float rows take no weights in a direct call")
        w = None if weights is None else np.ascontiguousarray(np.broadcast_to(weights, (T, K)), np.float32)
        listed = (_pointer(x2), T, _pointer(ids), K, int(count)) + ((_pointer(w),) if self._weighted else ())
        with self._lock:
            error = self._fn(*self._head, *listed, *self._tail)
            if error is not None:
                raise ValueError(f"jpinfer direct sparse ffn: {error.decode()}")
            y = self._y[:T].copy()
        return y[0] if x.ndim == 1 else y


def float_ffn(rows, b_up, *, kind: str) -> HostFfn | None:
    """Float32 neuron-major rows (n, R, d) (``sparse.neurons.NeuronFFN.rows``) and their up bias (n,) or None as a
    direct call of ``jpinfer_sparse_ffn``'s kernel; None without the library."""
    if _function("jpinfer_host_sparse_ffn") is None:
        return None
    rows = _view(rows, np.float32)
    n, R, d = rows.shape
    b_up = None if b_up is None else _view(b_up, np.float32, (n,))
    return HostFfn("jpinfer_host_sparse_ffn", d, kind, (_pointer(rows), n, R, d, _pointer(b_up)), (rows, b_up),
                   weighted=False)


def int8_ffn(rows, scales, down_scales, b_up, *, kind: str) -> HostFfn | None:
    """Int8 bundles (n, R, d) with their gate/up row scales (n, R - 1) and down scales (d,) as a direct call of
    ``jpinfer_sparse_ffn_int8``'s kernel; None without the library."""
    if _function("jpinfer_host_sparse_ffn_int8") is None:
        return None
    rows = _view(rows, np.int8)
    n, R, d = rows.shape
    scales, down_scales = _view(scales, np.float32, (n, R - 1)), _view(down_scales, np.float32, (d,))
    b_up = None if b_up is None else _view(b_up, np.float32, (n,))
    operands = (_pointer(rows), n, R, d, _pointer(scales), _pointer(down_scales), _pointer(b_up))
    return HostFfn("jpinfer_host_sparse_ffn_int8", d, kind, operands, (rows, scales, down_scales, b_up), weighted=True)


def q4_ffn(records, q4_kind: str, down, down_scales, b_up, *, kind: str) -> HostFfn | None:
    """An int4 model's neurons, their 4-bit gate/up ``records`` (n, record bytes) of ``q4_kind`` ("q4_0" or "q4_1",
    ``quant.q4.Q4Bundles``) and int8 down slots (n, d) (or the layout's (n, 1, d)) with their scales (d,), as a
    direct call of ``jpinfer_sparse_ffn_q4_*``'s kernel; None without the library."""
    if _function("jpinfer_host_sparse_ffn_q4") is None:
        return None
    records, down = _view(records, np.uint8), _view(down, np.int8)
    down = down.reshape(down.shape[0], down.shape[-1])  # the layout's (n, 1, d) down slots: a view
    n, d = down.shape
    if records.ndim != 2 or records.shape[0] != n:
        raise ValueError(f"records must be (n, record bytes) with n = {n}, got {records.shape}")
    down_scales = _view(down_scales, np.float32, (d,))
    b_up = None if b_up is None else _view(b_up, np.float32, (n,))
    operands = (int(q4_kind == "q4_1"), _pointer(records), records.shape[1], _pointer(down), n, d,
                _pointer(down_scales), _pointer(b_up))
    return HostFfn("jpinfer_host_sparse_ffn_q4", d, kind, operands, (records, down, down_scales, b_up), weighted=True)
