"""Load test of ``jpinfer serve``: many clients at once over loopback, at several slot counts and modes.

For each mode and slot count a server process is started (``jpinfer serve --mode M --slots S``), warmed
with the whole load once (compiles each prompt bucket and attention length; untimed), then ``--clients``
clients send one streamed chat request each, all at once: ``--tokens`` greedy tokens of an instruction
prompt (the bench's prompt pool, ChatGPT prompts and Alpaca). Per configuration:

- nothing lost: every response complete (one finish reason, usage present), and how many greedy texts
  equal that request run alone (``Engine.generate`` in this process; a batch's products may round
  differently, so a near-tie can flip a token: the count says how often);
- aggregate output tokens/s (all completion tokens over the wall time from the first request sent to
  the last answer done), p50 / p99 time to first token and time per output token (per request: the
  time from its first to its last token over its tokens after the first);
- in this process, the batched decode step with every slot full (``BatchDecoder.step``, median of
  interleaved rounds) against the one-slot step: how close a step of S sequences comes to the cost of
  one (a step reads every weight once, whatever S: the memory-bound cost).

    python bench/serve.py --out bench/results/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
import numpy as np

import jpinfer
from jpinfer.bench.prompts import instruction_pool
from jpinfer.bench.protocol import interleaved_rounds, load_average, log, machine, machine_line
from jpinfer.bench.results import command_line, markdown_table, publish
from jpinfer.runtime.generation import GenerationConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """n single-turn chats from the bench's prompt pool (sampled with a seed, at most 400 characters)."""
    pool = [p for p in instruction_pool() if len(p) <= 400]
    picks = np.random.default_rng(seed).choice(len(pool), size=n, replace=False)
    return [[{"role": "user", "content": pool[i]}] for i in picks]


