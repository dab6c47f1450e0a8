"""The lightning indexer's top-k on NVIDIA GPUs: Pallas kernels with the Triton lowering.

The score kernel (`gpu_scores`) writes each query's scores, then two kernels, driven by
`threshold.select_topk`, select the top-k:

* `count` -- one program per (row, chunk of `chunk` scores): how many scores reach each of the
  selection's edges (a few compares per score, one read of the scores).
* `compact` -- one program per (row, chunk): a running count (cumsum) of the scores above / in
  the selection bracket gives each one its candidate slot, written by a masked scatter store.

Why Triton rather than Mosaic GPU: the compaction is a data-dependent scatter, which the
pointer-based Triton lowering expresses directly as one masked store. With config.fused the
prefill top-k runs without a scores array (`gpu_fused`).

The tuning knobs are the fields of `IndexerGpuConfig` (`gpu_config`); the top-k over chunks of
queries and the scores' backward are shared with the TPU kernels (`indexer_topk.pallas_ops`).
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
from pallas_kernels._common import pad_axis
from pallas_kernels.indexer_topk import pallas_ops, threshold
from pallas_kernels.indexer_topk.gpu_config import BLOCK, CHUNK, IndexerGpuConfig, kernel_params, next_pow2
from pallas_kernels.indexer_topk.gpu_fused import fused_topk
from pallas_kernels.indexer_topk.gpu_scores import paged_scores, scores

__all__ = ["IndexerGpuConfig", "count", "compact", "select_topk", "indexer_topk", "paged_indexer_topk", "scores",
           "paged_scores", "fused_topk"]


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
        compiler_params=kernel_params(num_warps),
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
        compiler_params=kernel_params(num_warps),
        interpret=interpret,
        name="indexer_select_compact",
    )(padded, lo, hi, above_offset, between_offset, init)
    return out[:, :cap]


def _chunk_for(num_keys: int, chunk: int | None) -> int:
    """Count / compaction chunk: CHUNK, or the row length rounded up to a power of two
    (>= 16) when that is shorter."""
    if chunk is not None:
        return int(chunk)
    return min(CHUNK, max(16, next_pow2(num_keys)))


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
