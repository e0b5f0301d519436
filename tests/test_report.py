"""bench/results/REPORT.md is exactly what bench/report.py makes of the results files beside it, so no
figure in it can drift from the file it quotes (regenerate with ``python bench/report.py``)."""

from __future__ import annotations

import pathlib
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
