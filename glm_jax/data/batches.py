"""Token streams and the fixed validation windows (training batches come from `pipeline`)."""

from __future__ import annotations

import numpy as np

from glm_jax.data.tokenizer import eos_id
from glm_jax.extras import require

Tokenizer = require("tokenizers").Tokenizer


def encode_documents(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Documents -> one int32 stream [N], each document followed by the end-of-text token."""
    eos = eos_id(tok)
    parts = [np.asarray(e.ids + [eos], np.int32) for e in tok.encode_batch(texts)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def _check_long_enough(tokens: np.ndarray, seq_len: int) -> None:
    if tokens.size < seq_len + 1:
        raise ValueError(f"token stream of {tokens.size} tokens is shorter than seq_len + 1 = {seq_len + 1}; "
                         "use more data or a shorter --seq-len")


def heldout_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int):
    """Fixed, non-overlapping windows for validation: up to max_batches of [B, L] pairs."""
    _check_long_enough(tokens, seq_len)
    n = min((tokens.size - 1) // seq_len, batch_size * max_batches)
    n -= n % batch_size if n >= batch_size else 0
    windows = [tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(max(n, 1))]
    for b in range(0, len(windows), batch_size):
        chunk = np.stack(windows[b:b + batch_size])
        yield chunk[:, :-1], chunk[:, 1:]
