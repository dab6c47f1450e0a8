"""The FP8 latent store's block load of the paged sparse-MLA GPU kernel (`gpu.py`): the rows a
block selects, gathered field by field from an `pallas_kernels.fp8.Fp8Latent` and dequantized in
registers. Each 128-value group of e4m3 values [block_k, 128] is loaded with its float32 scale
[block_k] (one scalar-column gather) and multiplied in float32; the kernel casts the rows to
q's dtype before its dots. Triton-lowered Pallas cannot broadcast a [block_k, 4] scale tile over
[block_k, 512] columns without a reshape, hence one column chunk per scale group."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fp8


def load_block(idx_ref, pt_ref, kv_ref, scales_ref, rope_ref, *, b, slot, row, k0, block_k, page_size, num_keys,
               chunks):
    """`gpu._load_paged_block` over an FP8 store: kv_ref the e4m3 values [slots, pages, P, C],
    scales_ref float32 [.., C / 128], rope_ref bf16 [.., R]. chunks: the 128-wide groups of
    [0, C), each dequantized to float32 with its row's scale, then chunks of the rope."""
    idx = idx_ref[row, pl.ds(k0, block_k)]
    valid = (idx >= 0) & (idx < num_keys)
    safe = jnp.where(valid, idx, 0)
    pages = pt_ref[b, safe // page_size]                               # [bk]
    offsets = safe % page_size
    width = kv_ref.shape[-1]
    rows = []
    for c0, cs in chunks:
        if c0 < width:
            scale = scales_ref[slot, pages, offsets, c0 // fp8.GROUP]                  # [bk] f32
            values = kv_ref[slot, pages, offsets, pl.ds(c0, cs)].astype(jnp.float32)  # [bk, 128]
            rows.append(values * scale[:, None])
        else:
            rows.append(rope_ref[slot, pages, offsets, pl.ds(c0 - width, cs)])
    return valid, safe, rows


def split_store(kv: fp8.Fp8Latent, v_dim: int):
    """-> (the e4m3 values store, (scales, rope) passed after the page table, the value column
    chunks: one per 128-value scale group of [0, v_dim))."""
    return kv.values, (kv.scales, kv.rope), [(c0, fp8.GROUP) for c0 in range(0, v_dim, fp8.GROUP)]


def check(kv: fp8.Fp8Latent, v_dim: int):
    """ValueError unless v_dim is the FP8 values' width (the kernel's value chunks are its scale
    groups) -> the dtype the rows are sized as (bf16: dequantized to q's dtype in registers)."""
    if v_dim != kv.values.shape[-1]:
        raise ValueError(f"pallas_kernels.paged_sparse_mla: impl='pallas_gpu' reads FP8 pages with v_dim = the "
                         f"FP8 values' width ({kv.values.shape[-1]}), got v_dim={v_dim}")
    return jnp.bfloat16
