"""Sparse MLA on TPU: Mosaic kernels that gather the selected latent rows by DMA.

Layout. One program handles one query (b, s) with all H heads (the heads are the M dimension
of both matmuls) and walks its K selected rows in blocks of `block_k` along the last grid
axis ("arbitrary"), keeping the online-softmax state in VMEM scratch. The latent cache stays
in HBM (memory_space=ANY) viewed as [B, T, 1, Dk]: one DMA per selected row copies
kv[b, t] into row j of a [2, block_k, 1, Dk] VMEM buffer. With the unit axis second-minor,
both the HBM source and the VMEM destination are indexed dynamically on a leading axis only;
a dynamic offset on the sublane axis (a [T, Dk] view) must be a multiple of 8 and does not
compile. The buffer is double-buffered: block k+1's DMAs are issued before block k's are
waited on, so the gather of the next block overlaps the matmuls of this one.

Indices. Each program needs the K indices of its query as scalars (DMA addresses) and the
current block of them as a vector (the validity mask). The scalars come as a per-query SMEM
block of the index array rather than through scalar prefetch: scalar prefetch copies the
whole [B, S, K] array into SMEM, which does not fit for prefill (8K queries x 2048 slots is
64 MiB). The vector copy is a [1, block_k] VMEM block of the same array.

Invalid slots (-1 or out of range) fetch row 0 and are masked to -inf / zero probability.

Backward: per query, with the same gather, the kernel recomputes p = exp(s - lse) and writes
dq (accumulated over the blocks in VMEM) and the per-(query, slot) dkv contributions, which
`vjp.backward` scatter-adds into dkv (no two programs write the same memory).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check_positive_fields, tpu_interpret
from pallas_kernels.attention import vjp

#: Rows gathered per grid step.
DEFAULT_BLOCK_K = 256


@dataclasses.dataclass(frozen=True)
class SparseMLATpuConfig:
    """Tuning of the TPU sparse MLA kernels (`impl="pallas_tpu"`).

    block_k: rows gathered per grid step (default min(DEFAULT_BLOCK_K, K rounded up to 128))."""

    block_k: int | None = None

    def __post_init__(self):
        check_positive_fields(self)


def _pad_indices(indices: jax.Array, block_k: int) -> jax.Array:
    topk = indices.shape[-1]
    padded = -(-topk // block_k) * block_k
    idx = jnp.asarray(indices, jnp.int32)
    if padded != topk:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, padded - topk)), constant_values=-1)
    return idx


def _block_k(topk: int, block_k: int | None) -> int:
    if block_k is not None:
        return int(block_k)
    return min(DEFAULT_BLOCK_K, -(-topk // 128) * 128)


def _gather(idx_smem, kv_hbm, buf, sem, *, b, block, slot, block_k, num_keys):
    """Starts the DMAs of the rows of index block `block` into buf[slot]."""

    def start(j, carry):
        r = idx_smem[block * block_k + j]
        r = jnp.where((r >= 0) & (r < num_keys), r, 0)
        pltpu.make_async_copy(kv_hbm.at[b, r], buf.at[slot, j], sem.at[slot]).start()
        return carry

    lax.fori_loop(0, block_k, start, 0)


def _wait(kv_hbm, buf, sem, *, slot, block_k):
    def wait(j, carry):
        pltpu.make_async_copy(kv_hbm.at[0, 0], buf.at[slot, j], sem.at[slot]).wait()
        return carry

    lax.fori_loop(0, block_k, wait, 0)


def _prefetch_and_wait(idx_smem, kv_hbm, buf, sem, *, block_k, num_keys):
    """Double buffering over the K axis of the grid; returns the slot holding this block."""
    b = pl.program_id(0)
    kb = pl.program_id(2)
    nk = pl.num_programs(2)
    slot = kb % 2
    gather = functools.partial(_gather, idx_smem, kv_hbm, buf, sem, b=b, block_k=block_k,
                               num_keys=num_keys)

    @pl.when(kb == 0)
    def _():
        gather(block=0, slot=0)

    @pl.when(kb + 1 < nk)
    def _():
        gather(block=kb + 1, slot=1 - slot)

    _wait(kv_hbm, buf, sem, slot=slot, block_k=block_k)
    return slot


def _dot_nt(a, b):
    """a [M, D] . b [N, D]^T -> float32 [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, buf, sem, m_sc, l_sc, acc_sc,
                *, sm_scale, v_dim, block_k, num_keys):
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        _softmax_init(m_sc, l_sc, acc_sc)

    slot = _prefetch_and_wait(idx_smem, kv_hbm, buf, sem, block_k=block_k, num_keys=num_keys)
    idx = idx_vmem[...]                                                  # [1, bk]
    _softmax_update(q_ref, buf[slot], (idx >= 0) & (idx < num_keys), m_sc, l_sc, acc_sc, sm_scale=sm_scale,
                    v_dim=v_dim)

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc)


