"""The selected latent rows of one query, gathered from HBM into VMEM by DMA (Mosaic TPU), shared
by the sparse MLA forward (`tpu`) and backward (`tpu_backward`) kernels.

The latent cache stays in HBM (memory_space=ANY) viewed as [B, T, 1, Dk]: one DMA per selected
row copies kv[b, t] into row j of a [2, block_k, 1, Dk] VMEM buffer. With the unit axis
second-minor, both the HBM source and the VMEM destination are indexed dynamically on a leading
axis only; a dynamic offset on the sublane axis (a [T, Dk] view) must be a multiple of 8 and does
not compile. The buffer is double-buffered over the grid's last ("arbitrary") axis: block k+1's
DMAs are issued before block k's are waited on, so the gather of the next block overlaps the
matmuls of this one. Invalid indices (-1 or out of range) fetch row 0; the kernels mask them.

A paged store is read in place, in the [slots, pages, P, Dk] layout the cache keeps (a
[.., P, 1, Dk] view of it would make XLA copy the whole store into that layout before every
call): a DMA may start at any row of a page whose first row is a whole packed word, so each
selected row comes with the rest of its word (n = 32 bits / the dtype's bits rows: 2 in bf16,
1 in float32) into rows n*j .. n*j + n - 1 of a [2, n * block_k, Dk] buffer (`packed_scratch`,
`packed_dest`), and `unpack_rows` keeps the selected one.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def scratch(block_k, dk, kv_dtype):
    """The VMEM row buffer [2, block_k, 1, Dk] and its two DMA semaphores."""
    return [pltpu.VMEM((2, block_k, 1, dk), kv_dtype), pltpu.SemaphoreType.DMA((2,))]


def packing(dtype) -> int:
    """Rows of `dtype` that share one 32-bit word of a TPU tile (1, 2 or 4)."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"TPU row gather: {jnp.dtype(dtype)} rows are not supported (8, 16 or 32 bits)")
    return 4 // itemsize


def packed_scratch(block_k, dk, kv_dtype):
    """The VMEM buffer [2, n * block_k, Dk] of whole packed words (n = `packing`) and its two
    DMA semaphores."""
    return [pltpu.VMEM((2, packing(kv_dtype) * block_k, dk), kv_dtype), pltpu.SemaphoreType.DMA((2,))]


def packed_source(page, offset, n):
    """page [P, Dk] (an HBM ref view), offset >= 0 -> the n rows of the packed word holding row
    `offset` (n a power of two)."""
    return page.at[pl.ds(pl.multiple_of(offset & -n, n), n)]


def packed_dest(n):
    """dest for `prefetch_and_wait` over a `packed_scratch` buffer: rows n*j .. n*j + n - 1."""
    return lambda buf, slot, j: buf.at[slot, pl.ds(pl.multiple_of(n * j, n), n)]


def unpack_rows(words, rows):
    """words [n * bk, Dk] (a `packed_scratch` slot: row j's packed word at rows n*j ..), rows
    int32 [1, bk] the gathered row numbers (only their low bits are read: row % n is the row's
    place in its word when pages hold whole words) -> [bk, Dk] the gathered rows."""
    n = packing(words.dtype)
    if n == 1:
        return words
    bits = 32 // n
    packed = pltpu.bitcast(words, jnp.uint32)          # [bk, Dk]; row n*j + i in bits [i*bits, (i+1)*bits)
    bk = packed.shape[0]
    shift = jnp.broadcast_to((rows & (n - 1)) * bits, (8, bk)).T[:, :1]      # [bk, 1]: the lane vector as a column
    unsigned = {8: jnp.uint8, 16: jnp.uint16}[bits]
    return lax.bitcast_convert_type((packed >> shift.astype(jnp.uint32)).astype(unsigned), words.dtype)


def _gather(idx_smem, source, buf, sem, *, block, slot, block_k, num_keys, dest):
    """Starts the DMAs of the rows of index block `block` into buf[slot]; source(r): the HBM
    row (a ref view) of row r, invalid indices reading row 0; dest(buf, slot, j): where row j
    lands."""

    def start(j, carry):
        r = idx_smem[block * block_k + j]
        r = jnp.where((r >= 0) & (r < num_keys), r, 0)
        pltpu.make_async_copy(source(r), dest(buf, slot, j), sem.at[slot]).start()
        return carry

    lax.fori_loop(0, block_k, start, 0)


def _wait(source, buf, sem, *, slot, block_k, dest):
    def wait(j, carry):
        pltpu.make_async_copy(source(0), dest(buf, slot, j), sem.at[slot]).wait()
        return carry

    lax.fori_loop(0, block_k, wait, 0)


def _unit_axis_dest(buf, slot, j):
    return buf.at[slot, j]


def prefetch_and_wait(idx_smem, source, buf, sem, *, kb, nk, block_k, num_keys, dest=_unit_axis_dest):
    """Double buffering over the K axis of the grid (step kb of nk) for the rows whose indices
    are idx_smem [nk * block_k]; source(r) -> the HBM row of row r (kv.at[b, r] for a contiguous
    [B, T, 1, Dk] cache, the packed word of the page table's translation for a paged store);
    dest(buf, slot, j) -> the VMEM view row j lands in (default: buf.at[slot, j] of a `scratch`
    buffer; `packed_dest` for a `packed_scratch` one); -> the slot of buf holding block kb's rows."""
    slot = kb % 2
    gather = functools.partial(_gather, idx_smem, source, buf, sem, block_k=block_k, num_keys=num_keys, dest=dest)

    @pl.when(kb == 0)
    def _():
        gather(block=0, slot=0)

    @pl.when(kb + 1 < nk)
    def _():
        gather(block=kb + 1, slot=1 - slot)

    _wait(source, buf, sem, slot=slot, block_k=block_k, dest=dest)
    return slot


def rows_of(buf, slot):
    """buf[slot] [block_k, 1, Dk] as a [block_k, Dk] value."""
    rows = buf[slot]
    return rows.reshape(rows.shape[0], rows.shape[-1])


def dot_nt(a, b):
    """a [M, D] . b [N, D]^T -> float32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
    """a [M, D] . b [D, N] -> float32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
