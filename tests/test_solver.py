"""Placement solver: the integer program against brute force, constraints, grouping, policies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jpinfer.config import ModelConfig
from jpinfer.models.params import expected_shapes
from jpinfer.solver import (
    HardwareProfile,
    InfeasibleBudgetError,
    ModelSizes,
    model_sizes,
    solve_placement,
    synthetic_frequencies,
)
from jpinfer.solver.frequencies import check_frequencies, hottest_first
from jpinfer.solver.groups import make_groups

NEURON_BYTES = 1000
DENSE = dict(layer_dense_bytes=5000, embed_bytes=2000, lm_head_bytes=2000, other_bytes=100, kv_cache_bytes=3000)


def small_sizes(n_layers: int, n_neurons: int) -> ModelSizes:
    return ModelSizes(
        n_layers=n_layers, n_neurons=n_neurons, d_model=64, neuron_bytes=NEURON_BYTES,
        predictor_bytes=(0,) * n_layers, **DENSE,
    )


def dense_bytes(sizes: ModelSizes) -> int:
    return (sizes.n_layers * sizes.layer_dense_bytes + sizes.embed_bytes + sizes.lm_head_bytes + sizes.other_bytes
            + sizes.kv_cache_bytes)


def hardware(sizes: ModelSizes, neurons_that_fit: int, *, accel_bw=16e9, cpu_bw=1e9, latency=2e-6, sync=3e-6):
    """CPU 1 us per active neuron, accelerator 16x faster; budget = dense part + N neurons."""
    return HardwareProfile(
        name="test", accel_memory=dense_bytes(sizes) + neurons_that_fit * NEURON_BYTES,
        accel_bandwidth=accel_bw, cpu_bandwidth=cpu_bw, cpu_threads=1, link_bandwidth=1e9,
        link_latency=latency, sync_cost=sync, reserved=0,
    )


def random_freqs(rng, n_layers, n_neurons):
    return [rng.uniform(0, 1, n_neurons) ** rng.uniform(1, 4) for _ in range(n_layers)]


# --- independent reference: the cost model written out plainly, and brute force over group subsets


def ref_min_neurons(freqs, hw):
    out = []
    for f in freqs:
        per_neuron = NEURON_BYTES / hw.cpu_bandwidth
        top = np.sort(f)[::-1]
        k = next((k for k in range(1, f.size + 1) if per_neuron * top[:k].sum() >= hw.sync_cost), f.size)
        out.append(k)
    return np.array(out)


def ref_layer_time(hw, sizes, accel_mass, cpu_mass, n_accel, n_total):
    accel = accel_mass * NEURON_BYTES / hw.accel_bandwidth
    cpu = cpu_mass * NEURON_BYTES / hw.cpu_bandwidth
    transfer = 2 * (hw.link_latency + sizes.d_model * sizes.act_bytes / hw.link_bandwidth)
    if n_accel == n_total:
        return accel
    if n_accel == 0:
        return cpu + transfer
    return max(accel, cpu + transfer + hw.sync_cost)


def brute_force(freqs, sizes, hw, group_size, objective, prefix_only=False):
    """Best objective over every subset of groups meeting memory and communication constraints."""
    orders = [np.argsort(-f, kind="stable") for f in freqs]
    groups = [(l, pos) for l, f in enumerate(freqs) for pos in range(0, f.size, group_size)]
    capacity = (hw.budget - dense_bytes(sizes)) // NEURON_BYTES
    c_min = ref_min_neurons(freqs, hw)
    best = -np.inf if objective == "mass" else np.inf
    total = sum(f.sum() for f in freqs)
    for bits in itertools.product((0, 1), repeat=len(groups)):
        chosen = [[] for _ in freqs]
        for bit, (l, pos) in zip(bits, groups):
            if bit:
                chosen[l].append(pos)
        if prefix_only and any(c != list(range(0, len(c) * group_size, group_size)) for c in chosen):
            continue
        masks = []
        for l, f in enumerate(freqs):
            mask = np.zeros(f.size, bool)
            for pos in chosen[l]:
                mask[orders[l][pos : pos + group_size]] = True
            masks.append(mask)
        counts = [m.sum() for m in masks]
        if sum(counts) > capacity or any(0 < k < c for k, c in zip(counts, c_min)):
            continue
        if objective == "mass":
            best = max(best, sum(f[m].sum() for f, m in zip(freqs, masks)) / total)
        else:
            ffn = sum(
                ref_layer_time(hw, sizes, f[m].sum(), f[~m].sum(), m.sum(), m.size) for f, m in zip(freqs, masks)
            )
            best = min(best, ffn)
    return best


def ref_dense_time(sizes, hw):
    return dense_bytes(sizes) / hw.accel_bandwidth - sizes.embed_bytes / hw.accel_bandwidth


def check_placement(p, freqs, sizes, hw, capacity_neurons):
    """Every constraint and every reported number, recomputed."""
    total = 0
    for l, (acc, cpu) in enumerate(zip(p.accel_ids, p.cpu_ids)):
        assert acc.dtype == np.int32 and cpu.dtype == np.int32
        assert np.all(np.diff(acc) > 0) and np.all(np.diff(cpu) > 0)
        both = np.concatenate([acc, cpu])
        np.testing.assert_array_equal(np.sort(both), np.arange(freqs[l].size))  # each neuron exactly once
        total += acc.size
    assert total <= capacity_neurons
    assert p.memory_used <= p.budget_bytes
    assert p.ffn_accel_bytes == total * NEURON_BYTES
    mass = sum(f[a].sum() for f, a in zip(freqs, p.accel_ids))
    # float64 sums of <= 2600 terms in another order: <= 2600 * 1.1e-16 ~ 3e-13 relative, within 1e-12
    assert p.accel_share == pytest.approx(mass / sum(f.sum() for f in freqs), rel=1e-12)
    layer = [
        ref_layer_time(hw, sizes, f[m].sum(), f[~m].sum(), m.sum(), m.size) for f, m in zip(freqs, p.masks())
    ]
    np.testing.assert_allclose(p.layer_times, layer, rtol=1e-12)  # the same float64 cost model: ~1e-16
    assert p.per_token_time == pytest.approx(ref_dense_time(sizes, hw) + sum(layer), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("objective", ["mass", "latency"])
def test_milp_equals_brute_force(seed, objective):
    rng = np.random.default_rng(seed)
    n_layers, n_neurons, group = (3, 20, 4) if seed % 2 else (4, 16, 4)  # 15 or 16 group binaries
    freqs = random_freqs(rng, n_layers, n_neurons)
    sizes = small_sizes(n_layers, n_neurons)
    fit = int(rng.integers(n_neurons // 2, n_layers * n_neurons * 3 // 4))
    hw = hardware(sizes, fit, sync=float(rng.uniform(1e-6, 6e-6)))
    p = solve_placement(freqs, sizes, hw, objective=objective, group_size=group, mip_gap=0.0)
    expected = brute_force(freqs, sizes, hw, group, objective)
    # HiGHS's objective of a 0/1 incumbent is a float64 sum of <= 16 group terms (~1e-15 relative; measured
    # 3e-16); 1e-9 leaves room for HiGHS's own presolve arithmetic, still far below any other placement's value.
    # The share and time bounds below allow float64 rounding only: 1e-12 of a share <= 1, 1e-15 s of ~1e-5 s.
    if objective == "mass":
        assert p.objective_value == pytest.approx(expected, rel=1e-9)
        assert p.accel_share >= expected - 1e-12  # neuron-level refinement never loses
    else:
        assert p.objective_value == pytest.approx(expected + ref_dense_time(sizes, hw), rel=1e-9)
        assert p.per_token_time <= expected + ref_dense_time(sizes, hw) + 1e-15
    np.testing.assert_array_equal(p.min_neurons, ref_min_neurons(freqs, hw))
    assert p.below_min_layers() == []
    check_placement(p, freqs, sizes, hw, fit)


def test_latency_objective_when_accelerator_is_the_bottleneck():
    """An accelerator slower than the host makes max() pick its first branch; prefixes are the program's space."""
    rng = np.random.default_rng(7)
    freqs = random_freqs(rng, 3, 20)
    sizes = small_sizes(3, 20)
    hw = hardware(sizes, 40, accel_bw=0.5e9, sync=1e-6)
    p = solve_placement(freqs, sizes, hw, objective="latency", group_size=4, mip_gap=0.0)
    expected = brute_force(freqs, sizes, hw, 4, "latency", prefix_only=True)
    assert p.objective_value == pytest.approx(expected + ref_dense_time(sizes, hw), rel=1e-9)  # as in test_milp_...
    masks = p.masks()
    accel_time = [f[m].sum() * NEURON_BYTES / hw.accel_bandwidth for f, m in zip(freqs, masks)]
    assert any(np.isclose(t, a, rtol=1e-12, atol=0) for t, a in zip(p.layer_times, accel_time) if a > 0)  # float64
    check_placement(p, freqs, sizes, hw, 40)


