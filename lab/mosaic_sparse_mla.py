"""Sparse MLA forward on Hopper with the Mosaic GPU Pallas backend, paged (decode) and
contiguous (prefill): warp-specialised, a TMA producer warpgroup and two wgmma warpgroups.

Status: correct, slower than the registry's Triton kernel, so outside the registry. Measured on
an H100 (jax 0.11.2) in the same runs as the Triton kernel: paged decode (64 heads, Dk 576,
v 512, top-2048, 32K context) 433 / 887-930 us at batch 64 / 128, 12-13% of copy bandwidth,
against the Triton kernel's 155 / 268 us (36% / 41%), largest difference from the Triton
kernel's output 0.002; prefill forward (16,384 queries over 65,536 keys, 64 heads) 106 ms, 6% of
the bf16 matmul rate, against the Triton kernel's 21.5 ms (29%), lse within 2e-6.
`benchmarks/sparse_mla.py --paged-only` and `--mosaic-prefill` print both.

Where its time goes (the design's limits, for the next one): Hopper has no TMA row gather (gather4
is Blackwell's), so every selected row is fetched by TMAs issued one at a time by one thread of
the producer; a TMA box is limited to 256 elements a dimension, and Pallas does not slice one row
out of a tiled (8, 64) buffer, so each row arrives as Dk / 64 = 9 copies of 128 bytes into an
untiled staging ring, and the producer's 128 threads then move it through registers into the
tiled, swizzled block the wgmma reads. At Dk = 576 the shared memory (q 72 KiB, 2 staging slots
of 32 rows 72 KiB, one tiled block of 64 rows 72 KiB) leaves no room for a second tiled block, so
that move and the matmuls of a block do not overlap. Fetching each row as one TMA of [9, 64]
into a staging row and reading its 64-column chunks as strided views gave wrong results on the
H100 (up to 1.4 off; right in interpret mode): reading a strided view of the staging buffer into
registers is where it went wrong, so the staging slots are chunk-major, [Dk / 64, 32, 64], each
chunk read contiguously. Kernels that reach the matmul rate write the gathered rows straight into
the swizzled layout from the threads of producer warps (16-byte copies, no staging).

Layout. One CUDA block per (query row b * S + s, K split, group of 64 heads); three
warpgroups:
  * warpgroup 2 (producer): copies the query's 64 (padded) heads q [64, Dk] and the split's
    row ids int32 [blocks, bk] to shared memory (one TMA each), then for every 32-row slot:
    waits for its rows, (first slot of a block) waits until the tiled buffer is free, copies
    the slot into the tiled block, refills the slot, and (last slot) signals the block ready;
  * warpgroups 0 and 1 (compute): each computes the logits S = q K^T [64, bk] of the block
    (the same matmul in both, so no logits are exchanged), the online softmax, and
    O[:, w v/2 : (w + 1) v/2] += P V for its half of the value columns, P (bf16) the A operand
    from registers (an f32 accumulator [64, 512] would need 256 registers a thread in one
    warpgroup; [64, 256] needs 128), then frees the tiled block.
The staging copy into the tiled block uses `Layout.SMEM_GMEM_COPY` (16-byte vectors, 8 lanes
along a 128-byte row). Shared memory at Dk = 576, bf16, with the defaults (block_k 64, 2 slots,
1 tiled block): 216 KiB + the split's ids (4 bytes a row), under Hopper's 227 KiB (`smem_bytes`;
one split of 2048 rows does not fit, so the default splits are raised to 2 there).

Page translation and masking. The logical indices are turned into row ids of the store
flattened to [slots * pages * P, Dk] in XLA (`row_ids`: an int32 gather over the [B, S, K]
indices, 4 bytes per selected row next to the 1152 the kernel reads): id = (slot * pages +
page_table[b, t // P]) * P + t % P for a valid t (0 <= t < n * P); a skipped t gets ~id of
(page_table[b, 0], row 0), a readable address made negative. The producer copies row id if
id >= 0 else ~id; the compute warpgroups give ids < 0 the logit -inf. A duplicated index counts
once per occurrence (as in the Triton kernel; the reference counts it once). The contiguous
form (`sparse_mla`) is the paged one with one page of T rows a sequence.

Heads. The matmul M dimension is 64 heads: q is padded to a multiple of 64 heads in XLA when H
is not one (8 or 16 heads: 64 rows of work, most of them zeros; a grid axis takes each group
of 64); out and lse are written for the padded heads and sliced to H in XLA. K splits: with
fewer blocks than SMs, the K rows of a query are split over `num_splits` blocks writing partial
(out, lse) in float32, merged with a log-sum-exp in XLA.

Forward only; bf16 (or f16) q and store, Dk a multiple of 64, v_dim a multiple of 128
(`supports`); other inputs take the `xla` implementation. GPU interpret mode (jax >= 0.12,
`interpret=True`) runs the kernel on a CPU; it simulates wgmma with both operands in shared
memory and has no rule for `pl.run_state`, so there P goes through a shared-memory buffer
(`_pv`), the one place where the interpreted kernel differs from the compiled one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU pieces: absent from some jax builds; the module still imports
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from pallas_kernels._common import check_positive_fields, pad_slots

#: Rows of the matmul M dimension (one wgmma tile): heads are padded to a multiple of it.
HEAD_TILE = 64
#: Columns of one swizzled tile of 2-byte elements (128 bytes) and of one row chunk of a TMA.
CHUNK = 64
#: Rows of one staging slot: the producer converts and refills the staging ring by 32 rows (4
#: tiles of 8 rows, one a warp), so the next rows are in flight while a block is converted.
STAGE_ROWS = 32
#: Shared memory a block may use on an H100 / H200 (227 KiB).
SMEM_LIMIT = 227 * 1024
#: Bytes Mosaic adds to the allocations (barriers, alignment): 2872 measured at Dk = 576.
SMEM_OVERHEAD = 3 * 1024
#: Blocks the K splits aim for (one wave of an H100/H200's 132 SMs: one block per SM fits).
TARGET_BLOCKS = 132
#: Registers a thread of the compute / producer warpgroups asks for (setmaxnreg): 2 x 128 x
#: 224 + 128 x 56 = 64512 <= 65536.
COMPUTE_REGISTERS = 224
PRODUCER_REGISTERS = 56


def available() -> bool:
    """Whether this jax has the Mosaic GPU Pallas API the kernel uses."""
    return plgpu is not None and all(hasattr(plgpu, n) for n in (
        "kernel", "copy_gmem_to_smem", "wgmma", "Barrier", "TilingTransform", "SwizzleTransform", "ACC"))


def interpret_available() -> bool:
    """Whether GPU interpret mode (running the kernel on a CPU) exists in this jax."""
    return available() and hasattr(plgpu, "InterpretGPUParams")


@dataclasses.dataclass(frozen=True)
class SparseMLAMosaicConfig:
    """Tuning of the Mosaic GPU paged sparse MLA kernel (module docstring).

    block_k: selected rows per step, the N of the logits matmul and the K of P V (a multiple
      of 64, which Mosaic's wgmma takes for a bf16 A operand in registers; at most 256).
    num_splits: blocks per query over its K rows (None: about TARGET_BLOCKS blocks in all,
      raised until the shared memory fits).
    stages: staging slots of STAGE_ROWS rows (the per-row TMAs in flight), each [Dk / 64,
      STAGE_ROWS, 64]: the producer refills a slot as soon as it has moved it to the tiled block.
    buffers: tiled blocks of block_k rows (the matmul operands); 2 lets the producer fill
      block j + 1 while block j is multiplied.
    Shared memory (`smem_bytes`: q, the staging slots, the tiled blocks, the split's row ids)
    must fit in SMEM_LIMIT; checked when the shapes are known. At Dk = 576 the defaults use
    216 KiB + the ids (4 bytes a row of a split)."""

    block_k: int = 64
    num_splits: int | None = None
    stages: int = 2
    buffers: int = 1

    def __post_init__(self):
        check_positive_fields(self)
        if self.block_k % 64 or self.block_k > 256:
            raise ValueError(f"SparseMLAMosaicConfig.block_k must be a multiple of 64 and at most 256, "
                             f"got {self.block_k}")


def smem_bytes(dk: int, block_k: int, stages: int, buffers: int, rows_per_split: int, itemsize: int = 2) -> int:
    """Shared memory of one block, each allocation rounded up to 1 KiB, + SMEM_OVERHEAD: q
    [64, Dk], stages slots [STAGE_ROWS, Dk], buffers blocks [bk, Dk], the split's row ids int32
    [rows_per_split], lse f32 [64]."""
    kib = lambda n: -(-n // 1024) * 1024
    return (kib(HEAD_TILE * dk * itemsize) + kib(stages * STAGE_ROWS * dk * itemsize)
            + kib(buffers * block_k * dk * itemsize) + kib(4 * rows_per_split) + kib(4 * HEAD_TILE) + SMEM_OVERHEAD)


def supports(q_shape, kv_shape, v_dim: int, dtype) -> str | None:
    """None if the kernel takes q [B, S, H, Dk] over a store [.., Dk] of `dtype` with v_dim,
    else why not."""
    dk = q_shape[-1]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (bf16 / f16 only)"
    if kv_shape[-1] != dk or dk % CHUNK or dk // CHUNK > 256:
        return f"Dk={dk} (a multiple of {CHUNK}, q and store alike)"
    if v_dim % (2 * CHUNK) or v_dim > dk:
        return f"v_dim={v_dim} (a multiple of {2 * CHUNK}: two halves of whole 64-column tiles)"
    if not available():
        return "this jax has no Mosaic GPU Pallas backend"
    return None


def default_splits(num_blocks: int, topk: int, block_k: int) -> int:
    """K splits per query: about TARGET_BLOCKS blocks in all, at most one per row block."""
    splits = max(1, TARGET_BLOCKS // max(1, num_blocks))
    return max(1, min(splits, -(-topk // block_k)))


def row_ids(page_table: jax.Array, indices: jax.Array, *, slot, pages: int, page_size: int) -> jax.Array:
    """indices int32 [B, S, K] logical rows -> int32 [B, S, K] rows of the store flattened to
    [slots * pages * P, Dk]: the row's id when 0 <= t < n * P, else ~id of (page_table[b, 0],
    row 0) (negative: skip, but a readable address)."""
    b, s, k = indices.shape
    n = page_table.shape[1]
    valid = (indices >= 0) & (indices < n * page_size)
    t = jnp.where(valid, indices, 0).reshape(b, s * k)
    page = jnp.take_along_axis(page_table, t // page_size, axis=1)
    base = jnp.asarray(slot, jnp.int32) * pages
    ids = ((base + page) * page_size + t % page_size).reshape(b, s, k)
    safe = ((base + page_table[:, :1]) * page_size)[:, :, None]                 # [B, 1, 1]
    return jnp.where(valid, ids, ~safe).astype(jnp.int32)


def _pv(acc, p, v_ref, p_ref):
    """acc [64, n] f32 + p [64, bk] @ v_ref [bk, n]. Compiled (p_ref None): p is the wgmma's A
    operand from registers and the product accumulates into acc in place (`pl.run_state` over
    an initialised accumulator, as the FlashAttention-3 example does). GPU interpret mode
    (p_ref: a tiled [64, bk] buffer of this warpgroup) simulates wgmma with both operands in
    shared memory only and has no rule for `run_state` (nor for storing into an accumulator),
    so there p goes through p_ref and the product to a fresh accumulator, added in registers:
    the same sum (on a GPU it would cost 16 KiB of shared memory, which the kernel does not
    have at Dk = 576, and two [64, n] f32 arrays in registers)."""
    if p_ref is None:
        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p, v_ref)

        return pl.run_state(pv)(plgpu.ACC.init(acc))

    p_ref[...] = p
    plgpu.commit_smem()

    def pv_fresh(acc_ref):
        plgpu.wgmma(acc_ref, p_ref, v_ref)
        return acc_ref[...]

    return acc + pl.run_scoped(pv_fresh, plgpu.ACC(acc.shape, jnp.float32))


def _kernel(q_ref, kv_ref, ids_ref, out_ref, lse_ref, smem, bars, *, sm_scale, block_k, blocks, stages, buffers,
            chunks, v_half):
    """One block of 3 warpgroups (module docstring). q_ref [R, Hp, Dk]; kv_ref [rows, Dk / 64,
    64]; ids_ref int32 [R, splits * blocks, bk]; out_ref [R, splits, Hp, v]; lse_ref f32 [R,
    splits, Hp]."""
    q_smem, stage, tiled, ids_smem, lse_smem, *p_smem = smem
    p_smem = p_smem[0] if p_smem else None
    q_bar, ids_bar, stage_bar, ready_bar, free_bar = bars
    row = lax.axis_index("row")
    split = lax.axis_index("split")
    h0 = lax.axis_index("heads") * HEAD_TILE
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(h0, HEAD_TILE)], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(ids_ref.at[row, pl.ds(split * blocks, blocks)], ids_smem, ids_bar)
        plgpu.barrier_wait(ids_bar)

        per_block = block_k // STAGE_ROWS
        granules = blocks * per_block

        def issue(g):
            """The TMAs of granule g's STAGE_ROWS rows (block g // per_block) into staging slot
            g % stages: one 128-byte copy per row and chunk, all arriving on the slot's barrier."""
            s = lax.rem(g, stages)
            j = lax.div(g, per_block)
            r0 = lax.rem(g, per_block) * STAGE_ROWS

            @pl.loop(0, STAGE_ROWS)
            def _row(i):
                rid = ids_smem[j, r0 + i]
                rid = jnp.where(rid >= 0, rid, ~rid)
                for c in range(chunks):
                    plgpu.copy_gmem_to_smem(kv_ref.at[rid, pl.ds(c, 1)], stage.at[s, c, pl.ds(i, 1)],
                                             stage_bar.at[s])

        for g in range(min(stages, granules)):
            issue(jnp.int32(g))
        # 16-byte vectors, 8 lanes along each 128-byte row of a chunk
        copy_layout = plgpu.Layout.SMEM_GMEM_COPY((STAGE_ROWS, CHUNK), stage.dtype, 128)

        @pl.loop(0, granules)
        def _granule(g):
            s = lax.rem(g, stages)
            j = lax.div(g, per_block)
            k = lax.rem(g, per_block)
            t = lax.rem(j, buffers)
            plgpu.barrier_wait(stage_bar.at[s])

            @pl.when((k == 0) & (j >= buffers))
            def _():
                plgpu.barrier_wait(free_bar.at[t])          # block j - buffers multiplied

            for c in range(chunks):
                part = plgpu.load(stage.at[s, c], layout=copy_layout)            # [32, 64]
                tiled.at[t, pl.ds(k * STAGE_ROWS, STAGE_ROWS), pl.ds(c * CHUNK, CHUNK)][...] = part

            @pl.when(g + stages < granules)
            def _():
                issue(g + stages)                            # the slot's rows are in registers

            @pl.when(k == per_block - 1)
            def _():
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready_bar.at[t])

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(ids_bar)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((HEAD_TILE, v_half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        v0 = wg * v_half

        def body(j, carry):
            acc, m, l = carry
            t = lax.rem(j, buffers)
            plgpu.barrier_wait(ready_bar.at[t])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, tiled.at[t].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, block_k), jnp.float32))
            ids = plgpu.load(ids_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0))     # [bk]
            valid = lax.broadcast_in_dim(ids >= 0, s.shape, [1])
            s = jnp.where(valid, s * sm_scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            alpha = jnp.exp(m - m_use)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(q_smem.dtype)

            acc = _pv(acc, p16, tiled.at[t, :, pl.ds(v0, v_half)], None if p_smem is None else p_smem.at[wg])
            plgpu.barrier_arrive(free_bar.at[t])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, blocks, body, (acc, m, l))
        has_any = l > 0
        safe = jnp.where(has_any, l, 1.0)
        out = acc / lax.broadcast_in_dim(safe, acc.shape, [0])
        out_ref.at[row, split, pl.ds(h0, HEAD_TILE), pl.ds(v0, v_half)][...] = out.astype(out_ref.dtype)

        @pl.when(wg == 0)
        def _lse():
            m_use = jnp.where(m == -jnp.inf, 0.0, m)
            lse_smem[...] = jnp.where(has_any, m_use + jnp.log(safe), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, split, pl.ds(h0, HEAD_TILE)])
            plgpu.wait_smem_to_gmem(0)


