"""The lightning indexer on NVIDIA GPUs: Pallas kernels with the Triton lowering.

Three kernels, driven by `threshold.select_topk`:

* `scores` -- one program per (sequence, block of queries, chunk of keys), looping over key
  tiles. The block's queries x heads and the tile's keys are the two sides of one matmul; the
  epilogue applies relu and the head weights, sums the heads, masks by kv_start <= t <= q_pos
  and t < kv_len and writes float32 scores. Tiles no query of the block may see are not read,
  only written as -inf. Decode uses [queries x heads, keys] matmuls (memory-bound; about the
  copy bandwidth on an H200); prefill uses [keys, queries x heads] ("keys-major"), which keeps
  the head sum inside each thread's columns instead of across warps (1.7x faster there).
* `count` -- one program per (row, chunk of `chunk` scores): how many scores reach each of the
  selection's edges (a few compares per score, one read of the scores).
* `compact` -- one program per (row, chunk): a running count (cumsum) of the scores above / in
  the selection bracket gives each one its candidate slot, written by a masked scatter store.

Why Triton rather than Mosaic GPU: the compaction is a data-dependent scatter, which the
pointer-based Triton lowering expresses directly as one masked store. Block sizes must be
powers of two, so heads and the key width are zero-padded to powers of two >= 16 and queries
to a multiple of `block_q` (padded queries have q_pos -1: every key masked).

The tuning knobs are the fields of `IndexerGpuConfig`; the top-k over chunks of queries and
the scores' backward are shared with the TPU kernels (`indexer.pallas_ops`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp8
from pallas_kernels._common import check_positive_fields, check_topk, pad_axis, pad_topk, start_or_zero
from pallas_kernels.chunking import map_query_chunks
from pallas_kernels.indexer import pallas_ops, threshold

#: Key tiles per score program.
TILES_PER_PROGRAM = 16
#: Scores per count / compaction program, and per loop step inside it (one step: many small
#: programs hide memory latency better than few looping ones).
CHUNK = 2048
BLOCK = 2048


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _params(num_warps: int, num_stages: int = 1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------- scores

def _key_tile(k_ref, paged_refs, *, b, t0, block_t, page_size):
    """Keys [t0, t0 + block_t) of sequence b: a block of k_ref [B, T, D]; paged (page_size
    set; paged_refs = (page table [B, n], slot [1]), k_ref [slots, pages, P, D]): one page's
    block when P is a multiple of block_t, else a gather of the rows' (page, offset); FP8 keys
    (paged_refs + (scales [slots, pages, P],), k_ref the e4m3 values): float32 values * scale."""
    if page_size is None:
        return k_ref[b, pl.ds(t0, block_t), :]
    pt_ref, slot_ref, *scales_ref = paged_refs       # FP8 keys: k_ref e4m3, scales [.., P] f32
    slot = slot_ref[0]
    if page_size % block_t == 0:
        at = (slot, pt_ref[b, t0 // page_size], pl.ds(t0 % page_size, block_t))
    else:
        t = t0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
        at = (slot, pt_ref[b, jnp.minimum(t // page_size, pt_ref.shape[1] - 1)], t % page_size)
    if scales_ref:                                    # dequantized in registers, f32
        return k_ref[(*at, slice(None))].astype(jnp.float32) * scales_ref[0][at][:, None]
    return k_ref[(*at, slice(None))]


@dataclasses.dataclass(frozen=True)
class _QueryBlock:
    """One program's block of queries: q [M = block_q x heads, D], w [M], pos / start [block_q],
    n_keys (the sequence's kv_len), and the keys [lower, limit) any of its queries may see."""
    b: jax.Array
    q: jax.Array
    w: jax.Array
    pos: jax.Array
    start: jax.Array
    n_keys: jax.Array
    lower: jax.Array
    limit: jax.Array


def _query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, *, block_q, heads) -> _QueryBlock:
    b, qb = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(qb * block_q * heads, block_q * heads)
    qs = pl.ds(qb * block_q, block_q)
    pos, start, n_keys = pos_ref[b, qs], start_ref[b, qs], len_ref[b]
    return _QueryBlock(b, q_ref[b, rows, :], w_ref[b, rows], pos, start, n_keys, jnp.min(start),
                       jnp.minimum(jnp.max(pos) + 1, n_keys))


