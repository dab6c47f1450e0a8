"""Sparse MLA backward on NVIDIA GPUs (Pallas, Triton lowering): no atomics, the same bits on
every run.

Shapes: q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v]), indices int32 [B, S, K] (-1 or out of
range = skip), dout [B, S, H, v], lse / delta float32 [B, S, H] -> dq [B, S, H, Dk] (q dtype),
dkv float32 [B, T, Dk]: the `bwd_adds_dkv=True` contract of `vjp.make_sparse_mla`.

Why this shape of computation. Call one (query, selected row) a pair. Every pair's gradient
needs the query's q and dout (H x (Dk + v) values: 34 KB at 16 heads, 139 KB at 64) and the
row's latent vector (Dk = 576 values, 1152 bytes). A kernel that keeps the query on chip and
gathers the rows moves ~1 KB per pair; one that keeps a row on chip and gathers the selecting
queries (dkv "by key row") moves 34-139 KB per pair, 30-120x more, and no L2 holds the
queries (1.2 GB of q at 64K queries x 16 heads). So both gradients are computed query-major and
only dkv's *sum* is reorganised by key row, through the transposed index of `transpose.py`
(built once per IndexShare group and reusable by its layers):

1. `pairs` kernel, one program per query with all its heads: loops over the K selected rows in
   blocks of `block_k`, gathers them (each a contiguous 1152-byte row), recomputes
   p = exp(s - lse), dp and ds, and writes each pair's dkv row
   c[j] = ds[:, j]^T q + p[:, j]^T dout (dK in all Dk columns, + dV in the first v) at the
   pair's place in its row-sorted list (`TransposedIndex.position`), plus dq (summed in float32
   registers) or, with `fuse_dq=False`, ds^T [chunk, K, H] for the `dq` kernel.
   The block's rows are the M dimension of every matmul (s^T = rows . q^T is [block_k, H]), so
   16 heads still make 64-row Hopper MMAs (wgmma; heads as M would be 16-row mma.sync), and q
   and dout sit in shared memory once: Triton serves the K-major operand of s^T and the
   MN-major operand of c from one buffer (with heads as M it kept two copies of each, which is
   why the current kernel needs two 32-head programs at 64 heads).
2. `reduce` kernel, one program per latent row t: sums the row's pair gradients, which now lie
   in one contiguous run, in float32 in place order (by query, then slot), and adds the sum into
   dkv. No two programs write one row, nothing is atomic, the order never changes: dkv has the
   same bits on every run (and so has dq: one program sums each query's dq in a fixed order).
3. (`fuse_dq=False`) `dq` kernel, one program per query: dq = ds . rows, gathering the rows
   again. The default at 64 heads: q and dout (136 KB) plus a row block fill Hopper's shared
   memory, so dq's [64, 576] float32 accumulator cannot share their program (Triton asked for
   311 KB) and the pairs kernel runs unpipelined there.

Queries are processed in chunks of `chunk_rows` (a lax.scan carrying dkv) so that one chunk's
pair gradients ([chunk, K, Dk] in kv's dtype, `budget` bytes, default 4 GiB) are live at once.

Bytes per pair (bf16): gather 1152 + pair gradient written 1152 + read back 1152 (+ 1152 for
the second gather and 4H for ds^T without fused dq); FLOPs per pair 2H(3 Dk + 2 v). At 16 heads
that is 25 FLOP/byte (76 on the gathered rows alone) against the H200's ~220 (measured matmul
rate / copy bandwidth): the backward is bound by memory, not by the matmul rate; at 64 heads,
72 FLOP/byte (306 on the rows alone). Measured on an H200 (random
indices, docs/kernels-sparse-mla.md): 16 heads x 64K queries 183 ms (4.1x faster than the
atomic kernel, at 82% of the copy bandwidth on this design's bytes), 64 heads x 8K queries
42.6 ms (3.4x faster than the current best, scatter).

Float32 inputs keep float32 pair gradients and use 32-row blocks; they fit shared memory at up
to 32 heads x 576 (bf16 is the supported GPU dtype at 64 heads, as for the current kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import transpose as tr
from pallas_kernels.attention import vjp

#: Rows per loop step of the pairs kernel (the M dimension of its matmuls).
DEFAULT_BLOCK_K = 64
#: Pairs summed per step of the reduce kernel.
DEFAULT_REDUCE_BLOCK = 32
#: Column chunk of the per-pair gradient (its [block_k, chunk] float32 tile lives in registers).
DEFAULT_COL_BLOCK = 128
#: Bytes of one query chunk's per-pair gradients.
DEFAULT_BUDGET = 4 * 2**30
#: Largest padded head count whose dq accumulator is kept in the pairs kernel.
FUSED_DQ_MAX_HEADS = 32


def default_chunk_rows(rows: int, topk: int, dk: int, dtype, budget: int = DEFAULT_BUDGET) -> int:
    """Queries per chunk so that one chunk's pair gradients (kv's dtype, float32 for 4-byte kv)
    fit `budget` bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    return tr.default_chunk_rows(rows, topk, dk, 4 if itemsize >= 4 else itemsize, budget)


