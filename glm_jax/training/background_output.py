"""Output of the threads behind a training run, kept off the terminal and in a file.

orbax writes checkpoints on its own threads; when a write fails (a full disk, a lost mount) those
threads and tensorstore's callbacks print pages of tracebacks on stderr before the loop learns
of the failure at its next save, and the loop then reports the failure in one line
(`glm_jax.training.saving.SaveFailedError`). Within `routed_to(path)`, what a thread other than
the main one writes to stderr or logs goes to `path` instead, nothing lost; the main thread's
output (progress, errors) is unchanged, except within `library_logs_too()` (around the calls
into orbax), where the main thread's log records go to the file as well.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from pathlib import Path

from glm_jax.thread_streams import ThreadRoutedStream


_main_thread_logs_to_file = [0]      # > 0 within library_logs_too()


@contextlib.contextmanager
def library_logs_too():
    """Within (and within `routed_to`): the main thread's log records go to the file too."""
    _main_thread_logs_to_file[0] += 1
    try:
        yield
    finally:
        _main_thread_logs_to_file[0] -= 1


class _MainThreadOnly(logging.Filter):
    """Passes the main thread's log records (outside `library_logs_too`); writes the others to
    `sink`."""

    def __init__(self, sink: logging.Handler):
        super().__init__()
        self.sink = sink

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == threading.main_thread().ident and not _main_thread_logs_to_file[0]:
            return True
        self.sink.handle(record)
        return False


@contextlib.contextmanager
def routed_to(path: str | Path):
    """Within: other threads' stderr text and log records go to `path` (appended, opened on
    first use)."""
    file = _LazyFile(Path(path))
    sink = logging.StreamHandler(file)
    sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    keep = _MainThreadOnly(sink)
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(keep)
    previous, sys.stderr = sys.stderr, ThreadRoutedStream(sys.stderr, file)
    try:
        yield
    finally:
        sys.stderr = previous
        for h in handlers:
            h.removeFilter(keep)
        file.close()


class _LazyFile:
    """A text file created on the first write (a run without background output leaves none).
    A write the disk refuses (it is full: often why the threads are reporting) is dropped. A
    thread that still writes after `close` (one that kept a reference to the routed stream, at
    interpreter exit) appends to the file, opened for that write alone."""

    def __init__(self, path: Path):
        self.path, self.file, self.closed = path, None, False
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock, contextlib.suppress(OSError, ValueError):
            if self.closed:
                with self.path.open("a") as late:
                    late.write(text)
            else:
                if self.file is None:
                    self.file = self.path.open("a")
                self.file.write(text)
        return len(text)

    def flush(self) -> None:
        with self.lock, contextlib.suppress(OSError):
            if self.file is not None:
                self.file.flush()

    def close(self) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.closed = True
            if self.file is not None:
                self.file.close()
                self.file = None
