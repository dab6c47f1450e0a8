"""The model's only door to kernels: the `pallas_kernels` ops, run per query shard.

Layers call these, never a kernel module directly, so swapping an implementation (reference,
XLA, Pallas TPU or GPU) is one argument: `impl`, threaded from the model's `KernelChoice`.

Every op's output row s depends on the query-side rows s of its inputs and on all of the keys,
so under context parallelism (the ambient mesh splits the sequence, `sharding.split_queries`)
each device runs the kernel on its own queries against the complete keys; otherwise these are
the `pallas_kernels` functions themselves. Arguments and results are those of `pallas_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import pallas_kernels
from glm_jax.sharding import split_queries

__all__ = ["KernelChoice", "indexer_scores", "indexer_topk", "sparse_mla"]


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which implementation each op uses; `interpret` runs Pallas kernels on the CPU."""

    indexer: str = "auto"
    attention: str = "auto"
    interpret: bool = False


def indexer_scores(q, k, weights, *, q_pos, kv_len, kv_start=None, **static):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> float32 [B, S, T] (`pallas_kernels.indexer_scores`)."""
    return split_queries(functools.partial(pallas_kernels.indexer_scores, **static),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def indexer_topk(q, k, weights, *, q_pos, kv_len, kv_start=None, **static):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> int32 [B, S, topk] (`pallas_kernels.indexer_topk`)."""
    return split_queries(functools.partial(pallas_kernels.indexer_topk, **static),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def sparse_mla(q, kv, indices, **static):
    """q [B, S, H, Dk], kv [B, T, Dk], indices [B, S, K] -> (out [B, S, H, v_dim], lse [B, S, H])
    (`pallas_kernels.sparse_mla`)."""
    return split_queries(functools.partial(pallas_kernels.sparse_mla, **static),
                         dict(q=q, indices=indices), dict(kv=kv))
