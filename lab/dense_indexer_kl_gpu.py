"""The dense warm-up's group indexer KL (`pallas_kernels.dense_indexer_kl`) on NVIDIA GPUs as
Pallas kernels (Triton lowering): one for the tiles of the XLA form's passes 1 and 2
(`pallas_kernels/dense_indexer_kl/xla.py`), two for pass 3; `lab.dense_indexer_kl_gpu_vjp`
makes them a differentiable op.

Status: correct (tests/test_dense_kl.py, interpret mode, against the expanded form and the op's
contract), outside the registry: on an H100 its forward is 1.4-1.6x faster than the XLA form's
but forward + backward 1.7-1.8x slower (one IndexShare group of the default model at 32K and
128K tokens; 196 ms against 83 ms for the default recipe's 16 x 4,096 tokens), and the train
step needs both (docs/training.md). `benchmarks/dense_kl_long.py`, `train_long.py --dense-kl
pallas_gpu` and `train_step_parts.py --dense-kl pallas_gpu` measure it.

One program per (batch row b, block of `block` queries) runs both passes over its key blocks
(those before the diagonal, from the block's first document start, below kv_len):
  1. for every layer j and head h an online lse_jh [block] of the attention logits
     sm_scale * q_jh . c_t (each head's [block, Dk] x [Dk, block] matmul, Dk cut into
     power-of-two column chunks for Triton);
  2. per key block the layers' head-mean probabilities t_j = mean_h exp(logits - lse_jh), their
     neg-entropy, tbar = sum_j share_j t_j, the indexer scores s = sum_h w_h relu(q'_h . k_t)
     once, sum_t tbar s and an online LSE_s.
The queries and latent rows are re-read per key block (from L2: a program's working set is a
few of them); only the per-(layer, head) lse and running sums live in registers. Writes the
row losses, lse [L, B, S, H] and LSE_s [B, S].

`backward` is the gradient pass (pass 3) as two kernels: per tile tbar again from the saved lse,
the indexer's softmax from LSE_s and ds = (softmax - tbar) g; one program per query block
accumulates the queries' and head weights' gradients over its key blocks, one program per key
block the keys' gradient over the query blocks that see it, each in registers. No two programs
write one address, so the result is the same every run, and nothing grows with S^2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_positive_fields, dot, dot_nt, dot_tn, pad_axis
from pallas_kernels.sparse_mla.gpu_tiles import pow2_chunks


@dataclasses.dataclass(frozen=True)
class DenseIndexerKLGpuConfig:
    """block: queries and keys per tile (a power of two >= 16); num_warps, num_stages: Triton's."""

    block: int = 64
    num_warps: int = 4
    num_stages: int = 1
    backward_warps: int = 8

    def __post_init__(self):
        check_positive_fields(self)
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"DenseIndexerKLGpuConfig.block must be a power of two >= 16, got {self.block}")





