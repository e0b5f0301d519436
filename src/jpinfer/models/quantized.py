"""Quantized decoder weights: their format, quantizing a float model, and the product they run through.

Formats (``config.WEIGHT_FORMATS``, ``jpinfer.load(weights=...)``):
- "float": every tensor in the model's dtype;
- "int8": q/k/v, o, gate/up, down and the head as ``quant.int8.Int8Matrix`` (one scale per output, W8A8);
- "int4": q/k/v, o, gate/up and down as ``quant.q4.Q4Matrix`` (llama.cpp's blocks of 32, W4A8); the head
  stays int8 per row, as llama.cpp keeps its output matrix at 6 to 8 bits (its Q4 files store the default
  model's tied head as Q8_0). Norms, biases and an untied input embedding stay float in both.

``matmul`` is the one product of every quantized matrix: ``ops.dense.quantized_matmul``, where ``ops`` picks the
native kernel or the XLA form of ``quant`` per platform and token count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.models.params import Weights
from jpinfer.ops.dense import quantized_matmul
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix

QuantizedMatrix = Int8Matrix | Q4Matrix
INT4_KIND = "q4_1"  # the 4-bit blocks a float checkpoint is quantized to: the default model's own format


def is_quantized(w) -> bool:
    return isinstance(w, (Int8Matrix, Q4Matrix))


def is_input_major_int8(w) -> bool:
    """Whether ``w`` is an int8 (in, out) matrix with one scale per column (an input-major copy, read by rows)."""
    return isinstance(w, Int8Matrix) and w.scale_axis == 1


def input_major_int8(w: Int8Matrix) -> Int8Matrix:
    """A row-scaled (out, in) int8 matrix as its input-major (in, out) copy: the same integers and scales,
    transposed (one scale per column), so a product can read only the rows of the inputs it keeps."""
    if not isinstance(w, Int8Matrix) or w.scale_axis != 0:
        raise ValueError("input_major_int8 takes an int8 matrix with one scale per row")
    return Int8Matrix(jnp.asarray(np.ascontiguousarray(np.asarray(w.values).T)), w.scales, 1)


def weights_format(weights: Weights) -> str:
    """"float", "int8" or "int4": the format of the decoder's projections (int4 where any is 4-bit; also for
    a model whose FFN matrices were moved into a sparse layout)."""
    layer = weights.layers[0]
    projections = (layer.w_qkv, layer.wo, layer.w_gate_up, layer.w_down)
    if any(isinstance(w, Q4Matrix) for w in projections):
        return "int4"
    return "int8" if any(isinstance(w, Int8Matrix) for w in projections) else "float"


def bytes_per_weight(weights: Weights) -> float:
    """Bytes a stored FFN weight takes, its scales included (float32 4, bfloat16 2, int8 ~1, Q4_1 0.625): what
    a placement sizes neurons at."""
    layer = weights.layers[0]
    matrices = (layer.w_gate_up, layer.w_down)
    return sum(int(m.nbytes) for m in matrices) / sum(int(np.prod(m.shape)) for m in matrices)


def float_bytes(weights: Weights) -> int:
    """Bytes of the weights in their float dtype: the model's own for float weights, those of the float
    weights an int8 or 4-bit model stands for otherwise (each quantized matrix at the norms' dtype; an int8
    model's float copy of a tied embedding counts too)."""
    itemsize = jnp.dtype(weights.dtype).itemsize
    leaves = jax.tree_util.tree_leaves(weights, is_leaf=is_quantized)
    return sum(int(np.prod(m.shape)) * itemsize if is_quantized(m) else int(m.nbytes) for m in leaves)


def as_float(w: jax.Array | QuantizedMatrix, dtype=jnp.float32) -> jax.Array:
    """A weight as the float matrix it stands for, in its stored orientation (for the rare whole-matrix
    uses outside the products, e.g. a column norm); a float weight is cast to ``dtype``."""
    if isinstance(w, Int8Matrix):
        return int8.dequantize(w, dtype)
    if isinstance(w, Q4Matrix):
        return q4.dequantize(w, dtype)
    return w.astype(dtype)


# Rows quantized at a time when a matrix is made int8 from another form: ~4M weights (16 MB of float32, 32 MB
# of the float64 ``int8.quantize`` works in). Whole, a 7B down matrix took ~1.4 GB of float64 temporaries: the
# peak of building a 7B int4 model's sparse layout (bench/cpu_7b.py's memory runs, 2026-12-05).
CONVERT_WEIGHTS = 1 << 22


def row_chunks(shape: tuple[int, int]) -> Iterator[tuple[int, int]]:
    """(r0, r1): the row ranges of an (out, in) matrix converted ``CONVERT_WEIGHTS`` weights at a time."""
    out, inp = shape
    step = max(1, CONVERT_WEIGHTS // max(inp, 1))
    return ((r0, min(out, r0 + step)) for r0 in range(0, out, step))


def int8_by_rows(shape: tuple[int, int], float_rows: Callable[[int, int], Any]) -> Int8Matrix:
    """An (out, in) matrix quantized to int8 per output row, a ``row_chunks`` range at a time: ``float_rows(r0,
    r1)`` gives rows [r0, r1) in float. Rows are quantized independently, so the result is ``int8.quantize`` of
    the whole float matrix, without it or its float64 temporaries ever existing whole."""
    values = np.empty(shape, np.int8)
    scales = np.empty(shape[:1], np.float32)
    for r0, r1 in row_chunks(shape):
        part = int8.quantize(float_rows(r0, r1))
        values[r0:r1], scales[r0:r1] = np.asarray(part.values), np.asarray(part.scales)
    return Int8Matrix(jnp.asarray(values), jnp.asarray(scales), 0)


def int8_copy(w: jax.Array | QuantizedMatrix) -> Int8Matrix:
    """An (out, in) weight as int8 with one scale per output row: an int8 one as it is, another (a 4-bit
    one: its blocks run along the input, so its rows across the input cannot be read or cut out) quantized
    from the float matrix it stands for (``int8_by_rows``). The int8 copies the threshold layout of an int4
    model reads by rows, and its sparse layout's down columns."""
    if isinstance(w, Int8Matrix) and w.scale_axis == 0:
        return w
    if isinstance(w, Q4Matrix):
        rows = lambda r0, r1: q4.dequantize(w.take(slice(r0, r1)))
    elif isinstance(w, Int8Matrix):  # one scale per column (input-major): the rows' values with every scale
        rows = lambda r0, r1: int8.dequantize(Int8Matrix(w.values[r0:r1], w.scales, 1))
    else:
        rows = lambda r0, r1: jnp.asarray(w[r0:r1], jnp.float32)
    return int8_by_rows(tuple(w.shape), rows)


def rows(w: QuantizedMatrix, index: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The dequantized weights of the outputs at ``index`` (any shape), (*index.shape, in): the rows of an (out,
    in) quantized matrix, the columns of an input-major int8 one; the embeddings of a tied quantized head."""
    return int8.rows(w, index, dtype) if isinstance(w, Int8Matrix) else q4.rows(w, index, dtype)


matmul = quantized_matmul  # the product of every quantized matrix, picked by ``ops`` (module docstring)


def quantize_matrix(w, fmt: str) -> QuantizedMatrix:
    """A float (out, in) matrix in ``fmt``: "int8" per output row; "int4" in ``INT4_KIND`` blocks where its
    inputs fill whole blocks of 32, else int8 (the blocks' width)."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"fmt must be 'int8' or 'int4', got {fmt!r}")
    if fmt == "int8" or w.shape[1] % q4.QK:
        return int8.quantize(w)
    return q4.quantize(w, INT4_KIND)


def quantize_weights(weights: Weights, fmt: str, blocks: dict[str, Q4Matrix] | None = None) -> Weights:
    """Float ``weights`` in the format ``fmt`` ("int8" or "int4"; module docstring).

    int8: every projection and the head per output row (the head as a (vocab, d_model) matrix; a tied
    model's input embedding is then read from those rows, so nothing is stored twice; an embedding of
    its own stays float: it is read one row per token, nothing to gain, and quantizing it cost the
    default model 0.4% perplexity after the migration, a scratch run).
    int4: the projections in 4-bit blocks, taken from ``blocks`` where given (a GGUF file's own Q4_0 /
    Q4_1 tensors, fused like the float ones: ``gguf_loader.read_q4_blocks``), else quantized to
    ``INT4_KIND``; a projection whose input width is not a multiple of 32 (the blocks' width), and the
    head, int8."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"fmt must be 'int8' or 'int4', got {fmt!r}")
    if fmt == "int8" and blocks:
        raise ValueError("4-bit blocks make int4 weights, not int8")
    if weights_format(weights) != "float":
        raise ValueError(f"the weights are {weights_format(weights)} already")
    blocks = blocks or {}

    def convert(i: int, name: str, w: jax.Array) -> QuantizedMatrix:
        stored = blocks.get(f"layers.{i}.{name}")
        return stored if stored is not None else quantize_matrix(w, fmt)

    layers = [
        dataclasses.replace(layer, **{name: convert(i, name, getattr(layer, name))
                                      for name in ("w_qkv", "wo", "w_gate_up", "w_down")})
        for i, layer in enumerate(weights.layers)
    ]
    result = dataclasses.replace(weights, layers=layers, head=int8.quantize(np.asarray(weights.head).T))
    if weights_format(result) != fmt:  # every layer has the shapes of the first
        raise ValueError(f"int4 weights need projections taking a multiple of {q4.QK} inputs; this model has none")
    return result
