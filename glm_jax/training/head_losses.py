"""Cross-entropy and MTP total variation through a bias-free linear vocabulary head, by chunks.

The head is `hidden @ kernel`, kernel [hidden, V]. Every product runs on model-dtype operands
with float32 accumulation: logits = x @ W, and in the backward dx = g @ W^T and dW = x^T @ g with
the float32 dlogits g cast to the model dtype first. Only one chunk's float32 [B, C, V] logits
exist at a time (C positions per row, `losses.head_chunk`); dW is summed over the chunks in
float32 by a sequential scan (deterministic).

The logits are the float32 accumulator, not rounded to the model dtype as `GLMModel.logits`
rounds them (the two agree exactly for a float32 model).

- `linear_cross_entropy`: a masked-mean CE. Its cotangent is one scalar, so the forward pass also
  forms the gradients (3 products a chunk) and the backward pass only scales them.
- `linear_cross_entropy_with_tv`: the same, plus the per-position TV against a target hidden
  state's distribution from the same logits, reported without a gradient (4 products a chunk).
- `linear_nll_and_tv`: per-position CE and trained TV. Their cotangents depend on the other MTP
  depths (`losses.end_to_end_tv`), so the backward pass recomputes both sides' logits per chunk
  from the hidden states and the saved log-normalisers (2 products a chunk forward, 4 backward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm_jax.ops import split_query_chunks
from glm_jax.training.losses import head_chunk, masked_mean

F32 = jnp.float32


def linear_cross_entropy(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray,
                         mask: jnp.ndarray | None = None, *, chunk: int | None = None) -> jnp.ndarray:
    """`cross_entropy(hidden @ kernel, targets, mask)`, a float32 scalar.

    hidden [B, S, hidden], kernel [hidden, V], targets int32 [B, S], mask bool broadcastable to
    [B, S] or None (all); chunk: positions per row and chunk (None: `losses.head_chunk`)."""
    loss, _ = _fused_ce(hidden, kernel, targets, _full_mask(mask, targets), None, _chunk(hidden, kernel, chunk))
    return loss


def linear_cross_entropy_with_tv(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray,
                                 mask: jnp.ndarray | None, target_hidden: jnp.ndarray, *,
                                 chunk: int | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(`linear_cross_entropy(hidden, kernel, targets, mask)`,
    `total_variation(target_hidden @ kernel, hidden @ kernel)` float32 [B, S] without a gradient).

    target_hidden [B, S, hidden] (p, the target side); the rest as in `linear_cross_entropy`."""
    loss, tv = _fused_ce(hidden, kernel, targets, _full_mask(mask, targets), target_hidden,
                         _chunk(hidden, kernel, chunk))
    return loss, jax.lax.stop_gradient(tv)


def linear_nll_and_tv(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray,
                      target_hidden: jnp.ndarray, *, chunk: int | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(`token_nll(hidden @ kernel, targets)`, `total_variation(target_hidden @ kernel, hidden @ kernel)`),
    both float32 [B, S] and differentiable in hidden and kernel; target_hidden gets no gradient.

    hidden, target_hidden [B, S, hidden], kernel [hidden, V], targets int32 [B, S]."""
    return _nll_tv(hidden, kernel, targets, target_hidden, _chunk(hidden, kernel, chunk))


# ----------------------------------------------------------------------------- chunk algebra
def _chunk(hidden, kernel, chunk):
    return head_chunk(hidden.shape[0], hidden.shape[1], kernel.shape[1], chunk)


def _full_mask(mask, targets):
    return jnp.ones(targets.shape, bool) if mask is None else jnp.broadcast_to(mask, targets.shape)


def _split(x, chunk: int):
    """[B, S, ...] -> [n, B, chunk, ...], the tail zero-padded; None stays None."""
    return None if x is None else split_query_chunks(x, 0, chunk)


def _merge(y, s: int):
    """[n, B, chunk, ...] -> [B, S, ...] (`_split`'s inverse, the padding dropped)."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape((y.shape[0], -1) + y.shape[3:])[:, :s]


# On one chunk: x [B, C, hidden], logits and their gradients float32 [B, C, V], t int32 [B, C].
def _logits(x, kernel):
    """x [B, C, hidden], kernel [hidden, V] -> float32 logits [B, C, V]."""
    return jnp.einsum("bch,hv->bcv", x.astype(kernel.dtype), kernel, preferred_element_type=F32)


def _backprop(g, x, kernel):
    """float32 dlogits g [B, C, V] -> (dx float32 [B, C, hidden], dkernel float32 [hidden, V])."""
    g = g.astype(kernel.dtype)
    dx = jnp.einsum("bcv,hv->bch", g, kernel, preferred_element_type=F32)
    dk = jnp.einsum("bch,bcv->hv", x.astype(kernel.dtype), g, preferred_element_type=F32)
    return dx, dk


def _normalise(z):
    """logits [B, C, V] -> (log-normaliser [B, C], softmax [B, C, V])."""
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse, jnp.exp(z - lse[..., None])


def _nll(z, lse, t):
    """-log softmax(z)[t]: [B, C]."""
    return lse - jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0]


def _nll_dlogits(q, t):
    """d nll / d logits = softmax - onehot(t): [B, C, V]."""
    return q - jax.nn.one_hot(t, q.shape[-1], dtype=q.dtype)


def _tv(p, q):
    """1 - sum_v min(p_v, q_v): [B, C]."""
    return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)


