"""Dense causal attention over whole sequences (training without sparse selection).

`reference` is the plain-jnp oracle, `xla` is `jax.nn.dot_product_attention` in XLA, and
`cudnn` is cuDNN's flash attention, with the packed-documents layout behind one guarded use of
JAX's private cuDNN module; the public, dispatching entry point is
`pallas_kernels.causal_attention`."""

from pallas_kernels.causal_attention import cudnn, reference, xla

__all__ = ["cudnn", "reference", "xla"]
