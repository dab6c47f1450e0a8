"""Reference (oracle) dense indexer KL: every layer's [B, S, H, T] attention probabilities and the
indexer's [B, S, T] scores in float32, differentiated by autodiff. Meant for tests and small
shapes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NoConfig


def _masked_softmax_parts(z: jax.Array, visible: jax.Array):
    """z float32 [..., T], visible bool [..., T] -> (exp(z - m) 0 where not visible, its sum, m):
    m the visible maximum (0 where nothing is visible), a constant for autodiff."""
    z = jnp.where(visible, z, -jnp.inf)
    m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(z - m)
    return e, jnp.sum(e, axis=-1, keepdims=True), m


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale: float, kv_len, kv_start, shares,
                     config: NoConfig = NoConfig(), interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.dense_indexer_kl` (operands normalised there) -> float32 [B, S].
    config, interpret: the registry's uniform arguments (nothing to tune, no Pallas)."""
    del config, interpret
    seq_len = idx_q.shape[1]
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    visible = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < kv_len[:, None, None])
    if kv_start is not None:
        visible &= pos[None, None, :] >= kv_start[..., None]                      # [B, S, T]
    f32 = lambda x: x.astype(jnp.float32)
    tbar = neg_entropy = 0.0
    for q, latent, share in zip(qs, latents, shares):
        logits = jnp.einsum("bshd,btd->bsht", f32(q), f32(latent), precision=lax.Precision.HIGHEST) * sm_scale
        e, total, _ = _masked_softmax_parts(logits, visible[:, :, None, :])
        t = jnp.mean(e / jnp.where(total > 0, total, 1.0), axis=2)               # [B, S, T]
        tbar = tbar + share * t
        neg_entropy = neg_entropy + share * jnp.sum(jnp.where(t > 0, t * jnp.log(jnp.where(t > 0, t, 1.0)), 0.0),
                                                    axis=-1)
    dots = jnp.einsum("bshd,btd->bsht", f32(idx_q), f32(idx_keys), precision=lax.Precision.HIGHEST)
    scores = jnp.einsum("bsht,bsh->bst", jnp.maximum(dots, 0.0), f32(idx_w))
    _, total, m = _masked_softmax_parts(scores, visible)
    lse_s = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), 0.0)[..., 0]
    cross = jnp.sum(jnp.where(visible, lax.stop_gradient(tbar) * scores, 0.0), axis=-1)
    return neg_entropy - cross + lse_s