def _finite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _kernel(*refs, layers, heads, index_heads, kchunks, ichunks, sm_scale, shares, block):
    """refs: L queries [B, Sp, H, Dk], L latent rows [B, Sp, Dk], indexer queries [B, Sp, Hi, Di],
    keys [B, Sp, Di], weights float32 [B, Sp, Hi], kv_len int32 [B], kv_start int32 [B, Sp]
    -> row losses float32 [B, Sp], lse float32 [L, B, Sp, H], LSE_s float32 [B, Sp]."""
    q_refs, lat_refs = refs[:layers], refs[layers:2 * layers]
    iq_ref, ik_ref, iw_ref, kv_len_ref, kv_start_ref, rows_ref, lse_ref, lse_s_ref = refs[2 * layers:]
    b, i = pl.program_id(0), pl.program_id(1)
    s0, visible, lo, hi = _tile_setup(kv_len_ref, kv_start_ref, b, i, block)

    def logits(j, h, kb):
        t0 = kb * block
        rows = _reread(s0, kb)
        return _chunked_dot_nt(lambda c0, cs: q_refs[j][b, pl.ds(rows, block), h, pl.ds(c0, cs)],
                               lambda c0, cs: lat_refs[j][b, pl.ds(t0, block), pl.ds(c0, cs)],
                               kchunks) * sm_scale                           # [block, block]

    pairs = [(j, h) for j in range(layers) for h in range(heads)]

    def lse_body(kb, carry):
        vis = visible(kb)
        out = []
        for (j, h), (m, l) in zip(pairs, carry):
            x = jnp.where(vis, logits(j, h, kb), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(x, axis=1))
            safe = _finite(m_new)
            out.append((m_new, l * jnp.exp(m - safe) + jnp.sum(jnp.exp(x - safe[:, None]), axis=1)))
        return tuple(out)

    init = tuple((jnp.full((block,), -jnp.inf, jnp.float32), jnp.zeros((block,), jnp.float32)) for _ in pairs)
    state = lax.fori_loop(lo, hi, lse_body, init)
    lse = []
    for (j, h), (m, l) in zip(pairs, state):
        value = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        lse_ref[j, b, pl.ds(s0, block), h] = value
        lse.append(_finite(value))

    w = [iw_ref[b, pl.ds(s0, block), h] for h in range(index_heads)]

    def loss_body(kb, carry):
        neg_entropy, cross, m, l = carry
        vis = visible(kb)
        tbar = jnp.zeros((block, block), jnp.float32)
        for j in range(layers):
            t = jnp.zeros((block, block), jnp.float32)
            for h in range(heads):
                t += jnp.exp(logits(j, h, kb) - lse[j * heads + h][:, None])
            t = jnp.where(vis, t * (1.0 / heads), 0.0)
            neg_entropy += shares[j] * jnp.sum(jnp.where(t > 0, t * jnp.log(jnp.where(t > 0, t, 1.0)), 0.0), axis=1)
            tbar += shares[j] * t
        t0 = kb * block
        s = jnp.zeros((block, block), jnp.float32)
        for h in range(index_heads):
            a = _chunked_dot_nt(lambda c0, cs: iq_ref[b, pl.ds(_reread(s0, kb), block), h, pl.ds(c0, cs)],
                                lambda c0, cs: ik_ref[b, pl.ds(t0, block), pl.ds(c0, cs)], ichunks)
            s += w[h][:, None] * jnp.maximum(a, 0.0)
        cross += jnp.sum(jnp.where(vis, tbar * s, 0.0), axis=1)
        x = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        safe = _finite(m_new)
        l = l * jnp.exp(m - safe) + jnp.sum(jnp.exp(x - safe[:, None]), axis=1)
        return neg_entropy, cross, m_new, l

    zeros = jnp.zeros((block,), jnp.float32)
    neg_entropy, cross, m, l = lax.fori_loop(lo, hi, loss_body,
                                             (zeros, zeros, jnp.full((block,), -jnp.inf, jnp.float32), zeros))
    lse_s = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    lse_s_ref[b, pl.ds(s0, block)] = lse_s
    rows_ref[b, pl.ds(s0, block)] = neg_entropy - cross + _finite(lse_s)


def _reread(s0, kb):
    """The query block's first row s0, written to depend on the key block kb (kb is never
    negative, so it is s0): Triton would otherwise hoist the loop-invariant query loads out of
    the key-block loop and keep every (layer, head) query tile in shared memory at once (724 KiB
    at tiles of 64 over 4 layers of 8 heads of 160 columns, against Hopper's 227 KiB); re-read
    per key block, they come from L2."""
    return s0 + jnp.minimum(kb, 0)


