"""Token sampling with temperature and nucleus (top-p) filtering; temperature 0 is greedy."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_logits(logits: jnp.ndarray, temperature: jnp.ndarray, top_p: jnp.ndarray) -> jnp.ndarray:
    """logits float32 [..., V] -> tempered logits with everything outside the top-p nucleus at -inf.

    temperature and top_p are scalars (traced: one compiled program serves every setting);
    temperature must be > 0 here (greedy is handled by `sample_tokens`)."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p                      # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)


def sample_tokens(logits: jnp.ndarray, key: jax.Array, temperature, top_p) -> jnp.ndarray:
    """logits [B, V] -> int32 [B]; greedy (argmax, lowest id on ties) when temperature == 0."""
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.random.categorical(key, filtered_logits(logits, temperature, top_p), axis=-1)
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
