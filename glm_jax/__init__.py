"""glm-jax: GLM-5.2-style grouped-indexer sparse attention models in JAX (Flax NNX).

Start at `glm_jax.load_config` and `glm_jax.GLMModel`; the layers, for models of your own, are
in `glm_jax.layers` (docs/using-the-layers.md); kernels live in the top-level `pallas_kernels`
package and are reached through `glm_jax.ops`. The names below are imported on first use, so
`import glm_jax` stays cheap.
"""

import importlib

__version__ = "0.1.0"

#: Entry points: name -> the module that defines it.
_EXPORTS = {
    "GLMConfig": "glm_jax.config",
    "ConfigError": "glm_jax.config",
    "load_config": "glm_jax.config",
    "preset_names": "glm_jax.config",
    "GLMModel": "glm_jax.model",
    "ForwardOptions": "glm_jax.forward_options",
    "KernelChoice": "glm_jax.ops",
    "OpChoice": "glm_jax.ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