def backward_index(indices: jax.Array, num_keys: int, *, dk: int, dtype, budget: int = DEFAULT_BUDGET
                   ) -> tr.TransposedIndex:
    """The transposed index `backward` takes for indices int32 [B, S, K] over num_keys latent rows
    of width dk in `dtype`: build it once and pass it to every layer that shares the indices."""
    batch, seq_len, topk = indices.shape
    chunk = default_chunk_rows(batch * seq_len, topk, dk, dtype, budget)
    return tr.transpose_index(indices, num_keys, chunk_rows=chunk)


def pow2_chunks(start: int, stop: int, most: int = 1 << 30) -> list[tuple[int, int]]:
    """[start, stop) cut into power-of-two (offset, size) chunks of at most `most`, largest first."""
    out = []
    while start < stop:
        size = min(most, 1 << ((stop - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot(a, b):          # a [m, k] . b [k, n]
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nt(a, b):       # a [m, k] . b [n, k]^T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):       # a [k, m]^T . b [k, n]
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- pairs kernel

def _pairs_kernel(q_ref, do_ref, lse_ref, delta_ref, kv_ref, idx_ref, pos_ref, out_ref,
                  contrib_ref, *, sm_scale, block_k, num_blocks, kchunks, vchunks, fuse_dq, evict):
    """One program = one query row r with all (padded) heads H.

    q [R, H, Dk], do [R, H, v], lse / delta [R, H], kv [N, Dk], idx [R, Kp] (rows of kv, -1 =
    skip), pos [R, Kp] (each pair's place) -> out: dq [R, H, Dk] (fuse_dq) or ds^T [R, Kp, H];
    contrib [P, Dk] (row pos[r, j] = the gradient of pair (r, j))."""
    r = pl.program_id(0)
    nv = len(vchunks)
    qs = [q_ref[r, :, pl.ds(c0, cs)] for c0, cs in kchunks]            # [H, cs]
    dos = [do_ref[r, :, pl.ds(c0, cs)] for c0, cs in vchunks]          # [H, cs]
    lse = lse_ref[r, :]
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                    # empty row: p = 0
    delta = delta_ref[r, :]
    heads = qs[0].shape[0]

    def body(j, dqts):
        k0 = j * block_k
        gidx = idx_ref[r, pl.ds(k0, block_k)]                          # [bk]
        valid = gidx >= 0
        safe = jnp.where(valid, gidx, 0)
        rows = [kv_ref[safe, pl.ds(c0, cs)] for c0, cs in kchunks]     # [bk, cs] each
        dtype = rows[0].dtype
        st = _dot_nt(rows[0], qs[0])                                   # s^T [bk, H]
        for rc, qc in zip(rows[1:], qs[1:]):
            st += _dot_nt(rc, qc)
        pt = jnp.where(valid[:, None], jnp.exp(st * sm_scale - lse[None, :]), 0.0)
        dpt = _dot_nt(rows[0], dos[0])                                 # dp^T [bk, H]
        for rc, dc in zip(rows[1:nv], dos[1:]):
            dpt += _dot_nt(rc, dc)
        dst = pt * (dpt - delta[None, :]) * sm_scale                    # ds^T [bk, H]
        dsc = dst.astype(dtype)
        pc = pt.astype(dtype)
        place = pos_ref[r, pl.ds(k0, block_k)]                         # [bk]
        for i, ((c0, cs), qc) in enumerate(zip(kchunks, qs)):
            c = _dot(dsc, qc)                                          # [bk, cs]
            if i < nv:
                c += _dot(pc, dos[i])
            dst_ref = contrib_ref.at[place, pl.ds(c0, cs)]
            if evict:
                plgpu.store(dst_ref, c.astype(contrib_ref.dtype), eviction_policy="evict_first")
            else:
                dst_ref[...] = c.astype(contrib_ref.dtype)
        if not fuse_dq:
            out_ref[r, pl.ds(k0, block_k), :] = dsc.astype(out_ref.dtype)
            return dqts
        return tuple(dqt + _dot_tn(rc, dsc) for rc, dqt in zip(rows, dqts))   # dq^T [cs, H]

    init = tuple(jnp.zeros((cs, heads), jnp.float32) for _, cs in kchunks) if fuse_dq else ()
    dqts = lax.fori_loop(0, num_blocks, body, init)
    if fuse_dq:
        for (c0, cs), dqt in zip(kchunks, dqts):
            out_ref[r, :, pl.ds(c0, cs)] = dqt.T.astype(out_ref.dtype)


def pairs_call(q, do, lse, delta, kv, gidx, pos, *, num_places, sm_scale, block_k, col_block,
               fuse_dq, contrib_dtype, num_warps, num_stages, interpret, evict=False):
    """q [R, H, Dk], do [R, H, v], lse / delta float32 [R, H], kv [N, Dk], gidx int32 [R, Kp]
    (Kp a multiple of block_k), pos int32 [R, Kp] (places < num_places) -> (dq [R, H, Dk] in q
    dtype, or ds^T [R, Kp, H] in kv dtype; contrib [num_places, Dk] in contrib_dtype, row
    pos[r, j] holding pair (r, j)'s gradient; rows no pair is placed at are left unwritten)."""
    rows, heads, dk = q.shape
    v_dim = do.shape[-1]
    kp = gidx.shape[-1]
    kchunks = pow2_chunks(0, v_dim, col_block) + pow2_chunks(v_dim, dk, col_block)
    vchunks = pow2_chunks(0, v_dim, col_block)
    kernel = functools.partial(_pairs_kernel, sm_scale=sm_scale, block_k=block_k,
                               num_blocks=kp // block_k, kchunks=kchunks, vchunks=vchunks,
                               fuse_dq=fuse_dq, evict=evict and not interpret)
    first = (jax.ShapeDtypeStruct((rows, heads, dk), q.dtype) if fuse_dq
             else jax.ShapeDtypeStruct((rows, kp, heads), kv.dtype))
    return pl.pallas_call(
        kernel, grid=(rows,),
        out_shape=[first, jax.ShapeDtypeStruct((num_places, dk), contrib_dtype)],
        compiler_params=_params(num_warps, num_stages), interpret=interpret,
        name="sparse_mla_bwd_pairs",
    )(q, do, lse, delta, kv, gidx, pos)


# ----------------------------------------------------------------------------- dq kernel

def _dq_kernel(ds_ref, kv_ref, idx_ref, dq_ref, *, block_k, num_blocks, kchunks):
    """One program = one query row r: dq [H, Dk] = sum over blocks of ds[:, blk] . rows[blk]."""
    r = pl.program_id(0)
    heads = ds_ref.shape[-1]

    def body(j, dqs):
        k0 = j * block_k
        gidx = idx_ref[r, pl.ds(k0, block_k)]
        safe = jnp.where(gidx >= 0, gidx, 0)
        dst = ds_ref[r, pl.ds(k0, block_k), :]                         # [bk, H]; 0 where invalid
        return tuple(dq + _dot_tn(dst, kv_ref[safe, pl.ds(c0, cs)])
                     for (c0, cs), dq in zip(kchunks, dqs))

    dqs = lax.fori_loop(0, num_blocks, body,
                        tuple(jnp.zeros((heads, cs), jnp.float32) for _, cs in kchunks))
    for (c0, cs), dq in zip(kchunks, dqs):
        dq_ref[r, :, pl.ds(c0, cs)] = dq.astype(dq_ref.dtype)


def dq_call(dst, kv, gidx, *, dtype, block_k, col_block, num_warps, num_stages, interpret):
    """ds^T [R, Kp, H], kv [N, Dk], gidx [R, Kp] -> dq [R, H, Dk] in `dtype`."""
    rows, kp, heads = dst.shape
    dk = kv.shape[-1]
    kernel = functools.partial(_dq_kernel, block_k=block_k, num_blocks=kp // block_k,
                               kchunks=pow2_chunks(0, dk, col_block))
    return pl.pallas_call(
        kernel, grid=(rows,), out_shape=jax.ShapeDtypeStruct((rows, heads, dk), dtype),
        compiler_params=_params(num_warps, num_stages), interpret=interpret,
        name="sparse_mla_bwd_dq",
    )(dst, kv, gidx)


# ----------------------------------------------------------------------------- reduce kernel

def _reduce_kernel(contrib_ref, off_ref, dkv_in_ref, dkv_ref, *, block, chunks, evict):
    """One program = one latent row t: dkv[t] += the sum of its pairs' gradients, in place order.

    contrib [P + spare, Dk] (row t's pairs at places off[t] .. off[t+1] - 1); off int32 [N + 1];
    dkv_in / dkv float32 [N, Dk] (aliased)."""
    t = pl.program_id(0)
    start = off_ref[t]
    stop = off_ref[t + 1]
    lane = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def body(i, accs):
        first = start + i * block
        live = first + lane < stop
        out = []
        for (c0, cs), acc in zip(chunks, accs):
            src = contrib_ref.at[pl.ds(first, block), pl.ds(c0, cs)]
            vals = (plgpu.load(src, eviction_policy="evict_first") if evict else src[...])
            vals = vals.astype(jnp.float32)                                 # [block, cs]
            out.append(acc + jnp.sum(jnp.where(live[:, None], vals, 0.0), axis=0))
        return tuple(out)

    steps = (stop - start + block - 1) // block
    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((cs,), jnp.float32) for _, cs in chunks))
    for (c0, cs), acc in zip(chunks, accs):
        dkv_ref[t, pl.ds(c0, cs)] = dkv_in_ref[t, pl.ds(c0, cs)] + acc


def reduce_call(contrib, offsets, dkv, *, block, num_warps, interpret, evict=False):
    """contrib [P + spare, Dk] (sorted by kv row; spare >= block), offsets int32 [N + 1], dkv
    float32 [N, Dk] -> dkv[t] + the sum of contrib[offsets[t]:offsets[t+1]] (in that order)."""
    dk = contrib.shape[-1]
    num_rows = dkv.shape[0]
    kernel = functools.partial(_reduce_kernel, block=block, chunks=pow2_chunks(0, dk),
                               evict=evict and not interpret)
    return pl.pallas_call(
        kernel, grid=(num_rows,), out_shape=jax.ShapeDtypeStruct(dkv.shape, jnp.float32),
        input_output_aliases={2: 0}, compiler_params=_params(num_warps, 2),
        interpret=interpret, name="sparse_mla_bwd_reduce",
    )(contrib, offsets, dkv)


# ----------------------------------------------------------------------------- driver

def _pad_heads(x, hp, value=0.0):
    """[R, H, ...] -> [R, hp, ...]."""
    if x.shape[1] == hp:
        return x
    widths = [(0, 0), (0, hp - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths, constant_values=value)


def backward(q, kv, indices, dout, lse, delta, *, sm_scale, v_dim, tindex=None,
             budget=DEFAULT_BUDGET, block_k=None, col_block=DEFAULT_COL_BLOCK,
             fuse_dq=None, num_warps=4, num_stages=None, reduce_block=DEFAULT_REDUCE_BLOCK,
             reduce_warps=4, evict=False, dq_warps=8, dq_stages=2, interpret=False):
    """(dq [B, S, H, Dk] in q dtype, dkv float32 [B, T, Dk]) of sparse MLA (module docstring).

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 / out of range = skip),
    dout [B, S, H, v], lse, delta float32 [B, S, H] (delta = sum(out * dout) - dlse).
    tindex: `transpose.transpose_index(indices, T, chunk_rows=...)`, reusable by every layer
    sharing the indices (built here when None, with chunks of `budget` bytes).
    Settings (defaults measured best on an H200): block_k rows per step of the pairs and dq
    kernels (64; 32 for float32), col_block the widest column chunk of a pair gradient tile,
    fuse_dq keep dq in the pairs kernel (default: when the padded heads are <= 32),
    num_warps / num_stages (pairs kernel: 4; 2 stages with fused dq, else 1), dq_warps /
    dq_stages (dq kernel: 8, 2), reduce_block / reduce_warps (pairs summed per step of the
    reduce kernel, <= transpose.SPARE_ROWS: 32, 4), evict (stream the pair gradients past L2)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    topk = indices.shape[-1]
    rows = batch * seq_len
    hp = max(16, _next_pow2(heads))
    fuse_dq = hp <= FUSED_DQ_MAX_HEADS if fuse_dq is None else bool(fuse_dq)
    if num_stages is None:
        num_stages = 2 if fuse_dq else 1
    wide = jnp.dtype(kv.dtype).itemsize >= 4
    contrib_dtype = jnp.float32 if wide else kv.dtype
    if block_k is None:
        block_k = DEFAULT_BLOCK_K // 2 if wide else DEFAULT_BLOCK_K
    tindex = tr.checked_or_built(tindex, indices, num_keys, default_chunk_rows(rows, topk, dk, kv.dtype, budget))
    chunk, n = tindex.chunk_rows, tindex.num_chunks
    kp = -(-topk // block_k) * block_k

    gidx = tr.global_rows(indices, num_keys).reshape(rows, topk)
    gidx = jnp.pad(gidx, ((0, n * chunk - rows), (0, kp - topk)), constant_values=-1)
    pad_r = ((0, n * chunk - rows),)

    def flat(x, value=0.0):
        x = _pad_heads(x.reshape((rows, heads) + x.shape[3:]), hp, value)
        return jnp.pad(x, pad_r + ((0, 0),) * (x.ndim - 1), constant_values=value)

    per = chunk * topk                                   # pairs per chunk
    if reduce_block > tr.SPARE_ROWS:
        raise ValueError(f"reduce_block must be <= {tr.SPARE_ROWS}")
    # each pair's place in its chunk's sorted list; padded slots all go to the first spare row
    pos = jnp.pad(tindex.position.reshape(n * chunk, topk), ((0, 0), (0, kp - topk)),
                  constant_values=per)
    xs = (flat(q), flat(dout.astype(q.dtype)), flat(lse, -jnp.inf), flat(delta), gidx, pos,
          tindex.offsets)
    xs = tuple(x.reshape((n, chunk) + x.shape[1:]) if i < 6 else x for i, x in enumerate(xs))
    kv_rows = kv.reshape(batch * num_keys, dk)
    cfg = dict(num_warps=num_warps, interpret=interpret)

    def step(dkv, args):
        q_c, do_c, lse_c, delta_c, gidx_c, pos_c, off_c = args
        first, contrib = pairs_call(q_c, do_c, lse_c, delta_c, kv_rows, gidx_c, pos_c,
                                    num_places=per + tr.SPARE_ROWS, sm_scale=sm_scale,
                                    block_k=block_k, col_block=col_block, fuse_dq=fuse_dq,
                                    contrib_dtype=contrib_dtype, num_stages=num_stages, evict=evict,
                                    **cfg)
        dq_c = first if fuse_dq else dq_call(first, kv_rows, gidx_c, dtype=q.dtype, block_k=block_k,
                                             col_block=col_block, num_stages=dq_stages,
                                             num_warps=dq_warps, interpret=interpret)
        dkv = reduce_call(contrib, off_c, dkv, block=reduce_block, num_warps=reduce_warps,
                          interpret=interpret, evict=evict)
        return dkv, dq_c

    dkv0 = jnp.zeros((batch * num_keys, dk), jnp.float32)
    if n == 1:
        dkv, dq = step(dkv0, tuple(x[0] for x in xs))
    else:
        dkv, dq = lax.scan(step, dkv0, xs)
    dq = dq.reshape((n * chunk, hp, dk))[:rows, :heads].reshape(q.shape)
    return dq, dkv.reshape(batch, num_keys, dk)


# ----------------------------------------------------------------------------- a differentiable op

@functools.lru_cache(maxsize=None)
def _op(sm_scale, v_dim, fwd_block_k, fwd_warps, fwd_stages, bwd_cfg, chunk_rows, interpret):
    from pallas_kernels.attention import gpu as gpu_fwd          # the existing forward kernel

    def fwd(q, kv, indices):
        b, s, k = indices.shape
        kp = -(-k // fwd_block_k) * fwd_block_k
        idx = jnp.pad(jnp.asarray(indices, jnp.int32), ((0, 0), (0, 0), (0, kp - k)),
                      constant_values=-1)
        return gpu_fwd._forward(q, kv, idx.reshape(b * s, kp), sm_scale=sm_scale, v_dim=v_dim,
                                block_k=fwd_block_k, splits=1, num_warps=fwd_warps,
                                num_stages=fwd_stages, interpret=interpret)

    bwd = functools.partial(backward, sm_scale=sm_scale, v_dim=v_dim, interpret=interpret,
                            **dict(bwd_cfg))
    return vjp.make_indexed_sparse_mla(fwd, bwd, chunk_rows=chunk_rows)


def sparse_mla(q, kv, indices, *, sm_scale, v_dim, tindex=None, interpret=False,
               fwd_block_k=64, fwd_warps=8, fwd_stages=2, budget=DEFAULT_BUDGET, **bwd_cfg):
    """Sparse MLA (contract of `pallas_kernels.sparse_mla`) with the existing GPU forward
    kernel (`attention.gpu`, one program per query) and this module's deterministic backward.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] -> (out [B, S, H, v] in q dtype,
    lse float32 [B, S, H]). tindex: a prebuilt `transpose.transpose_index(indices, T, ...)`
    (shared by the layers of an IndexShare group); built here from `budget` when None.
    bwd_cfg: `backward`'s kernel settings (block_k, col_block, fuse_dq, num_warps, ...)."""
    if tindex is None:
        tindex = backward_index(indices, kv.shape[1], dk=q.shape[-1], dtype=kv.dtype, budget=budget)
    op = _op(float(sm_scale), int(v_dim), int(fwd_block_k), int(fwd_warps), int(fwd_stages),
             tuple(sorted(bwd_cfg.items())), tindex.chunk_rows, bool(interpret))
    return op(q, kv, jnp.asarray(indices, jnp.int32), tindex.position, tindex.offsets)
