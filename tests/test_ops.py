"""The ops layer: its table picks each product's implementation per format and platform, and it is the only
module that does (no other module imports the kernel libraries or lowers a choice per platform)."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.native import native_available
from jpinfer.ops import dense
from jpinfer.ops.table import FORMATS, PRODUCTS, dispatch, pick

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "jpinfer"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("product", ["dense", "attention", "threshold", "select"])
def test_kernel_products_run_native_on_the_cpu_with_the_library_and_xla_elsewhere(product, fmt):
    assert pick(product, fmt, "cpu", native=True) == "native"
    assert pick(product, fmt, "cpu", native=False) == "xla"
    for platform in ("cuda", "rocm", "default"):
        assert pick(product, fmt, platform, native=True, triton=True) == "xla"


@pytest.mark.parametrize("platform,native,triton,backend,want", [
    ("cpu", True, True, "auto", "native"),
    ("cpu", False, True, "auto", "loop"),  # the library missing: the chunked XLA loop
    ("cuda", True, True, "auto", "pallas"),
    ("cuda", True, False, "auto", "gather"),  # a jax without the Triton lowering
    ("rocm", True, True, "auto", "gather"),
    ("cpu", True, True, "xla", "loop"),
    ("cuda", True, True, "xla", "gather"),
    ("cpu", True, True, "gather", "gather"),
    ("cpu", True, True, "pallas", "pallas_interpret"),
    ("cuda", False, False, "pallas", "pallas"),
])
def test_float_listed_rows(platform, native, triton, backend, want):
    assert pick("listed", "float", platform, native=native, triton=triton, backend=backend) == want


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_listed_rows_are_native_on_the_cpu_and_the_gather_elsewhere(fmt):
    assert pick("listed", fmt, "cpu", native=True) == "native"
    assert pick("listed", fmt, "cpu", native=False) == "gather"
    assert pick("listed", fmt, "cpu", native=True, backend="xla") == "gather"
    assert pick("listed", fmt, "cuda", native=True, triton=True) == "gather"  # the Pallas kernels read float rows
    with pytest.raises(ValueError, match="float rows"):
        pick("listed", fmt, "cuda", native=False, backend="pallas")


def test_weighted_all_rows_and_rows_products():
    assert pick("weighted", "float", "cpu", native=True) == "native"
    assert pick("weighted", "float", "cpu", native=True, backend="gather") == "xla"
    assert pick("weighted", "float", "cuda", native=True, triton=True) == "xla"
    with pytest.raises(ValueError, match="routing weights"):
        pick("weighted", "float", "cpu", native=True, backend="pallas")
    with pytest.raises(ValueError, match="routing weights"):
        pick("weighted", "int8", "cuda", native=False, backend="pallas")
    assert pick("weighted", "int8", "cpu", native=True) == "native"  # the int8 and 4-bit kernels take the weights
    assert pick("weighted", "int4", "cuda", native=True) == "gather"
    for platform in ("cpu", "cuda"):  # an int4 model's records run the listed op, which picks per platform
        assert pick("all_rows", "int4", platform, native=False) == "listed"
    assert pick("all_rows", "int8", "cpu", native=True) == "listed"
    assert pick("all_rows", "float", "cpu", native=False) == "xla"
    assert pick("all_rows", "float", "cuda", native=True) == "xla"
    assert pick("rows", "float", "cpu", native=True) == "loop"
    assert pick("rows", "int8", "cuda", native=True) == "gather"
    assert pick("rows", "float", "cuda", native=True, backend="loop") == "loop"
    assert pick("threshold", "int8", "cpu", native=True, backend="loop") == "xla"
    with pytest.raises(ValueError, match="no product"):
        pick("conv", "float", "cpu", native=True)
    assert set(PRODUCTS) >= {"dense", "attention", "listed", "threshold"}


def test_dispatch_runs_the_lowering_platforms_choice_or_a_plain_call():
    calls = []
    impls = {"a": lambda x: calls.append("a") or x + 1, "b": lambda x: calls.append("b") or x * 2}
    assert dispatch(lambda p: "b", impls, 3) == 6 and calls == ["b"]  # one choice: a plain call, traced once
    per_platform = jax.jit(lambda x: dispatch(lambda p: "a" if p == "cpu" else "b", impls, x))
    assert float(per_platform(jnp.float32(3))) == 4.0  # these tests run on the CPU


@pytest.mark.parametrize("library", [True, False])
def test_the_decoders_float_product_follows_the_native_library(library, monkeypatch):
    """The decode-sized float product lowers to the native kernel on the CPU with the library, to XLA's product
    without it (the fallback after the library's one warning)."""
    if library and not native_available():
        pytest.skip("native library not built")
    monkeypatch.setattr(dense, "native_available", lambda: library)
    x, w = jnp.ones((2, 16), jnp.float32), jnp.asarray(np.eye(8, 16), jnp.float32)
    product = jax.jit(lambda x, w: dense.float_product(x, w))  # a function of its own: jit caches traces per function
    assert ("jpinfer_float_matvec" in product.lower(x, w).as_text()) == library
    np.testing.assert_allclose(np.asarray(product(x, w)), np.ones((2, 8)), rtol=0)


KERNEL_PACKAGES = ("jpinfer.native", "jpinfer.pallas")
# the packages that may import the kernel libraries: ops picks among them, the libraries themselves, and the
# benches, which time each kernel by name
MAY_IMPORT_KERNELS = ("ops", "native", "pallas", "bench")


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC), ast.parse(path.read_text(), str(path))


def test_only_ops_imports_the_kernel_libraries():
    offenders = []
    for rel, tree in _modules():
        if rel.parts[0] in MAY_IMPORT_KERNELS:
            continue
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "jpinfer":
                names = [f"jpinfer.{a.name}" for a in node.names]
            offenders += [f"{rel}: {n}" for n in names if n.startswith(KERNEL_PACKAGES)]
    assert offenders == []


def test_only_ops_lowers_a_choice_per_platform():
    """``jax.lax.platform_dependent`` is the per-platform choice: ops' ``dispatch`` makes it for every product.
    The one other use is no kernel choice: ``models.rope`` puts its tables behind a conditional on the CPU only
    (a fusion barrier, the same computation in both branches)."""
    users = {str(rel) for rel, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "platform_dependent"}
    assert users == {"ops/table.py", "models/rope.py"}
