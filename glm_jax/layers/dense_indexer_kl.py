"""The dense warm-up's indexer KL of an IndexShare group, in the absorbed form.

Layer j of a group (weight share_j) trains the group's indexer toward t_j, the head mean of its
causal attention probabilities over every visible key. With the layer's absorbed queries q_jh
and latent rows c_t, p_jh,t = exp(sm_scale q_jh . c_t - lse_jh) and t_j = mean_h p_jh; with
the indexer scores s_t = sum_h w_h relu(q'_h . k_t) and LSE_s over the visible keys,

    sum_j share_j KL(t_j || softmax(s)) = sum_j share_j sum_t t_j,t log t_j,t
                                          - sum_t tbar_t s_t + LSE_s,    tbar = sum_j share_j t_j.

The attention side is a constant target: gradients reach only the indexer's queries, keys and
head weights. The op (`ops.dense_indexer_kl`, i.e. `pallas_kernels.dense_indexer_kl`: XLA
passes over causal tiles) forms no [S, S] array.

The queries are the sequence's own tokens: query s sits at row s of the keys (the dense causal
form, as `MLAProjection.attend_causal`). Under context parallelism XLA partitions the op (it is
not split per query shard).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from glm_jax import ops
from glm_jax.forward_options import ForwardOptions


class DenseTarget(NamedTuple):
    """What one layer contributes to its group's dense KL (constants, no gradient):
    q float [B, S, H, Dk] its absorbed queries, latent [B, S, Dk] its latent rows."""

    q: jax.Array
    latent: jax.Array


def dense_group_kl(targets: Sequence[DenseTarget], *, idx_q: jax.Array, idx_keys: jax.Array, idx_w: jax.Array,
                   sm_scale: float, kv_len: jax.Array, kv_start: jax.Array | None = None,
                   shares: Sequence[float] | None = None,
                   options: ForwardOptions = ForwardOptions()) -> jax.Array:
    """sum_j share_j KL(t_j || softmax(indexer scores)) over the causal visible keys, summed over
    queries, averaged over the batch (a float32 scalar; `selected_kl.indexer_kl` of the expanded form).

    targets: the group's layers (`DenseTarget`, each [B, S, H, Dk] and [B, S, Dk]); idx_q
    [B, S, Hi, Di], idx_keys [B, S, Di], idx_w float32 [B, S, Hi]: the indexer's queries, keys
    and head weights (gradients flow into these only); kv_len int32 [B]; kv_start int32 [B, S]
    or None: the row where each query's document starts (packed rows). Key t is visible to query
    s iff kv_start[s] <= t <= s and t < kv_len. shares: one weight per layer (default
    1 / len(targets)). options: its kernels' `dense_indexer_kl` entry picks the implementation and its
    config (`pallas_kernels.DenseIndexerKLXlaConfig`: tiles of 512 at 4K, larger at long lengths)."""
    if not targets:
        raise ValueError("dense_group_kl needs at least one layer's target")
    rows = ops.dense_indexer_kl([t.q for t in targets], [t.latent for t in targets], idx_q, idx_keys, idx_w,
                                sm_scale=sm_scale, kv_len=kv_len, kv_start=kv_start, shares=shares, kernels=options.kernels)
    return jnp.sum(rows) / idx_q.shape[0]