def _tile_scores(blk: _QueryBlock, k_ref, paged_refs, t0, *, block_q, heads, block_t, keys_major, page_size):
    """Scores f32 [block_q, block_t] of keys [t0, t0 + block_t) for the block's queries: relu of
    the logits, weighted, summed over the heads; -inf where masked (t > q_pos, t >= kv_len,
    t < kv_start), +0.0 for -0.0."""
    t = t0 + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
    valid = (t <= blk.pos[:, None]) & (t < blk.n_keys) & (t >= blk.start[:, None])   # [block_q, block_t]
    k = _key_tile(k_ref, paged_refs, b=blk.b, t0=t0, block_t=block_t, page_size=page_size).astype(blk.q.dtype)
    if keys_major:
        logits = lax.dot_general(k, blk.q, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)          # [block_t, M]
        weighted = jnp.maximum(logits, 0.0) * blk.w[None, :]
        s = jnp.sum(weighted.reshape(block_t, block_q, heads), axis=2).T
    else:
        logits = lax.dot_general(blk.q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)          # [M, block_t]
        weighted = jnp.maximum(logits, 0.0) * blk.w[:, None]
        s = jnp.sum(weighted.reshape(block_q, heads, block_t), axis=1)
    return jnp.where(valid, jnp.where(s == 0.0, 0.0, s), -jnp.inf)


def _score_kernel(q_ref, w_ref, pos_ref, start_ref, len_ref, k_ref, *refs, block_q, heads, block_t,
                  tiles, keys_major, page_size):
    *paged_refs, s_ref = refs
    c = pl.program_id(2)
    blk = _query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
    qs = pl.ds(pl.program_id(1) * block_q, block_q)
    b = blk.b

    def tile(i, carry):
        t0 = (c * tiles + i) * block_t
        needed = (t0 < blk.limit) & (t0 + block_t > blk.lower)

        @pl.when(needed)
        def _():
            s_ref[b, qs, pl.ds(t0, block_t)] = _tile_scores(
                blk, k_ref, paged_refs, t0, block_q=block_q, heads=heads, block_t=block_t, keys_major=keys_major,
                page_size=page_size)

        @pl.when(~needed)
        def _():
            s_ref[b, qs, pl.ds(t0, block_t)] = jnp.full((block_q, block_t), -jnp.inf, jnp.float32)

        return carry

    lax.fori_loop(0, tiles, tile, 0)


