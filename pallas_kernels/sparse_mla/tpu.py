"""Sparse MLA on TPU: Mosaic kernels that gather the selected latent rows by DMA.

Layout. One program handles one query (b, s) with all H heads (the heads are the M dimension
of both matmuls) and walks its K selected rows in blocks of `block_k` along the last grid
axis ("arbitrary"), keeping the online-softmax state in VMEM scratch. The rows are gathered
from the HBM cache, viewed as [B, T, 1, Dk], by one DMA per row into a double-buffered VMEM
buffer (`tpu_rows`: why the unit axis, how the next block's gather overlaps this block's
matmuls).

Indices. Each program needs the K indices of its query as scalars (DMA addresses) and the
current block of them as a vector (the validity mask). The scalars come as a per-query SMEM
block of the index array rather than through scalar prefetch: scalar prefetch copies the
whole [B, S, K] array into SMEM, which does not fit for prefill (8K queries x 2048 slots is
64 MiB). The vector copy is a [1, block_k] VMEM block of the same array.

Invalid slots (-1 or out of range) fetch row 0 and are masked to -inf / zero probability.

Indexer target (`return_target`): every block's logits [H, block_k] are also kept in a VMEM
scratch ([K, H] float32 in all: 128 KiB at 16 heads x 2048 slots, 512 KiB at 64 heads); at the
last block, with lse known, the kernel writes target[j] = mean over heads of exp(s[h, j] - lse[h])
from them, gathering no row twice.


Backward: `tpu_backward` - per-query kernels write each (query, selected row) gradient at its
place in a key-row-sorted list (`transpose.transpose_index`), and one program per block of
latent rows sums their runs in a fixed order: no atomics, bitwise-repeatable gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check_positive_fields, pad_slots, tpu_interpret
from pallas_kernels.sparse_mla import tpu_backward, tpu_rows, transpose, vjp, xla

#: Rows gathered per grid step of the forward.
DEFAULT_BLOCK_K = 256


@dataclasses.dataclass(frozen=True)
class SparseMLATpuConfig:
    """Tuning of the TPU sparse MLA kernels (`impl="pallas_tpu"`).

    block_k, bwd_block_k: rows gathered per grid step of the forward / of the backward's pairs
      kernel (default min(DEFAULT_BLOCK_K / tpu_backward.DEFAULT_BLOCK_K, K rounded up to 128);
      compiled for a TPU, a multiple of 128 or at least K).
    reduce_rows, reduce_window: key rows per program and pair gradients per DMA window of the
      backward's reduce kernel (multiples of 8; `tpu_backward`).
    bwd_budget: bytes of one query chunk's float32 pair gradients in the backward."""

    block_k: int | None = None
    bwd_block_k: int | None = None
    reduce_rows: int = tpu_backward.DEFAULT_REDUCE_ROWS
    reduce_window: int = tpu_backward.DEFAULT_REDUCE_WINDOW
    bwd_budget: int = tpu_backward.DEFAULT_BUDGET

    def __post_init__(self):
        check_positive_fields(self)
        for name in ("reduce_rows", "reduce_window"):
            if getattr(self, name) % 8:
                raise ValueError(f"SparseMLATpuConfig.{name} must be a multiple of 8, "
                                 f"got {getattr(self, name)}")


