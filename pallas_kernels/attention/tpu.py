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

Indexer target (`return_target`): every block's logits [H, block_k] are also kept in a VMEM
scratch ([K, H] float32 in all: 128 KiB at 16 heads x 2048 slots, 512 KiB at 64 heads); at the
last block, with lse known, the kernel writes target[j] = mean over heads of exp(s[h, j] - lse[h])
from them, gathering no row twice.

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
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    slot = _prefetch_and_wait(idx_smem, kv_hbm, buf, sem, block_k=block_k, num_keys=num_keys)
    rows = buf[slot]
    rows = rows.reshape(rows.shape[0], rows.shape[-1])                   # [bk, Dk]
    idx = idx_vmem[...]                                                  # [1, bk]
    valid = (idx >= 0) & (idx < num_keys)
    s = _dot_nt(q_ref[...], rows) * sm_scale                             # [H, bk]
    s = jnp.where(valid, s, -jnp.inf)
    if with_target:
        s_sc[kb] = s
    m_prev = m_sc[...]                                                   # [H, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(rows.dtype), rows[:, :v_dim])
    m_sc[...] = m_new

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        l = l_sc[...]
        has_any = l > 0
        safe = jnp.where(has_any, l, 1.0)
        out_ref[...] = (acc_sc[...] / safe).astype(out_ref.dtype)
        m = jnp.where(m_sc[...] == -jnp.inf, 0.0, m_sc[...])
        lse = jnp.where(has_any, m + jnp.log(safe), -jnp.inf)
        lse_ref[...] = lse
        if with_target:             # the mean over heads of p = exp(s - lse), from the kept logits
            shift = jnp.where(has_any, lse, jnp.inf)
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
    scratch = _scratch(block_k, dk, kv.dtype) + [
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
        name="sparse_mla_fwd",
    )(idx4, idx4, q, kv4)
    if not with_target:
        return out, lse[..., 0]
    return out, lse[..., 0], target[0].reshape(batch, seq_len, padded)[..., :topk]


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
def _op(sm_scale, v_dim, block_k, topk, interpret):
    """topk: the unpadded K when the op also returns the indexer target, else None."""
    fwd = functools.partial(_forward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret, topk=topk)
    bwd = functools.partial(_backward, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                            interpret=interpret)
    return vjp.make_sparse_mla(fwd, bwd)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: SparseMLATpuConfig = SparseMLATpuConfig(),
               interpret: bool = False):
    """Sparse MLA forward/backward with Mosaic TPU kernels; contract of `pallas_kernels.sparse_mla`.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]); with return_target also the
    indexer target float32 [B, S, K], from the logits the forward kernel keeps in VMEM.
    Compiled for a TPU, H should be a multiple of 8 and Dk, v_dim multiples of 128."""
    topk = indices.shape[-1]
    bk = _block_k(topk, config.block_k)
    idx = _pad_indices(indices, bk)
    return _op(float(sm_scale), int(v_dim), bk, topk if return_target else None, bool(interpret))(q, kv, idx)
