"""Finding, checking and registering the native kernel library (built by setup.py at install time).

The library is loaded once, on the first ``native_available()`` (kernels.py asks it when a wrapper is
traced), never at import. Any failure — no built file, a file that does not load (wrong architecture,
broken), a library of another ABI version, a CPU lacking an instruction set the library was compiled
for — gives exactly one ``warnings.warn`` naming the cause, and the wrappers fall back to XLA; it never
raises. The CPU check runs two small exported C functions compiled for plain x86-64 (what the library
was compiled for, what ``__builtin_cpu_supports`` says this CPU has) before any kernel can run.

Environment:
    JPINFER_NATIVE=0             do not load it (the XLA fallback everywhere; no warning).
    JPINFER_NATIVE_LIBRARY=PATH  load this file instead of the one built next to this module
                                 (a development build; tests point it at a missing or broken file).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import pathlib
import threading
import warnings

import jax

# 4: jpinfer_cached_attention, 5: FFN kind geglu, 6: gelu, 7: the attention's softcap, 8: its per-sequence
# positions, 9: jpinfer_float_matvec, 12: jpinfer_select_over, 13: jpinfer_prefill_attention, 14: the direct host
# calls jpinfer_host_sparse_ffn* (host.py)
ABI_VERSION = 14
# (csrc/info.cc jpinfer_native_abi_version)
LIBRARY_STEM = "_jpinfer_native"  # setup.py's extension jpinfer.native._jpinfer_native

# FFI targets: the exported handler symbol, registered under the same name.
TARGETS = (
    "jpinfer_sparse_ffn",
    "jpinfer_sparse_ffn_int8",
    "jpinfer_sparse_ffn_q4_0",
    "jpinfer_sparse_ffn_q4_1",
    "jpinfer_sparse_activations",
    "jpinfer_listed_rows_sum",
    "jpinfer_threshold_rows",
    "jpinfer_threshold_rows_int8",
    "jpinfer_int8_matvec",
    "jpinfer_float_matvec",
    "jpinfer_q4_0_matvec",
    "jpinfer_q4_1_matvec",
    "jpinfer_cached_attention",
    "jpinfer_prefill_attention",
    "jpinfer_select_over",
)

# Bits of jpinfer_native_compiled_features / jpinfer_native_cpu_features (csrc/info.cc).
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni", "bmi2")


class NativeUnavailableWarning(RuntimeWarning):
    """The native kernels could not be used; the XLA fallback runs instead."""


_lock = threading.Lock()
_state: dict = {}  # after the first load attempt: {"lib": CDLL | None, "reason": str | None, "path": str | None}


def library_path() -> pathlib.Path | None:
    """The library to load: $JPINFER_NATIVE_LIBRARY, else the build next to this module (None: none built)."""
    override = os.environ.get("JPINFER_NATIVE_LIBRARY")
    if override:
        return pathlib.Path(override)
    here = pathlib.Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / (LIBRARY_STEM + suffix)
        if candidate.is_file():
            return candidate
    matches = sorted(here.glob(LIBRARY_STEM + "*.so"))
    return matches[0] if matches else None


def _feature_names(bits: int) -> list[str]:
    return [name for i, name in enumerate(FEATURES) if bits >> i & 1]


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, None, path) or (None, why not, path)."""
    if os.environ.get("JPINFER_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by JPINFER_NATIVE=0", None
    path = library_path()
    if path is None:
        return None, ("no native kernel library was built (pip install -e . compiles it; it needs g++ "
                      "and jax's FFI headers at build time)"), None
    if not path.is_file():
        return None, f"native kernel library {path} does not exist", str(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"native kernel library {path} failed to load: {e}", str(path)
    try:
        version = lib.jpinfer_native_abi_version()
        if version != ABI_VERSION:
            return None, (f"native kernel library {path} has ABI version {version}, this jpinfer expects "
                          f"{ABI_VERSION} (rebuild: pip install -e .)"), str(path)
        lib.jpinfer_native_compiled_features.restype = ctypes.c_uint32
        lib.jpinfer_native_cpu_features.restype = ctypes.c_uint32
        compiled, cpu = lib.jpinfer_native_compiled_features(), lib.jpinfer_native_cpu_features()
        missing = _feature_names(compiled & ~cpu)
        if missing:
            return None, (f"native kernel library {path} was compiled for {', '.join(missing)}, which this CPU "
                          f"lacks (rebuild here, or with JPINFER_NATIVE_PORTABLE=1 for any x86-64-v3 CPU)"), str(path)
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    except (AttributeError, OSError, ValueError, TypeError, RuntimeError) as e:
        return None, f"native kernel library {path} is unusable: {e}", str(path)
    return lib, None, str(path)


def _ensure() -> dict:
    if not _state:
        with _lock:
            if not _state:
                lib, reason, path = _load()
                if reason is not None and not reason.startswith("disabled"):
                    warnings.warn(f"jpinfer native CPU kernels unavailable: {reason}; using the XLA fallback",
                                  NativeUnavailableWarning, stacklevel=3)
                _state.update(lib=lib, reason=reason, path=path)
    return _state


def _reset_for_tests() -> None:
    """Forget the load attempt, so that the next call loads again under the current environment (a test
    hook: registered FFI targets stay registered)."""
    with _lock:
        _state.clear()


def native_available() -> bool:
    """Whether the native kernels are loaded and registered (loads them on the first call)."""
    return _ensure()["lib"] is not None


def loaded_library() -> ctypes.CDLL | None:
    """The loaded library (None: not loaded), for the plain C functions called without XLA (``host.py``)."""
    return _ensure()["lib"]


def unavailable_reason() -> str | None:
    """Why the native kernels are not used (None when they are)."""
    return _ensure()["reason"]


def loaded_path() -> str | None:
    """The library file that was loaded (or tried)."""
    return _ensure()["path"]


def features() -> dict[str, list[str]]:
    """{"compiled": the instruction sets the library was built for, "cpu": those this CPU has}
    (empty lists when it is not loaded)."""
    lib = _ensure()["lib"]
    if lib is None:
        return {"compiled": [], "cpu": []}
    return {"compiled": _feature_names(lib.jpinfer_native_compiled_features()),
            "cpu": _feature_names(lib.jpinfer_native_cpu_features())}


def set_max_threads(n: int) -> None:
    """Cap the threads a kernel uses (the calling one included); 0 = as many as XLA's intra-op pool has.
    Results do not depend on it (fixed partitions); it exists to check that and to measure."""
    lib = _ensure()["lib"]
    if lib is not None:
        lib.jpinfer_native_set_max_threads(int(n))
