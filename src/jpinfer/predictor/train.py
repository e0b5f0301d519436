"""Training one layer's predictor, and choosing its cut-off for a target recall.

Data: the profiler's predictor samples for one layer (float16 FFN inputs, bit-packed active
masks), split in corpus order into a training part and a held-out tail (nearby tokens are
alike, so a random split would flatter the held-out scores). Masks stay packed on the
device and are unpacked inside the jitted step: 8x less memory than booleans.

Loss: binary cross-entropy with the positives weighted by the layer's negative/positive
ratio (active neurons are the minority at high sparsity), and the strong pairs (the largest
contributions, when given) by ``strong_weight`` more. Optimiser: optax AdamW on a
warm-up + cosine schedule. Early stopping on the held-out loss, keeping the best epoch.
The cut-off is chosen afterwards on the held-out part: a missed active neuron costs
accuracy, an extra one only time, so it is the largest logit that keeps ``recall`` of the
truly active (token, neuron) pairs and ``strong_recall`` of the strong ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jpinfer.predictor.mlp import PredictorWeights, predict_logits

MAX_POSITIVE_WEIGHT = 20.0  # a layer with 1% active neurons would otherwise weigh positives 99x


class LayerPredictor(nnx.Module):
    """One layer's predictor as a Flax nnx module, for training: one logit per FFN neuron
    (``mlp.predict_logits`` computes the same from the exported arrays)."""

    def __init__(self, d_model: int, rank: int, d_ff: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(d_model, rank, rngs=rngs)
        self.out = nnx.Linear(rank, d_ff, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How each layer is trained; the defaults fit all layers of the default model in the
    time budget stated in the README."""

    max_epochs: int = 8
    batch_size: int = 256
    learning_rate: float = 5e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.05
    patience: int = 2
    held_out: float = 0.15
    recall: float = 0.99
    strong_recall: float = 0.999
    strong_weight: float = 10.0
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.recall <= 1:
            raise ValueError(f"recall must lie in (0, 1], got {self.recall}")
        if not 0 < self.strong_recall <= 1:
            raise ValueError(f"strong_recall must lie in (0, 1], got {self.strong_recall}")
        if self.strong_weight < 0:
            raise ValueError(f"strong_weight must be >= 0, got {self.strong_weight}")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must lie in (0, 1), got {self.held_out}")
        for name in ("max_epochs", "batch_size", "patience"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.learning_rate > 0 or self.weight_decay < 0:
            raise ValueError("learning_rate must be > 0 and weight_decay >= 0")


@dataclasses.dataclass(frozen=True)
class LayerData:
    """One layer's samples: ``inputs`` (n, d_model) float16 and ``masks`` (n, ceil(d_ff/8))
    bit-packed (big-endian bits, as ``np.packbits``) active masks; optionally ``strong``,
    packed like ``masks``: the active pairs whose contribution to the FFN output is among the
    largest (``fit.strong_masks``), which training weighs more and the cut-off must keep."""

    inputs: np.ndarray
    masks: np.ndarray
    d_ff: int
    strong: np.ndarray | None = None

    def __post_init__(self):
        if self.inputs.ndim != 2 or self.masks.ndim != 2 or len(self.inputs) != len(self.masks):
            raise ValueError(f"inputs (n, d) and masks (n, bytes) disagree: {self.inputs.shape} vs {self.masks.shape}")
        if self.masks.shape[1] != -(-self.d_ff // 8):
            raise ValueError(f"masks hold {self.masks.shape[1] * 8} bits per sample, d_ff is {self.d_ff}")
        if self.strong is not None and self.strong.shape != self.masks.shape:
            raise ValueError(f"strong masks {self.strong.shape} must match the masks {self.masks.shape}")

    def __len__(self) -> int:
        return len(self.inputs)

    def split(self, held_out: float) -> tuple["LayerData", "LayerData"]:
        """(training head, held-out tail) in corpus order."""
        n_held = max(1, int(round(len(self) * held_out)))
        if len(self) - n_held < 1:
            raise ValueError(f"{len(self)} samples are too few to hold out {held_out:.0%} and train on the rest")
        cut = len(self) - n_held
        head, tail = slice(None, cut), slice(cut, None)
        return tuple(
            LayerData(self.inputs[part], self.masks[part], self.d_ff,
                      None if self.strong is None else self.strong[part])
            for part in (head, tail)
        )

    def active(self) -> np.ndarray:
        """(n, d_ff) bool."""
        return _unpack(self.masks, self.d_ff)

    def strong_active(self) -> np.ndarray | None:
        """(n, d_ff) bool, or None without strong masks."""
        return None if self.strong is None else _unpack(self.strong, self.d_ff)


def _unpack(packed: np.ndarray, d_ff: int) -> np.ndarray:
    return np.unpackbits(np.asarray(packed), axis=-1, count=d_ff).astype(bool)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Held-out quality at the chosen cut-off (fractions over (token, neuron) pairs)."""

    recall: float
    precision: float
    predicted: float  # mean fraction of neurons predicted active per token
    active: float  # mean fraction truly active per token
    strong_recall: float | None = None  # recall of the strong pairs, when there are strong masks
    predicted_q99: int | None = None  # 0.99 quantile of the neurons predicted per token (a capacity K)


@dataclasses.dataclass(frozen=True)
class LayerResult:
    weights: PredictorWeights
    scores: Scores
    epochs: int
    held_out_loss: list[float]
    seconds: float


def cutoff_for_recall(logits: np.ndarray, active: np.ndarray, recall: float) -> float:
    """The largest cut-off c such that ``logits > c`` keeps at least ``recall`` of the active pairs.

    With no active pair there is nothing to keep: +inf (predict nothing).
    """
    positives = np.asarray(logits, np.float32)[np.asarray(active, bool)]
    if positives.size == 0:
        return math.inf
    may_miss = positives.size - math.ceil(recall * positives.size - 1e-9)
    kth = float(np.partition(positives, may_miss)[may_miss])
    return float(np.nextafter(np.float32(kth), np.float32(-np.inf)))


def score(logits: np.ndarray, active: np.ndarray, cutoff: float) -> Scores:
    predicted = logits > cutoff
    hits = np.count_nonzero(predicted & active)
    n_pred, n_active = np.count_nonzero(predicted), np.count_nonzero(active)
    per_token = predicted.sum(-1)
    q99 = int(np.ceil(np.quantile(per_token, 0.99))) if per_token.size else 0
    return Scores(hits / max(n_active, 1), hits / max(n_pred, 1), n_pred / active.size, n_active / active.size,
                  predicted_q99=q99)


def positive_weight(masks: np.ndarray, d_ff: int) -> float:
    """Negative/positive ratio of the training labels, clipped to [1, MAX_POSITIVE_WEIGHT]."""
    positives = int(np.count_nonzero(_unpack(masks, d_ff)))
    negatives = masks.shape[0] * d_ff - positives
    return float(np.clip(negatives / max(positives, 1), 1.0, MAX_POSITIVE_WEIGHT))


def _loss(module: LayerPredictor, x: jax.Array, packed: jax.Array, strong: jax.Array, pos_weight: jax.Array,
          strong_weight: float, d_ff: int) -> jax.Array:
    y = jnp.unpackbits(packed, axis=-1, count=d_ff).astype(jnp.float32)
    big = jnp.unpackbits(strong, axis=-1, count=d_ff).astype(jnp.float32)
    logits = module(x.astype(jnp.float32))
    weight = 1.0 + (pos_weight - 1.0) * y + strong_weight * big
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y) * weight)


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The jitted functions of one training shape, built once and reused: layers of equal width
    and sample count share them, so a model's layers compile once, not once each."""

    graphdef: Any
    init: Callable
    epoch: Callable
    loss: Callable


@functools.lru_cache(maxsize=16)
def _steps(d_model: int, rank: int, d_ff: int, batch: int, steps_per_epoch: int, config: TrainConfig) -> _Steps:
    total_steps = steps_per_epoch * config.max_epochs
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, max(1, int(config.warmup_fraction * total_steps)), total_steps
    )
    tx = optax.adamw(schedule, weight_decay=config.weight_decay)
    graphdef, _ = nnx.split(LayerPredictor(d_model, rank, d_ff, rngs=nnx.Rngs(0)), nnx.Param)

    def init(seed):
        params = nnx.split(LayerPredictor(d_model, rank, d_ff, rngs=nnx.Rngs(seed)), nnx.Param)[1]
        return params, tx.init(params)

    def loss_of(params, x, y, strong, pos_weight):
        return _loss(nnx.merge(graphdef, params), x, y, strong, pos_weight, config.strong_weight, d_ff)

    def epoch(params, state, x, y, strong, pos_weight, order):
        def step(carry, idx):
            params, state = carry
            loss, grads = jax.value_and_grad(loss_of)(params, x[idx], y[idx], strong[idx], pos_weight)
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss
        (params, state), losses = jax.lax.scan(step, (params, state), order.reshape(steps_per_epoch, batch))
        return params, state, losses.mean()

    return _Steps(graphdef, init, jax.jit(epoch, donate_argnums=(0, 1)), jax.jit(loss_of))


def train_layer(data: LayerData, rank: int, config: TrainConfig = TrainConfig(), *, progress: bool = True,
                desc: str = "predictor") -> LayerResult:
    """Train one layer's predictor of width ``rank`` and choose its cut-off on the held-out tail."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    t0 = time.perf_counter()
    train, held = data.split(config.held_out)
    batch = min(config.batch_size, len(train))
    steps_per_epoch = len(train) // batch
    fns = _steps(data.inputs.shape[1], rank, data.d_ff, batch, steps_per_epoch, config)
    params, opt_state = fns.init(config.seed)
    pos_weight = jnp.float32(positive_weight(train.masks, data.d_ff))
    x_train, y_train, s_train = jnp.asarray(train.inputs), jnp.asarray(train.masks), _strong_or_none(train)
    x_held, y_held, s_held = jnp.asarray(held.inputs), jnp.asarray(held.masks), _strong_or_none(held)

    rng = np.random.default_rng(config.seed)
    best, best_loss, history, since_best = params, math.inf, [], 0
    bar = tqdm(total=config.max_epochs, desc=desc, unit="epoch", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        for _ in range(config.max_epochs):
            order = jnp.asarray(rng.permutation(len(train))[: steps_per_epoch * batch].astype(np.int32))
            if best is params:  # the epoch donates its inputs: keep the best epoch's copy alive
                best = jax.tree_util.tree_map(jnp.copy, params)
            params, opt_state, _ = fns.epoch(params, opt_state, x_train, y_train, s_train, pos_weight, order)
            loss = float(fns.loss(params, x_held, y_held, s_held, pos_weight))
            history.append(loss)
            bar.update(1)
            bar.set_postfix(held_out_loss=f"{loss:.4f}")
            if loss < best_loss * (1 - 1e-4):
                best, best_loss, since_best = params, loss, 0
            else:
                since_best += 1
                if since_best >= config.patience:
                    break
    finally:
        bar.close()

    weights = PredictorWeights.from_module(nnx.merge(fns.graphdef, best), math.inf)
    weights, scores = with_cutoff(weights, held, config.recall, config.strong_recall)
    return LayerResult(weights, scores, len(history), history, time.perf_counter() - t0)


def _strong_or_none(data: LayerData) -> jax.Array:
    """The strong masks, or all-zero ones (one compiled step serves both)."""
    return jnp.asarray(data.strong if data.strong is not None else np.zeros_like(data.masks))


def with_cutoff(weights: PredictorWeights, held: LayerData, recall: float,
                strong_recall: float | None = None) -> tuple[PredictorWeights, Scores]:
    """The predictor with its cut-off chosen on held-out samples: the largest that keeps
    ``recall`` of the active pairs and, given strong masks and ``strong_recall``, that
    fraction of the strong ones (their recall is reported whenever there are strong masks)."""
    logits = np.asarray(_held_logits(weights, jnp.asarray(held.inputs)))
    active, strong = held.active(), held.strong_active()
    cutoff = cutoff_for_recall(logits, active, recall)
    if strong is not None and strong_recall is not None:
        cutoff = min(cutoff, cutoff_for_recall(logits, strong, strong_recall))
    scores = score(logits, active, cutoff)
    if strong is not None:
        scores = dataclasses.replace(scores, strong_recall=score(logits, strong, cutoff).recall)
    return dataclasses.replace(weights, cutoff=jnp.float32(cutoff)), scores


@jax.jit
def _held_logits(weights: PredictorWeights, x: jax.Array) -> jax.Array:
    return predict_logits(weights, x.astype(jnp.float32))
