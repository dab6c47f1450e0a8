"""Kernels for grouped-indexer sparse attention, with interchangeable implementations.

Public ops (pure functions of arrays; jittable with the keyword-only arguments but the arrays
static):

    indexer_scores(q, k, weights, *, q_pos, kv_len, kv_start, ...)        -> float32 [B, S, T]
    indexer_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start, ...)    -> int32 [B, S, topk]
    sparse_mla(q, kv, indices, *, sm_scale, v_dim, tindex, ...) -> (out [B, S, H, v_dim], lse [B, S, H]
                                                                   [, target [B, S, K]])
    sparse_mla_backward_index(indices, num_keys, *, dk, dtype, ...)  -> its backward's index or None
    indexer_cross_entropy(q, k, weights, indices, target, ...)            -> float32 [B, S]
    causal_attention(q, k, v, *, scale, kv_len, mask, segments, ...)      -> [B, S, N, d]
    dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale, kv_len, ...) -> float32 [B, S]

Paged decode forms read a paged store ([slots, pages, P, D], `paging`) through a page table
instead of a contiguous [B, T, D] copy (forward only):

    paged_indexer_topk(q, k_pages, page_table, weights, *, topk, q_pos, kv_len, slot, ...)
                                                                          -> int32 [B, S, topk]
    paged_sparse_mla(q, kv_pages, page_table, indices, *, sm_scale, v_dim, slot, ...)
                                                                -> (out [B, S, H, v_dim], lse [B, S, H])

Their stores may be in the FP8 layout (`pallas_kernels.fp8`: `Fp8Latent` latent rows, `Fp8Keys`
indexer keys, quantized per token): the op tells it from the store's type and dequantizes the
rows it reads; `FP8_IMPLS` lists the implementations that read it ("auto" falls back to "xla"
where the backend's does not).

Every op takes
    impl       "reference" (the dense plain-jnp oracle: [B, S, T]-sized matrices; tests, small
               shapes), "xla" (memory-sane jnp or `jax.nn`), "pallas_tpu" (Mosaic TPU
               kernels), "pallas_gpu" (Pallas kernels with the Triton lowering), "cudnn"
               (cuDNN's flash attention), or "auto": the implementation of the current backend
               where the op has one (for causal_attention: where cuDNN supports the dtype
               and head width), else "xla". `impl_choices(op)` lists an op's names.
    config     the tuning knobs of that implementation, a frozen dataclass (`XlaConfig`,
               `IndexerGpuConfig`, `SparseMLAGpuConfig`, ...; None: its defaults). A config of
               another implementation is a ValueError.
    interpret  run a Pallas implementation on the CPU (tests); ignored by the plain-jnp ones,
               refused by "cudnn".
All arithmetic is float32 internally; inputs may be bfloat16. Each op checks its arguments before
tracing (`checks`: ranks, matching dimensions, integer indices / positions / lengths, float32
weights, static arguments): one ValueError or TypeError naming the argument and what was expected.

Implementations live in one folder per op, named after it: sparse_mla/ (with its paged form
and the CUDA sources), indexer_topk/ (with indexer_scores and the paged form),
indexer_cross_entropy/, causal_attention/ and dense_indexer_kl/. Each folder's name is also
the name of its public function here, which shadows the folder as an attribute of the package:
import a folder's modules with `from pallas_kernels.sparse_mla import gpu`, not
`pallas_kernels.sparse_mla.gpu`. Every implementation is listed in `registry.REGISTRY`, the
one table from which the valid names, "auto", the command-line choices and the contract tests
derive: adding an implementation is a module with the op's function and its config
dataclass, plus one entry there (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import checks, fp8, registry
from pallas_kernels import paging
from pallas_kernels._common import NoConfig, XlaConfig, start_or_zero
from pallas_kernels.sparse_mla.gpu import SparseMLAGpuConfig
from pallas_kernels.sparse_mla.tpu import SparseMLATpuConfig
from pallas_kernels.causal_attention import cudnn as _cudnn
from pallas_kernels.dense_indexer_kl.xla import DenseIndexerKLXlaConfig
from pallas_kernels.indexer_topk.gpu import IndexerGpuConfig
from pallas_kernels.indexer_topk.tpu import IndexerTpuConfig
from pallas_kernels.indexer_cross_entropy.gpu import IndexerKLGpuConfig
from pallas_kernels.registry import REGISTRY, impl_choices, resolve_impl

__all__ = ["REGISTRY", "impl_choices", "resolve_impl", "indexer_scores", "indexer_topk", "sparse_mla",
           "sparse_mla_backward_index",
           "indexer_cross_entropy", "causal_attention", "paged_indexer_topk", "paged_sparse_mla", "FP8_IMPLS",
           "NoConfig",
           "XlaConfig", "IndexerGpuConfig", "IndexerTpuConfig", "IndexerKLGpuConfig", "SparseMLAGpuConfig",
           "SparseMLATpuConfig", "dense_indexer_kl", "DenseIndexerKLXlaConfig"]

#: The implementations of the paged ops that read FP8 stores (`pallas_kernels.fp8`).
FP8_IMPLS = {"paged_sparse_mla": ("reference", "xla", "pallas_gpu", "cuda"),
             "paged_indexer_topk": ("reference", "xla", "pallas_gpu", "pallas_tpu")}


def _store_impl(op: str, store, impl: str) -> str:
    """impl for a paged op over `store`: itself for a bf16 / float32 store or an implementation in
    FP8_IMPLS; for FP8 pages "auto" falls back to "xla" where the backend's implementation does
    not read them, and a named one that does not is a ValueError."""
    if not fp8.is_fp8(store):
        return impl
    name = resolve_impl(op, impl)
    if name in FP8_IMPLS[op]:
        return impl
    if impl == registry.AUTO:
        return registry.FALLBACK
    raise ValueError(f"pallas_kernels.{op}: impl={name!r} does not read FP8 pages; the implementations that do: "
                     f"{', '.join(FP8_IMPLS[op])} (or 'auto')")


def indexer_scores(q: jax.Array, k: jax.Array, weights: jax.Array, *, q_pos: jax.Array,
                   kv_len: jax.Array, kv_start: jax.Array | None = None, impl: str = "auto",
                   config=None, interpret: bool = False) -> jax.Array:
    """Lightning-indexer scores of every key for every query.

    Args:
      q: [B, S, H, D] indexer queries.
      k: [B, T, D] indexer keys (one head shared by all query heads).
      weights: float32 [B, S, H] per-head weights, every scale folded in.
      q_pos: int32 [B, S] absolute position of each query.
      kv_len: int32 [B] number of valid keys.
      kv_start: int32 [B, S] first valid key of each query (packed documents: where the
        query's document starts), or None for 0.
      impl, config, interpret: see the package docstring.

    Returns:
      float32 [B, S, T]: score[b,s,t] = sum_h weights[b,s,h] * relu(q[b,s,h] . k[b,t]) where
      kv_start[b,s] <= t <= q_pos[b,s] and t < kv_len[b]; -inf elsewhere. Differentiable in
      q, k and weights.
    """
    checks.indexer("indexer_scores", q, k, weights, q_pos, kv_len, kv_start)
    entry, config = registry.select("indexer_scores", impl, config, interpret)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    return entry.fn(q, k, weights, q_pos=q_pos, kv_len=jnp.asarray(kv_len, jnp.int32),
                    kv_start=start_or_zero(kv_start, q_pos), config=config, interpret=interpret)


def indexer_topk(q: jax.Array, k: jax.Array, weights: jax.Array, *, topk: int, q_pos: jax.Array,
                 kv_len: jax.Array, kv_start: jax.Array | None = None, impl: str = "auto",
                 config=None, interpret: bool = False) -> jax.Array:
    """The exact top-k keys of each query under the indexer scores (see `indexer_scores`).

    Args:
      q: [B, S, H, D];  k: [B, T, D];  weights: float32 [B, S, H];
      q_pos: int32 [B, S];  kv_len: int32 [B];  kv_start: int32 [B, S] or None
        -- as in `indexer_scores`.
      topk: number of slots per query (static); may exceed T.
      impl, config, interpret: see the package docstring.

    Returns:
      int32 [B, S, topk]. Row (b, s) holds the min(topk, #valid) valid keys t (kv_start[b,s]
      <= t <= q_pos[b,s], t < kv_len[b]) with the largest scores; on equal scores the lower t
      wins. The row is ordered by descending score, equal scores by ascending t, and the
      remaining trailing slots are -1. Masked keys are never selected. Deterministic. Not
      differentiated: a function that also uses q, k or weights elsewhere can be (the
      indices count as constants).
    """
    checks.indexer("indexer_topk", q, k, weights, q_pos, kv_len, kv_start).static_int("topk", topk)
    entry, config = registry.select("indexer_topk", impl, config, interpret)
    # Indices carry no gradient; stopping it here keeps autodiff out of the kernels.
    q, k, weights = (jax.lax.stop_gradient(x) for x in (q, k, weights))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    return entry.fn(q, k, weights, topk=topk, q_pos=q_pos, kv_len=jnp.asarray(kv_len, jnp.int32),
                    kv_start=start_or_zero(kv_start, q_pos), config=config, interpret=interpret)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, impl: str = "auto", config=None, interpret: bool = False,
               tindex=None):
    """Sparse multi-query attention over one shared latent head, restricted to selected rows.

    Args:
      q: [B, S, H, Dk] queries.
      kv: [B, T, Dk] latent rows; keys are kv, values kv[..., :v_dim].
      indices: int32 [B, S, K] selected rows per query; -1 (or any t outside [0, T)) = skip.
        Duplicates are not expected; they do not fail, but how they count is unspecified.
      sm_scale: softmax scale (static).
      v_dim: value width (static), <= Dk.
      return_target: also return the indexer's training target (static).
      impl, config, interpret: see the package docstring.
      tindex: the backward's transposed index, `sparse_mla_backward_index(indices, ...)` built
        once for every layer that shares these indices (an IndexShare group); None: built in
        this call's backward where the implementation uses one.

    Returns:
      out: [B, S, H, v_dim] in q.dtype, softmax(sm_scale * q . kv[sel]) @ kv[sel, :v_dim].
      lse: float32 [B, S, H], log sum over the selected rows of exp(sm_scale * q . kv[t]).
      target (with return_target): float32 [B, S, K], the attention probabilities at each slot
        averaged over the heads, mean_h exp(sm_scale * q[h] . kv[indices[j]] - lse[h]) (the
        L1-normalised head sum over the selected set); 0 at invalid slots, all 0 in a row with
        no valid index. A constant: no gradient flows through it.
      A query with no valid index gets out 0 and lse -inf. Differentiable in q and kv, with
      finite gradients also for such rows (mask the -inf lse before using it in a loss).
    """
    checks.sparse_mla("sparse_mla", q, kv, indices, sm_scale, v_dim).static_bool("return_target", return_target)
    entry, config = registry.select("sparse_mla", impl, config, interpret)
    extra = {}
    if tindex is not None:
        if entry.backward_index is None:
            raise ValueError(f"pallas_kernels.sparse_mla: impl={impl!r} takes no tindex "
                             "(sparse_mla_backward_index returns None for it)")
        extra["tindex"] = tindex
    return entry.fn(q, kv, indices, sm_scale=sm_scale, v_dim=v_dim, return_target=bool(return_target),
                    config=config, interpret=interpret, **extra)


def sparse_mla_backward_index(indices: jax.Array, num_keys: int, *, dk: int, dtype, impl: str = "auto",
                              config=None, interpret: bool = False, heads: int | None = None,
                              v_dim: int | None = None):
    """The index `sparse_mla`'s backward sorts its key gradients by, built once for several calls.

    Layers that attend with the same indices (an IndexShare group) pass the result as
    `sparse_mla(..., tindex=)`, so the sort of B*S*K (row, slot) pairs runs once, not per layer.

    Args:
      indices: int32 [B, S, K], as given to sparse_mla.
      num_keys: T, the kv rows sparse_mla will see.
      dk, dtype: the width and dtype of those kv rows.
      impl, config, interpret: those sparse_mla will be called with.
      heads, v_dim: the queries' heads and value width, with which "auto" picks the backward
        (and so the index) that sparse_mla will pick; without them, the sorted mode's.

    Returns:
      A `sparse_mla.transpose.TransposedIndex` (dkv_mode "sorted", the TPU kernel), a
      `sparse_mla.transpose.KeyBitmap` (pallas_gpu's "by_key"), or None where the implementation's
      backward takes none (reference, xla): pass it on to
      sparse_mla.
    """
    checks.backward_index(indices, num_keys, dk)
    entry, config = registry.select("sparse_mla", impl, config, interpret)
    if entry.backward_index is None:
        return None
    return entry.backward_index(jnp.asarray(indices, jnp.int32), int(num_keys), dk=int(dk), dtype=dtype,
                                config=config, heads=heads, v_dim=v_dim)


def indexer_cross_entropy(q: jax.Array, k: jax.Array, weights: jax.Array, indices: jax.Array,
                          target: jax.Array, *, impl: str = "auto", config=None,
                          interpret: bool = False) -> jax.Array:
    """The indexer side of the selected-set KL: each query's cross-entropy of a target
    distribution over its selected slots against the indexer's softmax over them.

    Args:
      q: [B, S, H, D] indexer queries.
      k: [B, T, D] indexer keys.
      weights: float32 [B, S, H] per-head weights, every scale folded in.
      indices: int32 [B, S, K] selected keys; -1 (or any t outside [0, T)) = skip. Duplicates
        are not expected; they do not fail, but how they count is unspecified.
      target: float32 [B, S, K] non-negative weights of the slots (the head-mean attention of
        `sparse_mla(return_target=True)`, or a sum of several layers'); a constant.
      impl, config, interpret: see the package docstring.

    Returns:
      float32 [B, S]: -sum over the valid slots j of target[j] * log softmax_j(z), with
      z[j] = sum_h weights[h] * relu(q[h] . k[indices[j]]) and the softmax over the valid slots;
      0 for a query with no valid slot. Differentiable in q, k and weights (finite gradients
      everywhere, 0 for queries with no valid slot); no gradient reaches target.
    """
    checks.cross_entropy(q, k, weights, indices, target)
    entry, config = registry.select("indexer_cross_entropy", impl, config, interpret)
    return entry.fn(q, k, weights, jnp.asarray(indices, jnp.int32), target, config=config, interpret=interpret)


def paged_indexer_topk(q: jax.Array, k_pages: jax.Array, page_table: jax.Array, weights: jax.Array, *,
                       topk: int, q_pos: jax.Array, kv_len: jax.Array, slot=0, impl: str = "auto", config=None,
                       interpret: bool = False) -> jax.Array:
    """`indexer_topk` over keys kept in a paged store, read through the page table.

    Args:
      q: [B, S, H, D];  weights: float32 [B, S, H];  q_pos: int32 [B, S];  kv_len: int32 [B]
        -- as in `indexer_topk` (no kv_start: decode and chunked prefill of one document).
      k_pages: [slots, pages, P, D] (or one slot [pages, P, D]) indexer keys, or an
        `fp8.Fp8Keys` of such stores (values e4m3 [.., D], scales float32 [.., 1]).
      page_table: int32 [B, n]; key t of sequence b is k_pages[slot, page_table[b, t // P], t % P]
        for t < n * P (`pallas_kernels.paging`); every page id in [0, pages).
      slot: int or int32 scalar, the store's slot to read.
      topk, impl, config, interpret: as in `indexer_topk` (the same config classes).

    Returns:
      int32 [B, S, topk]: `indexer_topk` of the keys k[b, t] (T = n * P; FP8 keys dequantized
      to float32), cast to q's dtype.
      Not differentiated.
    """
    checks.paged_indexer(q, k_pages, page_table, weights, q_pos, kv_len, slot).static_int("topk", topk)
    impl = _store_impl("paged_indexer_topk", k_pages, impl)
    entry, config = registry.select("paged_indexer_topk", impl, config, interpret)
    k_pages = paging.as_slots(k_pages, "paged_indexer_topk")
    page_table = paging.check_page_table(page_table, q.shape[0], "paged_indexer_topk")
    return entry.fn(q, k_pages, page_table, weights, topk=topk, q_pos=jnp.asarray(q_pos, jnp.int32),
                    kv_len=jnp.asarray(kv_len, jnp.int32), slot=jnp.asarray(slot, jnp.int32), config=config,
                    interpret=interpret)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *,
                     sm_scale: float, v_dim: int, slot=0, impl: str = "auto", config=None,
                     interpret: bool = False):
    """`sparse_mla` over latent rows kept in a paged store, gathered through the page table.

    Args:
      q: [B, S, H, Dk] queries.
      kv_pages: [slots, pages, P, Dk] (or one slot [pages, P, Dk]) latent rows, or an
        `fp8.Fp8Latent` of such stores (values e4m3 [.., C], scales float32 [.., C / 128],
        rope bfloat16 [.., Dk - C]).
      page_table: int32 [B, n]; logical row t of sequence b is kv_pages[slot,
        page_table[b, t // P], t % P] for t < n * P (`pallas_kernels.paging`); every page id
        in [0, pages).
      indices: int32 [B, S, K] logical rows; -1 (or any t outside [0, n * P)) = skip.
      slot: int or int32 scalar, the store's slot to read.
      sm_scale, v_dim, impl, config, interpret: as in `sparse_mla` (the same config classes).

    Returns:
      (out [B, S, H, v_dim] in q.dtype, lse float32 [B, S, H]): `sparse_mla` of the logical
      rows kv[b, t] (FP8 rows dequantized to float32), cast to q's dtype. Forward only (decode
      reads the cache; nothing differentiates through it).
    """
    checks.paged_sparse_mla(q, kv_pages, page_table, indices, sm_scale, v_dim, slot)
    impl = _store_impl("paged_sparse_mla", kv_pages, impl)
    entry, config = registry.select("paged_sparse_mla", impl, config, interpret)
    kv_pages = paging.as_slots(kv_pages, "paged_sparse_mla")
    page_table = paging.check_page_table(page_table, q.shape[0], "paged_sparse_mla")
    return entry.fn(q, kv_pages, page_table, jnp.asarray(indices, jnp.int32), slot=jnp.asarray(slot, jnp.int32),
                    sm_scale=sm_scale, v_dim=v_dim, config=config, interpret=interpret)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     kv_len: jax.Array | None = None, mask: jax.Array | None = None,
                     segments: tuple[jax.Array, jax.Array] | None = None, impl: str = "auto",
                     config=None, interpret: bool = False) -> jax.Array:
    """Dense causal self-attention of whole sequences (query s sits at key s).

    Args:
      q, k, v: [B, S, N, d], one head width d for all three.
      scale: softmax scale (static).
      kv_len: int32 [B] valid keys per sequence, or None for S.
      mask: bool [B, S, S] or None: further restricts the keys of each query (packed
        documents: query s sees key t only inside its own document).
      segments: the same documents in the packed layout of fused kernels, (offsets int32
        [B, M + 1]: where segment m starts, -1 after a row's last one; lengths int32 [B, M]),
        or None. The "cudnn" impl then runs cuDNN's packed kernel and builds no mask; the
        others use `mask`, or the segments' mask when mask is None.
      impl, config, interpret: see the package docstring; "auto" is "cudnn" on a GPU where
        `causal_attention.cudnn.supports` the dtype and head width, else "xla".

    Returns:
      [B, S, N, d] in q.dtype: softmax over the visible keys t (t <= s, t < kv_len[b], and
      inside the documents) of scale * q[b,s,n] . k[b,t,n], times v[b,t,n]. Rows s >= kv_len[b]
      and rows that see no key are unspecified (finite). Differentiable in q, k and v.
    """
    checks.causal_attention(q, k, v, scale, kv_len, mask, segments)
    if impl == registry.AUTO and resolve_impl("causal_attention", impl) == "cudnn" \
            and not _cudnn.supports(q.shape[-1], q.dtype):
        impl = registry.FALLBACK
    entry, config = registry.select("causal_attention", impl, config, interpret)
    return entry.fn(q, k, v, scale=scale, kv_len=kv_len, mask=mask, segments=segments, config=config,
                    interpret=interpret)


def dense_indexer_kl(qs, latents, idx_q: jax.Array, idx_keys: jax.Array, idx_w: jax.Array, *, sm_scale: float,
                     kv_len: jax.Array, kv_start: jax.Array | None = None, shares=None, impl: str = "auto",
                     config=None, interpret: bool = False) -> jax.Array:
    """The dense warm-up's indexer KL of an IndexShare group, per query, without [S, S] arrays
    (but impl="reference").

    Layer j of the group (weight share_j) attends causally with its absorbed queries q_jh over
    its latent rows c_t: p_jh,t = softmax_t(sm_scale q_jh . c_t) over the visible keys, and
    t_j = mean_h p_jh is the target it sets the indexer, whose scores are
    s_t = sum_h idx_w_h relu(idx_q_h . idx_keys_t). Key t is visible to query s (the queries
    are the sequence's own rows) iff kv_start[s] <= t <= s and t < kv_len.

    Args:
      qs: L arrays [B, S, H, Dk], the layers' absorbed queries (constants: no gradient).
      latents: L arrays [B, S, Dk], their latent rows (constants).
      idx_q: [B, S, Hi, Di] indexer queries;  idx_keys: [B, S, Di] indexer keys;
      idx_w: [B, S, Hi] indexer head weights (every scale folded in).
      sm_scale: the attention's softmax scale (static).
      kv_len: int32 [B] valid keys (capped at S).
      kv_start: int32 [B, S] the row where each query's document starts, or None for 0.
      shares: one weight per layer (static), default 1 / L each.
      impl, config, interpret: see the package docstring ("auto" takes "xla" everywhere; Pallas
        GPU kernels, measured slower, are in the repository's lab/, outside the package).

    Returns:
      float32 [B, S]: per query sum_j share_j sum_t t_j,t log t_j,t - sum_t tbar_t s_t + LSE_s
      with tbar = sum_j share_j t_j and LSE_s the log-sum-exp of s over the visible keys (0
      where no key is visible); with shares summing to 1 that is sum_j share_j KL(t_j ||
      softmax(s)). Differentiable in idx_q, idx_keys and idx_w (d/ds_t = softmax(s)_t - tbar_t);
      no gradient reaches qs or latents.
    """
    qs, latents = tuple(qs), tuple(latents)
    shares = checks.dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale, kv_len, kv_start, shares)
    entry, config = registry.select("dense_indexer_kl", impl, config, interpret)
    seq_len = idx_q.shape[1]
    qs = tuple(jax.lax.stop_gradient(q) for q in qs)
    latents = tuple(jax.lax.stop_gradient(c.astype(q.dtype)) for c, q in zip(latents, qs))
    kv_len = jnp.minimum(jnp.asarray(kv_len, jnp.int32), seq_len)
    kv_start = None if kv_start is None else jnp.asarray(kv_start, jnp.int32)
    return entry.fn(qs, latents, idx_q, idx_keys, idx_w.astype(jnp.float32), sm_scale=float(sm_scale),
                    kv_len=kv_len, kv_start=kv_start, shares=shares, config=config, interpret=interpret)
