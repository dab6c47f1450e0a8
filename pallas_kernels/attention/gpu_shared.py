"""Sparse MLA forward with row sharing: a block of adjacent queries loads the union of its rows once.

The per-query forward (`gpu._fwd_kernel`) gathers every (query, selected row) pair's latent row
on its own: at few heads (16) each 1152-byte row feeds only 16 x 1088 x 2 FLOPs, so the kernel
runs at the copy rate of the gather. Adjacent queries of a trained indexer select mostly the same
rows (`benchmarks/selection_overlap.py`), so here one program takes a block of `block_q` adjacent
queries of one sequence and walks the sorted union of their selections: each union row is
loaded once and multiplied against all the block's queries' heads (an M = block_q x H tile,
at most 64 rows), and the logits of a (query, row) pair the query did not select are masked
to -inf by a per-row bitmask. Exact: every query's softmax runs over exactly its own selected
rows. A row listed twice by one query counts once, as in the reference (top-k selections have
no duplicates).

The union is built in XLA once per set of indices (`shared_rows`; an IndexShare group's
layers share one): per block, a sort of its block_q x K (row, query) keys, the first of each
row's run kept, and the bits of the run's queries added into its mask. Blocks do not cross
sequences (S is padded to a multiple of block_q per sequence).

Cost model: a block loads |union| rows (against block_q x K) and does |union| x block_q x H
row-products (against K x H per query): worthwhile where |union| is well below block_q x K.
On uniformly random selections |union| ~ block_q x K and the kernel does block_q times the
per-query kernel's matmul work for the same bytes.

Layout as in `gpu`: q [B*S, H, Dk] read unpadded (masked loads of the H real heads of each of
the block's queries), the latent width cut into power-of-two column chunks (576 = 512 + 64),
out / lse written for the real (query, head) pairs only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import dot_nt, online_softmax_step
from pallas_kernels.attention import gpu_backward, transpose as tr
from pallas_kernels.attention.gpu_backward import next_pow2, pow2_chunks

#: Largest query-by-head tile of one program (its f32 accumulator [64, 512] and q [64, 576]
#: bf16 are what the per-query kernel holds at 64 heads).
MAX_TILE_ROWS = 64
#: The backward's largest tile: its pairs kernel keeps q and dout in shared memory in the two
#: layouts of its matmuls (2 x 64 x (576 + 512) bf16 = 272 KiB at 64 rows: more than Hopper's
#: 227 KiB; 136 KiB at 32).
MAX_BWD_TILE_ROWS = 32
#: Union rows per loop step.
DEFAULT_BLOCK_K = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedRows:
    """The union of the rows each block of `block_q` adjacent queries selected.

    rows int32 [N, U]: per block (N = B x ceil(S / block_q), b major), its distinct selected
      rows t in ascending order, then -1 (U = block_q x K rounded up to a multiple of 64);
    bits int32 [N, U]: bit i set where query i of the block selected the row;
    count int32 [N]: the distinct rows of each block.
    block_q, seq_len, num_keys: static."""

    rows: jax.Array
    bits: jax.Array
    count: jax.Array
    block_q: int = dataclasses.field(metadata=dict(static=True))
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    num_keys: int = dataclasses.field(metadata=dict(static=True))


def _run_starts(x: jax.Array) -> jax.Array:
    """x [N, W] sorted along W -> bool [N, W]: where a run of equal values starts."""
    return jnp.concatenate([jnp.ones((x.shape[0], 1), bool), x[:, 1:] != x[:, :-1]], axis=1)


def shared_rows(indices: jax.Array, num_keys: int, *, block_q: int) -> SharedRows:
    """indices int32 [B, S, K] (-1 / out of range = skip) -> SharedRows for blocks of block_q
    adjacent queries (module docstring). block_q <= 31 (the bits of one int32)."""
    if not 1 <= block_q <= 31:
        raise ValueError(f"shared_rows: block_q must be in [1, 31], got {block_q}")
    batch, seq_len, topk = indices.shape
    if (num_keys + 1) * block_q >= 2**31:
        raise ValueError(f"shared_rows: {num_keys} keys x block_q {block_q} overflow int32 keys")
    blocks = -(-seq_len // block_q)
    idx = jnp.asarray(indices, jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < num_keys), idx, num_keys)            # num_keys: none
    idx = jnp.pad(idx, ((0, 0), (0, blocks * block_q - seq_len), (0, 0)), constant_values=num_keys)
    n, width = batch * blocks, block_q * topk
    query = lax.broadcasted_iota(jnp.int32, (batch, blocks, block_q, topk), 2)
    keys = (idx.reshape(batch, blocks, block_q, topk) * block_q + query).reshape(n, width)
    keys = jnp.sort(keys, axis=-1)
    row, query = keys // block_q, keys % block_q
    valid = row < num_keys
    first = valid & _run_starts(row)
    place = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1                    # the run's union slot
    units = -(-width // 64) * 64
    block = lax.broadcasted_iota(jnp.int32, (n, width), 0)
    out_rows = jnp.full((n, units), -1, jnp.int32).at[block, jnp.where(first, place, units)].set(
        row, mode="drop")
    new_pair = valid & _run_starts(keys)
    bits = jnp.zeros((n, units), jnp.int32).at[block, jnp.where(new_pair, place, units)].add(
        jnp.left_shift(jnp.int32(1), query), mode="drop")               # distinct bits: add = or
    return SharedRows(rows=out_rows, bits=bits, count=jnp.sum(first, axis=1, dtype=jnp.int32),
                      block_q=block_q, seq_len=seq_len, num_keys=num_keys)


@dataclasses.dataclass(frozen=True)
class _Tile:
    """A program's block of queries as tile rows m = i * slots + h (query i of the block, head
    h): where each row lives in [B*S, H, ...] arrays (rows past the sequence or the heads point
    out of bounds and are masked)."""

    qi: jax.Array          # int32 [M]
    row: jax.Array         # int32 [M]: b * S + s, or B * S past the sequence
    head: jax.Array        # int32 [M]
    real: jax.Array        # bool [M]

    @classmethod
    def of(cls, n, *, seq_len, rows_total, blocks_per_seq, block_q, slots, heads) -> "_Tile":
        b, s0 = n // blocks_per_seq, (n % blocks_per_seq) * block_q
        m = lax.broadcasted_iota(jnp.int32, (block_q * slots,), 0)
        qi, h = m // slots, m % slots
        inside = s0 + qi < seq_len
        return cls(qi=qi, row=jnp.where(inside, b * seq_len + s0 + qi, rows_total), head=h,
                   real=inside & (h < heads))

    def load(self, ref, cols=None, other=0.0):
        """ref [B*S, H(, D)] -> the tile's [M] or its columns cols = (c0, cs) [M, cs]."""
        if cols is None:
            return plgpu.load(ref.at[self.row, self.head], mask=self.real, other=other)
        c = cols[0] + lax.broadcasted_iota(jnp.int32, (self.row.shape[0], cols[1]), 1)
        return plgpu.load(ref.at[self.row[:, None], self.head[:, None], c], mask=self.real[:, None], other=other)

    def store(self, ref, val, c0=None):
        """ref[row, head(, c0 + j)] = val[m(, j)] for the real rows m."""
        if c0 is None:
            plgpu.store(ref.at[self.row, self.head], val, mask=self.real)
            return
        c = c0 + lax.broadcasted_iota(jnp.int32, val.shape, 1)
        plgpu.store(ref.at[self.row[:, None], self.head[:, None], c], val, mask=self.real[:, None])


