"""Command line: python -m jpinfer {generate,chat,info}."""

from __future__ import annotations

import argparse
import sys

from jpinfer.models.loading import DTYPES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weight dtype (default float32)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _generation_config(args: argparse.Namespace, chat: bool):
    from jpinfer import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), chat=chat,
    )


def _print_stats(result, file=sys.stderr) -> None:
    print(
        f"[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} new, "
        f"finish={result.finish_reason}, prefill {result.prefill_s * 1e3:.0f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tok/s]",
        file=file,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    import jpinfer

    config = _generation_config(args, chat=args.chat)
    engine = jpinfer.load(args.model, dtype=args.dtype)
    if args.no_stream:
        result = engine.generate(args.prompt, config)
        print(result.text)
    else:
        result = None
        for event in engine.events(args.prompt, config):
            if isinstance(event, str):
                print(event, end="", flush=True)
            else:
                result = event
        print()
    if args.stats:
        _print_stats(result)


def cmd_chat(args: argparse.Namespace) -> None:
    import jpinfer

    config = _generation_config(args, chat=True)
    engine = jpinfer.load(args.model, dtype=args.dtype)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
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


def cmd_info(args: argparse.Namespace) -> None:
    import jpinfer
    from jpinfer.models.params import nbytes

    engine = jpinfer.load(args.model, dtype=args.dtype)
    print(f"source: {engine.source}")
    for field, value in vars(engine.cfg).items():
        print(f"{field}: {value}")
    print(f"weight bytes: {nbytes(engine.weights) / 1e6:.1f} MB ({args.dtype})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jpinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--no-stream", action="store_true", help="print the text at the end, not as it comes")
    g.add_argument("--stats", action="store_true", help="print timing to stderr")
    _add_model_args(g)
    _add_generation_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    _add_model_args(c)
    _add_generation_args(c)
    c.set_defaults(func=cmd_chat)
    i = sub.add_parser("info", help="print the model's configuration")
    _add_model_args(i)
    i.set_defaults(func=cmd_info)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130)


if __name__ == "__main__":
    main()
