"""The decode-time KV cache: MLA latent rows on every layer, indexer keys on Full layers only.

Laid out per group stack (see `layers.decoder.plan_groups`) so the model's scan over a stack
reads and writes its slice in place:
    latent[k]     [groups in stack k, layers per group, B, T, kv_lora + rope]
    index_keys[k] [groups in stack k, B, T, index_head_dim]      (one Full layer per group)
    lengths       int32 [B]: rows written so far in each sequence
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glm_jax.config import GLMConfig
from glm_jax.layers.decoder import plan_groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    latent: tuple[jnp.ndarray, ...]
    index_keys: tuple[jnp.ndarray, ...]
    lengths: jnp.ndarray

    @property
    def max_len(self) -> int:
        return self.latent[0].shape[3]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def create_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` rows.

    Rows past the model's context may exist as padding of whole prefill chunks / decode blocks;
    the caller (decoding.generate.Generator) checks that real tokens fit the context."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    latent, keys = [], []
    for plan in plan_groups(cfg):
        latent.append(jnp.zeros((plan.count, len(plan.kinds), batch, max_len, cfg.latent_dim), dtype))
        keys.append(jnp.zeros((plan.count, batch, max_len, cfg.index_head_dim), dtype))
    return KVCache(tuple(latent), tuple(keys), jnp.zeros((batch,), jnp.int32))


def create_mtp_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """The MTP layer's own cache: one group of one Full layer."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache((jnp.zeros((1, 1, batch, max_len, cfg.latent_dim), dtype),),
                   (jnp.zeros((1, batch, max_len, cfg.index_head_dim), dtype),),
                   jnp.zeros((batch,), jnp.int32))


def cache_bytes_per_token(cfg: GLMConfig, *, layout: str = "bf16", index_share: bool = True) -> int:
    """Bytes one token occupies across all decoder layers (the MTP layer not included).

    layout "bf16": latent 2 B x (kv_lora + rope), indexer key 2 B x D.
    layout "fp8":  latent kv_lora e4m3 + kv_lora/128 fp32 scales + rope bf16 (656 B for GLM-5.2),
                   indexer key D e4m3 + one fp32 scale (132 B)."""
    if layout == "bf16":
        latent, key = 2 * cfg.latent_dim, 2 * cfg.index_head_dim
    elif layout == "fp8":
        latent = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128) + 2 * cfg.qk_rope_head_dim
        key = cfg.index_head_dim + 4
    else:
        raise ValueError(f"layout must be 'bf16' or 'fp8', got {layout!r}")
    full = len(cfg.full_layers) if index_share else cfg.num_hidden_layers
    return cfg.num_hidden_layers * latent + full * key
