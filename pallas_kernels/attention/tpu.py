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

Backward: `tpu_backward` - per-query kernels write each (query, selected row) gradient at its
place in a key-row-sorted list (`transpose.transpose_index`), and one program per block of
latent rows sums their runs in a fixed order: no atomics, bitwise-repeatable gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check_positive_fields, tpu_interpret
from pallas_kernels.attention import tpu_backward, tpu_rows, transpose, vjp

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


def _pad_indices(indices: jax.Array, block_k: int) -> jax.Array:
    topk = indices.shape[-1]
    padded = -(-topk // block_k) * block_k
    idx = jnp.asarray(indices, jnp.int32)
    if padded != topk:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, padded - topk)), constant_values=-1)
    return idx


def _block_k(topk: int, block_k: int | None, default: int = DEFAULT_BLOCK_K) -> int:
    if block_k is not None:
        return int(block_k)
    return min(default, -(-topk // 128) * 128)


def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref, buf, sem, m_sc, l_sc, acc_sc,
                *, sm_scale, v_dim, block_k, num_keys):
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    slot = tpu_rows.prefetch_and_wait(idx_smem, kv_hbm, buf, sem, b=pl.program_id(0), kb=kb,
                                      nk=pl.num_programs(2), block_k=block_k, num_keys=num_keys)
    rows = tpu_rows.rows_of(buf, slot)                                   # [bk, Dk]
    idx = idx_vmem[...]                                                  # [1, bk]
    valid = (idx >= 0) & (idx < num_keys)
    s = tpu_rows.dot_nt(q_ref[...], rows) * sm_scale                             # [H, bk]
    s = jnp.where(valid, s, -jnp.inf)
    m_prev = m_sc[...]                                                   # [H, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + tpu_rows.dot(p.astype(rows.dtype), rows[:, :v_dim])
    m_sc[...] = m_new

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
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
        scratch_shapes=tpu_rows.scratch(block_k, dk, kv.dtype) + [
            pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
            pltpu.VMEM((heads, v_dim), jnp.float32)],
        compiler_params=_params(),
        interpret=tpu_interpret(interpret),
        cost_estimate=_forward_cost(q, kv, topk, v_dim),
        name="sparse_mla_fwd",
    )(idx4, idx4, q, kv4)
    return out, lse[..., 0]


def _padded_forward(q, kv, indices, *, block_k, **settings):
    return _forward(q, kv, _pad_indices(indices, block_k), block_k=block_k, **settings)


@functools.lru_cache(maxsize=None)
def _op(sm_scale, v_dim, block_k, bwd_settings, chunk_rows, interpret):
    """The differentiable op on unpadded indices; chunk_rows: None builds the transposed index
    in the backward, else the op takes a prebuilt one's (position, offsets) too."""
    fwd = functools.partial(_padded_forward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret)
    bwd = functools.partial(tpu_backward.backward, sm_scale=sm_scale, v_dim=v_dim,
                            interpret=interpret, **dict(bwd_settings))
    if chunk_rows is None:
        return vjp.make_sparse_mla(fwd, bwd, bwd_adds_dkv=True)
    return vjp.make_indexed_sparse_mla(fwd, bwd, chunk_rows=chunk_rows)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               config: SparseMLATpuConfig = SparseMLATpuConfig(), interpret: bool = False,
               tindex: transpose.TransposedIndex | None = None):
    """Sparse MLA forward/backward with Mosaic TPU kernels; contract of `pallas_kernels.sparse_mla`.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]).
    tindex: the backward's transposed index, `transpose.transpose_index(indices, T, chunk_rows=
    tpu_backward.default_chunk_rows(...))` built once and shared by the layers of an IndexShare
    group; None: built in each backward (chunks of `config.bwd_budget` bytes).
    Compiled for a TPU, H should be a multiple of 8 and Dk, v_dim multiples of 128."""
    topk = indices.shape[-1]
    bk = _block_k(topk, config.block_k)
    bwd = (("block_k", _block_k(topk, config.bwd_block_k, tpu_backward.DEFAULT_BLOCK_K)),
           ("budget", config.bwd_budget), ("reduce_rows", config.reduce_rows),
           ("reduce_window", config.reduce_window))
    idx = jnp.asarray(indices, jnp.int32)
    if tindex is None:
        return _op(float(sm_scale), int(v_dim), bk, bwd, None, bool(interpret))(q, kv, idx)
    op = _op(float(sm_scale), int(v_dim), bk, bwd, tindex.chunk_rows, bool(interpret))
    return op(q, kv, idx, tindex.position, tindex.offsets)
