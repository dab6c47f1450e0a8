"""Paged key/value stores, as the paged decode ops read them.

A store is `[slots, pages, P, D]` (P rows per page; one slot per layer) or one slot of it
`[pages, P, D]`; a page table int32 `[B, n]` names the page of each block of P rows of
sequence b: logical row t of sequence b is `store[slot, page_table[b, t // P], t % P]`, for
0 <= t < n * P. Every page id in the table must be in [0, pages) (a pool points unused
entries at a scratch page). A contiguous cache is one page per sequence (page table
`[[0], [1], ...]`, P = its length).

The plain-jnp helpers here define the addressing; the Pallas kernels apply the same
arithmetic to their index vectors inside the kernel. A store may also be in the FP8 layout
(`pallas_kernels.fp8`: a NamedTuple of per-field stores sharing [slots, pages, P]); the
helpers then address every field alike and `read_pages` / `gather_pages` return the rows
dequantized to float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import fp8


def as_slots(store, op: str):
    """store [pages, P, D] or [slots, pages, P, D] -> [slots, pages, P, D] (each field of an FP8 store)."""
    if fp8.is_fp8(store):
        return type(store)(*(x[None] for x in store)) if store.values.ndim == 3 else store
    if store.ndim == 3:
        return store[None]
    if store.ndim != 4:
        raise ValueError(f"pallas_kernels.{op}: the paged store must be [pages, P, D] or [slots, pages, P, D], "
                         f"got shape {store.shape}")
    return store


def check_page_table(page_table: jax.Array, batch: int, op: str) -> jax.Array:
    """The page table as int32 [B, n]; ValueError for another rank or batch."""
    if jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != batch:
        raise ValueError(f"pallas_kernels.{op}: page_table must be int32 [B={batch}, pages per sequence], "
                         f"got shape {jnp.shape(page_table)}")
    return jnp.asarray(page_table, jnp.int32)


def logical_rows(page_table: jax.Array, page_size: int) -> int:
    """Rows a sequence addresses through its page table: n * P."""
    return page_table.shape[1] * page_size


def row_addresses(page_table: jax.Array, rows: jax.Array, page_size: int):
    """rows int32 [B, ...] logical rows -> (pages, offsets, valid), each shaped like rows.

    valid: 0 <= t < n * P; invalid rows get page page_table[b, 0] and offset 0 (a readable
    address, to be masked)."""
    b = page_table.shape[0]
    valid = (rows >= 0) & (rows < logical_rows(page_table, page_size))
    t = jnp.where(valid, rows, 0).reshape(b, -1)
    pages = jnp.take_along_axis(page_table, t // page_size, axis=1)
    return pages.reshape(rows.shape), (t % page_size).reshape(rows.shape), valid


def read_pages(store, slot, page_table: jax.Array) -> jax.Array:
    """store [slots, pages, P, D] -> [B, n * P, D]: every logical row of slot `slot`, in order
    (an FP8 store's rows dequantized to float32)."""
    if fp8.is_fp8(store):     # fields [slots, pages, P, ...] -> [B, n * P, ...]
        return fp8.dequantize(type(store)(*(x[slot][page_table].reshape(page_table.shape[0], -1, *x.shape[3:])
                                            for x in store)))
    pages = store[slot][page_table]                                    # [B, n, P, D]
    return pages.reshape(pages.shape[0], -1, pages.shape[-1])


def gather_pages(store, slot, page_table: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """store [slots, pages, P, D], rows int32 [B, ...] logical rows
    -> (the rows [B, ..., D] (an invalid one reads a valid address), valid bool [B, ...]).
    An FP8 store: each field gathered (its own bytes only), then dequantized to float32."""
    if fp8.is_fp8(store):
        pages, offsets, valid = row_addresses(page_table, rows, store.values.shape[2])
        return fp8.dequantize(type(store)(*(x[slot, pages, offsets] for x in store))), valid
    pages, offsets, valid = row_addresses(page_table, rows, store.shape[2])
    return store[slot, pages, offsets], valid
