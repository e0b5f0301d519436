"""bench/modelled_speed.py's measured-against-modelled rows: a recorded GPU suite run's fixed-list decode turned into
(measured, modelled, error), checked against the cost model worked out by hand (no solving, no GPU)."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

from modelled_speed import LLAMA2_7B, Comparison, device_preset, gpu_decode_comparisons, measured_section  # noqa: E402

H200_BANDWIDTH = 4800e9  # the h200 preset's bytes/s

# the GPU suite's fixed_list data on one H200: Llama-2-7B shapes in bfloat16, 64 new tokens
RECORD = {
    "device": "NVIDIA H200", "model": LLAMA2_7B.name, "dtype": "bfloat16", "new_tokens": 64,
    "speeds": {"dense": [199.0, 200.0, 201.0], "sparse s=0.9 (K=1101)": [400.0, 400.0, 401.0]},
    "median": {"dense": 200.0, "sparse s=0.9 (K=1101)": 400.0},
}


def hand_seconds(active: int) -> float:
    """One 7B bf16 step all on the GPU, computing ``active`` neurons per layer, by hand: its attention reads 128
    cache slots (16 prompt + 64 new positions: the first rung of the attention lengths)."""
    attention = 32 * (4 * 4096 * 4096 * 2 + 2 * 4096 * 2)  # q, k, v, o and two norm scales per layer
    final_norm = 4096 * 2
    kv_cache = 2 * 32 * 4096 * 128 * 2  # keys and values, 32 layers, 128 positions
    head = 32000 * 4096 * 2
    ffn = 32 * active * 3 * 4096 * 2  # gate row, up row, down column per neuron
    return (attention + final_norm + kv_cache + head + ffn) / H200_BANDWIDTH


def test_error_is_relative_to_the_measured_time():
    row = Comparison("x", "y", measured_tok_s=250.0, modelled_s=0.005)
    assert row.measured_ms == pytest.approx(4.0)
    assert row.modelled_ms == pytest.approx(5.0)
    assert row.error == pytest.approx(0.25)  # (5 - 4) / 4
    assert Comparison("x", "y", 200.0, 0.004).error == pytest.approx(-0.2)  # (4 - 5) / 5


def test_gpu_decode_record_against_the_cost_model_by_hand():
    rows, note = gpu_decode_comparisons(RECORD)
    assert "h200 preset" in note and "128 cache slots" in note
    dense, sparse = rows
    assert dense.modelled_s == pytest.approx(hand_seconds(11008), rel=1e-9)
    assert sparse.modelled_s == pytest.approx(hand_seconds(1101), rel=1e-9)
    assert dense.modelled_s == pytest.approx(2.76704e-3, rel=1e-5)  # 13281796096 bytes at 4.8 TB/s
    assert dense.measured_ms == pytest.approx(5.0)
    assert dense.error == pytest.approx(2.76704e-3 * 200.0 - 1, rel=1e-5)  # -44.7%: the model is optimistic
    assert sparse.error == pytest.approx(hand_seconds(1101) * 400.0 - 1, rel=1e-9)


def test_devices_without_a_preset_are_not_compared():
    assert device_preset("NVIDIA A100 80GB PCIe") == "a100-80gb"
    assert device_preset("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert device_preset("NVIDIA A100-SXM4-40GB") is None  # another bandwidth than the preset's
    assert device_preset("NVIDIA GeForce RTX 4090") == "rtx4090"
    rows, note = gpu_decode_comparisons(RECORD | {"device": "cpu"})
    assert rows == [] and "no preset" in note


def test_measured_section_with_and_without_a_record(tmp_path):
    lines, data = measured_section(tmp_path)
    assert data == [] and any("No GPU run is recorded" in line for line in lines)
    (tmp_path / "gpu_suite.json").write_text(json.dumps({"suite": "gpu"}))  # a run whose fixed-list part was skipped
    lines, data = measured_section(tmp_path)
    assert data == [] and any("holds no fixed-list decode" in line for line in lines)
    (tmp_path / "gpu_suite.json").write_text(json.dumps({"suite": "gpu", "fixed_list": RECORD}))
    lines, data = measured_section(tmp_path)
    assert [round(d["error"], 3) for d in data] == [round(hand_seconds(11008) * 200 - 1, 3),
                                                    round(hand_seconds(1101) * 400 - 1, 3)]
    assert any(line.startswith("| Llama-2-7B shapes") and "-44.7%" in line for line in lines)
