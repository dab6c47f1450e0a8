"""The model's only door to kernels: the `pallas_kernels` ops, run per query shard, and the one
glm_jax module that imports `pallas_kernels` (tests/test_layering.py checks it).

Layers call these, never a kernel module directly, so swapping an implementation (reference,
XLA, Pallas TPU or GPU) is one entry of the model's `KernelChoice`: every op here takes
`kernels` and reads its own entry (`impl`, `config`) and the choice's `interpret`. Front ends
list the choices with `impl_choices(op)`. What else of `pallas_kernels` the library needs
passes through here: the FP8 cache layout (`fp8`), the query chunking of the losses
(`choose_q_chunk`, `map_query_chunks`, `split_query_chunks`) and the registry's names
(`resolve_impl`, `config_type`).

Every sparse op's output row s depends on the query-side rows s of its inputs and on all of
the keys, so under context parallelism (the ambient mesh splits the sequence,
`sharding.split_queries`) each device runs the kernel on its own queries against the complete
keys; otherwise these are the `pallas_kernels` functions themselves. Arguments and results are
those of `pallas_kernels`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

import pallas_kernels
from pallas_kernels import FP8_IMPLS, checks, fp8, impl_choices, registry, resolve_impl
from pallas_kernels.chunking import choose_q_chunk, map_query_chunks, split_query_chunks
from pallas_kernels.sparse_mla.vjp import RESIDUAL_NAME as SPARSE_MLA_SAVED
from glm_jax.sharding import context_size, split_queries

__all__ = ["KernelChoice", "OpChoice", "OPS", "FP8_IMPLS", "SPARSE_MLA_SAVED", "impl_choices", "resolve_impl", "config_type",
           "fp8", "choose_q_chunk", "map_query_chunks", "split_query_chunks", "indexer_scores", "indexer_topk",
           "sparse_mla", "sparse_mla_backward_index", "indexer_cross_entropy", "causal_attention",
           "paged_indexer_topk", "paged_sparse_mla", "dense_indexer_kl"]

#: The ops a KernelChoice names, each one folder of pallas_kernels. indexer_topk's entry also
#: runs indexer_scores and paged_indexer_topk; sparse_mla's its backward index and
#: paged_sparse_mla.
OPS = ("sparse_mla", "indexer_topk", "indexer_cross_entropy", "causal_attention", "dense_indexer_kl")
#: The implementation of an op a KernelChoice leaves out ("auto" for the others): the dense
#: stage's KL runs its XLA form (Pallas GPU kernels of it measured slower and are in lab/,
#: outside the package: docs/training.md).
DEFAULT_IMPL = {"dense_indexer_kl": "xla"}

#: Tokens per chunk of the batch-invariant cached forward by backend. On an accelerator a decode
#: step of up to 64 sequences is one chunk: the weights are read once and padding rows cost
#: little (chunks of 256 cost 0.76-0.95x at batches 1 and 8 on an H100, docs/speculative.md).
#: On a CPU, where padding rows cost their arithmetic, 8.
INVARIANT_ROWS = {"cpu": 8, "gpu": 64, "tpu": 64}


def config_type(op: str, impl: str) -> type:
    """The config dataclass of op's implementation `impl` ("auto" resolved on this backend)."""
    return registry.REGISTRY[op][resolve_impl(op, impl)].config


class OpChoice(NamedTuple):
    """One op's implementation (`impl_choices(op)`) and its config: that implementation's
    dataclass (`pallas_kernels.XlaConfig`, `SparseMLAGpuConfig`, ...), or None for its defaults."""

    impl: str = "auto"
    config: Any = None


