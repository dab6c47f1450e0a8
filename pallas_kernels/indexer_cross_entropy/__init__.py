"""The indexer's sparse-stage loss over the selected set: the cross-entropy term
-sum_j target[j] log softmax_j(indexer scores at the selected keys), with its gradient into the
indexer's queries, keys and head weights.

`reference` is the dense oracle (every key's score, read at the selected slots), `xla` the
gathering, query-chunked version and `gpu` the Pallas GPU kernels with a deterministic key
gradient; the public, dispatching entry point is `pallas_kernels.indexer_cross_entropy`."""

from pallas_kernels.indexer_cross_entropy import gpu, reference, xla

__all__ = ["reference", "xla", "gpu"]
