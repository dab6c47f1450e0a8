"""dense_indexer_kl, the dense warm-up's indexer KL of an IndexShare group: reference (dense
[S, T] matrices), xla (blockwise passes, custom VJP). Pallas GPU kernels of those passes,
measured slower than xla, are outside the package (lab/dense_indexer_kl_gpu.py)."""

from pallas_kernels.dense_indexer_kl import reference, xla

__all__ = ["reference", "xla"]
