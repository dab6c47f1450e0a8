"""The dense warm-up's indexer KL of an IndexShare group: Pallas kernels for its forward tiles
(`gpu`); the op itself, its XLA passes and its backward are `glm_jax.layers.dense_kl`."""

from pallas_kernels.dense_kl import gpu

__all__ = ["gpu"]