def _tv_dlogits(p, q):
    """d TV / d q-logits, p fixed: -q_k (m_k - sum_v m_v q_v), m = d min(p, q) / dq: 1 where
    q < p, 0 where q > p and 1/2 at ties (the rule of jnp.minimum's derivative). [B, C, V]."""
    m = jnp.where(q < p, 1.0, jnp.where(q == p, 0.5, 0.0))
    mq = m * q
    return q * jnp.sum(mq, axis=-1, keepdims=True) - mq


# ----------------------------------------------------------------------------- mean CE (+ reported TV)
def _ce_scan(hidden, kernel, targets, mask, target_hidden, chunk: int, grads: bool):
    """-> (mean CE, TV [B, S] or None, and with grads: d CE / d hidden [B, S, hidden] in hidden's
    dtype and d CE / d kernel float32 [hidden, V]; else None, None)."""
    s = hidden.shape[1]
    weight = mask.astype(F32) / jnp.maximum(jnp.sum(mask.astype(F32)), 1.0)      # the mean's scale

    def body(dk, xs):
        x, t, w, xp = xs
        z = _logits(x, kernel)
        lse, q = _normalise(z)
        nll = _nll(z, lse, t)
        tv = None if xp is None else _tv(_normalise(_logits(xp, kernel))[1], q)
        if not grads:
            return dk, (nll, tv, None)
        dx, dk_chunk = _backprop(_nll_dlogits(q, t) * w[..., None], x, kernel)
        return dk + dk_chunk, (nll, tv, dx.astype(hidden.dtype))

    dk0 = jnp.zeros(kernel.shape, F32) if grads else None
    xs = (_split(hidden, chunk), _split(targets, chunk), _split(weight, chunk), _split(target_hidden, chunk))
    dk, (nll, tv, dx) = jax.lax.scan(body, dk0, xs)
    loss = masked_mean(_merge(nll, s), mask)
    tv = None if tv is None else _merge(tv, s)
    return loss, tv, (None if dx is None else _merge(dx, s)), dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_ce(hidden, kernel, targets, mask, target_hidden, chunk):
    loss, tv, _, _ = _ce_scan(hidden, kernel, targets, mask, target_hidden, chunk, grads=False)
    return loss, tv


def _fused_ce_fwd(hidden, kernel, targets, mask, target_hidden, chunk):
    loss, tv, dh, dk = _ce_scan(hidden, kernel, targets, mask, target_hidden, chunk, grads=True)
    return (loss, tv), (dh, dk, kernel)


def _fused_ce_bwd(chunk, res, cts):
    dh, dk, kernel = res
    ct = cts[0]                                 # the TV's cotangent is zero: it is stop-gradiented
    return ((dh.astype(F32) * ct).astype(dh.dtype), (dk * ct).astype(kernel.dtype), None, None, None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


# ----------------------------------------------------------------------------- per-position CE and TV
def _nll_tv_scan(hidden, kernel, targets, target_hidden, chunk: int):
    """-> (nll [B, S], TV [B, S], log-normalisers of the q and p logits, float32 [B, S] each)."""
    s = hidden.shape[1]

    def body(_, xs):
        x, t, xp = xs
        z = _logits(x, kernel)
        lse_q, q = _normalise(z)
        lse_p, p = _normalise(_logits(xp, kernel))
        return None, (_nll(z, lse_q, t), _tv(p, q), lse_q, lse_p)

    _, ys = jax.lax.scan(body, None, (_split(hidden, chunk), _split(targets, chunk), _split(target_hidden, chunk)))
    return tuple(_merge(y, s) for y in ys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _nll_tv(hidden, kernel, targets, target_hidden, chunk):
    return _nll_tv_scan(hidden, kernel, targets, target_hidden, chunk)[:2]


def _nll_tv_fwd(hidden, kernel, targets, target_hidden, chunk):
    nll, tv, lse_q, lse_p = _nll_tv_scan(hidden, kernel, targets, target_hidden, chunk)
    return (nll, tv), (hidden, kernel, targets, target_hidden, lse_q, lse_p)


def _nll_tv_bwd(chunk, res, cts):
    hidden, kernel, targets, target_hidden, lse_q, lse_p = res
    s = hidden.shape[1]

    def body(dk, xs):
        x, t, xp, lq, lp, ct_nll, ct_tv = xs
        q = jnp.exp(_logits(x, kernel) - lq[..., None])
        p = jnp.exp(_logits(xp, kernel) - lp[..., None])
        g = ct_nll[..., None] * _nll_dlogits(q, t) + ct_tv[..., None] * _tv_dlogits(p, q)
        dx, dk_chunk = _backprop(g, x, kernel)
        return dk + dk_chunk, dx.astype(hidden.dtype)

    xs = tuple(_split(a, chunk) for a in (hidden, targets, target_hidden, lse_q, lse_p, *cts))
    dk, dx = jax.lax.scan(body, jnp.zeros(kernel.shape, F32), xs)
    return _merge(dx, s), dk.astype(kernel.dtype), None, None


_nll_tv.defvjp(_nll_tv_fwd, _nll_tv_bwd)
