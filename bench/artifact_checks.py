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

import numpy as np
import xxhash

from jpinfer.bench.protocol import interleaved_rounds, machine, machine_line
from jpinfer.bench.results import command_line, publish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="also write the table here (markdown)")
    args = ap.parse_args()

    data = np.random.default_rng(0).integers(0, 256, 512 << 20, dtype=np.uint8)
    # the copy goes into memory touched once here: a new array each call timed the VM's page faults as well
    # (0.24 GB/s on the 2-core EPYC, 2026-12-04), not the memory's bandwidth
    target = np.ones_like(data)
    digests = {
        "xxh3_128 (jpinfer's file digest)": lambda: xxhash.xxh3_128(data).hexdigest(),
        "blake2b-128 (hashlib)": lambda: hashlib.blake2b(data, digest_size=16).hexdigest(),
        "sha256 (hashlib)": lambda: hashlib.sha256(data).hexdigest(),
        "a copy of the buffer into memory already touched (memory bandwidth)": lambda: np.copyto(target, data),
    }
    lines = ["| what | GB/s |", "|---|---|"]
    measured_digests = interleaved_rounds({name: (lambda r, fn=fn: fn()) for name, fn in digests.items()},
                                          args.repeats)
    for name in digests:
        lines.append(f"| {name} | {data.nbytes / min(measured_digests.seconds(name)) / 1e9:.2f} |")

    with tempfile.TemporaryDirectory() as cache:
        os.environ["JPINFER_CACHE"] = cache
        from jpinfer import artifacts
        from jpinfer.models import default_model, loading

        path = default_model.default_model_path()
        loading.load_model(path)  # fills the cache
        (entry,) = (pathlib.Path(cache) / "gguf").iterdir()
        files = json.loads((entry / loading.CACHE_MANIFEST).read_text())["files"]
        size = sum(record["size"] for record in files.values())
        measured = interleaved_rounds({"check": lambda r: artifacts.check_files(entry, files),
                                       "load": lambda r: loading.load_model(path)}, args.repeats,
                                      warm={"check": lambda: None, "load": lambda: None})  # loaded once above
        check, load = measured.seconds("check"), measured.seconds("load")
    lines += [
        "",
        "| default model, cache entry of " + f"{size / 2**20:.0f} MiB | median s | min s |",
        "|---|---|---|",
        f"| check of the entry (sizes, xxh3-128 of every file) | {statistics.median(check):.3f} | {min(check):.3f} |",
        f"| whole cached load_model (check included) | {statistics.median(load):.3f} | {min(load):.3f} |",
    ]
    m = machine()
    publish(f"# Artifact checks\n\n{command_line('python ' + ' '.join(sys.argv))}\n\n{machine_line(m)}\n\n"
            f"Every measurement: {args.repeats} interleaved rounds (jpinfer.bench.protocol), after one untimed "
            "call.\n\n" + "\n".join(lines) + "\n", args.out,
            {"machine": m, "digest_seconds": {name: measured_digests.seconds(name) for name in digests},
             "check_seconds": check, "load_seconds": load, "bytes": int(data.nbytes), "cache_entry_bytes": size})


if __name__ == "__main__":
    main()
