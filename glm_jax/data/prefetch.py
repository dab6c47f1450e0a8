"""Batches built on a background thread while the accelerator runs the step.

    batches = Prefetched(PackedBatches(...), depth=2)
    batch = next(batches)          # the next Batch, usually already built
    meta["data"] = batches.state() # the position after the last batch handed out, not the last built

JAX dispatches a step and returns before the device has run it, so the host is free during the
step; packing the next batch there (tokenising documents, first-fit packing) hides it behind
the device instead of adding it to every step. The wrapped iterator's `state()` is read on the
producer thread right after each batch is built and handed out with it, so a checkpoint records
exactly the batches the loop consumed: a resume replays the same batches as without the thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

_DONE = object()


class Prefetched:
    """Iterator over `source`'s items, up to `depth` of them built ahead on a daemon thread.

    source: an iterator with `state()` (JSON of its position), e.g. `pipeline.PackedBatches`.
    An exception raised by the source (or its end) reaches the caller at the item where it
    happened. `close()` stops the thread; it is also stopped when the source is exhausted."""

    def __init__(self, source, depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._source = source
        self._state = source.state()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item = (next(self._source), self._source.state())
            except StopIteration:
                item = _DONE
            except BaseException as error:          # handed to the consumer, raised there
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is _DONE or isinstance(item, BaseException):
                return

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)                  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(item)
            raise item
        batch, self._state = item
        return batch

    def state(self) -> dict:
        """The source's state after the last item handed out (before any: its initial state)."""
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
