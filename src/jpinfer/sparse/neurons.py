"""Neuron-major FFN storage: each neuron's weights in one contiguous bundle.

In the dense layout neuron i is row i of the gate and up blocks of ``w_gate_up`` and
column i of ``w_down``, so computing one neuron touches three places that are far apart.
Here ``rows[i]`` is an (R, d_model) block holding the gate row, the up row and the down
row (``w_down[:, i]``) of neuron i next to each other (R = 3; R = 2 for kind ``relu``,
which has no gate). Gathering a neuron is then one contiguous read, which is what
sparse kernels want on both the accelerator and the CPU.

A layout can hold a subset of a layer's neurons (the hot part on the accelerator,
the cold part on the CPU): ``ids`` maps each row to the original neuron id.

Quantized models get int8 bundles (``NeuronFFN.quantized``). From an int8 model they hold the dense
model's own integers (W8A8, ``quant.int8``): the gate/up slots are neuron i's rows of
``w_gate_up.values`` with their row scales (``scales``, one per (neuron, slot)), the down slot is
column i of ``w_down.values``, whose scales run along its outputs (``down_scales``, (d,), shared
by every neuron): the full list then computes the dense int8 FFN's integers.

An int4 model's gate/up rows are its own 4-bit rows, the file's bits, regrouped by neuron (``gate_up``, a
``quant.q4.Q4Bundles``: neuron i's gate and up rows with their block scales in one record, so a listed neuron is
one read, not four); only the down slot is an int8 bundle (R = 1): a copy of column i of the dequantized ``w_down``,
requantized with one scale per output (``down_scales``). 4-bit blocks run along a matrix's input dimension, so a
down column cannot be cut out of ``w_down``'s blocks, and re-blocking it in 4 bits along the other axis cost ~9%
perplexity when tried (int8 copies 0.9% in the threshold mode, measured there, with most of it the per-token
activation scale; docs/architecture.md). At Llama-2-7B's shapes this holds a layer's FFN in 2 x 0.5625 + 1 bytes a
weight triple, against 3 when every slot was an int8 copy (bench/results/cpu_7b.md). Like the float and int8
bundles, the records are a copy: an engine over them drops the model's dense FFN (``modes.engines.without_ffn``).

With experts (Mixtral, ``ModelConfig.n_experts``) a layout also holds the router and each neuron's expert: a
neuron's activation is then times its expert's routing weight (``routing``), zero for the experts the router
does not pick, as in the decoder (``transformer.ffn_activations``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import FFN_KINDS, UNGATED_KINDS, ExpertRouting, FfnKind
from jpinfer.models import quantized
from jpinfer.models.params import Layer
from jpinfer.models.transformer import expert_weights
from jpinfer.quant.q4 import Q4Bundles, Q4Matrix


def routing_of(router: jax.Array, rule: ExpertRouting, experts: jax.Array, x: jax.Array) -> jax.Array:
    """(T, len(experts)) float32: for the tokens x (T, d_model), the routing weight (``transformer.expert_weights``)
    of each expert in ``experts`` (int32 ids: a layout's neuron of each row, or of each list position)."""
    return jnp.take(expert_weights(router, x, rule), experts, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NeuronFFN:
    """One layer's FFN (or a subset of its neurons), neuron-major.

    rows:   (n, R, d_model) with rows[i] = [gate_i, up_i, down_i] (R = 3) or
            [up_i, down_i] (R = 2, kind ``relu``).
    ids:    (n,) int32, original neuron id of each row.
    b_up:   (n,) or None, the up bias of each row's neuron (OPT).
    b_down: (d_model,) or None; a sparse FFN over this layout adds it once.
    kind:   FFN activation kind (static).
    scales: int8 gate/up rows only: (n, R - 1) float32, the scale of each gate/up row (else None).
    down_scales: int8 rows only: (d_model,) float32, the down projection's scale per output.
    gate_up: a 4-bit model's (module docstring): its 4-bit gate/up rows by neuron, P = 2 rows a record (gate, up;
            P = 1, up only, for an ungated kind); ``rows`` then holds the int8 down slots alone, (n, 1, d_model).
    router / neuron_experts / routing_rule: with experts, the router (n_experts, d_model), the expert of each
            row's neuron (n,) int32 and how the router weighs the experts (static; None without experts).
    """

    rows: jax.Array
    ids: jax.Array
    b_up: jax.Array | None
    b_down: jax.Array | None
    kind: str = dataclasses.field(metadata=dict(static=True))
    scales: jax.Array | None = None
    down_scales: jax.Array | None = None
    router: jax.Array | None = None
    neuron_experts: jax.Array | None = None
    routing_rule: ExpertRouting | None = dataclasses.field(default=None, metadata=dict(static=True))
    gate_up: Q4Bundles | None = None

    @property
    def quantized(self) -> bool:
        """Whether the bundles are int8 (W8A8: ``down_scales`` set, and ``scales`` or ``gate_up``)."""
        return self.rows.dtype == jnp.int8

    @property
    def n_neurons(self) -> int:
        return self.rows.shape[0]

    @property
    def d_model(self) -> int:
        return self.rows.shape[2]

    @property
    def gated(self) -> bool:
        return self.kind not in UNGATED_KINDS

    def routing(self, x: jax.Array) -> jax.Array:
        """(T, n) float32: each held neuron's routing weight for the tokens x (T, d_model) (layout with experts)."""
        return routing_of(self.router, self.routing_rule, self.neuron_experts, x)

    def subset(self, positions, *, with_b_down: bool = True) -> tuple["NeuronFFN", np.ndarray]:
        """Compact copy holding the rows at ``positions`` (row indices of this layout).

        Returns the copy and its int32 table compact position -> original neuron id
        (also stored as the copy's ``ids``). When a layer is split into parts whose
        outputs are summed (hot + cold), keep ``b_down`` in exactly one of them:
        pass ``with_b_down=False`` for the others.
        """
        pos = np.asarray(positions)
        if pos.ndim != 1 or not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"subset positions must be a 1-D integer array, got {pos.dtype} {pos.shape}")
        if pos.size and (pos.min() < 0 or pos.max() >= self.n_neurons):
            raise ValueError(f"subset positions must lie in [0, {self.n_neurons}), got [{pos.min()}, {pos.max()}]")
        if np.unique(pos).size != pos.size:
            raise ValueError("subset positions must not repeat a neuron (it would be counted twice)")
        table = np.asarray(self.ids)[pos].astype(np.int32)
        take = lambda a: None if a is None else a[jnp.asarray(pos, jnp.int32)]
        compact = NeuronFFN(
            rows=take(self.rows),
            ids=jnp.asarray(table),
            b_up=take(self.b_up),
            b_down=self.b_down if with_b_down else None,
            kind=self.kind,
            scales=take(self.scales),
            down_scales=self.down_scales,
            router=self.router,
            neuron_experts=take(self.neuron_experts),
            routing_rule=self.routing_rule,
            gate_up=None if self.gate_up is None else self.gate_up.take(jnp.asarray(pos, jnp.int32)),
        )
        return compact, table


def from_arrays(
    kind: FfnKind,
    w_gate: jax.Array | np.ndarray | None,
    w_up: jax.Array | np.ndarray,
    w_down: jax.Array | np.ndarray,
    b_up: jax.Array | np.ndarray | None = None,
    b_down: jax.Array | np.ndarray | None = None,
) -> NeuronFFN:
    """Bundle dense FFN weights in the decoder's (out, in) layout neuron-major:
    ``w_gate``/``w_up`` (n, d) (a row per neuron), ``w_down`` (d, n) (a column per neuron)."""
    if kind not in FFN_KINDS:
        raise ValueError(f"unknown FFN kind {kind!r}; supported: {', '.join(FFN_KINDS)}")
    if (w_gate is None) != (kind in UNGATED_KINDS):
        raise ValueError(f"FFN kind {kind!r} {'has no' if kind in UNGATED_KINDS else 'needs a'} gate projection")
    n, d = w_up.shape
    if tuple(w_down.shape) != (d, n):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected {(d, n)} for w_up {(n, d)}")
    if w_gate is not None and tuple(w_gate.shape) != (n, d):
        raise ValueError(f"w_gate has shape {tuple(w_gate.shape)}, expected {(n, d)} like w_up")
    if b_up is not None and tuple(b_up.shape) != (n,):
        raise ValueError(f"b_up has shape {tuple(b_up.shape)}, expected {(n,)}")
    if b_down is not None and tuple(b_down.shape) != (d,):
        raise ValueError(f"b_down has shape {tuple(b_down.shape)}, expected {(d,)}")
    parts = ([] if w_gate is None else [jnp.asarray(w_gate)]) + [jnp.asarray(w_up), jnp.asarray(w_down).T]
    return NeuronFFN(
        rows=jnp.stack(parts, axis=1),
        ids=jnp.arange(n, dtype=jnp.int32),
        b_up=None if b_up is None else jnp.asarray(b_up),
        b_down=None if b_down is None else jnp.asarray(b_down),
        kind=kind,
    )


def from_layer(layer: Layer, kind: FfnKind, experts: tuple[int, ExpertRouting] | None = None) -> NeuronFFN:
    """Neuron-major FFN of a decoder layer (``kind`` is ``ModelConfig.ffn_kind``): float bundles of a
    float layer, int8 bundles of an int8 one, 4-bit gate/up records and int8 down slots of an int4 one (module
    docstring). ``experts``: (neurons per expert,
    routing rule) of a layer with a router (``ModelConfig.experts``), and only of such a layer."""
    if (layer.router is None) != (experts is None):
        raise ValueError("a layer with a router needs experts=(neurons per expert, routing rule), and only it")
    if isinstance(layer.w_gate_up, Q4Matrix):
        ffn = _q4_from_layer(layer, kind)
    elif quantized.is_quantized(layer.w_gate_up) or quantized.is_quantized(layer.w_down):
        ffn = _int8_from_layer(layer, kind)
    else:
        n = layer.w_down.shape[1]
        gate, up = (None, layer.w_gate_up) if kind in UNGATED_KINDS else (layer.w_gate_up[:n], layer.w_gate_up[n:])
        ffn = from_arrays(kind, gate, up, layer.w_down, layer.b_up, layer.b_down)
    if experts is None:
        return ffn
    return dataclasses.replace(ffn, router=layer.router, routing_rule=experts[1],
                               neuron_experts=jnp.arange(ffn.n_neurons, dtype=jnp.int32) // experts[0])


def _checked_gate_up_shape(gate_up_shape: tuple[int, int], down_shape: tuple[int, int], kind: FfnKind) -> int:
    """The gate/up slots a neuron has (2, or 1 for an ungated kind), after checking w_gate_up's shape."""
    d, n = down_shape
    slots = 1 if kind in UNGATED_KINDS else 2
    if tuple(gate_up_shape) != (slots * n, d):
        raise ValueError(f"w_gate_up has shape {tuple(gate_up_shape)}, expected {(slots * n, d)} for kind {kind!r}")
    return slots


def _q4_from_layer(layer: Layer, kind: FfnKind) -> NeuronFFN:
    down = quantized.int8_copy(layer.w_down)
    slots = _checked_gate_up_shape(layer.w_gate_up.shape, down.shape, kind)
    return NeuronFFN(
        rows=down.values.T[:, None, :],
        ids=jnp.arange(down.shape[1], dtype=jnp.int32),
        b_up=None if layer.b_up is None else jnp.asarray(layer.b_up, jnp.float32),
        b_down=None if layer.b_down is None else jnp.asarray(layer.b_down),
        kind=kind,
        down_scales=down.scales,
        gate_up=Q4Bundles.from_matrix(layer.w_gate_up, slots),
    )


def _int8_from_layer(layer: Layer, kind: FfnKind) -> NeuronFFN:
    gate_up, down = quantized.int8_copy(layer.w_gate_up), quantized.int8_copy(layer.w_down)
    d, n = down.shape
    slots = _checked_gate_up_shape(gate_up.shape, down.shape, kind)
    values = gate_up.values.reshape(slots, n, d)
    rows = jnp.concatenate([values.transpose(1, 0, 2), down.values.T[:, None, :]], axis=1)
    return NeuronFFN(
        rows=rows,
        ids=jnp.arange(n, dtype=jnp.int32),
        b_up=None if layer.b_up is None else jnp.asarray(layer.b_up, jnp.float32),
        b_down=None if layer.b_down is None else jnp.asarray(layer.b_down),
        kind=kind,
        scales=gate_up.scales.reshape(slots, n).T,
        down_scales=down.scales,
    )
