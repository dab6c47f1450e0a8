"""The dense warm-up's indexer KL of an IndexShare group (`pallas_kernels.dense_indexer_kl`),
blockwise in XLA, with its custom VJP.

Three passes over the causal tiles of `block` queries x `block` keys, key blocks entirely above
the diagonal (or past every document start / kv_len of the tile) skipped:
  1. every layer's and head's attention lse (online over key blocks),
  2. the loss: per tile the layers' t_j (entropy, tbar) and the indexer's scores once
     (sum tbar s, online LSE_s),
  3. the backward pass: tbar and softmax(s) recomputed per tile, the indexer gradients formed.
Live per tile: one layer's logits float32 [B, block, H, block] at a time (XLA may overlap
layers) and the indexer's [B, block, Hi, block]; kept for the backward pass: the inputs, the
lse float32 [L, B, S, H] and LSE_s float32 [B, S]. No [S, S] array exists.

The same passes as Pallas GPU kernels, measured slower on an H100 forward + backward, are
outside the package (lab/dense_indexer_kl_gpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import check_positive_fields

#: The smallest tile (queries and keys) `auto_block` picks: 512 took one IndexShare group of the
#: default recipe (16 x 4,096 tokens, 4 layers) forward and backward in 82.8 ms on an H100
#: against 101.5 ms with 256 (docs/data/dense_kl_pallas_h100.json).
DEFAULT_BLOCK = 512
#: Query blocks a pass may have before `auto_block` doubles the tile. Each tile is a loop step
#: of a dozen small kernels and a device-to-host copy of the loop's condition: at 128K with 512
#: (256 blocks, 32,896 causal tiles a pass) a dense step of the default model launched about
#: two million kernels and its GPU stood idle for 19 of the step's 26 s (docs/training.md).
MAX_QUERY_BLOCKS = 64
#: The most bytes of one layer's float32 attention logits [B, block, H, block] a larger tile may take.
MAX_TILE_BYTES = 1 << 30


def auto_block(seq_len: int, batch: int, heads: int) -> int:
    """Queries (and keys) per tile: DEFAULT_BLOCK, doubled while a pass has more than
    MAX_QUERY_BLOCKS query blocks and the doubled tile's logits [batch, block, heads, block]
    float32 stay within MAX_TILE_BYTES (4,096 tokens: 512; 131,072 tokens, 8 heads: 2,048)."""
    block = DEFAULT_BLOCK
    while -(-seq_len // block) > MAX_QUERY_BLOCKS and batch * heads * (2 * block) ** 2 * 4 <= MAX_TILE_BYTES:
        block *= 2
    return block


@dataclasses.dataclass(frozen=True)
class DenseIndexerKLXlaConfig:
    """Tuning of the XLA dense indexer KL: block, queries and keys per tile (capped at S; None:
    `auto_block` from the length, batch and heads)."""

    block: int | None = None

    def __post_init__(self):
        check_positive_fields(self)


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale: float, kv_len, kv_start, shares,
                     config: DenseIndexerKLXlaConfig = DenseIndexerKLXlaConfig(), interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.dense_indexer_kl` (its arguments normalised there: qs and
    latents L-tuples of [B, S, H, Dk] and [B, S, Dk] without gradient, idx_w float32, kv_len
    int32 [B] <= S, kv_start int32 [B, S] or None, shares an L-tuple of floats) -> float32
    [B, S]. interpret: unused (plain XLA)."""
    batch, seq_len = idx_q.shape[:2]
    block = config.block or auto_block(seq_len, batch, max(q.shape[2] for q in qs))
    st = _Static(float(sm_scale), tuple(shares), max(1, min(block, seq_len)), seq_len)
    return _row_losses(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)


