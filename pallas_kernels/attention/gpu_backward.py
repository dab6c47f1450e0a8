"""Sparse MLA backward on NVIDIA GPUs (Pallas, Triton lowering): no atomics, the same bits on
every run. Two ways to sum the latent rows' gradient: "sorted" (`backward`) and "by_key"
(`backward_by_key`). `attention.gpu.sparse_mla` pairs them with its forward kernel
(`SparseMLAGpuConfig.dkv_mode` "sorted" / "by_key"); each keyword setting `name` of `backward`
and `backward_by_key` is the config's field `bwd_<name>`, with the same default.

Shapes: q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v]), indices int32 [B, S, K] (-1 or out of
range = skip), dout [B, S, H, v], lse / delta float32 [B, S, H] -> dq [B, S, H, Dk] (q dtype),
dkv float32 [B, T, Dk]: the backward contract of `vjp.make_sparse_mla`.

Heads. Triton's matmul tiles are powers of two of at least 16 rows, but no kernel here pads
the heads in memory: each reads q, dout, lse and delta as given ([.., H, ..]) into a tile of
`head_rows(H)` rows with masked loads (the rows >= H read zeros, lse +inf, so p = 0 there) and
stores only the H real rows of dq (`load_heads`, `store_heads`).

Call one (query, selected row) a pair. Every pair's gradient needs the query's q and dout
(H x (Dk + v) values: 34 KB at 16 heads, 139 KB at 64, 4.6 KB at the default model's 8 heads
x (160 + 128)) and the row's latent vector (Dk values). dq is always computed query-major (one
program per query keeps q and dout on chip and gathers its K rows); the two modes differ in how
dkv's sum over the selecting queries is organised.

"sorted" (`backward`): through the transposed index of `transpose.py` (built once per
IndexShare group and reusable by its layers):

1. `pairs` kernel, one program per query with all its heads: loops over the K selected rows in
   blocks of `block_k`, gathers them (each a contiguous Dk-wide row), recomputes
   p = exp(s - lse), dp and ds, and writes each pair's dkv row
   c[j] = ds[:, j]^T q + p[:, j]^T dout (dK in all Dk columns, + dV in the first v) at the
   pair's place in its row-sorted list (`TransposedIndex.position`), plus dq (summed in float32
   registers) or, with `fuse_dq=False`, ds^T [chunk, K, H] for the `dq` kernel.
   The block's rows are the M dimension of every matmul (s^T = rows . q^T is [block_k, H]), so
   16 heads still make 64-row Hopper MMAs (wgmma; heads as M would be 16-row mma.sync), and q
   and dout sit in shared memory once.
2. `reduce` kernel, one program per latent row t: sums the row's pair gradients, which now lie
   in one contiguous run, in float32 in place order (by query, then slot), and adds the sum into
   dkv. No two programs write one row, nothing is atomic, the order never changes.
3. (`fuse_dq=False`) `dq` kernel, one program per query: dq = ds . rows, gathering the rows
   again. The default at 64 heads: q and dout (136 KB) plus a row block fill Hopper's shared
   memory, so dq's [64, 576] float32 accumulator cannot share their program (Triton asked for
   311 KB) and the pairs kernel runs unpipelined there.
Queries are processed in chunks of `chunk_rows` (a lax.scan over the chunk number carrying dkv
and dq; every kernel reads the whole unpadded arrays at the chunk's rows and dq is written in
place, so no chunk is sliced out or stacked) so that one chunk's pair gradients ([chunk, K, Dk]
in kv's dtype, `budget` bytes, default 4 GiB) are live at once. Bytes per pair (bf16): gather
Dk x 2 + pair gradient written Dk x 2 + read back Dk x 2.

"by_key" (`backward_by_key`): no pair gradient in memory.

1. dq: the pairs kernel without pair gradients (`pairs_call(pos=None)`).
2. `keys` kernel, per block of `block_rows` consecutive rows of one sequence (a program takes
   blocks i and blocks - 1 - i, whose causal spans add up to about the same length): holds the
   rows' latent vectors and float32 dkv sums, and walks the queries of that sequence in
   contiguous tiles (`tile_cols` columns = tile_cols / query_slots(H) queries x their head
   slots, the N dimension of its matmuls; no gather), over the span of 32-query words that
   selected a row of its block (`transpose.key_bitmap`: the transposed index as bits; causal
   indices: the queries at and after the block). Per tile: s^T = rows . q^T [rows, N], p
   masked to the selected pairs by the bitmap's bits, dp^T = rows[:, :v] . dout^T, ds^T, and
   dkv += ds^T q + p^T dout. One program per dkv row, a fixed order, no atomics.
Cost: every (row, query) of the visited tiles is a matmul candidate (about S T / 2 per causal
sequence against S K selected pairs), and each query tile is read once per block of rows,
from L2 while a sequence's q and dout fit it (18.9 MB at the default model's shape). Gathering
each selecting query per pair instead would move H (Dk + v) itemsize bytes per pair, 7x the
pair gradients' 2 Dk itemsize at 8 heads. `gpu.by_key_is_cheaper` is the rule by which "auto"
picks this mode (few heads, top-k a large share of the keys: the default model's shape). On an
H100 at that shape (16 x 4096 queries, 8 heads, Dk 160, v 128, top-256 of 4096): 4.8 ms (dq
1.9 + keys 3.4, at 378 TFLOP/s on its tiles) against "sorted"'s 6.4 (docs/kernels-sparse-mla.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import dot, dot_nt, dot_tn
from pallas_kernels.attention import transpose as tr

#: Rows per loop step of the pairs kernel (the M dimension of its matmuls).
DEFAULT_BLOCK_K = 64
#: Triton warps of the pairs kernel.
DEFAULT_WARPS = 4
#: Pairs summed per step of the reduce kernel.
DEFAULT_REDUCE_BLOCK = 32
#: Column chunk of the per-pair gradient (its [block_k, chunk] float32 tile lives in registers).
DEFAULT_COL_BLOCK = 128
#: Bytes of one query chunk's per-pair gradients.
DEFAULT_BUDGET = 4 * 2**30
#: Largest padded head count whose dq accumulator is kept in the pairs kernel.
FUSED_DQ_MAX_HEADS = 32
#: Columns ((query, head slot) pairs) of one query tile of the keys kernel (64 with 4 warps:
#: 3.3 ms at the default model's shape on an H100; 128 columns 4.3 ms, 8 warps 7.1 ms).
KEYS_TILE_COLS = 64


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


def default_block_rows(dk: int) -> int:
    """Rows per program of the keys kernel: its [rows, Dk] float32 dkv sums live in registers."""
    return 64 if dk <= 256 else 32


def key_index(indices: jax.Array, num_keys: int, *, dk: int, block_rows: int | None = None) -> tr.KeyBitmap:
    """The bitmap `backward_by_key` takes for indices int32 [B, S, K] over num_keys latent rows
    of width dk: build it once and pass it to every layer that shares the indices."""
    return tr.key_bitmap(indices, num_keys, block_rows=int(block_rows or default_block_rows(dk)))


def pow2_chunks(start: int, stop: int, most: int = 1 << 30) -> list[tuple[int, int]]:
    """[start, stop) cut into power-of-two (offset, size) chunks of at most `most`, largest first."""
    out = []
    while start < stop:
        size = min(most, 1 << ((stop - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def head_rows(heads: int) -> int:
    """Rows of a program's head tile: H rounded up to a power of two >= 16 (Triton dot sizes)."""
    return max(16, next_pow2(heads))


