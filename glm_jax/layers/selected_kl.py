"""The sparse-stage indexer KL without dense attention matrices, for long sequences.

The sparse stage trains each Full layer's indexer toward the main attention restricted to the
selected set: target[s, j] = L1-normalised sum over heads of softmax(sm_scale q[s] . kv[idx[s, j]])
over the selected j, and the loss is KL(target || softmax over j of the indexer logits at the
same positions). `decoder.indexer_kl` computes it from dense [B, S, T] matrices, which
a 128K-token sequence cannot hold. Here it is computed per chunk of queries from the absorbed
queries, the latent rows of the selected positions and the log-sum-exp the sparse attention
kernel already returns, so memory is O(chunk x K) and the attention side is not recomputed
over all keys. Gradients reach only the indexer inputs (the target is constant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm_jax.sharding import split_queries
from pallas_kernels._common import map_query_chunks


def _chunk_kl(q_abs, lse, idx, idx_q, idx_w, latent, idx_keys, *, sm_scale):
    """One chunk of C queries -> each query's KL, float32 [B, C]."""
    valid = idx >= 0                                                       # [B, C, K]
    safe = jnp.where(valid, idx, 0)
    take = jax.vmap(lambda rows, i: rows[i])                               # per sequence
    kv_sel = take(latent, safe)                                            # [B, C, K, Dk]
    logits = jnp.einsum("bchd,bckd->bchk", q_abs, kv_sel.astype(q_abs.dtype),
                        preferred_element_type=jnp.float32)
    p = jnp.exp(sm_scale * logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    p = jnp.where(valid[:, :, None, :], p, 0.0).sum(axis=2)                 # [B, C, K]
    target = jax.lax.stop_gradient(p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30))

    key_sel = take(idx_keys, safe)                                         # [B, C, K, Di]
    scores = jnp.einsum("bchd,bckd->bchk", idx_q, key_sel.astype(idx_q.dtype),
                        preferred_element_type=jnp.float32)
    index_logits = jnp.sum(jnp.maximum(scores, 0.0) * idx_w[..., None], axis=2)   # [B, C, K]
    masked = jnp.where(valid, index_logits, -jnp.inf)
    log_q = jax.nn.log_softmax(jnp.where(valid.any(-1, keepdims=True), masked, 0.0), axis=-1)
    safe_t = jnp.where(target > 0, target, 1.0)
    kl = jnp.where(target > 0, target * (jnp.log(safe_t) - jnp.where(valid, log_q, 0.0)), 0.0)
    return kl.sum(axis=2)


def selected_set_kl(q_abs: jax.Array, latent: jax.Array, indices: jax.Array, lse: jax.Array, *,
                    sm_scale: float, idx_q: jax.Array, idx_keys: jax.Array, idx_w: jax.Array,
                    q_chunk: int = 64) -> jax.Array:
    """Sum over queries of the selected-set indexer KL, averaged over the batch (a scalar).

    q_abs [B, S, H, Dk] absorbed attention queries; latent [B, T, Dk] latent rows; indices int32
    [B, S, K] (-1 = none); lse float32 [B, S, H] from the sparse attention over those indices;
    idx_q [B, S, Hi, Di], idx_keys [B, T, Di], idx_w float32 [B, S, Hi]: the indexer's queries,
    keys and head weights (gradients flow into these only).
    Equals `decoder.indexer_kl(head-summed target, indexer logits, selected mask)`. Under context
    parallelism each device computes the KL of its own queries (`sharding.split_queries`)."""
    per_query = split_queries(functools.partial(_per_query_kl, sm_scale=sm_scale, q_chunk=q_chunk),
                              dict(q_abs=q_abs, lse=lse, indices=indices, idx_q=idx_q, idx_w=idx_w),
                              dict(latent=latent, idx_keys=idx_keys))
    return jnp.sum(per_query) / q_abs.shape[0]


def _per_query_kl(q_abs, lse, indices, idx_q, idx_w, latent, idx_keys, *, sm_scale, q_chunk):
    """Each query's KL, float32 [B, S], in chunks of q_chunk queries; arguments as in `selected_set_kl`."""
    chunk = max(1, min(int(q_chunk), q_abs.shape[1]))

    def body(q_c, lse_c, idx_c, iq_c, iw_c):
        return _chunk_kl(q_c, lse_c, idx_c, iq_c, iw_c, latent, idx_keys, sm_scale=sm_scale)

    return map_query_chunks(body, (q_abs, lse, indices, idx_q, idx_w), (0, -jnp.inf, -1, 0, 0), chunk, remat=True)
