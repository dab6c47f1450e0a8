"""Sparse multi-head latent attention over indexer-selected rows.

`reference` is the dense masked oracle, `xla` the gathering, query-chunked version; the
public, dispatching entry point is `pallas_kernels.sparse_mla`. (The folder is named
`attention` so that it does not shadow the function `pallas_kernels.sparse_mla`.)"""

from pallas_kernels.attention import reference, xla

__all__ = ["reference", "xla"]