def query_slots(heads: int) -> int:
    """Head slots per query in a keys-kernel tile: H rounded up to a power of two."""
    return next_pow2(heads)





def _params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


# ----------------------------------------------------------------------------- head tiles

def load_heads(ref, lead: tuple, h0, rows: int, heads: int, cols: tuple[int, int] | None = None, other=0.0):
    """ref [*lead dims, H] or [*lead dims, H, D] -> the `rows` heads h0 .. h0 + rows - 1 at `lead`
    ([rows], or [rows, cs] of columns cols = (c0, cs)); heads >= H read `other`. A plain slice
    when every tile lies inside the H heads (heads a multiple of rows), else a masked load."""
    if heads % rows == 0:
        return ref[(*lead, pl.ds(h0, rows)) + (() if cols is None else (pl.ds(*cols),))]
    if cols is None:
        h = h0 + _iota((rows,), 0)
        return plgpu.load(ref.at[(*lead, h)], mask=h < heads, other=other)
    c0, cs = cols
    h = h0 + _iota((rows, cs), 0)
    return plgpu.load(ref.at[(*lead, h, c0 + _iota((rows, cs), 1))], mask=h < heads, other=other)


def store_heads(ref, lead: tuple, h0, heads: int, val, c0: int | None = None):
    """ref[*lead, h0 + i(, c0 + j)] = val[i(, j)] for the heads h0 + i < H (val [rows] or
    [rows, cs]); the rows past H are not written."""
    rows = val.shape[0]
    if heads % rows == 0:
        ref[(*lead, pl.ds(h0, rows)) + (() if c0 is None else (pl.ds(c0, val.shape[1]),))] = val
        return
    if c0 is None:
        h = h0 + _iota((rows,), 0)
        plgpu.store(ref.at[(*lead, h)], val, mask=h < heads)
        return
    h = h0 + _iota(val.shape, 0)
    plgpu.store(ref.at[(*lead, h, c0 + _iota(val.shape, 1))], val, mask=h < heads)


