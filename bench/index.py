"""bench/results/INDEX.md from the files under bench/results and the files that cite them (nothing else).

Every results file is listed in its group (current claims, other machines, experiments) with what its header
says (machine, date, command) and which files cite it, so a reader can tell which file is the current claim
and where a figure came from. The header is read in the one form the scripts write
(``jpinfer.bench.results.read_header``).

    python bench/index.py
"""

from __future__ import annotations

import os
import pathlib
import re

from jpinfer.bench.results import markdown_table as table
from jpinfer.bench.results import read_header

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
GENERATED = ("REPORT.md", "INDEX.md")

LAYOUT = (
    "Layout. `bench/results/<name>.{md,json,png}` is the current claim of one script or one configured run, "
    "named by what it measures: one file set per claim, from the claim's reference machine, which is the most "
    "recent run of the current code on a machine whose RAM, not its cache, feeds the weights and where llama.cpp "
    "repacks its weights: the 2-core AMD Zen 4 VM (family 25, model 17) wherever it has a run, otherwise the only "
    "machine that ran it (the machine column says which). `bench/results/machines/<machine>/<name>.*` holds runs "
    "of the same script on other machines (`xeon`: the 2-core Intel Xeon VM, family 6 model 167, whose 480 MiB L3 "
    "holds the default model's weights and where llama.cpp's repacking crashed; `zen3`, `zen4`, `zen5`: 2-core AMD "
    "EPYC VMs of family 25 model 1, family 25 model 17, family 26 model 2; `h200`: an NVIDIA H200 host). "
    "`bench/results/experiments/<name>.md` holds one-off experiment records that no script regenerates. "
    "`REPORT.md` (`python bench/report.py`) and this file (`python bench/index.py`) are generated from the others. "
    "Each `.md` names its machine, date and command in its header; a file that keeps several runs names the "
    "machine and date of each in its section.")

GROUPS = (("current", "Current claims (`bench/results/<name>`)"),
          ("machines", "Other machines (`bench/results/machines/<machine>/<name>`)"),
          ("experiments", "Experiments (`bench/results/experiments/<name>`, no script regenerates them)"),
          ("generated", "Generated"))

_CITED = re.compile(r"(--out(?:-dir)? |--json |default: )?(bench/results/[\w./-]*[\w/])")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def group(path: pathlib.Path) -> str:
    """Which part of the layout a file under ``RESULTS`` belongs to."""
    rel = path.relative_to(RESULTS)
    if rel.parts[0] in ("machines", "experiments"):
        return rel.parts[0]
    return "generated" if rel.as_posix() in GENERATED else "current"


def file_sets() -> dict[pathlib.Path, list[pathlib.Path]]:
    """The files under ``RESULTS`` by file set (a run's markdown, JSON and figure share a name), this index
    included before it is written."""
    files = {p for p in RESULTS.rglob("*") if p.is_file()} | {RESULTS / "INDEX.md"}
    sets: dict[pathlib.Path, list[pathlib.Path]] = {}
    for p in sorted(files):
        sets.setdefault(p.with_suffix(""), []).append(p)
    return sets


def citing_files() -> list[pathlib.Path]:
    """The files whose mentions of results files count (INDEX.md itself excluded)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("*.md")),
             *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "src").rglob("*.h")),
             *sorted((ROOT / "src").rglob("*.cc")), *sorted((ROOT / "bench").glob("*.py"))]
    return [f for f in files if f.is_file() and f != RESULTS / "INDEX.md"]


def cited(path: pathlib.Path) -> set[str]:
    """Repository paths of results files a file mentions: ``bench/results/...`` anywhere, and, in a markdown
    file, its links (relative to the file). A path without a suffix stands for its ``.md``; the results folder
    itself and a path a command writes or defaults to (after ``--out``, ``--out-dir``, ``--json``, ``default:``)
    are no citations: they name where a file goes, not a file a figure comes from."""
    text = path.read_text(errors="replace")
    found = {m.group(2).rstrip(".") for m in _CITED.finditer(text) if not m.group(1)}
    if path.suffix == ".md":
        for m in _LINK.finditer(text):
            target = os.path.normpath(os.path.join(path.parent.relative_to(ROOT), m.group(1)))
            if target.startswith("bench/results/"):
                found.add(target)
    out = set()
    for p in found:
        if (ROOT / p).is_dir() or p.endswith("/"):
            continue
        out.add(p if pathlib.PurePath(p).suffix or (ROOT / p).exists() else p + ".md")
    return out


def citations() -> dict[str, list[str]]:
    """Each cited results path: the files that cite it."""
    by: dict[str, list[str]] = {}
    for f in citing_files():
        rel = f.relative_to(ROOT).as_posix()
        for p in cited(f):
            if p != rel:
                by.setdefault(p, []).append(rel)
    return by


def render() -> str:
    """INDEX.md's text."""
    by = citations()
    lines = ["# bench/results: index", "",
             "Generated by `python bench/index.py` from the files under `bench/results/` and the files that cite "
             "them (README.md, docs/, the results files, src/, bench/*.py); regenerate it after adding, "
             "moving or citing a results file. One row per file set (a run's markdown, JSON and figure).", "",
             LAYOUT, ""]
    sets = file_sets()
    cell = lambda v: (v or "not recorded").replace("|", "/")
    for key, title in GROUPS:
        rows = []
        for stem, files in sets.items():
            if group(files[0]) != key:
                continue
            md = stem.with_suffix(".md")
            h = read_header(md.read_text()) if md in files and key != "generated" else None
            names = [f.relative_to(RESULTS).as_posix() for f in files]
            citers = sorted({c for f in files for c in by.get(f.relative_to(ROOT).as_posix(), [])}
                            - {f.relative_to(ROOT).as_posix() for f in files})
            rows.append([", ".join(f"[`{n}`]({n})" for n in names), cell(h.machine) if h else "-",
                         cell(h.date) if h else "-", cell(h.command) if h else "-",
                         ", ".join(f"`{c}`" for c in citers) or "nothing"])
        lines += [f"## {title}", ""]
        lines += table(["files", "machine", "date", "command", "cited by"], rows) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    (RESULTS / "INDEX.md").write_text(render())
    print(RESULTS / "INDEX.md")


if __name__ == "__main__":
    main()
