"""Rotary position embeddings: interleaved (adjacent pairs) and half-split layouts, with YaRN.

GLM-5.x rotates adjacent pairs (2i, 2i+1) of the RoPE dims in both MLA and the indexer;
DeepSeek-V3.2's indexer rotates the pairs (i, i + D/2) ("half-split"). The rotation is done in
place (the output keeps the input's layout): queries and keys get the same layout, so their dot
products equal those of implementations that de-interleave first.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies [dim // 2] (float64 numpy, static), YaRN-blended when `scaling` says so."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / theta ** exponents
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return inv_freq
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    return inv_freq / factor * (1 - keep_extrapolated) + inv_freq * keep_extrapolated


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale_factor(scaling: dict | None) -> float:
    """Multiplier of the attention softmax scale that YaRN asks for (1 without YaRN)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    m = yarn_mscale(float(scaling["factor"]), float(scaling.get("mscale_all_dim", 0) or 0))
    return m * m


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
               *, interleave: bool) -> jnp.ndarray:
    """Rotate x [B, S, ..., D] by positions [B, S]; D == 2 * len(inv_freq). Computed in float32."""
    dim = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + (dim // 2,))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    if interleave:
        pairs = xf.reshape(xf.shape[:-1] + (dim // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(xf.shape)
    else:
        a, b = xf[..., : dim // 2], xf[..., dim // 2:]
        out = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.astype(x.dtype)