def _softmax_init(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _softmax_update(q_ref, rows, valid, m_sc, l_sc, acc_sc, *, sm_scale, v_dim):
    """One block of the online softmax: rows [bk, 1, Dk] gathered, valid bool [1, bk]."""
    q = q_ref[...]
    rows = rows.reshape(rows.shape[0], rows.shape[-1]).astype(q.dtype)  # [bk, Dk]
    s = _dot_nt(q, rows) * sm_scale                                      # [H, bk]
    s = jnp.where(valid, s, -jnp.inf)
    m_prev = m_sc[...]                                                   # [H, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(rows.dtype), rows[:, :v_dim])
    m_sc[...] = m_new


def _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc):
    l = l_sc[...]
    has_any = l > 0
    safe = jnp.where(has_any, l, 1.0)
    out_ref[...] = (acc_sc[...] / safe).astype(out_ref.dtype)
    m = jnp.where(m_sc[...] == -jnp.inf, 0.0, m_sc[...])
    lse_ref[...] = jnp.where(has_any, m + jnp.log(safe), -jnp.inf)


def _common_specs(batch, heads, dk, block_k, topk):
    # idx is passed as [B, S, 1, K]: the unit axis keeps the blocks' last two dims legal.
    idx_smem = pl.BlockSpec((None, None, None, topk), lambda b, s, k: (b, s, 0, 0),
                            memory_space=pltpu.SMEM)
    idx_vmem = pl.BlockSpec((None, None, 1, block_k), lambda b, s, k: (b, s, 0, k))
    q_spec = pl.BlockSpec((None, None, heads, dk), lambda b, s, k: (b, s, 0, 0))
    kv_spec = pl.BlockSpec(memory_space=pl.ANY)
    return idx_smem, idx_vmem, q_spec, kv_spec


def _scratch(block_k, dk, kv_dtype):
    return [pltpu.VMEM((2, block_k, 1, dk), kv_dtype), pltpu.SemaphoreType.DMA((2,))]


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _layout(q, kv, idx, block_k):
    """Shapes, the [B, T, 1, Dk] / [B, S, 1, K] views the kernels read, and the shared block specs."""
    batch, seq_len, heads, dk = q.shape
    num_keys, topk = kv.shape[1], idx.shape[-1]
    kv4 = kv.reshape(batch, num_keys, 1, dk)
    idx4 = idx.reshape(batch, seq_len, 1, topk)
    specs = _common_specs(batch, heads, dk, block_k, topk)
    return batch, seq_len, heads, dk, num_keys, topk, topk // block_k, kv4, idx4, specs


def _forward(q, kv, idx, *, sm_scale, v_dim, block_k, interpret):
    """idx already padded to a multiple of block_k."""
    batch, seq_len, heads, dk, num_keys, topk, nk, kv4, idx4, specs = _layout(q, kv, idx, block_k)
    idx_smem, idx_vmem, q_spec, kv_spec = specs
    kernel = functools.partial(_fwd_kernel, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                               num_keys=num_keys)
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, seq_len, nk),
        in_specs=[idx_smem, idx_vmem, q_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, None, heads, v_dim), lambda b, s, k: (b, s, 0, 0)),
                   pl.BlockSpec((None, None, heads, 1), lambda b, s, k: (b, s, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len, heads, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, seq_len, heads, 1), jnp.float32)],
        scratch_shapes=_scratch(block_k, dk, kv.dtype) + [
            pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
            pltpu.VMEM((heads, v_dim), jnp.float32)],
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        name="sparse_mla_fwd",
    )(idx4, idx4, q, kv4)
    return out, lse[..., 0]


