"""bench/hybrid_hops.py (on two simulated CPU devices without a GPU): every variant of the hybrid's per-layer
crossing runs, is timed and is recorded in its markdown and JSON (no timing checked)."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import hybrid_hops  # noqa: E402

from jpinfer.native import native_available


def test_every_variant_is_timed_and_recorded(tmp_path):
    out = tmp_path / "hops.md"
    assert hybrid_hops.main(["--widths", "8", "16", "--layers", "3", "--steps", "2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [run["width"] for run in data["runs"]] == [8, 16]
    names = {"accelerator only", "hybrid hops", "one jit, host callback (numpy)",
             "one jit, host callback (a jitted host call)", "one jit, no host", "accelerator -> host copy",
             "host -> accelerator copy"}
    names |= {"one jit, host callback (a direct native call)"} if native_available() else set()
    for run in data["runs"]:
        assert set(run["per_layer_us"]) == names and all(v > 0 for v in run["per_layer_us"].values())
    text = out.read_text()
    assert "| one jit, host callback (a jitted host call) |" in text and "width 16" in text
