"""Page addressing: where token row t of sequence b lives in a paged store.

A store is [slots, pages, P, D] (P = page size; D = kv_lora + rope for the latent store, the
indexer head dim for the key store); a page table int32 [B, pages per sequence] names the page
of each block of P rows: row t of sequence b is at page_table[b, t // P], offset t % P. A
contiguous cache is one page per sequence (page table [[0], [1], ...]).

A store may also be in the FP8 layout (`pallas_kernels.fp8.Fp8Latent` / `Fp8Keys`: a NamedTuple of
stores sharing [slots, pages, P]): `write_rows` then quantizes each row on write (its own
scales) and `gather_rows` / `read_sequence` return the rows dequantized to float32;
`gather_stored` / `read_stored` return them in the store's layout (FP8 rows: what a LayerSplit
owner sends), `as_rows` dequantizes them after the transfer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax.ops import fp8


def contiguous_page_table(batch: int) -> jnp.ndarray:
    """One page per sequence: int32 [B, 1] = [[0], [1], ...]."""
    return jnp.arange(batch, dtype=jnp.int32)[:, None]


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
    if fp8.is_fp8(store):
        pages, offs = page_addresses(page_table, store.values.shape[2], store.values.shape[1], positions)
        new = fp8.quantize_like(store, rows)
        if mine is not True:
            new = jax.tree.map(lambda s, n: jnp.where(mine, n, s[slot, jnp.minimum(pages, s.shape[1] - 1), offs]),
                               store, new)
        return jax.tree.map(lambda s, n: s.at[slot, pages, offs].set(n, mode="drop"), store, new)
    pages, offs = page_addresses(page_table, store.shape[2], store.shape[1], positions)
    rows = rows.astype(store.dtype)
    if mine is not True:
        rows = jnp.where(mine, rows, store[slot, jnp.minimum(pages, store.shape[1] - 1), offs])
    return store.at[slot, pages, offs].set(rows, mode="drop")


def store_lead(store) -> tuple[int, int, int]:
    """(slots, pages, P) of a store in any layout."""
    return tuple(jax.tree.leaves(store)[0].shape[:3])


def gather_stored(store, slot, page_table, indices):
    """The rows at indices int32 [B, S, K] of local `slot` (row 0 where index < 0) in the
    store's own layout: [B, S, K, D], or for an FP8 store its NamedTuple of such fields (what
    a LayerSplit owner sends: FP8 bytes)."""
    _, num_pages, page_size = store_lead(store)
    pages, offs = page_addresses(page_table, page_size, num_pages, indices)
    return jax.tree.map(lambda x: x[slot, jnp.minimum(pages, num_pages - 1), offs], store)


def gather_rows(store, slot, page_table, indices):
    """-> [B, S, K, D]: rows at indices int32 [B, S, K] of local `slot` (row 0 where index < 0),
    dequantized to float32 for an FP8 store."""
    return as_rows(gather_stored(store, slot, page_table, indices))


def read_stored(store, slot, page_table):
    """Every row of each sequence, pages gathered in order, in the store's own layout:
    [B, pages per sequence * P, D] (an FP8 store: its fields so)."""
    b = page_table.shape[0]
    return jax.tree.map(lambda x: x[slot][page_table].reshape(b, -1, *x.shape[3:]), store)


def read_sequence(store, slot, page_table):
    """-> [B, pages per sequence * P, D]: every row of each sequence, pages gathered in order
    (float32 for an FP8 store)."""
    return as_rows(read_stored(store, slot, page_table))


def as_rows(rows):
    """Gathered rows as the kernels take them: FP8 rows dequantized to float32, others as they are."""
    return fp8.dequantize(rows) if fp8.is_fp8(rows) else rows


def stored_rows(store, rows):
    """rows [..., width] as `store` gives them back: quantized and dequantized (float32) for an
    FP8 store, cast to the store's dtype otherwise."""
    return as_rows(fp8.quantize_like(store, rows))
