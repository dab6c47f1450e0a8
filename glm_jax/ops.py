"""The model's only door to kernels: the `pallas_kernels` ops, run per query shard.

Layers call these, never a kernel module directly, so swapping an implementation (reference,
XLA, Pallas TPU or GPU) is one argument: `impl` (and its `config`), threaded from the model's
`KernelChoice`. Front ends list the choices with `impl_choices(op)`.

Every sparse op's output row s depends on the query-side rows s of its inputs and on all of
the keys, so under context parallelism (the ambient mesh splits the sequence,
`sharding.split_queries`) each device runs the kernel on its own queries against the complete
keys; otherwise these are the `pallas_kernels` functions themselves. Arguments and results are
those of `pallas_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

import pallas_kernels
from pallas_kernels import checks, impl_choices
from pallas_kernels.attention.vjp import RESIDUAL_NAME as SPARSE_MLA_SAVED
from glm_jax.sharding import context_size, split_queries

__all__ = ["KernelChoice", "SPARSE_MLA_SAVED", "impl_choices", "indexer_scores", "indexer_topk", "sparse_mla", "sparse_mla_backward_index",
           "indexer_cross_entropy",
           "causal_attention", "paged_indexer_topk", "paged_sparse_mla", "dense_indexer_kl"]


#: Tokens per chunk of the batch-invariant cached forward by backend. On an accelerator a decode
#: step of up to 64 sequences is one chunk: the weights are read once and padding rows cost
#: little (chunks of 256 cost 0.76-0.95x at batches 1 and 8 on an H100, docs/speculative.md).
#: On a CPU, where padding rows cost their arithmetic, 8.
INVARIANT_ROWS = {"cpu": 8, "gpu": 64, "tpu": 64}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which implementation each op uses (`impl_choices`): `indexer` for the indexer's scores and
    top-k with `indexer_config` its tuning, `attention` for sparse MLA with `attention_config`,
    `indexer_kl` for the indexer side of the sparse-stage KL (`indexer_cross_entropy`) with
    `indexer_kl_config`, `dense_kl` for the dense stage's absorbed-form indexer KL
    (`dense_indexer_kl`; "xla" by default: its "pallas_gpu" is not yet measured against it) with
    `dense_kl_config` (each config that implementation's dataclass, e.g.
    `pallas_kernels.IndexerGpuConfig`, `pallas_kernels.SparseMLAGpuConfig`,
    `pallas_kernels.IndexerKLGpuConfig`, `pallas_kernels.DenseKLXlaConfig`; None: its defaults);
    `interpret` runs Pallas kernels on the CPU.

    `batch_invariant`: the cached forward (prefill, decode, speculative verify and draft)
    computes every token the same way whatever else is in the call: all of its work, the
    attention and indexer kernels included, runs on chunks of `token_rows` tokens of one
    compiled shape (`glm_jax.row_chunks`), each token a sequence of one query to the kernels,
    the MoE experts by the "dense" dispatch, the cached rows read in one fetch mode. Greedy
    decoding then gives a prompt the same tokens alone, in any batch, and with speculation."""

    indexer: str = "auto"
    attention: str = "auto"
    interpret: bool = False
    attention_config: Any = None
    indexer_config: Any = None
    indexer_kl: str = "auto"
    indexer_kl_config: Any = None
    dense_kl: str = "xla"
    dense_kl_config: Any = None
    batch_invariant: bool = False
    invariant_rows: int | None = None

    def __post_init__(self):
        for field, op in (("indexer", "indexer_topk"), ("attention", "sparse_mla"),
                          ("indexer_kl", "indexer_cross_entropy")):
            if getattr(self, field) not in impl_choices(op):
                raise ValueError(f"KernelChoice.{field}={getattr(self, field)!r}: valid choices are "
                                 f"{', '.join(map(repr, impl_choices(op)))}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"KernelChoice.batch_invariant must be True or False, got {self.batch_invariant!r}")
        rows = self.invariant_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"KernelChoice.invariant_rows must be a positive int or None, got {rows!r}")

    @property
    def token_rows(self) -> int | None:
        """Tokens per chunk of the cached forward's work (`row_chunks.in_row_chunks`):
        invariant_rows, or by default INVARIANT_ROWS of the backend; None when not
        batch_invariant (each call runs on its whole)."""
        if not self.batch_invariant:
            return None
        return self.invariant_rows or INVARIANT_ROWS.get(jax.default_backend(), 64)


