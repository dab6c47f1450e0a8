"""The one table of kernel implementations: `REGISTRY[op][impl]`.

Everything that lists implementations derives from it: `resolve_impl` (the valid names of an
op and what "auto" picks), `impl_choices` (command-line choices), the config check of the
public ops, and the contract tests (tests/test_kernel_contract.py runs every entry against
numpy oracles of the contracts). Adding an implementation is one entry here plus its config
dataclass (docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from pallas_kernels import checks
from pallas_kernels._common import NoConfig, XlaConfig
from pallas_kernels.causal_attention import cudnn as causal_cudnn, reference as causal_reference, xla as causal_xla
from pallas_kernels.dense_indexer_kl import reference as dense_indexer_kl_reference, xla as dense_indexer_kl_xla
from pallas_kernels.indexer_cross_entropy import gpu as cross_entropy_gpu, reference as cross_entropy_reference
from pallas_kernels.indexer_cross_entropy import xla as cross_entropy_xla
from pallas_kernels.indexer_topk import gpu as indexer_gpu, pallas_ops as indexer_pallas_ops
from pallas_kernels.indexer_topk import reference as indexer_reference, tpu as indexer_tpu, xla as indexer_xla
from pallas_kernels.sparse_mla import cuda as mla_cuda, gpu as mla_gpu, reference as mla_reference
from pallas_kernels.sparse_mla import tpu as mla_tpu, xla as mla_xla

#: The name that picks an implementation by backend.
AUTO = "auto"
#: What "auto" picks where the backend has no implementation of its own.
FALLBACK = "xla"


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    fn: takes the op's arguments (those of the public function, but `impl`) and the keyword
      arguments `config` (an instance of `config`) and `interpret`.
    config: its tuning knobs, a frozen dataclass whose fields all have defaults.
    platform: the jax backend ("tpu", "gpu") on which "auto" picks it; None: a portable one.
    interpretable: whether it runs on a CPU (plain jnp, or Pallas with interpret=True); a
      vendor library (cuDNN) runs only on its platform.
    backward_index: (sparse_mla) builds the transposed index its backward takes,
      fn(indices, num_keys, *, dk, dtype, config) -> TransposedIndex or None, so that layers
      sharing indices build it once (`fn`'s `tindex=`); None: the implementation takes none.
    auto: whether "auto" picks it on its platform (False where it measured slower there than
      the portable implementation, which "auto" then takes)."""

    fn: Callable
    config: type
    platform: str | None = None
    interpretable: bool = True
    backward_index: Callable | None = None
    auto: bool = True


def _pallas_scores(scores_fn: Callable) -> Callable:
    """The differentiable `indexer_scores` of a backend's Pallas scores kernel."""
    return functools.partial(indexer_pallas_ops.indexer_scores, scores_fn=scores_fn)


