"""Dense products: a float matrix's (the decoder's ``linear``) and a quantized matrix's (``quantized_matmul``).

Float: for 1 to ``MAX_TOKENS`` tokens (decode steps, one sequence or a batch), float32, the native product on the
CPU (``native.kernels.float_matvec``: XLA:CPU's products of 2-8 rows ran at a third of its one-row bandwidth, and
one kernel for both makes a sequence's output in a batch bit for bit its output alone; docs/architecture.md);
XLA's einsum otherwise.

Quantized (int8 rows, W8A8; 4-bit blocks, W4A8): on the CPU, for up to ``MAX_TOKENS`` tokens (every decode step;
``Q4_NATIVE_PROMPT_TOKENS`` for 4-bit blocks), the native kernel (``native.kernels.int8_matvec`` / ``q4_matvec``:
weights read once for all tokens, on every core); elsewhere the XLA form of ``quant``: on an accelerator, for
prompts of more tokens (one native call per 8 tokens would read the weights again for each group, where XLA's GEMM
reads them once), for an input-major int8 copy, and when the native library is unavailable. The two compute the
same integers (exactly) and scale them in another order (float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpinfer.native import kernels as native_kernels
from jpinfer.native import native_available
from jpinfer.ops.table import dispatch, pick
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix

MAX_TOKENS = native_kernels.MAX_TOKENS
# A 4-bit product of up to this many tokens (short prompts) runs the native kernel in groups of 8, each reading the
# blocks once, rather than XLA's form, which dequantizes the whole matrix to float32 for one GEMM: the 7B-shaped
# gate|up held 361 MB at a time, and short prompts ran slower. Default model, int4, prefill and one token (2-core
# Zen 5 VM, 2026-12-05, two alternated runs): 8 tokens 47-63 -> 27-28 ms, 24 tokens 57-75 -> 40-45; at 64 and
# 128 tokens the two measured alike (81-110 ms, 101-144), and each group is one more call to compile.
Q4_NATIVE_PROMPT_TOKENS = 32


def native_tokens(x: jax.Array) -> bool:
    """Whether x (..., d) holds 1 to ``MAX_TOKENS`` tokens, with the native kernels loaded."""
    tokens = x.size // x.shape[-1] if x.shape[-1] else 0
    return 1 <= tokens <= MAX_TOKENS and native_available()


def decode_sized(x: jax.Array, w: jax.Array) -> bool:
    """Whether float32 x holds 1 to ``MAX_TOKENS`` tokens for a float32 (out, in) matrix, with the native kernels
    loaded: the operands the native float products read."""
    return x.dtype == w.dtype == jnp.float32 and w.ndim == 2 and native_tokens(x)


def float_product(x: jax.Array, w: jax.Array, accumulate=None) -> jax.Array:
    """x (..., in) through a float (out, in) matrix: W @ x per token (module docstring). ``accumulate``: None, the
    einsum of x and w as they are (x's dtype); a dtype, x cast to w's dtype and the sums in ``accumulate``."""
    if accumulate is None:
        xla = lambda x, w: jnp.einsum("...i,oi->...o", x, w)
    else:
        xla = lambda x, w: jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=accumulate)
    native = lambda x, w: native_kernels.float_matvec(w, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    ready = decode_sized(x, w)
    return dispatch(lambda p: pick("dense", "float", p, native=ready), {"native": native, "xla": xla}, x, w)


def quantized_matmul(x: jax.Array, w: Int8Matrix | Q4Matrix) -> jax.Array:
    """x (..., in) times the matrix ``w`` stands for, float32 (..., out): W @ x per token for an (out, in)
    matrix, x @ M for an int8 (in, out) one (scale_axis 1).

    Differentiable in x (the loss sensitivities of ``profiler.calibration`` run through it): the
    derivative is the straight-through one, that of the dequantized matrix, since rounding x to
    int8 has a zero derivative almost everywhere and would silently zero every gradient."""
    if x.shape[-1] != w.inputs:
        raise ValueError(f"x has {x.shape[-1]} features, the quantized matrix {w.shape} takes {w.inputs}")
    y = _product(x.reshape(-1, w.inputs).astype(jnp.float32), w)
    return y.reshape(*x.shape[:-1], w.outputs)


def _xla_product(tokens: jax.Array, w: Int8Matrix | Q4Matrix) -> jax.Array:
    return int8.product(tokens, w) if isinstance(w, Int8Matrix) else q4.product(w, tokens)


def _native_product(tokens: jax.Array, w: Int8Matrix | Q4Matrix) -> jax.Array:
    if isinstance(w, Int8Matrix):
        return native_kernels.int8_matvec(w.values, w.scales, tokens, native=True)
    return native_kernels.q4_matvec(w, tokens, native=True)


@jax.custom_jvp
def _product(tokens: jax.Array, w: Int8Matrix | Q4Matrix) -> jax.Array:
    is_q4 = isinstance(w, Q4Matrix)
    native_form = is_q4 or w.scale_axis == 0
    limit = Q4_NATIVE_PROMPT_TOKENS if is_q4 else MAX_TOKENS
    ready = tokens.shape[0] <= limit and native_form and native_available()
    choice = lambda p: pick("dense", "int4" if is_q4 else "int8", p, native=ready)
    return dispatch(choice, {"native": _native_product, "xla": _xla_product}, tokens, w)


@_product.defjvp
def _product_jvp(primals, tangents):
    tokens, w = primals

    def dequantized(t, m):  # the float product; linear in t and in the scales (and mins)
        if isinstance(m, Int8Matrix):
            matrix = int8.dequantize(m, jnp.float32)
            return t @ (matrix if m.scale_axis == 1 else matrix.T)
        return t @ q4.dequantize(m, jnp.float32).T

    _, dy = jax.jvp(dequantized, primals, tangents)
    return _product(tokens, w), dy
