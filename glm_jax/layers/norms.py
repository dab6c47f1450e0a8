"""RMSNorm (the model's norms) and LayerNorm (the indexer's key norm); both compute in float32."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
from flax import nnx

from glm_jax.logical_axes import check_dtype, param


def _check(owner: str, dim, eps, dtype, param_dtype) -> None:
    if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"{owner}: dim must be a positive int, got {dim!r}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{owner}: eps must be a number >= 0, got {eps!r}")
    check_dtype(owner, "dtype", dtype)
    check_dtype(owner, "param_dtype", param_dtype)


def _check_input(owner: str, x, dim: int) -> None:
    if x.shape[-1:] != (dim,):
        raise ValueError(f"{owner}: x has shape {x.shape}, but the layer normalises a last dimension of {dim}")


class RMSNorm(nnx.Module):
    """x / rms(x) * weight over the last dimension, computed in float32.

    eps: default 1e-6 (the layers built from a GLMConfig pass its rms_norm_eps); axes: the
    weight's logical name (default "hidden"); param_dtype: the weight's dtype (default float32);
    dtype: the output's (default None: x's)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 axes: tuple[str | None] = ("hidden",)):
        _check("RMSNorm", dim, eps, dtype, param_dtype)
        self.weight = param(jnp.ones((dim,), param_dtype), axes)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        _check_input("RMSNorm", x, self.weight.shape[0])
        xf = x.astype(jnp.float32)
        xf = xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps))
        return (xf * self.weight[...].astype(jnp.float32)).astype(self.dtype or x.dtype)


class LayerNorm(nnx.Module):
    """(x - mean) / std * weight + bias over the last dimension, in float32 (arguments as RMSNorm's)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 axes: tuple[str | None] = ("hidden",)):
        _check("LayerNorm", dim, eps, dtype, param_dtype)
        self.weight = param(jnp.ones((dim,), param_dtype), axes)
        self.bias = param(jnp.zeros((dim,), param_dtype), axes)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        _check_input("LayerNorm", x, self.weight.shape[0])
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        xf = (xf - mean) * jnp.reciprocal(jnp.sqrt(var + self.eps))
        return (xf * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(
            self.dtype or x.dtype)
