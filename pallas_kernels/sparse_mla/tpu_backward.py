"""Sparse MLA backward on TPU (Mosaic): no atomics, no XLA scatter-add, the same bits on every run.

Shapes: q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v]), indices int32 [B, S, K] (-1 or out of
range = skip), dout [B, S, H, v], lse / delta float32 [B, S, H] -> dq [B, S, H, Dk] (q dtype),
dkv float32 [B, T, Dk]: the backward contract of `vjp.make_sparse_mla`.

Why this shape of computation. Call one (query, selected row) a pair. As on a GPU
(`gpu_backward`), every pair needs the query's q and dout (H x (Dk + v) values, 34 KB at 16
heads in bf16) and the row's latent vector (1152 bytes): keeping the query in VMEM and gathering
its rows moves ~1 KB per pair, gathering the selecting queries for a row ("by key row") 30-120x
more. So both gradients are computed by query and only dkv's sum is organised by key row,
through the transposed index of `transpose.py` (built once per IndexShare group, `tindex=`):

1. `pairs` kernel, grid (queries of a chunk, K / block_k), one query with all its heads per
   program: gathers its rows by DMA exactly as the forward does (`tpu_rows`), recomputes
   p = exp(s - lse), dp = dout . V^T, ds = p (dp - delta) scale; dq += ds . rows in a float32
   VMEM accumulator; and the pair gradients c = ds^T q + p^T dout ([block_k, Dk]: dK in all
   columns, dV added to the first v; block_k rows are the MXU's M dimension) go to HBM by one
   DMA per pair, at the pair's place in its key-row-sorted list (`TransposedIndex.position`,
   read per query as SMEM scalars like the row indices). The write buffer is double-buffered:
   a block's writes are waited on two blocks later (and all at the query's last block).
2. `reduce` kernel, grid (kv rows / reduce_rows), one block of R key rows per program: the
   pairs of those rows lie in one contiguous range of places [offsets[t0], offsets[t0 + R]),
   read in windows of `reduce_window` places by one contiguous DMA each (double-buffered);
   each window is summed into the R rows' float32 accumulator by a one-hot matmul
   [R, window] . [window, Dk] on the MXU (the one-hot row r is 1 on row r's run), and the
   block's dkv rows (aliased in and out over query chunks) get the sum.
   No two programs write one row, nothing is atomic, the windows and the MXU's accumulation
   order never change: dkv has the same bits on every run (dq too: one program per query sums
   its blocks in order).

Why scatter the pair gradients on write rather than gather them on read (the two choices of
the GPU design). A DMA needs its addresses as SMEM scalars. Written at their places, the
pairs kernel reads each pair's place per query, like its row indices (a [K] SMEM block of the
query), and the reduce needs only two scalars per program (where its range starts and ends)
and reads it as large contiguous DMAs. Gathered on read, the reduce would need the pair ids of
a data-dependent range of places as scalars, which no BlockSpec can deliver (SMEM copies of
the id list, pipelined by hand, two levels deep). Both move the same bytes.

Pair gradients are kept in float32 in HBM, viewed [P, 1, Dk] (a DMA may index only a leading
axis dynamically, as for the gather). TPU tiles the last two dims: a bf16 [P, 1, Dk] array
takes (2, 128) tiles that interleave two rows in 32-bit words, so one bf16 row costs as many
bytes as a float32 row ((1, 128) tiles): 4 x 640 (Dk padded to lanes) = 2560 bytes. Float32
costs no more and sums exactly; the reduce rounds them to bf16 for one MXU pass with bf16
inputs (the precision of `gpu_backward`'s bf16 pair gradients) and splits them into three bf16
pieces (exact) with float32 inputs.

Bytes per pair (bf16 kv, Dk 576): gathered row 1152 (+ its tile padding, as in the forward),
pair gradient written 2560 and read back 2560, plus per query chunk one read and write of the
float32 dkv. FLOPs per pair: pairs kernel 2H(3 Dk + 2 v) (88 K at 16 heads, 352 K at 64), reduce
one-hot 2 R Dk per bf16 pass (147 K at R = 128). Speed on a TPU is not measured
(docs/kernels-sparse-mla.md, "TPU backward").

Queries are processed in chunks of `TransposedIndex.chunk_rows` (a lax.scan carrying dkv): one
chunk's pair gradients ([chunk * K + window, 1, Dk] float32, `budget` bytes) are live at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import tpu_interpret
from pallas_kernels.sparse_mla import transpose as tr
from pallas_kernels.sparse_mla import tpu_rows

#: Rows gathered per step of the pairs kernel (the M dimension of its pair-gradient matmuls).
DEFAULT_BLOCK_K = 128
#: Key rows per program of the reduce kernel (the M dimension of its one-hot matmul).
DEFAULT_REDUCE_ROWS = 128
#: Places read per DMA window of the reduce kernel (the contraction of its one-hot matmul).
DEFAULT_REDUCE_WINDOW = 128
#: Bytes of one query chunk's float32 pair gradients.
DEFAULT_BUDGET = 4 * 2**30


def pair_row_bytes(dk: int) -> int:
    """HBM bytes of one float32 pair gradient row [1, Dk] (lanes padded to 128)."""
    return 4 * (-(-dk // 128) * 128)


def default_chunk_rows(rows: int, topk: int, dk: int, budget: int = DEFAULT_BUDGET) -> int:
    """Queries per chunk so that one chunk's pair gradients fit `budget` bytes."""
    return tr.default_chunk_rows(rows, topk, pair_row_bytes(dk), 1, budget)


