"""The differentiation rule shared by the Pallas sparse MLA kernels.

A kernel pair is plugged in as two callables:

    fwd(q, kv, idx) -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]), or with the
                       indexer target float32 [B, S, K] as a third output (a constant: its
                       cotangent is ignored)
    bwd(q, kv, idx, dout, lse, delta) -> (dq [B, S, H, Dk], dkv float32 [B, T, Dk])

where `idx` is the int32 index array padded by the kernel module and delta float32 [B, S, H]
= out . dout - dlse. The backward kernels add the latent rows' gradient by key row through a
transposed index (no write races, no atomics). `make_index_sparse_mla` plugs in a backward
that takes a prebuilt index of the indices (`transpose.TransposedIndex` or
`transpose.KeyBitmap`, shared by an IndexShare group's layers).

The residuals out and lse are named `RESIDUAL_NAME` (`jax.ad_checkpoint.checkpoint_name`): a
rematerialised caller whose policy saves that name keeps them instead of running the forward
kernel again in the backward pass.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.sparse_mla import transpose

#: The name of the forward's out and lse among the backward's residuals (module docstring).
RESIDUAL_NAME = "sparse_mla_out"


def _named(outs) -> tuple:
    """(out, lse) of a forward's outputs, named RESIDUAL_NAME for remat policies."""
    return tuple(checkpoint_name(x, RESIDUAL_NAME) for x in outs[:2])


def _delta(out, lse, dout, dlse):
    """d/dz_j of (out . dout + lse * dlse) = p_j (dp_j - delta) with delta = out . dout - dlse."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta - jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)


def make_sparse_mla(fwd: Callable, bwd: Callable):
    """A differentiable sparse_mla(q, kv, idx) -> (out, lse[, target]) from a forward and
    backward kernel."""

    @jax.custom_vjp
    def attend(q, kv, idx):
        return fwd(q, kv, idx)

    def attend_fwd(q, kv, idx):
        outs = fwd(q, kv, idx)
        return outs, (q, kv, idx) + _named(outs)

    def attend_bwd(res, cts):
        q, kv, idx, out, lse = res
        dout, dlse = cts[:2]
        dq, dkv = bwd(q, kv, idx, dout, lse, _delta(out, lse, dout, dlse))
        return dq.astype(q.dtype), dkv.astype(kv.dtype), None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def make_index_sparse_mla(fwd: Callable, bwd: Callable):
    """A differentiable sparse_mla(q, kv, indices, index) -> (out, lse[, target]) whose backward
    takes a prebuilt index of the indices (a pytree: `transpose.TransposedIndex` or
    `transpose.KeyBitmap`, shared by an IndexShare group's layers; no cotangent).

    fwd(q, kv, indices, index) -> (out, lse[, target]); bwd(q, kv, indices, dout, lse, delta,
    tindex=index) -> (dq, dkv float32 [B, T, Dk])."""

    @jax.custom_vjp
    def attend(q, kv, indices, index):
        return fwd(q, kv, indices, index)

    def attend_fwd(q, kv, indices, index):
        outs = fwd(q, kv, indices, index)
        return outs, (q, kv, indices, index) + _named(outs)

    def attend_bwd(res, cts):
        q, kv, indices, index, out, lse = res
        dout, dlse = cts[:2]
        dq, dkv = bwd(q, kv, indices, dout, lse, _delta(out, lse, dout, dlse), tindex=index)
        return dq.astype(q.dtype), dkv.astype(kv.dtype), None, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def make_indexed_sparse_mla(fwd: Callable, bwd: Callable, *, chunk_rows: int):
    """`make_index_sparse_mla` for a `transpose.TransposedIndex` passed as its arrays:
    sparse_mla(q, kv, indices, position, offsets) -> (out, lse[, target]), the index built with
    `chunk_rows`; fwd(q, kv, indices) does not take the index."""
    attend = make_index_sparse_mla(lambda q, kv, indices, index: fwd(q, kv, indices), bwd)

    def indexed(q, kv, indices, position, offsets):
        tindex = transpose.TransposedIndex(position=position, offsets=offsets, chunk_rows=chunk_rows,
                                           topk=indices.shape[-1], num_keys=kv.shape[1])
        return attend(q, kv, indices, tindex)

    return indexed
