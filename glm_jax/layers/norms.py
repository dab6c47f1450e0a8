"""RMSNorm (the model's norms) and LayerNorm (the indexer's key norm); both compute in float32."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        xf = xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps))
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        xf = (xf - mean) * jnp.reciprocal(jnp.sqrt(var + self.eps))
        return (xf * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
