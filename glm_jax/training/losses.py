"""Loss terms: next-token cross-entropy for the model and for the MTP layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Mean next-token CE. logits float32 [B, S, V], targets int32 [B, S], mask bool [B, S]."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = log_z - picked
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def mtp_targets(targets: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Labels for MTP depth 1: position i predicts t_{i+2} = targets[i + 1].

    targets int32 [B, S] -> (labels [B, S], mask bool [B, S]; the last position has no label)."""
    labels = jnp.concatenate([targets[:, 1:], jnp.zeros_like(targets[:, :1])], axis=1)
    mask = jnp.arange(targets.shape[1])[None, :] < targets.shape[1] - 1
    return labels, jnp.broadcast_to(mask, targets.shape)
