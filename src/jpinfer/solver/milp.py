"""The placement integer program (cvxpy, solved by HiGHS).

Within a layer the accelerator holds a hottest-first prefix of groups: with equal-sized
groups that maximises mass, and it minimises time while the layer is CPU-bound, which a
split layer is unless the accelerator is slower per byte than the host. The group
decisions x_{l,g} (group g of layer l on the accelerator) are therefore written through
one binary per (layer, prefix length):
    u_{l,k} = 1  <=>  layer l holds exactly its k hottest groups,  sum_k u_{l,k} = 1,
    x_{l,g} = sum_{k > g} u_{l,k},   "layer l uses the accelerator" y_l = 1 - u_{l,0}.
This is the same program as the direct one over x with x_{l,g+1} <= x_{l,g}, in the
per-layer convex hull: its LP relaxation is a multiple-choice knapsack (one row per
layer plus the memory row) instead of tens of thousands of chain rows, whose root LP
alone took over a minute for a 70B shape. Constraints:
    memory:         sum_{l,k} neurons_{l,k} u_{l,k} <= neurons that fit the FFN budget
    communication:  u_{l,k} = 0 for 0 < neurons_{l,k} < C_l  (zero, or at least C_l)
Objective "mass" (the PowerInfer paper's): maximise the accelerator's share of the
activation mass. Objective "latency": minimise sum_l t_l with
t_l = sum_k T_{l,k} u_{l,k}, where T_{l,k} is the cost model of ``latency.py`` for that
prefix, i.e. max(a A, c C + X + S) and its whole-layer / CPU-only cases evaluated per
option, so the max is linearised exactly. Times are in microseconds for the solver.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
import time
import warnings
from typing import Iterator, Literal

import numpy as np
import scipy.sparse as sp

from jpinfer.solver.groups import Groups
from jpinfer.solver.latency import CostModel

Objective = Literal["mass", "latency"]
OBJECTIVES = ("mass", "latency")
_US = 1e6


class SolverError(RuntimeError):
    """HiGHS returned no usable placement."""


@dataclasses.dataclass(frozen=True)
class SolveInfo:
    status: str  # "optimal" or "time_limit" (best placement found, see gap)
    objective_value: float  # share for "mass"; predicted seconds per token for "latency"
    gap: float  # HiGHS relative MIP gap (for "latency": on the FFN part of the time)
    solve_time: float  # wall seconds, building the program included


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null: HiGHS prints a banner from C++ on every solve.

    Anything another thread prints meanwhile is lost too.
    """
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        libc.fflush(None)  # push C stdio buffers into /dev/null, not into the restored fd
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The allowed prefixes, flat over all layers."""

    layer: np.ndarray  # layer of the option
    groups: np.ndarray  # k: number of hottest groups on the accelerator
    neurons: np.ndarray  # neurons in those groups
    mass: np.ndarray  # their activation mass


def _options(groups: Groups, min_neurons: np.ndarray) -> _Options:
    layer, count, neurons, mass = [], [], [], []
    bounds = np.searchsorted(groups.layer, np.arange(groups.n_layers + 1))  # groups are layer-major
    for l in range(groups.n_layers):
        sizes = groups.size[bounds[l] : bounds[l + 1]]
        cum_n = np.concatenate([[0], np.cumsum(sizes)])
        cum_m = np.concatenate([[0.0], np.cumsum(groups.mass[bounds[l] : bounds[l + 1]])])
        k = np.nonzero((cum_n == 0) | (cum_n >= min_neurons[l]))[0]
        layer.append(np.full(k.size, l))
        count.append(k)
        neurons.append(cum_n[k])
        mass.append(cum_m[k])
    return _Options(*(np.concatenate(a) for a in (layer, count, neurons, mass)))


def solve_milp(
    groups: Groups,
    cost: CostModel,
    min_neurons: np.ndarray,
    neuron_capacity: int,
    objective: Objective,
    *,
    time_limit: float,
    mip_gap: float,
) -> tuple[np.ndarray, SolveInfo]:
    """Boolean decision per group (hottest-first prefixes per layer) and how the solve went."""
    import cvxpy as cp

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    if not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap must be in [0, 1), got {mip_gap}")
    start = time.perf_counter()
    opt = _options(groups, min_neurons)
    n_layers = groups.n_layers
    layer_neurons = np.bincount(groups.layer, weights=groups.size, minlength=n_layers)
    layer_mass = np.bincount(groups.layer, weights=groups.mass, minlength=n_layers)
    one_per_layer = sp.csr_matrix((np.ones(opt.layer.size), (opt.layer, np.arange(opt.layer.size))))
    u = cp.Variable(opt.layer.size, boolean=True)
    scale = max(1, neuron_capacity)  # memory row in units of the capacity
    constraints = [one_per_layer @ u == 1, (opt.neurons / scale) @ u <= neuron_capacity / scale]
    if objective == "mass":
        problem = cp.Problem(cp.Maximize((opt.mass / layer_mass.sum()) @ u), constraints)
    else:
        times = cost.layer_times(
            opt.mass, layer_mass[opt.layer] - opt.mass, opt.neurons, layer_neurons[opt.layer]
        )
        problem = cp.Problem(cp.Minimize((_US * times) @ u), constraints)
    with quiet_stdout(), warnings.catch_warnings():
        # cvxpy warns "Solution may be inaccurate" on a time limit; the status says so instead
        warnings.simplefilter("ignore", UserWarning)
        problem.solve(solver=cp.HIGHS, time_limit=float(time_limit), mip_rel_gap=float(mip_gap))
    elapsed = time.perf_counter() - start
    info = problem.solver_stats.extra_stats
    if u.value is None or info is None or info.primal_solution_status != 2:
        raise SolverError(
            f"HiGHS found no placement (status {problem.status}) within time_limit={time_limit}s; "
            "raise time_limit or group_size"
        )
    status = {"optimal": "optimal", "user_limit": "time_limit"}.get(problem.status, problem.status)
    value = problem.value if objective == "mass" else problem.value / _US + cost.dense_time
    prefix = np.zeros(n_layers, np.int64)
    chosen_options = u.value > 0.5
    prefix[opt.layer[chosen_options]] = opt.groups[chosen_options]
    bounds = np.searchsorted(groups.layer, np.arange(n_layers))
    chosen = (np.arange(len(groups)) - bounds[groups.layer]) < prefix[groups.layer]
    return chosen, SolveInfo(status, float(value), float(info.mip_gap), elapsed)