class KernelChoice(Mapping):
    """Which implementation each op runs: a frozen, hashable mapping op (`OPS`) -> `OpChoice`,
    with settings of the whole choice. Build it with keyword arguments, one per op that does not
    take its default (an impl name, or an OpChoice / (impl, config) pair):

        KernelChoice(sparse_mla="pallas_gpu", indexer_topk=OpChoice("xla", XlaConfig(q_chunk=8)))

    An op left out runs "auto" with its defaults (`DEFAULT_IMPL`: "xla" for dense_indexer_kl).
    An unknown op, an impl the op does not have or the config of another implementation is a
    ValueError. `replace(**changes)` gives a copy with some ops or settings changed.

    `interpret` runs Pallas kernels on the CPU.

    `batch_invariant`: the cached forward (prefill, decode, speculative verify and draft)
    computes every token the same way whatever else is in the call: all of its work, the
    attention and indexer kernels included, runs on chunks of `token_rows` tokens of one
    compiled shape (`glm_jax.row_chunks`), each token a sequence of one query to the kernels,
    the MoE experts by the "dense" dispatch, the cached rows read in one fetch mode. Greedy
    decoding then gives a prompt the same tokens alone, in any batch, and with speculation.
    `invariant_rows`: that chunk's tokens (None: `INVARIANT_ROWS` of the backend)."""

    __slots__ = ("_ops", "interpret", "batch_invariant", "invariant_rows")

    def __init__(self, *, interpret: bool = False, batch_invariant: bool = False, invariant_rows: int | None = None,
                 **ops):
        unknown = sorted(set(ops) - set(OPS))
        if unknown:
            raise ValueError(f"KernelChoice: unknown op {unknown[0]!r}; the ops are {', '.join(OPS)}")
        entries = tuple(_op_choice(op, ops.get(op, OpChoice(DEFAULT_IMPL.get(op, "auto")))) for op in OPS)
        if not isinstance(interpret, bool):
            raise TypeError(f"KernelChoice.interpret must be True or False, got {interpret!r}")
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"KernelChoice.batch_invariant must be True or False, got {batch_invariant!r}")
        rows = invariant_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"KernelChoice.invariant_rows must be a positive int or None, got {rows!r}")
        for name, value in (("_ops", entries), ("interpret", interpret), ("batch_invariant", batch_invariant),
                            ("invariant_rows", invariant_rows)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"KernelChoice is frozen; use .replace({name}=...)")

    def __getitem__(self, op: str) -> OpChoice:
        try:
            return self._ops[OPS.index(op)]
        except ValueError:
            raise KeyError(f"KernelChoice: unknown op {op!r}; the ops are {', '.join(OPS)}") from None

    def __iter__(self):
        return iter(OPS)

    def __len__(self) -> int:
        return len(OPS)

    def _key(self) -> tuple:
        return self._ops, self.interpret, self.batch_invariant, self.invariant_rows

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelChoice) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        changed = [f"{op}={entry!r}" for op, entry in self.items() if entry != (DEFAULT_IMPL.get(op, "auto"), None)]
        settings = [f"{name}={getattr(self, name)!r}" for name, default in
                    (("interpret", False), ("batch_invariant", False), ("invariant_rows", None))
                    if getattr(self, name) != default]
        return f"KernelChoice({', '.join(changed + settings)})"

    def __reduce__(self):
        return functools.partial(KernelChoice, **self._kwargs()), ()

    def _kwargs(self) -> dict:
        return dict(self.items(), interpret=self.interpret, batch_invariant=self.batch_invariant,
                    invariant_rows=self.invariant_rows)

    def replace(self, **changes) -> "KernelChoice":
        """A copy with the ops and settings of `changes` (as the constructor takes them) changed."""
        return KernelChoice(**{**self._kwargs(), **changes})

    def impl_args(self, op: str) -> dict:
        """The keyword arguments `impl`, `config`, `interpret` of op's entry, for pallas_kernels."""
        impl, config = self[op]
        return dict(impl=impl, config=config, interpret=self.interpret)

    @property
    def token_rows(self) -> int | None:
        """Tokens per chunk of the cached forward's work (`row_chunks.in_row_chunks`):
        invariant_rows, or by default INVARIANT_ROWS of the backend; None when not
        batch_invariant (each call runs on its whole)."""
        if not self.batch_invariant:
            return None
        return self.invariant_rows or INVARIANT_ROWS.get(jax.default_backend(), 64)


def _op_choice(op: str, value) -> OpChoice:
    """An op's entry from an impl name, an OpChoice or an (impl, config) pair, checked: the impl
    one of `impl_choices(op)`, a config of the implementation it names (any for "auto", which
    `kernel_configs.configured` resolves before setting one)."""
    impl, config = (value, None) if isinstance(value, str) else value
    if impl not in impl_choices(op):
        raise ValueError(f"KernelChoice {op}={impl!r}: valid choices are {', '.join(map(repr, impl_choices(op)))}")
    if config is not None and impl != registry.AUTO and type(config) is not config_type(op, impl):
        raise ValueError(f"KernelChoice {op}={impl!r} takes config={config_type(op, impl).__name__}(...), "
                         f"got {type(config).__name__}")
    return OpChoice(impl, config)


DEFAULT_KERNELS = KernelChoice()


