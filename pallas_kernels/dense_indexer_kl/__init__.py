"""dense_indexer_kl, the dense warm-up's indexer KL of an IndexShare group: reference (dense
[S, T] matrices), xla (blockwise passes, custom VJP), Pallas GPU (`gpu`: the kernels of those
passes; `gpu_vjp`: them as a differentiable op)."""

from pallas_kernels.dense_indexer_kl import gpu, gpu_vjp, reference, xla

__all__ = ["gpu", "gpu_vjp", "reference", "xla"]
