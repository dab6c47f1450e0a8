"""The "by_key" sparse MLA backward's kernel on NVIDIA GPUs (Pallas, Triton lowering), driven by
`gpu_backward.backward_by_key` (see its module docstring): `keys_call`, one program per block
of latent rows, walking the queries that selected them in contiguous tiles (no pair gradient in
memory, no atomics)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_mla import transpose as tr
from pallas_kernels.sparse_mla.gpu_tiles import iota, kernel_params, pow2_chunks, query_slots, row_gradients


def _query_tile(ref, b, s0, *, seq_len, heads, slots, tile_queries, cols=None, other=0.0):
    """ref [B*S*H(, D)] flat (row (b*S + s)*H + h) -> the tile of queries s0 .. s0 + tq - 1 of
    sequence b as [tq * slots(, cs)] (column i = query s0 + i // slots, head i % slots); head
    slots >= H and queries >= S read `other`. Contiguous rows when slots == H and the tile
    lies inside the sequence."""
    n = tile_queries * slots
    if slots == heads and seq_len % tile_queries == 0:
        start = (b * seq_len + s0) * heads
        return ref[(pl.ds(start, n),) + (() if cols is None else (pl.ds(*cols),))]
    shape = (n,) if cols is None else (n, cols[1])
    i = iota(shape, 0)
    s, h = s0 + i // slots, i % slots
    ok = (h < heads) & (s < seq_len)
    row = (b * seq_len + s) * heads + h
    index = (row,) if cols is None else (row, cols[0] + iota(shape, 1))
    return plgpu.load(ref.at[index], mask=ok, other=other)


def _keys_block(kv_ref, q_ref, do_ref, lse_ref, delta_ref, bits_ref, spans_ref, dkv_ref, b, blk, *, sm_scale,
                seq_len, num_keys, heads, slots, tile_queries, block_rows, kchunks, vchunks):
    """Rows t0 .. t0 + block_rows - 1 (t0 = blk * block_rows) of sequence b: their dkv, summed
    over the query tiles of their span (`_keys_kernel`'s refs)."""
    blocks = -(-num_keys // block_rows)
    t0 = blk * block_rows
    t = t0 + iota((block_rows,), 0)
    n = tile_queries * slots
    if num_keys % block_rows == 0:
        rows = [kv_ref[pl.ds(b * num_keys + t0, block_rows), pl.ds(c0, cs)] for c0, cs in kchunks]
        words_at = lambda w: bits_ref[pl.ds(b * num_keys + t0, block_rows), w]
    else:
        live = t < num_keys
        krow = b * num_keys + jnp.minimum(t, num_keys - 1)
        rows = [jnp.where(live[:, None], kv_ref[krow, pl.ds(c0, cs)], 0) for c0, cs in kchunks]
        words_at = lambda w: jnp.where(live, bits_ref[krow, w], 0)
    shift0 = iota((n,), 0) // slots
    tile = functools.partial(_query_tile, b=b, seq_len=seq_len, heads=heads, slots=slots,
                             tile_queries=tile_queries)
    per_word = tr.WORD_BITS // tile_queries
    lo = spans_ref[b * blocks + blk, 0] * per_word
    hi = jnp.minimum(spans_ref[b * blocks + blk, 1] * per_word, -(-seq_len // tile_queries))

    def body(j, accs):
        s0 = j * tile_queries
        qs = [tile(q_ref, s0=s0, cols=cols) for cols in kchunks]                      # [n, cs]
        dos = [tile(do_ref, s0=s0, cols=cols) for cols in vchunks]
        lse = tile(lse_ref, s0=s0, other=jnp.inf)
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
        delta = tile(delta_ref, s0=s0)
        word = words_at(s0 // tr.WORD_BITS)                                            # [rows]
        sel = ((word[:, None] >> (s0 % tr.WORD_BITS + shift0)[None, :]) & 1) != 0          # [rows, n]
        grads = row_gradients(rows, qs, dos, lse, delta, sel, sm_scale=sm_scale)
        return tuple(acc + g for acc, g in zip(accs, grads))

    accs = lax.fori_loop(lo, hi, body, tuple(jnp.zeros((block_rows, cs), jnp.float32) for _, cs in kchunks))
    for (c0, cs), acc in zip(kchunks, accs):
        if num_keys % block_rows == 0:
            dkv_ref[pl.ds(b * num_keys + t0, block_rows), pl.ds(c0, cs)] = acc
        else:
            plgpu.store(dkv_ref.at[(b * num_keys + t)[:, None], c0 + iota((block_rows, cs), 1)], acc,
                        mask=jnp.broadcast_to((t < num_keys)[:, None], acc.shape))


def _keys_kernel(*refs, num_keys, block_rows, paired, **static):
    """One program = one block of rows of sequence b, or with `paired` blocks i and blocks - 1 - i
    (causal spans shrink with the block: a pair's work is about even).

    kv [B*T, Dk], q [B*S*H, Dk], do [B*S*H, v], lse / delta [B*S*H] (flat), bits int32 [B*T, W],
    spans int32 [B*blocks, 2] (words) -> dkv float32 [B*T, Dk] (this program's rows)."""
    blocks = -(-num_keys // block_rows)
    programs = -(-blocks // 2) if paired else blocks
    b = pl.program_id(0) // programs
    i = pl.program_id(0) % programs
    run = functools.partial(_keys_block, *refs, b, num_keys=num_keys, block_rows=block_rows, **static)
    run(i)
    if paired:
        pl.when(blocks - 1 - i != i)(lambda: run(blocks - 1 - i))


def keys_call(kv, q, do, lse, delta, kmap: tr.KeyBitmap, *, sm_scale, v_dim, col_block, tile_cols, num_warps,
              num_stages, interpret, paired=True):
    """kv [B, T, Dk], q [B, S, H, Dk], do [B, S, H, v], lse / delta float32 [B, S, H], kmap (its
    block_rows rows per block) -> dkv float32 [B, T, Dk]. paired: one program per two blocks
    (`_keys_kernel`)."""
    batch, seq_len, heads, dk = q.shape
    num_keys = kv.shape[1]
    slots = query_slots(heads)
    tile_queries = max(1, min(tr.WORD_BITS, tile_cols // slots))
    block_rows = kmap.block_rows
    blocks = -(-num_keys // block_rows)
    kernel = functools.partial(
        _keys_kernel, sm_scale=sm_scale, seq_len=seq_len, num_keys=num_keys, heads=heads, slots=slots,
        tile_queries=tile_queries, block_rows=block_rows, paired=paired,
        kchunks=pow2_chunks(0, v_dim, col_block) + pow2_chunks(v_dim, dk, col_block),
        vchunks=pow2_chunks(0, v_dim, col_block))
    flat = lambda x: x.reshape((batch * seq_len * heads,) + x.shape[3:])
    dkv = pl.pallas_call(
        kernel, grid=(batch * (-(-blocks // 2) if paired else blocks),),
        out_shape=jax.ShapeDtypeStruct((batch * num_keys, dk), jnp.float32),
        compiler_params=kernel_params(num_warps, num_stages), interpret=interpret, name="sparse_mla_bwd_keys",
    )(kv.reshape(batch * num_keys, dk), flat(q), flat(do), flat(lse), flat(delta), kmap.bits, kmap.spans)
    return dkv.reshape(batch, num_keys, dk)