def backward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s, g, *, sm_scale: float, shares,
             block: int = DEFAULT_BLOCK):
    """Pass 3 alone: the gradients of sum(g * row losses) from the saved lse float32 [L, B, S', H]
    and LSE_s float32 [B, S'] (S' >= S: S, or S padded to a multiple of block), g float32
    [B, S] -> (dq [B, S, Hi, Di], dk [B, S, Di], dw [B, S, Hi]) in the dtypes of idx_q,
    idx_keys and idx_w. Operands as in `dense_indexer_kl`."""
    seq_len = idx_q.shape[1]
    st = _Static(float(sm_scale), tuple(shares), max(1, min(int(block), seq_len)), seq_len)
    inp = _inputs(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)
    lse, lse_s = jax.vmap(lambda x: _pad(x, st.padded))(lse), _pad(lse_s, st.padded)
    dq, dk, dw = _gradient_pass(st, inp, lse, lse_s, _pad(g.astype(jnp.float32), st.padded))
    return dq[:, :seq_len].astype(idx_q.dtype), dk[:, :seq_len].astype(idx_keys.dtype), \
        dw[:, :seq_len].astype(idx_w.dtype)


# ---------------------------------------------------------------------- tiles
@dataclasses.dataclass(frozen=True)
class _Static:
    """The static settings of one call: the softmax scale, the layers' shares, the tile size
    (queries and keys) and the sequence length."""

    sm_scale: float
    shares: tuple[float, ...]
    block: int
    seq_len: int

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block)

    @property
    def padded(self) -> int:
        return self.num_blocks * self.block


class _Inputs(NamedTuple):
    """The operands, their query/key axis padded to a multiple of the block."""

    qs: tuple          # L x [B, Sp, H, Dk]
    latents: tuple     # L x [B, Sp, Dk]
    idx_q: jax.Array   # [B, Sp, Hi, Di]
    idx_keys: jax.Array  # [B, Sp, Di]
    idx_w: jax.Array   # float32 [B, Sp, Hi]
    kv_len: jax.Array  # int32 [B]
    kv_start: jax.Array  # int32 [B, Sp]


def _pad(x: jax.Array, size: int) -> jax.Array:
    extra = size - x.shape[1]
    return x if extra == 0 else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _inputs(st: _Static, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start) -> _Inputs:
    p = st.padded
    if kv_start is None:
        kv_start = jnp.zeros(idx_q.shape[:2], jnp.int32)
    return _Inputs(tuple(_pad(q, p) for q in qs), tuple(_pad(c, p) for c in latents), _pad(idx_q, p),
                   _pad(idx_keys, p), _pad(idx_w, p), kv_len, _pad(kv_start, p))


