"""Kernels outside the registry and every default: each is tested against its reference and
measured on hardware, and each measured slower than the registry's implementation of its op,
so no `impl` selects it. They stay as working starting points for the next design, with the
measurements that retired them in their docstrings.

  mosaic_sparse_mla   sparse MLA forward (paged and contiguous) on the Mosaic GPU backend:
                      warp-specialised (a TMA producer warpgroup, two wgmma warpgroups)
"""
