"""Reference (oracle) dense causal attention: plain jnp in float32 with the [B, N, S, S] scores
in memory. Meant for tests and small shapes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NoConfig


def segment_mask(offsets: jax.Array, lengths: jax.Array, length: int) -> jax.Array:
    """The documents of packed rows as a mask: offsets int32 [B, M + 1] (where segment m starts,
    -1 after a row's last segment), lengths int32 [B, M] -> bool [B, S, S] with S = length,
    True where query s and key t lie in one segment. Tokens in no segment see nothing."""
    t = jnp.arange(length, dtype=jnp.int32)
    start = jnp.asarray(offsets, jnp.int32)[:, :-1, None]                  # [B, M, 1]
    end = start + jnp.asarray(lengths, jnp.int32)[:, :, None]
    inside = (t >= start) & (t < end) & (start >= 0)                      # [B, M, S]
    segment = jnp.where(jnp.any(inside, axis=1), jnp.argmax(inside, axis=1), -1)   # [B, S]
    return (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)


def visible_keys(length: int, kv_len: jax.Array | None, mask: jax.Array | None,
                 segments: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """bool [B or 1, S, S]: key t is visible to query s (t <= s, t < kv_len, the documents of
    mask, or of segments when mask is None); arguments as in `pallas_kernels.causal_attention`."""
    t = jnp.arange(length, dtype=jnp.int32)
    visible = (t[None, None, :] <= t[None, :, None])
    if kv_len is not None:
        visible = visible & (t[None, None, :] < jnp.asarray(kv_len, jnp.int32)[:, None, None])
    if mask is not None:
        visible = visible & mask
    elif segments is not None:
        visible = visible & segment_mask(*segments, length)
    return visible


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     kv_len: jax.Array | None = None, mask: jax.Array | None = None,
                     segments: tuple[jax.Array, jax.Array] | None = None, config: NoConfig = NoConfig(),
                     interpret: bool = False) -> jax.Array:
    """Causal softmax attention computed densely in float32.

    q, k, v [B, S, N, d], kv_len int32 [B] or None, mask bool [B, S, S] or None, segments
    (offsets int32 [B, M + 1], lengths int32 [B, M]) or None -> [B, S, N, d] in q.dtype:
    softmax over the visible keys (`visible_keys`) of scale * q . k, times v; 0 for a query
    that sees no key. config, interpret: the registry's uniform arguments (nothing to tune,
    no Pallas to interpret)."""
    del config, interpret
    visible = visible_keys(q.shape[1], kv_len, mask, segments)[:, None]   # [B, 1, S, S]
    f32 = lambda x: x.astype(jnp.float32)
    logits = jnp.einsum("bsnd,btnd->bnst", f32(q), f32(k), precision=lax.Precision.HIGHEST) * scale
    logits = jnp.where(visible, logits, -jnp.inf)
    m = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bnst,btnd->bsnd", p, f32(v), precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)
