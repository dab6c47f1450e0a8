"""Loss terms: next-token cross-entropy, and the total-variation losses of MTP drafting.

The per-position terms come in two forms: on given logits [B, S, V], and "through the head"
(`head_cross_entropy`, `head_total_variation`): from hidden states [B, S, hidden] and the
function that maps them to logits, computed per chunk of HEAD_CHUNK positions and
rematerialised in the backward pass, so no [B, S, V] array exists. At 128K tokens and a 32K
vocabulary one float32 [S, V] array is 17 GB; the MTP cross-entropy and TV need several.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._common import map_query_chunks

#: Positions whose vocabulary-wide logits are live at once in the "through the head" terms.
HEAD_CHUNK = 2048


def token_nll(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """-log softmax(logits)[target] per position: logits [B, S, V], targets int32 [B, S] -> float32 [B, S]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Mean of x [B, S] over the positions where mask (bool, broadcastable to x) holds; all if None."""
    if mask is None:
        return jnp.mean(x)
    mask = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Mean next-token CE. logits float32 [B, S, V], targets int32 [B, S], mask bool [B, S]."""
    return masked_mean(token_nll(logits, targets), mask)


def head_cross_entropy(head: Callable, hidden: jnp.ndarray, targets: jnp.ndarray,
                       mask: jnp.ndarray | None = None, *, chunk: int = HEAD_CHUNK) -> jnp.ndarray:
    """`cross_entropy(head(hidden), targets, mask)` without the [B, S, V] logits in memory.

    head: hidden [B, C, hidden] -> logits [B, C, V]; hidden [B, S, hidden]; targets int32 [B, S]."""
    nll = map_query_chunks(lambda h, t: token_nll(head(h), t), (hidden, targets), (0, 0), chunk, remat=True)
    return masked_mean(nll, mask)


def head_total_variation(head: Callable, p_hidden: jnp.ndarray, q_hidden: jnp.ndarray, *,
                         chunk: int = HEAD_CHUNK) -> jnp.ndarray:
    """`total_variation(head(p_hidden), head(q_hidden))` per position, [B, S], chunked like
    `head_cross_entropy`; p (the target) gets no gradient."""
    return map_query_chunks(lambda p, q: total_variation(head(p), head(q)), (p_hidden, q_hidden), (0, 0), chunk,
                            remat=True)


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
    return masked_mean(1.0 - expected / len(tvs), mask)
