"""bench/results/REPORT.md is exactly what bench/report.py makes of the results files beside it, so no
figure in it can drift from the file it quotes (regenerate with ``python bench/report.py``)."""

from __future__ import annotations

import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # the report script

import report  # noqa: E402


def test_the_committed_report_is_the_generators_output():
    committed = (report.RESULTS / "REPORT.md").read_text()
    assert report.render() == committed, "REPORT.md is stale: run python bench/report.py"


def test_a_changed_result_changes_the_report(tmp_path, monkeypatch):
    """The check above can fail: the report quotes the results files, so editing one changes it."""
    for path in report.RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    quantized = tmp_path / "quantized.json"
    assert quantized.is_file()
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    before = report.render()
    quantized.unlink()
    assert report.render() != before


def options(command: str) -> tuple[str, dict[str, tuple[str, ...]]]:
    """A command as (program, {option: values}), leaving out where it writes (--out, --out-dir, --json), the
    progress switch and the environment: what decides the figures a run records."""
    words = shlex.split(command.strip("`").replace("PYTHONPATH=src ", "").replace("jpinfer bench", "python -m "
                                                                                                "jpinfer.bench"))
    program, opts, key = [], {}, None
    for w in words:
        if w.startswith("--"):
            key = w
            opts.setdefault(key, ())
        elif key is None:
            program.append(w)
        else:
            opts[key] += (w,)
    for dropped in ("--out", "--out-dir", "--json", "--no-progress"):
        opts.pop(dropped, None)
    return " ".join(program), opts


def test_each_command_shown_reproduces_its_file():
    """The report's command for a result is the one its file records (other --points or --rounds would make
    another file); only where it writes may differ."""
    checked = 0
    for name, command in report.COMMANDS.items():
        recorded = report.recorded(name).command
        if recorded is None:
            continue
        assert options(command) == options(recorded), name
        checked += 1
    assert checked >= 15
    assert options("python bench/q.py --rounds 5 --out a.md") != options("python bench/q.py --rounds 3")


def test_same_machine_runs_copies_the_section_and_nothing_else(tmp_path, monkeypatch):
    """The runs section of a results file reaches the report whole and ends at the next section; a file without
    it, or no file, gives no lines (the report then shows the one run its tables copy)."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    assert report.same_machine_runs("absent") == []
    (tmp_path / "plain.md").write_text("# A run\n\n## Per prompt length\n\n| a |\n")
    assert report.same_machine_runs("plain") == []
    (tmp_path / "runs.md").write_text(f"# A run\n\n{report.RUNS_HEADING}\n\n| run | x dense |\n|---|---|\n"
                                      "| 1 | 1.27x |\n| 2 | 1.43x |\n\n## Next section\n\nnot copied\n")
    lines = report.same_machine_runs("runs")
    assert lines[2:-1] == ["| run | x dense |", "|---|---|", "| 1 | 1.27x |", "| 2 | 1.43x |"]
    assert "(runs.md#runs-recorded-on-this-machine)" in lines[0] and "not copied" not in "\n".join(lines)


def test_the_report_shows_the_main_benchs_recorded_runs():
    """REPORT.md carries every line of bench.md's runs section, so its median and range sit beside the run."""
    section = (report.RESULTS / "bench.md").read_text().split(report.RUNS_HEADING + "\n", 1)[1]
    body = [line for line in section.split("\n## ")[0].splitlines() if line.strip()]
    assert body
    committed = (report.RESULTS / "REPORT.md").read_text()
    assert all(line in committed for line in body)
