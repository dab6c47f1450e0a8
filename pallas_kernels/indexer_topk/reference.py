"""Reference (oracle) implementation of the indexer: plain jnp, full [B, S, T] matrices.

Meant for tests and small shapes only; it materialises [B, S, H, T] float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NoConfig, check_topk, key_mask, normalize_zero, pad_topk
from pallas_kernels.paging import read_pages


def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array, *, q_pos: jax.Array,
                   kv_len: jax.Array, kv_start: jax.Array | None = None, config: NoConfig = NoConfig(),
                   interpret: bool = False) -> jax.Array:
    """Indexer scores, computed densely in float32.

    q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B]
    -> float32 [B, S, T]: sum_h weights[b,s,h] * relu(q[b,s,h] . k[b,t]) where
    kv_start[b,s] <= t <= q_pos[b,s] and t < kv_len[b] (kv_start: int32 [B, S] or None = 0),
    -inf elsewhere. config, interpret: the registry's uniform arguments (nothing to tune, no
    Pallas to interpret)."""
    del config, interpret
    qf = q.astype(jnp.float32)
    kf = k.astype(jnp.float32)
    logits = jnp.einsum("bshd,btd->bsht", qf, kf, precision=lax.Precision.HIGHEST)
    score = jnp.sum(jnp.maximum(logits, 0.0) * weights.astype(jnp.float32)[..., None], axis=2)
    valid = key_mask(q_pos, kv_len, k.shape[1], kv_start)
    return jnp.where(valid, score, -jnp.inf)


def topk_from_scores(score: jax.Array, valid: jax.Array, topk: int) -> jax.Array:
    """Exact top-k by a full sort on (invalid, -score, t).

    score float32 [..., T], valid bool [..., T] -> int32 [..., topk]: valid t ordered by
    descending score, ties by ascending t, then -1."""
    topk = check_topk(topk)
    num_keys = score.shape[-1]
    if num_keys == 0:
        return jnp.full(score.shape[:-1] + (topk,), -1, jnp.int32)
    s = normalize_zero(jnp.where(valid, score, 0.0))
    invalid = jnp.where(valid, 0, 1).astype(jnp.int32)
    t = lax.broadcasted_iota(jnp.int32, score.shape, score.ndim - 1)
    invalid_sorted, _, t_sorted = lax.sort((invalid, -s, t), dimension=score.ndim - 1, num_keys=3)
    kk = min(topk, num_keys)
    idx = jnp.where(invalid_sorted[..., :kk] == 0, t_sorted[..., :kk], -1)
    return pad_topk(idx.astype(jnp.int32), topk)


def indexer_topk(q: jax.Array, k: jax.Array, weights: jax.Array, *, topk: int, q_pos: jax.Array,
                 kv_len: jax.Array, kv_start: jax.Array | None = None, config: NoConfig = NoConfig(),
                 interpret: bool = False) -> jax.Array:
    """Top-k keys per query under the indexer scores (see `indexer_scores`).

    q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B]
    -> int32 [B, S, topk]: the valid t with the largest scores (ties: lower t wins), ordered by
    descending score then ascending t, -1 in the trailing slots when fewer are valid.
    config, interpret: as in `indexer_scores`."""
    del config, interpret
    score = indexer_scores(q, k, weights, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start)
    valid = key_mask(q_pos, kv_len, k.shape[1], kv_start)
    return topk_from_scores(score, valid, topk)


def paged_indexer_topk(q: jax.Array, k_pages: jax.Array, page_table: jax.Array, weights: jax.Array, *,
                       topk: int, q_pos: jax.Array, kv_len: jax.Array, slot, config: NoConfig = NoConfig(),
                       interpret: bool = False) -> jax.Array:
    """`indexer_topk` of every key of slot `slot` read through the page table
    (`paging.read_pages`: an FP8 store dequantized to float32; cast to q's dtype): the oracle of the paged form.

    q [B, S, H, D], k_pages [slots, pages, P, D], page_table int32 [B, n], weights f32 [B, S, H],
    q_pos int32 [B, S], kv_len int32 [B] -> int32 [B, S, topk]."""
    keys = read_pages(k_pages, slot, page_table).astype(q.dtype)
    return indexer_topk(q, keys, weights, topk=topk, q_pos=q_pos, kv_len=kv_len, config=config,
                        interpret=interpret)
