"""The decode-time KV cache: MLA latent rows on every layer, indexer keys on Full layers only.

Rows are addressed through pages; a contiguous cache is the special case of one page per
sequence (page size = max_len, page table [[0], [1], ...]):
    latent       [layer slots, pages, page_size, kv_lora + rope]   one slot per decoder layer
    index_keys   [key slots, pages, page_size, index_head_dim]      one slot per Full layer
    page_table   int32 [B, pages per sequence]: page of row t of sequence b = page_table[b, t // page_size]
    lengths      int32 [B]: rows written so far in each sequence
    split        static LayerSplit or None: with one, the slot axis is sharded over the mesh's
                 `layer` axis and padded to a multiple of its size (glm_jax.layer_split)
Layer l's latent slot is l (decoder order); Full layer number f (in order) has key slot f.
A page pool (glm_jax.page_pool) hands out pages to requests and fills the page table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glm_jax.config import GLMConfig
from glm_jax.layer_split import LayerSplit, padded_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    latent: jnp.ndarray
    index_keys: jnp.ndarray
    page_table: jnp.ndarray
    lengths: jnp.ndarray
    split: LayerSplit | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    @property
    def max_len(self) -> int:
        """Rows each sequence can address through its page table."""
        return self.page_table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def contiguous_page_table(batch: int) -> jnp.ndarray:
    """One page per sequence: int32 [B, 1] = [[0], [1], ...]."""
    return jnp.arange(batch, dtype=jnp.int32)[:, None]


def create_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None, *,
                 split: LayerSplit | None = None) -> KVCache:
    """An empty contiguous cache for `batch` sequences of up to `max_len` rows.

    Rows past the model's context may exist as padding of whole prefill chunks / decode blocks;
    the caller (decoding.generate.Generator) checks that real tokens fit the context."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(
        jnp.zeros((padded_slots(split, cfg.num_hidden_layers), batch, max_len, cfg.latent_dim), dtype),
        jnp.zeros((padded_slots(split, len(cfg.full_layers)), batch, max_len, cfg.index_head_dim), dtype),
        contiguous_page_table(batch), jnp.zeros((batch,), jnp.int32), split)


def create_mtp_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """The MTP layer's own cache: one Full layer, never split."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros((1, batch, max_len, cfg.latent_dim), dtype),
                   jnp.zeros((1, batch, max_len, cfg.index_head_dim), dtype),
                   contiguous_page_table(batch), jnp.zeros((batch,), jnp.int32))


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
