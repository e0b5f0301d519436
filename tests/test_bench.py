"""The main job end to end on a tiny GGUF model: `jpinfer prepare` writes a pack, `jpinfer bench` runs every
mode from it (a smoke test of the protocol and its numbers' bookkeeping, not a timing)."""

import json

import numpy as np
import pytest

import jpinfer
from jpinfer.bench.accuracy import wikitext_windows
from jpinfer.bench.compare import recorded_command, report
from jpinfer.bench.prompts import sample_prompts
from jpinfer.cli import main
from jpinfer.ffn import evaluate
from jpinfer.modes import MODE_NAMES
from jpinfer.pack import STAGES, Pack

from gguf_fixtures import random_tensors, tiny_config, write_gguf

ROUNDS, NEW, LENGTHS, LONG = 2, 5, (4, 16), 40


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny llama GGUF and its pack made by the CLI, with a cache of their own."""
    root = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JPINFER_CACHE", str(root / "cache"))
        cfg = tiny_config()
        model = write_gguf(root / "tiny.gguf", cfg, random_tensors(cfg))
        pack = root / "pack"
        argv = ["prepare", "--model", str(model), "--out", str(pack), "--n-tokens", "2048", "--calibration-tokens",
                "256", "--window", "64", "--samples", "512", "--rank", "4", "--epochs", "2", "--gpu-budget", "0.95",
                "--context", "64", "--no-progress"]
        yield model, pack, argv


def test_prepare_writes_a_pack_and_says_what_ran(env, capsys):
    model, pack, argv = env
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"stages run: {', '.join(STAGES)}" in out and str(pack) in out
    assert Pack.load(pack, jpinfer.load_model(model)).settings.n_tokens == 2048
    assert main(argv) == 0
    assert "stages run: none (all reused)" in capsys.readouterr().out


def test_load_with_a_pack_takes_its_artifacts(env):
    """jpinfer.load(source, pack=DIR): the hybrid's accelerator part is the pack's placement (not solved again),
    the threshold mode applies the pack's thresholds, and another model's pack is refused."""
    model, pack_dir, argv = env
    if not (pack_dir / "pack.json").exists():
        assert main(argv) == 0
    pack = Pack.load(pack_dir)
    hybrid = jpinfer.load(model, mode="hybrid", pack=pack_dir)
    for part, mask in zip(hybrid.ffn.state, pack.placement.masks()):
        np.testing.assert_array_equal(np.asarray(part.hot_ids), np.flatnonzero(mask))
    threshold = jpinfer.load(model, mode="threshold", pack=pack_dir)
    for state, expected in zip(threshold.ffn.state, pack.thresholds.activation):
        assert float(state.ffn.activation_threshold) == float(expected)
    cfg = tiny_config()
    other = write_gguf(pack_dir.parent / "other.gguf", cfg, random_tensors(cfg, seed=1))
    with pytest.raises(jpinfer.ArtifactError, match="prepared for model"):
        jpinfer.load(other, mode="sparse", pack=pack_dir)


@pytest.mark.slow  # heavy: a second pack; test_pack.py's test_a_quantized_model_gets_a_pack_of_its_own[int4] covers it
def test_prepare_weights_int4_makes_a_pack_of_the_int4_model(env, tmp_path, capsys):
    """jpinfer prepare --weights int4: the pack of the model loaded as int4 (its own fingerprint), which the
    int4 threshold mode reads and the float model is refused, the message naming the format that differs."""
    model, _, argv = env
    out = tmp_path / "int4"
    argv = [str(out) if previous == "--out" else arg for previous, arg in zip([None, *argv], argv)]
    assert main([*argv, "--weights", "int4"]) == 0
    assert f"--mode sparse|hybrid|threshold --weights int4 --pack {out}" in capsys.readouterr().out
    assert Pack.load(out).weights == "int4"
    engine = jpinfer.load(model, weights="int4", mode="threshold", pack=out)
    assert len(engine.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True).token_ids) == 3
    with pytest.raises(jpinfer.ArtifactError, match="weights format int4 there, float here: make one for this "
                                                    f"model \\(jpinfer prepare --model {model}\\)"):
        jpinfer.load(model, mode="threshold", pack=out)


@pytest.mark.slow  # the heaviest test; test_bench_child.py's peer-segfault test runs `jpinfer bench` end to end
def test_bench_runs_every_mode_from_the_pack(env, tmp_path, capsys):
    model, pack, argv = env
    if not (pack / "pack.json").exists():
        assert main(argv) == 0
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", "--model", str(model), "--pack", str(pack), "--lengths", *map(str, LENGTHS),
                 "--long-prompt", str(LONG), "--max-new-tokens", str(NEW), "--rounds", str(ROUNDS), "--ppl-windows",
                 "2", "--no-peers", "--json", str(out_json), "--out", str(out_md), "--no-progress"]) == 0
    results = json.loads(out_json.read_text())
    names = [row["engine"] for row in results["engines"]]
    assert names == [f"jpinfer {mode} float32" for mode in MODE_NAMES]
    lengths = [*LENGTHS, LONG]
    assert len(results["runs"]) == ROUNDS * len(lengths) * len(names)
    tokenizer = jpinfer.load_model(model).tokenizer
    prompts = sample_prompts(tokenizer, lengths, ROUNDS, seed=0)
    for run in results["runs"]:
        assert run["n_prompt"] == run["length"] and len(run["tokens"]) == NEW  # fixed-length outputs
        assert len(run["step_s"]) == NEW - 1 and run["prefill_s"] > 0
    for length in lengths:
        assert all(len(p) == length for p in prompts[length])
    dense, *others = results["engines"]
    assert dense["decode_vs_dense"] == 1.0 and dense["greedy_agreement"] == 1.0 and dense["ppl_vs_dense"] == 1.0
    # the dense perplexity is the dense model's on the first windows of WikiText-2 test: the same float32
    # forward on the same weights, compiled twice, so only the summation order of the mean log-likelihood
    # may differ (~1e-7 relative on any CPU; 1e-6 leaves a decade)
    windows = wikitext_windows(tokenizer, 2, window=tiny_config().max_position)
    assert dense["perplexity"] == pytest.approx(evaluate(jpinfer.load_model(model), windows)[0], rel=1e-6)
    for row in others:
        assert row["decode_tok_s"] > 0 and np.isfinite(row["perplexity"]) and 0 <= row["greedy_agreement"] <= 1
    sparse = others[0]
    assert 0 < sparse["neurons"] <= tiny_config().d_ff and sparse["clipped"] >= 0
    assert {row["length"] for row in results["per_length"]} == set(lengths)
    text = out_md.read_text()
    assert "| engine | decode tok/s |" in text and "## Per prompt length" in text
    # the agreement it reports is named, and the machine line comes from jpinfer.bench.protocol
    assert "| greedy agreement (prefix) |" in text and results["protocol"]["greedy_agreement"] == "prefix"
    assert "Machine: " in text and {"cpu", "cores", "load_before", "load_after"} <= set(results["machine"])
    assert text.strip() in capsys.readouterr().out
    results["protocol"]["ppl_windows"] = 0  # a run without accuracy says so, not "perplexity over 0 windows"
    assert "Accuracy: no perplexity (--ppl-windows 0); neurons" in report(results)


def test_prompts_have_exact_lengths_and_follow_the_seed():
    from profiler_fixtures import CharTokenizer

    tokenizer = CharTokenizer()
    a = sample_prompts(tokenizer, [8, 300], 3, seed=1)
    assert [len(p) for p in a[8]] == [8, 8, 8] and [len(p) for p in a[300]] == [300] * 3
    assert len({tuple(p) for p in a[8]}) == 3  # a new text each round
    assert sample_prompts(tokenizer, [300], 3, seed=1)[300] == a[300]  # independent of the other lengths
    assert sample_prompts(tokenizer, [8], 3, seed=2)[8] != a[8]
    with pytest.raises(ValueError, match=">= 1 token"):
        sample_prompts(tokenizer, [0], 1)


def test_no_progress_silences_the_libraries_bars_in_spawned_children(monkeypatch):
    """--no-progress: a child spawned after it (the bench's peers run in such children) gets tqdm bars
    that are disabled, the way transformers' GGUF conversion creates them (plain tqdm), and hub bars off."""
    import subprocess
    import sys

    from jpinfer.bench import compare

    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):  # absent now, and again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    probe = ("from tqdm.auto import tqdm; import huggingface_hub.utils as h; "
             "print(tqdm(range(3)).disable, h.are_progress_bars_disabled())")
    before = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    compare.quiet_library_progress()
    after = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert before == ["False", "False"] and after == ["True", "True"]


