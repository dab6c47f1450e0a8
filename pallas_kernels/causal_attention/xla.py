"""Dense causal attention with `jax.nn.dot_product_attention` compiled by XLA (the [S, S]
scores of each head are materialised)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import NoConfig
from pallas_kernels.causal_attention.reference import segment_mask


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, kv_len: jax.Array | None,
           mask: jax.Array | None, segments: tuple[jax.Array, jax.Array] | None,
           implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention(implementation=implementation)`, causal, with kv_len and the
    documents of mask (or of segments when mask is None); arguments and result as in
    `pallas_kernels.causal_attention`."""
    if mask is None and segments is not None:
        mask = segment_mask(*segments, q.shape[1])
    return jax.nn.dot_product_attention(
        q, k, v, mask=None if mask is None else mask[:, None], scale=scale, is_causal=True,
        key_value_seq_lengths=None if kv_len is None else jnp.asarray(kv_len, jnp.int32),
        implementation=implementation)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     kv_len: jax.Array | None = None, mask: jax.Array | None = None,
                     segments: tuple[jax.Array, jax.Array] | None = None, config: NoConfig = NoConfig(),
                     interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.causal_attention`: q, k, v [B, S, N, d] -> [B, S, N, d].
    config, interpret: the registry's uniform arguments (nothing to tune, no Pallas)."""
    del config, interpret
    return attend(q, k, v, scale=scale, kv_len=kv_len, mask=mask, segments=segments, implementation="xla")
