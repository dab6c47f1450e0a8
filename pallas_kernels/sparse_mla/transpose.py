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

The same relation as a bitmap (`key_bitmap`, `KeyBitmap`): for every latent row, one bit per
query of its sequence, set where the query selected the row, plus for every block of
`block_rows` rows the span of 32-query words holding a set bit. A backward that walks a block
of rows over contiguous tiles of queries (`gpu_backward`'s "by_key" dkv kernel) reads its
selections from it. Size: B*T*S/8 bytes (33.5 MB at 16 x 4096 queries and 4096 rows); cost:
one scatter-add of B*S*K bits and a reduction over the words (no sort).
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


#: Queries per word of a `KeyBitmap`.
WORD_BITS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBitmap:
    """bits int32 [B * T, W] (W = ceil(S / 32)): bit s % 32 of word [b * T + t, s // 32] is set
    when query (b, s) selected row t; spans int32 [B * ceil(T / block_rows), 2]: for each block
    of block_rows rows (b major), the first word holding a set bit and one past the last (0, 0
    for a block nobody selected); block_rows, seq_len, topk, num_keys: static."""

    bits: jax.Array
    spans: jax.Array
    block_rows: int = dataclasses.field(metadata=dict(static=True))
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    num_keys: int = dataclasses.field(metadata=dict(static=True))


def key_bitmap(indices: jax.Array, num_keys: int, *, block_rows: int) -> KeyBitmap:
    """indices int32 [B, S, K] (-1 / out of range = skip), num_keys T -> KeyBitmap (module
    docstring) with spans per block of `block_rows` rows.

    The bits are one scatter-add (the selecting queries of a row are distinct, so their bits'
    sum is their OR, in any order of the adds); a query that lists a row twice adds its bit
    twice, and the carry marks another query of that word instead: how duplicates count is
    unspecified, and only the duplicated row's dkv is affected."""
    batch, seq_len, topk = indices.shape
    words = -(-seq_len // WORD_BITS)
    blocks = -(-num_keys // block_rows)
    if batch * num_keys * words >= 2**31:
        raise ValueError(f"key_bitmap: {batch} x {num_keys} rows x {words} words overflow int32")
    idx = jnp.asarray(indices, jnp.int32)
    valid = (idx >= 0) & (idx < num_keys)
    row = jnp.where(valid, jnp.arange(batch, dtype=jnp.int32)[:, None, None] * num_keys + idx, batch * num_keys)
    s = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None]
    word = jnp.broadcast_to(s // WORD_BITS, idx.shape)
    bit = jnp.broadcast_to(jnp.left_shift(jnp.int32(1), s % WORD_BITS), idx.shape)
    bits = jnp.zeros((batch * num_keys, words), jnp.int32).at[row.reshape(-1), word.reshape(-1)].add(
        bit.reshape(-1), mode="drop")
    used = bits.reshape(batch, num_keys, words) != 0
    if blocks * block_rows != num_keys:
        used = jnp.pad(used, ((0, 0), (0, blocks * block_rows - num_keys), (0, 0)))
    used = jnp.any(used.reshape(batch, blocks, block_rows, words), axis=2)          # [B, blocks, W]
    lo = jnp.argmax(used, axis=-1).astype(jnp.int32)
    hi = words - jnp.argmax(used[..., ::-1], axis=-1).astype(jnp.int32)
    some = jnp.any(used, axis=-1)
    spans = jnp.stack([jnp.where(some, lo, 0), jnp.where(some, hi, 0)], axis=-1).reshape(batch * blocks, 2)
    return KeyBitmap(bits=bits, spans=spans, block_rows=block_rows, seq_len=seq_len, topk=topk,
                     num_keys=num_keys)
