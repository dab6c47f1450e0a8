"""Token-wise work in fixed chunks of rows, so that a token's result does not depend on its batch.

A matmul, a norm or a softmax computes every row by itself, but the compiler chooses its
algorithm (tiles, split of the reduction, vector width) from the whole shape: the same token
alone and among 31 others can come out a rounding apart, and a near-tie in the logits then
flips a greedy token. `in_row_chunks` runs a token-wise function on chunks of exactly `rows`
tokens, zero-padded, one chunk after another, so the compiled code and every
row's reduction order are the same whatever the batch size or the number of tokens in a call.
An optimization barrier around each chunk keeps the compiler from fusing the chunk's work with
what surrounds it (which differs between calls).

The cached forward uses it when `KernelChoice.batch_invariant` is set (`glm_jax.ops`): the
layers' projections, norms, MLP / MoE and the LM head run this way, and so do the attention
and indexer kernels, each token given to them as a sequence of one query
(`glm_jax.cache.view.by_token`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


#: Calls of up to this many chunks run them one after another in the program itself; longer
#: ones (prefill) in a loop, whose every step costs a host round trip on a GPU (a verify step
#: of 32 sequences at 3 and 7 drafts ran 1.7x and 2x slower as a loop of 2 and 4 chunks).
UNROLLED_CHUNKS = 4


def in_row_chunks(fn: Callable, *arrays: jax.Array, rows: int | None, fills: tuple | None = None):
    """fn(*arrays) computed on chunks of `rows` tokens.

    arrays: each [B, S, ...] (the same B and S); fn maps arrays of [1, rows, ...] to a pytree
    of [1, rows, ...] arrays and must treat every token by itself (no mixing across tokens).
    fills: the padding tokens' value in each array (default 0), e.g. -1 for indices that a
    kernel then skips. rows None: fn(*arrays) as it is. -> fn's pytree with every leaf [B, S, ...]."""
    if rows is None:
        return fn(*arrays)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"in_row_chunks: rows must be a positive int or None, got {rows!r}")
    b, s = arrays[0].shape[:2]
    for a in arrays:
        if a.shape[:2] != (b, s):
            raise ValueError(f"in_row_chunks: every array must be [B, S, ...] with B, S = {b}, {s}; "
                             f"got one of shape {a.shape}")
    tokens = b * s
    chunks = -(-tokens // rows)

    def to_chunks(a, fill):
        flat = a.reshape((tokens,) + a.shape[2:])
        flat = jnp.pad(flat, [(0, chunks * rows - tokens)] + [(0, 0)] * (flat.ndim - 1), constant_values=fill)
        return flat.reshape((chunks, 1, rows) + a.shape[2:])

    def one_chunk(chunk_arrays):
        chunk_arrays = jax.lax.optimization_barrier(chunk_arrays)
        return jax.lax.optimization_barrier(fn(*chunk_arrays))

    chunked = tuple(to_chunks(a, f) for a, f in zip(arrays, fills or (0,) * len(arrays)))
    if chunks <= UNROLLED_CHUNKS:
        out, previous = [], None
        for i in range(chunks):
            # After the previous chunk: two chunks' matmuls against the same weights are then
            # not independent, and the compiler cannot merge them into one of twice the rows.
            chunk_arrays, _ = jax.lax.optimization_barrier((tuple(a[i] for a in chunked), previous))
            previous = one_chunk(chunk_arrays)
            out.append(previous)
        out = jax.tree.map(lambda *parts: jnp.stack(parts), *out)
    else:
        out = jax.lax.map(one_chunk, chunked)
    return jax.tree.map(lambda o: o.reshape((chunks * rows,) + o.shape[3:])[:tokens].reshape((b, s) + o.shape[3:]),
                        out)
