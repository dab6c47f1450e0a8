"""Kernels for grouped-indexer sparse attention, with interchangeable implementations.

Public ops (pure functions of arrays; jittable with the keyword-only config arguments static):

    indexer_scores(q, k, weights, *, q_pos, kv_len, kv_start, ...)        -> float32 [B, S, T]
    indexer_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start, ...)    -> int32 [B, S, topk]
    sparse_mla(q, kv, indices, *, sm_scale, v_dim, ...)         -> (out [B, S, H, v_dim], lse [B, S, H])

Every op takes `impl`:
    "reference"   dense plain-jnp oracle (builds [B, S, T]-sized matrices; tests, small shapes)
    "xla"         memory-sane jnp, chunked over queries (never all of [S, T] at once)
    "auto"        the Pallas implementation of the current backend on TPU and GPU, else "xla"
    "pallas_tpu"  Mosaic TPU kernels;  "pallas_gpu"  Pallas kernels with the Triton lowering
`interpret` runs a Pallas implementation on the CPU (tests) and is ignored by the others;
`q_chunk` is the number of queries per chunk of the "xla" implementation and of the Pallas
indexer top-k (None: chosen from the shapes so that a chunk's intermediates stay bounded)
and ignored by "reference".
All arithmetic is float32 internally; inputs may be bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import attention as _attention
from pallas_kernels import indexer as _indexer
from pallas_kernels._common import AUTO_IMPL, VALID_IMPLS, resolve_impl, start_or_zero

_INDEXER_PALLAS = {"pallas_gpu": _indexer.gpu, "pallas_tpu": _indexer.tpu}
_INDEXER_IMPLS = ("reference", "xla") + tuple(_INDEXER_PALLAS)

__all__ = ["VALID_IMPLS", "AUTO_IMPL", "resolve_impl", "indexer_scores", "indexer_topk", "sparse_mla"]


def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array, *, q_pos: jax.Array,
                   kv_len: jax.Array, kv_start: jax.Array | None = None, impl: str = "auto",
                   interpret: bool = False, q_chunk: int | None = None) -> jax.Array:
    """Lightning-indexer scores of every key for every query.

    Args:
      q: [B, S, H, D] indexer queries.
      k: [B, T, D] indexer keys (one head shared by all query heads).
      weights: float32 [B, S, H] per-head weights, every scale folded in.
      q_pos: int32 [B, S] absolute position of each query.
      kv_len: int32 [B] number of valid keys.
      kv_start: int32 [B, S] first valid key of each query (packed documents: where the
        query's document starts), or None for 0.
      impl, interpret, q_chunk: see the package docstring.

    Returns:
      float32 [B, S, T]: score[b,s,t] = sum_h weights[b,s,h] * relu(q[b,s,h] . k[b,t]) where
      kv_start[b,s] <= t <= q_pos[b,s] and t < kv_len[b]; -inf elsewhere. Differentiable in
      q, k and weights.
    """
    impl = resolve_impl("indexer_scores", impl, implemented=_INDEXER_IMPLS)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    kv_start = start_or_zero(kv_start, q_pos)
    if impl in _INDEXER_PALLAS:
        return _pallas_scores(impl, interpret, q_chunk)(q, k, weights, q_pos,
                                                        jnp.asarray(kv_len, jnp.int32), kv_start)
    if impl == "reference":
        return _indexer.reference.indexer_scores(q, k, weights, q_pos=q_pos, kv_len=kv_len,
                                                 kv_start=kv_start)
    return _indexer.xla.indexer_scores(q, k, weights, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start,
                                       q_chunk=q_chunk)


@functools.cache
def _pallas_scores(impl: str, interpret: bool, q_chunk: int | None):
    """The Pallas scores, differentiable: the backward pass is that of the `xla` scores (the
    indexer losses train through them)."""
    forward = functools.partial(_INDEXER_PALLAS[impl].indexer_scores, interpret=interpret)

    @jax.custom_vjp
    def scores(q, k, weights, q_pos, kv_len, kv_start):
        return forward(q, k, weights, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start)

    def fwd(*args):
        return scores(*args), args

    def bwd(res, g):
        q, k, weights, q_pos, kv_len, kv_start = res
        _, vjp = jax.vjp(lambda a, b, c: _indexer.xla.indexer_scores(
            a, b, c, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start, q_chunk=q_chunk), q, k, weights)
        return (*vjp(g), None, None, None)

    scores.defvjp(fwd, bwd)
    return scores


def indexer_topk(q: jax.Array, k: jax.Array, weights: jax.Array, *, topk: int, q_pos: jax.Array,
                 kv_len: jax.Array, kv_start: jax.Array | None = None, impl: str = "auto",
                 interpret: bool = False, q_chunk: int | None = None) -> jax.Array:
    """The exact top-k keys of each query under the indexer scores (see `indexer_scores`).

    Args:
      q: [B, S, H, D];  k: [B, T, D];  weights: float32 [B, S, H];
      q_pos: int32 [B, S];  kv_len: int32 [B];  kv_start: int32 [B, S] or None
        -- as in `indexer_scores`.
      topk: number of slots per query (static); may exceed T.
      impl, interpret, q_chunk: see the package docstring.

    Returns:
      int32 [B, S, topk]. Row (b, s) holds the min(topk, #valid) valid keys t (kv_start[b,s]
      <= t <= q_pos[b,s], t < kv_len[b]) with the largest scores; on equal scores the lower t
      wins. The row is ordered by descending score, equal scores by ascending t, and the
      remaining trailing slots are -1. Masked keys are never selected. Deterministic. Not
      differentiated: a function that also uses q, k or weights elsewhere can be (the
      indices count as constants).
    """
    impl = resolve_impl("indexer_topk", impl, implemented=_INDEXER_IMPLS)
    # Indices carry no gradient; stopping it here keeps autodiff out of the kernels.
    q, k, weights = (jax.lax.stop_gradient(x) for x in (q, k, weights))
    args = dict(topk=topk, q_pos=q_pos, kv_len=kv_len, kv_start=start_or_zero(kv_start, q_pos))
    if impl in _INDEXER_PALLAS:
        return _INDEXER_PALLAS[impl].indexer_topk(q, k, weights, interpret=interpret, q_chunk=q_chunk,
                                                  **args)
    if impl == "reference":
        return _indexer.reference.indexer_topk(q, k, weights, **args)
    return _indexer.xla.indexer_topk(q, k, weights, q_chunk=q_chunk, **args)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               impl: str = "auto", interpret: bool = False, q_chunk: int | None = None):
    """Sparse multi-query attention over one shared latent head, restricted to selected rows.

    Args:
      q: [B, S, H, Dk] queries.
      kv: [B, T, Dk] latent rows; keys are kv, values kv[..., :v_dim].
      indices: int32 [B, S, K] selected rows per query; -1 (or any t outside [0, T)) = skip.
        Duplicates are not expected; they do not fail, but how they count is unspecified.
      sm_scale: softmax scale (static).
      v_dim: value width (static), <= Dk.
      impl, interpret, q_chunk: see the package docstring. "auto" is "pallas_tpu" on TPU,
        "pallas_gpu" on GPU and "xla" elsewhere; q_chunk only applies to "xla".

    Returns:
      out: [B, S, H, v_dim] in q.dtype, softmax(sm_scale * q . kv[sel]) @ kv[sel, :v_dim].
      lse: float32 [B, S, H], log sum over the selected rows of exp(sm_scale * q . kv[t]).
      A query with no valid index gets out 0 and lse -inf. Differentiable in q and kv, with
      finite gradients also for such rows (mask the -inf lse before using it in a loss).
    """
    impl = resolve_impl("sparse_mla", impl, implemented=("reference", "xla", "pallas_tpu", "pallas_gpu"))
    if not 0 < v_dim <= kv.shape[-1]:
        raise ValueError(f"pallas_kernels.sparse_mla: v_dim={v_dim} must be in [1, {kv.shape[-1]}]")
    if impl == "pallas_tpu":
        return _attention.tpu.sparse_mla(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim, interpret=interpret)
    if impl == "pallas_gpu":
        return _attention.gpu.sparse_mla(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim, interpret=interpret)
    if impl == "reference":
        return _attention.reference.sparse_mla(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim)
    return _attention.xla.sparse_mla(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim, q_chunk=q_chunk)