def indexer_scores(q, k, weights, *, q_pos, kv_len, kv_start=None, **static):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> float32 [B, S, T] (`pallas_kernels.indexer_scores`)."""
    checks.indexer("indexer_scores", q, k, weights, q_pos, kv_len, kv_start)
    return split_queries(functools.partial(pallas_kernels.indexer_scores, **static),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def indexer_topk(q, k, weights, *, q_pos, kv_len, kv_start=None, **static):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> int32 [B, S, topk] (`pallas_kernels.indexer_topk`)."""
    checks.indexer("indexer_topk", q, k, weights, q_pos, kv_len, kv_start)
    return split_queries(functools.partial(pallas_kernels.indexer_topk, **static),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def sparse_mla(q, kv, indices, *, tindex=None, **static):
    """q [B, S, H, Dk], kv [B, T, Dk], indices [B, S, K] -> (out [B, S, H, v_dim], lse [B, S, H]
    [, target [B, S, K]]) (`pallas_kernels.sparse_mla`); tindex from `sparse_mla_backward_index`."""
    checks.sparse_mla("sparse_mla", q, kv, indices, static.get("sm_scale"), static.get("v_dim"))
    if tindex is not None and context_size() > 1:
        raise ValueError("ops.sparse_mla: a prebuilt tindex covers every query; under context "
                         "parallelism each shard builds its own (sparse_mla_backward_index gives None)")
    return split_queries(functools.partial(pallas_kernels.sparse_mla, tindex=tindex, **static),
                         dict(q=q, indices=indices), dict(kv=kv))


def sparse_mla_backward_index(indices, num_keys, *, dk, dtype, kernels: KernelChoice, heads=None, v_dim=None):
    """indices int32 [B, S, K] -> the index `sparse_mla`'s backward sorts by
    (`pallas_kernels.sparse_mla_backward_index`), built once for the layers sharing indices;
    None where the implementation takes none, and under context parallelism (each query shard's
    backward builds its own)."""
    if context_size() > 1:
        return None
    return pallas_kernels.sparse_mla_backward_index(indices, num_keys, dk=dk, dtype=dtype, impl=kernels.attention,
                                                    config=kernels.attention_config, interpret=kernels.interpret,
                                                    heads=heads, v_dim=v_dim)


def indexer_cross_entropy(q, k, weights, indices, target, **static):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H], indices, target [B, S, K] -> float32 [B, S]
    (`pallas_kernels.indexer_cross_entropy`)."""
    checks.cross_entropy(q, k, weights, indices, target)
    return split_queries(functools.partial(pallas_kernels.indexer_cross_entropy, **static),
                         dict(q=q, weights=weights, indices=indices, target=target), dict(k=k))


def paged_indexer_topk(q, k_pages, page_table, weights, **kwargs):
    """q [B, S, H, D], k_pages [slots, pages, P, D], page_table int32 [B, n], weights [B, S, H]
    -> int32 [B, S, topk] (`pallas_kernels.paged_indexer_topk`). Not split per query shard: the
    cached forward that reads a paged store runs without a context axis."""
    return pallas_kernels.paged_indexer_topk(q, k_pages, page_table, weights, **kwargs)


def paged_sparse_mla(q, kv_pages, page_table, indices, **kwargs):
    """q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], indices [B, S, K]
    -> (out [B, S, H, v_dim], lse [B, S, H]) (`pallas_kernels.paged_sparse_mla`); not split per
    query shard, as `paged_indexer_topk`."""
    return pallas_kernels.paged_sparse_mla(q, kv_pages, page_table, indices, **kwargs)


def causal_attention(q, k, v, *, scale, kv_len=None, mask=None, segments=None):
    """q, k, v [B, S, N, d] -> [B, S, N, d]: `pallas_kernels.causal_attention` with impl "auto"
    (cuDNN's flash kernel on a GPU where it supports the dtype and head width, XLA elsewhere),
    except "xla" under context parallelism: the
    flash kernel's causal mask assumes query i is key i, while XLA splits its scores over the
    query shards. Not split per query shard: XLA partitions it."""
    impl = "xla" if context_size() > 1 else "auto"
    return pallas_kernels.causal_attention(q, k, v, scale=scale, kv_len=kv_len, mask=mask, segments=segments,
                                           impl=impl)


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, **kwargs):
    """qs L x [B, S, H, Dk], latents L x [B, S, Dk], idx_q [B, S, Hi, Di], idx_keys [B, S, Di],
    idx_w [B, S, Hi] -> float32 [B, S] (`pallas_kernels.dense_indexer_kl`). Not split per query
    shard: its queries are the keys' own rows, and XLA partitions it."""
    return pallas_kernels.dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, **kwargs)
