"""The forward of the dense warm-up's group indexer KL on NVIDIA GPUs: one Pallas kernel
(Triton lowering) for the tiles of `glm_jax.layers.dense_kl`'s passes 1 and 2.

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

`backward` is the gradient pass (pass 3) as one kernel over the same programs: per key block
tbar again from the saved lse, the indexer's softmax from LSE_s, ds = (softmax - tbar) g, and
from it the queries' and head weights' gradients (accumulated in registers over the key blocks)
and each key block's keys gradient from this query block, written to its own slot of a
[S / block, B, S, Di] float32 buffer that is summed over query blocks after the kernel: no two
programs write one address, so the result is the same every run.
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
from pallas_kernels.attention.gpu_backward import pow2_chunks


@dataclasses.dataclass(frozen=True)
class DenseKLGpuConfig:
    """block: queries and keys per tile (a power of two >= 16); num_warps, num_stages: Triton's."""

    block: int = 64
    num_warps: int = 4
    num_stages: int = 1
    backward_warps: int = 8

    def __post_init__(self):
        check_positive_fields(self)
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"DenseKLGpuConfig.block must be a power of two >= 16, got {self.block}")





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


def _backward_kernel(*refs, layers, heads, index_heads, kchunks, ichunks, sm_scale, shares, block):
    """refs: L queries [B, Sp, H, Dk], L latent rows [B, Sp, Dk], indexer queries [B, Sp, Hi, Di],
    keys [B, Sp, Di], weights float32 [B, Sp, Hi], kv_len int32 [B], kv_start int32 [B, Sp],
    lse float32 [L, B, Sp, H], LSE_s float32 [B, Sp], g float32 [B, Sp]
    -> dq float32 [B, Sp, Hi, Di], dw float32 [B, Sp, Hi], dk partial float32 [n, B, Sp, Di]."""
    q_refs, lat_refs = refs[:layers], refs[layers:2 * layers]
    (iq_ref, ik_ref, iw_ref, kv_len_ref, kv_start_ref, lse_ref, lse_s_ref, g_ref,
     dq_ref, dw_ref, dk_ref) = refs[2 * layers:]
    b, i = pl.program_id(0), pl.program_id(1)
    n = pl.num_programs(1)
    s0, visible, lo, hi = _tile_setup(kv_len_ref, kv_start_ref, b, i, block)
    lse = [_finite(lse_ref[j, b, pl.ds(s0, block), h]) for j in range(layers) for h in range(heads)]
    lse_s = _finite(lse_s_ref[b, pl.ds(s0, block)])
    g = g_ref[b, pl.ds(s0, block)]
    w = [iw_ref[b, pl.ds(s0, block), h] for h in range(index_heads)]
    di = sum(cs for _, cs in ichunks)

    def index_logits(h, t0):
        return _chunked_dot_nt(lambda c0, cs: iq_ref[b, pl.ds(s0, block), h, pl.ds(c0, cs)],
                               lambda c0, cs: ik_ref[b, pl.ds(t0, block), pl.ds(c0, cs)], ichunks)

    def body(kb, carry):
        dqs, dws = carry
        t0 = kb * block
        vis = visible(kb)
        tbar = jnp.zeros((block, block), jnp.float32)
        for j in range(layers):
            t = jnp.zeros((block, block), jnp.float32)
            for h in range(heads):
                logits = _chunked_dot_nt(lambda c0, cs: q_refs[j][b, pl.ds(s0, block), h, pl.ds(c0, cs)],
                                         lambda c0, cs: lat_refs[j][b, pl.ds(t0, block), pl.ds(c0, cs)], kchunks)
                t += jnp.exp(logits * sm_scale - lse[j * heads + h][:, None])
            tbar += (shares[j] / heads) * jnp.where(vis, t, 0.0)
        s = jnp.zeros((block, block), jnp.float32)
        for h in range(index_heads):
            s += w[h][:, None] * jnp.maximum(index_logits(h, t0), 0.0)
        softmax = jnp.where(vis, jnp.exp(s - lse_s[:, None]), 0.0)
        ds = (softmax - tbar) * g[:, None]                                     # [block(q), block(k)]
        keys = ik_ref[b, pl.ds(t0, block), :]
        dk = jnp.zeros((block, di), jnp.float32)
        new_dqs, new_dws = [], []
        for h in range(index_heads):
            a = index_logits(h, t0)
            new_dws.append(dws[h] + jnp.sum(ds * jnp.maximum(a, 0.0), axis=1))
            da = jnp.where(a > 0, ds * w[h][:, None], 0.0).astype(keys.dtype)
            new_dqs.append(dqs[h] + dot(da, keys))
            dk += dot_tn(da, iq_ref[b, pl.ds(s0, block), h, :])
        dk_ref[i, b, pl.ds(t0, block), :] = dk
        return tuple(new_dqs), tuple(new_dws)

    init = (tuple(jnp.zeros((block, di), jnp.float32) for _ in range(index_heads)),
            tuple(jnp.zeros((block,), jnp.float32) for _ in range(index_heads)))
    dqs, dws = lax.fori_loop(lo, hi, body, init)
    for h in range(index_heads):
        dq_ref[b, pl.ds(s0, block), h, :] = dqs[h]
        dw_ref[b, pl.ds(s0, block), h] = dws[h]

    def zero(kb, carry):             # key blocks this query block does not reach
        dk_ref[i, b, pl.ds(kb * block, block), :] = jnp.zeros((block, di), jnp.float32)
        return carry                 # a carried value: a constant one does not lower on jax 0.11's Triton

    lax.fori_loop(0, lo, zero, jnp.int32(0))
    lax.fori_loop(hi, n, zero, jnp.int32(0))


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
    kv_start = pad_axis(kv_start.astype(jnp.int32), 1, sp)
    statics = dict(layers=len(qs), heads=qs[0].shape[2], index_heads=idx_q.shape[2],
                   kchunks=tuple(pow2_chunks(0, dkp)), ichunks=tuple(pow2_chunks(0, dip)), block=block)
    return (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics


def forward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, *, sm_scale: float, shares: tuple,
            config: DenseKLGpuConfig = DenseKLGpuConfig(), interpret: bool = False):
    """qs: L x [B, S, H, Dk] absorbed queries, latents: L x [B, S, Dk], idx_q [B, S, Hi, Di],
    idx_keys [B, S, Di], idx_w float32 [B, S, Hi], kv_len int32 [B] (<= S), kv_start int32
    [B, S] -> (row losses float32 [B, S], lse float32 [L, B, S, H], LSE_s float32 [B, S]), the
    quantities of `glm_jax.layers.dense_kl`'s passes 1 and 2."""
    batch, seq_len, heads = qs[0].shape[:3]
    (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics = _prepare(
        qs, latents, idx_q, idx_keys, idx_w, kv_start, config.block)
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), shares=tuple(float(s) for s in shares), **statics)
    vec = jax.ShapeDtypeStruct((batch, sp), jnp.float32)
    rows, lse, lse_s = pl.pallas_call(
        kernel, grid=(batch, sp // config.block),
        out_shape=[vec, jax.ShapeDtypeStruct((len(qs), batch, sp, heads), jnp.float32), vec],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="dense_kl_fwd",
    )(*qs, *latents, idx_q, idx_keys, idx_w, kv_len.astype(jnp.int32), kv_start)
    return rows[:, :seq_len], lse[:, :, :seq_len], lse_s[:, :seq_len]


def backward_bytes(batch: int, seq_len: int, index_dim: int, config: DenseKLGpuConfig = DenseKLGpuConfig()) -> int:
    """Bytes of the backward's per-query-block keys-gradient buffer [S / block, B, S, Di] float32."""
    sp = -(-seq_len // config.block) * config.block
    return (sp // config.block) * batch * sp * _width(index_dim) * 4


def backward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s, g, *, sm_scale: float,
             shares: tuple, config: DenseKLGpuConfig = DenseKLGpuConfig(), interpret: bool = False):
    """The gradients of sum(g * row losses) (`forward`'s operands; lse float32 [L, B, S, H] and
    LSE_s float32 [B, S] from `forward`, g float32 [B, S]) -> float32 (dq [B, S, Hi, Di],
    dk [B, S, Di], dw [B, S, Hi]) into the indexer's queries, keys and head weights."""
    batch, seq_len = idx_q.shape[:2]
    index_heads, di = idx_q.shape[2:]
    (qs, latents, idx_q, idx_keys, idx_w, kv_start), sp, statics = _prepare(
        qs, latents, idx_q, idx_keys, idx_w, kv_start, config.block)
    dip = idx_q.shape[3]
    lse = pad_axis(lse.astype(jnp.float32), 2, sp)
    lse_s, g = pad_axis(lse_s.astype(jnp.float32), 1, sp), pad_axis(g.astype(jnp.float32), 1, sp)
    n = sp // config.block
    kernel = functools.partial(_backward_kernel, sm_scale=float(sm_scale), shares=tuple(float(s) for s in shares),
                               **statics)
    dq, dw, dk_part = pl.pallas_call(
        kernel, grid=(batch, n),
        out_shape=[jax.ShapeDtypeStruct((batch, sp, index_heads, dip), jnp.float32),
                   jax.ShapeDtypeStruct((batch, sp, index_heads), jnp.float32),
                   jax.ShapeDtypeStruct((n, batch, sp, dip), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.backward_warps, num_stages=config.num_stages),
        interpret=interpret, name="dense_kl_bwd",
    )(*qs, *latents, idx_q, idx_keys, idx_w, kv_len.astype(jnp.int32), kv_start, lse, lse_s, g)
    dk = jnp.sum(dk_part, axis=0)
    return dq[:, :seq_len, :, :di], dk[:, :seq_len, :di], dw[:, :seq_len]
