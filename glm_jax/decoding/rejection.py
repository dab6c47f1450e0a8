"""Verification of drafted tokens; both rules emit tokens distributed exactly as the target.

`rejection_sample` (speculative sampling, Leviathan et al. / Chen et al.): draft token x_i ~ q_i
is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
resampled from normalize(max(0, p_i - q_i)); if every draft is accepted a bonus token is
sampled from p_K.

`match_sample` (the base rule): a token y_i ~ p_i is sampled at every position and draft x_i is
accepted iff it equals y_i; the first mismatch emits y_i. It accepts with probability p_i(x_i)
instead of min(1, p_i(x_i) / q_i(x_i)), so never more often. At temperature 0 (one-hot p and q)
the two rules are the same greedy verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

VERIFICATION_RULES = ("rejection", "match")


def rejection_sample(target_probs: jnp.ndarray, draft_probs: jnp.ndarray, draft_tokens: jnp.ndarray,
                     key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Verify K drafted tokens per sequence against the target.

    target_probs float [B, K+1, V]: p at each drafted position and the bonus position.
    draft_probs  float [B, K, V]:   q, the distributions the drafts were sampled from.
    draft_tokens int32 [B, K].
    -> (tokens int32 [B, K+1]: the accepted drafts, then the corrected or bonus token, then -1;
        num_accepted int32 [B]: accepted drafts per sequence, so num_accepted + 1 tokens are valid).
    With one-hot p and q (temperature 0) this is exactly greedy verification."""
    b, k, v = draft_probs.shape
    _check_shapes(target_probs, draft_tokens, b, k, v)
    p = target_probs.astype(jnp.float32)
    q = draft_probs.astype(jnp.float32)
    accept_key, resample_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, (b, k))
    accepted = u * q_draft < p_draft                       # u < p/q without dividing by q
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)

    # Residual at every position (the bonus position has q = 0, so its residual is p itself).
    q_ext = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)
    residual = jnp.maximum(p - q_ext, 0.0)
    at = jnp.take_along_axis(residual, num_accepted[:, None, None], axis=1)[:, 0]       # [B, V]
    p_at = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]
    mass = jnp.sum(at, axis=-1, keepdims=True)
    at = jnp.where(mass > 0, at, p_at)                     # p == q: rejection is impossible anyway
    corrected = jax.random.categorical(resample_key, jnp.log(at), axis=-1).astype(jnp.int32)

    slot = jnp.arange(k + 1)[None, :]
    drafts_ext = jnp.concatenate([draft_tokens, jnp.zeros((b, 1), draft_tokens.dtype)], axis=1)
    tokens = jnp.where(slot < num_accepted[:, None], drafts_ext,
                       jnp.where(slot == num_accepted[:, None], corrected[:, None], -1))
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)


def match_sample(target_probs: jnp.ndarray, draft_tokens: jnp.ndarray,
                 key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The base rule: target_probs float [B, K+1, V], draft_tokens int32 [B, K] -> the same
    (tokens int32 [B, K+1], num_accepted int32 [B]) as `rejection_sample`."""
    b, k = draft_tokens.shape
    _check_shapes(target_probs, draft_tokens, b, k, target_probs.shape[-1])
    sampled = jax.random.categorical(key, jnp.log(target_probs.astype(jnp.float32)), axis=-1).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod((draft_tokens == sampled[:, :k]).astype(jnp.int32), axis=1), axis=1)
    tokens = jnp.where(jnp.arange(k + 1)[None, :] <= num_accepted[:, None], sampled, -1)
    return tokens, num_accepted.astype(jnp.int32)


def _check_shapes(target_probs, draft_tokens, b: int, k: int, v: int) -> None:
    if target_probs.shape != (b, k + 1, v) or draft_tokens.shape != (b, k):
        raise ValueError(f"shapes: target_probs {target_probs.shape} must be [B, K+1, V] = {(b, k + 1, v)}, "
                         f"draft_tokens {draft_tokens.shape} must be [B, K] = {(b, k)}")