def _fwd_kernel(q_ref, kv_ref, rows_ref, bits_ref, count_ref, out_ref, lse_ref, *, seq_len, blocks_per_seq,
                block_q, slots, heads, sm_scale, block_k, kchunks, vchunks):
    """One block of block_q queries: q [B*S, H, Dk], kv [B, T, Dk], rows / bits [N, U], count
    [N] -> out [B*S, H, v], lse [B*S, H] of the block's real (query, head) pairs."""
    n = pl.program_id(0)
    b = n // blocks_per_seq
    tile = _Tile.of(n, seq_len=seq_len, rows_total=q_ref.shape[0], blocks_per_seq=blocks_per_seq,
                    block_q=block_q, slots=slots, heads=heads)
    qs = [tile.load(q_ref, cols) for cols in kchunks]                         # [M, cs]
    nv = len(vchunks)

    def body(j, carry):
        k0 = j * block_k
        t = rows_ref[n, pl.ds(k0, block_k)]                                  # [bk]
        sel_bits = bits_ref[n, pl.ds(k0, block_k)]
        valid = t >= 0
        safe = jnp.where(valid, t, 0)
        rows = [kv_ref[b, safe, pl.ds(c0, cs)].astype(qs[0].dtype) for c0, cs in kchunks]
        s = dot_nt(qs[0], rows[0])
        for qc, rc in zip(qs[1:], rows[1:]):
            s += dot_nt(qc, rc)
        chosen = (jnp.right_shift(sel_bits[None, :], tile.qi[:, None]) & 1) != 0   # [M, bk]
        return online_softmax_step(carry, jnp.where(chosen & valid[None, :], s * sm_scale, -jnp.inf), rows[:nv])

    size = block_q * slots
    init = (jnp.full((size,), -jnp.inf, jnp.float32), jnp.zeros((size,), jnp.float32),
            tuple(jnp.zeros((size, cs), jnp.float32) for _, cs in vchunks))
    steps = (count_ref[n] + block_k - 1) // block_k
    m, l, accs = lax.fori_loop(0, steps, body, init)
    has_any = l > 0
    safe_l = jnp.where(has_any, l, 1.0)
    for (c0, _), a in zip(vchunks, accs):
        tile.store(out_ref, (a / safe_l[:, None]).astype(out_ref.dtype), c0)
    tile.store(lse_ref, jnp.where(has_any, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l), -jnp.inf))


