"""The sparse-stage indexer KL of an IndexShare group, its indexer side computed once per group.

Layer j of a group (share_j = 1 / group size) trains the group's indexer toward its target t_j
[B, S, K]: the L1-normalised head sum of its attention probabilities over the selected set,
which the sparse attention kernel writes beside its output (`ops.sparse_mla(return_target=True)`;
a constant). The indexer's distribution q = softmax over the selected slots of its scores is
the same for every layer of the group (same indices, same indexer), so

    sum_j share_j KL(t_j || q) = sum_j share_j sum_k t_j log t_j  -  sum_k tbar log q,
    tbar = sum_j share_j t_j.

Each layer adds its weighted negative entropy and its target to a `TargetSum`; the group then
gathers the indexer keys, scores, normalises and differentiates once, on tbar
(`ops.indexer_cross_entropy`, gradients into the indexer's queries, keys and head weights only).
Equal, value and gradients, to the per-layer sum of `indexer_kl` over the selected set
(tests/test_losses.py). Memory: tbar, float32 [B, S, K] per group (as large as the group's
int32 top-k), is kept for the backward pass; no [S, T] matrix is built.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm_jax import ops
from glm_jax.forward_options import ForwardOptions


class TargetSum(NamedTuple):
    """The layers' part of a group's selected-set KL so far: neg_entropy float32 scalar (sum_j
    share_j of sum over queries and slots of t_j log t_j), tbar float32 [B, S, K] (sum_j share_j t_j)."""

    neg_entropy: jax.Array
    tbar: jax.Array


def add_target(acc: TargetSum | None, target: jax.Array, share: float) -> TargetSum:
    """acc (None: the first layer) + one layer's target float32 [B, S, K] with weight share."""
    t = jax.lax.stop_gradient(target)
    neg_entropy = share * jnp.sum(jnp.where(t > 0, t * jnp.log(jnp.where(t > 0, t, 1.0)), 0.0))
    if acc is None:
        return TargetSum(neg_entropy, share * t)
    return TargetSum(acc.neg_entropy + neg_entropy, acc.tbar + share * t)


def selected_set_kl(acc: TargetSum, *, idx_q: jax.Array, idx_keys: jax.Array, idx_w: jax.Array,
                    indices: jax.Array, options: ForwardOptions = ForwardOptions()) -> jax.Array:
    """sum_j share_j KL(t_j || q) summed over queries, averaged over the batch (a scalar).

    acc: the group's layers' `TargetSum`; idx_q [B, S, Hi, Di], idx_keys [B, T, Di], idx_w
    float32 [B, S, Hi]: the indexer's queries, keys and head weights (gradients flow into these
    only); indices int32 [B, S, K] (-1 = none); options: its kernels' `indexer_cross_entropy`
    entry picks the implementation.
    Under context parallelism each device computes its own queries' part (`ops`)."""
    cross = ops.indexer_cross_entropy(idx_q, idx_keys, idx_w, indices, acc.tbar, kernels=options.kernels)
    return (acc.neg_entropy + jnp.sum(cross)) / indices.shape[0]


def head_summed_target(probs: jnp.ndarray) -> jnp.ndarray:
    """probs [B, nh, S, T] -> L1-normalised head sum [B, S, T], no gradient."""
    p = jax.lax.stop_gradient(jnp.sum(probs, axis=1))
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def indexer_kl(target: jnp.ndarray, logits: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """sum over queries of KL(target || softmax(logits restricted to mask)), averaged over B.

    target [B, S, T] (rows sum to 1, zero outside mask), logits [B, S, T], mask bool [B, S, T]."""
    masked = jnp.where(mask, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    log_z = jnp.log(jnp.maximum(jnp.sum(jnp.exp(masked - row_max), axis=-1, keepdims=True), 1e-30)) + row_max
    log_q = jnp.where(mask, logits - log_z, 0.0)
    safe_p = jnp.where(target > 0, target, 1.0)
    kl = jnp.where(target > 0, target * (jnp.log(safe_p) - log_q), 0.0)
    return jnp.sum(kl) / target.shape[0]
