"""bench/results is indexed and every figure has a file: INDEX.md is what bench/index.py makes of the files now,
every results markdown names its machine, date and command, every results path cited anywhere exists, and each
figure in a README table row that links a results file is in that file (its text or its JSON)."""

from __future__ import annotations

import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # the index script

import index  # noqa: E402

from jpinfer.bench.results import Header, read_header  # noqa: E402

ROOT = index.ROOT
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:x\b| tok/s\b)")
RESULTS_LINK = re.compile(r"\]\((bench/results/[^)#\s]+)(?:#[^)]*)?\)")


def headerless(results: pathlib.Path) -> list[str]:
    """The results markdowns (the generated two aside) whose header lacks a machine, a date or a command."""
    out = []
    for path in sorted(results.rglob("*.md")):
        if path.relative_to(results).as_posix() in index.GENERATED:
            continue
        h = read_header(path.read_text())
        out += [f"{path.relative_to(results)}: no {k}" for k in ("machine", "date", "command") if not getattr(h, k)]
        if h.machine and not (" cores" in h.machine and re.search(r"family \d+|NVIDIA|not recorded", h.machine)):
            out.append(f"{path.relative_to(results)}: machine without its cores and CPU family / GPU: {h.machine}")
    return out


def missing_citations(files: list[pathlib.Path]) -> list[str]:
    """'file: path' for each results path a file cites that does not exist."""
    return [f"{f}: {p}" for f in files for p in sorted(index.cited(f)) if not (ROOT / p).exists()]


def numbers_in(path: pathlib.Path) -> str:
    """A results file's text and, beside it, its JSON's numbers (as written and rounded to 1-3 places)."""
    text = path.read_text() if path.suffix == ".md" else ""
    data = path.with_suffix(".json")
    if data.is_file():
        values: list[float] = []

        def walk(v: object) -> None:
            if isinstance(v, bool):
                return
            if isinstance(v, (int, float)):
                values.append(float(v))
            elif isinstance(v, dict):
                for w in v.values():
                    walk(w)
            elif isinstance(v, list):
                for w in v:
                    walk(w)

        walk(json.loads(data.read_text()))
        text += "\n" + " ".join(f"{v:.{d}f}" for v in values for d in (0, 1, 2, 3))
    return text


def unbacked_figures(row: str) -> list[str]:
    """The figures (``1.27x``, ``44.9 tok/s``) of one markdown table row that none of its linked results files
    holds; a row without a results link has none to check."""
    linked = [ROOT / m.group(1) for m in RESULTS_LINK.finditer(row)]
    if not linked:
        return []
    texts = [numbers_in(p) for p in linked if p.is_file()]
    out = []
    for m in FIGURE.finditer(re.sub(r"\]\([^)]*\)", "]", row)):  # not the digits of a link's path
        number = re.compile(rf"(?<![\d.]){re.escape(m.group(1))}(?![\d])")
        if not any(number.search(t) for t in texts):
            out.append(m.group(0))
    return out


def test_the_committed_index_is_the_generators_output():
    committed = (index.RESULTS / "INDEX.md").read_text()
    assert index.render() == committed, "INDEX.md is stale: run python bench/index.py"


def test_the_index_follows_the_files(tmp_path, monkeypatch):
    """The drift check can fail: a new results file, its header and who cites it change the index."""
    results = tmp_path / "bench" / "results"
    (results / "experiments").mkdir(parents=True)
    (tmp_path / "README.md").write_text("See [probe](bench/results/experiments/probe.md).\n")
    monkeypatch.setattr(index, "RESULTS", results)
    monkeypatch.setattr(index, "ROOT", tmp_path)
    before = index.render()
    (results / "experiments" / "probe.md").write_text(
        "# A probe\n\nMachine: AMD EPYC (family 25, model 17), 2 cores; 2026-12-07.\n\nCommand: `python probe.py`\n")
    after = index.render()
    assert after != before
    row = next(line for line in after.splitlines() if "experiments/probe.md" in line)
    assert "family 25, model 17" in row and "2026-12-07" in row and "python probe.py" in row and "`README.md`" in row


def test_every_results_markdown_names_machine_date_and_command(tmp_path):
    assert headerless(index.RESULTS) == []
    (tmp_path / "bare.md").write_text("# A record\n\nMachine: a 2-core VM.\n")
    assert headerless(tmp_path) == ["bare.md: no date", "bare.md: no command",
                                    "bare.md: machine without its cores and CPU family / GPU: a 2-core VM"]


def test_the_header_forms():
    h = read_header("# T\n\nCommand: `python x.py --out y`. Machine: AMD EPYC (family 26, model 2), 2 cores; load "
                     "average (1/5 min) 1.0/1.0 before, 1.0/1.0 after; jax 0.10.2 on cpu; 2026-12-04T21:26:16+00:00.\n")
    assert h == Header("AMD EPYC (family 26, model 2), 2 cores", "2026-12-04", "`python x.py --out y`")
    h = read_header("# T\n\n- Machine: Intel(R) Xeon(R) Processor, 16 cores; jax 0.11.2 on gpu (NVIDIA H200); "
                     "2026-12-04T11:53:10+00:00.\n- command: `python -m jpinfer.bench gpu`\n")
    assert h == Header("NVIDIA H200 (host: Intel(R) Xeon(R) Processor, 16 cores)", "2026-12-04",
                       "`python -m jpinfer.bench gpu`")
    assert read_header("# T\n\nno header\n") == Header(None, None, None)


def test_every_cited_results_path_exists(tmp_path):
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(index.RESULTS.rglob("*.md")),
             *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]
    missing = missing_citations([f for f in files if f.is_file()])
    assert missing == [], "\n".join(str(m).replace(str(ROOT) + "/", "") for m in missing)
    stale = tmp_path / "stale.py"
    stale.write_text("# measured in bench/results/no_such_file.md, see bench/results/bench.md\n")
    assert missing_citations([stale]) == [f"{stale}: bench/results/no_such_file.md"]


def test_readme_table_figures_are_in_the_files_they_link():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    unbacked = {row[:80]: figs for row in rows if (figs := unbacked_figures(row))}
    assert unbacked == {}, f"README table figures not in the results file the row links: {unbacked}"


def test_a_figure_missing_from_its_file_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run.md").write_text("| threshold | 44.9 | 1.27x |\n")
    (tmp_path / "bench" / "results" / "run.json").write_text('{"x_dense": 0.9712}')
    row = "| threshold | 44.9 tok/s, 1.27x, 0.97x dense, 1.43x peer ([run](bench/results/run.md#speed)) |"
    assert unbacked_figures(row) == ["1.43x"]
    assert unbacked_figures("| no link | 9.99x |") == []
