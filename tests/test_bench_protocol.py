"""jpinfer.bench.protocol: the agreement measures on hand-made sequences, the interleaved rounds on fake
engines and a fake clock (medians of same-round ratios against a brute-force computation), the machine line."""

import datetime
import itertools
import os
import statistics

import pytest

from jpinfer.bench import protocol
from jpinfer.bench.protocol import (
    interleaved_rounds,
    machine,
    machine_line,
    matching_prefix,
    median_ratio,
    pooled_positions_agreement,
    positions_agreement,
    prefix_agreement,
    rotation,
)


@pytest.mark.parametrize("a, b, prefix, positions", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 1.0, 1.0),
    ([1, 2, 3, 4], [1, 9, 3, 4], 0.25, 0.75),  # one difference, then realigned: prefix stops, positions go on
    ([9, 2, 3, 4], [1, 2, 3, 4], 0.0, 0.75),
    ([1, 2, 3, 9], [1, 2, 3, 4], 0.75, 0.75),
    ([5, 6, 7, 8], [1, 2, 3, 4], 0.0, 0.0),
    ([1, 2, 3], [1, 2, 3, 4], 1.0, 1.0),  # over the shorter length
    ([1, 2, 9, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8], 0.25, 0.25),
    ([], [], 1.0, 1.0),
])
def test_agreement_measures(a, b, prefix, positions):
    assert prefix_agreement(a, b) == pytest.approx(prefix)
    assert positions_agreement(a, b) == pytest.approx(positions)
    assert prefix_agreement(b, a) == pytest.approx(prefix)  # both are symmetric
    assert matching_prefix(a, b) == round(prefix * min(len(a), len(b)))


def test_prefix_never_exceeds_positions():
    for a in itertools.product([0, 1], repeat=4):
        for b in itertools.product([0, 1], repeat=4):
            assert prefix_agreement(a, b) <= positions_agreement(a, b)


def test_pooled_positions_weighs_every_position():
    outs, refs = [[1, 2, 3, 4], [7, 8]], [[1, 0, 3, 4], [0, 0]]
    assert pooled_positions_agreement(outs, refs) == pytest.approx(3 / 6)  # not the mean of 0.75 and 0.0
    assert statistics.mean(map(positions_agreement, outs, refs)) == pytest.approx(0.375)


def test_labels_name_the_measure():
    assert protocol.AGREEMENT_LABELS[prefix_agreement] == "greedy agreement (prefix)"
    assert protocol.AGREEMENT_LABELS[positions_agreement] == "greedy agreement (positions)"


