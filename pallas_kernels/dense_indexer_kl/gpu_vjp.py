"""The dense indexer KL's `pallas_gpu` implementation: the forward kernel of `dense_indexer_kl.gpu`
(passes 1 and 2) and its backward kernels (pass 3) under one custom VJP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense_indexer_kl import gpu


@dataclasses.dataclass(frozen=True)
class _Static:
    sm_scale: float
    shares: tuple[float, ...]
    config: gpu.DenseIndexerKLGpuConfig
    interpret: bool


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale: float, kv_len, kv_start, shares,
                     config: gpu.DenseIndexerKLGpuConfig = gpu.DenseIndexerKLGpuConfig(), interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.dense_indexer_kl` (operands normalised as for
    `dense_indexer_kl.xla.dense_indexer_kl`) -> float32 [B, S]; tiles of config.block."""
    if kv_start is None:
        kv_start = jnp.zeros(idx_q.shape[:2], jnp.int32)
    st = _Static(float(sm_scale), tuple(shares), config, bool(interpret))
    return _row_losses(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_losses(st: _Static, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start):
    return _row_losses_fwd(st, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)[0]


def _row_losses_fwd(st: _Static, qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start):
    rows, lse, lse_s = gpu.forward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, sm_scale=st.sm_scale,
                                   shares=st.shares, config=st.config, interpret=st.interpret)
    return rows, (qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s)


def _row_losses_bwd(st: _Static, res, g):
    qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s = res
    dq, dk, dw = gpu.backward(qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start, lse, lse_s, g,
                              sm_scale=st.sm_scale, shares=st.shares, config=st.config, interpret=st.interpret)
    return None, None, dq.astype(idx_q.dtype), dk.astype(idx_keys.dtype), dw.astype(idx_w.dtype), None, None


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)