def indexer_scores(q, k, weights, *, q_pos, kv_len, kv_start=None, kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> float32 [B, S, T] (`pallas_kernels.indexer_scores`;
    kernels["indexer_topk"] picks the implementation)."""
    checks.indexer("indexer_scores", q, k, weights, q_pos, kv_len, kv_start)
    return split_queries(functools.partial(pallas_kernels.indexer_scores, **kernels.impl_args("indexer_topk")),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def indexer_topk(q, k, weights, *, topk, q_pos, kv_len, kv_start=None, kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H] -> int32 [B, S, topk] (`pallas_kernels.indexer_topk`)."""
    checks.indexer("indexer_topk", q, k, weights, q_pos, kv_len, kv_start)
    return split_queries(functools.partial(pallas_kernels.indexer_topk, topk=topk, **kernels.impl_args("indexer_topk")),
                         dict(q=q, weights=weights, q_pos=q_pos, kv_start=kv_start), dict(k=k, kv_len=kv_len))


def sparse_mla(q, kv, indices, *, sm_scale, v_dim, tindex=None, return_target=False,
               kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, Dk], kv [B, T, Dk], indices [B, S, K] -> (out [B, S, H, v_dim], lse [B, S, H]
    [, target [B, S, K]]) (`pallas_kernels.sparse_mla`); tindex from `sparse_mla_backward_index`."""
    checks.sparse_mla("sparse_mla", q, kv, indices, sm_scale, v_dim)
    if tindex is not None and context_size() > 1:
        raise ValueError("ops.sparse_mla: a prebuilt tindex covers every query; under context "
                         "parallelism each shard builds its own (sparse_mla_backward_index gives None)")
    return split_queries(functools.partial(pallas_kernels.sparse_mla, sm_scale=sm_scale, v_dim=v_dim, tindex=tindex,
                                           return_target=return_target, **kernels.impl_args("sparse_mla")),
                         dict(q=q, indices=indices), dict(kv=kv))


def sparse_mla_backward_index(indices, num_keys, *, dk, dtype, kernels: KernelChoice = DEFAULT_KERNELS, heads=None,
                              v_dim=None):
    """indices int32 [B, S, K] -> the index `sparse_mla`'s backward sorts by
    (`pallas_kernels.sparse_mla_backward_index`), built once for the layers sharing indices;
    None where the implementation takes none, and under context parallelism (each query shard's
    backward builds its own)."""
    if context_size() > 1:
        return None
    return pallas_kernels.sparse_mla_backward_index(indices, num_keys, dk=dk, dtype=dtype, heads=heads, v_dim=v_dim,
                                                    **kernels.impl_args("sparse_mla"))


def indexer_cross_entropy(q, k, weights, indices, target, *, kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, D], k [B, T, D], weights [B, S, H], indices, target [B, S, K] -> float32 [B, S]
    (`pallas_kernels.indexer_cross_entropy`)."""
    checks.cross_entropy(q, k, weights, indices, target)
    return split_queries(functools.partial(pallas_kernels.indexer_cross_entropy,
                                           **kernels.impl_args("indexer_cross_entropy")),
                         dict(q=q, weights=weights, indices=indices, target=target), dict(k=k))


def paged_indexer_topk(q, k_pages, page_table, weights, *, topk, q_pos, kv_len, slot=0,
                       kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, D], k_pages [slots, pages, P, D], page_table int32 [B, n], weights [B, S, H]
    -> int32 [B, S, topk] (`pallas_kernels.paged_indexer_topk`; kernels["indexer_topk"]). Not
    split per query shard: the cached forward that reads a paged store runs without a context
    axis."""
    return pallas_kernels.paged_indexer_topk(q, k_pages, page_table, weights, topk=topk, q_pos=q_pos, kv_len=kv_len,
                                             slot=slot, **kernels.impl_args("indexer_topk"))


def paged_sparse_mla(q, kv_pages, page_table, indices, *, sm_scale, v_dim, slot=0,
                     kernels: KernelChoice = DEFAULT_KERNELS):
    """q [B, S, H, Dk], kv_pages [slots, pages, P, Dk], page_table int32 [B, n], indices [B, S, K]
    -> (out [B, S, H, v_dim], lse [B, S, H]) (`pallas_kernels.paged_sparse_mla`;
    kernels["sparse_mla"]); not split per query shard, as `paged_indexer_topk`."""
    return pallas_kernels.paged_sparse_mla(q, kv_pages, page_table, indices, sm_scale=sm_scale, v_dim=v_dim,
                                           slot=slot, **kernels.impl_args("sparse_mla"))


def causal_attention(q, k, v, *, scale, kv_len=None, mask=None, segments=None,
                     kernels: KernelChoice = DEFAULT_KERNELS):
    """q, k, v [B, S, N, d] -> [B, S, N, d]: `pallas_kernels.causal_attention` by
    kernels["causal_attention"] ("auto": cuDNN's flash kernel on a GPU where it supports the
    dtype and head width, XLA elsewhere). Under context parallelism "auto" runs "xla" and
    "cudnn" is refused: the flash kernel's causal mask assumes query i is key i, while XLA
    splits its scores over the query shards. Not split per query shard: XLA partitions it."""
    args = kernels.impl_args("causal_attention")
    if context_size() > 1 and args["impl"] not in ("xla", "reference"):
        if args["impl"] != registry.AUTO:
            raise ValueError(f"ops.causal_attention: impl={args['impl']!r} does not run under context parallelism "
                             f"(its causal mask assumes query i is key i); use 'xla' or 'auto'")
        args.update(impl="xla", config=None)
    return pallas_kernels.causal_attention(q, k, v, scale=scale, kv_len=kv_len, mask=mask, segments=segments, **args)


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale, kv_len, kv_start=None, shares=None,
                     kernels: KernelChoice = DEFAULT_KERNELS):
    """qs L x [B, S, H, Dk], latents L x [B, S, Dk], idx_q [B, S, Hi, Di], idx_keys [B, S, Di],
    idx_w [B, S, Hi] -> float32 [B, S] (`pallas_kernels.dense_indexer_kl`). Not split per query
    shard: its queries are the keys' own rows, and XLA partitions it."""
    return pallas_kernels.dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale=sm_scale, kv_len=kv_len,
                                           kv_start=kv_start, shares=shares, **kernels.impl_args("dense_indexer_kl"))