def row_gradients(rows, qs, dos, lse, delta, sel, *, sm_scale):
    """The latent rows' gradient from a tile of (query, head) columns, inside a kernel.

    rows: the rows' column chunks [bk, cs] (the first len(dos) make up V); qs, dos: the
    columns' q and dout chunks [n, cs]; lse (+inf where a column is empty or padding) / delta
    float32 [n]; sel bool [bk, n]: the (row, column) pairs that count -> float32 [bk, cs] per
    chunk: ds^T q, plus p^T dout in the V chunks."""
    nv = len(dos)
    dtype = rows[0].dtype
    st = dot_nt(rows[0], qs[0])                                                       # s^T [bk, n]
    for rc, qc in zip(rows[1:], qs[1:]):
        st += dot_nt(rc, qc)
    pt = jnp.where(sel, jnp.exp(st * sm_scale - lse[None, :]), 0.0)
    dpt = dot_nt(rows[0], dos[0])
    for rc, dc in zip(rows[1:nv], dos[1:]):
        dpt += dot_nt(rc, dc)
    dsc = (pt * (dpt - delta[None, :]) * sm_scale).astype(dtype)
    pc = pt.astype(dtype)
    out = []
    for i, qc in enumerate(qs):
        g = dot(dsc, qc)                                                              # [bk, cs]
        if i < nv:
            g += dot(pc, dos[i])
        out.append(g)
    return tuple(out)


def _slot_block(idx_ref, r, k0, block_k, topk, num_keys, base):
    """Slots k0 .. k0 + block_k - 1 of query row r of idx [R, K] (slots >= K read -1) ->
    (valid bool [bk], kv row base + t [bk], `base` where invalid); base = b * T."""
    k = k0 + _iota((block_k,), 0)
    if topk % block_k == 0:
        idx = idx_ref[r, pl.ds(k0, block_k)]
    else:
        idx = plgpu.load(idx_ref.at[r, k], mask=k < topk, other=-1)
    valid = (idx >= 0) & (idx < num_keys)
    return valid, jnp.where(valid, base + idx, base)


