"""The decode-time KV cache: MLA latent rows on every layer, indexer keys on Full layers only.

Rows are addressed through pages (`pages`); a contiguous cache is the special case of one page
per sequence (page size = max_len, page table [[0], [1], ...]):
    latent       [layer slots, pages, page_size, kv_lora + rope]   one slot per decoder layer;
                 a row is [c_kv | k_rope] of one token
    index_keys   [key slots, pages, page_size, index_head_dim]      one slot per Full layer
    page_table   int32 [B, pages per sequence]: page of row t of sequence b = page_table[b, t // page_size]
    lengths      int32 [B]: rows written so far in each sequence
    split        static LayerSplit or None: with one, the slot axis is sharded over the mesh's
                 `layer` axis and padded to a multiple of its size (`layer_split`)
Layer l's latent slot is l (decoder order); Full layer number f (in order) has key slot f.
In the FP8 layout (dtype float8_e4m3fn, `fp8`) latent and index_keys are `Fp8Latent` /
`Fp8Keys` stores (NamedTuples of arrays sharing [slots, pages, page_size]), quantized per row
when written; `page_size`, `num_pages` and `layout` read any layout.
A page pool (`page_pool`) hands out pages to requests and fills the page table.

The model never reads these fields: it asks for the positions of the next tokens, the view of
one IndexShare group (`group_view`), puts the updated view back (`with_view`) and advances the
lengths (`advance`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glm_jax import ops
from glm_jax.cache import fp8
from glm_jax.cache.layer_split import LayerSplit, Placement, padded_slots
from glm_jax.cache.pages import contiguous_page_table, store_lead
from glm_jax.cache.view import GroupCacheView
from glm_jax.config import GLMConfig


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
        return store_lead(self.latent)[2]

    @property
    def num_pages(self) -> int:
        """Pages of the stores (all data shards)."""
        return store_lead(self.latent)[1]

    @property
    def layout(self) -> str:
        """"fp8", or the stores' dtype name ("bfloat16", "float32")."""
        return "fp8" if fp8.is_fp8(self.latent) else self.latent.dtype.name

    @property
    def max_len(self) -> int:
        """Rows each sequence can address through its page table."""
        return self.page_table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def positions(self, num_tokens: int) -> jnp.ndarray:
        """int32 [B, num_tokens]: the positions of the next tokens, lengths + [0, num_tokens)."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def group_view(self, first_layer, full_index, positions: jnp.ndarray,
                   kernels: ops.KernelChoice = ops.KernelChoice()) -> GroupCacheView:
        """The view of one IndexShare group whose layers start at decoder layer `first_layer`
        and whose Full layer is Full layer number `full_index` (ints or int32 scalars), for
        tokens at positions int32 [B, S], read through `kernels`."""
        return GroupCacheView(self.latent, self.index_keys, self.page_table, Placement(self.split),
                              first_layer, full_index, positions, kernels)

    def with_view(self, view: GroupCacheView) -> KVCache:
        """This cache holding the stores a group's view wrote."""
        return dataclasses.replace(self, latent=view.latent, index_keys=view.index_keys)

    def advance(self, num_tokens) -> KVCache:
        """Lengths advanced by num_tokens (int or int32 [B])."""
        return dataclasses.replace(self, lengths=self.lengths + num_tokens)


def create_paged_cache(cfg: GLMConfig, num_pages: int, page_size: int, page_table: jnp.ndarray, dtype=None, *,
                       split: LayerSplit | None = None) -> KVCache:
    """Empty stores of num_pages pages of page_size rows: latent [layer slots, num_pages,
    page_size, latent], index_keys [Full-layer slots, num_pages, page_size, D]; page_table
    int32 [B, pages per sequence]; lengths zero. dtype: the rows' (None: the model's;
    float8_e4m3fn: the FP8 layout, `fp8.empty_stores`; `fp8.store_dtype` maps the
    --kv-cache-dtype names)."""
    return _empty(cfg, padded_slots(split, cfg.num_hidden_layers), padded_slots(split, len(cfg.full_layers)),
                  num_pages, page_size, page_table, dtype, split)


def create_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None, *,
                 split: LayerSplit | None = None) -> KVCache:
    """An empty contiguous cache for `batch` sequences of up to `max_len` rows.

    Rows past the model's context may exist as padding of whole prefill chunks / decode blocks;
    the caller (decoding.generate.Generator) checks that real tokens fit the context."""
    return create_paged_cache(cfg, batch, max_len, contiguous_page_table(batch), dtype, split=split)


def create_mtp_cache(cfg: GLMConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """The MTP layer's own cache: one Full layer, never split; dtype as for `create_paged_cache`."""
    return _empty(cfg, 1, 1, batch, max_len, contiguous_page_table(batch), dtype, None)


def _empty(cfg: GLMConfig, latent_slots: int, key_slots: int, num_pages: int, page_size: int, page_table,
           dtype, split) -> KVCache:
    lengths = jnp.zeros((page_table.shape[0],), jnp.int32)
    if fp8.is_fp8_dtype(dtype):
        fp8.check_fp8_model(cfg)
        latent, keys = fp8.empty_stores(cfg, latent_slots, key_slots, num_pages, page_size)
        return KVCache(latent, keys, page_table, lengths, split)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros((latent_slots, num_pages, page_size, cfg.latent_dim), dtype),
                   jnp.zeros((key_slots, num_pages, page_size, cfg.index_head_dim), dtype),
                   page_table, lengths, split)


def cache_bytes_per_token(cfg: GLMConfig, *, layout: str = "bf16", index_share: bool = True) -> int:
    """Bytes one token occupies across all decoder layers (the MTP layer not included).

    layout "bf16": latent 2 B x (kv_lora + rope), indexer key 2 B x D.
    layout "fp8":  latent kv_lora e4m3 + kv_lora/128 fp32 scales + rope bf16 (656 B for GLM-5.2),
                   indexer key D e4m3 + one fp32 scale (132 B). (`fp8.bytes_per_token`)"""
    return fp8.bytes_per_token(cfg, layout, index_share=index_share)
