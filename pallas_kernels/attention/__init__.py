"""Sparse multi-head latent attention over indexer-selected rows.

`reference` is the dense masked oracle, `xla` the gathering, query-chunked version, `tpu`
(Mosaic) and `gpu` (Pallas Triton) the Pallas kernels sharing the differentiation rule in
`vjp` (`gpu_mosaic`, the paged decode forward on the Mosaic GPU backend, is not yet correct on
hardware and is imported only where asked for); the public, dispatching entry point is `pallas_kernels.sparse_mla`. (The folder is
named `attention` so that it does not shadow the function `pallas_kernels.sparse_mla`.)"""

from pallas_kernels.attention import gpu, reference, tpu, vjp, xla

__all__ = ["reference", "xla", "tpu", "gpu", "vjp"]
