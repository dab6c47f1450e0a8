"""The "sorted" sparse MLA backward's kernels on NVIDIA GPUs (Pallas, Triton lowering), driven
by `gpu_backward.backward` (see its module docstring for the algorithm): `pairs_call` (one
program per query: each (query, selected row) pair's dkv row at its place in the transposed
index, and dq or ds^T), `dq_call` (dq = ds . rows where the pairs kernel cannot keep dq) and
`reduce_call` (one program per latent row: sums its pairs' contiguous run into dkv in a fixed
order). No atomics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import dot, dot_nt, dot_tn
from pallas_kernels.sparse_mla import transpose as tr
from pallas_kernels.sparse_mla.gpu_tiles import (head_rows, iota, kernel_params, load_heads, pow2_chunks,
                                                slot_block, store_heads)


def _pairs_kernel(q_ref, do_ref, lse_ref, delta_ref, kv_ref, idx_ref, *refs, sm_scale, seq_len, num_keys,
                  heads, block_k, topk, kchunks, vchunks, fuse_dq, chunk_rows, rows, pairs, evict):
    """One program = one query row r with all its heads (a tile of head_rows(H) rows).

    q [R, H, Dk], do [R, H, v], lse / delta [R, H], kv [B*T, Dk], idx [R, K] (rows of kv[b],
    -1 = skip). chunk_rows set: refs start with chunk [1] (the row r = chunk * chunk_rows +
    program, rows >= R skip); pairs: then pos [n, chunk_rows * K] (each pair's place). With
    fuse_dq and chunk_rows, a dq input aliased to the dq output. Outputs: dq [R, H, Dk]
    (fuse_dq) or ds^T [chunk_rows, Kp, hp]; with pairs, contrib [P, Dk] (row pos[c, local pair]
    = the gradient of that pair)."""
    refs = list(refs)
    local = pl.program_id(0)
    if chunk_rows is None:
        c, r = 0, local
    else:
        c = refs.pop(0)[0]
        r = c * chunk_rows + local
    pos_ref = refs.pop(0) if pairs else None
    if fuse_dq and chunk_rows is not None:
        refs.pop(0)                                                    # dq input, aliased
    out_ref = refs.pop(0)
    contrib_ref = refs.pop(0) if pairs else None
    nv = len(vchunks)
    hp = head_rows(heads)

    def program():
        qs = [load_heads(q_ref, (r,), 0, hp, heads, cols) for cols in kchunks]          # [hp, cs]
        dos = [load_heads(do_ref, (r,), 0, hp, heads, cols) for cols in vchunks]
        lse = load_heads(lse_ref, (r,), 0, hp, heads, other=jnp.inf)
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                # empty row: p = 0
        delta = load_heads(delta_ref, (r,), 0, hp, heads)
        base = (r // seq_len) * num_keys

        def body(j, dqts):
            k0 = j * block_k
            valid, safe = slot_block(idx_ref, r, k0, block_k, topk, num_keys, base)
            kv_rows = [kv_ref[safe, pl.ds(c0, cs)] for c0, cs in kchunks]            # [bk, cs]
            dtype = kv_rows[0].dtype
            st = dot_nt(kv_rows[0], qs[0])                                          # s^T [bk, hp]
            for rc, qc in zip(kv_rows[1:], qs[1:]):
                st += dot_nt(rc, qc)
            pt = jnp.where(valid[:, None], jnp.exp(st * sm_scale - lse[None, :]), 0.0)
            dpt = dot_nt(kv_rows[0], dos[0])                                        # dp^T [bk, hp]
            for rc, dc in zip(kv_rows[1:nv], dos[1:]):
                dpt += dot_nt(rc, dc)
            dsc = (pt * (dpt - delta[None, :]) * sm_scale).astype(dtype)             # ds^T [bk, hp]
            if pairs:
                pc = pt.astype(dtype)
                k = k0 + iota((block_k,), 0)
                place = plgpu.load(pos_ref.at[c, local * topk + k], mask=k < topk, other=pos_ref.shape[1])
                for i, ((c0, cs), qc) in enumerate(zip(kchunks, qs)):
                    g = dot(dsc, qc)                                                # [bk, cs]
                    if i < nv:
                        g += dot(pc, dos[i])
                    dst = contrib_ref.at[place, pl.ds(c0, cs)]
                    if evict:
                        plgpu.store(dst, g.astype(contrib_ref.dtype), eviction_policy="evict_first")
                    else:
                        dst[...] = g.astype(contrib_ref.dtype)
            if not fuse_dq:
                out_ref[local, pl.ds(k0, block_k), :] = dsc.astype(out_ref.dtype)
                return dqts
            return tuple(dqt + dot_tn(rc, dsc) for rc, dqt in zip(kv_rows, dqts))   # dq^T [cs, hp]

        init = tuple(jnp.zeros((cs, hp), jnp.float32) for _, cs in kchunks) if fuse_dq else ()
        dqts = lax.fori_loop(0, -(-topk // block_k), body, init)
        if fuse_dq:
            for (c0, _), dqt in zip(kchunks, dqts):
                store_heads(out_ref, (r,), 0, heads, dqt.T.astype(out_ref.dtype), c0)

    if chunk_rows is None:
        program()
    else:
        pl.when(r < rows)(program)


def pairs_call(q, do, lse, delta, kv, indices, *, seq_len, sm_scale, block_k, col_block, fuse_dq,
               num_warps, num_stages, interpret, pos=None, chunk=None, dq=None, contrib_dtype=None,
               evict=False):
    """q [R, H, Dk], do [R, H, v], lse / delta float32 [R, H], kv [B*T, Dk], indices int32 [R, K]
    (rows of each query's sequence, R = B * seq_len; -1 / out of range = skip).

    pos: None (dq only) or the transposed index's places int32 [n, chunk_rows * K]; chunk: None
    (every row in one call) or (c int32 [1], chunk_rows): this call runs rows c * chunk_rows ..
    (c + 1) * chunk_rows - 1 (those < R); dq: with chunk and fuse_dq, the dq array [R, H, Dk]
    whose chunk rows this call fills (aliased).
    -> (dq [R, H, Dk] in q dtype, or ds^T [chunk rows, Kp, hp] in kv dtype with fuse_dq=False;
    with pos also contrib [n_places + SPARE_ROWS, Dk] in contrib_dtype, row pos[c, j] holding
    the chunk's local pair j's gradient; rows no pair is placed at are left unwritten)."""
    rows, heads, dk = q.shape
    v_dim = do.shape[-1]
    topk = indices.shape[-1]
    num_keys = kv.shape[0] // (rows // seq_len)
    kchunks = pow2_chunks(0, v_dim, col_block) + pow2_chunks(v_dim, dk, col_block)
    vchunks = pow2_chunks(0, v_dim, col_block)
    chunk_rows = None if chunk is None else int(chunk[1])
    grid_rows = rows if chunk is None else chunk_rows
    kernel = functools.partial(_pairs_kernel, sm_scale=sm_scale, seq_len=seq_len, num_keys=num_keys, heads=heads,
                               block_k=block_k, topk=topk, kchunks=kchunks, vchunks=vchunks, fuse_dq=fuse_dq,
                               chunk_rows=chunk_rows, rows=rows, pairs=pos is not None,
                               evict=evict and not interpret)
    kp = -(-topk // block_k) * block_k
    args = [q, do, lse, delta, kv, indices]
    if chunk is not None:
        args.append(chunk[0])
    if pos is not None:
        args.append(pos)
    aliases = {}
    if fuse_dq and chunk is not None:
        aliases = {len(args): 0}
        args.append(dq)
    out_shape = [jax.ShapeDtypeStruct((rows, heads, dk), q.dtype) if fuse_dq
                 else jax.ShapeDtypeStruct((grid_rows, kp, head_rows(heads)), kv.dtype)]
    if pos is not None:
        out_shape.append(jax.ShapeDtypeStruct((pos.shape[1] + tr.SPARE_ROWS, dk), contrib_dtype))
    outs = pl.pallas_call(
        kernel, grid=(grid_rows,), out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=kernel_params(num_warps, num_stages), interpret=interpret,
        name="sparse_mla_bwd_pairs" if pos is not None else "sparse_mla_bwd_queries",
    )(*args)
    return tuple(outs) if pos is not None else outs[0]


# ----------------------------------------------------------------------------- dq kernel

def _dq_kernel(ds_ref, kv_ref, idx_ref, chunk_ref, dq_in_ref, dq_ref, *, seq_len, num_keys, heads, block_k,
               topk, kchunks, chunk_rows, rows):
    """One program = one query row r = chunk * chunk_rows + program (< R):
    dq [H, Dk] = sum over blocks of ds[:, blk] . rows[blk], written into the aliased dq."""
    del dq_in_ref
    local = pl.program_id(0)
    r = chunk_ref[0] * chunk_rows + local
    hp = ds_ref.shape[-1]

    @pl.when(r < rows)
    def _():
        base = (r // seq_len) * num_keys

        def body(j, dqs):
            k0 = j * block_k
            _, safe = slot_block(idx_ref, r, k0, block_k, topk, num_keys, base)
            dst = ds_ref[local, pl.ds(k0, block_k), :]                              # [bk, hp]; 0 where invalid
            return tuple(dq + dot_tn(dst, kv_ref[safe, pl.ds(c0, cs)])
                         for (c0, cs), dq in zip(kchunks, dqs))

        dqs = lax.fori_loop(0, -(-topk // block_k), body,
                            tuple(jnp.zeros((hp, cs), jnp.float32) for _, cs in kchunks))
        for (c0, _), dq in zip(kchunks, dqs):
            store_heads(dq_ref, (r,), 0, heads, dq.astype(dq_ref.dtype), c0)


def dq_call(dst, kv, indices, dq, chunk, *, seq_len, block_k, col_block, num_warps, num_stages, interpret):
    """ds^T [chunk_rows, Kp, hp], kv [B*T, Dk], indices int32 [R, K], dq [R, H, Dk] (aliased),
    chunk = (c int32 [1], chunk_rows) -> dq with rows c * chunk_rows .. of this chunk written."""
    rows, heads, dk = dq.shape
    chunk_rows = int(chunk[1])
    topk = indices.shape[-1]
    kernel = functools.partial(_dq_kernel, seq_len=seq_len, num_keys=kv.shape[0] // (rows // seq_len),
                               heads=heads, block_k=block_k, topk=topk, kchunks=pow2_chunks(0, dk, col_block),
                               chunk_rows=chunk_rows, rows=rows)
    return pl.pallas_call(
        kernel, grid=(chunk_rows,), out_shape=jax.ShapeDtypeStruct(dq.shape, dq.dtype),
        input_output_aliases={4: 0}, compiler_params=kernel_params(num_warps, num_stages), interpret=interpret,
        name="sparse_mla_bwd_dq",
    )(dst, kv, indices, chunk[0], dq)


# ----------------------------------------------------------------------------- reduce kernel

def _reduce_kernel(contrib_ref, off_ref, *refs, block, chunks, evict, chunked):
    """One program = one latent row t: dkv[t] += the sum of its pairs' gradients, in place order.

    contrib [P + spare, Dk] (row t's pairs at places off[t] .. off[t+1] - 1); off int32 [N + 1],
    or [n, N + 1] with a chunk number [1] first in refs; dkv_in / dkv float32 [N, Dk] (aliased)."""
    if chunked:
        chunk_ref, dkv_in_ref, dkv_ref = refs
        c = chunk_ref[0]
        start, stop = off_ref[c, pl.program_id(0)], off_ref[c, pl.program_id(0) + 1]
    else:
        dkv_in_ref, dkv_ref = refs
        start, stop = off_ref[pl.program_id(0)], off_ref[pl.program_id(0) + 1]
    t = pl.program_id(0)
    lane = iota((block,), 0)

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


def reduce_call(contrib, offsets, dkv, *, block, num_warps, interpret, evict=False, chunk=None):
    """contrib [P + spare, Dk] (sorted by kv row; spare >= block), offsets int32 [N + 1] (or
    [n, N + 1] with chunk = c int32 [1]: row c's), dkv float32 [N, Dk] -> dkv[t] + the sum of
    contrib[offsets[t]:offsets[t+1]] (in that order)."""
    dk = contrib.shape[-1]
    num_rows = dkv.shape[0]
    kernel = functools.partial(_reduce_kernel, block=block, chunks=pow2_chunks(0, dk),
                               evict=evict and not interpret, chunked=chunk is not None)
    args = (contrib, offsets) + (() if chunk is None else (chunk,)) + (dkv,)
    return pl.pallas_call(
        kernel, grid=(num_rows,), out_shape=jax.ShapeDtypeStruct(dkv.shape, jnp.float32),
        input_output_aliases={len(args) - 1: 0}, compiler_params=kernel_params(num_warps, 2),
        interpret=interpret, name="sparse_mla_bwd_reduce",
    )(*args)