def _block_k(topk: int, block_k: int | None, default: int = DEFAULT_BLOCK_K) -> int:
    if block_k is not None:
        return int(block_k)
    return min(default, -(-topk // 128) * 128)


def _softmax_init(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _softmax_update(q, rows, valid, m_sc, l_sc, acc_sc, *, sm_scale, v_dim):
    """One block of the online softmax: q [H, Dk], rows [bk, Dk] gathered, valid bool [1, bk]
    -> the block's logits float32 [H, bk] (-inf at invalid slots)."""
    rows = rows.astype(q.dtype)
    s = jnp.where(valid, tpu_rows.dot_nt(q, rows) * sm_scale, -jnp.inf)
    m_prev = m_sc[...]                                                   # [H, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + tpu_rows.dot(p.astype(rows.dtype), rows[:, :v_dim])
    m_sc[...] = m_new
    return s


def _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc):
    """Writes the output and lse [H, 1] (-inf for a query with no valid slot) and returns lse."""
    l = l_sc[...]
    has_any = l > 0
    safe = jnp.where(has_any, l, 1.0)
    out_ref[...] = (acc_sc[...] / safe).astype(out_ref.dtype)
    m = jnp.where(m_sc[...] == -jnp.inf, 0.0, m_sc[...])
    lse = jnp.where(has_any, m + jnp.log(safe), -jnp.inf)
    lse_ref[...] = lse
    return lse


def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, *refs, sm_scale, v_dim, block_k, num_keys,
                with_target):
    """refs: (target_ref,) when with_target, then the scratch buffers: the row buffer and its DMA
    semaphores, m, l, the output accumulator, and (with_target) every block's logits."""
    if with_target:
        target_ref, buf, sem, m_sc, l_sc, acc_sc, s_sc = refs
    else:
        buf, sem, m_sc, l_sc, acc_sc = refs
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        _softmax_init(m_sc, l_sc, acc_sc)

    b = pl.program_id(0)
    slot = tpu_rows.prefetch_and_wait(idx_smem, lambda r: kv_hbm.at[b, r], buf, sem, kb=kb,
                                      nk=pl.num_programs(2), block_k=block_k, num_keys=num_keys)
    idx = idx_vmem[...]                                                  # [1, bk]
    s = _softmax_update(q_ref[...], tpu_rows.rows_of(buf, slot), (idx >= 0) & (idx < num_keys), m_sc, l_sc,
                        acc_sc, sm_scale=sm_scale, v_dim=v_dim)
    if with_target:
        s_sc[kb] = s

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        lse = _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc)
        if with_target:             # the mean over heads of p = exp(s - lse), from the kept logits
            shift = jnp.where(lse == -jnp.inf, jnp.inf, lse)
            for j in range(s_sc.shape[0]):
                p = jnp.exp(s_sc[j] - shift)                              # [H, bk]; 0 where invalid
                target_ref[j:j + 1, :] = jnp.sum(p, axis=0, keepdims=True) * (1.0 / p.shape[0])


def _common_specs(batch, heads, dk, block_k, topk):
    # idx is passed as [B, S, 1, K]: the unit axis keeps the blocks' last two dims legal.
    idx_smem = pl.BlockSpec((None, None, None, topk), lambda b, s, k: (b, s, 0, 0),
                            memory_space=pltpu.SMEM)
    idx_vmem = pl.BlockSpec((None, None, 1, block_k), lambda b, s, k: (b, s, 0, k))
    q_spec = pl.BlockSpec((None, None, heads, dk), lambda b, s, k: (b, s, 0, 0))
    kv_spec = pl.BlockSpec(memory_space=pl.ANY)
    return idx_smem, idx_vmem, q_spec, kv_spec


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


def _forward_cost(q, kv, topk, v_dim):
    """What the forward does per (query, slot): one row gathered, the matmuls of its heads."""
    batch, seq_len, heads, dk = q.shape
    pairs = batch * seq_len * topk
    return pl.CostEstimate(
        flops=2 * pairs * heads * (dk + v_dim), transcendentals=pairs * heads,
        bytes_accessed=pairs * (dk * jnp.dtype(kv.dtype).itemsize + 4)
        + batch * seq_len * heads * (dk + v_dim) * jnp.dtype(q.dtype).itemsize)


