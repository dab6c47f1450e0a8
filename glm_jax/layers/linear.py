"""Bias-free linear layer holding its weight as [in, out] (checkpoints store [out, in])."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.layers.matmul import einsum
from glm_jax.logical_axes import check_dtype, explicit_axes, leading_spec, on_auto_axes, param


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in_features, out_features].

    axes: the kernel's logical names (in, out), e.g. ("embed", "vocab") for a head; the
    default (None, None) leaves it replicated (`glm_jax.logical_axes`). param_dtype: the
    kernel's dtype (default float32); dtype: the computation's (x and the kernel are cast to it;
    default None: the kernel's dtype), which is also the output's."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32,
                 axes: tuple[str | None, str | None] = (None, None)):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Linear: {name} must be a positive int, got {value!r}")
        check_dtype("Linear", "dtype", dtype)
        check_dtype("Linear", "param_dtype", param_dtype)
        init = jax.nn.initializers.normal(stddev=in_features ** -0.5)
        self.kernel = param(init(rngs.params(), (in_features, out_features), param_dtype), axes)
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        kernel = self.kernel[...]
        if x.shape[-1:] != kernel.shape[:1]:
            raise ValueError(f"Linear: x has shape {x.shape}, but the layer takes in_features={kernel.shape[0]} "
                             "in its last dimension")
        if explicit_axes():
            out = leading_spec(x, x.ndim, x.ndim - 1)
            return on_auto_axes(self, lambda layer, x: layer(x), (x,), out)
        dtype = self.dtype or kernel.dtype
        return einsum("...i,io->...o", x.astype(dtype), kernel.astype(dtype)).astype(dtype)
