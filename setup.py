"""Builds jpinfer's native CPU kernels (src/jpinfer/native/csrc) into one shared library at install time.

Everything else about the package is in pyproject.toml; this file only adds the C++ extension
``jpinfer.native._jpinfer_native``. It is a plain shared library of XLA FFI handlers, loaded with
ctypes by jpinfer/native/library.py (no Python C API involved), built by setuptools' build_ext so that
``pip install .`` and ``pip install -e .`` (in place, next to library.py) both produce it.

The build never fails the install: the extension is ``optional`` (a compiler error only warns), and it
is skipped with a message on a machine that is not x86-64 or when jax's FFI headers cannot be found.
At run time library.py then warns once and the XLA fallback runs.

Headers: the FFI headers ship inside jaxlib (``jax.ffi.include_dir()``). jax is deliberately NOT a
build requirement: pip would install jax, jaxlib, scipy and numpy (~150 MB) into every isolated build
environment just to read three header files. Instead the headers are looked up, in order, in
$JPINFER_FFI_INCLUDE; through ``import jax`` in this process (no build isolation); through the
installing interpreter in a subprocess with pip's isolation variables removed (it sees the target
environment's site-packages); and by path under the interpreter's site-packages. On a fresh
environment jax is not installed yet when pip builds jpinfer, so the first install builds no library;
the Makefile's setup rule therefore reinstalls once (``--no-deps``) when no library was built.

Time (2-core EPYC, 2026-12-02): ``pip install -e .`` in the project's venv takes about 30 s, of which
8 s without the library (JPINFER_NATIVE_BUILD=0): the four .cc files compile concurrently in ~20 s.

Flags: -O3 -march=native -std=c++17 by default; JPINFER_NATIVE_PORTABLE=1 builds for
-march=x86-64-v3 (AVX2 + FMA + F16C: the kernels' baseline) instead, for a library copied to other
machines. JPINFER_NATIVE_BUILD=0 skips the library. No OpenMP: the kernels use XLA's thread pool
(csrc/common.h says why). No -ffast-math: the kernels' float sums must keep their written order.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import platform
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "src/jpinfer/native/csrc"
HEADER = os.path.join("xla", "ffi", "api", "ffi.h")


def _has_header(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, HEADER))


def ffi_include_dir() -> str | None:
    """Where jax's FFI headers are (the directory holding xla/ffi/api/ffi.h), or None."""
    env = os.environ.get("JPINFER_FFI_INCLUDE")
    if _has_header(env):
        return env
    try:
        import jax.ffi  # noqa: PLC0415

        path = jax.ffi.include_dir()
        if _has_header(path):
            return path
    except Exception:  # noqa: BLE001 - not importable in an isolated build environment
        pass
    # pip's isolated build environment hides the target site-packages through PYTHONPATH (a
    # sitecustomize) and friends; the same interpreter without them sees the target environment.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        out = subprocess.run([sys.executable, "-c", "import jax.ffi; print(jax.ffi.include_dir())"], env=clean,
                             capture_output=True, text=True, timeout=120, check=False)
        path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
        if _has_header(path):
            return path
    except (OSError, subprocess.SubprocessError):
        pass
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    roots |= {os.path.join(sys.prefix, "lib", version, "site-packages")}
    for root in sorted(roots):
        path = os.path.join(root, "jaxlib", "include")
        if _has_header(path):
            return path
    return None


class BuildNative(build_ext):
    """build_ext for the FFI library: picks the headers and flags, compiles in parallel, skips (with
    a message) what cannot be built rather than failing the install."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def _skip(self, why: str) -> None:
        print(f"jpinfer: not building the native CPU kernels ({why}); the XLA fallback will be used",
              file=sys.stderr)
        self.extensions = []

    def run(self):
        if os.environ.get("JPINFER_NATIVE_BUILD", "1") == "0":
            self._skip("JPINFER_NATIVE_BUILD=0")
        elif platform.machine().lower() not in ("x86_64", "amd64") or self.compiler not in (None, "unix"):
            self._skip(f"needs x86-64 and a gcc/clang toolchain, this is {platform.machine()}")
        else:
            include = ffi_include_dir()
            if include is None:
                self._skip("jax's FFI headers were not found: install jax first, or set JPINFER_FFI_INCLUDE")
            else:
                portable = os.environ.get("JPINFER_NATIVE_PORTABLE", "0") not in ("", "0")
                arch = "-march=x86-64-v3" if portable else "-march=native"
                for ext in self.extensions:
                    # -isystem: XLA's headers are not ours to warn about (-Wall flags their sign compares)
                    # -g0: Python's CFLAGS ask for -g, which made the library 5 MB instead of 0.4 MB
                    flags = ["-isystem", include, "-O3", "-g0", arch, "-std=c++17", "-fPIC", "-DNDEBUG", "-Wall",
                             "-Wno-unused-parameter"]
                    ext.extra_compile_args = flags + list(ext.extra_compile_args)
                print(f"jpinfer: building the native CPU kernels ({arch}, FFI headers from {include})",
                      file=sys.stderr)
        super().run()

    def build_extension(self, ext):
        # build_ext's --parallel builds extensions side by side, not the sources of one: compile this
        # one's .cc files concurrently (about 10 s each with -O3; 33 s in a row, 20 s on 2 cores)
        serial = self.compiler.compile
        workers = max(1, int(self.parallel or 1))

        def compile_concurrently(sources, *args, **kwargs):
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                parts = pool.map(lambda source: serial([source], *args, **kwargs), sources)
                return [obj for objs in parts for obj in objs]

        self.compiler.compile = compile_concurrently
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = serial


setup(
    ext_modules=[
        Extension(
            "jpinfer.native._jpinfer_native",
            sources=sorted(glob.glob(os.path.join(CSRC, "*.cc"))),
            depends=sorted(glob.glob(os.path.join(CSRC, "*.h"))),
            language="c++",
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
