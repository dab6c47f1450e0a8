"""Sparse MLA on NVIDIA GPUs: Pallas kernels with the Triton lowering.

Why Triton rather than Mosaic GPU: the op is a gather of arbitrary latent rows. The Triton
lowering addresses memory through pointers, so `kv_ref[b, rows, cols]` with a vector of row
indices is one coalesced gather load (each 1152-byte row is contiguous) that Triton software-
pipelines across loop iterations; Mosaic GPU moves data with TMA, whose row gather only
exists on Blackwell, so on Hopper it would need per-row copies through shared memory.

Layout. One program handles one query (b, s) with all heads (the M dimension of the matmuls, a
tile of `gpu_tiles.head_rows(H)` rows: H rounded up to a power of two >= 16) and loops over
its K selected rows in blocks of `block_k` with an online softmax. The heads are not padded in
memory: the program reads q [B*S, H, Dk] as given with masked loads (tile rows >= H read
zeros) and writes only the H real rows of out and lse (masked stores), so q, out and lse move
H rows per query, not 16 (the default model's 8 heads: half the bytes, and no pad or slice
copy around the call). Triton blocks must have power-of-two sizes, so the
latent width is cut into power-of-two column chunks ([0, v_dim) first, then [v_dim, Dk):
576 = 512 + 64); the logits are summed over the chunks and the value accumulators are the
chunks of [0, v_dim). When B*S programs are too few to fill the GPU (decode), the K slots
are split over `num_splits` programs per query, each writing a partial (out, lse), merged
by a log-sum-exp in XLA. The heads may also be cut into groups of `head_group` (one program
per group, each re-reading the query's rows).

Paged decode (`paged_sparse_mla`): the same forward kernel over a paged store [slots, pages,
P, Dk]; each block's logical indices are translated to (page, offset) through the page table
inside the kernel and the rows gathered from their pages, so no contiguous copy is made. By
default it runs head groups rather than K splits (`default_head_group`). An FP8 store
(`pallas_kernels.fp8.Fp8Latent`) is dequantized in registers (`gpu_fp8`).

Indexer target (`return_target`). Once a program's loop has its lse, a second loop over the
same K rows (just gathered by this program, so mostly served from L2) recomputes the logits
and writes target[j] = mean over the real heads of exp(s[h, j] - lse[h]): per selected row
another gather (Dk * itemsize bytes) and the Q.K matmul (2 H Dk FLOPs), no P.V, and 4 bytes
written. It needs the final lse in the program, so the forward then runs one split per query.

Backward (`dkv_mode`), all reading q, dout, lse and delta unpadded like the forward: the
deterministic backwards of `gpu_backward` (no atomics, the same bits on every run); "auto" takes
"by_key" where `by_key_is_cheaper` says so (few heads, a top-k that is a large share of the
keys: the default model's shape), else "sorted". "sorted": per-query kernels write each (query,
selected row) gradient at its place in a key-sorted list (`transpose.transpose_index`), and one
program per latent row sums its run in a fixed order; on an H200 3.4x (64 heads, 8K queries) to
4.1x (16 heads, 64K queries) faster than the atomic backward it replaced
(docs/kernels-sparse-mla.md). "by_key": dq per query as in "sorted" without the pair gradients,
dkv per block of latent rows over contiguous tiles of the queries that selected them
(`transpose.key_bitmap`), summed on chip. The config's `bwd_` fields tune whichever backward
runs (`SparseMLAGpuConfig`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp8
from pallas_kernels._common import dot_nt, online_softmax_step, pad_slots
from pallas_kernels.sparse_mla import gpu_backward, gpu_fp8, gpu_tiles, transpose, vjp
from pallas_kernels.sparse_mla.gpu_tiles import head_rows, next_pow2, pow2_chunks

#: Rows per loop step of the forward for 2-byte inputs (halved for 4-byte). Sized for Hopper's
#: 227 KiB of shared memory at 64 heads x 576: the forward keeps q ([64, 576] bf16, 72 KiB) and
#: 2 row blocks ([64, 576], 72 KiB each) there.
DEFAULT_BLOCK_K = 64
#: Programs the forward aims for (about two waves of an H100/H200's 132 SMs).
TARGET_PROGRAMS = 264
#: How the backward adds up the latent rows' gradient (module docstring).
DKV_MODES = ("auto", "sorted", "by_key")
#: The keyword settings of `gpu_backward.backward` ("sorted") and `gpu_backward.backward_by_key`
#: ("by_key") that `SparseMLAGpuConfig` sets: each `name` from its field `bwd_<name>`.
INDEXED_KNOBS = {
    "sorted": ("block_k", "col_block", "fuse_dq", "num_warps", "num_stages", "dq_warps", "dq_stages", "budget",
               "reduce_block", "reduce_warps", "evict"),
    "by_key": ("block_k", "col_block", "fuse_dq", "num_warps", "num_stages", "dq_warps", "dq_stages",
               "block_rows", "tile_cols", "keys_warps", "keys_stages", "keys_paired"),
}
#: The config's fields that are block sizes of the backward kernels (powers of two).
_POW2_FIELDS = ("bwd_block_k", "bwd_col_block", "bwd_reduce_block", "bwd_block_rows", "bwd_tile_cols")
#: The config's boolean fields (bwd_fuse_dq may also be None).
_BOOL_FIELDS = ("bwd_fuse_dq", "bwd_evict", "bwd_keys_paired")
#: Matmul FLOPs of "by_key" per byte of "sorted" at which "auto" switches (`by_key_is_cheaper`):
#: the two cost the same at about 109 on an H100 (keys kernel at 378 TFLOP/s, sorted's bytes at
#: 2.45 TB/s, docs/kernels-sparse-mla.md); an H200's 1.47x copy bandwidth at the same matmul
#: rate would put it near 75.
BY_KEY_FLOP_PER_BYTE = 100




def _load_block(idx_ref, kv_ref, *, b, row, k0, block_k, num_keys, chunks):
    idx = idx_ref[row, pl.ds(k0, block_k)]
    valid = (idx >= 0) & (idx < num_keys)
    safe = jnp.where(valid, idx, 0)
    rows = [kv_ref[b, safe, pl.ds(c0, cs)] for c0, cs in chunks]       # [bk, cs] each
    return valid, safe, rows


def _load_paged_block(idx_ref, pt_ref, kv_ref, *, b, slot, row, k0, block_k, page_size, num_keys, chunks):
    """The block's logical rows translated through the page table: row t of sequence b is
    kv_ref[slot, pt_ref[b, t // P], t % P] (`pallas_kernels.paging`)."""
    idx = idx_ref[row, pl.ds(k0, block_k)]
    valid = (idx >= 0) & (idx < num_keys)
    safe = jnp.where(valid, idx, 0)
    pages = pt_ref[b, safe // page_size]                               # [bk]
    offsets = safe % page_size
    rows = [kv_ref[slot, pages, offsets, pl.ds(c0, cs)] for c0, cs in chunks]
    return valid, safe, rows


def _fwd_kernel(q_ref, kv_ref, idx_ref, *refs, seq_len, num_keys, sm_scale, block_k, blocks_per_split, kchunks,
                vchunks, group, page_size, heads, fp8_store=False):
    """One (query, K split, head group) program over q [B*S, H, Dk] (the group's `group` heads in
    a tile, those >= H masked: read as 0, not written). Contiguous: refs = (out, lse[, target])
    and kv [B, T, Dk]; with target (one split, one group of all heads) a second pass over the
    rows writes the indexer target. Paged (page_size set): refs = (page table [B, n], slot [1],
    out, lse) and kv [slots, pages, P, Dk]; an FP8 store (fp8 set): refs = (page table, slot,
    scales, rope, out, lse) and kv the e4m3 values. out [B*S, splits, H, v], lse [B*S, splits, H]."""
    row = pl.program_id(0)                  # b * S + s
    split = pl.program_id(1)
    h0 = pl.program_id(2) * group
    b = row // seq_len
    if page_size is None:
        out_ref, lse_ref, *target_ref = refs
        load = functools.partial(_load_block, idx_ref, kv_ref, b=b, row=row, block_k=block_k,
                                 num_keys=num_keys, chunks=kchunks)
    elif fp8_store:
        pt_ref, slot_ref, scales_ref, rope_ref, out_ref, lse_ref = refs
        target_ref = []
        load = functools.partial(gpu_fp8.load_block, idx_ref, pt_ref, kv_ref, scales_ref, rope_ref, b=b,
                                 slot=slot_ref[0], row=row, block_k=block_k, page_size=page_size,
                                 num_keys=num_keys, chunks=kchunks)
    else:
        pt_ref, slot_ref, out_ref, lse_ref = refs
        target_ref = []
        load = functools.partial(_load_paged_block, idx_ref, pt_ref, kv_ref, b=b, slot=slot_ref[0], row=row,
                                 block_k=block_k, page_size=page_size, num_keys=num_keys, chunks=kchunks)
    qs = [gpu_tiles.load_heads(q_ref, (row,), h0, group, heads, cols) for cols in kchunks]   # [group, cs]
    nv = len(vchunks)

    def scores(k0):
        valid, _, rows = load(k0=k0)
        rows = [r.astype(qs[0].dtype) for r in rows]
        s = dot_nt(qs[0], rows[0])
        for qc, rc in zip(qs[1:], rows[1:]):
            s += dot_nt(qc, rc)
        return valid, rows, s * sm_scale                                  # s [group, bk]

    def body(j, carry):
        valid, rows, s = scores((split * blocks_per_split + j) * block_k)
        return online_softmax_step(carry, jnp.where(valid[None, :], s, -jnp.inf), rows[:nv])

    init = (jnp.full((group,), -jnp.inf, jnp.float32), jnp.zeros((group,), jnp.float32),
            tuple(jnp.zeros((group, cs), jnp.float32) for _, cs in vchunks))
    m, l, accs = lax.fori_loop(0, blocks_per_split, body, init)
    has_any = l > 0
    safe = jnp.where(has_any, l, 1.0)
    for (c0, _), a in zip(vchunks, accs):
        gpu_tiles.store_heads(out_ref, (row, split), h0, heads, (a / safe[:, None]).astype(out_ref.dtype), c0)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    lse = m + jnp.log(safe)
    gpu_tiles.store_heads(lse_ref, (row, split), h0, heads, jnp.where(has_any, lse, -jnp.inf))
    if not target_ref:
        return
    # the indexer target: a second pass over the same rows (just read, likely still in L2) now
    # that lse is known; the mean over the real heads of p = exp(s - lse) at each slot
    real = (h0 + lax.broadcasted_iota(jnp.int32, (group,), 0) < heads) & has_any

    def target_body(j, carry):
        k0 = j * block_k
        valid, _, s = scores(k0)
        p = jnp.where(valid[None, :] & real[:, None], jnp.exp(s - lse[:, None]), 0.0)
        target_ref[0][row, pl.ds(k0, block_k)] = jnp.sum(p, axis=0) * (1.0 / heads)
        return carry

    lax.fori_loop(0, blocks_per_split, target_body, 0)


def _params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(q, kv, idx, *, sm_scale, v_dim, block_k, splits, num_warps, num_stages, interpret, head_group=None,
             paged=None, topk=None):
    """q [B, S, H, Dk]; idx int32 [B*S, Kp] (Kp a multiple of block_k * splits); head_group: heads
    per program (a power of two >= 16, or None: all, in head_rows(H) rows). Contiguous: kv [B, T, Dk].
    paged = (page_table int32 [B, n], slot int32 [1]): kv is a store [slots, pages, P, Dk] and idx
    holds logical rows; kv may then be an `fp8.Fp8Latent` of such stores (v_dim its values' width).
    -> (out, lse), and with `topk` (contiguous, one split, all heads in
    one program) the indexer target float32 [B, S, topk] as well. q is read and out / lse
    written unpadded (the program's head tile is masked)."""
    batch, seq_len, heads, dk = q.shape
    hp = head_rows(heads)
    group = min(hp, head_group or hp)
    fp8_store = fp8.is_fp8(kv)
    kv, extra, vchunks = gpu_fp8.split_store(kv, v_dim) if fp8_store else (kv, (), pow2_chunks(0, v_dim))
    kchunks = vchunks + pow2_chunks(v_dim, dk)
    rows_total = batch * seq_len
    kp = idx.shape[-1]
    blocks_per_split = kp // (block_k * splits)
    final = splits == 1
    if topk is not None and (not final or group != hp or paged is not None):
        raise ValueError("sparse_mla: the indexer target needs the whole lse of every head in one program "
                         "(num_splits=1, head_group=None, a contiguous kv)")
    page_size = None if paged is None else kv.shape[2]
    num_keys = kv.shape[1] if paged is None else paged[0].shape[1] * page_size
    kernel = functools.partial(
        _fwd_kernel, seq_len=seq_len, num_keys=num_keys, sm_scale=sm_scale, block_k=block_k,
        blocks_per_split=blocks_per_split, kchunks=kchunks, vchunks=vchunks, group=group, page_size=page_size,
        heads=heads, fp8_store=fp8_store)
    out_dtype = q.dtype if final else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((rows_total, splits, heads, v_dim), out_dtype),
                 jax.ShapeDtypeStruct((rows_total, splits, heads), jnp.float32)]
    if topk is not None:
        out_shape.append(jax.ShapeDtypeStruct((rows_total, kp), jnp.float32))
    out, lse, *target = pl.pallas_call(
        kernel,
        grid=(rows_total, splits, -(-heads // group)),
        out_shape=out_shape,
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="sparse_mla_fwd" if paged is None else "paged_sparse_mla_fwd",
    )(q.reshape(rows_total, heads, dk), kv, idx, *(paged or ()), *extra)
    if not final:
        lse_all = lse
        lse = jax.nn.logsumexp(lse_all, axis=1, keepdims=True)
        w = jnp.where(jnp.isfinite(lse), jnp.exp(lse_all - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
        out = jnp.sum(out * w[..., None], axis=1, keepdims=True).astype(q.dtype)
    out = out.reshape(batch, seq_len, heads, v_dim)
    lse = lse.reshape(batch, seq_len, heads)
    if topk is None:
        return out, lse
    return out, lse, target[0][:, :topk].reshape(batch, seq_len, topk)


@functools.lru_cache(maxsize=None)
def _op(sm_scale, v_dim, block_k, splits, head_group, num_warps, num_stages, dkv_mode, bwd, topk, interpret):
    """The differentiable op on unpadded indices and the backward's index
    (`vjp.make_index_sparse_mla`). bwd: the backward's keyword settings for dkv_mode, ((name,
    value), ...) (`_backward_settings`). topk: the unpadded K when the op also returns the
    indexer target, else None."""
    def fwd(q, kv, idx, index):
        idx = pad_slots(idx, block_k * splits)
        b, s, kp = idx.shape
        return _forward(q, kv, idx.reshape(b * s, kp), sm_scale=sm_scale, v_dim=v_dim,
                        block_k=block_k, splits=splits, head_group=head_group, num_warps=num_warps,
                        num_stages=num_stages, interpret=interpret, topk=topk)

    fn = {"sorted": gpu_backward.backward, "by_key": gpu_backward.backward_by_key}[dkv_mode]
    return vjp.make_index_sparse_mla(fwd, functools.partial(fn, sm_scale=sm_scale, v_dim=v_dim,
                                                            interpret=interpret, **dict(bwd)))


def default_head_group(num_queries: int, heads: int) -> int:
    """Heads per forward program of the paged decode: the padded heads cut into as many groups
    of >= 16 as bring the programs to about TARGET_PROGRAMS (every group re-reads its query's
    rows, from L2 when the groups run together; no K-split partials to merge)."""
    hp = head_rows(heads)
    groups = max(1, min(hp // 16, TARGET_PROGRAMS // max(1, num_queries)))
    return hp >> (groups.bit_length() - 1)


def default_splits(num_queries: int, topk: int, block_k: int) -> int:
    """K splits per query so that about TARGET_PROGRAMS programs run (1 for prefill)."""
    splits = max(1, TARGET_PROGRAMS // max(1, num_queries))
    splits = min(splits, max(1, -(-topk // block_k)))
    return 1 << (splits.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class SparseMLAGpuConfig:
    """Tuning of the GPU sparse MLA kernels (`impl="pallas_gpu"`; module docstring).

    Forward:
    block_k: rows per loop step (a power of two; default DEFAULT_BLOCK_K for 2-byte inputs,
      halved for 4-byte ones, at most K rounded up to a power of two >= 16).
    num_splits: programs per query (default: enough to fill the GPU, `default_splits`).
    head_group: heads per program (a power of two >= 16). Default: all heads for `sparse_mla`;
      for `paged_sparse_mla`, enough head groups to fill the GPU before the K slots are split
      (`default_head_group`).
    num_warps, num_stages: Triton settings.

    Backward:
    dkv_mode: "sorted" or "by_key" (the deterministic backwards of `gpu_backward`), or "auto":
      one of them by `by_key_is_cheaper`.
    The knobs below tune the backward that dkv_mode selects; those of the other mode are unused.
    The field `bwd_<name>` is the keyword `name` of `gpu_backward.backward` / `backward_by_key`
    (INDEXED_KNOBS), with the same default.
    bwd_block_k: rows per loop step of the per-query kernels (a power of two). None:
      `gpu_tiles.DEFAULT_BLOCK_K` = 64, 32 for 4-byte inputs.
    bwd_num_warps, bwd_num_stages: Triton settings of the per-query kernel ("sorted"'s pairs
      kernel, "by_key"'s dq-only queries kernel). None: 4 warps (`gpu_tiles.DEFAULT_WARPS`);
      2 stages where dq is fused, else 1.
    bwd_col_block: ("sorted", "by_key") the widest column chunk of the gradient tiles (a power
      of two; 128).
    bwd_fuse_dq: ("sorted", "by_key") keep dq's accumulator in the per-query kernel (True), or
      write ds^T and sum dq in a separate dq kernel (False). None: fused when H rounded up to a
      power of two >= 16 is <= `gpu_tiles.FUSED_DQ_MAX_HEADS` (32).
    bwd_dq_warps, bwd_dq_stages: ("sorted", "by_key") Triton settings of that dq kernel (8, 2).
    bwd_budget: ("sorted") bytes of one query chunk's pair gradients (4 GiB): sets the chunks of
      the transposed index built by `sparse_mla` / `backward_index` (a prebuilt one keeps its own).
    bwd_reduce_block, bwd_reduce_warps: ("sorted") pairs summed per step of the reduce kernel (a
      power of two <= transpose.SPARE_ROWS; 32) and its warps (4).
    bwd_evict: ("sorted") stream the pair gradients past L2 (evict_first stores and loads).
    bwd_block_rows: ("by_key") latent rows per block of the keys kernel (a power of two; None:
      `gpu_backward.default_block_rows`, 64 for Dk <= 256, else 32): sets the key bitmap built by
      `sparse_mla` / `backward_index` (a prebuilt one keeps its own).
    bwd_tile_cols: ("by_key") columns (queries x head slots) of the keys kernel's query tiles (a
      power of two; 64).
    bwd_keys_warps, bwd_keys_stages: ("by_key") Triton settings of the keys kernel (4, 2).
    bwd_keys_paired: ("by_key") two blocks of rows, i and blocks - 1 - i, per keys program."""

    block_k: int | None = None
    num_splits: int | None = None
    head_group: int | None = None
    num_warps: int = 8
    num_stages: int = 2
    bwd_block_k: int | None = None
    bwd_num_stages: int | None = None
    dkv_mode: str = "auto"
    bwd_num_warps: int | None = None
    bwd_col_block: int = gpu_tiles.DEFAULT_COL_BLOCK
    bwd_fuse_dq: bool | None = None
    bwd_dq_warps: int = 8
    bwd_dq_stages: int = 2
    bwd_budget: int = gpu_tiles.DEFAULT_BUDGET
    bwd_reduce_block: int = gpu_tiles.DEFAULT_REDUCE_BLOCK
    bwd_reduce_warps: int = 4
    bwd_evict: bool = False
    bwd_block_rows: int | None = None
    bwd_tile_cols: int = gpu_tiles.KEYS_TILE_COLS
    bwd_keys_warps: int = 4
    bwd_keys_stages: int = 2
    bwd_keys_paired: bool = True

    def __post_init__(self):
        name = type(self).__name__
        for field in _BOOL_FIELDS:
            value = getattr(self, field)
            if not (isinstance(value, bool) or (value is None and field == "bwd_fuse_dq")):
                allowed = "True, False or None" if field == "bwd_fuse_dq" else "True or False"
                raise ValueError(f"{name}.{field} must be {allowed}, got {value!r}")
        for field in dataclasses.fields(self):                 # the int fields; None where typed so
            value, optional = getattr(self, field.name), "None" in str(field.type)
            if not str(field.type).startswith("int") or (value is None and optional):
                continue
            try:
                ok = not isinstance(value, bool) and operator.index(value) >= 1
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{name}.{field.name} must be a positive int{' or None' if optional else ''}, "
                                 f"got {value!r}")
        for field in _POW2_FIELDS:
            value = getattr(self, field)
            if value is not None and value & (value - 1):
                raise ValueError(f"{name}.{field} must be a power of two (a Triton block size), got {value!r}")
        if self.bwd_reduce_block > transpose.SPARE_ROWS:
            raise ValueError(f"{name}.bwd_reduce_block must be <= transpose.SPARE_ROWS = {transpose.SPARE_ROWS}, "
                             f"got {self.bwd_reduce_block}")
        if self.dkv_mode not in DKV_MODES:
            raise ValueError(f"dkv_mode must be one of {DKV_MODES}, got {self.dkv_mode!r}")


def _block_and_splits(c: SparseMLAGpuConfig, dtype, topk: int, programs_per_split: int) -> tuple[int, int]:
    """The forward's rows per step (block_k) and K splits for queries of `topk` slots."""
    shrink = max(1, jnp.dtype(dtype).itemsize // 2)
    bk = int(c.block_k or min(DEFAULT_BLOCK_K // shrink, max(16, next_pow2(topk))))
    return bk, int(c.num_splits or default_splits(programs_per_split, topk, bk))


def _backward_settings(c: SparseMLAGpuConfig, dkv_mode: str) -> tuple[tuple[str, object], ...]:
    """The keyword settings of dkv_mode's backward from the config: `gpu_backward.backward`'s /
    `backward_by_key`'s (INDEXED_KNOBS; None: their defaults)."""
    return tuple((name, getattr(c, "bwd_" + name)) for name in INDEXED_KNOBS[dkv_mode])


def _indexed_index(indices, num_keys: int, mode: str, *, dk: int, dtype, c: SparseMLAGpuConfig):
    """The index that mode's backward takes, built with the config's bwd_budget / bwd_block_rows."""
    if mode == "sorted":
        return gpu_backward.backward_index(indices, num_keys, dk=dk, dtype=dtype, budget=c.bwd_budget)
    return gpu_backward.key_index(indices, num_keys, dk=dk, block_rows=c.bwd_block_rows)


def by_key_is_cheaper(*, seq_len: int, num_keys: int, heads: int, dk: int, v_dim: int, topk: int,
                      itemsize: int) -> bool:
    """Whether "auto" takes the "by_key" backward rather than "sorted" (`gpu_backward`) for
    queries [B, S, H, Dk], kv [B, T, Dk], K selected rows: when by_key's matmul FLOPs over its
    candidate pairs (every (row, query) of the tiles it visits; causal indices assumed, the S
    queries the last S positions of T: S T - S (S - 1) / 2 pairs per sequence; 2 x
    query_slots(H) x (2 Dk + 2 v) FLOPs each) per byte that sorted moves for its selected pairs
    (S K of them, 3 Dk itemsize bytes each: the row gathered, the pair gradient written and
    read back) stay under BY_KEY_FLOP_PER_BYTE. True at the default model's shape (8 heads,
    Dk 160, v 128, top-256 of 4096: 77), False at small-128k's (16 heads, 576 / 512, top-2048
    of 64K: 324) and GLM-5.2's."""
    short = min(seq_len, num_keys)
    candidates = seq_len * num_keys - short * (short - 1) // 2
    flops = 2 * gpu_tiles.query_slots(heads) * (2 * dk + 2 * v_dim) * candidates
    moved = 3 * dk * itemsize * seq_len * min(topk, num_keys)
    return flops < BY_KEY_FLOP_PER_BYTE * moved


def resolve_dkv_mode(c: SparseMLAGpuConfig, **shape) -> str:
    """The config's dkv_mode; "auto" resolved for the shape (`by_key_is_cheaper`'s arguments, or
    none: "sorted")."""
    if c.dkv_mode != "auto":
        return c.dkv_mode
    return "by_key" if shape and by_key_is_cheaper(**shape) else "sorted"


def backward_index(indices: jax.Array, num_keys: int, *, dk: int, dtype,
                   config: SparseMLAGpuConfig = SparseMLAGpuConfig(), heads: int | None = None,
                   v_dim: int | None = None) -> transpose.TransposedIndex | transpose.KeyBitmap:
    """The index the backward takes for indices int32 [B, S, K] over num_keys rows of width dk in
    `dtype`, to build once per IndexShare group: the transposed index of "sorted"
    (`gpu_backward.backward_index`, chunked by config.bwd_budget), the key bitmap of "by_key"
    (`gpu_backward.key_index`, blocks of config.bwd_block_rows). Under "auto" the choice needs the heads and v_dim of
    the queries (`by_key_is_cheaper`); without them it is "sorted"'s index, which `sparse_mla`
    leaves unused (building its own bitmap) where it resolves "auto" to "by_key"."""
    batch, seq_len, topk = indices.shape
    shape = {} if heads is None or v_dim is None else dict(
        seq_len=seq_len, num_keys=num_keys, heads=heads, dk=dk, v_dim=v_dim, topk=topk,
        itemsize=jnp.dtype(dtype).itemsize)
    return _indexed_index(indices, num_keys, resolve_dkv_mode(config, **shape), dk=dk, dtype=dtype, c=config)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: SparseMLAGpuConfig = SparseMLAGpuConfig(),
               interpret: bool = False, tindex: transpose.TransposedIndex | transpose.KeyBitmap | None = None):
    """Sparse MLA forward/backward with Pallas Triton kernels; contract of
    `pallas_kernels.sparse_mla`.

    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K] (-1 = skip)
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]); with return_target also the
    indexer target float32 [B, S, K], written by the forward kernel in a second pass over the
    rows (one program per query: num_splits is 1 then).
    tindex: the backward's index (`backward_index`: "sorted"'s transposed index or "by_key"'s
    key bitmap), built once and shared by the layers of an IndexShare group; None: built for
    this call (with the config's bwd_budget / bwd_block_rows). Under "auto", a key bitmap
    selects "by_key"; a transposed index is used where "auto" resolves to "sorted" for this
    shape (`by_key_is_cheaper`), else left aside.
    config: the forward's and the backward's knobs (`SparseMLAGpuConfig`), e.g.
    `SparseMLAGpuConfig(dkv_mode="sorted", num_splits=1, bwd_fuse_dq=False)`.
    Compiled for a GPU, every power-of-two column chunk of Dk must be >= 16 wide, and the
    backward's q, dout and row block must fit in shared memory (bf16 at 64 x 576 does;
    float32 at 64 heads does not)."""
    c = config
    batch, seq_len, heads, dk = q.shape
    topk = indices.shape[-1]
    bk, splits = _block_and_splits(c, kv.dtype, topk, batch * seq_len)
    head_group = c.head_group
    if return_target:
        splits, head_group = 1, None
    dkv_mode = resolve_dkv_mode(c, seq_len=seq_len, num_keys=kv.shape[1], heads=heads, dk=dk, v_dim=int(v_dim),
                         topk=topk, itemsize=jnp.dtype(kv.dtype).itemsize)
    if c.dkv_mode == "auto" and isinstance(tindex, transpose.KeyBitmap):
        dkv_mode = "by_key"
    settings = (float(sm_scale), int(v_dim), bk, splits, head_group, c.num_warps, c.num_stages, dkv_mode,
                _backward_settings(c, dkv_mode), topk if return_target else None, bool(interpret))
    want = {"sorted": transpose.TransposedIndex, "by_key": transpose.KeyBitmap}[dkv_mode]
    idx = jnp.asarray(indices, jnp.int32)
    if tindex is not None and not isinstance(tindex, want):
        if c.dkv_mode != "auto":
            raise ValueError(f"sparse_mla: dkv_mode={dkv_mode!r} takes a {want.__name__}, got {type(tindex).__name__}")
        tindex = None
    if tindex is None:
        tindex = _indexed_index(idx, kv.shape[1], dkv_mode, dk=dk, dtype=kv.dtype, c=c)
    return _op(*settings)(q, kv, idx, tindex)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: SparseMLAGpuConfig = SparseMLAGpuConfig(),
                     interpret: bool = False):
    """The forward kernel reading a paged store: each block's logical rows are translated to
    (page, offset) through the page table inside the kernel and gathered by pointer; no
    copy of the rows is made. Contract of `pallas_kernels.paged_sparse_mla`.

    q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], slot int32
    scalar, indices int32 [B, S, K] (-1 or >= n * P = skip) -> (out [B, S, H, v_dim] in
    q.dtype, lse f32 [B, S, H]). Forward only. Programs: one per (query, K split, head group)
    (`default_head_group`, `default_splits`); the backward knobs of the config are unused.
    kv_pages may be an `fp8.Fp8Latent` (dequantized in registers; v_dim must be its values' width)."""
    c = config
    batch, seq_len, heads = q.shape[:3]
    group = int(c.head_group or default_head_group(batch * seq_len, heads))
    groups = max(1, head_rows(heads) // group)
    dtype = gpu_fp8.check(kv_pages, v_dim) if fp8.is_fp8(kv_pages) else kv_pages.dtype
    bk, splits = _block_and_splits(c, dtype, indices.shape[-1], batch * seq_len * groups)
    idx = pad_slots(indices, bk * splits)
    slot = jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))
    return _forward(q, kv_pages, idx.reshape(batch * seq_len, -1), sm_scale=float(sm_scale), v_dim=int(v_dim),
                    block_k=bk, splits=splits, num_warps=c.num_warps, num_stages=c.num_stages,
                    interpret=bool(interpret), head_group=group, paged=(page_table, slot))
