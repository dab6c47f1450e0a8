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
from pallas_kernels.attention.gpu_backward import next_pow2, pow2_chunks

#: Largest query-by-head tile of one program (its f32 accumulator [64, 512] and q [64, 576]
#: bf16 are what the per-query kernel holds at 64 heads).
MAX_TILE_ROWS = 64
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
    first = valid & jnp.concatenate([jnp.ones((n, 1), bool), row[:, 1:] != row[:, :-1]], axis=1)
    place = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1                    # the run's union slot
    units = -(-width // 64) * 64
    block = lax.broadcasted_iota(jnp.int32, (n, width), 0)
    out_rows = jnp.full((n, units), -1, jnp.int32).at[block, jnp.where(first, place, units)].set(
        row, mode="drop")
    new_pair = valid & jnp.concatenate([jnp.ones((n, 1), bool), keys[:, 1:] != keys[:, :-1]], axis=1)
    bits = jnp.zeros((n, units), jnp.int32).at[block, jnp.where(new_pair, place, units)].add(
        jnp.left_shift(jnp.int32(1), query), mode="drop")               # distinct bits: add = or
    return SharedRows(rows=out_rows, bits=bits, count=jnp.sum(first, axis=1, dtype=jnp.int32),
                      block_q=block_q, seq_len=seq_len, num_keys=num_keys)


def default_block_q(heads: int) -> int:
    """Queries per program: as many as fill a MAX_TILE_ROWS tile of (query, head slot) rows."""
    return max(1, MAX_TILE_ROWS // next_pow2(heads))


def _tile_index(block_q: int, slots: int):
    """The tile's rows m = i * slots + h -> (query i of the block, head h), int32 [M] each."""
    m = lax.broadcasted_iota(jnp.int32, (block_q * slots,), 0)
    return m // slots, m % slots


def _fwd_kernel(q_ref, kv_ref, rows_ref, bits_ref, count_ref, out_ref, lse_ref, *, seq_len, blocks_per_seq,
                block_q, slots, heads, sm_scale, block_k, kchunks, vchunks):
    """One block of block_q queries: q [B*S, H, Dk], kv [B, T, Dk], rows / bits [N, U], count
    [N] -> out [B*S, H, v], lse [B*S, H] of the block's real (query, head) pairs."""
    n = pl.program_id(0)
    b = n // blocks_per_seq
    s0 = (n % blocks_per_seq) * block_q
    qi, h = _tile_index(block_q, slots)
    real = (h < heads) & (s0 + qi < seq_len)                                 # [M]
    # the tile's rows past the sequence or the heads point out of bounds, masked
    q_row = jnp.where(s0 + qi < seq_len, b * seq_len + s0 + qi, q_ref.shape[0])

    def tile_at(cols):
        c0, cs = cols
        c = c0 + lax.broadcasted_iota(jnp.int32, (block_q * slots, cs), 1)
        return q_row[:, None], h[:, None], c, real[:, None]

    qs = []
    for cols in kchunks:
        r, hh, c, mask = tile_at(cols)
        qs.append(plgpu.load(q_ref.at[r, hh, c], mask=mask, other=0.0))     # [M, cs]
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
        chosen = (jnp.right_shift(sel_bits[None, :], qi[:, None]) & 1) != 0   # [M, bk]
        return online_softmax_step(carry, jnp.where(chosen & valid[None, :], s * sm_scale, -jnp.inf), rows[:nv])

    tile = block_q * slots
    init = (jnp.full((tile,), -jnp.inf, jnp.float32), jnp.zeros((tile,), jnp.float32),
            tuple(jnp.zeros((tile, cs), jnp.float32) for _, cs in vchunks))
    steps = (count_ref[n] + block_k - 1) // block_k
    m, l, accs = lax.fori_loop(0, steps, body, init)
    has_any = l > 0
    safe_l = jnp.where(has_any, l, 1.0)
    for (c0, cs), a in zip(vchunks, accs):
        r, hh, c, mask = tile_at((c0, cs))
        plgpu.store(out_ref.at[r, hh, c], (a / safe_l[:, None]).astype(out_ref.dtype), mask=mask)
    lse = jnp.where(has_any, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l), -jnp.inf)
    plgpu.store(lse_ref.at[q_row, h], lse, mask=real)


def forward(q: jax.Array, kv: jax.Array, shared: SharedRows, *, sm_scale: float, v_dim: int,
            block_k: int = DEFAULT_BLOCK_K, num_warps: int = 4, num_stages: int = 2,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """q [B, S, H, Dk], kv [B, T, Dk], shared: `shared_rows` of the indices for these queries
    -> (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]), as `gpu.sparse_mla`'s forward.
    The program's tile is block_q x next_pow2(H) rows (<= MAX_TILE_ROWS)."""
    batch, seq_len, heads, dk = q.shape
    if (shared.seq_len, shared.num_keys) != (seq_len, kv.shape[1]):
        raise ValueError(f"gpu_shared.forward: shared rows built for S={shared.seq_len}, T={shared.num_keys}; "
                         f"got S={seq_len}, T={kv.shape[1]}")
    slots = next_pow2(heads)
    tile = shared.block_q * slots
    if tile > MAX_TILE_ROWS or tile < 16:
        raise ValueError(f"gpu_shared.forward: block_q {shared.block_q} x {slots} head slots = {tile} tile rows; "
                         f"need 16 .. {MAX_TILE_ROWS}")
    if shared.rows.shape[1] % block_k:
        raise ValueError(f"gpu_shared.forward: block_k {block_k} must divide the union width {shared.rows.shape[1]}")
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
