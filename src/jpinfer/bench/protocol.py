"""The bench's protocol, in one place: how engines are timed against each other, what the machine
was, and how two greedy outputs are compared.

- ``interleaved_rounds``: an untimed warm-up of every engine, then ``rounds`` rounds in each of
  which every engine runs once, in turn. The order ROTATES: round r starts with engine r (mod the
  number of engines) and goes on in the given order, so no engine always runs first (after a
  pause, on a cold cache) or last. Every run's result and its wall-clock seconds are kept per
  round (``Rounds``); a speed is the median over rounds, and a ratio to a reference engine is the
  median of SAME-ROUND ratios (``Rounds.median_ratio``, ``median_ratio``): load from other jobs on
  a shared machine changes between rounds and hits the engines of one round alike, so it cancels
  in a same-round ratio and not in a ratio of medians.
- ``fastest``: the same rounds for microbenchmarks (one kernel call, milliseconds): each round
  times ``per_round`` calls of every variant and the fastest call counts (the minimum, not the
  median: on a shared machine the median of short calls mostly measures the other jobs).
- ``machine`` / ``machine_line``: the processor's model name, cores, load average before and
  after, jax version and backend, date (UTC): one dict, and one line of markdown from it.
- ``prefix_agreement`` and ``positions_agreement``: the two ways the bench compares greedy tokens
  with a reference's; every table says which one it reports ("greedy agreement (prefix)" or
  "greedy agreement (positions)", ``AGREEMENT_LABELS``).
- ``TEST_WINDOWS``: the perplexity protocol's size, the default of every script and of the bench.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")

# The perplexity protocol: the first TEST_WINDOWS windows of 512 tokens (8192 tokens) of WikiText-2 test,
# the raw file tokenised as one text, no BOS (``accuracy.wikitext_windows``). Every figure divides by dense
# scored on the same windows in the same run, so ratios are paired; 16 is what the costliest script
# (accuracy_curves, ~20 settings) affords on 2 cores.
TEST_WINDOWS = 16

# ----- agreement of greedy outputs


def prefix_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Length of the matching prefix over the length: the share of ``tokens`` equal to
    ``reference`` before the first position where they differ (1.0: identical; 0.0: the first
    token differs). Over the shorter of the two lengths; 1.0 when both are empty.

    The strict measure for greedy decoding: after a first difference the two continue from
    different texts, so later positions say little about the engine."""
    n = min(len(tokens), len(reference))
    same = next((i for i in range(n) if tokens[i] != reference[i]), n)
    return same / n if n else 1.0


def matching_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Number of tokens equal to ``reference`` before the first difference (``prefix_agreement``
    times the length)."""
    n = min(len(tokens), len(reference))
    return next((i for i in range(n) if tokens[i] != reference[i]), n)


def positions_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of equal positions: the fraction of positions i (over the shorter of the two
    lengths) at which ``tokens[i] == reference[i]``, wherever they first differ; 1.0 when both
    are empty.

    Looser than ``prefix_agreement``: two outputs that differ in one token and then realign
    count as nearly equal."""
    n = min(len(tokens), len(reference))
    return sum(a == b for a, b in zip(tokens[:n], reference[:n])) / n if n else 1.0


def pooled_positions_agreement(outputs: Iterable[Sequence[int]], references: Iterable[Sequence[int]]) -> float:
    """``positions_agreement`` over several outputs at once: equal positions of all of them over
    all their positions (each output against its reference, over the shorter length)."""
    equal = total = 0
    for tokens, reference in zip(outputs, references):
        n = min(len(tokens), len(reference))
        equal += sum(a == b for a, b in zip(tokens[:n], reference[:n]))
        total += n
    return equal / total if total else 1.0


AGREEMENT_LABELS = {prefix_agreement: "greedy agreement (prefix)",
                    positions_agreement: "greedy agreement (positions)"}
