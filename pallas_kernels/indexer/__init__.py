"""The lightning indexer: scores and exact top-k selection.

`reference` is the dense oracle, `xla` the query-chunked memory-sane version; the public,
dispatching entry points are `pallas_kernels.indexer_scores` and `pallas_kernels.indexer_topk`."""

from pallas_kernels.indexer import reference, xla

__all__ = ["reference", "xla"]