# ----------------------------------------------------------------------------- pairs kernel

def _write_rows(pos_smem, wbuf, contrib_hbm, wsem, *, block, slot, block_k, start):
    """Starts (or, start=False, waits for) the DMAs of wbuf[slot]'s rows to their places."""

    def step(j, carry):
        if start:
            place = pos_smem[block * block_k + j]
            pltpu.make_async_copy(wbuf.at[slot, j], contrib_hbm.at[place], wsem.at[slot]).start()
        else:
            pltpu.make_async_copy(wbuf.at[slot, j], contrib_hbm.at[0], wsem.at[slot]).wait()
        return carry

    lax.fori_loop(0, block_k, step, 0)


def _pairs_kernel(idx_smem, pos_smem, idx_vmem, q_ref, do_ref, lse_ref, delta_ref, kv_hbm,
                  dq_ref, contrib_hbm, buf, sem, wbuf, wsem, dq_sc, *, sm_scale, v_dim, block_k,
                  num_keys):
    """One program = query r of the chunk, row block kb.

    idx [R, 1, Kp] (global kv rows, -1 = skip) as SMEM [Kp] and VMEM [1, block_k] blocks;
    pos [R, 1, Kp] (each pair's place) as an SMEM block; q [H, Dk], do [H, v], lse / delta
    [H, 1] blocks; kv [1, N, 1, Dk] in HBM -> dq [H, Dk] block; contrib [P, 1, Dk] float32 in
    HBM (row pos[r, j] = the gradient of pair (r, j))."""
    kb = pl.program_id(1)
    nk = pl.num_programs(1)

    @pl.when(kb == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    slot = tpu_rows.prefetch_and_wait(idx_smem, lambda r: kv_hbm.at[0, r], buf, sem, kb=kb, nk=nk,
                                      block_k=block_k, num_keys=num_keys)
    rows = tpu_rows.rows_of(buf, slot)                                   # [bk, Dk]
    dtype = rows.dtype
    idx = idx_vmem[...]                                                  # [1, bk]
    valid = (idx >= 0) & (idx < num_keys)
    q = q_ref[...]                                                       # [H, Dk]
    do = do_ref[...]                                                     # [H, v]
    lse = lse_ref[...]                                                   # [H, 1]
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                       # empty row: p = 0
    s = tpu_rows.dot_nt(q, rows) * sm_scale
    p = jnp.where(valid, jnp.exp(s - lse), 0.0)                          # [H, bk]
    dp = tpu_rows.dot_nt(do, rows[:, :v_dim])                            # [H, bk]
    ds = p * (dp - delta_ref[...]) * sm_scale
    dq_sc[...] += tpu_rows.dot(ds.astype(dtype), rows)
    dk = tpu_rows.dot(ds.T.astype(dtype), q.astype(dtype))               # [bk, Dk]
    dv = tpu_rows.dot(p.T.astype(dtype), do.astype(dtype))               # [bk, v]

    write = functools.partial(_write_rows, pos_smem, wbuf, contrib_hbm, wsem, block_k=block_k)

    @pl.when(kb >= 2)
    def _():
        write(block=kb - 2, slot=slot, start=False)

    out = wbuf.at[slot]                                                  # [bk, 1, Dk]
    if v_dim < dk.shape[1]:
        out[:, :, :v_dim] = (dk[:, :v_dim] + dv).reshape(block_k, 1, v_dim)
        out[:, :, v_dim:] = dk[:, v_dim:].reshape(block_k, 1, dk.shape[1] - v_dim)
    else:
        out[...] = (dk + dv).reshape(out.shape)
    write(block=kb, slot=slot, start=True)

    @pl.when(kb == nk - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)
        write(block=kb, slot=slot, start=False)

        @pl.when(nk >= 2)
        def _():
            write(block=kb - 1, slot=1 - slot, start=False)


def pairs_call(q, do, lse, delta, kv, gidx, pos, *, num_places, sm_scale, block_k, interpret):
    """q [R, H, Dk], do [R, H, v], lse / delta float32 [R, H], kv [N, Dk], gidx int32 [R, Kp]
    (rows of kv, -1 = skip; Kp a multiple of block_k), pos int32 [R, Kp] (places < num_places)
    -> (dq [R, H, Dk] in q dtype, contrib float32 [num_places, 1, Dk]: row pos[r, j] holds pair
    (r, j)'s gradient; rows no pair is placed at are left unwritten)."""
    rows, heads, dk = q.shape
    v_dim = do.shape[-1]
    num_keys = kv.shape[0]
    kp = gidx.shape[-1]
    idx3 = gidx.reshape(rows, 1, kp)
    pos3 = pos.reshape(rows, 1, kp)
    smem = pl.BlockSpec((None, None, kp), lambda r, k: (r, 0, 0), memory_space=pltpu.SMEM)
    per_head = lambda width: pl.BlockSpec((None, heads, width), lambda r, k: (r, 0, 0))
    kernel = functools.partial(_pairs_kernel, sm_scale=sm_scale, v_dim=v_dim, block_k=block_k,
                               num_keys=num_keys)
    pairs = rows * kp
    item = jnp.dtype(q.dtype).itemsize
    cost = pl.CostEstimate(                      # per pair: the row in, its gradient out
        flops=2 * pairs * heads * (3 * dk + 2 * v_dim), transcendentals=pairs * heads,
        bytes_accessed=pairs * (dk * jnp.dtype(kv.dtype).itemsize + pair_row_bytes(dk) + 8)
        + rows * heads * (2 * dk + v_dim) * item)
    return pl.pallas_call(
        kernel,
        grid=(rows, kp // block_k),
        in_specs=[smem, smem, pl.BlockSpec((None, 1, block_k), lambda r, k: (r, 0, k)),
                  per_head(dk), per_head(v_dim), per_head(1), per_head(1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[per_head(dk), pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[jax.ShapeDtypeStruct((rows, heads, dk), q.dtype),
                   jax.ShapeDtypeStruct((num_places, 1, dk), jnp.float32)],
        scratch_shapes=tpu_rows.scratch(block_k, dk, kv.dtype) + [
            pltpu.VMEM((2, block_k, 1, dk), jnp.float32), pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((heads, dk), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        cost_estimate=cost,
        name="sparse_mla_bwd_pairs",
    )(idx3, pos3, idx3, q, do, lse[..., None], delta[..., None], kv.reshape(1, num_keys, 1, dk))


# ----------------------------------------------------------------------------- reduce kernel

def _bf16_pieces(x, passes):
    """float32 x as `passes` bf16 terms whose float32 sum approximates x (3: exactly)."""
    pieces = []
    for _ in range(passes):
        piece = x.astype(jnp.bfloat16)
        pieces.append(piece)
        x = x - piece.astype(jnp.float32)
    return pieces


def _reduce_kernel(bounds_smem, starts_ref, ends_ref, contrib_hbm, dkv_in_ref, dkv_ref, buf, sem,
                   acc_sc, *, window, passes):
    """One program = key rows [i R, (i + 1) R): dkv += the sum of each row's run of places.

    bounds [n + 1] (SMEM: the first place of each block of rows), starts / ends [R, 1] (row r's
    run is places [starts[r], ends[r])), contrib [P, 1, Dk] float32 in HBM, dkv_in / dkv
    [R, Dk] float32 (aliased)."""
    i = pl.program_id(0)
    lo = bounds_smem[i]
    hi = bounds_smem[i + 1]
    first = lo // window * window                    # windows aligned to the window size
    num_windows = jnp.where(hi > lo, (hi - first + window - 1) // window, 0)
    dk = acc_sc.shape[-1]

    def copy(w, slot):
        return pltpu.make_async_copy(contrib_hbm.at[pl.ds(first + w * window, window)],
                                     buf.at[slot], sem.at[slot])

    @pl.when(num_windows > 0)
    def _():
        copy(0, 0).start()

    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    starts = starts_ref[...]                                             # [R, 1]
    ends = ends_ref[...]

    def body(w, carry):
        slot = w % 2

        @pl.when(w + 1 < num_windows)
        def _():
            copy(w + 1, 1 - slot).start()

        copy(w, slot).wait()
        base = first + w * window
        x = buf[slot].reshape(window, dk)                                # [window, Dk]
        place = base + lax.broadcasted_iota(jnp.int32, (window, 1), 0)
        x = jnp.where((place >= lo) & (place < hi), x, 0.0)            # other blocks' / unwritten
        place = base + lax.broadcasted_iota(jnp.int32, (1, window), 1)
        onehot = ((place >= starts) & (place < ends)).astype(jnp.bfloat16)   # [R, window]
        for piece in _bf16_pieces(x, passes):
            acc_sc[...] += tpu_rows.dot(onehot, piece)
        return carry

    lax.fori_loop(0, num_windows, body, 0)
    dkv_ref[...] = dkv_in_ref[...] + acc_sc[...]


def reduce_call(contrib, offsets, dkv, *, rows_per_block, window, passes, interpret):
    """contrib float32 [P, 1, Dk] (sorted by kv row; P >= the last place + window), offsets
    int32 [N + 1] (row t's pairs at places offsets[t] .. offsets[t + 1] - 1), dkv float32
    [n * rows_per_block, Dk] (N rounded up) -> dkv[t] + the sum of row t's pairs."""
    num_padded, dk = dkv.shape
    num_rows = offsets.shape[0] - 1
    blocks = num_padded // rows_per_block
    off = jnp.pad(offsets, (0, num_padded - num_rows), mode="edge")     # padded rows: empty runs
    bounds = off[::rows_per_block]
    runs = lambda x: x.reshape(num_padded, 1)
    row_block = lambda width: pl.BlockSpec((rows_per_block, width), lambda i, b: (i, 0))
    kernel = functools.partial(_reduce_kernel, window=window, passes=passes)
    places = contrib.shape[0]
    cost = pl.CostEstimate(                      # every place read once (windows' overlap aside)
        flops=2 * places * rows_per_block * dk * passes, transcendentals=0,
        bytes_accessed=places * pair_row_bytes(dk) + 2 * dkv.size * 4)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(blocks,),
            in_specs=[row_block(1), row_block(1), pl.BlockSpec(memory_space=pl.ANY), row_block(dk)],
            out_specs=row_block(dk),
            scratch_shapes=[pltpu.VMEM((2, window, 1, dk), jnp.float32),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((rows_per_block, dk), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(dkv.shape, jnp.float32),
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret(interpret),
        cost_estimate=cost,
        name="sparse_mla_bwd_reduce",
    )(bounds, runs(off[:-1]), runs(off[1:]), contrib, dkv)


# ----------------------------------------------------------------------------- driver

def backward(q, kv, indices, dout, lse, delta, *, sm_scale, v_dim, tindex=None,
             block_k=DEFAULT_BLOCK_K, reduce_rows=DEFAULT_REDUCE_ROWS,
             reduce_window=DEFAULT_REDUCE_WINDOW, budget=DEFAULT_BUDGET, interpret=False):
    """(dq [B, S, H, Dk] in q dtype, dkv float32 [B, T, Dk]) of sparse MLA (module docstring).

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 / out of range = skip),
    dout [B, S, H, v], lse, delta float32 [B, S, H] (delta = sum(out * dout) - dlse).
    tindex: `transpose.transpose_index(indices, T, chunk_rows=...)`, reusable by every layer
    sharing the indices (built here when None, with chunks of `budget` bytes of pair gradients,
    `default_chunk_rows`). block_k: rows per step of the pairs kernel; reduce_rows, reduce_window:
    key rows per program and places per DMA window of the reduce kernel (multiples of 8)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    topk = indices.shape[-1]
    rows = batch * seq_len
    tindex = tr.checked_or_built(tindex, indices, num_keys, default_chunk_rows(rows, topk, dk, budget))
    chunk, n = tindex.chunk_rows, tindex.num_chunks
    kp = -(-topk // block_k) * block_k
    per = chunk * topk                                   # pairs per chunk
    passes = 3 if jnp.dtype(kv.dtype).itemsize >= 4 else 1

    gidx = tr.global_rows(indices, num_keys).reshape(rows, topk)
    gidx = jnp.pad(gidx, ((0, n * chunk - rows), (0, kp - topk)), constant_values=-1)
    # each pair's place in its chunk's sorted list; padded slots (zero gradients) all go to `per`
    pos = jnp.pad(tindex.position.reshape(n * chunk, topk), ((0, 0), (0, kp - topk)),
                  constant_values=per)

    def flat(x, value=0.0):
        x = x.reshape((rows,) + x.shape[2:])
        return jnp.pad(x, ((0, n * chunk - rows),) + ((0, 0),) * (x.ndim - 1),
                       constant_values=value)

    xs = (flat(q), flat(dout.astype(q.dtype)), flat(lse, -jnp.inf), flat(delta), gidx, pos)
    xs = tuple(x.reshape((n, chunk) + x.shape[1:]) for x in xs) + (tindex.offsets,)
    kv_rows = kv.reshape(batch * num_keys, dk)
    padded_rows = -(-(batch * num_keys) // reduce_rows) * reduce_rows

    def step(dkv, args):
        q_c, do_c, lse_c, delta_c, gidx_c, pos_c, off_c = args
        dq_c, contrib = pairs_call(q_c, do_c, lse_c, delta_c, kv_rows, gidx_c, pos_c,
                                   num_places=per + reduce_window, sm_scale=sm_scale,
                                   block_k=block_k, interpret=interpret)
        dkv = reduce_call(contrib, off_c, dkv, rows_per_block=reduce_rows, window=reduce_window,
                          passes=passes, interpret=interpret)
        return dkv, dq_c

    dkv0 = jnp.zeros((padded_rows, dk), jnp.float32)
    dkv, dq = lax.scan(step, dkv0, xs)
    dq = dq.reshape((n * chunk, heads, dk))[:rows].reshape(q.shape)
    return dq, dkv[:batch * num_keys].reshape(batch, num_keys, dk)
