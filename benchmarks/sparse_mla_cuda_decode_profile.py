"""The CUDA paged sparse-MLA decode, bf16 then FP8 pages, as a workload for Nsight Compute.

    ncu --target-processes all -k regex:sparse_mla_fwd --launch-skip 1 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section MemoryWorkloadAnalysis python3 benchmarks/sparse_mla_cuda_decode_profile.py

GLM-5.2's decode shape (64 heads, Dk 576 = 512 latent + 64 rope, top-k 2048, one query a
sequence) at batch 64 and 128K context: page tables point at random into a pool of 8,192 pages
of 64 rows (604 MB of bf16 rows, far above the L2 cache), the same rows quantized for the FP8
store (`fp8.quantize_latent`). Each layout's decode runs twice (the first call compiles), so
`--launch-skip 1 --launch-count 2` profiles bf16's second launch and FP8's first; the split
count is the kernel's default (`cuda.default_splits`). Needs a GPU and the built CUDA library
(scripts/build_cuda_kernels.sh). The timing against the copy bandwidth is
benchmarks/sparse_mla_cuda.py's; this script only gives the profiler one launch of each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import fp8

BATCH, CONTEXT, TOPK, HEADS, DK, DV, PAGE, POOL = 64, 131072, 2048, 64, 576, 512, 64, 8192


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    bf16 = jax.random.normal(keys[0], (1, POOL, PAGE, DK), jnp.bfloat16)
    stores = {"bf16": bf16, "fp8": jax.jit(lambda s: fp8.quantize_latent(s, DV))(bf16)}
    q = jax.random.normal(keys[1], (BATCH, 1, HEADS, DK), jnp.bfloat16)
    table = jax.random.randint(keys[2], (BATCH, CONTEXT // PAGE), 0, POOL, jnp.int32)
    idx = jax.random.randint(keys[3], (BATCH, 1, TOPK), 0, CONTEXT, jnp.int32)
    decode = jax.jit(lambda q, s, t, i: pk.paged_sparse_mla(q, s, t, i, sm_scale=0.04, v_dim=DV, impl="cuda"))
    for layout, store in stores.items():
        for _ in range(2):
            jax.block_until_ready(decode(q, store, table, idx))
        print(f"{layout}: decoded batch {BATCH} at {CONTEXT} tokens", flush=True)


if __name__ == "__main__":
    main()
