"""Sparse MLA backward on NVIDIA GPUs (Pallas, Triton lowering): no atomics, the same bits on
every run. Two ways to sum the latent rows' gradient: "sorted" (`backward`) and "by_key"
(`backward_by_key`), the drivers of the kernels in `gpu_pairs` ("sorted": pairs, dq, reduce) and
`gpu_keys` ("by_key"), which share `gpu_tiles`. `gpu.sparse_mla` pairs them with its forward kernel
(`SparseMLAGpuConfig.dkv_mode` "sorted" / "by_key"); each keyword setting `name` of `backward`
and `backward_by_key` is the config's field `bwd_<name>`, with the same default.

Shapes: q [B, S, H, Dk], kv [B, T, Dk] (V = kv[..., :v]), indices int32 [B, S, K] (-1 or out of
range = skip), dout [B, S, H, v], lse / delta float32 [B, S, H] -> dq [B, S, H, Dk] (q dtype),
dkv float32 [B, T, Dk]: the backward contract of `vjp.make_sparse_mla`.

Heads. Triton's matmul tiles are powers of two of at least 16 rows, but no kernel here pads
the heads in memory: each reads q, dout, lse and delta as given ([.., H, ..]) into a tile of
`head_rows(H)` rows with masked loads (the rows >= H read zeros, lse +inf, so p = 0 there) and
stores only the H real rows of dq (`gpu_tiles.load_heads`, `store_heads`).

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

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sparse_mla import transpose as tr
from pallas_kernels.sparse_mla.gpu_keys import keys_call
from pallas_kernels.sparse_mla.gpu_pairs import dq_call, pairs_call, reduce_call
from pallas_kernels.sparse_mla.gpu_tiles import (DEFAULT_BLOCK_K, DEFAULT_BUDGET, DEFAULT_COL_BLOCK,
                                                DEFAULT_REDUCE_BLOCK, DEFAULT_WARPS, FUSED_DQ_MAX_HEADS,
                                                KEYS_TILE_COLS, head_rows)


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
