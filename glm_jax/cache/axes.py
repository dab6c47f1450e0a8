"""The cache's logical axes and its placement on a mesh.

Each KVCache field's dims carry logical names; `glm_jax.sharding.LOGICAL_AXIS_RULES` (the one
table) maps them to mesh axes: layer slots over `layer` (LayerSplit), pages over `data`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from glm_jax.cache.store import KVCache
from glm_jax.multihost import place
from glm_jax.sharding import LOGICAL_AXIS_RULES, logical_sharding

CACHE_AXES = {
    "latent": ("cache_layers", "cache_pages", "page_rows", "latent"),
    "index_keys": ("cache_layers", "cache_pages", "page_rows", "latent"),
    "page_table": ("batch", None),
    "lengths": ("batch",),
}


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """A KVCache of NamedShardings. Without LayerSplit the layer slots are replicated along
    the `layer` axis (each device keeps every layer). An FP8 store's fields each take the
    leading names of their dims (a key's scales [slots, pages, P] have no width)."""
    rules = LOGICAL_AXIS_RULES if cache.split is not None else {**LOGICAL_AXIS_RULES, "cache_layers": None}
    fields = {name: jax.tree.map(lambda x, name=name: logical_sharding(mesh, CACHE_AXES[name][:x.ndim], tuple(x.shape),
                                                                       f"cache.{name}", rules), getattr(cache, name))
              for name in CACHE_AXES}
    return dataclasses.replace(cache, **fields)


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """Place the cache with `cache_shardings` (checked before any transfer); on a mesh over
    several processes each process fills its own shards."""
    return place(cache, cache_shardings(cache, mesh))
