"""Placement solver: saved results, the CLI, the HiGHS banner, hardware profiles."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from jpinfer.cli import main as cli_main
from jpinfer.solver import (
    PRESETS,
    HardwareProfile,
    Placement,
    PlacementError,
    PlacementVersionError,
    measure_hardware,
    preset,
    solve_placement,
    synthetic_frequencies,
)
from jpinfer.solver.memory import model_sizes
from jpinfer.solver.result import JSON_NAME
from jpinfer.solver.shapes import SHAPES

SMALL_CFG = dataclasses.replace(SHAPES["llama2-7b"], n_layers=4, d_ff=256)
SMALL = ["place", "--shape", "llama2-7b", "--layers", "4", "--d-ff", "256", "--context", "64", "--hardware", "rtx4090"]


def small_budget_gib() -> float:
    """Accelerator memory that holds the dense part of SMALL and about half its neurons."""
    sizes = model_sizes(SMALL_CFG, context=64)
    dense = sizes.required_bytes + sizes.embed_bytes + sizes.lm_head_bytes
    return (dense + sizes.ffn_bytes / 2 + PRESETS["rtx4090"].reserved) / 2**30


@pytest.fixture(scope="module")
def placement() -> Placement:
    freqs = synthetic_frequencies(SMALL_CFG.n_layers, SMALL_CFG.d_ff, seed=3)
    hw = preset("rtx2080ti").replace(accel_memory=small_budget_gib() * 2**30)
    return solve_placement(freqs, SMALL_CFG, hw, objective="latency", context=64, mip_gap=1e-3)


def test_save_load_round_trip(placement, tmp_path):
    placement.save(tmp_path / "p")
    back = Placement.load(tmp_path / "p")
    for a, b in zip(placement.accel_ids + placement.cpu_ids, back.accel_ids + back.cpu_ids):
        assert b.dtype == np.int32
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(placement.layer_times, back.layer_times)
    np.testing.assert_array_equal(placement.min_neurons, back.min_neurons)
    assert back.summary() == placement.summary()
    assert back.hardware == placement.hardware
    assert HardwareProfile.from_dict(back.hardware) == preset("rtx2080ti").replace(
        accel_memory=small_budget_gib() * 2**30
    )


def test_load_rejects_another_version(placement, tmp_path):
    placement.save(tmp_path)
    meta = json.loads((tmp_path / JSON_NAME).read_text())
    meta["format_version"] = 999
    (tmp_path / JSON_NAME).write_text(json.dumps(meta))
    with pytest.raises(PlacementVersionError, match="format version 999"):
        Placement.load(tmp_path)
    with pytest.raises(PlacementError, match="placement.json is missing"):
        Placement.load(tmp_path / "missing")


def test_highs_banner_does_not_reach_stdout():
    """HiGHS prints its banner once per process, so both checks run in fresh processes."""
    control = subprocess.run(
        [sys.executable, "-c", "import highspy; highspy.Highs()"], capture_output=True, text=True, check=True
    )
    if "HiGHS" not in control.stdout:
        pytest.skip("this HiGHS prints no banner, so there is nothing to suppress")
    budget = f"{small_budget_gib():.6f}"
    run = subprocess.run(
        [sys.executable, "-m", "jpinfer", *SMALL, "--budget-gib", budget, "--json", "--runs", "mass,latency"],
        capture_output=True, text=True, check=True,
    )
    assert "HiGHS" not in run.stdout + run.stderr
    assert [json.loads(line)["run"] for line in run.stdout.splitlines()] == ["mass", "latency"]


def test_cli_table_json_and_save(capfd, tmp_path):
    budget = f"{small_budget_gib():.6f}"
    assert cli_main(SMALL + ["--budget-gib", budget, "--save", str(tmp_path)]) == 0
    table = capfd.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "share", "ms/token"]
    assert [line.split()[0] for line in table[1:]] == ["mass", "latency", "greedy", "layers"]
    assert cli_main(SMALL + ["--budget-gib", budget, "--json", "--runs", "latency,greedy"]) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines()]  # nothing but JSON
    assert [r["run"] for r in rows] == ["latency", "greedy"]
    assert 0 < rows[0]["accel_share"] < 1 and rows[0]["per_token_time_ms"] <= rows[1]["per_token_time_ms"]
    saved = Placement.load(tmp_path / "latency")
    # JSON keeps float64 exactly (repr round-trips): equal, within approx's default 1e-6
    assert saved.summary()["accel_share"] == pytest.approx(rows[0]["accel_share"])


def test_cli_frequency_file_and_errors(capfd, tmp_path):
    freqs = np.stack(synthetic_frequencies(4, 256, skew=2.0, seed=9))
    np.save(tmp_path / "f.npy", freqs)
    budget = f"{small_budget_gib():.6f}"
    assert cli_main(SMALL + ["--budget-gib", budget, "--freq", str(tmp_path / "f.npy"), "--json",
                             "--runs", "mass"]) == 0
    row = json.loads(capfd.readouterr().out)
    hw = preset("rtx4090").replace(accel_memory=float(budget) * 2**30)
    direct = solve_placement(list(freqs), SMALL_CFG, hw, context=64)
    assert row["accel_share"] == pytest.approx(direct.accel_share)  # the same float64 solve: equal (default 1e-6)
    assert cli_main(SMALL + ["--budget-gib", "1.2"]) == 3
    err = capfd.readouterr().err
    assert "minimum" in err and "GiB" in err
    assert cli_main(SMALL + ["--runs", "fastest"]) == 2
    assert "unknown run" in capfd.readouterr().err
    assert cli_main(SMALL + ["--set", "warp_factor=9"]) == 2
    assert "unknown hardware field" in capfd.readouterr().err


def test_hardware_profiles():
    for name, p in PRESETS.items():
        assert preset(name) is p and 0 < p.budget < p.accel_memory
    with pytest.raises(ValueError, match="rtx4090"):
        preset("rtx9090")
    with pytest.raises(ValueError, match="cpu_bandwidth"):
        preset("h200").replace(cpu_bandwidth=0)
    with pytest.raises(ValueError, match="reserved"):
        preset("h200").replace(reserved=2 * preset("h200").accel_memory)
    assert preset("rtx4090").replace(accel_memory=10 * 2**30).budget == 9 * 2**30


def test_measure_hardware_on_this_machine():
    import jax

    base = preset("rtx2080ti")
    p = measure_hardware(base, array_mib=16)
    assert {"cpu_bandwidth", "cpu_threads"} <= set(p.measured)
    assert 1e8 < p.cpu_bandwidth < 1e13 and p.cpu_threads >= 1  # plausible: 100 MB/s to 10 TB/s
    if jax.devices()[0].platform == "cpu":  # nothing else to measure: the rest is the preset's
        assert set(p.measured) == {"cpu_bandwidth", "cpu_threads"}
        assert (p.accel_memory, p.link_bandwidth, p.sync_cost) == (base.accel_memory, base.link_bandwidth,
                                                                   base.sync_cost)
    else:
        assert {"accel_bandwidth", "link_bandwidth", "link_latency", "sync_cost"} <= set(p.measured)


def test_measure_hardware_between_two_simulated_devices():
    """The hybrid engine's two CPU devices: the link and the sync are measured between them."""
    import jax

    accel, host = jax.devices("cpu")[:2]
    base = preset("rtx2080ti")
    p = measure_hardware(base, array_mib=16, devices=(accel, host))
    assert {"accel_bandwidth", "link_bandwidth", "link_latency", "sync_cost"} <= set(p.measured)
    assert 1e8 < p.link_bandwidth < 1e13 and 0 < p.link_latency < 0.1 and 0 < p.sync_cost < 0.1
    assert p.accel_memory == base.accel_memory  # a CPU device reports no memory limit
