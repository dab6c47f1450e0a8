"""The lightning indexer's fused prefill top-k on NVIDIA GPUs (`IndexerGpuConfig.fused`).

The threshold selection's passes over a row need its scores only one at a time: a count of the
scores above each edge, a compaction of those in a bracket. `FusedRows` gives it those passes
as kernels that compute the scores of their tiles from q and k (the score kernel's tiles,
`gpu_scores`) and never write them: the [S, T] scores array of the plain path is not made. The
price is the score matmul once per pass (the first count, usually no refinement pass, the
compaction) instead of once; the bytes saved are the scores' write and the passes' reads of
them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_topk, pad_axis, pad_topk, start_or_zero
from pallas_kernels.chunking import map_query_chunks
from pallas_kernels.indexer_topk import threshold
from pallas_kernels.indexer_topk.gpu_config import IndexerGpuConfig, ScoreTiling, kernel_params
from pallas_kernels.indexer_topk.gpu_scores import QueryBlock, padded_keys, query_block, query_layout, tile_scores

#: Scores a fused pass costs per row beside its candidates: the budget of candidate bytes
#: (positions and scores) of one query chunk.
FUSED_BUDGET_BYTES = 2**30


def _tile_range(blk: QueryBlock, c, *, tiles, block_t, active=None):
    """The tiles [first, last) of program chunk c that some query of the block may see (none
    when `active` is given and false)."""
    base = c * tiles
    first = jnp.clip(blk.lower // block_t - base, 0, tiles)
    last = jnp.clip((blk.limit + block_t - 1) // block_t - base, 0, tiles)
    last = jnp.maximum(first, last)
    return first, last if active is None else jnp.where(active, last, first)


def _fused_count_kernel(q_ref, w_ref, pos_ref, start_ref, len_ref, k_ref, e_ref, act_ref, out_ref, *, block_q,
                        heads, block_t, tiles, keys_major, num_edges):
    """Per (sequence, block of queries, chunk of keys): how many of each query's scores in the
    chunk reach each of its edges. e_ref f32 [B, Sp, E], act_ref int32 [B, Sp], out_ref int32
    [B, Sp, chunks, E]."""
    blk = query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
    qs = pl.ds(pl.program_id(1) * block_q, block_q)
    c = pl.program_id(2)
    edges = [e_ref[blk.b, qs, j] for j in range(num_edges)]                  # [block_q] each
    first, last = _tile_range(blk, c, tiles=tiles, block_t=block_t, active=jnp.max(act_ref[blk.b, qs]) > 0)

    def tile(i, counts):
        s = tile_scores(blk, k_ref, (), (c * tiles + i) * block_t, block_q=block_q, heads=heads, block_t=block_t,
                         keys_major=keys_major, page_size=None)
        return tuple(n + jnp.sum((s >= e[:, None]).astype(jnp.int32), axis=1) for n, e in zip(counts, edges))

    counts = lax.fori_loop(first, last, tile, tuple(jnp.zeros((block_q,), jnp.int32) for _ in edges))
    for j, n in enumerate(counts):
        out_ref[blk.b, qs, c, j] = n


def _fused_compact_kernel(q_ref, w_ref, pos_ref, start_ref, len_ref, k_ref, lo_ref, hi_ref, oa_ref, ob_ref,
                          init_ref, init_s_ref, out_ref, out_s_ref, *, block_q, heads, block_t, tiles, keys_major,
                          cap):
    """Per (sequence, block of queries, chunk of keys): each query's scores >= hi ("above") to
    candidate slots from its chunk's above offset on, those in [lo, hi) from its between offset
    on, in position order (slots >= cap dropped), with their scores. lo / hi f32 [B, Sp], the
    offsets int32 [B, Sp, chunks]; out_ref int32 / out_s_ref f32 [B, Sp, cap + block_t]."""
    del init_ref, init_s_ref                                   # aliased with the outputs (-1 / -inf filled)
    blk = query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
    q0 = pl.program_id(1) * block_q
    qs = pl.ds(q0, block_q)
    c = pl.program_id(2)
    lo, hi = lo_ref[blk.b, qs], hi_ref[blk.b, qs]
    first, last = _tile_range(blk, c, tiles=tiles, block_t=block_t)
    row = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    lane = lax.broadcasted_iota(jnp.int32, (block_t,), 0)

    def tile(i, offsets):
        off_a, off_b = offsets                                 # [block_q] each
        t0 = (c * tiles + i) * block_t
        s = tile_scores(blk, k_ref, (), t0, block_q=block_q, heads=heads, block_t=block_t, keys_major=keys_major,
                         page_size=None)
        above = s >= hi[:, None]
        between = (s >= lo[:, None]) & ~above
        packed = jnp.where(above, 1 << 16, 0) + between.astype(jnp.int32)   # both ranks, one scan
        for r in range(block_q):                               # one query's row at a time: 1-D scans and stores
            mine = row == r
            p = jnp.sum(jnp.where(mine, packed, 0), axis=0)    # [block_t]
            x = jnp.sum(jnp.where(mine, s, 0.0), axis=0)
            rank = jnp.cumsum(p) - p
            a_r = jnp.sum(jnp.where(mine[:, 0], off_a, 0))
            b_r = jnp.sum(jnp.where(mine[:, 0], off_b, 0))
            is_above = p >= (1 << 16)
            slot = jnp.where(is_above, a_r + (rank >> 16), b_r + (rank & 0xFFFF))
            keep = (p > 0) & (slot < cap)
            slot = jnp.where(keep, slot, cap + lane)           # distinct slots, even when masked
            plgpu.store(out_ref.at[blk.b, q0 + r, slot], t0 + lane, mask=keep)
            plgpu.store(out_s_ref.at[blk.b, q0 + r, slot], x, mask=keep)
        return off_a + jnp.sum(above.astype(jnp.int32), axis=1), off_b + jnp.sum(between.astype(jnp.int32), axis=1)

    lax.fori_loop(first, last, tile, (oa_ref[blk.b, qs, c], ob_ref[blk.b, qs, c]))


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """A `threshold.RowSource` over the scores of queries q [B, S, H, D] against keys k [B, T, D]
    that are never stored (see the section comment): rows are the B x Sp (S padded to the score
    tiling's block_q) queries, chunks the score programs' spans of keys (tiles_per_program x
    block_t). Build with `FusedRows.of`."""

    q: jax.Array          # [B, Sp * Hp, Dp] (the score kernel's layout)
    w: jax.Array          # f32 [B, Sp * Hp]
    pos: jax.Array        # int32 [B, Sp]
    start: jax.Array      # int32 [B, Sp]
    kv_len: jax.Array     # int32 [B]
    k: jax.Array          # [B, Tp, Dp]
    heads: int            # Hp
    num_keys: int         # T
    tiling: ScoreTiling
    tiles: int            # key tiles per program
    interpret: bool

    @classmethod
    def of(cls, q, k, weights, *, q_pos, kv_len, kv_start, config: IndexerGpuConfig, interpret: bool) -> "FusedRows":
        tiling = config.tiling(q.shape[1], q.shape[2])
        qf, w, pos, start, hp, dp = query_layout(q, weights, q_pos, kv_start, tiling.block_q)
        num_keys = k.shape[1]
        tp = padded_keys(num_keys, tiling.block_t, config.tiles_per_program)
        return cls(qf, w, pos, start, jnp.asarray(kv_len, jnp.int32), pad_axis(pad_axis(k, 2, dp), 1, tp), hp,
                   num_keys, tiling, max(1, min(config.tiles_per_program, -(-num_keys // tiling.block_t))),
                   bool(interpret))

    @property
    def rows(self) -> int:
        return self.pos.shape[0] * self.pos.shape[1]

    def _call(self, kernel, name, out_shape, extra, aliases=None, **kw):
        batch, sp = self.pos.shape
        bq, bt = self.tiling.block_q, self.tiling.block_t
        chunks = self.k.shape[1] // (self.tiles * bt)
        fn = functools.partial(kernel, block_q=bq, heads=self.heads, block_t=bt, tiles=self.tiles,
                               keys_major=self.tiling.keys_major, **kw)
        return pl.pallas_call(fn, grid=(batch, sp // bq, chunks), out_shape=out_shape,
                              compiler_params=kernel_params(self.tiling.num_warps, 1), interpret=self.interpret, name=name,
                              input_output_aliases=aliases or {})(
            self.q, self.w, self.pos, self.start, self.kv_len, self.k, *extra)

    def _chunks(self) -> int:
        return self.k.shape[1] // (self.tiles * self.tiling.block_t)

    def count(self, edges, active):
        batch, sp = self.pos.shape
        e = edges.shape[1]
        out = self._call(_fused_count_kernel, "indexer_fused_count",
                         jax.ShapeDtypeStruct((batch, sp, self._chunks(), e), jnp.int32),
                         (edges.reshape(batch, sp, e), active.astype(jnp.int32).reshape(batch, sp)), num_edges=e)
        return out.reshape(self.rows, self._chunks(), e)

    def compact(self, lo, hi, above_offset, between_offset, cap):
        batch, sp = self.pos.shape
        width = cap + self.tiling.block_t                      # block_t spill slots, never kept
        shape = (batch, sp, width)
        per_row = lambda x: x.reshape(batch, sp, *x.shape[1:])  # noqa: E731
        pos, score = self._call(
            _fused_compact_kernel, "indexer_fused_compact",
            [jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.float32)],
            (per_row(lo), per_row(hi), per_row(above_offset), per_row(between_offset),
             jnp.full(shape, -1, jnp.int32), jnp.full(shape, -jnp.inf, jnp.float32)),
            aliases={10: 0, 11: 1}, cap=cap)                  # the -1 / -inf fills are the outputs
        return pos.reshape(self.rows, width)[:, :cap], score.reshape(self.rows, width)[:, :cap]

    def sample(self, tile, stride):
        """The sampled keys' scores in plain jnp (a few hundred keys: not worth a kernel)."""
        batch, sp = self.pos.shape
        n_tiles = threshold.chunk_count(self.num_keys, tile)
        t = (jnp.arange(0, n_tiles, stride)[:, None] * tile + jnp.arange(tile)[None, :]).reshape(-1)
        keys = jnp.take(self.k, jnp.minimum(t, self.k.shape[1] - 1), axis=1)            # [B, n, Dp]
        q = self.q.reshape(batch, sp, self.heads, -1)
        logits = jnp.einsum("bshd,bnd->bshn", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        s = jnp.sum(jnp.maximum(logits, 0.0) * self.w.reshape(batch, sp, self.heads)[..., None], axis=2)
        valid = ((t[None, None, :] <= self.pos[..., None]) & (t[None, None, :] >= self.start[..., None])
                 & (t[None, None, :] < jnp.minimum(self.kv_len, self.num_keys)[:, None, None]))
        return jnp.where(valid, s, -jnp.inf).reshape(self.rows, -1)


def fused_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start=None, config: IndexerGpuConfig = IndexerGpuConfig(),
               interpret: bool = False):
    """`indexer_topk` by the threshold selection over `FusedRows` (no scores array), over chunks
    of queries whose candidates stay under FUSED_BUDGET_BYTES (or config.q_chunk)."""
    topk = check_topk(topk)
    batch, seq_len = q.shape[:2]
    num_keys = k.shape[1]
    if num_keys == 0:
        return jnp.full((batch, seq_len, topk), -1, jnp.int32)
    k_eff = min(topk, num_keys)
    block_q = config.tiling(seq_len, q.shape[2]).block_q
    per_query = batch * (max(2 * k_eff, 64) + 256) * 8
    chunk = int(config.q_chunk or min(seq_len, max(block_q, FUSED_BUDGET_BYTES // per_query // block_q * block_q)))

    def body(q_c, w_c, pos_c, start_c):
        src = FusedRows.of(q_c, k, w_c, q_pos=pos_c, kv_len=kv_len, kv_start=start_c, config=config,
                           interpret=interpret)
        idx = threshold.select_topk_from(src, k_eff)
        return idx.reshape(batch, -1, k_eff)[:, :q_c.shape[1]]

    args = (q, weights, jnp.asarray(q_pos, jnp.int32), start_or_zero(kv_start, q_pos))
    return pad_topk(map_query_chunks(body, args, (0, 0, -1, 0), chunk), topk)
