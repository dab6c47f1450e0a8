"""The optional dependencies: which extra of the `glm-jax` package installs each, and one clear
ImportError when a module that needs one is imported without it.

The core (`pip install glm-jax`: jax, flax, optax, einops, chex, pyyaml) runs `pallas_kernels`,
the layers, the model and its training step; data pipelines, checkpoints, tokenizers and the
HTTP server each come with an extra (docs/install.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: The extra (pyproject.toml's optional-dependencies) that installs each optional top-level module.
EXTRA_OF = {
    "grain": "data",
    "tokenizers": "tokenizers",
    "orbax": "checkpoints",
    "tqdm": "train",
    "tyro": "cli",
    "starlette": "serve",
    "uvicorn": "serve",
}


def require(module: str) -> ModuleType:
    """import_module(module), whose top-level package is one of `EXTRA_OF`; where that package
    is not installed, an ImportError naming the extra that installs it."""
    top = module.split(".")[0]
    extra = EXTRA_OF[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise ImportError(f"{module} is not installed; it comes with glm-jax's {extra!r} extra: "
                          f"pip install 'glm-jax[{extra}]' (in a clone: pip install '.[{extra}]')") from e
