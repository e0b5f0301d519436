"""How the bench scripts record a run: the markdown table printed, and with ``out`` written there, its data
beside it as JSON (same name, ``.json``), so every recorded number has a machine-readable source."""

from __future__ import annotations

import json
import os
import pathlib
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
    """The line that names the command a results file came from, in the one form bench/index.py reads
    (``Command: `...```), so every file under bench/results says how to make it again."""
    return f"Command: `{command}`"


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