def _rows(x: jax.Array, i, size: int) -> jax.Array:
    """Rows [i * size, (i + 1) * size) of axis 1 of x."""
    return lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _key_range(st: _Static, inp: _Inputs, i):
    """The key blocks tile row i (query block i) must visit: [lo, hi), skipping blocks past the
    diagonal, before every document start of the block and at or past every kv_len."""
    b = st.block
    lo = jnp.min(_rows(inp.kv_start, i, b)) // b
    hi = jnp.minimum(i + 1, (jnp.max(inp.kv_len) + b - 1) // b)
    return lo, jnp.maximum(hi, lo)


def _visible(st: _Static, inp: _Inputs, i, kb) -> jax.Array:
    """bool [B, block, block]: key kb * block + c is visible to query i * block + r."""
    b = st.block
    r = i * b + lax.broadcasted_iota(jnp.int32, (1, b, 1), 1)
    c = kb * b + lax.broadcasted_iota(jnp.int32, (1, 1, b), 2)
    start = _rows(inp.kv_start, i, b)[:, :, None]
    return (c <= r) & (c < inp.kv_len[:, None, None]) & (c >= start)


def _attention_logits(st: _Static, q_blk, latent_blk) -> jax.Array:
    """q [B, bq, H, Dk], latent rows [B, bk, Dk] -> float32 [B, bq, H, bk]."""
    return jnp.einsum("bshd,btd->bsht", q_blk, latent_blk, preferred_element_type=jnp.float32) * st.sm_scale


def _finite(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _head_mean_probs(st: _Static, q_blk, latent_blk, lse_blk, vis) -> jax.Array:
    """One layer's t over a tile: float32 [B, bq, bk], the head mean of exp(logits - lse)
    (lse float32 [B, bq, H]), 0 where not visible."""
    logits = _attention_logits(st, q_blk, latent_blk)
    p = jnp.where(vis[:, :, None, :], jnp.exp(logits - _finite(lse_blk)[..., None]), 0.0)
    return jnp.mean(p, axis=2)


def _index_logits(iq_blk, ik_blk) -> jax.Array:
    """Indexer queries [B, bq, Hi, Di], keys [B, bk, Di] -> per-head dots float32 [B, bq, Hi, bk]."""
    return jnp.einsum("bshd,btd->bsht", iq_blk, ik_blk.astype(iq_blk.dtype), preferred_element_type=jnp.float32)


def _scores(a, w_blk) -> jax.Array:
    """Per-head dots float32 [B, bq, Hi, bk], head weights [B, bq, Hi] -> scores [B, bq, bk]."""
    return jnp.einsum("bsht,bsh->bst", jnp.maximum(a, 0.0), w_blk)


def _online_lse(m, l, x, valid, axis: int = -1):
    """One step of a running log-sum-exp: (max m, sum l) over the previous blocks and the new
    values x masked by valid (reduced over axis) -> (m, l)."""
    x = jnp.where(valid, x, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(x, axis=axis))
    safe = _finite(m_new)
    l = l * jnp.exp(m - safe) + jnp.sum(jnp.exp(x - jnp.expand_dims(safe, axis)), axis=axis)
    return m_new, l


def _lse(m, l) -> jax.Array:
    """-inf where nothing was visible."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def _merge_blocks(y: jax.Array) -> jax.Array:
    """[n, B, block, ...] (one entry per query block) -> [B, n * block, ...]."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape((y.shape[0], -1) + y.shape[3:])


# ---------------------------------------------------------------------- passes
def _attention_lse(st: _Static, inp: _Inputs) -> jax.Array:
    """Pass 1: every layer's and head's lse over the visible keys -> float32 [L, B, Sp, H]."""
    b = st.block

    def query_block(i):
        q_blks = [_rows(q, i, b) for q in inp.qs]
        shape = q_blks[0].shape[:3]
        init = (tuple(jnp.full(shape, -jnp.inf, jnp.float32) for _ in q_blks),
                tuple(jnp.zeros(shape, jnp.float32) for _ in q_blks))

        def key_block(kb, carry):
            vis = _visible(st, inp, i, kb)[:, :, None, :]
            ms, ls = [], []
            for q_blk, latent, m, l in zip(q_blks, inp.latents, *carry):
                m, l = _online_lse(m, l, _attention_logits(st, q_blk, _rows(latent, kb, b)), vis)
                ms.append(m)
                ls.append(l)
            return tuple(ms), tuple(ls)

        lo, hi = _key_range(st, inp, i)
        ms, ls = lax.fori_loop(lo, hi, key_block, init)
        return jnp.stack([_lse(m, l) for m, l in zip(ms, ls)])        # [L, B, bq, H]

    out = lax.map(query_block, jnp.arange(st.num_blocks))                # [n, L, B, bq, H]
    return jax.vmap(_merge_blocks, in_axes=1)(out)


def _target_tile(st: _Static, inp: _Inputs, lse, i, kb, vis, with_entropy: bool):
    """tbar float32 [B, bq, bk] over tile (i, kb) and, with_entropy, sum_j share_j sum_t
    t_j log t_j per query float32 [B, bq] (else None). lse: float32 [L, B, Sp, H]."""
    b = st.block
    tbar, neg_entropy = None, None
    for j, (q, latent, share) in enumerate(zip(inp.qs, inp.latents, st.shares)):
        t = _head_mean_probs(st, _rows(q, i, b), _rows(latent, kb, b), _rows(lse[j], i, b), vis)
        tbar = share * t if tbar is None else tbar + share * t
        if with_entropy:
            h = share * jnp.sum(jnp.where(t > 0, t * jnp.log(jnp.where(t > 0, t, 1.0)), 0.0), axis=-1)
            neg_entropy = h if neg_entropy is None else neg_entropy + h
    return tbar, neg_entropy


def _loss_pass(st: _Static, inp: _Inputs, lse) -> tuple[jax.Array, jax.Array]:
    """Pass 2 -> (row losses float32 [B, Sp], the indexer's LSE_s float32 [B, Sp])."""
    b = st.block

    def query_block(i):
        iq, w = _rows(inp.idx_q, i, b), _rows(inp.idx_w, i, b)
        shape = iq.shape[:2]
        zeros = jnp.zeros(shape, jnp.float32)
        init = (zeros, zeros, jnp.full(shape, -jnp.inf, jnp.float32), zeros)

        def key_block(kb, carry):
            neg_entropy, cross, m, l = carry
            vis = _visible(st, inp, i, kb)
            tbar, h = _target_tile(st, inp, lse, i, kb, vis, with_entropy=True)
            s = _scores(_index_logits(iq, _rows(inp.idx_keys, kb, b)), w)
            cross = cross + jnp.sum(jnp.where(vis, tbar * s, 0.0), axis=-1)
            m, l = _online_lse(m, l, s, vis)
            return neg_entropy + h, cross, m, l

        lo, hi = _key_range(st, inp, i)
        neg_entropy, cross, m, l = lax.fori_loop(lo, hi, key_block, init)
        lse_s = _lse(m, l)
        return neg_entropy - cross + _finite(lse_s), lse_s

    rows, lse_s = lax.map(query_block, jnp.arange(st.num_blocks))
    return _merge_blocks(rows), _merge_blocks(lse_s)


def _gradient_pass(st: _Static, inp: _Inputs, lse, lse_s, g):
    """Pass 3: g float32 [B, Sp] the cotangent of the row losses -> the cotangents of the
    indexer's queries [B, Sp, Hi, Di], keys [B, Sp, Di] and head weights [B, Sp, Hi], float32."""
    b = st.block
    dk0 = jnp.zeros(inp.idx_keys.shape, jnp.float32)

    def query_block(dk, i):
        iq, w = _rows(inp.idx_q, i, b), _rows(inp.idx_w, i, b)
        g_blk, lse_s_blk = _rows(g, i, b), _finite(_rows(lse_s, i, b))
        init = (jnp.zeros(iq.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32), dk)

        def key_block(kb, carry):
            dq, dw, dk = carry
            vis = _visible(st, inp, i, kb)
            tbar, _ = _target_tile(st, inp, lse, i, kb, vis, with_entropy=False)
            ik = _rows(inp.idx_keys, kb, b)
            a = _index_logits(iq, ik)
            s = _scores(a, w)
            softmax = jnp.where(vis, jnp.exp(s - lse_s_blk[..., None]), 0.0)
            ds = (softmax - tbar) * g_blk[..., None]                                 # [B, bq, bk]
            dw = dw + jnp.einsum("bst,bsht->bsh", ds, jnp.maximum(a, 0.0))
            da = jnp.where(a > 0, ds[:, :, None, :] * w[..., None], 0.0).astype(iq.dtype)   # [B, bq, Hi, bk]
            dq = dq + jnp.einsum("bsht,btd->bshd", da, ik.astype(iq.dtype), preferred_element_type=jnp.float32)
            dk_blk = jnp.einsum("bsht,bshd->btd", da, iq, preferred_element_type=jnp.float32)
            dk = lax.dynamic_update_slice_in_dim(dk, _rows(dk, kb, b) + dk_blk, kb * b, axis=1)
            return dq, dw, dk

        lo, hi = _key_range(st, inp, i)
        dq, dw, dk = lax.fori_loop(lo, hi, key_block, init)
        return dk, (dq, dw)

    dk, (dq, dw) = lax.scan(query_block, dk0, jnp.arange(st.num_blocks))
    return _merge_blocks(dq), dk, _merge_blocks(dw)


# ---------------------------------------------------------------------- custom vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_losses(st: _Static, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start):
    """The group's KL per query float32 [B, S]."""
    return _row_losses_fwd(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)[0]


def _row_losses_fwd(st: _Static, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start):
    inp = _inputs(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)
    lse = _attention_lse(st, inp)
    rows, lse_s = _loss_pass(st, inp, lse)
    return rows[:, :st.seq_len], (qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s)


def _row_losses_bwd(st: _Static, res, g):
    qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s = res
    dq, dk, dw = backward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s, g,
                          sm_scale=st.sm_scale, shares=st.shares, block=st.block)
    return None, None, dq, dk, dw, None, None


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)
