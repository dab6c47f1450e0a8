"""How one IndexShare group reads and writes the KV cache inside a cached forward.

Page addressing (`write_rows`, `gather_rows`, `read_sequence`) works on a store
[slots, pages, page_size, D] and a page table int32 [B, pages per sequence]; a contiguous
cache is one page per sequence. `GroupCacheView` adds placement (local, or LayerSplit with the
owner broadcasting) and the order of work the decoder follows:

    write_latent(0, rows); write_keys(keys)       the chunk's rows go to the owner's slots
    indices = select(indexer over the keys)       run where the keys are; int32 [B, S, K] shared
    fetch(indices)                                rows every layer of the group will attend:
                                                  layer 0 first, layers 1.. in a second transfer
                                                  that overlaps layer 0's attention and MLP
    kv, idx = attention_kv(j, indices, rows_j)    per layer; the chunk's own rows come from the
                                                  local computation (they need no transfer)

Fetch modes (static): "rows" gathers only the S * K selected rows per layer (decode: K rows
however long the context); "slice" takes the whole [B, T, D] slice when S * K >= T (prefill
chunks of short contexts), where it is the smaller message.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax.layer_split import Placement


def page_addresses(page_table: jnp.ndarray, page_size: int, num_pages: int, positions: jnp.ndarray):
    """positions int32 [B, ...] (negative = unused) -> (page ids, offsets), both shaped like positions.

    A position past the page table gets page id `num_pages` (out of range: writes are dropped)."""
    b = page_table.shape[0]
    t = jnp.maximum(positions, 0).reshape(b, -1)
    slot = t // page_size
    pages = jnp.take_along_axis(page_table, jnp.minimum(slot, page_table.shape[1] - 1), axis=1)
    pages = jnp.where(slot < page_table.shape[1], pages, num_pages)
    return pages.reshape(positions.shape), (t % page_size).reshape(positions.shape)


def write_rows(store, slot, page_table, positions, rows, mine=True):
    """store [slots, pages, P, D]; rows [B, S, D] at positions int32 [B, S] of local `slot`.

    mine: False (traced bool) keeps the old rows (another device owns this layer)."""
    pages, offs = page_addresses(page_table, store.shape[2], store.shape[1], positions)
    rows = rows.astype(store.dtype)
    if mine is not True:
        rows = jnp.where(mine, rows, store[slot, jnp.minimum(pages, store.shape[1] - 1), offs])
    return store.at[slot, pages, offs].set(rows, mode="drop")


def gather_rows(store, slot, page_table, indices):
    """-> [B, S, K, D]: rows at indices int32 [B, S, K] of local `slot` (row 0 where index < 0)."""
    pages, offs = page_addresses(page_table, store.shape[2], store.shape[1], indices)
    return store[slot, jnp.minimum(pages, store.shape[1] - 1), offs]


def read_sequence(store, slot, page_table):
    """-> [B, pages per sequence * P, D]: every row of each sequence, pages gathered in order."""
    pages = store[slot][page_table]                      # [B, n, P, D]
    return pages.reshape(pages.shape[0], -1, pages.shape[-1])


def fetch_mode(num_queries: int, topk: int, max_len: int) -> str:
    return "rows" if num_queries * topk < max_len else "slice"


class GroupCacheView:
    """The cache seen by one IndexShare group (layers first_layer .. first_layer + G - 1, whose
    Full layer is number full_index) while tokens at positions int32 [B, S] run through it.

    Holds the stores latent [slots, pages, P, latent] and keys [slots, pages, P, D]; methods
    replace them functionally, so read `.latent` / `.keys` back after the group ran. Every
    method that touches a store runs through `placement.manual` (per device under LayerSplit)."""

    def __init__(self, latent, keys, page_table, placement: Placement, first_layer, full_index, positions):
        self.latent, self.keys, self.page_table = latent, keys, page_table
        self.placement = placement
        self.first_layer = jnp.asarray(first_layer, jnp.int32)
        self.full_index = jnp.asarray(full_index, jnp.int32)
        self.positions = positions
        self.fetched: list[jnp.ndarray] = []
        self.mode = "slice"

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.latent.shape[2]

    def _write(self, store, index, rows):
        def fn(store, page_table, positions, rows, index):
            slot, mine = self.placement.locate(index, store.shape[0])
            return (write_rows(store, slot, page_table, positions, rows, mine),)
        return self.placement.manual(fn, (store,), (self.page_table, self.positions, rows), (index,),
                                     out_stores=1, out_rows=0)[0]

    def write_latent(self, j: int, rows: jnp.ndarray) -> None:
        """rows [B, S, latent] of layer j of the group."""
        self.latent = self._write(self.latent, self.first_layer + j, rows)

    def write_keys(self, keys: jnp.ndarray) -> None:
        """keys [B, S, D] of the Full layer."""
        self.keys = self._write(self.keys, self.full_index, keys)

    def select(self, select_fn, *batch_args) -> jnp.ndarray:
        """select_fn(keys [B, T, D], *batch_args) -> indices int32 [B, S, K]; run where the keys
        live and shared. batch_args: arrays with a leading batch dim the selection needs."""
        def fn(keys, page_table, *rest):
            *args, index = rest
            slot, mine = self.placement.locate(index, keys.shape[0])
            return (self.placement.share(select_fn(read_sequence(keys, slot, page_table), *args), mine),)
        return self.placement.manual(fn, (self.keys,), (self.page_table, *batch_args), (self.full_index,),
                                     out_stores=0, out_rows=1)[0]

    def read_latent(self, j: int) -> jnp.ndarray:
        """Every row of layer j: [B, T, latent] (e.g. the MTP layer's KVShare draft steps)."""
        def fn(latent, page_table, index):
            slot, mine = self.placement.locate(index, latent.shape[0])
            return (self.placement.share(read_sequence(latent, slot, page_table), mine),)
        return self.placement.manual(fn, (self.latent,), (self.page_table,), (self.first_layer + j,),
                                     out_stores=0, out_rows=1)[0]

    def fetch(self, indices: jnp.ndarray, num_layers: int) -> None:
        """Bring what attention of layers 0 .. num_layers-1 will read; indices int32 [B, S, K]."""
        self.mode = mode = fetch_mode(indices.shape[1], indices.shape[2], self.max_len)
        placement = self.placement

        def fn(latent, page_table, indices, first_layer):
            def owned(j):
                slot, mine = placement.locate(first_layer + j, latent.shape[0])
                if mode == "rows":
                    data = gather_rows(latent, slot, page_table, indices)
                else:
                    data = read_sequence(latent, slot, page_table)
                return data if mine is True else jnp.where(mine, data, jnp.zeros_like(data))

            # Layer 0 is needed at once; layers 1.. travel in one message while layer 0 computes.
            first = placement.share(owned(0), True)
            if num_layers == 1:
                return (first,)
            return first, placement.share(jnp.stack([owned(j) for j in range(1, num_layers)], axis=1), True)

        out = placement.manual(fn, (self.latent,), (self.page_table, indices), (self.first_layer,),
                               out_stores=0, out_rows=min(num_layers, 2))
        self.fetched = [out[0]] + ([out[1][:, j] for j in range(num_layers - 1)] if num_layers > 1 else [])

    def attention_kv(self, j: int, indices: jnp.ndarray, new_rows: jnp.ndarray):
        """-> (kv [B, T', latent], indices int32 [B, S, K] into kv) for layer j.

        new_rows [B, S, latent]: layer j's rows of the running chunk, patched in locally."""
        data = self.fetched[j]
        new_rows = new_rows.astype(data.dtype)
        b, s, k = indices.shape
        if self.mode == "slice":
            return data.at[jnp.arange(b)[:, None], self.positions].set(new_rows, mode="drop"), indices
        rel = indices - self.positions[:, :1, None]
        in_chunk = (indices >= 0) & (rel >= 0) & (rel < s)
        local = jax.vmap(lambda rows, r: rows[r])(new_rows, jnp.clip(rel, 0, s - 1))   # [B, S, K, latent]
        rows = jnp.where(in_chunk[..., None], local, data)
        slots = jnp.arange(s, dtype=jnp.int32)[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]
        return rows.reshape(b, s * k, -1), jnp.where(indices >= 0, slots[None], -1)
