"""The paged ops' contract over FP8 stores (`pallas_kernels.fp8`), beside kernel_contract.py's:
the FP8 implementations' pytest parameters, checks of the ops over FP8 stores against float64
oracles of the dequantized rows, and keys the FP8 layout stores exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from kernel_contract import assert_sparse_mla_forward, call, impl_params, np_scores, np_topk, paged_store
from pallas_kernels import fp8


def fp8_impl_params(op: str):
    """`impl_params` of the implementations that read FP8 stores (`pk.FP8_IMPLS`)."""
    return [p for p in impl_params(op) if p.values[0] in pk.FP8_IMPLS[op]]


def check_paged_sparse_mla_fp8(impl, q, kv, idx, *, page_size, sm_scale, v_dim, config=None, tol=1e-5):
    """paged_sparse_mla over kv [B, T, Dk] laid out by `paged_store` and quantized to the FP8
    layout (values [0, v_dim), the rest bf16) equals the oracle over the dequantized logical
    rows (each row quantized on its own, so the junk past T too) -> (out, lse)."""
    store, table, logical = paged_store(idx.shape[-1] + page_size, kv, page_size)
    out, lse = call("paged_sparse_mla", impl, q, fp8.quantize_latent(store, v_dim), table, idx, slot=jnp.int32(1),
                    sm_scale=sm_scale, v_dim=v_dim, config=config)
    rows = fp8.dequantize(fp8.quantize_latent(logical, v_dim))
    assert_sparse_mla_forward(out, lse, q, rows, idx, sm_scale=sm_scale, v_dim=v_dim, tol=tol)
    return out, lse


def fp8_exact_keys(rng, B, T, D) -> jax.Array:
    """float32 keys [B, T, D] that the FP8 layout stores exactly: quarter-integers in [-1.75,
    1.75], each key holding +-1.75, so its scale is 1.75 / 448 = 2^-8 and every value a
    multiple of 64 up to 448 after scaling (3 significant bits): the dequantized keys are the
    keys, their scores exact in float32 (ties stay ties)."""
    k = rng.integers(-7, 8, (B, T, D)).astype(np.float32)
    k[..., 0] = np.where(rng.random((B, T)) < 0.5, 7, -7)
    return jnp.asarray(k * 0.25)


def check_paged_topk_fp8(impl, q, k, w, *, page_size, topk, q_pos, kv_len, config=None):
    """paged_indexer_topk over keys k [B, T, D] laid out by `paged_store` and quantized to the FP8
    layout equals the brute force over the dequantized logical keys (float64 scores)."""
    store, table, logical = paged_store(topk + page_size, k, page_size)
    got = call("paged_indexer_topk", impl, q, fp8.quantize_keys(store), table, w, slot=jnp.int32(1), topk=topk,
               q_pos=q_pos, kv_len=kv_len, config=config)
    assert got.dtype == jnp.int32 and got.shape == q.shape[:2] + (topk,)
    want = np_topk(np_scores(q, fp8.dequantize(fp8.quantize_keys(logical)), w, q_pos, kv_len), topk)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{impl} paged FP8 top-{topk}")
    return got
