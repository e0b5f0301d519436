"""The ``jpinfer`` command (also ``python -m jpinfer``): one parser, one subcommand per job.

Each subcommand is a module of ``jpinfer.commands`` (the benches': of ``jpinfer.bench``) named in
``COMMANDS``, with ``add_arguments(parser, command)`` and ``run(args) -> int``, so no stage holds a CLI and
no import goes back up the dependency order. Only the invoked subcommand's module is
imported, so one command does not pay for another's imports (cvxpy, PyTorch). Problems with the user's input
(``jpinfer.JpinferError`` and other ``ValueError``s, missing files) print one ``error:``
line and exit with status 2; the placement solver exits with 3 when no placement fits.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

# name -> (module with add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("jpinfer.commands.generate", "continue a prompt"),
    "chat": ("jpinfer.commands.generate", "interactive chat with the model's chat template"),
    "info": ("jpinfer.commands.generate", "print the model's configuration"),
    "bench": ("jpinfer.bench.compare", "engines side by side on real prompts (decode speed, accuracy)"),
    "bench-kernels": ("jpinfer.bench.kernels", "sparse FFN kernels against the dense FFN"),
    "bench-gpu": ("jpinfer.bench.gpu_suite", "the GPU suite: checks, kernel table, sparse and hybrid decodes"),
    "profile": ("jpinfer.commands.profile", "count how often each FFN neuron fires over a corpus"),
    "train-predictors": ("jpinfer.commands.train_predictors",
                         "train per-layer activation predictors from a profile's samples"),
    "place": ("jpinfer.commands.place", "place the hottest neurons on the accelerator under a memory budget"),
    "prepare": ("jpinfer.commands.prepare", "profile, thresholds, predictors and placement of a model, as one pack"),
    "cache": ("jpinfer.commands.cache", "what the cache directory holds; prune what no current key reaches"),
    "serve": ("jpinfer.commands.serve", "an OpenAI-compatible HTTP server (chat and completions, streaming, batching)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="jpinfer", description="Activation-sparse LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # only the invoked command's module is imported
            _command_module(module).add_arguments(command, name)
    args = parser.parse_args(argv)
    try:
        _compilation_cache()
        return _command_module(COMMANDS[args.command][0]).run(args)
    except (ValueError, FileNotFoundError) as error:  # jpinfer.JpinferError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _command_module(name: str):
    return importlib.import_module(name)


def _compilation_cache() -> None:
    """Keep XLA's compiled programs in $JPINFER_CACHE/xla, so a command run again loads them instead of
    compiling: the default model's hybrid engine compiled in 61 s the first time and 18 s with the cache
    (scratch probe, 2026-12-02; its programs took 6 MB). ``JPINFER_COMPILE_CACHE=0`` turns it off (the tests
    do); a cache directory already set by the caller is kept."""
    import jax

    from jpinfer.cache import cache_dir
    from jpinfer.errors import CacheError

    if os.environ.get("JPINFER_COMPILE_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir is not None:
        return
    try:
        directory = cache_dir("xla")
    except CacheError:  # an unwritable cache costs compile time only: the command runs without it
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the hybrid's are many small ones