class ServerProcess:
    def __init__(self, mode: str, slots: int, max_waiting: int) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jpinfer", "serve", "--mode", mode, "--slots", str(slots), "--port", str(self.port),
             "--max-waiting", str(max_waiting)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jpinfer serve exited: {self.process.stderr.read()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("jpinfer serve did not start in 10 minutes")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


async def one_request(session: aiohttp.ClientSession, url: str, messages: list[dict], tokens: int) -> dict:
    """One streamed chat request: its text, finish reasons, usage and token arrival times."""
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, text, finishes, usage = [], [], [], None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return {"error": f"{response.status}: {await response.text()}"}
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    arrivals.append(time.perf_counter())
                    text.append(choice["delta"]["content"])
                if choice["finish_reason"]:
                    finishes.append(choice["finish_reason"])
    return {"sent": sent, "arrivals": arrivals, "text": "".join(text), "finishes": finishes, "usage": usage}


async def load(url: str, chats: list[list[dict]], tokens: int) -> tuple[list[dict], float]:
    """Every chat sent at once; (the answers, the wall seconds from the first sent to the last done)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        answers = await asyncio.gather(*(one_request(session, url, c, tokens) for c in chats))
        return list(answers), time.perf_counter() - start


def step_seconds(engine, slot_counts: list[int], rounds: int, steps: int = 16) -> dict[int, float]:
    """Median seconds of a decode step with every slot full, per slot count (interleaved rounds)."""
    decoders = {}
    for slots in slot_counts:
        decoder = engine.batch_decoder(slots, 512)
        for i in range(slots):
            decoder.add([10 + i] * (20 + 7 * i), GenerationConfig(max_new_tokens=500, ignore_eos=True))
        decoders[slots] = decoder

    def run(slots: int):
        def timed(_: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                decoders[slots].step()
            return (time.perf_counter() - t0) / steps
        return timed

    measured = interleaved_rounds({str(s): run(s) for s in slot_counts}, rounds)
    return {s: statistics.median(measured.results(str(s))) for s in slot_counts}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(answers: list[dict], wall: float, references: list[str]) -> dict:
    done = [a for a in answers if "error" not in a]
    complete = [a for a in done if len(a["finishes"]) == 1 and a["usage"]]
    tokens = sum(a["usage"]["completion_tokens"] for a in complete)
    ttft = [a["arrivals"][0] - a["sent"] for a in complete if a["arrivals"]]
    tpot = [(a["arrivals"][-1] - a["arrivals"][0]) / (a["usage"]["completion_tokens"] - 1) for a in complete
            if a["usage"]["completion_tokens"] > 1 and len(a["arrivals"]) > 1]
    equal = sum(a.get("text") == ref for a, ref in zip(answers, references))
    errors = [a["error"] for a in answers if "error" in a]
    return {"requests": len(answers), "complete": len(complete), "errors": errors,
            "equal_to_alone": equal, "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["dense", "threshold"])
    ap.add_argument("--slots", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the in-process step timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = load_average()
    chats = prompts(args.clients)
    data = {"clients": args.clients, "tokens": args.tokens, "modes": {}}
    for mode in args.modes:
        engine = jpinfer.load(mode=mode)
        log(f"{mode}: references (each request alone)")
        config = GenerationConfig(max_new_tokens=args.tokens)
        references = [engine.generate(c, config).text for c in chats]
        log(f"{mode}: batched step timing")
        steps = step_seconds(engine, args.slots, args.rounds)
        del engine
        runs = {}
        for slots in args.slots:
            log(f"{mode}: server with {slots} slots")
            server = ServerProcess(mode, slots, max_waiting=args.clients)
            try:
                url = f"http://127.0.0.1:{server.port}"
                asyncio.run(load(url, chats, args.tokens))  # warm-up, untimed: every prompt bucket, attention length
                answers, wall = asyncio.run(load(url, chats, args.tokens))
            finally:
                server.stop()
            runs[slots] = summarize(answers, wall, references) | {"step_s": steps[slots]}
            log(f"{mode} {slots} slots: {runs[slots]['tokens_per_s']:.1f} tok/s, "
                f"{runs[slots]['complete']}/{args.clients} complete")
        data["modes"][mode] = runs
    data["machine"] = machine(load_before)
    publish(report(data), args.out, data)


def report(data: dict) -> str:
    rows = []
    for mode, runs in data["modes"].items():
        base = runs.get(min(runs))
        for slots, r in runs.items():
            rows.append([mode, slots, f"{r['complete']}/{r['requests']}", f"{r['equal_to_alone']}/{r['requests']}",
                         f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                         f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}",
                         f"{r['tpot_p50_s'] * 1e3:.1f}", f"{r['tpot_p99_s'] * 1e3:.1f}",
                         f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / base['step_s']:.2f}x",
                         f"{int(slots) / r['step_s']:.1f}", f"{int(slots) * base['step_s'] / r['step_s']:.2f}x"])
    lines = [
        "# jpinfer serve under load",
        "",
        machine_line(data["machine"]),
        "",
        command_line("python bench/serve.py")
        + f" ({data['clients']} clients at once, one streamed greedy chat request of "
        f"{data['tokens']} tokens each, default model, loopback). Output tok/s: all completion tokens over the wall "
        "time of the load; TTFT and TPOT (time per output token after the first) in ms, p50 / p99 over requests; "
        "'equal': greedy texts equal to the request run alone; step: the batched decode step with every slot full, "
        "in this process (median of interleaved rounds), and its cost against the one-slot step; decode tok/s: the "
        "tokens those steps make per second (slots / step), the aggregate decode throughput without prefills; the "
        "one-slot step is the memory-bound cost of a step (it reads every weight once for one token).",
        "",
        *markdown_table(["mode", "slots", "complete", "equal", "output tok/s", "x 1 slot", "TTFT p50", "TTFT p99",
                         "TPOT p50", "TPOT p99", "step ms", "x 1-slot step", "decode tok/s", "x 1 slot"], rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
