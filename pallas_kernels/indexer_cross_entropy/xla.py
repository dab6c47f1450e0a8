"""Memory-sane XLA indexer cross-entropy: gathers only the selected key rows, chunked over
queries (live per chunk of C queries: the rows [B, C, K, D] and the per-head scores
[B, C, H, K]), each chunk rematerialised in the backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import XlaConfig
from pallas_kernels.chunking import choose_q_chunk, map_query_chunks
from pallas_kernels.sparse_mla.xla import gather_rows
from pallas_kernels.indexer_cross_entropy.reference import slot_cross_entropy


def _chunk(q, weights, indices, target, k):
    valid = (indices >= 0) & (indices < k.shape[1])
    rows = gather_rows(k, jnp.where(valid, indices, 0))                             # [B, C, K, D]
    logits = jnp.einsum("bchd,bckd->bchk", q, rows.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.sum(jnp.maximum(logits, 0.0) * weights.astype(jnp.float32)[..., None], axis=2)
    return slot_cross_entropy(scores, valid, target)


def indexer_cross_entropy(q: jax.Array, k: jax.Array, weights: jax.Array, indices: jax.Array,
                          target: jax.Array, *, config: XlaConfig = XlaConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.indexer_cross_entropy`, `config.q_chunk` queries at a time.
    interpret: the registry's uniform argument (no Pallas here)."""
    del interpret
    batch, seq_len, heads, dim = q.shape
    topk = indices.shape[-1]
    per_query = batch * topk * (dim * jnp.dtype(k.dtype).itemsize + 8 * heads + 16)
    chunk = choose_q_chunk(seq_len, per_query, config.q_chunk)
    return map_query_chunks(lambda *a: _chunk(*a, k), (q, weights, jnp.asarray(indices, jnp.int32), target),
                            (0, 0, -1, 0), chunk, remat=True)