AGREEMENT_MEANINGS = {
    prefix_agreement: "greedy agreement (prefix): share of the output tokens equal to the reference's before the "
                      "first difference",
    positions_agreement: "greedy agreement (positions): share of output positions whose token equals the "
                         "reference's at the same position",
}


# ----- interleaved rounds


@dataclasses.dataclass
class Run(Generic[T]):
    """One engine's run in one round: what it returned and the seconds the call took."""

    result: T
    seconds: float


@dataclasses.dataclass
class Rounds(Generic[T]):
    """What ``interleaved_rounds`` measured: per round, engine name -> its run, in the order they ran."""

    names: list[str]
    rounds: list[dict[str, Run[T]]]
    errors: dict[str, BaseException] = dataclasses.field(default_factory=dict)  # engines dropped, and why

    def results(self, name: str) -> list[T]:
        """The engine's results, one per round it ran in."""
        return [r[name].result for r in self.rounds if name in r]

    def seconds(self, name: str) -> list[float]:
        return [r[name].seconds for r in self.rounds if name in r]

    def values(self, name: str, measure: Callable[[T], float] | None = None) -> list[float]:
        """``measure`` of each of the engine's results (None: the seconds of each run)."""
        return [measure(r[name].result) if measure else r[name].seconds for r in self.rounds if name in r]

    def median(self, name: str, measure: Callable[[T], float] | None = None) -> float:
        """Median over rounds of ``values``."""
        return statistics.median(self.values(name, measure))

    def ratios(self, name: str, reference: str, measure: Callable[[T], float] | None = None) -> list[float]:
        """Per round in which both ran: ``measure`` of ``name`` over ``measure`` of ``reference``
        (pass a rate, such as tok/s, for a speed-up; with seconds the ratio is a slow-down)."""
        value = (lambda run: measure(run.result)) if measure else (lambda run: run.seconds)
        return [value(r[name]) / value(r[reference]) for r in self.rounds if name in r and reference in r]

    def median_ratio(self, name: str, reference: str, measure: Callable[[T], float] | None = None) -> float:
        """The median of the same-round ratios (see the module's docstring)."""
        return statistics.median(self.ratios(name, reference, measure))

    def order(self, r: int) -> list[str]:
        """The engines in the order they ran in round ``r``."""
        return list(self.rounds[r])


