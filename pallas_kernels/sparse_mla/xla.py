"""Memory-sane XLA sparse MLA: gathers only the selected kv rows, chunked over queries.

Per chunk of C queries the live intermediates are the gathered rows [B, C, K, Dk] and the
logits [B, C, H, K]; no [S, T] mask or score matrix is ever built. Each chunk is
rematerialised in the backward pass, so gradients do not store the gathered rows of every
chunk either."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import XlaConfig
from pallas_kernels import fp8
from pallas_kernels.chunking import choose_q_chunk, map_query_chunks
from pallas_kernels.paging import gather_pages


def _bytes_per_query(batch: int, num_heads: int, topk: int, dk: int, v_dim: int, itemsize: int) -> int:
    # gathered rows (+ their f32 V copy) and ~4 [H, K] f32 arrays (logits, p, masks).
    return batch * topk * (dk * itemsize + 4 * v_dim + 16 * num_heads + 8)


def gather_rows(kv: jax.Array, indices: jax.Array) -> jax.Array:
    """kv [B, T, D], indices int32 [B, C, K] in [0, T) -> [B, C, K, D]."""
    return jax.vmap(lambda rows, idx: rows[idx])(kv, indices)


def _attend_chunk(q, indices, kv, *, sm_scale, v_dim, return_target):
    num_keys = kv.shape[1]
    valid = (indices >= 0) & (indices < num_keys)
    rows = gather_rows(kv, jnp.where(valid, indices, 0))                 # [B, C, K, Dk]
    return _attend_rows(q, rows, valid, sm_scale=sm_scale, v_dim=v_dim, return_target=return_target)


def _attend_rows(q, rows, valid, *, sm_scale, v_dim, return_target=False):
    """q [B, C, H, Dk], the selected rows [B, C, K, Dk], valid bool [B, C, K] -> (out, lse), and
    with return_target the indexer target float32 [B, C, K] from the same probabilities."""
    logits = jnp.einsum("bchd,bckd->bchk", q, rows, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = lax.stop_gradient(jnp.max(logits, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m[..., None])                                   # [B, C, H, K]
    denom = jnp.sum(p, axis=-1)
    has_any = denom > 0
    safe = jnp.where(has_any, denom, 1.0)
    values = rows[..., :v_dim].astype(jnp.float32)
    out = jnp.einsum("bchk,bckd->bchd", p, values, preferred_element_type=jnp.float32)
    out = out / safe[..., None]
    lse = jnp.where(has_any, m + jnp.log(safe), -jnp.inf)
    if not return_target:
        return out.astype(q.dtype), lse
    target = lax.stop_gradient(jnp.mean(p / safe[..., None], axis=2))       # [B, C, K]
    return out.astype(q.dtype), lse, target


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: XlaConfig = XlaConfig(), interpret: bool = False):
    """Sparse MQA over one shared latent head by gathering the selected rows, `config.q_chunk`
    queries at a time.

    q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v_dim]), indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]). Rows without a valid index
    give out 0 and lse -inf (finite gradients). Duplicate indices are each counted.
    return_target: also the indexer target float32 [B, S, K] (`pallas_kernels.sparse_mla`), from
    the same chunk's probabilities.
    interpret: the registry's uniform argument (no Pallas here)."""
    del interpret
    batch, seq_len, num_heads, dk = q.shape
    topk = indices.shape[-1]
    itemsize = jnp.dtype(kv.dtype).itemsize
    per_query = _bytes_per_query(batch, num_heads, topk, dk, v_dim, itemsize)
    chunk = choose_q_chunk(seq_len, per_query, config.q_chunk)

    def body(q_c, idx_c):
        return _attend_chunk(q_c, idx_c, kv, sm_scale=sm_scale, v_dim=v_dim, return_target=return_target)

    return map_query_chunks(body, (q, jnp.asarray(indices, jnp.int32)), (0, -1), chunk, remat=True)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: XlaConfig = XlaConfig(), interpret: bool = False):
    """`sparse_mla` over the rows the logical indices name through the page table, gathered
    from the store (`paging.gather_pages`, cast to q's dtype) `config.q_chunk` queries at a time.
    An FP8 store (`pallas_kernels.fp8.Fp8Latent`) is gathered field by field (its own bytes)
    and dequantized to float32 before the cast.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk] (or an Fp8Latent of such stores), page_table int32 [B, n], indices int32
    [B, S, K] (-1 or >= n * P = skip) -> (out [B, S, H, v_dim], lse f32 [B, S, H])."""
    del interpret
    batch, seq_len, num_heads, dk = q.shape
    topk = indices.shape[-1]
    itemsize = 4 if fp8.is_fp8(kv_pages) else jnp.dtype(kv_pages.dtype).itemsize
    per_query = _bytes_per_query(batch, num_heads, topk, dk, v_dim, itemsize)
    chunk = choose_q_chunk(seq_len, per_query, config.q_chunk)

    def body(q_c, idx_c):
        rows, valid = gather_pages(kv_pages, slot, page_table, idx_c)
        return _attend_rows(q_c, rows.astype(q.dtype), valid, sm_scale=sm_scale, v_dim=v_dim)

    return map_query_chunks(body, (q, jnp.asarray(indices, jnp.int32)), (0, -1), chunk)
