"""bench/kernel_efficiency.py's data handling: the GPU table's rows into efficiency series, the CPU repeats into
medians, and its figure and GPU section with and without a recorded GPU run (no timing here)."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import kernel_efficiency  # noqa: E402

# chain_kernels' JSON layout (run_chain's data): tables of (shape, tokens, rows); dense first at s = 0, a failed
# variant with an error and no timing; the sparsities here deliberately out of order.
GPU_TABLE = {
    "device": "NVIDIA H200", "jax": "0.11.2", "layers": 32, "dtype": "bfloat16", "copy_bandwidth": 4.0e12,
    "tables": [
        {"shape": "7B (Llama-2)", "tokens": 1, "rows": [
            {"s": 0.0, "k": 11008, "tokens": 1, "op": "dense", "ms": 3.1, "speedup": 1.0, "efficiency": 1.0,
             "gbs": 2900.0, "copy_share": 0.87},
            {"s": 0.9, "k": 1101, "tokens": 1, "op": "pallas split", "ms": 0.9, "speedup": 3.44,
             "efficiency": 0.344, "gbs": 900.0, "copy_share": 0.25},
            {"s": 0.9, "k": 1101, "tokens": 1, "op": "pallas fused",
             "error": "LoweringError: not supported"},
            {"s": 0.5, "k": 5504, "tokens": 1, "op": "pallas split", "ms": 2.0, "speedup": 1.55,
             "efficiency": 0.775, "gbs": 2000.0, "copy_share": 0.6},
            {"s": 0.5, "k": 5504, "tokens": 1, "op": "pallas fused", "ms": 2.2, "speedup": 1.41,
             "efficiency": 0.705, "gbs": 1800.0, "copy_share": 0.55},
        ]},
        {"shape": "7B (Llama-2)", "tokens": 4, "rows": [
            {"s": 0.0, "k": 11008, "tokens": 4, "op": "dense", "ms": 3.2, "speedup": 1.0, "efficiency": 1.0,
             "gbs": 2800.0, "copy_share": 0.85},
            {"s": 0.5, "k": 5504, "tokens": 4, "op": "pallas split", "ms": 2.4, "speedup": 1.33,
             "efficiency": 0.665, "gbs": 1700.0, "copy_share": 0.5},
        ]},
    ],
}


def test_gpu_series_one_curve_per_shape_tokens_and_variant_sorted_by_sparsity_without_dense():
    series = kernel_efficiency.gpu_series(GPU_TABLE)
    assert [(sr["shape"], sr["tokens"], sr["variant"]) for sr in series] == [
        ("7B (Llama-2)", 1, "pallas split"), ("7B (Llama-2)", 1, "pallas fused"), ("7B (Llama-2)", 4, "pallas split")]
    assert series[0]["points"] == [(0.5, 0.775), (0.9, 0.344)]
    assert series[1]["points"] == [(0.5, 0.705), (0.9, None)]  # failed there: no efficiency, still a point
    assert series[2]["points"] == [(0.5, 0.665)]


def test_load_gpu_reads_a_recorded_table_and_says_when_there_is_none(tmp_path):
    path = tmp_path / "gpu_kernels.json"
    assert kernel_efficiency.load_gpu(path) is None
    path.write_text(json.dumps(GPU_TABLE))
    gpu = kernel_efficiency.load_gpu(path)
    assert (gpu["device"], gpu["dtype"], gpu["layers"]) == ("NVIDIA H200", "bfloat16", 32)
    assert gpu["series"] == kernel_efficiency.gpu_series(GPU_TABLE)
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not an accelerator table"):
        kernel_efficiency.load_gpu(path)


def test_gpu_section_lists_every_variant_and_names_the_command_when_not_measured(tmp_path):
    text = "\n".join(kernel_efficiency.gpu_markdown(None, tmp_path / "gpu_suite.md"))
    assert "not measured yet" in text and kernel_efficiency.GPU_COMMAND in text
    (tmp_path / "gpu_suite.md").write_text("# GPU suite")  # the suite measured the kernels on a GPU: said so
    text = "\n".join(kernel_efficiency.gpu_markdown(None, tmp_path / "gpu_suite.md"))
    assert "not measured" not in text and "bench/results/gpu_suite.md" in text and kernel_efficiency.GPU_COMMAND in text
    gpu = dict(source="bench/results/gpu_kernels.json", device="NVIDIA H200", dtype="bfloat16", layers=32,
               jax="0.11.2", series=kernel_efficiency.gpu_series(GPU_TABLE))
    lines = kernel_efficiency.gpu_markdown(gpu)
    assert "| 7B (Llama-2) | 1 | pallas fused | 0.70 | failed |" in lines
    assert "| 7B (Llama-2) | 4 | pallas split | 0.67 |  |" in lines  # not run at 0.9: an empty cell
    assert any("bench/results/gpu_kernels.json" in line for line in lines)


def test_cpu_summary_takes_medians_of_the_repeats_same_run_ratios():
    rows = [dict(shape=shape, layers=layers, s=s, k=k, dense_ms=d * layers, sparse_ms=sp, speedup=d * layers / sp,
                 efficiency=d * layers / sp * (1 - s), repeat=r)
            for r, (d, sp) in enumerate([(10.0, 8.0), (20.0, 10.0), (12.0, 12.0)])
            for shape, s, k in [("A", 0.5, 50), ("B", 0.9, 10)] for layers in (1, 2)]
    a, a_chained, b, b_chained = kernel_efficiency.cpu_summary(rows)
    assert (a["shape"], a["layers"], a["s"], a["k"], a["repeats"]) == ("A", 1, 0.5, 50, 3)
    assert a["efficiency"] == pytest.approx(0.625) and a["efficiency_min"] == pytest.approx(0.5)
    assert a["efficiency_max"] == pytest.approx(1.0) and a["dense_ms"] == 12.0 and a["sparse_ms"] == 10.0
    assert b["efficiency"] == pytest.approx(0.125)
    # a chain's rows are their own group, never pooled with the lone calls' of the same shape and sparsity
    assert (a_chained["shape"], a_chained["layers"], a_chained["repeats"]) == ("A", 2, 3)
    assert a_chained["efficiency"] == pytest.approx(1.25) and b_chained["layers"] == 2


def test_figure_is_drawn_with_and_without_a_gpu_run(tmp_path):
    pytest.importorskip("matplotlib")
    cpu = [dict(shape="A", layers=layers, s=s, efficiency=e, efficiency_min=e - 0.1, efficiency_max=e + 0.1)
           for s, e in [(0.5, 0.6), (0.9, 0.4)] for layers in (1, 26)]
    gpu = dict(source="x.json", device="NVIDIA H200", dtype="bfloat16", layers=32, jax="0.11.2",
               series=kernel_efficiency.gpu_series(GPU_TABLE))
    for name, recorded in [("none.png", None), ("gpu.png", gpu)]:
        kernel_efficiency.figure(cpu, recorded, tmp_path / name, "CPU")
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
