"""The transposed sparse index: for every latent row, the (query, slot) pairs that selected it.

The sparse MLA backward needs dkv[t] = sum over the pairs (s, j) with idx[s, j] = t of a
per-pair gradient row. Summing them by key row through this index, in a fixed order, needs
no atomics and gives the same bits on every run. The index depends only on the indices, so
one build serves every layer that shares them (an IndexShare group): build it once with
`transpose_index` and pass it to each layer's backward.

Layout. The queries (rows of the flattened [B*S] axis) are processed in chunks of
`chunk_rows` (the backward's per-pair gradients of one chunk must fit in memory). Within chunk
c, each pair has a *local* id `(row - c * chunk_rows) * K + j`; the chunk's pairs are sorted by
(kv row, local id) and `position[c, local id]` is the pair's place in that list; the list of
flattened kv row r = b * T + t is places `offsets[c, r]` to `offsets[c, r + 1]`, and
`offsets[c, B*T]` is where the valid pairs end (invalid pairs, -1 or out of range, are placed
after it and never read). The backward's pairs kernel writes each pair's gradient row at its
place, so that the reduce kernel reads every row's gradients as one contiguous run.

Cost: one stable sort of B*S*K (key, id) pairs (XLA; a radix sort on a GPU), a scatter of
unique places and a binary search per (chunk, row); measured next to the kernels in
benchmarks/sparse_mla_backward.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

#: Spare rows after a chunk's sorted pair gradients (>= any reduce kernel's block of pairs);
#: the first of them takes the writes of padded slots.
SPARE_ROWS = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedIndex:
    """position int32 [n_chunks, chunk_rows * K] (each pair's place in its chunk's sorted list),
    offsets int32 [n_chunks, B*T + 1] (where each kv row's run of places starts; the last entry
    ends the valid pairs); chunk_rows, topk, num_keys: static (the chunking and the index shape
    it was built for)."""

    position: jax.Array
    offsets: jax.Array
    chunk_rows: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    num_keys: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_chunks(self) -> int:
        return self.offsets.shape[0]


def global_rows(indices: jax.Array, num_keys: int) -> jax.Array:
    """indices int32 [B, S, K] -> int32 [B, S, K]: b * T + t for a valid t in [0, T), else -1."""
    batch = indices.shape[0]
    idx = jnp.asarray(indices, jnp.int32)
    base = (jnp.arange(batch, dtype=jnp.int32) * num_keys)[:, None, None]
    return jnp.where((idx >= 0) & (idx < num_keys), idx + base, -1)


def default_chunk_rows(rows: int, topk: int, dk: int, itemsize: int, budget: int) -> int:
    """Queries per chunk so that one chunk's per-pair gradients [chunk, K, Dk] fit `budget`."""
    return int(max(1, min(rows, budget // max(1, topk * dk * itemsize))))


def transpose_index(indices: jax.Array, num_keys: int, *, chunk_rows: int) -> TransposedIndex:
    """indices int32 [B, S, K] (-1 / out of range = skip), num_keys T -> TransposedIndex
    (module docstring) for query chunks of `chunk_rows` rows of the flattened [B*S] axis."""
    batch, seq_len, topk = indices.shape
    rows = batch * seq_len
    chunk_rows = int(max(1, min(chunk_rows, rows)))
    n = -(-rows // chunk_rows)
    sentinel = batch * num_keys                          # key of an invalid pair, per chunk
    span = sentinel + 1
    if n * span >= 2**31 or n * chunk_rows * topk >= 2**31:
        raise ValueError(f"transpose_index: {n} chunks x {span} keys or {rows * topk} pairs "
                         "overflow int32; use fewer, larger chunks or shorter sequences")
    g = global_rows(indices, num_keys).reshape(rows, topk)
    g = jnp.pad(g, ((0, n * chunk_rows - rows), (0, 0)), constant_values=-1)
    g = g.reshape(n, chunk_rows * topk)
    chunk = jnp.arange(n, dtype=jnp.int32)[:, None]
    keys = (chunk * span + jnp.where(g >= 0, g, sentinel)).reshape(-1)
    local = jnp.broadcast_to(jnp.arange(chunk_rows * topk, dtype=jnp.int32), g.shape).reshape(-1)
    keys, local = lax.sort((keys, local), num_keys=1, is_stable=True)
    per = chunk_rows * topk
    place = jnp.arange(n * per, dtype=jnp.int32)
    owner = place // per                                  # chunk of each sorted entry
    position = jnp.zeros((n * per,), jnp.int32).at[owner * per + local].set(
        place - owner * per, unique_indices=True, mode="promise_in_bounds")
    want = (chunk * span + jnp.arange(span, dtype=jnp.int32)[None, :]).reshape(-1)
    offsets = jnp.searchsorted(keys, want, side="left").astype(jnp.int32).reshape(n, span)
    offsets = offsets - chunk * per
    return TransposedIndex(position=position.reshape(n, per), offsets=offsets,
                           chunk_rows=chunk_rows, topk=topk, num_keys=num_keys)


def checked_or_built(tindex: TransposedIndex | None, indices: jax.Array, num_keys: int,
                     chunk_rows: int) -> TransposedIndex:
    """A backward's transposed index: `tindex` when given (refused if built for another K or T),
    else built from indices int32 [B, S, K] with chunks of `chunk_rows` queries."""
    if tindex is None:
        return transpose_index(indices, num_keys, chunk_rows=chunk_rows)
    if (tindex.topk, tindex.num_keys) != (indices.shape[-1], num_keys):
        raise ValueError(f"tindex was built for K={tindex.topk}, T={tindex.num_keys}; "
                         f"got K={indices.shape[-1]}, T={num_keys}")
    return tindex