def _layout(q, weights, q_pos, kv_start, block_q):
    """Pads heads / key width to powers of two >= 16 and queries to a multiple of block_q.

    -> (q [B, Sp*Hp, Dp], w f32 [B, Sp*Hp], q_pos, kv_start int32 [B, Sp], Hp, Dp)."""
    batch, seq_len, heads, dim = q.shape
    hp = max(16 // block_q if block_q < 16 else 1, _next_pow2(heads))
    dp = max(16, _next_pow2(dim))
    sp = -(-seq_len // block_q) * block_q
    q = pad_axis(pad_axis(pad_axis(q, 3, dp), 2, hp), 1, sp)
    w = pad_axis(pad_axis(weights.astype(jnp.float32), 2, hp), 1, sp)
    pos = pad_axis(jnp.asarray(q_pos, jnp.int32), 1, sp, -1)
    start = pad_axis(start_or_zero(kv_start, q_pos), 1, sp, 0)
    return q.reshape(batch, sp * hp, dp), w.reshape(batch, sp * hp), pos, start, hp, dp


@dataclasses.dataclass(frozen=True)
class ScoreTiling:
    """How the score kernel tiles its work (see the module docstring)."""
    block_q: int        # queries per program
    block_t: int        # keys per matmul
    num_warps: int
    keys_major: bool    # matmul as [keys, queries x heads]: the head sum stays inside a warp


def score_tiling(seq_len: int, heads: int) -> ScoreTiling:
    """Decode (<= 8 queries): all queries per program, [queries x heads, keys] matmuls, 4 warps
    (memory-bound: about copy bandwidth on an H200). Prefill: up to 8 queries (at most 256
    query-head columns), keys-major matmuls over 64 keys, 8 warps (compute-bound)."""
    if seq_len <= 8:
        return ScoreTiling(_next_pow2(seq_len), 128, 4, False)
    hp = max(16, _next_pow2(heads))
    return ScoreTiling(max(1, min(8, 256 // hp)), 64, 8, True)


@dataclasses.dataclass(frozen=True)
class IndexerGpuConfig:
    """Tuning of the GPU indexer kernels (`impl="pallas_gpu"`); None: chosen from the shapes.

    block_q, block_t, num_warps, keys_major: the score kernel's `ScoreTiling` (defaults:
      `score_tiling`; block sizes are powers of two).
    tiles_per_program: key tiles per score program.  num_stages: its software pipelining.
    chunk: scores per count / compaction program (a power of two; default CHUNK, or the row
      rounded up to a power of two >= 16 when that is shorter).  block: scores per loop step
      inside them.  select_num_warps: their warps.
    q_chunk: queries per top-k chunk and per chunk of the scores' backward (default: as many as
      keep the top-k's scores under `pallas_ops.SCORE_BUDGET_BYTES`).
    fused: the prefill top-k without a scores array (`FusedRows`: the count and compact passes
      compute their scores from q and k); decode and the paged form keep the scores kernel."""

    block_q: int | None = None
    block_t: int | None = None
    num_warps: int | None = None
    keys_major: bool | None = None
    tiles_per_program: int = TILES_PER_PROGRAM
    num_stages: int = 2
    chunk: int | None = None
    block: int = BLOCK
    select_num_warps: int = 4
    q_chunk: int | None = None
    fused: bool = False

    def __post_init__(self):
        check_positive_fields(self)

    def tiling(self, seq_len: int, heads: int) -> ScoreTiling:
        """The score kernel's tiling for [*, seq_len, heads, *] queries: the fields set here
        over `score_tiling`'s defaults."""
        fixed = {f.name: getattr(self, f.name) for f in dataclasses.fields(ScoreTiling)}
        return dataclasses.replace(score_tiling(seq_len, heads),
                                   **{k: v for k, v in fixed.items() if v is not None})


def scores(q, k, weights, *, q_pos, kv_len, kv_start=None, config: IndexerGpuConfig = IndexerGpuConfig(),
           interpret: bool = False):
    """q [B, S, H, D], k [B, T, D], weights f32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B],
    kv_start int32 [B, S] or None -> scores f32 [B, S, T], -inf where masked."""
    num_keys = k.shape[1]
    tiling = config.tiling(q.shape[1], q.shape[2])
    tp = _padded_keys(num_keys, tiling.block_t, config.tiles_per_program)
    dp = max(16, _next_pow2(k.shape[2]))
    keys = (pad_axis(pad_axis(k, 2, dp), 1, tp),)
    return _scores(q, weights, keys, num_keys, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start, tiling=tiling,
                   config=config, interpret=interpret, page_size=None)[..., :num_keys]


def paged_scores(q, k_pages, page_table, slot, weights, *, q_pos, kv_len, kv_start=None,
                 config: IndexerGpuConfig = IndexerGpuConfig(), interpret: bool = False):
    """`scores` of the keys of a paged store, read through the page table inside the kernel
    (no copy): k_pages [slots, pages, P, D] (D a power of two >= 16), page_table int32 [B, n],
    slot int32 scalar -> f32 [B, S, n * P]. k_pages may be an `fp8.Fp8Keys` of such stores."""
    scales = (k_pages.scales,) if fp8.is_fp8(k_pages) else ()
    k_pages = k_pages.values if scales else k_pages
    dim = k_pages.shape[-1]
    if dim != max(16, _next_pow2(dim)):
        raise ValueError(f"pallas_gpu paged indexer: the key width must be a power of two >= 16, got {dim}")
    num_keys = page_table.shape[1] * k_pages.shape[2]
    keys = (k_pages, page_table, jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), *scales)
    return _scores(q, weights, keys, num_keys, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start,
                   tiling=config.tiling(q.shape[1], q.shape[2]), config=config, interpret=interpret,
                   page_size=k_pages.shape[2])[..., :num_keys]


def _padded_keys(num_keys: int, block_t: int, tiles_per_program: int) -> int:
    n_tiles = -(-num_keys // block_t)
    tiles = max(1, min(tiles_per_program, n_tiles))
    return -(-n_tiles // tiles) * tiles * block_t


def _scores(q, weights, keys: tuple, num_keys: int, *, q_pos, kv_len, kv_start, tiling: ScoreTiling, config,
            interpret, page_size):
    """The score kernel over keys (k [B, Tp, Dp] padded to whole programs, or the paged
    (store, page table, slot)) -> f32 [B, S, Tp], Tp = num_keys rounded up to whole programs."""
    batch, seq_len, heads, _ = q.shape
    bq, block_t = tiling.block_q, tiling.block_t
    qf, w, pos, start, hp, _ = _layout(q, weights, q_pos, kv_start, bq)
    tp = _padded_keys(num_keys, block_t, config.tiles_per_program)
    tiles = max(1, min(config.tiles_per_program, -(-num_keys // block_t)))
    sp = pos.shape[1]
    kernel = functools.partial(_score_kernel, block_q=bq, heads=hp, block_t=block_t, tiles=tiles,
                               keys_major=tiling.keys_major, page_size=page_size)
    out = pl.pallas_call(
        kernel,
        grid=(batch, sp // bq, tp // (tiles * block_t)),
        out_shape=jax.ShapeDtypeStruct((batch, sp, tp), jnp.float32),
        compiler_params=_params(tiling.num_warps, config.num_stages),
        interpret=interpret,
        name="indexer_scores" if page_size is None else "paged_indexer_scores",
    )(qf, w, pos, start, jnp.asarray(kv_len, jnp.int32), *keys)
    return out[:, :seq_len]


# ----------------------------------------------------------------------- count and compact

def _count_kernel(s_ref, e_ref, act_ref, out_ref, *, chunk, block):
    r, c = pl.program_id(0), pl.program_id(1)
    edges = e_ref[r, :]                                        # [E]

    @pl.when(act_ref[r] != 0)
    def _():
        def step(i, acc):
            x = s_ref[r, pl.ds(c * chunk + i * block, block)]  # [block]
            return acc + jnp.sum((x[None, :] >= edges[:, None]).astype(jnp.int32), axis=1)

        out_ref[r, c, :] = lax.fori_loop(0, chunk // block, step, jnp.zeros_like(edges, jnp.int32))

    @pl.when(act_ref[r] == 0)
    def _():
        out_ref[r, c, :] = jnp.zeros_like(edges, jnp.int32)


def _compact_kernel(s_ref, lo_ref, hi_ref, oa_ref, ob_ref, init_ref, out_ref, *, chunk, block, cap):
    del init_ref                                               # aliased with out_ref (-1 filled)
    r, c = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[r], hi_ref[r]

    def step(i, offsets):
        off_a, off_b = offsets
        t0 = c * chunk + i * block
        x = s_ref[r, pl.ds(t0, block)]
        above = x >= hi
        between = (x >= lo) & ~above
        packed = jnp.where(above, 1 << 16, 0) + between.astype(jnp.int32)   # both ranks, one scan
        rank = jnp.cumsum(packed) - packed
        a, bt = packed >> 16, packed & 0xFFFF
        slot = jnp.where(above, off_a + (rank >> 16), off_b + (rank & 0xFFFF))
        keep = (above | between) & (slot < cap)
        lane = lax.broadcasted_iota(jnp.int32, (block,), 0)
        slot = jnp.where(keep, slot, cap + lane)               # distinct slots, even when masked
        plgpu.store(out_ref.at[r, slot], t0 + lane, mask=keep)
        return off_a + jnp.sum(a), off_b + jnp.sum(bt)

    lax.fori_loop(0, chunk // block, step, (oa_ref[r, c], ob_ref[r, c]))


def _pad_scores(scores: jax.Array, chunk: int) -> jax.Array:
    n = threshold.chunk_count(scores.shape[1], chunk)
    return pad_axis(scores, 1, n * chunk, -jnp.inf)


def count(scores, edges, active, *, chunk=CHUNK, block=BLOCK, num_warps=4, interpret=False):
    """`threshold.CountFn`: scores f32 [R, T] -> int32 [R, ceil(T / chunk), E]."""
    block = min(block, chunk)
    padded = _pad_scores(scores, chunk)
    rows, n = scores.shape[0], padded.shape[1] // chunk
    return pl.pallas_call(
        functools.partial(_count_kernel, chunk=chunk, block=block),
        grid=(rows, n),
        out_shape=jax.ShapeDtypeStruct((rows, n, edges.shape[1]), jnp.int32),
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="indexer_select_count",
    )(padded, edges, active.astype(jnp.int32))


def compact(scores, lo, hi, above_offset, between_offset, cap, *, chunk=CHUNK, block=BLOCK,
            num_warps=4, interpret=False):
    """`threshold.CompactFn`: candidate positions int32 [R, cap], -1 where empty."""
    block = min(block, chunk)
    padded = _pad_scores(scores, chunk)
    rows, n = scores.shape[0], padded.shape[1] // chunk
    init = jnp.full((rows, cap + block), -1, jnp.int32)          # block spill slots, never kept
    out = pl.pallas_call(
        functools.partial(_compact_kernel, chunk=chunk, block=block, cap=cap),
        grid=(rows, n),
        out_shape=jax.ShapeDtypeStruct((rows, cap + block), jnp.int32),
        input_output_aliases={5: 0},
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="indexer_select_compact",
    )(padded, lo, hi, above_offset, between_offset, init)
    return out[:, :cap]


def _chunk_for(num_keys: int, chunk: int | None) -> int:
    """Count / compaction chunk: CHUNK, or the row length rounded up to a power of two
    (>= 16) when that is shorter."""
    if chunk is not None:
        return int(chunk)
    return min(CHUNK, max(16, _next_pow2(num_keys)))


def select_topk(scores: jax.Array, topk: int, *, config: IndexerGpuConfig = IndexerGpuConfig(),
                interpret: bool = False) -> jax.Array:
    """Exact top-k of each row of float32 scores [R, T] (-inf = masked) -> int32 [R, topk]."""
    ch = _chunk_for(scores.shape[1], config.chunk)
    kw = dict(chunk=ch, block=min(config.block, ch), num_warps=config.select_num_warps, interpret=interpret)
    return threshold.select_topk(scores.astype(jnp.float32), topk, count_fn=functools.partial(count, **kw),
                                 compact_fn=functools.partial(compact, **kw))


def indexer_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start=None,
                 config: IndexerGpuConfig = IndexerGpuConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.indexer_topk`: scores kernel, then threshold selection, over
    chunks of `config.q_chunk` queries (`pallas_ops.topk`); with config.fused (prefill), the
    selection over `FusedRows` instead (no scores array). Every chunk's scores are tiled as the
    whole prefill's."""
    config = _whole_tiling(config, q.shape)
    if config.fused and q.shape[1] > 8:
        return fused_topk(q, k, weights, topk=topk, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start, config=config,
                          interpret=interpret)
    scores_fn = lambda q_c, w_c, **kw: scores(q_c, k, w_c, kv_len=kv_len, **kw)
    return _topk(q, weights, scores_fn, k.shape[1], topk=topk, q_pos=q_pos, kv_start=kv_start, config=config,
                 interpret=interpret)


def paged_indexer_topk(q, k_pages, page_table, weights, *, topk, q_pos, kv_len, slot,
                       config: IndexerGpuConfig = IndexerGpuConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.paged_indexer_topk`: `indexer_topk` with the paged score
    kernel (`paged_scores`: key tiles read through the page table, no copy of the keys)."""
    config = _whole_tiling(config, q.shape)
    scores_fn = lambda q_c, w_c, **kw: paged_scores(q_c, k_pages, page_table, slot, w_c, kv_len=kv_len, **kw)
    page_size = (k_pages.values if fp8.is_fp8(k_pages) else k_pages).shape[2]
    return _topk(q, weights, scores_fn, page_table.shape[1] * page_size, topk=topk, q_pos=q_pos,
                 kv_start=None, config=config, interpret=interpret)


def _whole_tiling(config: IndexerGpuConfig, q_shape) -> IndexerGpuConfig:
    """The config with the score tiling of the whole [B, S, H, D] queries fixed (query chunks
    are tiled as the whole)."""
    return dataclasses.replace(config, **dataclasses.asdict(config.tiling(q_shape[1], q_shape[2])))


def _topk(q, weights, scores_fn, num_keys: int, *, topk, q_pos, kv_start, config: IndexerGpuConfig, interpret):
    chunk = pallas_ops.query_chunk(q.shape[0], q.shape[1], num_keys, config.block_q, config.q_chunk)
    return pallas_ops.topk(q, weights, topk=topk, q_pos=q_pos, kv_start=kv_start, num_keys=num_keys,
                           scores_fn=functools.partial(scores_fn, config=config, interpret=interpret),
                           select_fn=functools.partial(select_topk, config=config, interpret=interpret),
                           q_chunk=chunk)


# ------------------------------------------------------------- fused scores + selection (prefill)
#
# The threshold selection's passes over a row need its scores only one at a time: a count of the
# scores above each edge, a compaction of those in a bracket. `FusedRows` gives it those passes
# as kernels that compute the scores of their tiles from q and k (the score kernel's tiles) and
# never write them: the [S, T] scores array of the plain path is not made. The price is the
# score matmul once per pass (the first count, usually no refinement pass, the compaction)
# instead of once; the bytes saved are the scores' write and the passes' reads of them.

#: Scores a fused pass costs per row beside its candidates: the budget of candidate bytes
#: (positions and scores) of one query chunk.
FUSED_BUDGET_BYTES = 2**30


def _tile_range(blk: _QueryBlock, c, *, tiles, block_t, active=None):
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
    blk = _query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
    qs = pl.ds(pl.program_id(1) * block_q, block_q)
    c = pl.program_id(2)
    edges = [e_ref[blk.b, qs, j] for j in range(num_edges)]                  # [block_q] each
    first, last = _tile_range(blk, c, tiles=tiles, block_t=block_t, active=jnp.max(act_ref[blk.b, qs]) > 0)

    def tile(i, counts):
        s = _tile_scores(blk, k_ref, (), (c * tiles + i) * block_t, block_q=block_q, heads=heads, block_t=block_t,
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
    blk = _query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
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
        s = _tile_scores(blk, k_ref, (), t0, block_q=block_q, heads=heads, block_t=block_t, keys_major=keys_major,
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
        qf, w, pos, start, hp, dp = _layout(q, weights, q_pos, kv_start, tiling.block_q)
        num_keys = k.shape[1]
        tp = _padded_keys(num_keys, tiling.block_t, config.tiles_per_program)
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
                              compiler_params=_params(self.tiling.num_warps, 1), interpret=self.interpret, name=name,
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
