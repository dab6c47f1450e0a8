"""Saying in one line what is wrong with a checkpoint that orbax cannot restore.

orbax and tensorstore report a damaged file with pages of internal detail (and, from the reads
still in flight, tracebacks printed after the restore has failed); `damage_summary` names the
array and the cause, `let_failed_reads_finish` keeps the late tracebacks off the terminal.
"""

from __future__ import annotations

import contextlib
import os
import re
import time


def let_failed_reads_finish(seconds: float = 1.0) -> None:
    """After a failed restore, the reads still in flight finish on tensorstore's threads and
    report to an event loop that orbax has closed, each printing a traceback; wait for them with
    Python's stderr muted, so that the one-line error is all the user sees."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        time.sleep(seconds)


def damage_summary(error: BaseException) -> str:
    """One line saying which saved array could not be read and why, from an orbax/tensorstore
    restore error (whose text runs to pages of internal detail)."""
    chain, seen = [], error
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = "\n".join(str(e) for e in chain)
    item = re.search(r'Error reading "([^"]+)"', text)
    what = f"array {item.group(1).split('/')[0]!r}" if item else "a saved array"
    if re.search(r"byte range .* is not valid for value of size", text):
        why = "its data file is truncated (shorter than when it was written)"
    else:
        first = next((line for line in text.splitlines() if line.strip()), type(error).__name__)
        why = re.sub(r"<bound method [^>]*>|\(?see full tensorstore details.*", "", first, flags=re.I).strip(" :.")
        why = f"{type(error).__name__}: {why[:160]}"
    return f"{what} cannot be read: {why}"
