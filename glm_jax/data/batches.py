"""Training batches: random windows of a token stream, a pure function of (seed, step).

Resuming is exact because the batch at step n depends only on the seed and n.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from glm_jax.data.tokenizer import eos_id


def encode_documents(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Documents -> one int32 stream [N], each document followed by the end-of-text token."""
    eos = eos_id(tok)
    parts = [np.asarray(e.ids + [eos], np.int32) for e in tok.encode_batch(texts)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def _check_long_enough(tokens: np.ndarray, seq_len: int) -> None:
    if tokens.size < seq_len + 1:
        raise ValueError(f"token stream of {tokens.size} tokens is shorter than seq_len + 1 = {seq_len + 1}; "
                         "use more data or a shorter --seq-len")


class TokenBatches:
    """Iterator of (inputs int32 [B, L], targets int32 [B, L]); targets are inputs shifted by one."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int = 0, step: int = 0):
        _check_long_enough(tokens, seq_len)
        self.tokens, self.seq_len, self.batch_size, self.seed, self.step = tokens, seq_len, batch_size, seed, step

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size, endpoint=True)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self):
        return self

    def __next__(self):
        out = self.batch(self.step)
        self.step += 1
        return out

    def state(self) -> dict:
        return {"seed": self.seed, "step": self.step, "seq_len": self.seq_len, "batch_size": self.batch_size}

    @classmethod
    def from_state(cls, tokens: np.ndarray, state: dict) -> "TokenBatches":
        return cls(tokens, seq_len=state["seq_len"], batch_size=state["batch_size"], seed=state["seed"],
                   step=state["step"])


def heldout_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int):
    """Fixed, non-overlapping windows for validation: up to max_batches of [B, L] pairs."""
    _check_long_enough(tokens, seq_len)
    n = min((tokens.size - 1) // seq_len, batch_size * max_batches)
    n -= n % batch_size if n >= batch_size else 0
    windows = [tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(max(n, 1))]
    for b in range(0, len(windows), batch_size):
        chunk = np.stack(windows[b:b + batch_size])
        yield chunk[:, :-1], chunk[:, 1:]
