"""The indexer ops built from a backend's Pallas kernels, shared by `gpu` and `tpu`: the
differentiable scores (registered with the backend's scores kernel bound), and the top-k as
the scores kernel followed by the threshold selection, over chunks of queries.

A backend module supplies its kernels as plain functions:

    scores_fn(q [B, C, H, D], k [B, T, D], weights f32 [B, C, H], *, q_pos int32 [B, C],
              kv_len int32 [B], kv_start int32 [B, C], config, interpret) -> f32 [B, C, T]
              (or its paged form over a store and page table, bound into `topk`'s scores_fn)
    select_fn(scores f32 [R, T] (-inf = masked), k) -> int32 [R, k]   (exact top-k per row)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._common import XlaConfig, check_topk, pad_topk, start_or_zero
from pallas_kernels.chunking import map_query_chunks
from pallas_kernels.indexer_topk import xla

#: Upper bound on the score bytes of one query chunk of the top-k (longer prefills are chunked).
SCORE_BUDGET_BYTES = 2 * 2**30


def query_chunk(batch: int, seq_len: int, num_keys: int, multiple: int, q_chunk: int | None) -> int:
    """Queries per top-k chunk: q_chunk when given, else the most whose float32 scores [B, C, T]
    stay under SCORE_BUDGET_BYTES, a multiple of `multiple` (at least one), at most seq_len."""
    if q_chunk is not None:
        return int(q_chunk)
    per_query = batch * max(num_keys, 1) * 4
    return min(seq_len, max(multiple, SCORE_BUDGET_BYTES // per_query // multiple * multiple))


def topk(q: jax.Array, weights: jax.Array, *, topk: int, q_pos: jax.Array, kv_start: jax.Array | None,
         num_keys: int, scores_fn: Callable, select_fn: Callable, q_chunk: int) -> jax.Array:
    """Contract of `pallas_kernels.indexer_topk` from a backend's kernels (module docstring),
    `q_chunk` queries at a time. scores_fn(q_c, w_c, *, q_pos, kv_start) -> f32 [B, C, num_keys]
    has the keys, kv_len, config and interpret bound (contiguous or paged keys alike).

    q [B, S, H, D], weights f32 [B, S, H], q_pos int32 [B, S], kv_start int32 [B, S] or None
    -> int32 [B, S, topk]."""
    topk = check_topk(topk)
    batch, seq_len = q.shape[:2]
    if num_keys == 0:
        return jnp.full((batch, seq_len, topk), -1, jnp.int32)

    def body(q_c, w_c, pos_c, start_c):
        s = scores_fn(q_c, w_c, q_pos=pos_c, kv_start=start_c)
        rows = s.shape[0] * s.shape[1]
        idx = select_fn(s.reshape(rows, num_keys), min(topk, num_keys))
        return idx.reshape(s.shape[0], s.shape[1], -1)

    args = (q, weights, jnp.asarray(q_pos, jnp.int32), start_or_zero(kv_start, q_pos))
    return pad_topk(map_query_chunks(body, args, (0, 0, -1, 0), q_chunk), topk)


def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array, *, q_pos: jax.Array,
                   kv_len: jax.Array, kv_start: jax.Array | None = None, scores_fn: Callable, config,
                   interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.indexer_scores` from a backend's scores kernel (registered
    with scores_fn bound), differentiable in q, k and weights: the backward pass is that of the
    `xla` scores (the indexer losses train through them), `config.q_chunk` queries at a time."""
    fn = _differentiable(scores_fn, config, bool(interpret))
    return fn(q, k, weights, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_len, jnp.int32),
              start_or_zero(kv_start, q_pos))


@functools.cache
def _differentiable(scores_fn: Callable, config, interpret: bool):
    forward = functools.partial(scores_fn, config=config, interpret=interpret)
    backward = XlaConfig(q_chunk=config.q_chunk)

    @jax.custom_vjp
    def fn(q, k, weights, q_pos, kv_len, kv_start):
        return forward(q, k, weights, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start)

    def fwd(*args):
        return fn(*args), args

    def bwd(res, g):
        q, k, weights, q_pos, kv_len, kv_start = res
        _, vjp = jax.vjp(lambda a, b, c: xla.indexer_scores(
            a, b, c, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start, config=backward), q, k, weights)
        return (*vjp(g), None, None, None)

    fn.defvjp(fwd, bwd)
    return fn
