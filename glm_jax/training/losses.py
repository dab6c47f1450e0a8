"""Loss terms: next-token cross-entropy, and the total-variation losses of MTP drafting.

The per-position terms are defined on given logits [B, S, V]. The training loss computes them
through the vocabulary head per chunk of positions (`head_chunk`), so no [B, S, V] array exists:
at 128K tokens and a 32K vocabulary one float32 [S, V] array is 17 GB, and the MTP cross-entropy
and TV need several. `head_cross_entropy` does so for any head function (evaluation); the
training terms, with their gradients, are in `head_losses` (a linear head).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from glm_jax.ops import choose_q_chunk, map_query_chunks

#: Upper bound on one chunk's float32 logits [B, C, V] in the terms computed through the head.
HEAD_CHUNK_BYTES = 2**30


def head_chunk(batch: int, seq_len: int, vocab: int, chunk: int | None = None) -> int:
    """Positions per row and chunk C: `chunk` if given (capped at seq_len), else the largest power
    of two whose float32 logits [batch, C, vocab] fit HEAD_CHUNK_BYTES (1024 at batch 16 and a
    16K vocabulary)."""
    return choose_q_chunk(seq_len, 4 * batch * vocab, chunk, budget=HEAD_CHUNK_BYTES, max_chunk=max(seq_len, 1))


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
                       mask: jnp.ndarray | None = None, *, chunk: int | None = None) -> jnp.ndarray:
    """`cross_entropy(head(hidden), targets, mask)` without the [B, S, V] logits in memory.

    head: hidden [B, C, hidden] -> logits [B, C, V]; hidden [B, S, hidden]; targets int32 [B, S];
    chunk: positions per row and chunk (None: `head_chunk`). Each chunk is rematerialised in the
    backward pass; the training loss uses `head_losses.linear_cross_entropy` instead."""
    b, s = targets.shape
    vocab = jax.eval_shape(head, jax.ShapeDtypeStruct((b, 1) + hidden.shape[2:], hidden.dtype)).shape[-1]
    nll = map_query_chunks(lambda h, t: token_nll(head(h), t), (hidden, targets), (0, 0),
                           head_chunk(b, s, vocab, chunk), remat=True)
    return masked_mean(nll, mask)


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
