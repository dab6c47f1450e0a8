"""Kernels outside the package, the registry and every default (not in the wheel: pyproject
packages only glm_jax and pallas_kernels). Each is tested against its reference and measured on
hardware, and each measured slower than the registry's implementation of its op, so no `impl`
selects it. They stay as working starting points for the next design, with the measurements
that retired them in their docstrings. Import them from the repository root (`PYTHONPATH=.`).

  mosaic_sparse_mla   sparse MLA forward (paged and contiguous) on the Mosaic GPU backend:
                      warp-specialised (a TMA producer warpgroup, two wgmma warpgroups)
"""
