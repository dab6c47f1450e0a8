"""Memory-sane XLA implementation of the indexer.

Queries are processed in chunks of `XlaConfig.q_chunk` (lax.map), so only a chunk's
[B, chunk, H, T] float32 logits are live at once; a long prefill never materialises scores for
all queries (except `indexer_scores`, whose output is [B, S, T] by contract)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import XlaConfig, check_topk, key_mask, normalize_zero, pad_topk, start_or_zero
from pallas_kernels.chunking import choose_q_chunk, map_query_chunks
from pallas_kernels.paging import read_pages

_INT32_MAX = jnp.iinfo(jnp.int32).max


def _bytes_per_query(batch: int, num_heads: int, num_keys: int) -> int:
    # f32 logits per head, plus ~4 [T] f32/int32 arrays (score, mask, cumsum, sort key).
    return batch * num_keys * (4 * num_heads + 16)


def _chunk_scores(q, weights, q_pos, start, k, kv_len):
    """q [B, C, H, D], weights [B, C, H], q_pos, start [B, C] -> (score f32 [B, C, T], valid bool)."""
    logits = jnp.einsum("bchd,btd->bcht", q, k, preferred_element_type=jnp.float32)
    score = jnp.sum(jnp.maximum(logits, 0.0) * weights.astype(jnp.float32)[..., None], axis=2)
    return score, key_mask(q_pos, kv_len, k.shape[1], start)


def select_topk(score: jax.Array, valid: jax.Array, topk: int) -> jax.Array:
    """Exact top-k with the "lower t wins" tie rule, without a full sort.

    score float32 [..., T], valid bool [..., T] -> int32 [..., topk], ordered by descending
    score then ascending t, -1 in the trailing slots.

    1. v = the k-th largest masked score (lax.top_k values only; value ties are irrelevant).
    2. Select every valid t with score > v, plus the lowest-t valid entries equal to v until
       k are selected (a cumsum over the tie mask) -- this is the exact tie rule.
    3. Extract the selected t with lax.top_k on the distinct integer key T - t.
    4. Order the k survivors by (-score, t) with a small stable sort."""
    topk = check_topk(topk)
    num_keys = score.shape[-1]
    if num_keys == 0:
        return jnp.full(score.shape[:-1] + (topk,), -1, jnp.int32)
    kk = min(topk, num_keys)
    s = normalize_zero(jnp.where(valid, score, -jnp.inf))
    kth = lax.top_k(s, kk)[0][..., kk - 1:kk]
    above = valid & (s > kth)
    tied = valid & (s == kth)
    need = kk - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    tie_rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)
    selected = above | (tied & (tie_rank <= need))

    t = lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1)
    key = jnp.where(selected, num_keys - t, 0)
    top_key, _ = lax.top_k(key, kk)
    ok = top_key > 0
    idx = jnp.where(ok, num_keys - top_key, 0)

    sel_score = jnp.take_along_axis(s, idx, axis=-1)
    neg = jnp.where(ok, -sel_score, jnp.inf)
    t_key = jnp.where(ok, idx, _INT32_MAX)
    _, t_sorted = lax.sort((neg, t_key), dimension=neg.ndim - 1, num_keys=2)
    out = jnp.where(t_sorted == _INT32_MAX, -1, t_sorted).astype(jnp.int32)
    return pad_topk(out, topk)


def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array, *, q_pos: jax.Array,
                   kv_len: jax.Array, kv_start: jax.Array | None = None, config: XlaConfig = XlaConfig(),
                   interpret: bool = False) -> jax.Array:
    """Indexer scores, chunked over queries (`config.q_chunk` queries at a time).

    q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B]
    kv_start int32 [B, S] or None (0)
    -> float32 [B, S, T]: sum_h weights * relu(q . k) where kv_start <= t <= q_pos and
    t < kv_len, else -inf. interpret: the registry's uniform argument (no Pallas here)."""
    del interpret
    batch, seq_len, num_heads, _ = q.shape
    chunk = choose_q_chunk(seq_len, _bytes_per_query(batch, num_heads, k.shape[1]), config.q_chunk)

    def body(q_c, w_c, pos_c, start_c):
        score, valid = _chunk_scores(q_c, w_c, pos_c, start_c, k, kv_len)
        return jnp.where(valid, score, -jnp.inf)

    args = (q, weights, jnp.asarray(q_pos, jnp.int32), start_or_zero(kv_start, q_pos))
    return map_query_chunks(body, args, (0, 0, -1, 0), chunk)


def indexer_topk(q: jax.Array, k: jax.Array, weights: jax.Array, *, topk: int, q_pos: jax.Array,
                 kv_len: jax.Array, kv_start: jax.Array | None = None, config: XlaConfig = XlaConfig(),
                 interpret: bool = False) -> jax.Array:
    """Top-k keys per query, chunked over queries (see `select_topk` for the selection).

    q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B]
    -> int32 [B, S, topk], ordered by descending score then ascending t, -1 padded.
    config, interpret: as in `indexer_scores`."""
    del interpret
    topk = check_topk(topk)
    batch, seq_len, num_heads, _ = q.shape
    num_keys = k.shape[1]
    chunk = choose_q_chunk(seq_len, _bytes_per_query(batch, num_heads, num_keys), config.q_chunk)

    def body(q_c, w_c, pos_c, start_c):
        score, valid = _chunk_scores(q_c, w_c, pos_c, start_c, k, kv_len)
        return select_topk(score, valid, min(topk, max(num_keys, 1)))

    args = (q, weights, jnp.asarray(q_pos, jnp.int32), start_or_zero(kv_start, q_pos))
    out = map_query_chunks(body, args, (0, 0, -1, 0), chunk)
    return pad_topk(out, topk)


def paged_indexer_topk(q: jax.Array, k_pages: jax.Array, page_table: jax.Array, weights: jax.Array, *,
                       topk: int, q_pos: jax.Array, kv_len: jax.Array, slot, config: XlaConfig = XlaConfig(),
                       interpret: bool = False) -> jax.Array:
    """`indexer_topk` of every key of slot `slot` read through the page table
    (`paging.read_pages`: an FP8 store dequantized to float32; cast to q's dtype): the baseline of the paged form (XLA gathers the pages into a copy).

    q [B, S, H, D], k_pages [slots, pages, P, D], page_table int32 [B, n], weights f32 [B, S, H],
    q_pos int32 [B, S], kv_len int32 [B] -> int32 [B, S, topk]."""
    keys = read_pages(k_pages, slot, page_table).astype(q.dtype)
    return indexer_topk(q, keys, weights, topk=topk, q_pos=q_pos, kv_len=kv_len, config=config,
                        interpret=interpret)
