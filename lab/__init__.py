"""Kernels outside the package, the registry and every default (not in the wheel: pyproject
packages only glm_jax and pallas_kernels). Each is tested against its reference and measured on
hardware, and each measured slower than the registry's implementation of its op, so no `impl`
selects it (a benchmark may register one for its run: `dense_indexer_kl_gpu_vjp.registered()`).
They stay as working starting points for the next design, with the measurements that retired
them in their docstrings. Import them from the repository root (`PYTHONPATH=.`). They may
import pallas_kernels; the package never imports them.

  mosaic_sparse_mla       sparse MLA forward (paged and contiguous) on the Mosaic GPU backend:
                          warp-specialised (a TMA producer warpgroup, two wgmma warpgroups)
  dense_indexer_kl_gpu    the dense warm-up's indexer KL as Pallas GPU (Triton) kernels: forward
                          1.4-1.6x faster than the xla impl on an H100, forward + backward
                          1.7-1.8x slower
  dense_indexer_kl_gpu_vjp  those kernels as a differentiable op; registered(): impl
                          "pallas_gpu" of pallas_kernels.dense_indexer_kl inside a with block
"""