def _forward(q, kv, idx, *, sm_scale, v_dim, block_k, interpret, topk=None):
    """idx already padded to a multiple of block_k -> (out, lse), and with `topk` (the unpadded
    K) the indexer target float32 [B, S, topk]: each block's logits are kept in VMEM ([Kp, H]
    float32: 128 KiB at 16 heads x 2048 slots) and turned into the target once lse is known, so
    no row is gathered twice."""
    batch, seq_len, heads, dk, num_keys, padded, nk, kv4, idx4, specs = _layout(q, kv, idx, block_k)
    idx_smem, idx_vmem, q_spec, kv_spec = specs
    with_target = topk is not None
    kernel = functools.partial(_fwd_kernel, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                               num_keys=num_keys, with_target=with_target)
    per_query = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, s, k: (b, s, 0, 0))
    out_specs = [per_query(heads, v_dim), per_query(heads, 1)]
    out_shape = [jax.ShapeDtypeStruct((batch, seq_len, heads, v_dim), q.dtype),
                 jax.ShapeDtypeStruct((batch, seq_len, heads, 1), jnp.float32)]
    scratch = tpu_rows.scratch(block_k, dk, kv.dtype) + [
        pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
        pltpu.VMEM((heads, v_dim), jnp.float32)]
    if with_target:
        out_specs.append(per_query(nk, block_k))
        out_shape.append(jax.ShapeDtypeStruct((batch, seq_len, nk, block_k), jnp.float32))
        scratch.append(pltpu.VMEM((nk, heads, block_k), jnp.float32))
    out, lse, *target = pl.pallas_call(
        kernel,
        grid=(batch, seq_len, nk),
        in_specs=[idx_smem, idx_vmem, q_spec, kv_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        cost_estimate=_forward_cost(q, kv, padded, v_dim),
        name="sparse_mla_fwd",
    )(idx4, idx4, q, kv4)
    if not with_target:
        return out, lse[..., 0]
    return out, lse[..., 0], target[0].reshape(batch, seq_len, padded)[..., :topk]


def _padded_forward(q, kv, indices, *, block_k, **settings):
    return _forward(q, kv, pad_slots(indices, block_k), block_k=block_k, **settings)


@functools.lru_cache(maxsize=None)
def _op(sm_scale, v_dim, block_k, bwd_settings, chunk_rows, topk, interpret):
    """The differentiable op on unpadded indices; chunk_rows: None builds the transposed index
    in the backward, else the op takes a prebuilt one's (position, offsets) too; topk: the K
    of the indices when the op also returns the indexer target, else None."""
    fwd = functools.partial(_padded_forward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret, topk=topk)
    bwd = functools.partial(tpu_backward.backward, sm_scale=sm_scale, v_dim=v_dim,
                            interpret=interpret, **dict(bwd_settings))
    if chunk_rows is None:
        return vjp.make_sparse_mla(fwd, bwd)
    return vjp.make_indexed_sparse_mla(fwd, bwd, chunk_rows=chunk_rows)


def backward_index(indices: jax.Array, num_keys: int, *, dk: int, dtype,
                   config: SparseMLATpuConfig = SparseMLATpuConfig(), heads: int | None = None,
                   v_dim: int | None = None) -> transpose.TransposedIndex:
    """The transposed index the backward takes for indices int32 [B, S, K] over num_keys rows
    of width dk (chunks of `config.bwd_budget` bytes of pair gradients), to build once per
    IndexShare group. dtype: kv's (unused: the TPU kernel's pair gradients are float32);
    heads, v_dim: the queries' (unused: one backward here)."""
    del dtype, heads, v_dim
    batch, seq_len, topk = indices.shape
    chunk = tpu_backward.default_chunk_rows(batch * seq_len, topk, dk, config.bwd_budget)
    return transpose.transpose_index(indices, num_keys, chunk_rows=chunk)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: SparseMLATpuConfig = SparseMLATpuConfig(),
               interpret: bool = False, tindex: transpose.TransposedIndex | None = None):
    """Sparse MLA forward/backward with Mosaic TPU kernels; contract of `pallas_kernels.sparse_mla`.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]); with return_target also the
    indexer target float32 [B, S, K], from the logits the forward kernel keeps in VMEM.
    tindex: the backward's transposed index (`backward_index`), built once and shared by the
    layers of an IndexShare group; None: built in each backward (chunks of `config.bwd_budget`
    bytes).
    Compiled for a TPU, H should be a multiple of 8 and Dk, v_dim multiples of 128."""
    topk = indices.shape[-1]
    bk = _block_k(topk, config.block_k)
    bwd = (("block_k", _block_k(topk, config.bwd_block_k, tpu_backward.DEFAULT_BLOCK_K)),
           ("budget", config.bwd_budget), ("reduce_rows", config.reduce_rows),
           ("reduce_window", config.reduce_window))
    idx = jnp.asarray(indices, jnp.int32)
    target_k = topk if return_target else None
    if tindex is None:
        return _op(float(sm_scale), int(v_dim), bk, bwd, None, target_k, bool(interpret))(q, kv, idx)
    op = _op(float(sm_scale), int(v_dim), bk, bwd, tindex.chunk_rows, target_k, bool(interpret))
    return op(q, kv, idx, tindex.position, tindex.offsets)


