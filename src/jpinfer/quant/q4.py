"""4-bit weights in llama.cpp's blocks of 32 (Q4_0, Q4_1), products with int8 activations per block (W4A8).

A block holds 32 consecutive inputs of one output row: q4_0 stores w = d * (q - 8), q4_1 stores
w = d * q + m, q in 0..15, d (and m) in float16: 4.5 (q4_0) or 5 (q4_1) bits a weight. The
products quantize x to int8 per block of 32 (llama.cpp's Q8_0/Q8_1 pairing), sum each block's
integers exactly and scale: y = sum over blocks of d_w * d_x * (sum q_w q_x) [+ m_w * d_x * sum q_x].
GGUF's Q4_0 / Q4_1 tensors load into this format without a float round trip (``from_gguf``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.ordering import after
from jpinfer.quant.int8 import quantize_tokens

QK = 32  # weights per block (llama.cpp's QK4_0 / QK4_1), and inputs per block of quantized activations
KINDS = ("q4_0", "q4_1")
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20}  # float16 d [, float16 m], 16 bytes of nibbles


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Q4Matrix:
    """A 4-bit (out, in) matrix in blocks of 32 along the input (module docstring).

    packed: uint8 (out, in / 2): within each block's 16 bytes, byte i holds element i (low nibble)
            and element i + 16 (high nibble), the order of llama.cpp's block ``qs``;
    scales: float16 (out, in / 32); mins: float16 (out, in / 32) for q4_1, None for q4_0."""

    packed: jax.Array
    scales: jax.Array
    mins: jax.Array | None
    kind: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def inputs(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def outputs(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes) + int(self.scales.nbytes) + (0 if self.mins is None else int(self.mins.nbytes))

    def take(self, index, axis: int = 0) -> "Q4Matrix":
        """The rows at ``index`` (an index array or a slice); only rows: the blocks run along the input."""
        if axis != 0:
            raise ValueError("a 4-bit matrix takes whole rows only (its blocks run along the input)")
        return Q4Matrix(self.packed[index], self.scales[index], None if self.mins is None else self.mins[index],
                        self.kind)


def check(m: Q4Matrix) -> None:
    """ValueError unless ``m`` is a well-formed Q4Matrix (dtypes and shapes as the class says)."""
    if not isinstance(m, Q4Matrix) or m.kind not in KINDS:
        raise ValueError(f"expected a Q4Matrix of kind {' or '.join(KINDS)}")
    out, inp = m.shape
    if m.packed.dtype != jnp.uint8 or m.scales.dtype != jnp.float16 or tuple(m.scales.shape) != (out, inp // QK):
        raise ValueError("Q4Matrix: packed must be uint8 (out, in/2), scales float16 (out, in/32)")
    if m.kind == "q4_1" and (m.mins is None or m.mins.dtype != jnp.float16 or tuple(m.mins.shape) != (out, inp // QK)):
        raise ValueError("Q4Matrix q4_1: mins must be float16 (out, in/32)")
    if inp % QK:
        raise ValueError(f"in ({inp}) must be a multiple of {QK}")


def concatenate(parts: list[Q4Matrix]) -> Q4Matrix:
    """The rows of several matrices of one kind and width stacked (e.g. q, k, v into one fused matrix)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack 4-bit matrices of kinds {sorted(kinds)}")
    mins = None if parts[0].mins is None else jnp.concatenate([p.mins for p in parts])
    return Q4Matrix(jnp.concatenate([p.packed for p in parts]), jnp.concatenate([p.scales for p in parts]), mins,
                    parts[0].kind)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Q4Bundles:
    """A 4-bit (slots n, in) matrix's rows in groups of ``slots``, each group one run of bytes: record i holds rows
    i, n + i, ..., (slots - 1) n + i (an int4 model's gate and up rows of neuron i), their packed bytes one row
    after the other, then their block scales as float16 bytes, then (q4_1) their mins likewise.

    A sparse FFN reads the records of the listed neurons only. In the matrix they are 2 x 4 separate runs of
    2 KiB and 256 bytes (packed rows, scale rows) at Llama-2-7B's width; in a record one run of 4.5 KiB.
    Measured (2-core Zen 4 VM, 2026-12-05, a scratch bench of the sparse FFN's gate/up half, 1101 of 11008
    neurons a layer from a power law, 24 layers chained, one token, same runs): 11.6-12.3 GB/s from the matrix,
    18.4-18.9 GB/s from records (16.3-16.9 with the rows of a group adjacent but the scales in an array apart).

    records: uint8 (n, slots * record bytes a row), a row's being in / 2 + 2 in / 32 (q4_0), + 2 in / 32 (q4_1).
    """

    records: jax.Array
    inputs: int = dataclasses.field(metadata=dict(static=True))
    slots: int = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(metadata=dict(static=True))

    @staticmethod
    def from_matrix(m: Q4Matrix, slots: int) -> "Q4Bundles":
        """The records of ``m`` (slots n, in) in groups of ``slots`` rows (class docstring)."""
        check(m)
        if slots < 1 or m.outputs % slots:
            raise ValueError(f"a {m.shape} matrix does not split into {slots} blocks of rows")
        n = m.outputs // slots
        # explicit sizes, never -1, here and below: a part of a layer may hold no neuron (n = 0)
        group = lambda a: jnp.asarray(a).reshape(slots, n, a.shape[1]).transpose(1, 0, 2).reshape(n, slots * a.shape[1])
        as_bytes = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint8).reshape(a.shape[0], 2 * a.shape[1])
        parts = [group(m.packed), group(as_bytes(m.scales))] + ([] if m.mins is None else [group(as_bytes(m.mins))])
        return Q4Bundles(jnp.concatenate(parts, axis=1), m.inputs, slots, m.kind)

    @property
    def n(self) -> int:
        return self.records.shape[0]

    @property
    def nbytes(self) -> int:
        return int(self.records.nbytes)

    def matrix(self) -> Q4Matrix:
        """The (slots n, in) Q4Matrix these records hold, its rows in ``from_matrix``'s order."""
        n, half, nb = self.n, self.inputs // 2, self.inputs // QK
        cut = np.cumsum([self.slots * half, self.slots * nb * 2])
        parts = jnp.split(self.records, cut, axis=1)
        ungroup = lambda a, width: a.reshape(n, self.slots, width).transpose(1, 0, 2).reshape(self.slots * n, width)
        halves = lambda a: jax.lax.bitcast_convert_type(ungroup(a, nb * 2).reshape(self.slots * n, nb, 2), jnp.float16)
        return Q4Matrix(ungroup(parts[0], half), halves(parts[1]), halves(parts[2]) if self.kind == "q4_1" else None,
                        self.kind)

    def take(self, index) -> "Q4Bundles":
        """The records at ``index`` (an index array or a slice)."""
        return Q4Bundles(self.records[index], self.inputs, self.slots, self.kind)


