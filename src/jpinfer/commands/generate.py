"""``jpinfer generate``, ``jpinfer chat`` and ``jpinfer info``: one model loaded in one mode, to continue a
prompt, hold a conversation, or print the model's configuration."""

from __future__ import annotations

import argparse
import sys

from jpinfer.commands.args import add_mode_arguments, add_model_arguments, load_engine


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
    from jpinfer.runtime.generation import GenerationConfig

    if args.command == "info":
        return _info(load_engine(args), args)
    config = GenerationConfig(  # checked before the model loads: bad settings fail fast
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), chat=args.command == "chat" or args.chat,
    )
    engine = load_engine(args, with_mode=True)
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
