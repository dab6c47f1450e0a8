"""The CUDA paged sparse MLA over FP8 pages (`pallas_kernels.fp8.Fp8Latent`): what the FP8
kernel takes (sparse_mla_fwd_fp8.cu; the dequantize step in sparse_mla_fp8.cuh) and its
(block_k, stages). `cuda.paged_sparse_mla` calls it when the store is an `Fp8Latent`.

The kernel gathers each selected row's 656 bytes (512 e4m3 values, 4 float32 scales, 64 bf16
rope values) into a staging ring and dequantizes a block of 32 rows into one bf16 tile,
bf16_rn(float(e4m3) * scale), which the bf16 kernel's MMA loop reads unchanged."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import fp8

#: The FP8 row the kernel takes: latent values, scales per row, rope values.
LATENT, SCALES, ROPE = 512, 512 // fp8.GROUP, 64
#: (block_k, stages) pairs compiled for FP8 rows; the first is used for a config's block_k = 64
#: (a 64-row bf16 tile and its staging ring do not fit a CTA's shared memory).
BLOCK_STAGES = ((32, 4), (32, 3))
#: The FFI target.
TARGET = "glm_paged_sparse_mla_fp8_fwd"


def block_stages(block_k: int, stages: int) -> tuple[int, int]:
    """A config's (block_k, stages) -> the pair the FP8 kernel runs: itself for block_k 32, else
    BLOCK_STAGES[0]."""
    return (block_k, stages) if (block_k, stages) in BLOCK_STAGES else BLOCK_STAGES[0]


def check_supported(q, store: fp8.Fp8Latent, v_dim: int) -> None:
    """ValueError (one line, naming the fallback) for what the FP8 kernel does not take: bf16 q
    [.., H, 576] with H a multiple of 64, values e4m3 [.., 512], scales float32 [.., 4], rope bf16
    [.., 64], v_dim 512."""
    heads, dk = q.shape[-2:]
    problems = []
    if q.dtype != jnp.bfloat16:
        problems.append(f"bf16 q (got {q.dtype})")
    fields = (store.values.dtype, store.scales.dtype, store.rope.dtype)
    widths = (store.values.shape[-1], store.scales.shape[-1], store.rope.shape[-1])
    want = (jnp.dtype(fp8.FP8), jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if fields != want or widths != (LATENT, SCALES, ROPE):
        problems.append(f"FP8 rows of {LATENT} e4m3 values, {SCALES} float32 scales and {ROPE} bf16 rope values "
                        f"(got {'/'.join(map(str, fields))} of widths {widths})")
    if dk != LATENT + ROPE:
        problems.append(f"Dk = {LATENT + ROPE} (got {dk})")
    if v_dim != LATENT:
        problems.append(f"v_dim = {LATENT} (got {v_dim})")
    if heads % 64:
        problems.append(f"a multiple of 64 heads (got {heads})")
    if problems:
        raise ValueError("pallas_kernels.paged_sparse_mla: impl='cuda' over FP8 pages takes only " +
                         ", ".join(problems) + "; use impl='pallas_gpu' (or 'auto')")
