"""The lightning indexer: scores and exact top-k selection.

`reference` is the dense oracle, `xla` the query-chunked memory-sane version, `gpu` (Triton)
and `tpu` (Mosaic) the Pallas kernels, which select by `threshold` search instead of sorting
and share their top-k driver and differentiable scores (`pallas_ops`); the public, dispatching
entry points are `pallas_kernels.indexer_scores` and `pallas_kernels.indexer_topk`."""

from pallas_kernels.indexer_topk import gpu, pallas_ops, reference, threshold, tpu, xla

__all__ = ["gpu", "pallas_ops", "reference", "threshold", "tpu", "xla"]
