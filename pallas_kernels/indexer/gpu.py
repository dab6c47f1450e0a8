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

from pallas_kernels._common import check_positive_fields, pad_axis, start_or_zero
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
    block when P is a multiple of block_t, else a gather of the rows' (page, offset)."""
    if page_size is None:
        return k_ref[b, pl.ds(t0, block_t), :]
    pt_ref, slot_ref = paged_refs
    slot = slot_ref[0]
    if page_size % block_t == 0:
        return k_ref[slot, pt_ref[b, t0 // page_size], pl.ds(t0 % page_size, block_t), :]
    t = t0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    pages = pt_ref[b, jnp.minimum(t // page_size, pt_ref.shape[1] - 1)]
    return k_ref[slot, pages, t % page_size, :]


def _score_kernel(q_ref, w_ref, pos_ref, start_ref, len_ref, k_ref, *refs, block_q, heads, block_t,
                  tiles, keys_major, page_size):
    *paged_refs, s_ref = refs
    b, qb, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(qb * block_q * heads, block_q * heads)
    qs = pl.ds(qb * block_q, block_q)
    q = q_ref[b, rows, :]                                      # [M, D]
    w = w_ref[b, rows]                                         # [M]
    pos = pos_ref[b, qs]                                       # [block_q]
    start = start_ref[b, qs]
    n_keys = len_ref[b]
    limit = jnp.minimum(jnp.max(pos) + 1, n_keys)              # keys this block may see: [lower, limit)
    lower = jnp.min(start)

    def tile(i, carry):
        t0 = (c * tiles + i) * block_t
        t = t0 + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
        valid = (t <= pos[:, None]) & (t < n_keys) & (t >= start[:, None])   # [block_q, block_t]
        needed = (t0 < limit) & (t0 + block_t > lower)

        @pl.when(needed)
        def _():
            k = _key_tile(k_ref, paged_refs, b=b, t0=t0, block_t=block_t,
                          page_size=page_size).astype(q.dtype)                 # [block_t, D]
            if keys_major:
                logits = lax.dot_general(k, q, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)  # [block_t, M]
                weighted = jnp.maximum(logits, 0.0) * w[None, :]
                s = jnp.sum(weighted.reshape(block_t, block_q, heads), axis=2).T
            else:
                logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)  # [M, block_t]
                weighted = jnp.maximum(logits, 0.0) * w[:, None]
                s = jnp.sum(weighted.reshape(block_q, heads, block_t), axis=1)
            s_ref[b, qs, pl.ds(t0, block_t)] = jnp.where(valid, jnp.where(s == 0.0, 0.0, s), -jnp.inf)

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
      keep the top-k's scores under `pallas_ops.SCORE_BUDGET_BYTES`)."""

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
    slot int32 scalar -> f32 [B, S, n * P]."""
    dim = k_pages.shape[-1]
    if dim != max(16, _next_pow2(dim)):
        raise ValueError(f"pallas_gpu paged indexer: the key width must be a power of two >= 16, got {dim}")
    num_keys = page_table.shape[1] * k_pages.shape[2]
    keys = (k_pages, page_table, jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)))
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
    chunks of `config.q_chunk` queries (`pallas_ops.topk`). Every chunk's scores are tiled as
    the whole prefill's."""
    config = _whole_tiling(config, q.shape)
    scores_fn = lambda q_c, w_c, **kw: scores(q_c, k, w_c, kv_len=kv_len, **kw)
    return _topk(q, weights, scores_fn, k.shape[1], topk=topk, q_pos=q_pos, kv_start=kv_start, config=config,
                 interpret=interpret)


def paged_indexer_topk(q, k_pages, page_table, weights, *, topk, q_pos, kv_len, slot,
                       config: IndexerGpuConfig = IndexerGpuConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.paged_indexer_topk`: `indexer_topk` with the paged score
    kernel (`paged_scores`: key tiles read through the page table, no copy of the keys)."""
    config = _whole_tiling(config, q.shape)
    scores_fn = lambda q_c, w_c, **kw: paged_scores(q_c, k_pages, page_table, slot, w_c, kv_len=kv_len, **kw)
    return _topk(q, weights, scores_fn, page_table.shape[1] * k_pages.shape[2], topk=topk, q_pos=q_pos,
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