REGISTRY: dict[str, dict[str, Implementation]] = {
    "indexer_scores": {
        "reference": Implementation(indexer_reference.indexer_scores, NoConfig),
        "xla": Implementation(indexer_xla.indexer_scores, XlaConfig),
        "pallas_tpu": Implementation(_pallas_scores(indexer_tpu.scores), indexer_tpu.IndexerTpuConfig, "tpu"),
        "pallas_gpu": Implementation(_pallas_scores(indexer_gpu.scores), indexer_gpu.IndexerGpuConfig, "gpu"),
    },
    "indexer_topk": {
        "reference": Implementation(indexer_reference.indexer_topk, NoConfig),
        "xla": Implementation(indexer_xla.indexer_topk, XlaConfig),
        "pallas_tpu": Implementation(indexer_tpu.indexer_topk, indexer_tpu.IndexerTpuConfig, "tpu"),
        "pallas_gpu": Implementation(indexer_gpu.indexer_topk, indexer_gpu.IndexerGpuConfig, "gpu"),
    },
    "sparse_mla": {
        "reference": Implementation(mla_reference.sparse_mla, NoConfig),
        "xla": Implementation(mla_xla.sparse_mla, XlaConfig),
        "pallas_tpu": Implementation(mla_tpu.sparse_mla, mla_tpu.SparseMLATpuConfig, "tpu",
                                     backward_index=mla_tpu.backward_index),
        "pallas_gpu": Implementation(mla_gpu.sparse_mla, mla_gpu.SparseMLAGpuConfig, "gpu",
                                     backward_index=mla_gpu.backward_index),
        # hand-written CUDA forward and backward through the XLA FFI (scripts/build_cuda_kernels.sh
        # builds them; docs/kernels-sparse-mla.md has their H100 figures). "auto" keeps pallas_gpu:
        # the CUDA forward returns no indexer target, which the sparse stage's KL needs
        "cuda": Implementation(mla_cuda.sparse_mla, mla_cuda.SparseMLACudaConfig, "gpu",
                               interpretable=False, backward_index=mla_cuda.backward_index, auto=False),
    },
    "indexer_cross_entropy": {
        "reference": Implementation(cross_entropy_reference.indexer_cross_entropy, NoConfig),
        "xla": Implementation(cross_entropy_xla.indexer_cross_entropy, XlaConfig),
        "pallas_gpu": Implementation(cross_entropy_gpu.indexer_cross_entropy, cross_entropy_gpu.IndexerKLGpuConfig, "gpu"),
    },
    "paged_indexer_topk": {
        "reference": Implementation(indexer_reference.paged_indexer_topk, NoConfig),
        "xla": Implementation(indexer_xla.paged_indexer_topk, XlaConfig),
        "pallas_tpu": Implementation(indexer_tpu.paged_indexer_topk, indexer_tpu.IndexerTpuConfig, "tpu"),
        "pallas_gpu": Implementation(indexer_gpu.paged_indexer_topk, indexer_gpu.IndexerGpuConfig, "gpu"),
    },
    "paged_sparse_mla": {
        "reference": Implementation(mla_reference.paged_sparse_mla, NoConfig),
        "xla": Implementation(mla_xla.paged_sparse_mla, XlaConfig),
        "pallas_tpu": Implementation(mla_tpu.paged_sparse_mla, mla_tpu.SparseMLATpuConfig, "tpu"),
        "pallas_gpu": Implementation(mla_gpu.paged_sparse_mla, mla_gpu.SparseMLAGpuConfig, "gpu"),
        "cuda": Implementation(mla_cuda.paged_sparse_mla, mla_cuda.SparseMLACudaConfig, "gpu",
                               interpretable=False, auto=False),
    },
    "causal_attention": {
        "reference": Implementation(causal_reference.causal_attention, NoConfig),
        "xla": Implementation(causal_xla.causal_attention, NoConfig),
        "cudnn": Implementation(causal_cudnn.causal_attention, NoConfig, "gpu", interpretable=False),
    },
    "dense_indexer_kl": {
        "reference": Implementation(dense_indexer_kl_reference.dense_indexer_kl, NoConfig),
        "xla": Implementation(dense_indexer_kl_xla.dense_indexer_kl, dense_indexer_kl_xla.DenseIndexerKLXlaConfig),
    },
}


def _entries(op: str) -> dict[str, Implementation]:
    try:
        return REGISTRY[op]
    except KeyError:
        raise ValueError(f"pallas_kernels: unknown op {op!r}; the ops are {', '.join(REGISTRY)}") from None


def impl_choices(op: str) -> tuple[str, ...]:
    """Every valid `impl` of op: "auto", then its implementations in registry order (for
    command-line choices)."""
    return (AUTO,) + tuple(_entries(op))


def resolve_impl(op: str, impl: str) -> str:
    """The implementation `impl` names for op: itself, or for "auto" the first one whose platform
    is the current backend (and that "auto" may pick), else FALLBACK. Raises ValueError listing the valid choices for a
    name the op does not have."""
    entries = _entries(op)
    if impl == AUTO:
        backend = jax.default_backend()
        return next((name for name, entry in entries.items() if entry.platform == backend and entry.auto),
                    FALLBACK)
    if not isinstance(impl, str) or impl not in entries:
        choices = ", ".join(repr(c) for c in impl_choices(op))
        raise ValueError(f"pallas_kernels.{op}: unknown impl {impl!r}; valid choices are {choices}")
    return impl


def select(op: str, impl: str, config, interpret: bool):
    """-> (the Implementation that `impl` names for op, its config: `config`, or the default one
    when None). Raises ValueError for a config of another implementation, and for interpret=True
    with an implementation that cannot run on a CPU."""
    name = resolve_impl(op, impl)
    entry = REGISTRY[op][name]
    if config is None:
        config = entry.config()
    elif type(config) is not entry.config:
        via = f" ({AUTO!r} resolved to {name!r} here)" if impl == AUTO else ""
        raise ValueError(f"pallas_kernels.{op}: impl={name!r}{via} takes config={entry.config.__name__}(...), "
                         f"got {type(config).__name__}; pass the config of the implementation you name")
    if interpret and not entry.interpretable:
        raise ValueError(f"pallas_kernels.{op}: impl={name!r} has no interpret mode; it runs only on "
                         f"{entry.platform}")
    checks.runnable(op, name, entry.platform, entry.interpretable, interpret)
    return entry, config
