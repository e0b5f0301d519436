"""What verifying jpinfer's files costs: digest throughput, and the default model's cached load
with and without the check of its cache entry.

Every load of a GGUF from the cache checks the size and xxh3-128 digest of every file of its
entry (``jpinfer.artifacts``). This measures, in one process: the throughput of xxh3-128 and
of the hashlib digests it was chosen over on a 512 MiB buffer in memory; the check of the
default model's entry (517 MiB, page cache warm) alone; and a whole cached ``load_model``.
The cache is a temporary directory (the first load fills it), so nothing of yours is touched.

    python bench/artifact_checks.py --out bench/results/artifact_checks.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import xxhash


def seconds(fn, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="also write the table here (markdown)")
    args = ap.parse_args()

    data = np.random.default_rng(0).integers(0, 256, 512 << 20, dtype=np.uint8)
    digests = {
        "xxh3_128 (jpinfer's file digest)": lambda: xxhash.xxh3_128(data).hexdigest(),
        "blake2b-128 (hashlib)": lambda: hashlib.blake2b(data, digest_size=16).hexdigest(),
        "sha256 (hashlib)": lambda: hashlib.sha256(data).hexdigest(),
        "a copy of the buffer (memory bandwidth)": lambda: data.copy(),
    }
    lines = ["| what | GB/s |", "|---|---|"]
    for name, fn in digests.items():
        lines.append(f"| {name} | {data.nbytes / min(seconds(fn, args.repeats)) / 1e9:.2f} |")

    with tempfile.TemporaryDirectory() as cache:
        os.environ["JPINFER_CACHE"] = cache
        from jpinfer import artifacts
        from jpinfer.models import default_model, loading

        path = default_model.default_model_path()
        loading.load_model(path)  # fills the cache
        (entry,) = (pathlib.Path(cache) / "gguf").iterdir()
        files = json.loads((entry / loading.CACHE_MANIFEST).read_text())["files"]
        size = sum(record["size"] for record in files.values())
        check = seconds(lambda: artifacts.check_files(entry, files), args.repeats)
        load = seconds(lambda: loading.load_model(path), args.repeats)
    lines += [
        "",
        "| default model, cache entry of " + f"{size / 2**20:.0f} MiB | median s | min s |",
        "|---|---|---|",
        f"| check of the entry (sizes, xxh3-128 of every file) | {statistics.median(check):.3f} | {min(check):.3f} |",
        f"| whole cached load_model (check included) | {statistics.median(load):.3f} | {min(load):.3f} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"# Artifact checks\n\n`python {' '.join(sys.argv)}` "
                            f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)\n\n{text}\n")


if __name__ == "__main__":
    main()
