"""``jpinfer serve``: an OpenAI-compatible HTTP server over any engine mode (``serve.app``), decoding
concurrent requests together (``runtime.batch``)."""

from __future__ import annotations

import argparse
import re
import sys
import time

from jpinfer.commands.args import add_mode_arguments, add_model_arguments, load_engine
from jpinfer.runtime.batch import MAX_SLOTS

DEFAULT_CONTEXT = 2048  # per slot: the default model's KV cache is 46 KB a position, 94 MB a slot


def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    add_model_arguments(p)
    add_mode_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=4,
                   help=f"requests decoded together, 1-{MAX_SLOTS} (default 4); more wait in a queue")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help=f"tokens per request, prompt and answer (default {DEFAULT_CONTEXT}, at most the model's)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a slot; more are answered 503 (default 64)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--served-name", default=None, help="the model's name in the API (default: from its config)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default 30)")


def served_name(cfg_name: str) -> str:
    """The config's model name as an API id: lowercase, runs of other characters made one '-'."""
    return re.sub(r"[^a-z0-9._]+", "-", cfg_name.lower()).strip("-") or "model"


def run(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web
    except ImportError:
        raise ValueError("jpinfer serve needs its HTTP stack: pip install 'jpinfer[serve]'") from None

    from jpinfer.serve.app import create_app
    from jpinfer.serve.scheduler import Scheduler

    if not 1 <= args.slots <= MAX_SLOTS:
        raise ValueError(f"--slots must be in [1, {MAX_SLOTS}], got {args.slots}")
    if args.context < 16 or args.max_waiting < 0 or args.max_body < 1024:
        raise ValueError("--context must be >= 16, --max-waiting >= 0 and --max-body >= 1024")
    engine = load_engine(args, with_mode=True)
    scheduler = Scheduler(engine, args.slots, min(args.context, engine.cfg.max_position), args.max_waiting)
    scheduler.warmup()
    scheduler.start()
    name = args.served_name or served_name(engine.cfg.name)
    app = create_app(scheduler, model=name, api_key=args.api_key, max_body=args.max_body, created=int(time.time()))
    banner = (f"jpinfer serving {name!r} ({args.mode}, {args.weights} weights) on http://{args.host}:{args.port}/v1 "
              f"with {args.slots} slots of {scheduler.context} tokens")
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                shutdown_timeout=args.shutdown_timeout, print=lambda _: print(banner, file=sys.stderr, flush=True))
    return 0
