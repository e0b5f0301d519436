"""The README's main command on a fresh clone, timed: first run (install, pack, bench), then a second.

Clones the repository's committed HEAD into a temporary directory, and runs ``make bench`` there
twice with an empty cache directory of its own (``JPINFER_CACHE``), reading the output as it comes:
when each run reached the pack (install done), when the pack was ready (its five stages, or all
reused), when the benchmark began (the engines loaded; each compiles, untimed, before its first
prompt of each length), and when the run ended. The clone, its virtual
environment and the cache are removed afterwards.

    python bench/first_run.py --out bench/results/first_run.md
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from jpinfer.bench.protocol import load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish

MARKS = {  # first output line matching -> event
    "pack": re.compile(r"default model's pack"),
    "pack ready": re.compile(r"^loading jpinfer dense"),
    "benchmarking": re.compile(r"benchmarking:"),
    "table": re.compile(r"^\| engine \| decode tok/s"),
}


def timed_run(command: list[str], cwd: pathlib.Path, env: dict[str, str], log: pathlib.Path) -> dict:
    """Seconds from the start to each event of ``MARKS`` and to the end; the output goes to ``log``."""
    start = time.perf_counter()
    seen: dict[str, float] = {}
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc, open(log, "w") as out:
        for line in proc.stdout:
            out.write(line)
            for part in line.split("\r"):
                for name, pattern in MARKS.items():
                    if name not in seen and pattern.search(part):
                        seen[name] = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed with status {proc.returncode}; output in {log}")
    return seen | {"end": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file (JSON beside it)")
    ap.add_argument("--keep", action="store_true", help="keep the clone, its logs and its cache")
    args = ap.parse_args()
    load_before = load_average()
    repo = pathlib.Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    work = pathlib.Path(tempfile.mkdtemp(prefix="jpinfer-first-run-"))
    clone, cache = work / "jpinfer", work / "cache"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "JPINFER_CACHE")}
    env |= {"JPINFER_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    runs = []
    for i in (1, 2):
        print(f"run {i}: make bench in {clone} ...", file=sys.stderr, flush=True)
        runs.append(timed_run(["make", "bench"], clone, env, work / f"run{i}.log"))
        print(f"run {i}: {runs[-1]}", file=sys.stderr, flush=True)
    after = machine(load_before)
    fmt = lambda run, key: "-" if key not in run else f"{run[key] / 60:.1f} min ({run[key]:.0f} s)"
    lines = [
        "# The main command on a fresh clone: first and second run", "",
        (command_line(f"python bench/first_run.py {' '.join(sys.argv[1:])}")
         + f" (commit {head}). {machine_line(after)} "
        "Both runs: `make bench` in one fresh "
        "clone whose cache directory starts empty (the first run installs `.venv`, loads the default model, "
        "prepares its pack and benches; the second reuses all of it). Times from the start of `make bench`."), "",
        ("| run | install done, pack begins | pack ready (first engine loads) | benchmark begins | table printed "
        "(end) |"), "|---|---|---|---|---|",
    ]
    for i, run in enumerate(runs, 1):
        lines.append(f"| {i} | {fmt(run, 'pack')} | {fmt(run, 'pack ready')} | {fmt(run, 'benchmarking')} | "
                     f"{fmt(run, 'end')} |")
    publish("\n".join(lines) + "\n", args.out, {"commit": head, "date": after["date"], "runs": runs,
                                                  "load_after": after["load_after"], "machine": after})
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=True)


if __name__ == "__main__":
    main()
