"""Bias-free linear layer holding its weight as [in, out] (checkpoints store [out, in])."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.layers.matmul import einsum


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        init = jax.nn.initializers.normal(stddev=d_in ** -0.5)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        kernel = self.kernel[...]
        return einsum("...i,io->...o", x.astype(kernel.dtype), kernel).astype(kernel.dtype)
