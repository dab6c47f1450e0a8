"""glm-jax: GLM-5.2-style grouped-indexer sparse attention models in JAX (Flax NNX).

Start at `glm_jax.config.load_config` and `glm_jax.model.GLMModel`; kernels live in the
top-level `pallas_kernels` package and are reached through `glm_jax.ops`.
"""

__version__ = "0.1.0"
