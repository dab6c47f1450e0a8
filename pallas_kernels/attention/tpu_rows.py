"""The selected latent rows of one query, gathered from HBM into VMEM by DMA (Mosaic TPU), shared
by the sparse MLA forward (`tpu`) and backward (`tpu_backward`) kernels.

The latent cache stays in HBM (memory_space=ANY) viewed as [B, T, 1, Dk]: one DMA per selected
row copies kv[b, t] into row j of a [2, block_k, 1, Dk] VMEM buffer. With the unit axis
second-minor, both the HBM source and the VMEM destination are indexed dynamically on a leading
axis only; a dynamic offset on the sublane axis (a [T, Dk] view) must be a multiple of 8 and does
not compile. The buffer is double-buffered over the grid's last ("arbitrary") axis: block k+1's
DMAs are issued before block k's are waited on, so the gather of the next block overlaps the
matmuls of this one. Invalid indices (-1 or out of range) fetch row 0; the kernels mask them.
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


def _gather(idx_smem, source, buf, sem, *, block, slot, block_k, num_keys):
    """Starts the DMAs of the rows of index block `block` into buf[slot]; source(r): the HBM
    row (a ref view) of row r, invalid indices reading row 0."""

    def start(j, carry):
        r = idx_smem[block * block_k + j]
        r = jnp.where((r >= 0) & (r < num_keys), r, 0)
        pltpu.make_async_copy(source(r), buf.at[slot, j], sem.at[slot]).start()
        return carry

    lax.fori_loop(0, block_k, start, 0)


def _wait(source, buf, sem, *, slot, block_k):
    def wait(j, carry):
        pltpu.make_async_copy(source(0), buf.at[slot, j], sem.at[slot]).wait()
        return carry

    lax.fori_loop(0, block_k, wait, 0)


def prefetch_and_wait(idx_smem, source, buf, sem, *, kb, nk, block_k, num_keys):
    """Double buffering over the K axis of the grid (step kb of nk) for the rows whose indices
    are idx_smem [nk * block_k]; source(r) -> the HBM row of row r (kv.at[b, r] for a contiguous
    [B, T, 1, Dk] cache, the page table's translation for a paged store); -> the slot of buf
    holding block kb's rows."""
    slot = kb % 2
    gather = functools.partial(_gather, idx_smem, source, buf, sem, block_k=block_k, num_keys=num_keys)

    @pl.when(kb == 0)
    def _():
        gather(block=0, slot=0)

    @pl.when(kb + 1 < nk)
    def _():
        gather(block=kb + 1, slot=1 - slot)

    _wait(source, buf, sem, slot=slot, block_k=block_k)
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