def test_communication_constraint_binds():
    """A large sync cost makes C_l exceed what mass alone would spread into each layer."""
    rng = np.random.default_rng(3)
    freqs = random_freqs(rng, 4, 64)
    sizes = small_sizes(4, 64)
    free = solve_placement(freqs, sizes, hardware(sizes, 60, sync=0.0), group_size=4, mip_gap=0.0)
    hw = hardware(sizes, 60, sync=12e-6)
    bound = solve_placement(freqs, sizes, hw, group_size=4, mip_gap=0.0)
    c_min = ref_min_neurons(freqs, hw)
    counts_free = np.array([a.size for a in free.accel_ids])
    counts_bound = np.array([a.size for a in bound.accel_ids])
    assert np.any((counts_free > 0) & (counts_free < c_min)), "instance too easy: the constraint would not bind"
    assert np.all((counts_bound == 0) | (counts_bound >= c_min))
    assert bound.objective_value < free.objective_value  # binding costs mass
    check_placement(bound, freqs, sizes, hw, 60)


def test_latency_beats_mass_and_baselines_on_the_same_instance():
    freqs = synthetic_frequencies(8, 512, seed=1)
    sizes = small_sizes(8, 512)
    hw = hardware(sizes, 2600, latency=20e-6, sync=40e-6)  # fixed per-layer costs that matter
    runs = {
        name: solve_placement(freqs, sizes, hw, objective=obj, method=method, group_size=32, mip_gap=0.0)
        for name, (method, obj) in {
            "latency": ("milp", "latency"), "mass": ("milp", "mass"),
            "greedy": ("greedy", "mass"), "layers": ("layers", "mass"),
        }.items()
    }
    for name in ("mass", "greedy", "layers"):
        assert runs["latency"].per_token_time <= runs[name].per_token_time
        check_placement(runs[name], freqs, sizes, hw, 2600)
    assert runs["latency"].per_token_time < 0.99 * runs["mass"].per_token_time  # not a tie here
    assert runs["mass"].accel_share >= runs["latency"].accel_share
    check_placement(runs["latency"], freqs, sizes, hw, 2600)