def _check(shared: SharedRows, heads: int, block_k: int, who: str, most: int) -> int:
    """The head slots of the tile (raises where the tile (at most `most` rows) or block_k do not fit)."""
    slots = next_pow2(heads)
    size = shared.block_q * slots
    if size > most or size < 16:
        raise ValueError(f"gpu_shared.{who}: block_q {shared.block_q} x {slots} head slots = {size} tile rows; "
                         f"need 16 .. {most}")
    if shared.rows.shape[1] % block_k:
        raise ValueError(f"gpu_shared.{who}: block_k {block_k} must divide the union width {shared.rows.shape[1]}")
    return slots


def forward(q: jax.Array, kv: jax.Array, shared: SharedRows, *, sm_scale: float, v_dim: int,
            block_k: int = DEFAULT_BLOCK_K, num_warps: int = 8, num_stages: int = 2,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """q [B, S, H, Dk], kv [B, T, Dk], shared: `shared_rows` of the indices for these queries
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]), as `gpu.sparse_mla`'s forward.
    The program's tile is block_q x next_pow2(H) rows (<= MAX_TILE_ROWS)."""
    batch, seq_len, heads, dk = q.shape
    if (shared.seq_len, shared.num_keys) != (seq_len, kv.shape[1]):
        raise ValueError(f"gpu_shared.forward: shared rows built for S={shared.seq_len}, T={shared.num_keys}; "
                         f"got S={seq_len}, T={kv.shape[1]}")
    slots = _check(shared, heads, block_k, "forward", MAX_TILE_ROWS)
    blocks_per_seq = -(-seq_len // shared.block_q)
    kernel = functools.partial(
        _fwd_kernel, seq_len=seq_len, blocks_per_seq=blocks_per_seq, block_q=shared.block_q, slots=slots,
        heads=heads, sm_scale=float(sm_scale), block_k=block_k,
        kchunks=pow2_chunks(0, v_dim) + pow2_chunks(v_dim, dk), vchunks=pow2_chunks(0, v_dim))
    rows_total = batch * seq_len
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch * blocks_per_seq,),
        out_shape=[jax.ShapeDtypeStruct((rows_total, heads, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((rows_total, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla_fwd_shared",
    )(q.reshape(rows_total, heads, dk), kv, shared.rows, shared.bits, shared.count)
    return out.reshape(batch, seq_len, heads, v_dim), lse.reshape(batch, seq_len, heads)


# ----------------------------------------------------------------------------- backward

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedIndex:
    """What the row-sharing forward and backward take, built once per set of indices (an
    IndexShare group's layers share it): the union of each query block's rows, and the
    transposed index of the (block, union slot) pairs by latent row (`transpose.TransposedIndex`
    over rows [B, N / B, U] as if each block were a query selecting U rows), by which the
    backward sums each latent row's per-block gradients in a fixed order."""

    rows: SharedRows
    transposed: tr.TransposedIndex


def shared_index(indices: jax.Array, num_keys: int, *, block_q: int, dk: int, dtype,
                 budget: int = gpu_backward.DEFAULT_BUDGET) -> SharedIndex:
    """indices int32 [B, S, K] -> SharedIndex for blocks of block_q queries, its pair gradients
    chunked by blocks so that one chunk's ([blocks, U, Dk] in dtype) fit `budget` bytes."""
    shared = shared_rows(indices, num_keys, block_q=block_q)
    batch = indices.shape[0]
    union = shared.rows.reshape(batch, -1, shared.rows.shape[1])
    chunk = gpu_backward.default_chunk_rows(shared.rows.shape[0], union.shape[-1], dk, dtype, budget)
    return SharedIndex(rows=shared, transposed=tr.transpose_index(union, num_keys, chunk_rows=chunk))


def _pairs_kernel(q_ref, do_ref, lse_ref, delta_ref, kv_ref, rows_ref, bits_ref, count_ref, chunk_ref, pos_ref,
                  contrib_ref, *, sm_scale, seq_len, num_keys, blocks_per_seq, block_q, slots, heads, block_k,
                  kchunks, vchunks, chunk_blocks, num_blocks, units):
    """One block n = chunk * chunk_blocks + program (< N) of block_q queries: for each union row
    of the block, the gradient its selecting (query, head) pairs send it, written at the
    (block, slot) pair's place pos[chunk, local * U + slot] of contrib [P + spare, Dk].
    q [B*S, H, Dk], do [B*S, H, v], lse / delta [B*S, H], kv [B*T, Dk], rows / bits [N, U],
    count [N]."""
    local = pl.program_id(0)
    c = chunk_ref[0]
    n = c * chunk_blocks + local

    @pl.when(n < num_blocks)
    def _():
        tile = _Tile.of(n, seq_len=seq_len, rows_total=q_ref.shape[0], blocks_per_seq=blocks_per_seq,
                        block_q=block_q, slots=slots, heads=heads)
        qs = [tile.load(q_ref, cols) for cols in kchunks]                                 # [M, cs]
        dos = [tile.load(do_ref, cols) for cols in vchunks]
        lse = tile.load(lse_ref, other=jnp.inf)
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                                   # empty: p = 0
        delta = tile.load(delta_ref)
        base = (n // blocks_per_seq) * num_keys

        def body(j, carry):
            k0 = j * block_k
            t = rows_ref[n, pl.ds(k0, block_k)]                                          # [bk]
            sel_bits = bits_ref[n, pl.ds(k0, block_k)]
            valid = t >= 0
            safe = jnp.where(valid, base + t, base)
            rows = [kv_ref[safe, pl.ds(c0, cs)] for c0, cs in kchunks]                  # [bk, cs]
            sel = valid[:, None] & ((jnp.right_shift(sel_bits[:, None], tile.qi[None, :]) & 1) != 0)
            grads = gpu_backward.row_gradients(rows, qs, dos, lse, delta, sel, sm_scale=sm_scale)
            place = pos_ref[c, pl.ds(local * units + k0, block_k)]
            for (c0, cs), g in zip(kchunks, grads):
                contrib_ref[place, pl.ds(c0, cs)] = g.astype(contrib_ref.dtype)
            return carry

        lax.fori_loop(0, (count_ref[n] + block_k - 1) // block_k, body, 0)


def backward(q, kv, indices, dout, lse, delta, *, sm_scale, v_dim, tindex: SharedIndex, block_k=DEFAULT_BLOCK_K,
             col_block=gpu_backward.DEFAULT_COL_BLOCK, num_warps=None, num_stages=None, fuse_dq=None,
             dq_warps=8, dq_stages=2, reduce_block=gpu_backward.DEFAULT_REDUCE_BLOCK, reduce_warps=4,
             interpret=False):
    """(dq [B, S, H, Dk] in q dtype, dkv float32 [B, T, Dk]) of sparse MLA, dkv with row sharing:
    one program per block of queries walks its union of rows (as the forward) and writes one
    gradient row per (block, union row) pair, summed per latent row by `gpu_backward`'s reduce
    kernel through tindex.transposed; dq per query by `gpu_backward`'s query-major kernels. The
    tile, tindex's block_q x next_pow2(H), is 16 .. MAX_BWD_TILE_ROWS rows.
    Shapes as `gpu_backward.backward`'s; tindex: `shared_index` of these indices. Settings:
    block_k union rows per step and num_warps / num_stages (None: 4, 1: the tile's q and dout in
    two layouts, 136 KiB at 32 x (576 + 512) bf16, leave room for one row block in shared
    memory) of the pairs kernel; col_block, fuse_dq, dq_warps, dq_stages those of the dq kernels
    (`gpu_backward.query_major_dq`); reduce_block, reduce_warps the reduce kernel's."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    shared, tix = tindex.rows, tindex.transposed
    slots = _check(shared, heads, block_k, "backward", MAX_BWD_TILE_ROWS)
    q2, do2, lse2, delta2, kv2, idx2 = gpu_backward.query_major(q, kv, indices, dout, lse, delta)
    dq = gpu_backward.query_major_dq(q2, do2, lse2, delta2, kv2, idx2, seq_len=seq_len, sm_scale=sm_scale,
                                     block_k=None, col_block=col_block, fuse_dq=fuse_dq, num_warps=None,
                                     num_stages=None, dq_warps=dq_warps, dq_stages=dq_stages, interpret=interpret)
    num_blocks, units = shared.rows.shape
    kernel = functools.partial(
        _pairs_kernel, sm_scale=float(sm_scale), seq_len=seq_len, num_keys=num_keys,
        blocks_per_seq=num_blocks // batch, block_q=shared.block_q, slots=slots, heads=heads, block_k=block_k,
        kchunks=pow2_chunks(0, v_dim, col_block) + pow2_chunks(v_dim, dk, col_block),
        vchunks=pow2_chunks(0, v_dim, col_block), chunk_blocks=tix.chunk_rows, num_blocks=num_blocks, units=units)
    wide = jnp.dtype(kv.dtype).itemsize >= 4

    def step(dkv, c):
        chunk = c.reshape(1)
        contrib = pl.pallas_call(
            kernel, grid=(tix.chunk_rows,),
            out_shape=jax.ShapeDtypeStruct((tix.position.shape[1] + tr.SPARE_ROWS, dk),
                                           jnp.float32 if wide else kv.dtype),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 1),
            interpret=interpret, name="sparse_mla_bwd_shared_pairs",
        )(q2, do2, lse2, delta2, kv2, shared.rows, shared.bits, shared.count, chunk, tix.position)
        return gpu_backward.reduce_call(contrib, tix.offsets, dkv, block=reduce_block, num_warps=reduce_warps,
                                        interpret=interpret, chunk=chunk), None

    dkv0 = jnp.zeros((batch * num_keys, dk), jnp.float32)
    chunks = jnp.arange(tix.num_chunks, dtype=jnp.int32)
    dkv, _ = step(dkv0, chunks[0]) if tix.num_chunks == 1 else lax.scan(step, dkv0, chunks)
    return dq.reshape(q.shape), dkv.reshape(batch, num_keys, dk)