class FakeClock:
    """A clock that engines advance by their own (made-up) durations."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_engines(clock, durations):
    """name -> call(r) that takes durations[name][r] fake seconds and records its call."""
    calls = []

    def engine(name):
        def call(r):
            calls.append((name, r))
            clock.now += durations[name][r]
            return {"tok_s": 10 / durations[name][r]}
        return call
    return {name: engine(name) for name in durations}, calls


DURATIONS = {  # three engines, five rounds; round 2 is a loaded round that slows all of them
    "dense": [1.0, 1.1, 3.0, 0.9, 1.0],
    "sparse": [0.5, 0.6, 1.2, 0.5, 0.7],
    "hybrid": [0.8, 0.7, 2.9, 0.6, 0.9],
}


def test_rounds_medians_of_same_round_ratios_against_brute_force():
    clock = FakeClock()
    engines, calls = fake_engines(clock, DURATIONS)
    got = interleaved_rounds(engines, 5, clock=clock)
    # warm-up: each engine once with round 0, before any timed run, then 5 rounds of all three
    assert calls[:3] == [("dense", 0), ("sparse", 0), ("hybrid", 0)]
    assert len(calls) == 3 + 15
    assert len(got.rounds) == 5
    for name, d in DURATIONS.items():
        assert got.seconds(name) == pytest.approx(d)
        assert got.median(name) == pytest.approx(statistics.median(d))
        rate = lambda res: res["tok_s"]
        brute = statistics.median([(10 / d[r]) / (10 / DURATIONS["dense"][r]) for r in range(5)])
        assert got.median_ratio(name, "dense", rate) == pytest.approx(brute)
        assert got.median_ratio(name, "dense") == pytest.approx(
            statistics.median([d[r] / DURATIONS["dense"][r] for r in range(5)]))
        assert median_ratio(got.values(name, rate), got.values("dense", rate)) == pytest.approx(brute)
    # a median of same-round ratios is not the ratio of medians (the loaded round shows it)
    ratio_of_medians = statistics.median(DURATIONS["sparse"]) / statistics.median(DURATIONS["dense"])
    assert got.median_ratio("sparse", "dense") != pytest.approx(ratio_of_medians)


def test_rounds_rotate_the_order():
    clock = FakeClock()
    engines, calls = fake_engines(clock, DURATIONS)
    got = interleaved_rounds(engines, 4, clock=clock)
    names = list(DURATIONS)
    for r in range(4):
        assert got.order(r) == rotation(names, r) == names[r % 3:] + names[:r % 3]
        assert [n for n, rr in calls[3:] if rr == r] == rotation(names, r)
    fixed = interleaved_rounds(fake_engines(FakeClock(), DURATIONS)[0], 3, rotate=False, clock=FakeClock())
    assert all(fixed.order(r) == names for r in range(3))


def test_rounds_warm_stop_and_errors():
    clock = FakeClock()
    engines, calls = fake_engines(clock, DURATIONS)
    warmed = []
    got = interleaved_rounds(engines, 5, warm={"dense": lambda: warmed.append("dense")},
                             before_round=lambda r, so_far: r < 2, clock=clock)
    assert warmed == ["dense"] and calls[:2] == [("sparse", 0), ("hybrid", 0)]
    assert len(got.rounds) == 2

    def broken(r):
        if r == 1:
            raise RuntimeError("out of memory")
        return {"tok_s": 1.0}
    errors = []
    got = interleaved_rounds({"dense": lambda r: {"tok_s": 2.0}, "broken": broken}, 3,
                             on_error=lambda name, err: errors.append(name))
    assert errors == ["broken"] and isinstance(got.errors["broken"], RuntimeError)
    assert len(got.results("dense")) == 3 and len(got.results("broken")) == 1
    assert got.ratios("broken", "dense", lambda res: res["tok_s"]) == [0.5]  # only the rounds both ran
    with pytest.raises(RuntimeError):
        interleaved_rounds({"broken": broken}, 3)


def test_median_ratio_needs_round_pairs():
    assert median_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0
    with pytest.raises(ValueError):
        median_ratio([1.0], [1.0, 2.0])


def test_fastest_takes_the_fastest_call_of_each():
    clock = FakeClock()
    steps = {"a": itertools.cycle([0.3, 0.1, 0.2]), "b": itertools.cycle([0.05, 0.5])}

    def call(name):
        def f():
            clock.now += next(steps[name])
            return 0
        return f
    assert protocol.fastest([call("a"), call("b")], rounds=2, per_round=3, clock=clock) == pytest.approx([0.1, 0.05])


def test_machine_fields(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.234, 0.5, 0.25))
    m = machine(load_before=[3.0, 2.0, 1.0])
    assert set(m) == {"cpu", "cores", "load_before", "load_after", "jax", "backend", "device", "date"}
    assert m["cores"] == os.cpu_count() and m["cpu"]
    assert m["load_before"] == [3.0, 2.0, 1.0] and m["load_after"] == [1.23, 0.5, 0.25]
    import jax

    assert m["jax"] == jax.__version__ and m["backend"] == jax.devices()[0].platform
    date = datetime.datetime.fromisoformat(m["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 60
    line = machine_line(m)
    for part in (m["cpu"], f"{m['cores']} cores", "3.00/2.00 before", "1.23/0.50 after", f"jax {m['jax']}", m["date"]):
        assert part in line


def test_cpu_name_from_cpuinfo_else_platform(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Fake CPU @ 3.0GHz\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert protocol.cpu_name() == "Fake CPU @ 3.0GHz"
    # a VM's masked name: the family and model numbers tell two processors of one name apart
    info.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
                    "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: Other\n")
    assert protocol.cpu_name() == "AMD EPYC (family 26, model 2)"

    def missing(path, *a, **k):
        raise OSError("no /proc")
    monkeypatch.setattr("builtins.open", missing)
    monkeypatch.setattr(protocol.platform, "processor", lambda: "fallback-cpu")
    assert protocol.cpu_name() == "fallback-cpu"


class FakeEngine:
    """A BenchEngine whose runs return made-up RunStats: ``speed`` tok/s, tokens from a fixed list."""

    def __init__(self, name, speed, tokens):
        self.name, self.speed, self.tokens, self.warmed = name, speed, tokens, []

    def warm(self, n_prompt, max_new_tokens):
        self.warmed.append(n_prompt)

    def run(self, prompt_ids, max_new_tokens):
        from jpinfer.bench.engines import RunStats

        return RunStats(len(prompt_ids), self.tokens[:max_new_tokens], 0.01 * len(prompt_ids),
                        [1 / self.speed] * (max_new_tokens - 1))


def test_speed_rounds_over_prompts(capsys):
    from jpinfer.bench.engines import decode_tok_s, e2e_tok_s, prefill_tok_s, speed_rounds

    engines = {"dense": FakeEngine("dense", 10.0, [1, 2, 3, 4]), "sparse": FakeEngine("sparse", 25.0, [1, 2, 9, 4])}
    prompts = [[0] * 8, [0] * 16, [0] * 8]
    measured, loads = speed_rounds(engines, prompts, 4, rounds=3)
    assert engines["dense"].warmed == [8, 16]  # once per prompt length, before the rounds
    assert len(loads) == 3 and len(measured.rounds) == 3
    assert [len(r) for r in measured.results("sparse")] == [3, 3, 3]  # every prompt, every round
    assert measured.median("sparse", decode_tok_s) == pytest.approx(25.0)
    assert measured.median_ratio("sparse", "dense", decode_tok_s) == pytest.approx(2.5)
    first = measured.results("dense")[0]
    assert prefill_tok_s(first) == pytest.approx(100.0)
    assert e2e_tok_s(first) == pytest.approx(12 / (0.32 + 3 * 0.3))
    sparse_tokens = [s.tokens for s in measured.results("sparse")[0]]
    assert pooled_positions_agreement(sparse_tokens, [s.tokens for s in first]) == pytest.approx(0.75)
    assert "round 3" in capsys.readouterr().out


def test_no_script_imports_another():
    """bench/*.py are thin entry points: what two of them share lives in jpinfer.bench."""
    import ast
    import pathlib

    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    scripts = {p.stem for p in bench.glob("*.py")}
    for path in bench.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in scripts | {"bench"}, f"{path.name} imports {name}"
        assert "sys.path" not in path.read_text(), f"{path.name} changes sys.path"
        assert "spec_from_file_location" not in path.read_text(), f"{path.name} loads a file as a module"


SCORED_WINDOW_OPTIONS = ("--test-windows", "--ppl-windows", "--attribution-windows")


def test_every_perplexity_figure_uses_the_protocol_windows():
    """Every option that sets how many WikiText-2 test windows a figure is scored on (the bench's
    --ppl-windows, the scripts' --test-windows, quantized.py's --attribution-windows) defaults to
    protocol.TEST_WINDOWS, and only accuracy.wikitext_windows reads the test text: no two results files
    quote one setting on other text."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    defaults = {}
    for path in [*(root / "bench").glob("*.py"), *(root / "src" / "jpinfer" / "bench").glob("*.py")]:
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in SCORED_WINDOW_OPTIONS):
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                defaults[path.name, node.args[0].value] = None if default is None else ast.unparse(default)
        if path.name != "accuracy.py":
            assert "wikitext2-test" not in text and "WIKITEXT2_TEST" not in text, f"{path.name} reads the test text"
    assert {name for name, _ in defaults} >= {"compare.py", "threshold.py", "modes.py", "predictors.py",
                                              "sparsity_ppl.py", "accuracy_curves.py", "model_wide.py", "quantized.py"}
    assert ("quantized.py", "--attribution-windows") in defaults
    assert {key: d for key, d in defaults.items() if d != "TEST_WINDOWS"} == {}
