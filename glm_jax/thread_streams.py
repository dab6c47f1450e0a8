"""A text stream split by thread: the main thread's text to one stream, every other thread's to
another. Shared by the checkpoint's damage handling (`checkpoint_damage`: orbax's threads
silenced after a failed restore) and the training run (`training.background_output`: their
output routed to a file)."""

from __future__ import annotations

import threading


class ThreadRoutedStream:
    """A text stream that writes the main thread's text to `main` and the others' to `other`."""

    def __init__(self, main, other):
        self.main, self.other = main, other

    def _target(self):
        return self.main if threading.current_thread() is threading.main_thread() else self.other

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self.main.flush()
        self.other.flush()

    def __getattr__(self, name):
        return getattr(self.main, name)
