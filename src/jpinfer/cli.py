"""The ``jpinfer`` command (also ``python -m jpinfer``): one parser, one subcommand per job.

Subcommands live next to what they run: each module named in ``COMMANDS`` has
``add_arguments(parser)`` and ``run(args) -> int``. Only the invoked subcommand's module is
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

from jpinfer.cli_args import add_mode_arguments, add_model_arguments, mode_options, prepare_devices

# name -> (module with add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("jpinfer.cli", "continue a prompt"),
    "chat": ("jpinfer.cli", "interactive chat with the model's chat template"),
    "info": ("jpinfer.cli", "print the model's configuration"),
    "bench": ("jpinfer.bench.compare", "engines side by side on real prompts (decode speed, accuracy)"),
    "bench-kernels": ("jpinfer.bench.kernels", "sparse FFN kernels against the dense FFN"),
    "bench-gpu": ("jpinfer.bench.gpu_suite", "the GPU suite: checks, kernel table, sparse and hybrid decodes"),
    "profile": ("jpinfer.profiler.cli", "count how often each FFN neuron fires over a corpus"),
    "train-predictors": ("jpinfer.predictor.cli", "train per-layer activation predictors from a profile's samples"),
    "place": ("jpinfer.solver.cli", "place the hottest neurons on the accelerator under a memory budget"),
    "prepare": ("jpinfer.pack.cli", "profile, thresholds, predictors and placement of a model, as one pack"),
    "cache": ("jpinfer.cache_cli", "what the cache directory holds; prune what no current key reaches"),
    "serve": ("jpinfer.serve.cli", "an OpenAI-compatible HTTP server (chat and completions, streaming, batching)"),
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


# ----- the generation commands: generate, chat, info

def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """Arguments of ``generate``, ``chat`` and ``info``."""
    if command == "generate":
        p.add_argument("prompt")
        p.add_argument("--chat", action="store_true", help="apply the model's chat template")
        p.add_argument("--no-stream", action="store_true", help="print the text at the end, not as it comes")
        p.add_argument("--stats", action="store_true", help="print timing to stderr")
    if command == "chat":
        p.add_argument("--system", default=None, help="system message")
    add_model_arguments(p)
    if command in ("generate", "chat"):
        add_mode_arguments(p)
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        p.add_argument("--top-k", type=int, default=0, help="0 = off")
        p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def run(args: argparse.Namespace) -> int:
    from jpinfer.api import load
    from jpinfer.runtime.generation import GenerationConfig

    if args.command == "info":
        return _info(load(args.model, dtype=args.dtype, weights=args.weights), args)
    config = GenerationConfig(  # checked before the model loads: bad settings fail fast
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), chat=args.command == "chat" or args.chat,
    )
    prepare_devices([args.mode])
    engine = load(args.model, dtype=args.dtype, weights=args.weights, mode=args.mode, **mode_options(args))
    if args.command == "chat":
        return _chat(engine, config, args.system)
    result = None
    for event in engine.events(args.prompt, config):
        if isinstance(event, str):
            if not args.no_stream:
                print(event, end="", flush=True)
        else:
            result = event
    print(result.text if args.no_stream else "")
    if args.stats:
        print(
            f"[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} new, "
            f"finish={result.finish_reason}, prefill {result.prefill_s * 1e3:.0f} ms, "
            f"decode {result.decode_tokens_per_s:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def _chat(engine, config, system: str | None) -> int:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    print(f"chatting with {engine.cfg.name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for event in engine.events(messages, config):
            if isinstance(event, str):
                reply.append(event)
                print(event, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _info(engine, args: argparse.Namespace) -> int:
    from jpinfer.models.params import nbytes

    print(f"source: {engine.source}")
    for field, value in vars(engine.cfg).items():
        print(f"{field}: {value}")
    print(f"weight bytes: {nbytes(engine.weights) / 1e6:.1f} MB ({args.dtype}, {args.weights} weights)")
    return 0
