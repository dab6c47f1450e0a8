"""Held-out text for the benchmarks that run a trained model on text it did not train on."""

from __future__ import annotations

import numpy as np

from glm_jax.data import corpus, sources


def heldout_documents(heldout: str | None):
    """The held-out documents (indexable texts): `heldout` (JSON lines), or the standard
    library's held-out split when None."""
    return sources.open_documents([heldout]) if heldout else sources.TextFiles(
        corpus.split_files(corpus.stdlib_source_files())[1])


def heldout_prompts(tok, count: int, length: int, heldout: str | None) -> np.ndarray:
    """int32 [count, length]: the first `length` tokens of the first `count` held-out documents
    that have that many."""
    docs = heldout_documents(heldout)
    rows = []
    for i in range(len(docs)):
        ids = tok.encode(docs[i]).ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return np.asarray(rows, np.int32)
    raise ValueError(f"only {len(rows)} held-out documents have {length} tokens; lower --prompts or --prompt-len")
