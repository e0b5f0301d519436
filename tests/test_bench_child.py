"""Peers in processes of their own: a crash, hang or error there is reported as that engine's failure,
and the bench goes on without it."""

from __future__ import annotations

import json
import os

import pytest

from jpinfer.bench import llama_cpp
from jpinfer.bench.child import ChildEngine, EngineFailed
from jpinfer.cli import main

import fake_peers
from gguf_fixtures import random_tensors, tiny_config, write_gguf


def test_a_child_engine_answers_like_the_engine_in_another_process():
    engine = ChildEngine(fake_peers.FakePeer, "model.gguf")
    try:
        assert engine.name == "fake peer model.gguf" and engine.weight_bytes_per_token == 123
        assert engine.call("process_id") != os.getpid()
        stats = engine.run([1, 2, 3], 4)
        assert (stats.n_prompt, stats.tokens, len(stats.step_s)) == (3, [3, 2, 1, 3], 3)
        assert engine.perplexity([[1], [2]]) == 3.5  # forwarded because the engine has one
    finally:
        engine.close()


@pytest.mark.parametrize("how, message", [("segfault", "killed by SIGSEGV"), ("exit", "exited with status 3")])
def test_a_dead_child_is_that_engines_failure(how, message):
    engine = ChildEngine(fake_peers.FakePeer, "model.gguf", how=how)
    with pytest.raises(EngineFailed, match=f"fake peer model.gguf: its process died \\({message}\\)"):
        engine.run([1], 2)
    with pytest.raises(EngineFailed, match="died"):  # and stays failed
        engine.run([1], 2)


def test_an_error_in_the_child_is_reported_and_the_child_answers_on():
    engine = ChildEngine(fake_peers.FakePeer, "model.gguf", how="raise")
    try:
        with pytest.raises(EngineFailed, match="ValueError: bad prompt"):
            engine.run([1], 2)
        assert engine.call("process_id") > 0
    finally:
        engine.close()


def test_a_hanging_child_is_killed_after_the_timeout():
    engine = ChildEngine(fake_peers.FakePeer, "model.gguf", how="hang")
    engine.timeout_s = 3  # after the start, which may take longer on a loaded machine (imports)
    with pytest.raises(EngineFailed, match="no answer within 3 s"):
        engine.run([1], 2)


def test_a_peer_that_cannot_load_fails_at_construction():
    with pytest.raises(EngineFailed, match="OSError: cannot open model.gguf"):
        ChildEngine(fake_peers.FakePeer, "model.gguf", how="fail to load")


def test_a_peer_whose_weight_repacking_crashes_is_run_without_it(monkeypatch, capsys):
    monkeypatch.setattr(llama_cpp, "LlamaCppEngine", fake_peers.RepackingCrashPeer)  # the child imports it anew
    engine = llama_cpp.peer_engine("model.gguf")
    try:
        assert engine.name == "fake peer model.gguf without repacking"
        assert engine.run([1, 2], 2).tokens == [2, 1]
    finally:
        engine.close()
    assert "killed by SIGSEGV); trying again without llama.cpp's weight repacking" in capsys.readouterr().err


def test_a_peer_gets_the_context_it_is_asked_for(monkeypatch):
    """The bench sizes llama.cpp's context to its longest prompt and output (a 4096-token prompt did not fit
    the default 2048); the retry without repacking keeps it."""
    monkeypatch.setattr(llama_cpp, "LlamaCppEngine", fake_peers.RepackingCrashPeer)
    engine = llama_cpp.peer_engine("model.gguf", n_ctx=4160)
    try:
        assert engine.call("context") == 4160
    finally:
        engine.close()


def test_the_bench_goes_on_when_a_peer_segfaults(tmp_path, monkeypatch, capsys):
    """llama.cpp's float32 copy 'segfaults' in its first timed run: the bench reports it and finishes with
    dense and the other peer, whose perplexity comes from its own process."""
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config()
    model = write_gguf(tmp_path / "tiny.gguf", cfg, random_tensors(cfg))
    monkeypatch.setattr(llama_cpp, "LlamaCppEngine", fake_peers.FakePeer)
    monkeypatch.setattr(llama_cpp, "float32_gguf", lambda source: source.with_suffix(fake_peers.CRASH_SUFFIX))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(model), "--modes", "dense", "--lengths", "4", "--long-prompt", "0",
                 "--max-new-tokens", "3", "--rounds", "2", "--ppl-windows", "1", "--peers", "llama.cpp",
                 "--json", str(out), "--no-progress"]) == 0
    results = json.loads(out.read_text())
    assert [row["engine"] for row in results["engines"]] == ["jpinfer dense float32", "fake peer tiny.gguf"]
    assert results["engines"][1]["perplexity"] == 2.5  # FakePeer.perplexity of one window
    (failure,) = results["failures"]
    assert failure["engine"] == "fake peer tiny.crash" and "killed by SIGSEGV" in failure["error"]
    assert "dropping fake peer tiny.crash: its process died (killed by SIGSEGV)" in capsys.readouterr().err
    assert {run["engine"] for run in results["runs"]} == {"jpinfer dense float32", "fake peer tiny.gguf"}
