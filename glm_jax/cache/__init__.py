"""The decode-time KV cache, in one package.

    store.py        KVCache (latent rows [c_kv | k_rope] on every layer, indexer keys on Full
                    layers), create_cache / create_paged_cache / create_mtp_cache, bytes per token
    pages.py        page addressing: write, gather and read rows of a paged store
    view.py         GroupCacheView: how one IndexShare group writes, selects, fetches and attends
    layer_split.py  LayerSplit (which device owns which layer's slots), Placement, owner broadcast
    page_pool.py    PagePool: pages per request, page tables, reuse, CacheFullError
    fp8.py          the FP8 layout at the model's shapes (--kv-cache-dtype fp8): the setting's
                    names and checks, bytes per row / token / page, empty FP8 stores (the
                    layout and quantizer: pallas_kernels.fp8)
    axes.py         the cache's logical axes; cache_shardings / shard_cache on a mesh

The model reaches the cache only through `KVCache.positions`, `group_view`, `with_view` and
`advance`.
"""

from glm_jax.cache.axes import CACHE_AXES, cache_shardings, shard_cache
from glm_jax.cache.layer_split import LayerSplit, Placement, broadcast_from_owner
from glm_jax.cache.page_pool import CacheFullError, PagePool, page_bytes
from glm_jax.cache.pages import contiguous_page_table
from glm_jax.cache.store import (KVCache, cache_bytes_per_token, create_cache, create_mtp_cache,
                                 create_paged_cache)
from glm_jax.cache.view import GroupCacheView

__all__ = ["CACHE_AXES", "CacheFullError", "GroupCacheView", "KVCache", "LayerSplit", "PagePool", "Placement",
           "broadcast_from_owner", "cache_bytes_per_token", "cache_shardings", "contiguous_page_table",
           "create_cache", "create_mtp_cache", "create_paged_cache", "page_bytes", "shard_cache"]
