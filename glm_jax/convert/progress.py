"""A one-line progress bar on stderr (redrawn in place on a terminal, a line per 10% otherwise)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total_bytes: int, *, enabled: bool = True, stream=None):
        self.label, self.total, self.enabled = label, max(total_bytes, 1), enabled
        self.stream = stream or sys.stderr
        self.done, self.count, self.start, self.last_decile = 0, 0, time.perf_counter(), -1
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def advance(self, nbytes: int, what: str = "") -> None:
        self.done += nbytes
        self.count += 1
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        decile = int(frac * 10)
        if not self.tty and decile == self.last_decile:
            return
        self.last_decile = decile
        filled = int(frac * 20)
        rate = self.done / max(time.perf_counter() - self.start, 1e-9) / 1e9
        line = (f"{self.label} [{'#' * filled}{'.' * (20 - filled)}] {frac:4.0%} {self.count} arrays "
                f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate:.2f} GB/s {what}")
        self.stream.write(("\r" + line[:160].ljust(160)) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