# ------------------------------------------------------------------------ paged decode forward

def _paged_fwd_kernel(slot_ref, idx_smem, pages_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, buf, sem, m_sc,
                      l_sc, acc_sc, *, sm_scale, v_dim, block_k, page_size, num_keys):
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        _softmax_init(m_sc, l_sc, acc_sc)

    # logical row t of this sequence is kv_hbm[slot, pages[t // P], t % P]; the DMA copies the packed
    # word holding it (P is a whole number of words, so t % n is the row's place in its word); r >= 0
    # here, so truncating division (no sign fix-up)
    n = tpu_rows.packing(kv_hbm.dtype)
    source = lambda r: tpu_rows.packed_source(kv_hbm.at[slot_ref[0], pages_smem[lax.div(r, page_size)]],
                                              lax.rem(r, page_size), n)
    buf_slot = tpu_rows.prefetch_and_wait(idx_smem, source, buf, sem, kb=kb, nk=pl.num_programs(2), block_k=block_k,
                                          num_keys=num_keys, dest=tpu_rows.packed_dest(n))
    idx = idx_vmem[...]                                                  # [1, bk]
    _softmax_update(q_ref[...], tpu_rows.unpack_rows(buf[buf_slot], idx), (idx >= 0) & (idx < num_keys), m_sc,
                    l_sc, acc_sc, sm_scale=sm_scale, v_dim=v_dim)

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        _softmax_finish(out_ref, lse_ref, m_sc, l_sc, acc_sc)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: SparseMLATpuConfig = SparseMLATpuConfig(),
                     interpret: bool = False):
    """The forward kernel reading a paged store in place: each selected logical row is
    translated to (page, offset) inside the kernel and its packed word (`tpu_rows.packing` rows:
    2 in bf16) copied by one DMA from the store in HBM, in the store's own layout (no copy of
    the rows, no relayout of the store). Contract of `pallas_kernels.paged_sparse_mla`.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], slot int32
    scalar (prefetched), indices int32 [B, S, K] (-1 or >= n * P = skip) -> (out [B, S, H,
    v_dim] in q.dtype, lse f32 [B, S, H]). Forward only. The sequence's page table is an SMEM
    block next to the query's indices (n int32 per sequence). A page size that splits a
    packed word (an odd P in bf16) runs the XLA implementation instead (`xla.paged_sparse_mla`)."""
    batch, seq_len, heads, dk = q.shape
    page_size, n = kv_pages.shape[2], page_table.shape[1]
    if page_size % tpu_rows.packing(kv_pages.dtype):
        return xla.paged_sparse_mla(q, kv_pages, page_table, indices, slot=slot, sm_scale=sm_scale, v_dim=v_dim)
    bk = _block_k(indices.shape[-1], config.block_k)
    idx = pad_slots(indices, bk)
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
            scratch_shapes=tpu_rows.packed_scratch(bk, dk, kv_pages.dtype) + [
                pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
                pltpu.VMEM((heads, v_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len, heads, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, seq_len, heads, 1), jnp.float32)],
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        name="paged_sparse_mla_fwd",
    )(jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), idx.reshape(batch, seq_len, 1, topk),
      page_table.reshape(batch, 1, n), idx.reshape(batch, seq_len, 1, topk), q, kv_pages)
    return out, lse[..., 0]
