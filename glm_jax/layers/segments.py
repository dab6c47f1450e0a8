"""Packed rows: several documents in one sequence, told apart by segment ids.

A row of S tokens holds documents (segments) one after another; token i of the row belongs
to segment_ids[i]. Every query attends only keys of its own segment, and RoPE counts
positions from each segment's first token:

    kv_start[i]  = the row index where token i's segment starts   (first key it may attend)
    positions[i] = i - kv_start[i]                                (RoPE position in the document)
so the row index of token i is kv_start[i] + positions[i].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