def test_baselines():
    freqs = synthetic_frequencies(4, 100, seed=2)
    sizes = small_sizes(4, 100)
    hw = hardware(sizes, 250)
    greedy = solve_placement(freqs, sizes, hw, method="greedy")
    flat = np.concatenate(freqs)
    threshold = np.sort(flat)[::-1][249]
    assert sum(a.size for a in greedy.accel_ids) == 250
    assert all(np.all(f[a] >= threshold) for f, a in zip(freqs, greedy.accel_ids))
    layers = solve_placement(freqs, sizes, hw, method="layers")
    assert [a.size for a in layers.accel_ids] == [0, 0, 100, 100]  # the last whole layers, like -ngl
    assert greedy.status == layers.status == "heuristic" and greedy.gap is None
    for p in (greedy, layers):
        check_placement(p, freqs, sizes, hw, 250)


@pytest.mark.parametrize("n_neurons, group", [(100, 64), (64, 64), (37, 5), (10, 1), (3, 8)])
def test_grouping_covers_each_neuron_once(n_neurons, group):
    rng = np.random.default_rng(n_neurons)
    freqs = [rng.uniform(size=n_neurons).round(1) for _ in range(3)]  # rounding makes ties
    g = make_groups(freqs, group)
    for l, f in enumerate(freqs):
        ids = np.concatenate([g.order[l][s : s + n] for s, n in zip(g.start[g.layer == l], g.size[g.layer == l])])
        np.testing.assert_array_equal(np.sort(ids), np.arange(n_neurons))  # no split, no duplicate
        assert np.all(np.diff(f[g.order[l]]) <= 0)  # hottest first
        np.testing.assert_allclose(g.mass[g.layer == l],  # float64, default 1e-7
                                   [f[g.order[l][s : s + n]].sum()
                                    for s, n in zip(g.start[g.layer == l], g.size[g.layer == l])])
    assert np.all(g.size <= group) and np.all(g.size > 0)
    every = g.masks(np.ones(len(g), bool))
    assert all(m.all() for m in every)


def test_hottest_first_orders_by_frequency_then_id():
    f = np.array([0.2, 0.9, 0.2, 1.0, 0.0, 0.9])
    order = hottest_first(f)
    assert order.dtype == np.int32
    assert order.tolist() == [3, 1, 5, 0, 2, 4]  # ties (0.9, 0.2) keep increasing ids


def test_infeasible_budget_states_the_minimum():
    sizes = small_sizes(2, 8)
    freqs = [np.full(8, 0.5)] * 2
    minimum = dense_bytes(sizes) - sizes.embed_bytes - sizes.lm_head_bytes
    short = HardwareProfile("tiny", minimum - 1, 1e9, 1e9, 1, 1e9, 0, 0)
    with pytest.raises(InfeasibleBudgetError, match=f"minimum {minimum} B") as err:
        solve_placement(freqs, sizes, short)
    assert err.value.minimum_bytes == minimum
    with pytest.raises(InfeasibleBudgetError, match=f"minimum {dense_bytes(sizes)} B"):
        solve_placement(freqs, sizes, short.replace(accel_memory=dense_bytes(sizes) - 1), dense_policy="strict")


