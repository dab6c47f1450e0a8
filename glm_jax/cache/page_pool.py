"""A pool of KV-cache pages shared by requests, with a page table per request.

A page holds `page_size` token rows of one request in every layer slot of the cache: latent
rows in each decoder layer's slot, indexer-key rows only in the Full layers' slots (Shared
layers have no key slot). One page id addresses the same rows in every slot, so a request
needs one page table. With LayerSplit each device stores only its own layers' slots of every
page, so the pool's memory per device shrinks with the `layer` axis while page ids stay global.

    pool = PagePool(cfg, num_pages=64, page_size=16, data_shards=1)
    pages = pool.allocate("req-1", tokens=300)      # CacheFullError if it cannot fit
    more = pool.grow("req-1", tokens=330)           # the pages added as the sequence grows
    pool.release("req-1")                           # its pages go back to the free list
    table = pool.page_table(["req-1", None], width=20)   # int32 [B, width]

Page 0 of each data shard is a scratch page: table slots not backed by an allocation point to
it, so padding rows written past a request's last page land there and are never read.
With a `data` mesh axis the pages are split into `data_shards` contiguous ranges (the cache
shards its page axis over `data`); a request in batch row b takes pages from the range of the
shard that holds row b.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glm_jax.cache import fp8
from glm_jax.cache.layer_split import LayerSplit
from glm_jax.cache.store import KVCache, create_paged_cache
from glm_jax.config import GLMConfig


class CacheFullError(RuntimeError):
    """A request needs more cache pages than the pool can give it."""


def page_bytes(cfg: GLMConfig, page_size: int, dtype=None, *, layout: str | None = None) -> int:
    """Bytes of one page over all layers: latent rows on every layer, keys on Full layers; in
    `dtype` (default the model's; float8_e4m3fn: the FP8 layout, scales included), or in a
    layout of `fp8.LAYOUTS` ("fp8": `fp8.page_bytes`)."""
    if layout is None and fp8.is_fp8_dtype(dtype):
        layout = "fp8"
    if layout is not None:
        return fp8.page_bytes(cfg, page_size, layout)
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    return page_size * itemsize * (cfg.num_hidden_layers * cfg.latent_dim + len(cfg.full_layers) * cfg.index_head_dim)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class PagePool:
    """Host-side allocator: free lists of page ids per data shard, pages held per request.
    dtype: the cache's rows (None: the model's dtype; float8_e4m3fn: the FP8 layout), which
    sets the bytes a page takes (`bytes_per_page`) and the stores `create_cache` makes."""

    def __init__(self, cfg: GLMConfig, *, num_pages: int, page_size: int, data_shards: int = 1, dtype=None):
        if page_size < 1 or num_pages < 2 * data_shards or num_pages % data_shards:
            raise ValueError(f"a pool needs page_size >= 1 and num_pages a multiple of {data_shards} data "
                             f"shard(s) with >= 2 pages each (one is scratch); got {num_pages} pages of {page_size}")
        self.cfg, self.num_pages, self.page_size, self.data_shards = cfg, num_pages, page_size, data_shards
        self.dtype = dtype
        per = num_pages // data_shards
        self.scratch = [s * per for s in range(data_shards)]
        self.free = [list(range(s * per + per - 1, s * per, -1)) for s in range(data_shards)]   # pop() = lowest
        self.held: dict[object, list[int]] = {}

    @property
    def bytes_per_page(self) -> int:
        return page_bytes(self.cfg, self.page_size, self.dtype)

    def describe(self) -> str:
        """The pool in words: "KV cache fp8, 63 pages of 16 tokens (1,008 tokens, 12.3 MiB)"."""
        return (f"KV cache {fp8.layout_of(self.cfg, self.dtype)}, {self.num_pages} pages of {self.page_size} tokens "
                f"({self.num_pages * self.page_size:,} tokens, {_mib(self.num_pages * self.bytes_per_page)})")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def free_pages(self, shard: int = 0) -> int:
        return len(self.free[shard])

    def allocate(self, request, tokens: int, shard: int = 0) -> list[int]:
        """Pages for `tokens` rows of a request that holds none; raises CacheFullError naming the memory."""
        if request in self.held:
            raise ValueError(f"request {request!r} already holds pages; release it first")
        return self.grow(request, tokens, shard)

    def grow(self, request, tokens: int, shard: int = 0) -> list[int]:
        """Pages so that `request` holds enough for `tokens` rows (allocation on demand, as a
        sequence grows) -> the pages added (often none). CacheFullError, naming the memory
        needed, when the free list of `shard` is short."""
        held = self.held.get(request, [])
        need = self.pages_for(tokens) - len(held)
        if need <= 0:
            return []
        if need > len(self.free[shard]):
            raise CacheFullError(self._shortage(request, tokens, shard))
        pages = [self.free[shard].pop() for _ in range(need)]
        self.held[request] = held + pages
        return pages

    def check_fits_ever(self, request, tokens: int) -> None:
        """CacheFullError, naming the memory, if `tokens` rows need more pages than a whole
        shard of the pool (the request could never run, however long it waits)."""
        if self.pages_for(tokens) > self.usable_pages:
            raise CacheFullError(self._shortage(request, tokens, None))

    @property
    def usable_pages(self) -> int:
        """Pages one request can hold at most: a data shard's pages minus its scratch page."""
        return self.num_pages // self.data_shards - 1

    def memory_for(self, tokens: int) -> str:
        """What `tokens` rows take, in words: "N pages of P tokens for T tokens = X MiB of KV cache"."""
        need = self.pages_for(tokens)
        return (f"{need} pages of {self.page_size} tokens for {tokens} tokens = {_mib(need * self.bytes_per_page)} "
                "of KV cache")

    def _shortage(self, request, tokens: int, shard: int | None) -> str:
        need = self.pages_for(tokens)
        free = self.usable_pages if shard is None else len(self.free[shard])
        what = "the whole pool" if need > self.usable_pages else "what is free now"
        return (f"request {request!r} needs {self.memory_for(tokens)}, more than {what}: {free} free of "
                f"{self.usable_pages} usable pages ({_mib(free * self.bytes_per_page)} free); shorten the "
                "request or give the pool more pages")

    def release(self, request) -> None:
        """Return the request's pages (if it holds any) to the free list; later requests reuse them."""
        pages = self.held.pop(request, [])
        if pages:
            self.free[pages[0] // (self.num_pages // self.data_shards)].extend(reversed(pages))

    def page_table(self, requests: list, width: int) -> np.ndarray:
        """int32 [len(requests), width]: each request's pages, then its shard's scratch page;
        None = an idle batch row (all scratch). Row b belongs to data shard b * shards // B."""
        table = np.zeros((len(requests), width), np.int32)
        for b, r in enumerate(requests):
            table[b] = self.scratch[b * self.data_shards // len(requests)]
            pages = self.held.get(r, []) if r is not None else []
            if len(pages) > width:
                raise ValueError(f"request {r!r} holds {len(pages)} pages, more than the table width {width}")
            table[b, :len(pages)] = pages
        return table

    def create_cache(self, batch: int, width: int, split: LayerSplit | None = None) -> KVCache:
        """The device-side pool: latent [layer slots, num_pages, page_size, latent], index_keys
        [Full-layer slots, num_pages, page_size, D], an all-scratch page table int32 [batch, width]."""
        return create_paged_cache(self.cfg, self.num_pages, self.page_size,
                                  jnp.asarray(self.page_table([None] * batch, width)), self.dtype, split=split)
