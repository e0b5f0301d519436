"""The table: which implementation runs each product, per weights format and lowering platform.

``pick`` is the one decision; the product functions of ``ops.dense``, ``ops.attention``, ``ops.listed`` and
``ops.threshold`` ask it per platform and lower the answer with ``dispatch``. Pure Python over names, so a test
reads the whole table without a GPU or the native library.

Products (``PRODUCTS``):
- "dense": a matrix product of 1-8 tokens (decode steps; float32, int8 rows or 4-bit blocks);
- "attention": the cached attention of a decode step or a long prompt;
- "listed": the sparse FFN over a neuron list (``fmt`` of its bundles); "weighted" the same with a weight per
  listed activation (experts' routing, 0/1 keep masks), which the fused float kernels do not take (float rows run
  as the kernels' two halves; int8 and 4-bit kernels take the weights: "listed"'s choice);
- "all_rows": every neuron of a layout for up to 8 tokens: the listed FFN over the full list ("listed") or the
  dense products over the rows ("xla");
- "rows": x @ M over listed rows of M (the threshold modes' XLA form; no kernel of its own);
- "threshold": the threshold rows product (inputs at most a threshold skipped, the kept rows read) and the
  input-thresholded head;
- "select": the predictor's compaction of the neurons over a cut-off.

``native``: the native library is loaded (``native.native_available``) and reads these operands (dtype, token
count, shapes: each product function checks its own); without it every CPU row is an XLA form, after the one
warning the library gives. ``backend``: a forced choice of the listed and rows products (tests, benches).

Implementations: "native" (``jpinfer.native``'s C++ kernel), "pallas" (``jpinfer.pallas``' kernel; on the CPU
"pallas_interpret", its interpret mode), "loop" (the chunked XLA loop, ``ops.chunked``: the CPU's XLA form of
listed rows), "gather" (listed rows gathered at once, then products: an accelerator's XLA form), "xla" (the
product's one XLA form), "listed" (all_rows: the listed FFN over the full list).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax

PRODUCTS = ("dense", "attention", "listed", "weighted", "all_rows", "rows", "threshold", "select")
FORMATS = ("float", "int8", "int4")
# the platforms a choice is made for: "default" stands for every other (ROCm, TPU, ...)
PLATFORMS = ("cpu", "cuda", "default")


def pick(product: str, fmt: str, platform: str, *, native: bool, triton: bool = False,
         backend: str = "auto") -> str:
    """The implementation of ``product`` over ``fmt`` weights lowered for ``platform`` (module docstring)."""
    if product not in PRODUCTS or fmt not in FORMATS:
        raise ValueError(f"no product {product!r} over {fmt!r} weights")
    cpu = platform == "cpu"
    if product == "rows":
        return backend if backend in ("loop", "gather") else ("loop" if cpu else "gather")
    if product == "weighted" and backend == "pallas":
        raise ValueError("a layout with experts runs with backend 'auto', 'xla' or 'gather' (the Pallas kernels "
                         "take no routing weights)")
    if product == "listed" and backend == "pallas" and fmt != "float":
        raise ValueError("the Pallas kernels take float rows: quantized bundles run with backend 'auto', 'xla' or "
                         "'gather'")
    if product == "weighted" and fmt != "float":  # the int8 and 4-bit kernels take the weights themselves
        product = "listed"
    if product == "listed" and fmt == "float":
        if backend == "gather":
            return "gather"
        if backend == "pallas":
            return "pallas_interpret" if cpu else "pallas"
        if cpu:
            return "native" if native and backend == "auto" else "loop"
        return "pallas" if backend == "auto" and platform == "cuda" and triton else "gather"
    if product == "listed":  # int8 bundles, an int4 model's records: the native kernel or the XLA gather
        return "native" if cpu and native and backend == "auto" else "gather"
    if product == "all_rows":  # an int4 model's records run the listed op, which picks per platform itself
        return "listed" if fmt == "int4" or (cpu and native) else "xla"
    return "native" if cpu and native and backend == "auto" else "xla"


def dispatch(choice: Callable[[str], str], implementations: Mapping[str, Callable], *args):
    """``implementations[choice(platform)](*args)`` for the platform the call is lowered for: one
    ``jax.lax.platform_dependent`` (a function jitted for the CPU on a GPU machine still gets the CPU's), or a plain
    call where every platform gets the same implementation."""
    cpu, cuda, default = (choice(platform) for platform in PLATFORMS)
    if cpu == cuda == default:
        return implementations[cpu](*args)
    branches = {"cpu": implementations[cpu]} | ({} if cuda == default else {"cuda": implementations[cuda]})
    return jax.lax.platform_dependent(*args, default=implementations[default], **branches)