def _bwd_kernel(idx_smem, idx_vmem, q_ref, do_ref, lse_ref, delta_ref, kv_hbm, dq_ref, contrib_ref,
                buf, sem, dq_sc, *, sm_scale, v_dim, block_k, num_keys):
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    slot = _prefetch_and_wait(idx_smem, kv_hbm, buf, sem, block_k=block_k, num_keys=num_keys)
    rows = buf[slot]
    rows = rows.reshape(rows.shape[0], rows.shape[-1])                   # [bk, Dk]
    dtype = rows.dtype
    idx = idx_vmem[...]
    valid = (idx >= 0) & (idx < num_keys)
    q = q_ref[...]                                                       # [H, Dk]
    do = do_ref[...]                                                     # [H, v]
    lse = lse_ref[...]                                                   # [H, 1]
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                       # empty row: p = 0
    s = _dot_nt(q, rows) * sm_scale
    p = jnp.where(valid, jnp.exp(s - lse), 0.0)                          # [H, bk]
    dp = _dot_nt(do, rows[:, :v_dim])                                    # [H, bk]
    ds = p * (dp - delta_ref[...]) * sm_scale
    dq_sc[...] += _dot(ds.astype(dtype), rows)
    dk = _dot(ds.T.astype(dtype), q.astype(dtype))                       # [bk, Dk]
    dv = _dot(p.T.astype(dtype), do.astype(dtype))                       # [bk, v]
    if v_dim < dk.shape[1]:
        contrib_ref[:, :v_dim] = (dk[:, :v_dim] + dv).astype(contrib_ref.dtype)
        contrib_ref[:, v_dim:] = dk[:, v_dim:].astype(contrib_ref.dtype)
    else:
        contrib_ref[...] = (dk + dv).astype(contrib_ref.dtype)

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _backward(q, kv, idx, dout, lse, delta, *, sm_scale, v_dim, block_k, interpret):
    batch, seq_len, heads, dk, num_keys, topk, nk, kv4, idx4, specs = _layout(q, kv, idx, block_k)
    idx_smem, idx_vmem, q_spec, kv_spec = specs
    per_head = lambda width: pl.BlockSpec((None, None, heads, width), lambda b, s, k: (b, s, 0, 0))
    kernel = functools.partial(_bwd_kernel, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                               num_keys=num_keys)
    dq, contrib = pl.pallas_call(
        kernel,
        grid=(batch, seq_len, nk),
        in_specs=[idx_smem, idx_vmem, q_spec, per_head(v_dim), per_head(1), per_head(1), kv_spec],
        out_specs=[per_head(dk),
                   pl.BlockSpec((None, None, block_k, dk), lambda b, s, k: (b, s, k, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len, heads, dk), q.dtype),
                   jax.ShapeDtypeStruct((batch, seq_len, topk, dk), kv.dtype)],
        scratch_shapes=_scratch(block_k, dk, kv.dtype) + [pltpu.VMEM((heads, dk), jnp.float32)],
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        name="sparse_mla_bwd",
    )(idx4, idx4, q, dout.astype(q.dtype), lse[..., None], delta[..., None], kv4)
    return dq, contrib


@functools.lru_cache(maxsize=None)
def _op(sm_scale, v_dim, block_k, interpret):
    fwd = functools.partial(_forward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret)
    bwd = functools.partial(_backward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret)
    return vjp.make_sparse_mla(fwd, bwd)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               config: SparseMLATpuConfig = SparseMLATpuConfig(), interpret: bool = False):
    """Sparse MLA forward/backward with Mosaic TPU kernels; contract of `pallas_kernels.sparse_mla`.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]).
    Compiled for a TPU, H should be a multiple of 8 and Dk, v_dim multiples of 128."""
    topk = indices.shape[-1]
    bk = _block_k(topk, config.block_k)
    idx = _pad_indices(indices, bk)
    return _op(float(sm_scale), int(v_dim), bk, bool(interpret))(q, kv, idx)


# ------------------------------------------------------------------------ paged decode forward

