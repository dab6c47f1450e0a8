"""Tokens in, text out, a few at a time: incremental detokenization and stop strings.

A byte-level BPE splits a multi-byte character over several tokens, and decoding a prefix that
ends inside one gives U+FFFD. `Detokenizer` holds such a tail back until the character is
whole, and decodes only a short window of recent tokens, so each step's cost does not grow
with the length of the completion. `TextStream` adds stop strings: it never emits text that
could still turn out to be the start of a stop string, and ends the text before the first one.
`token_texts` spells single tokens, for log-probabilities.
"""

from __future__ import annotations

import functools
from typing import Callable

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Incremental `tokenizer.decode`: the pieces `push` returns, joined with `flush()`, are
    `tokenizer.decode(all ids)`.

    The window `ids[prefix:]` starts at a token boundary where the text before it was whole;
    `ids[prefix:read]` is the part of the window whose text was emitted already."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, ids: list[int]) -> str:
        """Take new token ids -> the text that is now complete (may be "")."""
        self.ids.extend(ids)
        emitted = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if len(window) <= len(emitted) or window.endswith(_INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(emitted):]

    def flush(self) -> str:
        """The text held back (an incomplete character decodes to U+FFFD here)."""
        emitted = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return window[len(emitted):]


class TextStream:
    """Detokenizer + stop strings. After `push` or `flush`, `stopped` says whether a stop string
    was found; the text returned so far then ends just before it (the stop string excluded).
    `decoded` counts the characters decoded so far, stop strings and the text held back
    included: where the next token's text starts."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.detokenizer = Detokenizer(tokenizer)
        self.stop = stop
        self.pending = ""           # decoded, not yet emitted: it may begin a stop string
        self.stopped = False
        self.decoded = 0

    def push(self, ids: list[int]) -> str:
        """Take new token ids -> the text that can be emitted now."""
        return self._emit(self.detokenizer.push(ids), final=False)

    def flush(self) -> str:
        """The generation ended: -> the rest of the text."""
        return self._emit(self.detokenizer.flush(), final=True)

    def _emit(self, text: str, *, final: bool) -> str:
        self.decoded += len(text)
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        keep = 0 if final else self._stop_prefix_length()
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def _stop_prefix_length(self) -> int:
        """The length of the longest end of `pending` that is the start of a stop string."""
        for n in range(min(len(self.pending), max(map(len, self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.pending[-n:]) for s in self.stop):
                return n
        return 0


def token_texts(tokenizer, cache_size: int = 1 << 16) -> Callable[[int], str]:
    """token id -> its own text (special tokens spelled out; a token that ends inside a
    multi-byte character has U+FFFD for the part), cached."""
    @functools.lru_cache(maxsize=cache_size)
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)
    return text