def _forward(q, kv, ids, *, sm_scale, v_dim, block_k, splits, stages, buffers, interpret):
    """q [R, Hp, Dk] (Hp a multiple of 64); kv [rows, Dk] (the flattened store); ids int32
    [R, Kp] (Kp a multiple of block_k * splits) -> (out [R, splits, Hp, v] (q.dtype when one
    split, else f32), lse f32 [R, splits, Hp])."""
    rows_total, hp, dk = q.shape
    kp = ids.shape[-1]
    blocks = kp // (block_k * splits)
    chunks = dk // CHUNK
    dtype = q.dtype
    out_dtype = dtype if splits == 1 else jnp.float32
    tiling = plgpu.TilingTransform((8, CHUNK))
    swizzle = plgpu.SwizzleTransform(128)
    kernel = functools.partial(_kernel, sm_scale=sm_scale, block_k=block_k, blocks=blocks, stages=stages,
                               buffers=buffers, chunks=chunks, v_half=v_dim // 2)
    # interpret mode: a P buffer per compute warpgroup (`_pv`)
    p_scratch = [] if interpret is False else [
        plgpu.SMEM((2, HEAD_TILE, block_k), dtype, transforms=(tiling, swizzle))]
    nsmem = 5 + len(p_scratch)

    def entry(q_ref, kv_ref, ids_ref, out_ref, lse_ref):
        pl.run_scoped(
            lambda *refs: kernel(q_ref, kv_ref, ids_ref, out_ref, lse_ref, refs[:nsmem], refs[nsmem:]),
            plgpu.SMEM((HEAD_TILE, dk), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, chunks, STAGE_ROWS, CHUNK), dtype),
            plgpu.SMEM((buffers, block_k, dk), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((blocks, block_k), jnp.int32),
            plgpu.SMEM((HEAD_TILE,), jnp.float32),
            *p_scratch,
            plgpu.Barrier(),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=STAGE_ROWS * chunks, num_barriers=stages),
            plgpu.Barrier(num_barriers=buffers),
            plgpu.Barrier(num_arrivals=2, num_barriers=buffers),
            collective_axes="wg",
        )

    kwargs = {} if interpret is False else dict(interpret=interpret)
    out, lse = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((rows_total, splits, hp, v_dim), out_dtype),
                  jax.ShapeDtypeStruct((rows_total, splits, hp), jnp.float32)],
        grid=(rows_total, splits, hp // HEAD_TILE),
        grid_names=("row", "split", "heads"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, kv.reshape(kv.shape[0], chunks, CHUNK), ids.reshape(rows_total, splits * blocks, block_k))
    return out, lse


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: SparseMLAMosaicConfig = SparseMLAMosaicConfig(),
                     interpret: bool = False):
    """Paged sparse MLA decode with the Mosaic GPU kernel; contract of
    `pallas_kernels.paged_sparse_mla`.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], slot int32
    scalar, indices int32 [B, S, K] (-1 or >= n * P = skip) -> (out [B, S, H, v_dim] in
    q.dtype, lse f32 [B, S, H]). Inputs the kernel does not take (`supports`: not bf16 / f16,
    Dk or v_dim not multiples of 64 / 128) run `sparse_mla.xla.paged_sparse_mla` instead.
    interpret: run the kernel in GPU interpret mode (jax >= 0.12; a CPU)."""
    why = supports(q.shape, kv_pages.shape, v_dim, kv_pages.dtype)
    if why is None and q.dtype != kv_pages.dtype:
        why = "q and store of different dtypes"
    if why is not None:
        from pallas_kernels.sparse_mla import xla
        from pallas_kernels._common import XlaConfig
        return xla.paged_sparse_mla(q, kv_pages, page_table, indices, slot=slot, sm_scale=sm_scale, v_dim=v_dim,
                                    config=XlaConfig(), interpret=interpret)
    c = config
    batch, seq_len, heads, dk = q.shape
    slots, pages, page_size, _ = kv_pages.shape
    hp = -(-heads // HEAD_TILE) * HEAD_TILE
    rows_total = batch * seq_len
    topk = indices.shape[-1]
    bk = c.block_k
    splits = c.num_splits
    if splits is None:
        splits = default_splits(rows_total * (hp // HEAD_TILE), topk, bk)
        while splits < -(-topk // bk) and smem_bytes(dk, bk, c.stages, c.buffers, -(-topk // (bk * splits)) * bk,
                                                   jnp.dtype(q.dtype).itemsize) > SMEM_LIMIT:
            splits += 1
    idx = pad_slots(jnp.asarray(indices, jnp.int32), bk * splits)
    kp = idx.shape[-1]
    need = smem_bytes(dk, bk, c.stages, c.buffers, kp // splits, jnp.dtype(q.dtype).itemsize)
    if kp // (bk * splits) > 256:
        raise ValueError(f"paged_sparse_mla (mosaic_gpu): {kp // splits} rows a split is more than 256 blocks of "
                         f"block_k={bk} (one TMA box of row ids); use more num_splits")
    if need > SMEM_LIMIT:
        raise ValueError(f"paged_sparse_mla (mosaic_gpu): {need} bytes of shared memory a block (Dk={dk}, "
                         f"block_k={bk}, stages={c.stages}, buffers={c.buffers}, {kp // splits} rows a split) "
                         f"exceed {SMEM_LIMIT}; use fewer stages / buffers or more num_splits")
    if interpret and not interpret_available():
        raise ValueError("paged_sparse_mla (mosaic_gpu): this jax has no GPU interpret mode")
    ids = row_ids(page_table, idx, slot=slot, pages=pages, page_size=page_size).reshape(rows_total, kp)
    qf = q.reshape(rows_total, heads, dk)
    if hp != heads:
        qf = jnp.pad(qf, ((0, 0), (0, hp - heads), (0, 0)))
    out, lse = _forward(qf, kv_pages.reshape(slots * pages * page_size, dk), ids, sm_scale=float(sm_scale),
                        v_dim=int(v_dim), block_k=bk, splits=splits, stages=c.stages, buffers=c.buffers,
                        interpret=plgpu.InterpretGPUParams() if interpret else False)
    out, lse = out[:, :, :heads], lse[:, :, :heads]
    if splits > 1:
        lse_all = lse
        lse = jax.nn.logsumexp(lse_all, axis=1, keepdims=True)
        finite = jnp.isfinite(lse)
        w = jnp.where(finite, jnp.exp(lse_all - jnp.where(finite, lse, 0.0)), 0.0)
        out = jnp.sum(out * w[..., None], axis=1, keepdims=True).astype(q.dtype)
    return out.reshape(batch, seq_len, heads, v_dim), lse.reshape(batch, seq_len, heads)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               config: SparseMLAMosaicConfig = SparseMLAMosaicConfig(), interpret: bool = False):
    """The forward of `pallas_kernels.sparse_mla` (contiguous latent rows) with the same kernel:
    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 or >= T = skip) -> (out
    [B, S, H, v_dim] in q.dtype, lse f32 [B, S, H]). Each sequence's rows are one page of T rows
    of a one-slot store, so the row ids are b * T + t."""
    batch, seq_len, dk = kv.shape
    table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    return paged_sparse_mla(q, kv.reshape(1, batch, seq_len, dk), table, indices, slot=0, sm_scale=sm_scale,
                            v_dim=v_dim, config=config, interpret=interpret)