def _paged_gather(slot_ref, idx_smem, pages_smem, kv_hbm, buf, sem, *, block, buf_slot, block_k, page_size,
                  num_keys):
    """Starts the DMAs of index block `block`: logical row t of this sequence is
    kv_hbm[slot, pages[t // P], t % P] (a [1, Dk] row at a dynamic sublane offset of its page)."""

    def start(j, carry):
        r = idx_smem[block * block_k + j]
        r = jnp.where((r >= 0) & (r < num_keys), r, 0)
        src = kv_hbm.at[slot_ref[0], pages_smem[r // page_size], r % page_size]
        pltpu.make_async_copy(src, buf.at[buf_slot, j], sem.at[buf_slot]).start()
        return carry

    lax.fori_loop(0, block_k, start, 0)


def _paged_fwd_kernel(slot_ref, idx_smem, pages_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, buf, sem, m_sc,
                      l_sc, acc_sc, *, sm_scale, v_dim, block_k, page_size, num_keys):
    kb = pl.program_id(2)
    nk = pl.num_programs(2)
    buf_slot = kb % 2
    gather = functools.partial(_paged_gather, slot_ref, idx_smem, pages_smem, kv_hbm, buf, sem, block_k=block_k,
                               page_size=page_size, num_keys=num_keys)

    @pl.when(kb == 0)
    def _():
        _softmax_init(m_sc, l_sc, acc_sc)
        gather(block=0, buf_slot=0)

    @pl.when(kb + 1 < nk)
    def _():
        gather(block=kb + 1, buf_slot=1 - buf_slot)

    def wait(j, carry):
        pltpu.make_async_copy(kv_hbm.at[0, 0, 0], buf.at[buf_slot, j], sem.at[buf_slot]).wait()
        return carry

    lax.fori_loop(0, block_k, wait, 0)
    idx = idx_vmem[...]                                                  # [1, bk]
    _softmax_update(q_ref, buf[buf_slot], (idx >= 0) & (idx < num_keys), m_sc, l_sc, acc_sc, sm_scale=sm_scale,
                    v_dim=v_dim)

    @pl.when(kb == nk - 1)
    def _():
        _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: SparseMLATpuConfig = SparseMLATpuConfig(),
                     interpret: bool = False):
    """The forward kernel reading a paged store: each selected logical row is translated to
    (page, offset) inside the kernel and copied by one DMA from the store in HBM (no copy of
    the rows, no relayout of the store). Contract of `pallas_kernels.paged_sparse_mla`.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], slot int32
    scalar (prefetched), indices int32 [B, S, K] (-1 or >= n * P = skip) -> (out [B, S, H,
    v_dim] in q.dtype, lse f32 [B, S, H]). Forward only. The sequence's page table is an SMEM
    block next to the query's indices (n int32 per sequence)."""
    batch, seq_len, heads, dk = q.shape
    page_size, n = kv_pages.shape[2], page_table.shape[1]
    bk = _block_k(indices.shape[-1], config.block_k)
    idx = _pad_indices(indices, bk)
    topk = idx.shape[-1]
    kernel = functools.partial(_paged_fwd_kernel, sm_scale=float(sm_scale), v_dim=int(v_dim), block_k=bk,
                               page_size=page_size, num_keys=n * page_size)
    per_query = lambda width: pl.BlockSpec((None, None, heads, width), lambda b, s, k, *_: (b, s, 0, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, seq_len, topk // bk),
            in_specs=[pl.BlockSpec((None, None, None, topk), lambda b, s, k, *_: (b, s, 0, 0),
                                   memory_space=pltpu.SMEM),
                      pl.BlockSpec((None, None, n), lambda b, s, k, *_: (b, 0, 0), memory_space=pltpu.SMEM),
                      pl.BlockSpec((None, None, 1, bk), lambda b, s, k, *_: (b, s, 0, k)),
                      per_query(dk),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[per_query(v_dim), per_query(1)],
            scratch_shapes=_scratch(bk, dk, kv_pages.dtype) + [
                pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
                pltpu.VMEM((heads, v_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len, heads, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, seq_len, heads, 1), jnp.float32)],
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        name="paged_sparse_mla_fwd",
    )(jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), idx.reshape(batch, seq_len, 1, topk),
      page_table.reshape(batch, 1, n), idx.reshape(batch, seq_len, 1, topk), q, kv_pages[..., None, :])
    return out, lse[..., 0]
