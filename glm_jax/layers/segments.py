"""Packed rows: several documents in one sequence, told apart by segment ids.

A row of S tokens holds documents (segments) one after another; token i of the row belongs
to segment_ids[i]. Every query attends only keys of its own segment, and RoPE counts
positions from each segment's first token:

    kv_start[i]  = the row index where token i's segment starts   (first key it may attend)
    positions[i] = i - kv_start[i]                                (RoPE position in the document)
so the row index of token i is kv_start[i] + positions[i].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def segment_layout(segment_ids: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """segment_ids int [B, S] (equal ids of neighbours = one segment) -> (positions, kv_start),
    both int32 [B, S]."""
    b, s = segment_ids.shape
    rows = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    starts_here = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    kv_start = jax.lax.cummax(jnp.where(starts_here, rows, 0), axis=1)
    return rows - kv_start, kv_start


def query_rows(positions: jnp.ndarray, kv_start: jnp.ndarray | None) -> jnp.ndarray:
    """Row index of each query int32 [B, S]: positions when rows are not packed (kv_start None)."""
    return positions if kv_start is None else kv_start + positions


def same_segment_ahead(segment_ids: jnp.ndarray, n: int) -> jnp.ndarray:
    """bool [B, S]: token i + n exists, is in token i's segment, and that segment is not padding (0)."""
    s = segment_ids.shape[1]
    if n >= s:
        return jnp.zeros(segment_ids.shape, bool)
    ahead = jnp.concatenate([segment_ids[:, n:], jnp.zeros_like(segment_ids[:, :n])], axis=1)
    return (ahead == segment_ids) & (segment_ids > 0) & (jnp.arange(s)[None, :] < s - n)


class SegmentTable(NamedTuple):
    """The segments of packed rows as offsets and lengths (the packed layout of fused attention
    kernels), for at most M segments per row; entries after a row's last segment are -1.

    offsets int32 [B, M + 1]: the row index where segment m starts (column M is always -1)
    lengths int32 [B, M]:     its number of tokens"""

    offsets: jnp.ndarray
    lengths: jnp.ndarray


def segment_table(positions: jnp.ndarray, max_segments: int) -> SegmentTable:
    """positions int32 [B, S] (per-segment, from `segment_layout`) -> the SegmentTable of the
    segments that start where positions is 0. Trailing padding counts as a segment of its own
    (it attends only itself). max_segments must be at least the segments of any row: later
    ones are dropped (see `count_segments`)."""
    b, s = positions.shape

    def row(pos):
        starts = jnp.nonzero(pos == 0, size=max_segments, fill_value=-1)[0].astype(jnp.int32)
        following = jnp.concatenate([starts[1:], jnp.full((1,), -1, jnp.int32)])
        ends = jnp.where(following >= 0, following, s)
        lengths = jnp.where(starts >= 0, ends - starts, -1)
        return jnp.concatenate([starts, jnp.full((1,), -1, jnp.int32)]), lengths

    offsets, lengths = jax.vmap(row)(positions)
    return SegmentTable(offsets, lengths)


def count_segments(segment_ids) -> int:
    """The most segments (padding included) of any row of segment_ids int [B, S], on the host."""
    ids = np.asarray(segment_ids)
    return int((np.diff(ids, axis=1) != 0).sum(axis=1).max()) + 1 if ids.size else 0


def segment_bound(n: int) -> int:
    """A static segment bound for rows of n segments: the next power of two (at least 4), so
    that batches share few bounds and compilations. cuDNN's packed backward keeps an f32
    [seq_len, heads, head width] buffer per segment of the bound (1.5 GiB at 128K tokens, 16
    heads of 192): rows of a few long documents suit it, rows of hundreds of short ones do not."""
    return max(4, 1 << (max(n, 1) - 1).bit_length())
