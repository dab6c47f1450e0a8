"""The differentiation rule shared by the Pallas sparse MLA kernels.

A kernel pair is plugged in as two callables:

    fwd(q, kv, idx) -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]), or with the
                       indexer target float32 [B, S, K] as a third output (a constant: its
                       cotangent is ignored)
    bwd(q, kv, idx, dout, lse, delta) -> (dq float32-or-q.dtype [B, S, H, Dk],
                                          contrib [B, S, K, Dk] in kv.dtype)

where `idx` is the int32 index array padded by the kernel module and `contrib[b, s, j]` is
the gradient that query (b, s) sends to the kv row it selected in slot j (keys and values
together: dK in every column, plus dV in the first v_dim columns).

A kernel that adds those contributions into dkv itself (atomically, or by key row through a
transposed index) is plugged in with `bwd_adds_dkv=True` and returns (dq, dkv float32
[B, T, Dk]) for all queries at once. `make_index_sparse_mla` plugs in such a backward with a
prebuilt index of the indices (`transpose.TransposedIndex` or `transpose.KeyBitmap`, shared by
an IndexShare group's layers).

dkv is accumulated without write races: the kernels never write into a row that another
program may write; each writes its own (query, slot) contributions, and XLA adds them into
the rows with one scatter-add per chunk of queries (invalid slots go to an out-of-range row
and are dropped). The queries are processed in chunks (a `lax.scan` carrying the float32
dkv), so the contributions of only `chunk` queries are live at once.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import split_query_chunks
from pallas_kernels.attention import transpose

#: Upper bound on the bytes of one chunk's per-(query, slot) gradient contributions.
CONTRIB_BUDGET_BYTES = 2 * 2**30


def _query_chunk(batch: int, seq_len: int, topk: int, dk: int, itemsize: int, budget: int) -> int:
    per_query = max(1, batch * topk * dk * itemsize)
    return max(1, min(seq_len, budget // per_query))


def _delta(out, lse, dout, dlse):
    """d/dz_j of (out . dout + lse * dlse) = p_j (dp_j - delta) with delta = out . dout - dlse."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta - jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)


def backward(fwd_res, dout, dlse, *, bwd: Callable, budget: int = CONTRIB_BUDGET_BYTES):
    """Cotangents (dq, dkv) of sparse MLA from the saved forward residuals."""
    q, kv, idx, out, lse = fwd_res
    batch, seq_len, _, dk = q.shape
    num_keys = kv.shape[1]
    topk = idx.shape[-1]
    delta = _delta(out, lse, dout, dlse)

    chunk = _query_chunk(batch, seq_len, topk, dk, jnp.dtype(kv.dtype).itemsize, budget)
    n = -(-seq_len // chunk)
    xs = tuple(split_query_chunks(x, v, chunk) for x, v in
               ((q, 0), (idx, -1), (dout, 0), (lse, -jnp.inf), (delta, 0)))
    row_base = (jnp.arange(batch, dtype=jnp.int32) * num_keys)[:, None, None]

    def step(dkv, chunk_args):
        q_c, idx_c, do_c, lse_c, delta_c = chunk_args
        dq_c, contrib = bwd(q_c, kv, idx_c, do_c, lse_c, delta_c)
        valid = (idx_c >= 0) & (idx_c < num_keys)
        rows = jnp.where(valid, idx_c + row_base, batch * num_keys).reshape(-1)
        dkv = dkv.at[rows].add(contrib.reshape(-1, dk).astype(jnp.float32), mode="drop")
        return dkv, dq_c.astype(q.dtype)

    dkv0 = jnp.zeros((batch * num_keys, dk), jnp.float32)
    if n == 1:
        dkv, dq = step(dkv0, tuple(x[0] for x in xs))
        dq = dq[:, :seq_len]
    else:
        dkv, dqs = lax.scan(step, dkv0, xs)
        dq = jnp.moveaxis(dqs, 0, 1).reshape((batch, n * chunk) + q.shape[2:])[:, :seq_len]
    return dq, dkv.reshape(kv.shape).astype(kv.dtype)


def make_sparse_mla(fwd: Callable, bwd: Callable, *, budget: int = CONTRIB_BUDGET_BYTES,
                    bwd_adds_dkv: bool = False):
    """A differentiable sparse_mla(q, kv, idx) -> (out, lse[, target]) from a forward and
    backward kernel.

    bwd_adds_dkv: `bwd` returns (dq, dkv) itself instead of per-slot contributions."""

    @jax.custom_vjp
    def attend(q, kv, idx):
        return fwd(q, kv, idx)

    def attend_fwd(q, kv, idx):
        outs = fwd(q, kv, idx)
        return outs, (q, kv, idx) + tuple(outs[:2])

    def attend_bwd(res, cts):
        dout, dlse = cts[:2]
        if bwd_adds_dkv:
            q, kv, idx, out, lse = res
            dq, dkv = bwd(q, kv, idx, dout, lse, _delta(out, lse, dout, dlse))
            return dq.astype(q.dtype), dkv.astype(kv.dtype), None
        dq, dkv = backward(res, dout, dlse, bwd=bwd, budget=budget)
        return dq, dkv, None

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
        return outs, (q, kv, indices, index) + tuple(outs[:2])

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
