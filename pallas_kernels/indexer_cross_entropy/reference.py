"""Reference (oracle) indexer cross-entropy: every key's score [B, S, T] in float32, read at the
selected slots. Meant for tests and small shapes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NoConfig


def slot_cross_entropy(scores: jax.Array, valid: jax.Array, target: jax.Array) -> jax.Array:
    """scores float32 [..., K] (the indexer scores of the selected slots), valid bool [..., K],
    target float32 [..., K] -> float32 [...]: -sum over the valid slots of target * log softmax
    over the valid slots of scores; 0 where no slot is valid. No gradient reaches target."""
    z = jnp.where(valid, scores, -jnp.inf)
    m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    denom = jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.where(denom > 0, denom, 1.0))
    t = jnp.where(valid, lax.stop_gradient(target).astype(jnp.float32), 0.0)
    return -jnp.sum(t * jnp.where(valid, z - lse, 0.0), axis=-1)


def indexer_cross_entropy(q: jax.Array, k: jax.Array, weights: jax.Array, indices: jax.Array,
                          target: jax.Array, *, config: NoConfig = NoConfig(), interpret: bool = False):
    """q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], indices int32 [B, S, K] (-1 or out
    of range = skip), target float32 [B, S, K] -> float32 [B, S] (contract of
    `pallas_kernels.indexer_cross_entropy`), differentiated by autodiff.
    config, interpret: the registry's uniform arguments (nothing to tune, no Pallas)."""
    del config, interpret
    num_keys = k.shape[1]
    logits = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    scores = jnp.sum(jnp.maximum(logits, 0.0) * weights.astype(jnp.float32)[..., None], axis=2)   # [B, S, T]
    idx = jnp.asarray(indices, jnp.int32)
    valid = (idx >= 0) & (idx < num_keys)
    selected = jnp.take_along_axis(scores, jnp.where(valid, idx, 0), axis=-1)
    return slot_cross_entropy(selected, valid, target)
