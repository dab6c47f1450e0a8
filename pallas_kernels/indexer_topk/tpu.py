"""The lightning indexer on TPUs: Pallas Mosaic kernels.

* `scores` -- grid (sequence, block of queries, tile of `block_t` keys). The block's queries and
  heads are the M dimension of one MXU matmul ([block_q * H, D] x [D, block_t]); the epilogue
  applies relu and the head weights, sums the heads (a sublane reduction), masks by q_pos and
  kv_len and writes the float32 scores. The key tile's index map is clamped to the last tile
  the block may see (scalar-prefetched), so tiles past it are not fetched again, only written
  as -inf.
* `count` -- grid (8 rows, chunk of scores): how many scores reach each edge of the
  threshold selection (`threshold.select_topk`).

The compaction of the few candidates is the plain-jnp `threshold.compact_xla` (running counts
and a bisection per slot): a data-dependent scatter has no cheap Mosaic form, and after the
counting pass it touches the scores only once more.

Mosaic block rules: the last two block dims are multiples of (8, 128) or the whole array dims.
Heads are zero-padded to a multiple of 8, queries to a multiple of `block_q` (8 in prefill,
all of them in decode), keys to a multiple of `block_t`, rows of the selection to 8.

The tuning knobs are the fields of `IndexerTpuConfig`; the top-k over chunks of queries and
the scores' backward are shared with the GPU kernels (`indexer_topk.pallas_ops`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import fp8
from pallas_kernels._common import check_positive_fields, pad_axis, start_or_zero, tpu_interpret
from pallas_kernels.indexer_topk import pallas_ops, threshold

#: Keys per score tile (lanes of the output block).
BLOCK_T = 512
#: Scores per counting program.
CHUNK = 4096
#: Queries per score block in prefill (a sublane tile); decode blocks hold all queries.
BLOCK_Q = 8


@dataclasses.dataclass(frozen=True)
class IndexerTpuConfig:
    """Tuning of the TPU indexer kernels (`impl="pallas_tpu"`).

    block_t: keys per score tile (a multiple of 128).  chunk: scores per counting program (a
    multiple of 128).  q_chunk: queries per top-k chunk and per chunk of the scores' backward
    (default: as many as keep the top-k's scores under `pallas_ops.SCORE_BUDGET_BYTES`)."""

    block_t: int = BLOCK_T
    chunk: int = CHUNK
    q_chunk: int | None = None

    def __post_init__(self):
        check_positive_fields(self)


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


# ----------------------------------------------------------------------------------- scores

def _tile_of(key, block_t: int, page_size: int | None):
    """The score tile holding key (int or int32 array): key // block_t, or for paged keys
    (tiles of block_t inside pages of page_size, ceil(P / block_t) per page) page * tiles
    per page + tile in the page. Monotone in key; key -1 is in tile -1."""
    if page_size is None:
        return key // block_t
    return (key // page_size) * -(-page_size // block_t) + (key % page_size) // block_t


def _score_kernel(first_ref, last_ref, len_ref, *refs, block_q, heads, block_t, n_qblocks, precision,
                  page_size, scaled=False):
    """Grid (b, query block, key tile), or for paged keys (b, query block, page j, tile i in
    the page); refs: (q, w, pos, start, k, scores), after the paged scalars (page table, slot);
    scaled (FP8 keys): (q, w, pos, start, k e4m3, scales [1, block_t] f32, scores): the logits of
    the e4m3 values (exact in q's dtype) times each key's scale, before the relu (scale >= 0)."""
    if scaled:
        q_ref, w_ref, pos_ref, start_ref, k_ref, scale_ref, s_ref = refs[-7:]
    else:
        q_ref, w_ref, pos_ref, start_ref, k_ref, s_ref = refs[-6:]
    b, qb = pl.program_id(0), pl.program_id(1)
    lane = lax.broadcasted_iota(jnp.int32, (block_q, block_t), 1)
    if page_size is None:
        t = pl.program_id(2)
        key, in_page = t * block_t + lane, True
    else:
        j, i = pl.program_id(2), pl.program_id(3)
        t = j * pl.num_programs(3) + i
        key, in_page = j * page_size + i * block_t + lane, i * block_t + lane < page_size
    block = b * n_qblocks + qb
    needed = (t >= first_ref[block]) & (t <= last_ref[block])

    @pl.when(needed)
    def _():
        logits = lax.dot_general(q_ref[...], k_ref[...].astype(q_ref.dtype), (((1,), (1,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
        if scaled:
            logits = logits * scale_ref[...]                             # [M, block_t] * [1, block_t]
        weighted = jnp.maximum(logits, 0.0) * w_ref[...]                 # [M, block_t]
        s = jnp.sum(weighted.reshape(block_q, heads, block_t), axis=1)  # [block_q, block_t]
        valid = in_page & (key <= pos_ref[...]) & (key < len_ref[b]) & (key >= start_ref[...])
        s_ref[...] = jnp.where(valid, jnp.where(s == 0.0, 0.0, s), -jnp.inf)

    @pl.when(~needed)
    def _():
        s_ref[...] = jnp.full(s_ref.shape, -jnp.inf, jnp.float32)


def _per_block(op, x, n_blocks: int, block: int):
    """x int32 [B, n_blocks * block] -> [B, n_blocks]: op (maximum / minimum) over each block, as
    elementwise ops on its `block` strided slices. A reduce here (a [B, n_blocks, block] array with
    the short block axis reduced) fails to compile for two-core TPU chips (v5p) at 16K queries."""
    x = x.reshape(x.shape[0], n_blocks, block)
    return functools.reduce(op, [x[..., i] for i in range(block)])


def _query_layout(q, weights, q_pos, kv_start, kv_len, block_t: int, page_size: int | None):
    """Queries padded to whole blocks (heads to a multiple of 8) and the first / last key tile
    each query block may see (`_tile_of`; for skipping and index clamping)
    -> (q [B, Sp*Hp, D], w [B, Sp*Hp, 1], pos, start [B, Sp, 1], first, last int32 [B * blocks],
        block_q, Hp)."""
    batch, seq_len, heads, dim = q.shape
    bq = seq_len if seq_len <= BLOCK_Q else BLOCK_Q
    sp = _round_up(seq_len, bq)
    hp = _round_up(heads, 8)
    n_qb = sp // bq
    q = pad_axis(pad_axis(q, 2, hp), 1, sp).reshape(batch, sp * hp, dim)
    w = pad_axis(pad_axis(weights.astype(jnp.float32), 2, hp), 1, sp).reshape(batch, sp * hp, 1)
    pos = pad_axis(jnp.asarray(q_pos, jnp.int32), 1, sp, -1)
    start = pad_axis(start_or_zero(kv_start, q_pos), 1, sp, 0)
    seen = jnp.minimum(_per_block(jnp.maximum, pos, n_qb, bq) + 1, kv_len[:, None])
    last = _tile_of(seen - 1, block_t, page_size).reshape(-1).astype(jnp.int32)
    first = _tile_of(_per_block(jnp.minimum, start, n_qb, bq), block_t, page_size).reshape(-1).astype(jnp.int32)
    return q, w, pos[..., None], start[..., None], first, last, bq, hp


def _score_call(kernel, grid, scalars, q, w, pos, start, k, k_spec, out_shape, out_spec, *, block_q, interpret):
    """The score pallas_call: scalars prefetched, the query block's rows (block_q queries x
    heads) of q, w, pos and start, the key tile k_spec -> out_shape in out_spec blocks. k and
    k_spec may be tuples (FP8 keys: the values and their scales)."""
    k, k_spec = (k, k_spec) if isinstance(k, tuple) else ((k,), (k_spec,))
    rows = q.shape[1] // pos.shape[1] * block_q
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=grid,
            in_specs=[
                pl.BlockSpec((None, rows, q.shape[-1]), lambda b, qb, *_: (b, qb, 0)),
                pl.BlockSpec((None, rows, 1), lambda b, qb, *_: (b, qb, 0)),
                pl.BlockSpec((None, block_q, 1), lambda b, qb, *_: (b, qb, 0)),
                pl.BlockSpec((None, block_q, 1), lambda b, qb, *_: (b, qb, 0)),
                *k_spec,
            ],
            out_specs=out_spec,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel") + ("arbitrary",) * (len(grid) - 2)),
        interpret=tpu_interpret(interpret),
        name="indexer_scores" if len(grid) == 3 else "paged_indexer_scores",
    )(*scalars, q, w, pos, start, *k)


def scores(q, k, weights, *, q_pos, kv_len, kv_start=None, config: IndexerTpuConfig = IndexerTpuConfig(),
           interpret: bool = False):
    """q [B, S, H, D], k [B, T, D], weights f32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B],
    kv_start int32 [B, S] or None -> scores f32 [B, S, T], -inf where masked."""
    batch, seq_len, _, dim = q.shape
    block_t = config.block_t
    num_keys = k.shape[1]
    kv_len = jnp.asarray(kv_len, jnp.int32)
    q, w, pos, start, first, last, bq, hp = _query_layout(q, weights, q_pos, kv_start, kv_len, block_t, None)
    sp = pos.shape[1]
    tp = _round_up(max(num_keys, 1), block_t)
    n_qb, n_t = sp // bq, tp // block_t
    k = pad_axis(k, 1, tp)

    def clamp(b, qb, t, first_ref, last_ref):
        block = b * n_qb + qb
        return jnp.clip(jnp.minimum(jnp.maximum(t, first_ref[block]), last_ref[block]), 0, n_t - 1)

    kernel = functools.partial(_score_kernel, block_q=bq, heads=hp, block_t=block_t, n_qblocks=n_qb,
                               precision=_precision(q), page_size=None)
    out = _score_call(
        kernel, (batch, n_qb, n_t), (first, last, kv_len), q, w, pos, start, k,
        pl.BlockSpec((None, block_t, dim), lambda b, qb, t, first, last, n: (b, clamp(b, qb, t, first, last), 0)),
        jax.ShapeDtypeStruct((batch, sp, tp), jnp.float32),
        pl.BlockSpec((None, bq, block_t), lambda b, qb, t, *_: (b, qb, t)), block_q=bq, interpret=interpret)
    return out[:, :seq_len, :num_keys]


def paged_scores(q, k_pages, page_table, slot, weights, *, q_pos, kv_len, kv_start=None,
                 config: IndexerTpuConfig = IndexerTpuConfig(), interpret: bool = False):
    """`scores` of the keys of a paged store, fetched tile by tile through the page table (no
    copy of the keys): k_pages [slots, pages, P, D], page_table int32 [B, n], slot int32 scalar
    -> f32 [B, S, n * P].

    The page table (flattened) and the slot are scalar-prefetched into SMEM and the key tile's
    index map reads them: grid (b, query block, page j, tile i of block_t keys in the page; a
    page of P <= block_t keys is one tile), clamped to the tiles the block may see like
    `scores`. SMEM holds B * n page ids. The scores come out page-major ([B, n, S, P]; a
    block's last two dims must be whole or (8, 128)-aligned) and are moved to [B, S, n * P]
    in XLA (a bitcast for one query). FP8 keys (`fp8.Fp8Keys`): each e4m3 tile is fetched with
    its scales, the logits of the values scaled per key (exact algebra; unlike the contract's
    order the scaled key is not rounded to q's dtype). The scales are viewed [slots, pages, 1, P]
    (a lane-dense block of a page; in the row-major layout the decode step pins, XLA copies the
    [slots, pages, P] scales into that shape: 4 bytes a key)."""
    scales = (k_pages.scales[:, :, None, :],) if fp8.is_fp8(k_pages) else ()
    k_pages = k_pages.values if scales else k_pages
    batch, seq_len, _, dim = q.shape
    page_size, n = k_pages.shape[2], page_table.shape[1]
    block_t = min(config.block_t, page_size)
    per_page = -(-page_size // block_t)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    q, w, pos, start, first, last, bq, hp = _query_layout(q, weights, q_pos, kv_start, kv_len, block_t, page_size)
    sp = pos.shape[1]
    n_qb = sp // bq

    def key_block(b, qb, j, i, first_ref, last_ref, len_ref, pages_ref, slot_ref):
        block = b * n_qb + qb
        tile = jnp.clip(jnp.minimum(jnp.maximum(j * per_page + i, first_ref[block]), last_ref[block]),
                        0, n * per_page - 1)
        # tile >= 0: truncating division, which needs no sign fix-up
        return slot_ref[0], pages_ref[b * n + lax.div(tile, per_page)], lax.rem(tile, per_page), 0

    kernel = functools.partial(_score_kernel, block_q=bq, heads=hp, block_t=block_t, n_qblocks=n_qb,
                               precision=_precision(q), page_size=page_size, scaled=bool(scales))
    scalars = (first, last, kv_len, page_table.reshape(-1), jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)))
    out = _score_call(
        kernel, (batch, n_qb, n, per_page), scalars, q, w, pos, start, (k_pages, *scales),
        (pl.BlockSpec((None, None, block_t, dim), key_block),)
        + ((pl.BlockSpec((None, None, 1, block_t), lambda *ids: _scale_block(key_block(*ids))),) if scales else ()),
        jax.ShapeDtypeStruct((batch, n, sp, per_page * block_t), jnp.float32),
        pl.BlockSpec((None, None, bq, block_t), lambda b, qb, j, i, *_: (b, j, qb, i)), block_q=bq,
        interpret=interpret)
    return jnp.moveaxis(out[:, :, :seq_len, :page_size], 1, 2).reshape(batch, seq_len, n * page_size)


def _scale_block(key_block):
    """The block of a page's scales [1, block_t] beside the key tile (slot, page, tile, 0)."""
    slot, page, tile, _ = key_block
    return slot, page, 0, tile


def _precision(q):
    return lax.Precision.HIGHEST if q.dtype == jnp.float32 else None


# -------------------------------------------------------------------------------- counting

def _count_kernel(s_ref, e_ref, act_ref, out_ref):
    x = s_ref[...]                                             # [8, chunk]
    edges = e_ref[...]                                         # [8, E]
    lane = lax.broadcasted_iota(jnp.int32, edges.shape, 1)
    acc = jnp.zeros(edges.shape, jnp.int32)
    for j in range(edges.shape[1]):
        hits = jnp.sum((x >= edges[:, j:j + 1]).astype(jnp.int32), axis=1, keepdims=True)
        acc = acc + jnp.where(lane == j, hits, 0)
    out_ref[...] = jnp.where(act_ref[...] != 0, acc, 0)


def count(scores, edges, active, *, chunk: int = CHUNK, interpret: bool = False):
    """`threshold.CountFn`: scores f32 [R, T] -> int32 [R, ceil(T / chunk), E]."""
    rows, num_keys = scores.shape
    chunk = min(chunk, _round_up(num_keys, 128))
    n = threshold.chunk_count(num_keys, chunk)
    rp = _round_up(rows, 8)
    padded = pad_axis(pad_axis(scores, 1, n * chunk, -jnp.inf), 0, rp, -jnp.inf)
    e = pad_axis(edges, 0, rp)
    act = pad_axis(active.astype(jnp.int32)[:, None], 0, rp)
    out = pl.pallas_call(
        _count_kernel,
        grid=(rp // 8, n),
        in_specs=[pl.BlockSpec((8, chunk), lambda r, c: (r, c)),
                  pl.BlockSpec((8, e.shape[1]), lambda r, c: (r, 0)),
                  pl.BlockSpec((8, 1), lambda r, c: (r, 0))],
        out_specs=pl.BlockSpec((None, 8, e.shape[1]), lambda r, c: (c, r, 0)),
        out_shape=jax.ShapeDtypeStruct((n, rp, e.shape[1]), jnp.int32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="indexer_select_count",
    )(padded, e, act)
    return jnp.moveaxis(out, 0, 1)[:rows]


def select_topk(scores: jax.Array, topk: int, *, config: IndexerTpuConfig = IndexerTpuConfig(),
                interpret: bool = False) -> jax.Array:
    """Exact top-k of each row of float32 scores [R, T] (-inf = masked) -> int32 [R, topk]."""
    return threshold.select_topk(
        scores.astype(jnp.float32), topk, compact_fn=threshold.compact_xla,
        count_fn=functools.partial(count, chunk=config.chunk, interpret=interpret))


def indexer_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start=None,
                 config: IndexerTpuConfig = IndexerTpuConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.indexer_topk`: scores kernel, then threshold selection, over
    chunks of `config.q_chunk` queries (`pallas_ops.topk`)."""
    scores_fn = lambda q_c, w_c, **kw: scores(q_c, k, w_c, kv_len=kv_len, **kw)
    return _topk(q, weights, scores_fn, k.shape[1], topk=topk, q_pos=q_pos, kv_start=kv_start, config=config,
                 interpret=interpret)


def paged_indexer_topk(q, k_pages, page_table, weights, *, topk, q_pos, kv_len, slot,
                       config: IndexerTpuConfig = IndexerTpuConfig(), interpret: bool = False):
    """Contract of `pallas_kernels.paged_indexer_topk`: `indexer_topk` with the paged score
    kernel (`paged_scores`: key tiles fetched through the scalar-prefetched page table)."""
    scores_fn = lambda q_c, w_c, **kw: paged_scores(q_c, k_pages, page_table, slot, w_c, kv_len=kv_len, **kw)
    page_size = (k_pages.values if fp8.is_fp8(k_pages) else k_pages).shape[2]
    return _topk(q, weights, scores_fn, page_table.shape[1] * page_size, topk=topk, q_pos=q_pos,
                 kv_start=None, config=config, interpret=interpret)


def _topk(q, weights, scores_fn, num_keys: int, *, topk, q_pos, kv_start, config: IndexerTpuConfig, interpret):
    chunk = pallas_ops.query_chunk(q.shape[0], q.shape[1], num_keys, BLOCK_Q, config.q_chunk)
    return pallas_ops.topk(q, weights, topk=topk, q_pos=q_pos, kv_start=kv_start, num_keys=num_keys,
                           scores_fn=functools.partial(scores_fn, config=config, interpret=interpret),
                           select_fn=functools.partial(select_topk, config=config, interpret=interpret),
                           q_chunk=chunk)
