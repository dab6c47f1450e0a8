"""The model's only door to kernels: re-exports the `pallas_kernels` ops.

Layers call these, never a kernel module directly, so swapping an implementation (reference,
XLA, Pallas TPU or GPU) is one argument: `impl`, threaded from the model's `KernelChoice`.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import indexer_scores, indexer_topk, sparse_mla

__all__ = ["KernelChoice", "indexer_scores", "indexer_topk", "sparse_mla"]


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which implementation each op uses; `interpret` runs Pallas kernels on the CPU."""

    indexer: str = "auto"
    attention: str = "auto"
    interpret: bool = False
