"""Loss terms: next-token cross-entropy, and the total-variation losses of MTP drafting."""

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


def shift_left(x: jnp.ndarray, n: int, fill=0) -> jnp.ndarray:
    """x [B, S, ...] -> x[:, n:] padded with `fill` at the end to length S."""
    if n == 0:
        return x
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def total_variation(p_logits: jnp.ndarray, q_logits: jnp.ndarray) -> jnp.ndarray:
    """TV(p, q) = 1 - sum_v min(p_v, q_v) per position, [B, S]; p (the target) gets no gradient."""
    p = jax.lax.stop_gradient(jax.nn.softmax(p_logits.astype(jnp.float32), axis=-1))
    q = jax.nn.softmax(q_logits.astype(jnp.float32), axis=-1)
    return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)


def end_to_end_tv(tvs: list[jnp.ndarray], mask: jnp.ndarray) -> jnp.ndarray:
    """L = 1 - (1/gamma) sum_j prod_{i<=j} (1 - TV_i), averaged over positions where mask holds.

    tvs: gamma arrays [B, S] (TV of draft depth i at each position), mask bool [B, S]."""
    alive = jnp.ones_like(tvs[0])
    expected = jnp.zeros_like(tvs[0])
    for tv in tvs:
        alive = alive * (1.0 - tv)
        expected = expected + alive
    loss = 1.0 - expected / len(tvs)
    mask = jnp.broadcast_to(mask, loss.shape).astype(jnp.float32)
    return jnp.sum(loss * mask) / jnp.maximum(jnp.sum(mask), 1.0)
