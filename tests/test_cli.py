"""Command line: clean errors for bad input; real generation on the default model (slow)."""

import subprocess
import sys

import pytest

from jpinfer.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "no such checkpoint"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_generate_prints_a_continuation():
    out = subprocess.run(
        [sys.executable, "-m", "jpinfer", "generate", "What is the capital of France?", "--chat",
         "--max-new-tokens", "12", "--stats"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    assert "Paris" in out.stdout
    assert "tok/s" in out.stderr