def _tile_setup(kv_len_ref, kv_start_ref, b, i, block):
    """(first query row, visible(kb) -> bool [block, block], the key blocks [lo, hi) to visit)
    of program (b, i)."""
    s0 = i * block
    rows = s0 + lax.broadcasted_iota(jnp.int32, (block, block), 0)
    start = kv_start_ref[b, pl.ds(s0, block)]
    kv_len = kv_len_ref[b]
    lo = jnp.min(start) // block
    hi = jnp.maximum(jnp.minimum(i + 1, (kv_len + block - 1) // block), lo)

    def visible(kb):
        cols = kb * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
        return (cols <= rows) & (cols < kv_len) & (cols >= start[:, None])

    return s0, visible, lo, hi


def _chunked_dot_nt(a_ref_rows, b_ref_rows, chunks):
    """sum over column chunks of a(c0, cs) . b(c0, cs)^T; a_ref_rows(c0, cs) -> [m, cs]."""
    out = None
    for c0, cs in chunks:
        part = dot_nt(a_ref_rows(c0, cs), b_ref_rows(c0, cs))
        out = part if out is None else out + part
    return out


def _target(logits_of, lse_of, vis, *, layers, heads, shares):
    """tbar over one tile: sum_j share_j / H sum_h exp(logits_of(j, h) - lse_of(j, h)), 0 where
    not visible (vis); logits_of(j, h) -> float32 tile, lse_of(j, h) broadcast to it."""
    tbar = None
    for j in range(layers):
        t = None
        for h in range(heads):
            p = jnp.exp(logits_of(j, h) - lse_of(j, h))
            t = p if t is None else t + p
        tbar = (shares[j] / heads) * t if tbar is None else tbar + (shares[j] / heads) * t
    return jnp.where(vis, tbar, 0.0)


def _tile_terms(*, tbar, a_of, w, lse_s, g, vis):
    """The gradient terms of one tile (either orientation: `rows` the queries or the keys):
    ds = (softmax(s) - tbar) g with s = sum_h w_h relu(a_h), and da_h = [a_h > 0] ds w_h.
    tbar float32 tile, a_of(h) -> the indexer's per-head dots (float32 tile), w: per-head
    weights, lse_s and g broadcast to the tile -> (ds, a_of, w) for `_head_gradients`."""
    s = None
    for h, w_h in enumerate(w):
        part = w_h * jnp.maximum(a_of(h), 0.0)
        s = part if s is None else s + part
    softmax = jnp.where(vis, jnp.exp(s - lse_s), 0.0)
    return (softmax - tbar) * g


def _query_gradients_kernel(*refs, layers, heads, index_heads, kchunks, ichunks, sm_scale, shares, block):
    """refs: L queries [B, Sp, H, Dk], L latent rows [B, Sp, Dk], indexer queries [B, Sp, Hi, Di],
    keys [B, Sp, Di], weights float32 [B, Sp, Hi], kv_len int32 [B], kv_start int32 [B, Sp],
    lse float32 [L, B, Sp, H], LSE_s float32 [B, Sp], g float32 [B, Sp]
    -> dq float32 [B, Sp, Hi, Di], dw float32 [B, Sp, Hi]: program (b, i) owns query block i and
    accumulates over its key blocks in registers."""
    q_refs, lat_refs = refs[:layers], refs[layers:2 * layers]
    iq_ref, ik_ref, iw_ref, kv_len_ref, kv_start_ref, lse_ref, lse_s_ref, g_ref, dq_ref, dw_ref = refs[2 * layers:]
    b, i = pl.program_id(0), pl.program_id(1)
    s0, visible, lo, hi = _tile_setup(kv_len_ref, kv_start_ref, b, i, block)
    lse = [_finite(lse_ref[j, b, pl.ds(s0, block), h]) for j in range(layers) for h in range(heads)]
    lse_s = _finite(lse_s_ref[b, pl.ds(s0, block)])
    g = g_ref[b, pl.ds(s0, block)]
    w = [iw_ref[b, pl.ds(s0, block), h][:, None] for h in range(index_heads)]
    di = sum(cs for _, cs in ichunks)

    def body(kb, carry):
        dqs, dws = carry
        t0 = kb * block
        rows = _reread(s0, kb)
        vis = visible(kb)
        logits = lambda j, h: sm_scale * _chunked_dot_nt(
            lambda c0, cs: q_refs[j][b, pl.ds(rows, block), h, pl.ds(c0, cs)],
            lambda c0, cs: lat_refs[j][b, pl.ds(t0, block), pl.ds(c0, cs)], kchunks)
        tbar = _target(logits, lambda j, h: lse[j * heads + h][:, None], vis, layers=layers, heads=heads,
                       shares=shares)

        def a_of(h):
            return _chunked_dot_nt(lambda c0, cs: iq_ref[b, pl.ds(rows, block), h, pl.ds(c0, cs)],
                                   lambda c0, cs: ik_ref[b, pl.ds(t0, block), pl.ds(c0, cs)], ichunks)

        ds = _tile_terms(tbar=tbar, a_of=a_of, w=w, lse_s=lse_s[:, None], g=g[:, None], vis=vis)
        keys = ik_ref[b, pl.ds(t0, block), :]
        new_dqs, new_dws = [], []
        for h in range(index_heads):
            a = a_of(h)
            new_dws.append(dws[h] + jnp.sum(ds * jnp.maximum(a, 0.0), axis=1))
            da = jnp.where(a > 0, ds * w[h], 0.0).astype(keys.dtype)
            new_dqs.append(dqs[h] + dot(da, keys))
        return tuple(new_dqs), tuple(new_dws)

    init = (tuple(jnp.zeros((block, di), jnp.float32) for _ in range(index_heads)),
            tuple(jnp.zeros((block,), jnp.float32) for _ in range(index_heads)))
    dqs, dws = lax.fori_loop(lo, hi, body, init)
    for h in range(index_heads):
        dq_ref[b, pl.ds(s0, block), h, :] = dqs[h]
        dw_ref[b, pl.ds(s0, block), h] = dws[h]


def _key_gradients_kernel(*refs, layers, heads, index_heads, kchunks, ichunks, sm_scale, shares, block):
    """refs: as `_query_gradients_kernel`'s inputs, then the end of each key block's query
    blocks int32 [B, n] -> dk float32 [B, Sp, Di]: program (b, kb) owns key block kb and
    accumulates over the query blocks that see it, in registers; tiles are [keys, queries]."""
    q_refs, lat_refs = refs[:layers], refs[layers:2 * layers]
    (iq_ref, ik_ref, iw_ref, kv_len_ref, kv_start_ref, lse_ref, lse_s_ref, g_ref, q_end_ref,
     dk_ref) = refs[2 * layers:]
    b, kb = pl.program_id(0), pl.program_id(1)
    t0 = kb * block
    cols_of_keys = t0 + lax.broadcasted_iota(jnp.int32, (block, block), 0)       # key of each tile row
    kv_len = kv_len_ref[b]
    di = sum(cs for _, cs in ichunks)
    first = jnp.where(t0 < kv_len, kb, pl.num_programs(1))      # nothing sees a key block past kv_len
    last = jnp.maximum(q_end_ref[b, kb], first)

    def body(i, dk):
        s0 = i * block
        keys0 = t0 + jnp.minimum(i, 0)                          # re-read per query block (see _reread)
        queries = s0 + lax.broadcasted_iota(jnp.int32, (block, block), 1)
        start = kv_start_ref[b, pl.ds(s0, block)]
        vis = (cols_of_keys <= queries) & (cols_of_keys < kv_len) & (cols_of_keys >= start[None, :])
        lse = [_finite(lse_ref[j, b, pl.ds(s0, block), h]) for j in range(layers) for h in range(heads)]
        w = [iw_ref[b, pl.ds(s0, block), h][None, :] for h in range(index_heads)]
        logits = lambda j, h: sm_scale * _chunked_dot_nt(
            lambda c0, cs: lat_refs[j][b, pl.ds(keys0, block), pl.ds(c0, cs)],
            lambda c0, cs: q_refs[j][b, pl.ds(s0, block), h, pl.ds(c0, cs)], kchunks)
        tbar = _target(logits, lambda j, h: lse[j * heads + h][None, :], vis, layers=layers, heads=heads,
                       shares=shares)

        def a_of(h):
            return _chunked_dot_nt(lambda c0, cs: ik_ref[b, pl.ds(keys0, block), pl.ds(c0, cs)],
                                   lambda c0, cs: iq_ref[b, pl.ds(s0, block), h, pl.ds(c0, cs)], ichunks)

        ds = _tile_terms(tbar=tbar, a_of=a_of, w=w, lse_s=_finite(lse_s_ref[b, pl.ds(s0, block)])[None, :],
                         g=g_ref[b, pl.ds(s0, block)][None, :], vis=vis)
        for h in range(index_heads):
            da = jnp.where(a_of(h) > 0, ds * w[h], 0.0).astype(iq_ref.dtype)           # [keys, queries]
            dk = dk + dot(da, iq_ref[b, pl.ds(s0, block), h, :])
        return dk

    dk = lax.fori_loop(first, last, body, jnp.zeros((block, di), jnp.float32))
    dk_ref[b, pl.ds(t0, block), :] = dk


def _width(n: int) -> int:
    """A feature width Triton's dots take in power-of-two chunks: a multiple of 16."""
    return -(-n // 16) * 16


def _prepare(qs, latents, idx_q, idx_keys, idx_w, kv_start, block: int):
    """The operands padded for the kernels: rows to a multiple of block, feature widths to a
    multiple of 16 (zeros change no dot)."""
    seq_len, dk = qs[0].shape[1], qs[0].shape[3]
    sp = -(-seq_len // block) * block
    dkp, dip = _width(dk), _width(idx_q.shape[3])
    qs = [pad_axis(pad_axis(q, 3, dkp), 1, sp) for q in qs]
    latents = [pad_axis(pad_axis(c.astype(q.dtype), 2, dkp), 1, sp) for c, q in zip(latents, qs)]
    idx_q = pad_axis(pad_axis(idx_q, 3, dip), 1, sp)
    idx_keys = pad_axis(pad_axis(idx_keys.astype(idx_q.dtype), 2, dip), 1, sp)
    idx_w = pad_axis(idx_w.astype(jnp.float32), 1, sp)
    kv_start = pad_axis(kv_start.astype(jnp.int32), 1, sp, value=sp)    # padded rows see no key
    statics = dict(layers=len(qs), heads=qs[0].shape[2], index_heads=idx_q.shape[2],
                   kchunks=tuple(pow2_chunks(0, dkp)), ichunks=tuple(pow2_chunks(0, dip)), block=block)
    return (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics


def forward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, *, sm_scale: float, shares: tuple,
            config: DenseIndexerKLGpuConfig = DenseIndexerKLGpuConfig(), interpret: bool = False):
    """qs: L x [B, S, H, Dk] absorbed queries, latents: L x [B, S, Dk], idx_q [B, S, Hi, Di],
    idx_keys [B, S, Di], idx_w float32 [B, S, Hi], kv_len int32 [B] (<= S), kv_start int32
    [B, S] -> (row losses float32 [B, S], lse float32 [L, B, S, H], LSE_s float32 [B, S]), the
    quantities of the XLA form's passes 1 and 2."""
    batch, seq_len, heads = qs[0].shape[:3]
    (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics = _prepare(
        qs, latents, idx_q, idx_keys, idx_w, kv_start, config.block)
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), shares=tuple(float(s) for s in shares), **statics)
    vec = jax.ShapeDtypeStruct((batch, sp), jnp.float32)
    rows, lse, lse_s = pl.pallas_call(
        kernel, grid=(batch, sp // config.block),
        out_shape=[vec, jax.ShapeDtypeStruct((len(qs), batch, sp, heads), jnp.float32), vec],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="dense_indexer_kl_fwd",
    )(*qs, *latents, idx_q, idx_keys, idx_w, kv_len.astype(jnp.int32), kv_start)
    return rows[:, :seq_len], lse[:, :, :seq_len], lse_s[:, :seq_len]


def _query_block_ends(kv_start, block: int) -> jax.Array:
    """kv_start int32 [B, Sp] -> int32 [B, n]: for each key block, one past the last query block
    that visits it (query block i visits the key blocks from min(kv_start of i) // block; taken
    as a suffix minimum, so that a row's documents need not be sorted)."""
    batch, sp = kv_start.shape
    first_key_block = jnp.min(kv_start.reshape(batch, sp // block, block), axis=2) // block
    suffix_min = lax.cummin(first_key_block, axis=1, reverse=True)
    key_blocks = jnp.arange(sp // block, dtype=jnp.int32)
    return jax.vmap(lambda m: jnp.searchsorted(m, key_blocks, side="right"))(suffix_min).astype(jnp.int32)


def backward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s, g, *, sm_scale: float,
             shares: tuple, config: DenseIndexerKLGpuConfig = DenseIndexerKLGpuConfig(), interpret: bool = False):
    """The gradients of sum(g * row losses) (`forward`'s operands; lse float32 [L, B, S, H] and
    LSE_s float32 [B, S] from `forward`, g float32 [B, S]) -> float32 (dq [B, S, Hi, Di],
    dk [B, S, Di], dw [B, S, Hi]) into the indexer's queries, keys and head weights.

    Two kernels over the causal tiles, each recomputing the tile's target and scores: one
    program per query block accumulates dq and dw, one per key block dk, each in registers. No
    two programs write one address and no buffer grows with S^2: the result is the same every
    run at any length."""
    batch, seq_len = idx_q.shape[:2]
    index_heads, di = idx_q.shape[2:]
    (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics = _prepare(
        qs, latents, idx_q, idx_keys, idx_w, kv_start, config.block)
    dip = idx_q.shape[3]
    lse = pad_axis(lse.astype(jnp.float32), 2, sp)
    lse_s, g = pad_axis(lse_s.astype(jnp.float32), 1, sp), pad_axis(g.astype(jnp.float32), 1, sp)
    operands = (*qs, *latents, idx_q, idx_keys, idx_w, kv_len.astype(jnp.int32), kv_start, lse, lse_s, g)
    statics = dict(statics, sm_scale=float(sm_scale), shares=tuple(float(s) for s in shares))
    params = plgpu.CompilerParams(num_warps=config.backward_warps, num_stages=config.num_stages)
    grid = (batch, sp // config.block)
    dq, dw = pl.pallas_call(
        functools.partial(_query_gradients_kernel, **statics), grid=grid,
        out_shape=[jax.ShapeDtypeStruct((batch, sp, index_heads, dip), jnp.float32),
                   jax.ShapeDtypeStruct((batch, sp, index_heads), jnp.float32)],
        compiler_params=params, interpret=interpret, name="dense_indexer_kl_bwd_queries",
    )(*operands)
    dk = pl.pallas_call(
        functools.partial(_key_gradients_kernel, **statics), grid=grid,
        out_shape=jax.ShapeDtypeStruct((batch, sp, dip), jnp.float32),
        compiler_params=params, interpret=interpret, name="dense_indexer_kl_bwd_keys",
    )(*operands, _query_block_ends(kv_start, config.block))
    return dq[:, :seq_len, :, :di], dk[:, :seq_len, :di], dw[:, :seq_len]