def _blocks(w) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"a 4-bit matrix must be (out, in) with in a multiple of {QK}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize a matrix holding inf or nan")
    return w.reshape(w.shape[0], w.shape[1] // QK, QK)


def _pack(q: np.ndarray) -> np.ndarray:
    """q (out, nb, 32) in 0..15 -> packed (out, nb * 16): byte i = q[i] | q[i + 16] << 4."""
    q = q.astype(np.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], q.shape[1] * 16)


def unpack(packed: jax.Array) -> jax.Array:
    """packed (..., in / 2) uint8 -> q (..., in / 32, 32) uint8 in 0..15 (jnp, or numpy for numpy input)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 16, 16)  # no -1: a matrix may have no rows
    return xp.concatenate([b & 0x0F, b >> 4], axis=-1)


def quantize_q4_0(w) -> Q4Matrix:
    """llama.cpp's quantize_row_q4_0 on each block (float32): d = (the value of largest magnitude) / -8,
    q = min(15, trunc(x / d + 8.5)); the scale is stored as float16 (the integers use the float32 d)."""
    x = _blocks(w)
    idx = np.abs(x).argmax(axis=-1)[..., None]
    vmax = np.take_along_axis(x, idx, axis=-1)
    d = vmax / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, np.trunc(x * inv + np.float32(8.5))).astype(np.uint8)
    return Q4Matrix(jnp.asarray(_pack(q)), jnp.asarray(d[..., 0].astype(np.float16)), None, "q4_0")


def quantize_q4_1(w) -> Q4Matrix:
    """llama.cpp's quantize_row_q4_1 on each block (float32): d = (max - min) / 15,
    q = min(15, trunc((x - min) / d + 0.5)); scale d and min stored as float16."""
    x = _blocks(w)
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, np.trunc((x - lo) * inv + np.float32(0.5))).astype(np.uint8)
    return Q4Matrix(jnp.asarray(_pack(q)), jnp.asarray(d[..., 0].astype(np.float16)),
                    jnp.asarray(lo[..., 0].astype(np.float16)), "q4_1")


def quantize(w, kind: str) -> Q4Matrix:
    """A float (out, in) matrix in the 4-bit format ``kind`` ("q4_0" or "q4_1")."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return quantize_q4_0(w) if kind == "q4_0" else quantize_q4_1(w)


