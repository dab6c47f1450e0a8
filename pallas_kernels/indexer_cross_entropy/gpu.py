"""Indexer cross-entropy over the selected set on NVIDIA GPUs: Pallas kernels (Triton lowering),
with a deterministic key gradient.

Shapes: q [B, S, H, D] indexer queries, k [B, T, D] indexer keys (cast to q's dtype), weights
float32 [B, S, H], indices int32 [B, S, K] (-1 or out of range = skip), target float32 [B, S, K]
-> ce float32 [B, S]: ce = -sum_j target[j] log q[j], q = softmax over the valid slots of
z[j] = sum_h weights[h] relu(q[h] . k[indices[j]]); custom VJP into q, k and weights (the target
is a constant: zero cotangent).

Why. The sparse-stage indexer KL of an IndexShare group is sum_j share_j KL(t_j || q); every
layer of the group shares q (same indices, same indexer), so its indexer side is this one op on
tbar = sum_j share_j t_j, run once per group instead of once per layer.

Call one (query, selected slot) a pair. Like the sparse MLA backward (`sparse_mla.gpu_backward`),
everything is computed query-major, and only the keys' gradient is reorganised by key row:

1. forward, one program per query with all its (padded) heads: loops over its K slots in
   blocks of `block_k`, gathers the key rows (one contiguous D-row each), computes the scores
   s^T = rows . q^T [block_k, H] (the rows are the M dimension of the matmul), z, and an online
   log-sum-exp with the target-weighted sums (sum t (z - m), sum t), so that one pass gives
   ce = sum(t) * log(l) - sum t (z - m). It writes ce, lse and sum(t) per query.
2. backward `pairs` kernel, one program per query: gathers the rows again, recomputes s and z,
   p = exp(z - lse), dz = g (p sum(t) - t), ds = dz w [s > 0]; sums dq = ds^T rows and
   dw = dz^T relu(s) in float32 registers, and writes each pair's key gradient ds . q at its
   place in a key-sorted list (`sparse_mla.transpose.transpose_index`, built once per call).
3. `reduce` kernel (`sparse_mla.gpu_pairs.reduce_call`), one program per key row: sums its
   pairs' gradients, one contiguous run, in place order. No atomics: the same bits on every run.

Queries run in chunks of `budget` bytes of pair gradients (a lax.scan carrying dk).

Bytes per pair (bf16 keys, D = 128): forward gathers 2D = 256 B plus 8 B of index and target;
backward gathers 256 B again (+ 12 B of index, target and place) and writes a 2D-byte key
gradient that the reduce reads back: ~530 B. FLOPs per pair: forward 2HD (+3H), backward 6HD
(scores again, dq, dk). At 16 heads that is 16 FLOP/byte forward and ~23 backward, far below
an H200's ~180 (matmul rate / copy bandwidth): the op is bound by memory, and its limit is
bytes / copy bandwidth (benchmarks/sparse_train_parts.py prints both).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_positive_fields
from pallas_kernels.sparse_mla import gpu_pairs, transpose as tr

#: Bytes of one query chunk's per-pair key gradients in the backward.
DEFAULT_BUDGET = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class IndexerKLGpuConfig:
    """Tuning of the GPU indexer cross-entropy kernels (`impl="pallas_gpu"`; module docstring).

    block_k: slots per loop step of the forward and pairs kernels (a power of two >= 16).
    num_warps, num_stages: Triton settings of those two kernels.
    reduce_block, reduce_warps: pairs summed per step of the reduce kernel (<= transpose.SPARE_ROWS)
      and its warps.
    budget: bytes of one query chunk's per-pair key gradients."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    reduce_block: int = 32
    reduce_warps: int = 4
    budget: int = DEFAULT_BUDGET

    def __post_init__(self):
        check_positive_fields(self)
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"IndexerKLGpuConfig.block_k must be a power of two >= 16, got {self.block_k}")
        if self.reduce_block > tr.SPARE_ROWS:
            raise ValueError(f"IndexerKLGpuConfig.reduce_block must be <= {tr.SPARE_ROWS}, got {self.reduce_block}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _block(r, k0, *, q, w, keys_ref, idx_ref, t_ref, block_k):
    """Slots k0 .. k0 + block_k of query r -> (valid [bk], rows [bk, D], s^T [bk, H],
    z [bk] (-inf where invalid), t [bk] (0 where invalid))."""
    gidx = idx_ref[r, pl.ds(k0, block_k)]
    valid = gidx >= 0
    rows = keys_ref[jnp.where(valid, gidx, 0), :]
    st = lax.dot_general(rows, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    z = jnp.where(valid, jnp.sum(jnp.maximum(st, 0.0) * w[None, :], axis=1), -jnp.inf)
    t = jnp.where(valid, t_ref[r, pl.ds(k0, block_k)], 0.0)
    return valid, rows, st, z, t


def _fwd_kernel(q_ref, w_ref, keys_ref, idx_ref, t_ref, ce_ref, lse_ref, tsum_ref, *, block_k, num_blocks):
    """One program = one query r: q [R, H, D], w [R, H], keys [N, D], idx [R, Kp] (rows of keys,
    -1 = skip), t [R, Kp] -> ce, lse, tsum [R]."""
    r = pl.program_id(0)
    block = functools.partial(_block, q=q_ref[r, :, :], w=w_ref[r, :], keys_ref=keys_ref, idx_ref=idx_ref,
                              t_ref=t_ref, block_k=block_k)

    def body(j, carry):
        m, l, a, tt = carry                    # running max, sum exp(z - m), sum t (z - m), sum t
        _, _, _, z, t = block(r, j * block_k)
        m_new = jnp.maximum(m, jnp.max(z))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        l = l * jnp.exp(m - m_use) + jnp.sum(jnp.exp(z - m_use))
        shift = jnp.where(m == -jnp.inf, 0.0, tt * (m - m_use))      # tt is 0 while m is -inf
        a = a + shift + jnp.sum(jnp.where(t > 0, t * (z - m_use), 0.0))
        return m_new, l, a, tt + jnp.sum(t)

    zero = jnp.zeros((), jnp.float32)
    m, l, a, tt = lax.fori_loop(0, num_blocks, body, (jnp.full((), -jnp.inf, jnp.float32), zero, zero, zero))
    has_any = l > 0
    log_l = jnp.log(jnp.where(has_any, l, 1.0))
    ce_ref[r] = jnp.where(has_any, tt * log_l - a, 0.0)
    lse_ref[r] = jnp.where(m == -jnp.inf, 0.0, m) + log_l
    tsum_ref[r] = tt


def _pairs_kernel(q_ref, w_ref, keys_ref, idx_ref, t_ref, pos_ref, lse_ref, g_ref, gt_ref, dq_ref, dw_ref,
                  contrib_ref, *, block_k, num_blocks):
    """One program = one query r of a chunk: as `_fwd_kernel`, plus pos [R, Kp] (each pair's
    place), lse, g (the cotangent of ce), gt = g * sum(t) [R] -> dq [R, H, D] (q dtype), dw float32
    [R, H], contrib [P, D] (row pos[r, j] = the key gradient of pair (r, j))."""
    r = pl.program_id(0)
    q = q_ref[r, :, :]
    w = w_ref[r, :]
    lse, g, gt = lse_ref[r], g_ref[r], gt_ref[r]
    block = functools.partial(_block, q=q, w=w, keys_ref=keys_ref, idx_ref=idx_ref, t_ref=t_ref,
                              block_k=block_k)

    def body(j, carry):
        dq, dw = carry
        k0 = j * block_k
        valid, rows, st, z, t = block(r, k0)
        p = jnp.where(valid, jnp.exp(z - lse), 0.0)
        dz = p * gt - g * t                                                  # [bk]
        dw = dw + jnp.sum(dz[:, None] * jnp.maximum(st, 0.0), axis=0)
        ds = jnp.where(st > 0, dz[:, None] * w[None, :], 0.0).astype(rows.dtype)     # [bk, H]
        dq = dq + lax.dot_general(ds, rows, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dk = lax.dot_general(ds, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        place = pos_ref[r, pl.ds(k0, block_k)]
        contrib_ref.at[place, pl.ds(0, dk.shape[1])][...] = dk.astype(contrib_ref.dtype)
        return dq, dw

    heads, dim = q.shape
    dq, dw = lax.fori_loop(0, num_blocks, body, (jnp.zeros((heads, dim), jnp.float32),
                                                 jnp.zeros((heads,), jnp.float32)))
    dq_ref[r, :, :] = dq.astype(dq_ref.dtype)
    dw_ref[r, :] = dw


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The kernels' padded operands: q [R, Hp, Dp], w float32 [R, Hp], keys [B*T, Dp] (q dtype),
    gidx int32 [R, Kp] (global key rows, -1 = skip), t float32 [R, Kp]; R = B*S, Hp and Dp
    powers of two >= 16 (Triton's dot sizes), Kp a multiple of block_k."""

    q: jax.Array
    w: jax.Array
    keys: jax.Array
    gidx: jax.Array
    t: jax.Array


def _pad_to(x, shape, value=0):
    widths = [(0, n - s) for s, n in zip(x.shape, shape)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def _layout(q, k, weights, indices, target, block_k) -> _Layout:
    batch, seq_len, heads, dim = q.shape
    num_keys, topk = k.shape[1], indices.shape[-1]
    rows = batch * seq_len
    hp, dp = max(16, _next_pow2(heads)), max(16, _next_pow2(dim))
    kp = -(-topk // block_k) * block_k
    gidx = tr.global_rows(indices, num_keys).reshape(rows, topk)
    return _Layout(q=_pad_to(q.reshape(rows, heads, dim), (rows, hp, dp)),
                   w=_pad_to(weights.astype(jnp.float32).reshape(rows, heads), (rows, hp)),
                   keys=_pad_to(k.astype(q.dtype).reshape(batch * num_keys, dim), (batch * num_keys, dp)),
                   gidx=_pad_to(gidx, (rows, kp), -1),
                   t=_pad_to(target.astype(jnp.float32).reshape(rows, topk), (rows, kp)))


def _forward(lay: _Layout, cfg: IndexerKLGpuConfig, interpret: bool):
    """-> (ce, lse, tsum) float32 [R] each."""
    rows, kp = lay.gidx.shape
    kernel = functools.partial(_fwd_kernel, block_k=cfg.block_k, num_blocks=kp // cfg.block_k)
    vec = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return pl.pallas_call(kernel, grid=(rows,), out_shape=[vec, vec, vec],
                          compiler_params=_params(cfg.num_warps, cfg.num_stages), interpret=interpret,
                          name="indexer_kl_fwd")(lay.q, lay.w, lay.keys, lay.gidx, lay.t)


def _backward(lay: _Layout, indices, num_keys, lse, tsum, g, cfg: IndexerKLGpuConfig, interpret: bool):
    """-> (dq [R, Hp, Dp] in q dtype, dw float32 [R, Hp], dkeys float32 [B*T, Dp])."""
    rows, kp = lay.gidx.shape
    topk = indices.shape[-1]
    dp = lay.q.shape[-1]
    wide = jnp.dtype(lay.keys.dtype).itemsize >= 4
    contrib_dtype = jnp.float32 if wide else lay.keys.dtype
    chunk = tr.default_chunk_rows(rows, topk, dp, jnp.dtype(contrib_dtype).itemsize, cfg.budget)
    tindex = tr.transpose_index(indices, num_keys, chunk_rows=chunk)
    chunk, n = tindex.chunk_rows, tindex.num_chunks
    per = chunk * topk                                     # pairs per chunk
    # padded slots all go to the first spare row (never read)
    pos = _pad_to(tindex.position.reshape(n * chunk, topk), (n * chunk, kp), per)
    padded_rows = lambda x, value=0: _pad_to(x, (n * chunk,) + x.shape[1:], value)
    per_query = (padded_rows(lay.q), padded_rows(lay.w), padded_rows(lay.gidx, -1), padded_rows(lay.t),
                 padded_rows(lse), padded_rows(g), padded_rows(g * tsum), pos)
    xs = tuple(x.reshape((n, chunk) + x.shape[1:]) for x in per_query) + (tindex.offsets,)
    kernel = functools.partial(_pairs_kernel, block_k=cfg.block_k, num_blocks=kp // cfg.block_k)
    hp = lay.q.shape[1]

    def step(dkeys, args):
        q_c, w_c, gidx_c, t_c, lse_c, g_c, gt_c, pos_c, off_c = args
        dq_c, dw_c, contrib = pl.pallas_call(
            kernel, grid=(chunk,),
            out_shape=[jax.ShapeDtypeStruct((chunk, hp, dp), lay.q.dtype),
                       jax.ShapeDtypeStruct((chunk, hp), jnp.float32),
                       jax.ShapeDtypeStruct((per + tr.SPARE_ROWS, dp), contrib_dtype)],
            compiler_params=_params(cfg.num_warps, cfg.num_stages), interpret=interpret,
            name="indexer_kl_bwd_pairs",
        )(q_c, w_c, lay.keys, gidx_c, t_c, pos_c, lse_c, g_c, gt_c)
        dkeys = gpu_pairs.reduce_call(contrib, off_c, dkeys, block=cfg.reduce_block,
                                         num_warps=cfg.reduce_warps, interpret=interpret)
        return dkeys, (dq_c, dw_c)

    dkeys0 = jnp.zeros(lay.keys.shape, jnp.float32)
    if n == 1:
        dkeys, (dq, dw) = step(dkeys0, tuple(x[0] for x in xs))
    else:
        dkeys, (dq, dw) = lax.scan(step, dkeys0, xs)
    return dq.reshape((n * chunk,) + dq.shape[-2:])[:rows], dw.reshape(n * chunk, hp)[:rows], dkeys


@functools.lru_cache(maxsize=None)
def _op(cfg: IndexerKLGpuConfig, interpret: bool):
    @jax.custom_vjp
    def cross_entropy(q, k, weights, indices, target):
        lay = _layout(q, k, weights, indices, target, cfg.block_k)
        return _forward(lay, cfg, interpret)[0].reshape(q.shape[:2])

    def fwd(q, k, weights, indices, target):
        lay = _layout(q, k, weights, indices, target, cfg.block_k)
        ce, lse, tsum = _forward(lay, cfg, interpret)
        return ce.reshape(q.shape[:2]), (q, k, weights, indices, target, lse, tsum)

    def bwd(res, dce):
        q, k, weights, indices, target, lse, tsum = res
        batch, seq_len, heads, dim = q.shape
        num_keys = k.shape[1]
        lay = _layout(q, k, weights, indices, target, cfg.block_k)
        dq, dw, dkeys = _backward(lay, indices, num_keys, lse, tsum, dce.astype(jnp.float32).reshape(-1), cfg,
                                  interpret)
        dq = dq[:, :heads, :dim].reshape(q.shape)
        dw = dw[:, :heads].reshape(weights.shape).astype(weights.dtype)
        dk = dkeys[:, :dim].reshape(batch, num_keys, dim).astype(k.dtype)
        return dq, dk, dw, None, jnp.zeros_like(target)

    cross_entropy.defvjp(fwd, bwd)
    return cross_entropy


def indexer_cross_entropy(q: jax.Array, k: jax.Array, weights: jax.Array, indices: jax.Array,
                          target: jax.Array, *, config: IndexerKLGpuConfig = IndexerKLGpuConfig(),
                          interpret: bool = False):
    """Contract of `pallas_kernels.indexer_cross_entropy` with this module's kernels.

    q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], indices int32 [B, S, K], target
    float32 [B, S, K] -> float32 [B, S]."""
    return _op(config, bool(interpret))(q, k, weights, jnp.asarray(indices, jnp.int32), target)