def test_no_progress_reaches_the_default_pack_build(monkeypatch):
    """--no-progress: building the default model's pack (profiling, predictor training) shows no bars either;
    without it, it does."""
    import argparse
    import types

    import jpinfer.api
    import jpinfer.pack
    from jpinfer.bench import compare

    built = []
    monkeypatch.setattr(jpinfer.api, "load", lambda *a, **k: types.SimpleNamespace(model="the default model"))
    monkeypatch.setattr(jpinfer.pack, "default_pack", lambda model, progress: built.append((model, progress)))
    for progress in (False, True):
        args = argparse.Namespace(pack=None, weights=["float"], predictors=None, profile=None, model=None,
                                  dtypes=["float32"], progress=progress)
        compare._packs(args, ["dense", "sparse"])
    assert built == [("the default model", False), ("the default model", True)]


@pytest.mark.parametrize("argv, environ, command", [
    (["jpinfer", "bench", "--modes", "dense"], {"HOME": "/root"}, "jpinfer bench --modes dense"),
    (["/src/jpinfer/bench/__main__.py", "--no-peers"], {}, "jpinfer bench --no-peers"),
    (["jpinfer", "bench"], {"JPINFER_NATIVE": "0", "JPINFER_CACHE": "/tmp/c"}, "JPINFER_NATIVE=0 jpinfer bench"),
    (["jpinfer", "bench"], {"JPINFER_NATIVE_LIBRARY": "/tmp/a b.so"},
     "JPINFER_NATIVE_LIBRARY='/tmp/a b.so' jpinfer bench"),
])
def test_recorded_command_carries_the_settings_that_change_the_run(argv, environ, command):
    assert recorded_command(argv, environ) == command

