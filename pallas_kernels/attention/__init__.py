"""Sparse multi-head latent attention over indexer-selected rows.

`reference` is the dense masked oracle, `xla` the gathering, query-chunked version, `tpu`
(Mosaic) and `gpu` (Pallas Triton) the Pallas kernels sharing the differentiation rule in
`vjp` (a Mosaic GPU forward, measured slower, is in `pallas_kernels.experimental`); the public,
dispatching entry point is `pallas_kernels.sparse_mla`. (The folder is
named `attention` so that it does not shadow the function `pallas_kernels.sparse_mla`.)"""

from pallas_kernels.attention import gpu, reference, tpu, vjp, xla

__all__ = ["reference", "xla", "tpu", "gpu", "vjp"]
