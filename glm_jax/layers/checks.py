"""The layers' argument checks: a misused layer raises one line naming its own argument, before
anything is traced."""

from __future__ import annotations

import jax.numpy as jnp

from glm_jax.config import GLMConfig


def check_config(owner: str, cfg) -> None:
    """TypeError unless cfg is a GLMConfig."""
    if not isinstance(cfg, GLMConfig):
        raise TypeError(f"{owner}: cfg must be a GLMConfig (glm_jax.load_config), got {type(cfg).__name__}")


def check_hidden(owner: str, cfg: GLMConfig, x, name: str = "x") -> None:
    """ValueError unless x is [B, S, cfg.hidden_size]."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"{owner}: {name} must be an array [batch, sequence, hidden_size], got "
                         f"{'shape ' + str(tuple(shape)) if shape is not None else type(x).__name__}")
    if shape[-1] != cfg.hidden_size:
        raise ValueError(f"{owner}: {name} has hidden size {shape[-1]} (shape {tuple(shape)}), but cfg.hidden_size "
                         f"is {cfg.hidden_size}")


def check_rows(owner: str, name: str, value, shape: tuple[int, ...], integer: bool = True) -> None:
    """ValueError unless value has `shape` (and, with integer, an integer dtype)."""
    got = getattr(value, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"{owner}: {name} must have shape {tuple(shape)}, got "
                         f"{'shape ' + str(tuple(got)) if got is not None else type(value).__name__}")
    if integer and not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{owner}: {name} must hold integers (int32), got {value.dtype}")