def rotation(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: the names starting from the (r mod n)-th, then around."""
    k = r % len(names) if names else 0
    return [*names[k:], *names[:k]]


def interleaved_rounds(
    engines: Mapping[str, Callable[[int], T]],
    rounds: int,
    *,
    warm: Mapping[str, Callable[[], object]] | None = None,
    rotate: bool = True,
    before_round: Callable[[int, Rounds[T]], bool] | None = None,
    after_run: Callable[[int, str, Run[T]], None] | None = None,
    after_round: Callable[[int, Rounds[T]], None] | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Rounds[T]:
    """Run every engine once per round, ``rounds`` rounds, in turn; see the module's docstring.

    ``engines``: name -> a call given the round index (so a round can draw its own prompts),
    returning whatever the caller measures with (its own timings, tokens; the call's wall-clock
    seconds are kept beside it). Warm-up, untimed and before the first round: ``warm[name]()``
    where given, else one call ``engines[name](0)`` whose result is dropped (give
    ``{name: lambda: None}`` for an engine warmed already).
    ``rotate``: False keeps the given order in every round. ``before_round(r, so_far)``: False
    stops before round r (a time bound). ``after_run`` / ``after_round``: progress. ``on_error``:
    when given, an engine that raises is dropped from later rounds (its error kept in
    ``Rounds.errors`` and passed on); without it the error propagates. ``clock``: the timer (a
    fake in tests).
    """
    names = list(engines)
    out: Rounds[T] = Rounds(names, [])
    live = list(names)

    def attempt(name: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            return True, call()
        except Exception as err:  # noqa: BLE001 -- handed to on_error, or raised
            if on_error is None:
                raise
            out.errors[name] = err
            live.remove(name)
            on_error(name, err)
            return False, None

    for name in names:
        attempt(name, warm[name] if warm is not None and name in warm else (lambda f=engines[name]: f(0)))
    for r in range(rounds):
        if before_round is not None and not before_round(r, out):
            break
        done: dict[str, Run[T]] = {}
        out.rounds.append(done)
        for name in rotation(live, r) if rotate else list(live):
            start = clock()
            ok, result = attempt(name, lambda f=engines[name]: f(r))
            if ok:
                done[name] = Run(result, clock() - start)
                if after_run is not None:
                    after_run(r, name, done[name])
        if after_round is not None:
            after_round(r, out)
    return out


def median_ratio(values: Sequence[float], reference: Sequence[float]) -> float:
    """Median of same-round ratios ``values[r] / reference[r]`` (the two lists round by round)."""
    if len(values) != len(reference) or not values:
        raise ValueError(f"need one value per round on both sides, got {len(values)} and {len(reference)}")
    return statistics.median(v / ref for v, ref in zip(values, reference))


def fastest(calls: Sequence[Callable[[], object]], rounds: int, per_round: int = 3,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Fastest seconds of each no-argument call (results waited for with ``jax.block_until_ready``):
    ``interleaved_rounds`` over the calls, each round timing ``per_round`` calls of each, after one
    untimed call of each (compilation, first touch)."""
    import jax

    def timed(call: Callable[[], object]) -> Callable[[int], float]:
        def best_of_round(_: int) -> float:
            best = float("inf")
            for _ in range(per_round):
                t0 = clock()
                jax.block_until_ready(call())
                best = min(best, clock() - t0)
            return best
        return best_of_round

    names = [str(i) for i in range(len(calls))]
    measured = interleaved_rounds({n: timed(c) for n, c in zip(names, calls)}, rounds,
                                  warm={n: (lambda c=c: jax.block_until_ready(c())) for n, c in zip(names, calls)},
                                  clock=clock)
    return [min(measured.results(n), default=float("inf")) for n in names]


# ----- the machine


def cpu_name() -> str:
    """The processor's model name from /proc/cpuinfo (Linux), with its family and model numbers where
    given, else what ``platform`` reports. The numbers matter on VMs, which show masked names: machines
    that all said "AMD EPYC" ran XLA:CPU's float32 x @ M over a 7B down matrix at 18 GB/s (2026-12-02, Zen 4,
    loaded) and at 67 GB/s (2026-12-04, family 26: Zen 5), so a name alone does not say which results compare."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages ([] where the system has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def machine(load_before: Sequence[float] | None = None) -> dict:
    """What a result belongs to: ``cpu`` (model name), ``cores``, ``load_before`` (given: the
    ``load_average()`` taken before the run; else now) and ``load_after`` (now), ``jax`` version,
    ``backend`` (jax's default platform) and ``device`` (its first device's kind), ``date`` (UTC,
    ISO 8601 to the second)."""
    import jax

    device = jax.devices()[0]
    now = load_average()
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "load_before": list(load_before if load_before is not None
                                                                             else now),
            "load_after": now, "jax": jax.__version__, "backend": device.platform, "device": device.device_kind,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _load(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values[:2]) if values else "n/a"


def machine_line(m: Mapping[str, Any]) -> str:
    """One line of markdown from ``machine()``'s dict."""
    device = "" if m["backend"] == "cpu" else f" ({m['device']})"
    return (f"Machine: {m['cpu']}, {m['cores']} cores; load average (1/5 min) {_load(m['load_before'])} before, "
            f"{_load(m['load_after'])} after; jax {m['jax']} on {m['backend']}{device}; {m['date']}.")


# ----- progress

_START = time.perf_counter()


def log(message: str) -> None:
    """Timestamped progress (seconds since the bench started), flushed: a run cut short, as on a
    time-limited accelerator, still shows where its time went."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", flush=True)