# ----------------------------------------------------------------------------- pairs kernel

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
            valid, safe = _slot_block(idx_ref, r, k0, block_k, topk, num_keys, base)
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
                k = k0 + _iota((block_k,), 0)
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
        compiler_params=_params(num_warps, num_stages), interpret=interpret,
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
            _, safe = _slot_block(idx_ref, r, k0, block_k, topk, num_keys, base)
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
        input_output_aliases={4: 0}, compiler_params=_params(num_warps, num_stages), interpret=interpret,
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
    lane = _iota((block,), 0)

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
        input_output_aliases={len(args) - 1: 0}, compiler_params=_params(num_warps, 2),
        interpret=interpret, name="sparse_mla_bwd_reduce",
    )(*args)


# ----------------------------------------------------------------------------- keys kernel

def _query_tile(ref, b, s0, *, seq_len, heads, slots, tile_queries, cols=None, other=0.0):
    """ref [B*S*H(, D)] flat (row (b*S + s)*H + h) -> the tile of queries s0 .. s0 + tq - 1 of
    sequence b as [tq * slots(, cs)] (column i = query s0 + i // slots, head i % slots); head
    slots >= H and queries >= S read `other`. Contiguous rows when slots == H and the tile
    lies inside the sequence."""
    n = tile_queries * slots
    if slots == heads and seq_len % tile_queries == 0:
        start = (b * seq_len + s0) * heads
        return ref[(pl.ds(start, n),) + (() if cols is None else (pl.ds(*cols),))]
    shape = (n,) if cols is None else (n, cols[1])
    i = _iota(shape, 0)
    s, h = s0 + i // slots, i % slots
    ok = (h < heads) & (s < seq_len)
    row = (b * seq_len + s) * heads + h
    index = (row,) if cols is None else (row, cols[0] + _iota(shape, 1))
    return plgpu.load(ref.at[index], mask=ok, other=other)