def dequantize(m: Q4Matrix, dtype=jnp.float32) -> jax.Array:
    """The float (out, in) matrix a Q4Matrix represents (jnp; differentiable in the scales and mins)."""
    q = unpack(jnp.asarray(m.packed)).astype(jnp.float32)
    d = m.scales.astype(jnp.float32)[..., None]
    w = d * (q - 8) if m.kind == "q4_0" else d * q + m.mins.astype(jnp.float32)[..., None]
    return w.reshape(q.shape[0], q.shape[1] * QK).astype(dtype)


def rows(m: Q4Matrix, index: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The dequantized rows at ``index`` (any shape): (*index.shape, in) (a tied 4-bit head's embeddings)."""
    flat = m.take(index.reshape(-1))
    return dequantize(flat, dtype).reshape(*index.shape, m.inputs)


def from_gguf(raw, shape: tuple[int, int], kind: str) -> Q4Matrix:
    """A Q4Matrix from a GGUF Q4_0 / Q4_1 tensor's bytes (``raw``: its uint8 data, blocks in row order;
    ``shape``: (out, in), i.e. GGUF's (ne1, ne0)): the scales, mins and nibbles are split out of each
    block as they are, no float round trip."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"kind must be one of {tuple(GGUF_BLOCK_BYTES)}, got {kind!r}")
    out, inp = shape
    if inp % QK:
        raise ValueError(f"in ({inp}) must be a multiple of {QK}")
    size = GGUF_BLOCK_BYTES[kind]
    raw = np.ascontiguousarray(np.asarray(raw, np.uint8)).reshape(-1)
    if raw.size != out * inp // QK * size:
        raise ValueError(f"{kind} data of shape {shape} holds {out * inp // QK * size} bytes, got {raw.size}")
    blocks = raw.reshape(out, inp // QK, size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "q4_1" else None
    packed = blocks[..., size - 16:].reshape(out, inp // 2)
    return Q4Matrix(jnp.asarray(packed), jnp.asarray(scales), None if mins is None else jnp.asarray(mins), kind)


def to_gguf(m: Q4Matrix) -> np.ndarray:
    """The GGUF block bytes (uint8, flat) of a Q4Matrix (inverse of ``from_gguf``)."""
    out, inp = m.shape
    nb = inp // QK
    parts = [np.asarray(m.scales, np.float16).reshape(out, nb, 1).view(np.uint8)]
    if m.kind == "q4_1":
        parts.append(np.asarray(m.mins, np.float16).reshape(out, nb, 1).view(np.uint8))
    parts.append(np.asarray(m.packed, np.uint8).reshape(out, nb, 16))
    return np.concatenate(parts, axis=-1).reshape(-1)


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tokens x (T, in) to int8 in blocks of 32 as the products do: (q (T, in) int8, scale (T, in/32)
    float32, sum of each block's q (T, in/32) int32), the rounding of ``int8.quantize_tokens`` per block."""
    T, inp = x.shape
    xb = x.astype(jnp.float32).reshape(T, inp // QK, QK)
    q, scale = quantize_tokens(xb)
    return q.reshape(T, inp), scale, q.astype(jnp.int32).sum(-1)


def product(m: Q4Matrix, tokens: jax.Array) -> jax.Array:
    """W @ x per token (N, in) -> float32 (N, out) in XLA ops: the module docstring's function, with both
    sides dequantized to float32 and one float32 GEMM (XLA:CPU has no 4-bit or per-block integer product
    that runs fast; the integer block sums unpacked to int32 took 1.2 s of prefill for a 64-token prompt of
    the default model, a scratch run). Equal to the integer formula within the rounding of a float32 sum
    of ``in`` products."""
    T, inp = tokens.shape
    xq, xd, _ = quantize_blocks(tokens)
    x_hat = (xq.reshape(T, inp // QK, QK).astype(jnp.float32) * xd[..., None]).reshape(T, inp)
    # dequantized once the tokens exist (``ordering.after``): otherwise XLA dequantized every layer's matrix at the
    # start of a prompt's step and held them all (tests/test_quantized.py checks the compiled step's temporaries)
    w = dequantize(dataclasses.replace(m, scales=after(m.scales, tokens)))
    return jnp.dot(x_hat, w.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
