"""Sparse multi-head latent attention over indexer-selected rows.

`reference` is the dense masked oracle, `xla` the gathering, query-chunked version, `tpu`
(Mosaic) and `gpu` (Pallas Triton) the Pallas kernels sharing the differentiation rule in
`vjp`, `cuda` the hand-written CUDA forward (sources in cuda/) with the `gpu` backward (a
Mosaic GPU forward, measured slower, is in the repository's lab/, outside the package); the
paged decode form `paged_sparse_mla` lives beside each. The public, dispatching entry points
are the functions `pallas_kernels.sparse_mla` and `pallas_kernels.paged_sparse_mla` (the
function shadows this folder as an attribute of `pallas_kernels`: import its modules with
`from pallas_kernels.sparse_mla import gpu`)."""

from pallas_kernels.sparse_mla import gpu, reference, tpu, vjp, xla

__all__ = ["reference", "xla", "tpu", "gpu", "vjp"]
