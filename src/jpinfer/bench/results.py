"""How the bench scripts record a run: the markdown table printed, and with ``out`` written there, its data
beside it as JSON (same name, ``.json``), so every recorded number has a machine-readable source."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Iterable, Sequence


def publish(text: str, out: str | os.PathLike | None, data: Any) -> None:
    """Print ``text``; when ``out`` is given, write it there and ``data`` to ``out`` with a .json suffix
    (numpy scalars become floats)."""
    print(text)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float))


def command_line(command: str) -> str:
    """The line that names the command a results file came from, in the form ``read_header`` reads, so every
    file under bench/results says how to make it again."""
    return f"Command: `{command}`"


_MACHINE = re.compile(r"(?:^(?:- )?|[.)] )Machine: (.+?)(?:\n\s*\n|\Z)", re.M | re.S)
_DATE = re.compile(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)")
_GPU = re.compile(r"on gpu \(([^)]+)\)")
_COMMAND = re.compile(r"(?:^(?:- )?|[.)] )(?i:commands?): (`[^`\n]+`|[^\n]+)", re.M)


@dataclasses.dataclass(frozen=True)
class Header:
    """What a results markdown says of its run; None where it says nothing."""
    machine: str | None
    date: str | None
    command: str | None


def read_header(text: str) -> Header:
    """The machine, date and command a results markdown names, in the form the scripts write
    (``protocol.machine_line`` and ``command_line``), so bench/index.py and bench/report.py can show them:

    - machine: the paragraph that begins ``Machine: `` (at a line's start, after ``- `` or after a sentence),
      up to its first ``;`` (``machine_line``'s CPU and cores), led by the GPU where jax ran ``on gpu (...)``;
    - date: the first ``YYYY-MM-DD`` in that paragraph;
    - command: what follows the first ``Command: `` (or ``Commands: ``, any case): a backticked command or, for a
      record no script makes, a sentence saying what ran.
    """
    machine = _MACHINE.search(text)
    paragraph = " ".join(machine.group(1).split()) if machine else ""
    date = _DATE.search(paragraph)
    command = _COMMAND.search(text)
    gpu = _GPU.search(paragraph)
    cpu = paragraph.split(";")[0].rstrip(".")
    return Header(machine=(f"{gpu.group(1)} (host: {cpu})" if gpu else cpu) if machine else None,
                  date=date.group(0) if date else None,
                  command=command.group(1).rstrip(" .") if command else None)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the header, its rule, then one line per row (each cell as ``str``)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def format_cell(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``; "-" for None (a number the run does not have)."""
    return "-" if value is None else format(value, spec)


def error_text(err: BaseException) -> str:
    """An error as one short table cell: its type and the first line of its message."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}".replace("|", "/")
