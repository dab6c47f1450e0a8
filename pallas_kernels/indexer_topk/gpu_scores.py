"""The lightning indexer's score kernel on NVIDIA GPUs (Pallas, Triton lowering).

`scores` -- one program per (sequence, block of queries, chunk of keys), looping over key
tiles. The block's queries x heads and the tile's keys are the two sides of one matmul; the
epilogue applies relu and the head weights, sums the heads, masks by kv_start <= t <= q_pos and
t < kv_len and writes float32 scores. Tiles no query of the block may see are not read, only
written as -inf. Decode uses [queries x heads, keys] matmuls (memory-bound; about the copy
bandwidth on an H200); prefill uses [keys, queries x heads] ("keys-major"), which keeps the
head sum inside each thread's columns instead of across warps (1.7x faster there).
`paged_scores` reads the keys of a paged store through the page table inside the kernel. Block
sizes must be powers of two, so heads and the key width are zero-padded to powers of two >= 16
and queries to a multiple of `block_q` (padded queries have q_pos -1: every key masked). The
fused prefill top-k (`gpu_fused`) shares the query block and tile scores."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import fp8
from pallas_kernels._common import pad_axis, start_or_zero
from pallas_kernels.indexer_topk.gpu_config import IndexerGpuConfig, ScoreTiling, kernel_params, next_pow2

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
class QueryBlock:
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


def query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, *, block_q, heads) -> QueryBlock:
    b, qb = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(qb * block_q * heads, block_q * heads)
    qs = pl.ds(qb * block_q, block_q)
    pos, start, n_keys = pos_ref[b, qs], start_ref[b, qs], len_ref[b]
    return QueryBlock(b, q_ref[b, rows, :], w_ref[b, rows], pos, start, n_keys, jnp.min(start),
                       jnp.minimum(jnp.max(pos) + 1, n_keys))


def tile_scores(blk: QueryBlock, k_ref, paged_refs, t0, *, block_q, heads, block_t, keys_major, page_size):
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
    blk = query_block(q_ref, w_ref, pos_ref, start_ref, len_ref, block_q=block_q, heads=heads)
    qs = pl.ds(pl.program_id(1) * block_q, block_q)
    b = blk.b

    def tile(i, carry):
        t0 = (c * tiles + i) * block_t
        needed = (t0 < blk.limit) & (t0 + block_t > blk.lower)

        @pl.when(needed)
        def _():
            s_ref[b, qs, pl.ds(t0, block_t)] = tile_scores(
                blk, k_ref, paged_refs, t0, block_q=block_q, heads=heads, block_t=block_t, keys_major=keys_major,
                page_size=page_size)

        @pl.when(~needed)
        def _():
            s_ref[b, qs, pl.ds(t0, block_t)] = jnp.full((block_q, block_t), -jnp.inf, jnp.float32)

        return carry

    lax.fori_loop(0, tiles, tile, 0)


def query_layout(q, weights, q_pos, kv_start, block_q):
    """Pads heads / key width to powers of two >= 16 and queries to a multiple of block_q.

    -> (q [B, Sp*Hp, Dp], w f32 [B, Sp*Hp], q_pos, kv_start int32 [B, Sp], Hp, Dp)."""
    batch, seq_len, heads, dim = q.shape
    hp = max(16 // block_q if block_q < 16 else 1, next_pow2(heads))
    dp = max(16, next_pow2(dim))
    sp = -(-seq_len // block_q) * block_q
    q = pad_axis(pad_axis(pad_axis(q, 3, dp), 2, hp), 1, sp)
    w = pad_axis(pad_axis(weights.astype(jnp.float32), 2, hp), 1, sp)
    pos = pad_axis(jnp.asarray(q_pos, jnp.int32), 1, sp, -1)
    start = pad_axis(start_or_zero(kv_start, q_pos), 1, sp, 0)
    return q.reshape(batch, sp * hp, dp), w.reshape(batch, sp * hp), pos, start, hp, dp


def scores(q, k, weights, *, q_pos, kv_len, kv_start=None, config: IndexerGpuConfig = IndexerGpuConfig(),
           interpret: bool = False):
    """q [B, S, H, D], k [B, T, D], weights f32 [B, S, H], q_pos int32 [B, S], kv_len int32 [B],
    kv_start int32 [B, S] or None -> scores f32 [B, S, T], -inf where masked."""
    num_keys = k.shape[1]
    tiling = config.tiling(q.shape[1], q.shape[2])
    tp = padded_keys(num_keys, tiling.block_t, config.tiles_per_program)
    dp = max(16, next_pow2(k.shape[2]))
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
    if dim != max(16, next_pow2(dim)):
        raise ValueError(f"pallas_gpu paged indexer: the key width must be a power of two >= 16, got {dim}")
    num_keys = page_table.shape[1] * k_pages.shape[2]
    keys = (k_pages, page_table, jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), *scales)
    return _scores(q, weights, keys, num_keys, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start,
                   tiling=config.tiling(q.shape[1], q.shape[2]), config=config, interpret=interpret,
                   page_size=k_pages.shape[2])[..., :num_keys]


def padded_keys(num_keys: int, block_t: int, tiles_per_program: int) -> int:
    n_tiles = -(-num_keys // block_t)
    tiles = max(1, min(tiles_per_program, n_tiles))
    return -(-n_tiles // tiles) * tiles * block_t


def _scores(q, weights, keys: tuple, num_keys: int, *, q_pos, kv_len, kv_start, tiling: ScoreTiling, config,
            interpret, page_size):
    """The score kernel over keys (k [B, Tp, Dp] padded to whole programs, or the paged
    (store, page table, slot)) -> f32 [B, S, Tp], Tp = num_keys rounded up to whole programs."""
    batch, seq_len, heads, _ = q.shape
    bq, block_t = tiling.block_q, tiling.block_t
    qf, w, pos, start, hp, _ = query_layout(q, weights, q_pos, kv_start, bq)
    tp = padded_keys(num_keys, block_t, config.tiles_per_program)
    tiles = max(1, min(config.tiles_per_program, -(-num_keys // block_t)))
    sp = pos.shape[1]
    kernel = functools.partial(_score_kernel, block_q=bq, heads=hp, block_t=block_t, tiles=tiles,
                               keys_major=tiling.keys_major, page_size=page_size)
    out = pl.pallas_call(
        kernel,
        grid=(batch, sp // bq, tp // (tiles * block_t)),
        out_shape=jax.ShapeDtypeStruct((batch, sp, tp), jnp.float32),
        compiler_params=kernel_params(tiling.num_warps, config.num_stages),
        interpret=interpret,
        name="indexer_scores" if page_size is None else "paged_indexer_scores",
    )(qf, w, pos, start, jnp.asarray(kv_len, jnp.int32), *keys)
    return out[:, :seq_len]
