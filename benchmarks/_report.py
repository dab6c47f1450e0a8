"""How a benchmark reports: its markdown table on stdout, its JSON file, and what a failed part
says.

    table = Table("part", "ms", "limit ms")      # prints the header
    table.row(name, f"{ms:.1f}", f"{limit:.1f}")  # prints one row, flushed
    write_json(args.json, {"rows": rows})       # nothing without a path
    except Exception as e:
        row["failed"] = failure(e)              # "Type: its message's last line"; traceback on stderr
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from pathlib import Path

#: A traceback's closing line: the exception's (qualified) type, then its message.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b")


class Table:
    """A markdown table printed as it is measured: the header at once, each row when it comes."""

    def __init__(self, *columns: str):
        self.width = len(columns)
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * self.width, flush=True)

    def row(self, *cells) -> None:
        """One row; missing trailing cells are left empty."""
        cells = [str(c) for c in cells] + [""] * (self.width - len(cells))
        print("| " + " | ".join(cells) + " |", flush=True)


def write_json(path: str | Path | None, data) -> None:
    """data as indented JSON at path (its folder made; values JSON cannot hold as their str);
    nothing when path is None. Called after every row, a run cut short keeps what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def device_kind() -> str:
    """The first device's kind ("NVIDIA H100 80GB HBM3", "cpu"), for a report's header. (jax is
    imported here: the other helpers serve scripts that import it late or not at all.)"""
    import jax

    return jax.devices()[0].device_kind


def failure_text(error: BaseException) -> str:
    """'Type: last non-empty line of the message' (the type alone for an empty message): what a
    failed part's row records. The last line, since JAX and XLA put the cause there after lines
    of context."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def failure(error: BaseException) -> str:
    """`failure_text(error)`, after printing the whole traceback to stderr."""
    traceback.print_exception(error, file=sys.stderr)
    return failure_text(error)


def child_failure(stderr: str, returncode: int) -> str:
    """What a benchmark child process that failed says: its traceback's last exception line (the
    lines JAX adds after it, such as the note on filtered frames, skipped), else its exit status
    and last line of stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    found = [line for line in lines if _EXCEPTION_LINE.match(line)]
    if found:
        return found[-1]
    return f"exit status {returncode}: {lines[-1] if lines else 'no output'}"