def _keys_block(kv_ref, q_ref, do_ref, lse_ref, delta_ref, bits_ref, spans_ref, dkv_ref, b, blk, *, sm_scale,
                seq_len, num_keys, heads, slots, tile_queries, block_rows, kchunks, vchunks):
    """Rows t0 .. t0 + block_rows - 1 (t0 = blk * block_rows) of sequence b: their dkv, summed
    over the query tiles of their span (`_keys_kernel`'s refs)."""
    blocks = -(-num_keys // block_rows)
    t0 = blk * block_rows
    t = t0 + _iota((block_rows,), 0)
    n = tile_queries * slots
    if num_keys % block_rows == 0:
        rows = [kv_ref[pl.ds(b * num_keys + t0, block_rows), pl.ds(c0, cs)] for c0, cs in kchunks]
        words_at = lambda w: bits_ref[pl.ds(b * num_keys + t0, block_rows), w]
    else:
        live = t < num_keys
        krow = b * num_keys + jnp.minimum(t, num_keys - 1)
        rows = [jnp.where(live[:, None], kv_ref[krow, pl.ds(c0, cs)], 0) for c0, cs in kchunks]
        words_at = lambda w: jnp.where(live, bits_ref[krow, w], 0)
    shift0 = _iota((n,), 0) // slots
    tile = functools.partial(_query_tile, b=b, seq_len=seq_len, heads=heads, slots=slots,
                             tile_queries=tile_queries)
    per_word = tr.WORD_BITS // tile_queries
    lo = spans_ref[b * blocks + blk, 0] * per_word
    hi = jnp.minimum(spans_ref[b * blocks + blk, 1] * per_word, -(-seq_len // tile_queries))

    def body(j, accs):
        s0 = j * tile_queries
        qs = [tile(q_ref, s0=s0, cols=cols) for cols in kchunks]                      # [n, cs]
        dos = [tile(do_ref, s0=s0, cols=cols) for cols in vchunks]
        lse = tile(lse_ref, s0=s0, other=jnp.inf)
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
        delta = tile(delta_ref, s0=s0)
        word = words_at(s0 // tr.WORD_BITS)                                            # [rows]
        sel = ((word[:, None] >> (s0 % tr.WORD_BITS + shift0)[None, :]) & 1) != 0          # [rows, n]
        grads = row_gradients(rows, qs, dos, lse, delta, sel, sm_scale=sm_scale)
        return tuple(acc + g for acc, g in zip(accs, grads))

    accs = lax.fori_loop(lo, hi, body, tuple(jnp.zeros((block_rows, cs), jnp.float32) for _, cs in kchunks))
    for (c0, cs), acc in zip(kchunks, accs):
        if num_keys % block_rows == 0:
            dkv_ref[pl.ds(b * num_keys + t0, block_rows), pl.ds(c0, cs)] = acc
        else:
            plgpu.store(dkv_ref.at[(b * num_keys + t)[:, None], c0 + _iota((block_rows, cs), 1)], acc,
                        mask=jnp.broadcast_to((t < num_keys)[:, None], acc.shape))


def _keys_kernel(*refs, num_keys, block_rows, paired, **static):
    """One program = one block of rows of sequence b, or with `paired` blocks i and blocks - 1 - i
    (causal spans shrink with the block: a pair's work is about even).

    kv [B*T, Dk], q [B*S*H, Dk], do [B*S*H, v], lse / delta [B*S*H] (flat), bits int32 [B*T, W],
    spans int32 [B*blocks, 2] (words) -> dkv float32 [B*T, Dk] (this program's rows)."""
    blocks = -(-num_keys // block_rows)
    programs = -(-blocks // 2) if paired else blocks
    b = pl.program_id(0) // programs
    i = pl.program_id(0) % programs
    run = functools.partial(_keys_block, *refs, b, num_keys=num_keys, block_rows=block_rows, **static)
    run(i)
    if paired:
        pl.when(blocks - 1 - i != i)(lambda: run(blocks - 1 - i))


def keys_call(kv, q, do, lse, delta, kmap: tr.KeyBitmap, *, sm_scale, v_dim, col_block, tile_cols, num_warps,
              num_stages, interpret, paired=True):
    """kv [B, T, Dk], q [B, S, H, Dk], do [B, S, H, v], lse / delta float32 [B, S, H], kmap (its
    block_rows rows per block) -> dkv float32 [B, T, Dk]. paired: one program per two blocks
    (`_keys_kernel`)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    slots = query_slots(heads)
    tile_queries = max(1, min(tr.WORD_BITS, tile_cols // slots))
    block_rows = kmap.block_rows
    blocks = -(-num_keys // block_rows)
    kernel = functools.partial(
        _keys_kernel, sm_scale=sm_scale, seq_len=seq_len, num_keys=num_keys, heads=heads, slots=slots,
        tile_queries=tile_queries, block_rows=block_rows, paired=paired,
        kchunks=pow2_chunks(0, v_dim, col_block) + pow2_chunks(v_dim, dk, col_block),
        vchunks=pow2_chunks(0, v_dim, col_block))
    flat = lambda x: x.reshape((batch * seq_len * heads,) + x.shape[3:])
    dkv = pl.pallas_call(
        kernel, grid=(batch * (-(-blocks // 2) if paired else blocks),),
        out_shape=jax.ShapeDtypeStruct((batch * num_keys, dk), jnp.float32),
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name="sparse_mla_bwd_keys",
    )(kv.reshape(batch * num_keys, dk), flat(q), flat(do), flat(lse), flat(delta), kmap.bits, kmap.spans)
    return dkv.reshape(batch, num_keys, dk)


# ----------------------------------------------------------------------------- drivers

def _settings(kv, heads, block_k, fuse_dq, num_warps, num_stages):
    """(block_k, fuse_dq, num_warps, num_stages, wide) defaults of the query-major kernels."""
    wide = jnp.dtype(kv.dtype).itemsize >= 4
    fuse_dq = head_rows(heads) <= FUSED_DQ_MAX_HEADS if fuse_dq is None else bool(fuse_dq)
    if num_warps is None:
        num_warps = DEFAULT_WARPS
    if num_stages is None:
        num_stages = 2 if fuse_dq else 1
    if block_k is None:
        block_k = DEFAULT_BLOCK_K // 2 if wide else DEFAULT_BLOCK_K
    return block_k, fuse_dq, num_warps, num_stages, wide


def query_major(q, kv, indices, dout, lse, delta):
    """The query-major kernels' views: q [R, H, Dk], dout [R, H, v] in q dtype, lse / delta
    [R, H], kv [B*T, Dk], indices [R, K] (all free reshapes but dout's cast)."""
    batch, seq_len, heads, dk = q.shape
    rows = batch * seq_len
    return (q.reshape(rows, heads, dk), dout.astype(q.dtype).reshape(rows, heads, -1),
            lse.reshape(rows, heads), delta.reshape(rows, heads), kv.reshape(-1, dk),
            jnp.asarray(indices, jnp.int32).reshape(rows, -1))


def query_major_dq(q2, do2, lse2, delta2, kv2, idx2, *, seq_len, sm_scale, block_k, col_block, fuse_dq, num_warps,
                   num_stages, dq_warps, dq_stages, interpret):
    """dq [R, H, Dk] alone from `query_major`'s views, by the pairs kernel without pair gradients
    (dq fused into it) or its ds^T and the dq kernel (`_settings` fill the None settings)."""
    block_k, fuse_dq, num_warps, num_stages, _ = _settings(kv2, q2.shape[1], block_k, fuse_dq, num_warps,
                                                           num_stages)
    common = dict(seq_len=seq_len, block_k=block_k, col_block=col_block, interpret=interpret)
    if fuse_dq:
        return pairs_call(q2, do2, lse2, delta2, kv2, idx2, sm_scale=sm_scale, fuse_dq=True,
                          num_warps=num_warps, num_stages=num_stages, **common)
    chunk = (jnp.zeros((1,), jnp.int32), q2.shape[0])
    dst = pairs_call(q2, do2, lse2, delta2, kv2, idx2, sm_scale=sm_scale, fuse_dq=False,
                     num_warps=num_warps, num_stages=num_stages, chunk=chunk, **common)
    return dq_call(dst, kv2, idx2, jnp.zeros(q2.shape, q2.dtype), chunk, num_warps=dq_warps,
                   num_stages=dq_stages, **common)


def backward(q, kv, indices, dout, lse, delta, *, sm_scale, v_dim, tindex=None,
             budget=DEFAULT_BUDGET, block_k=None, col_block=DEFAULT_COL_BLOCK,
             fuse_dq=None, num_warps=None, num_stages=None, reduce_block=DEFAULT_REDUCE_BLOCK,
             reduce_warps=4, evict=False, dq_warps=8, dq_stages=2, interpret=False):
    """The "sorted" backward: (dq [B, S, H, Dk] in q dtype, dkv float32 [B, T, Dk]) of sparse MLA
    (module docstring).

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 / out of range = skip),
    dout [B, S, H, v], lse, delta float32 [B, S, H] (delta = sum(out * dout) - dlse).
    tindex: `transpose.transpose_index(indices, T, chunk_rows=...)`, reusable by every layer
    sharing the indices (built here when None, with chunks of `budget` bytes).
    Settings (defaults measured best on an H200): block_k rows per step of the pairs and dq
    kernels (64; 32 for float32), col_block the widest column chunk of a pair gradient tile,
    fuse_dq keep dq in the pairs kernel (default: when head_rows(H) <= 32),
    num_warps / num_stages (pairs kernel: None = DEFAULT_WARPS, 4; 2 stages with fused dq, else
    1), dq_warps / dq_stages (dq kernel: 8, 2), reduce_block / reduce_warps (pairs summed per
    step of the reduce kernel, <= transpose.SPARE_ROWS: 32, 4), evict (stream the pair
    gradients past L2)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    topk = indices.shape[-1]
    rows = batch * seq_len
    block_k, fuse_dq, num_warps, num_stages, wide = _settings(kv, heads, block_k, fuse_dq, num_warps,
                                                              num_stages)
    if reduce_block > tr.SPARE_ROWS:
        raise ValueError(f"reduce_block must be <= {tr.SPARE_ROWS}")
    tindex = tr.checked_or_built(tindex, indices, num_keys, default_chunk_rows(rows, topk, dk, kv.dtype, budget))
    chunk_rows, n = tindex.chunk_rows, tindex.num_chunks
    q2, do2, lse2, delta2, kv2, idx2 = query_major(q, kv, indices, dout, lse, delta)
    common = dict(seq_len=seq_len, block_k=block_k, col_block=col_block, interpret=interpret)

    def step(carry, c):
        dkv, dq = carry
        chunk = (c.reshape(1), chunk_rows)
        first, contrib = pairs_call(q2, do2, lse2, delta2, kv2, idx2, sm_scale=sm_scale, fuse_dq=fuse_dq,
                                    num_warps=num_warps, num_stages=num_stages, pos=tindex.position,
                                    chunk=chunk, dq=dq, contrib_dtype=jnp.float32 if wide else kv.dtype,
                                    evict=evict, **common)
        dq = first if fuse_dq else dq_call(first, kv2, idx2, dq, chunk, num_warps=dq_warps,
                                           num_stages=dq_stages, **common)
        dkv = reduce_call(contrib, tindex.offsets, dkv, block=reduce_block, num_warps=reduce_warps,
                          interpret=interpret, evict=evict, chunk=chunk[0])
        return (dkv, dq), None

    init = (jnp.zeros((batch * num_keys, dk), jnp.float32), jnp.zeros(q2.shape, q.dtype))
    chunks = jnp.arange(n, dtype=jnp.int32)
    (dkv, dq), _ = step(init, chunks[0]) if n == 1 else lax.scan(step, init, chunks)
    return dq.reshape(q.shape), dkv.reshape(batch, num_keys, dk)


def backward_by_key(q, kv, indices, dout, lse, delta, *, sm_scale, v_dim, tindex=None, block_rows=None,
                    tile_cols=KEYS_TILE_COLS, keys_warps=4, keys_stages=2, keys_paired=True, block_k=None,
                    col_block=DEFAULT_COL_BLOCK, fuse_dq=None, num_warps=None, num_stages=None, dq_warps=8,
                    dq_stages=2, interpret=False):
    """The "by_key" backward: (dq [B, S, H, Dk] in q dtype, dkv float32 [B, T, Dk]) of sparse MLA
    (module docstring); arguments as `backward`'s.

    tindex: `key_index(indices, T, dk=Dk)` (a `transpose.KeyBitmap`), reusable by every layer
    sharing the indices (built here when None, with `block_rows` rows per keys program).
    Settings: tile_cols (query tile columns of the keys kernel, queries x head slots),
    keys_warps / keys_stages (its Triton settings), keys_paired (two blocks of rows per keys
    program, `keys_call`); block_k, fuse_dq, num_warps, num_stages,
    dq_warps, dq_stages: the query-major dq kernels' (`backward`)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    if tindex is None:
        tindex = key_index(indices, num_keys, dk=dk, block_rows=block_rows)
    elif (tindex.topk, tindex.num_keys, tindex.seq_len) != (indices.shape[-1], num_keys, seq_len):
        raise ValueError(f"tindex was built for K={tindex.topk}, T={tindex.num_keys}, S={tindex.seq_len}; "
                         f"got K={indices.shape[-1]}, T={num_keys}, S={seq_len}")
    q2, do2, lse2, delta2, kv2, idx2 = query_major(q, kv, indices, dout, lse, delta)
    dq = query_major_dq(q2, do2, lse2, delta2, kv2, idx2, seq_len=seq_len, sm_scale=sm_scale, block_k=block_k,
                        col_block=col_block, fuse_dq=fuse_dq, num_warps=num_warps, num_stages=num_stages,
                        dq_warps=dq_warps, dq_stages=dq_stages, interpret=interpret)
    dkv = keys_call(kv, q, dout.astype(q.dtype), lse, delta, tindex, sm_scale=sm_scale, v_dim=v_dim,
                    col_block=col_block, tile_cols=tile_cols, num_warps=keys_warps, num_stages=keys_stages,
                    interpret=interpret, paired=keys_paired)
    return dq.reshape(q.shape), dkv
