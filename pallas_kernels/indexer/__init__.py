"""The lightning indexer: scores and exact top-k selection.

`reference` is the dense oracle, `xla` the query-chunked memory-sane version, `gpu` (Triton)
and `tpu` (Mosaic) the Pallas kernels, which select by `threshold` search instead of sorting;
the public, dispatching entry points are `pallas_kernels.indexer_scores` and
`pallas_kernels.indexer_topk`."""

from pallas_kernels.indexer import gpu, reference, threshold, tpu, xla

__all__ = ["gpu", "reference", "threshold", "tpu", "xla"]