def test_offload_policy_moves_embedding_then_lm_head():
    sizes = small_sizes(2, 8)
    freqs = [np.full(8, 0.5)] * 2
    full = dense_bytes(sizes)
    for memory, moved in [
        (full, ()),
        (full - 1, ("embed",)),
        (full - sizes.embed_bytes - 1, ("embed", "lm_head")),
    ]:
        p = solve_placement(freqs, sizes, HardwareProfile("h", memory, 1e10, 1e9, 1, 1e9, 0, 0))
        assert p.cpu_dense == moved
        assert p.dense_accel_bytes == full - sum(getattr(sizes, f"{m}_bytes") for m in moved)
        assert p.memory_used <= memory


def llama(**kw):
    base = dict(vocab_size=100, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize(
    "cfg",
    [
        llama(),
        llama(tie_embeddings=True, qkv_bias=True, name="qwen2-like"),
        llama(ffn_kind="relu", norm_kind="layernorm", positions="learned", position_offset=2,
              qkv_bias=True, attn_out_bias=True, ffn_bias=True, n_kv_heads=4, name="opt-like"),
        llama(qk_norm=True, head_dim=12, name="qwen3-like"),
        llama(qk_norm=True, qk_norm_whole=True, name="olmoe-like-attention"),
        llama(ffn_kind="geglu", sandwich_norms=True, tie_embeddings=True, name="gemma2-like"),
    ],
)
def test_model_sizes_match_the_tensor_list(cfg):
    """Dense + per-neuron bytes add up to every tensor the config declares."""
    sizes = model_sizes(cfg, weight_bytes=2, vector_bytes=4, context=16, batch=3, kv_bytes=2, predictor_bytes=7)
    total = sum(int(np.prod(s)) * (2 if len(s) == 2 else 4) for s in expected_shapes(cfg).values())
    counted = sizes.ffn_bytes + sizes.required_bytes + sizes.embed_bytes + sizes.lm_head_bytes
    kv = 2 * cfg.n_layers * cfg.kv_dim * 16 * 3 * 2
    assert sizes.kv_cache_bytes == kv
    assert counted - kv - 7 * cfg.n_layers == total
    ffn_tensors = sum(
        int(np.prod(s)) * (2 if len(s) == 2 else 4)
        for name, s in expected_shapes(cfg).items()
        if name.split(".")[-1] in ("w_gate", "w_up", "w_down", "b_up")
    )
    assert sizes.ffn_bytes == ffn_tensors


def test_frequency_validation():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_frequencies([np.array([0.5, 2.0])])
    with pytest.raises(ValueError, match="all zero"):
        check_frequencies([np.zeros(4)])
    sizes = small_sizes(2, 8)
    with pytest.raises(ValueError, match="model has 8"):
        solve_placement([np.full(7, 0.1)] * 2, sizes, hardware(sizes, 4))
    with pytest.raises(ValueError, match="model has 2"):
        solve_placement([np.full(8, 0.1)] * 3, sizes, hardware(sizes, 4))
    with pytest.raises(ValueError, match="objective"):
        solve_placement([np.full(8, 0.1)] * 2, sizes, hardware(sizes, 4), objective="speed")
    with pytest.raises(ValueError, match="ModelSizes"):
        solve_placement([np.full(8, 0.1)] * 2, sizes, hardware(sizes, 4), context=10)


def test_synthetic_frequencies():
    a = synthetic_frequencies(3, 1000, skew=1.2, mean_active=0.1, seed=5)
    b = synthetic_frequencies(3, 1000, skew=1.2, mean_active=0.1, seed=5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
        assert 0.1 * 0.85 - 1e-6 <= x.mean() <= 0.1 * 1.15 + 1e-6  # mean_active +-15%; bisection to ~1e-17
        assert x.min() >= 0 and x.max() == 1.0
    hot = np.sort(a[0])[::-1]
    steeper = np.sort(synthetic_frequencies(1, 1000, skew=2.0, layer_spread=0, seed=5)[0])[::-1]
    flatter = np.sort(synthetic_frequencies(1, 1000, skew=0.5, layer_spread=0, seed=5)[0])[::-1]
    top = lambda f: f[:100].sum() / f.sum()  # noqa: E731
    assert top(flatter) < top(hot) < top(steeper)
