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
