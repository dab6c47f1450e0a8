"""Reference (oracle) sparse MLA: dense [B, S, H, T] float32 logits under a mask built from
the indices. Meant for tests and small shapes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NoConfig
from pallas_kernels.paging import read_pages


def indices_to_mask(indices: jax.Array, num_keys: int) -> jax.Array:
    """indices int32 [B, S, K] -> bool [B, S, T]: True at every listed t in [0, T).

    Negative and out-of-range entries are ignored; duplicates count once."""
    idx = jnp.asarray(indices, jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < num_keys), idx, num_keys)

    def row(i):
        return jnp.zeros((num_keys + 1,), jnp.bool_).at[i].set(True)[:num_keys]

    return jax.vmap(jax.vmap(row))(idx)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: NoConfig = NoConfig(), interpret: bool = False):
    """Sparse MQA over one shared latent head, computed densely with a mask.

    q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v_dim]), indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]) with
    lse = log sum_{t selected} exp(sm_scale * q . kv[t]); rows without a valid index give
    out 0 and lse -inf (with finite gradients). Duplicate indices count once here.
    return_target: also the indexer target float32 [B, S, K] (`pallas_kernels.sparse_mla`), no
    gradient: the head mean of the probabilities, read at each slot's row.
    config, interpret: the registry's uniform arguments (nothing to tune, no Pallas to
    interpret)."""
    del config, interpret
    num_keys = kv.shape[1]
    qf = q.astype(jnp.float32)
    kvf = kv.astype(jnp.float32)
    logits = jnp.einsum("bshd,btd->bsht", qf, kvf, precision=lax.Precision.HIGHEST) * sm_scale
    mask = indices_to_mask(indices, num_keys)[:, :, None, :]            # [B, S, 1, T]
    logits = jnp.where(mask, logits, -jnp.inf)
    # Safe softmax: a fully masked row has max -inf; shift by 0 instead, so p = 0 there, and
    # take the log of 1 instead of 0 so no inf/NaN reaches the gradient.
    m = lax.stop_gradient(jnp.max(logits, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m[..., None])
    denom = jnp.sum(p, axis=-1)
    has_any = denom > 0
    safe = jnp.where(has_any, denom, 1.0)
    out = jnp.einsum("bsht,btd->bshd", p, kvf[..., :v_dim], precision=lax.Precision.HIGHEST)
    out = out / safe[..., None]
    lse = jnp.where(has_any, m + jnp.log(safe), -jnp.inf)
    if not return_target:
        return out.astype(q.dtype), lse
    head_mean = jnp.mean(p / safe[..., None], axis=2)                       # [B, S, T]
    valid = (indices >= 0) & (indices < num_keys)
    target = jnp.where(valid, jnp.take_along_axis(head_mean, jnp.where(valid, indices, 0), axis=-1), 0.0)
    return out.astype(q.dtype), lse, lax.stop_gradient(target)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: NoConfig = NoConfig(), interpret: bool = False):
    """The paged form's oracle: every logical row of slot `slot` read through the page table
    (`paging.read_pages`: an FP8 store dequantized to float32; cast to q's dtype), then `sparse_mla`.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], indices int32
    [B, S, K] logical rows (-1 or >= n * P = skip) -> (out [B, S, H, v_dim], lse f32 [B, S, H])."""
    kv = read_pages(kv_pages, slot, page_table).astype(q.dtype)
    return sparse_mla(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim, config=config, interpret=interpret)
