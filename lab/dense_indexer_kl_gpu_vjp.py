"""The Pallas GPU dense indexer KL (`lab.dense_indexer_kl_gpu`, outside the registry: measured
slower than the XLA form, that module's docstring) as a differentiable op: its forward kernel
(passes 1 and 2) and backward kernels (pass 3) under one custom VJP, and `registered()`, which
lets the public op and `glm_jax` (a train step's `KernelChoice(dense_indexer_kl="pallas_gpu")`)
run it for as long as a benchmark or a test needs it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from lab import dense_indexer_kl_gpu as gpu
from pallas_kernels import registry

#: The impl name `registered()` gives it.
IMPL = "pallas_gpu"


@contextlib.contextmanager
def registered():
    """Within the block, `pallas_kernels.REGISTRY["dense_indexer_kl"][IMPL]` is this op (config
    `DenseIndexerKLGpuConfig`, platform gpu, never what "auto" picks), so that
    `pallas_kernels.dense_indexer_kl(..., impl=IMPL)`, `KernelChoice(dense_indexer_kl=IMPL)`
    and their config checks take it; programs traced inside keep it. Removed on exit."""
    entries = registry.REGISTRY["dense_indexer_kl"]
    if IMPL in entries:
        raise RuntimeError(f"dense_indexer_kl already has an implementation {IMPL!r}")
    entries[IMPL] = registry.Implementation(dense_indexer_kl, gpu.DenseIndexerKLGpuConfig, "gpu", auto=False)
    try:
        yield
    finally:
        del entries[IMPL]


@dataclasses.dataclass(frozen=True)
class _Static:
    sm_scale: float
    shares: tuple[float, ...]
    config: gpu.DenseIndexerKLGpuConfig
    interpret: bool


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale: float, kv_len, kv_start, shares,
                     config: gpu.DenseIndexerKLGpuConfig = gpu.DenseIndexerKLGpuConfig(), interpret: bool = False) -> jax.Array:
    """An implementation of `pallas_kernels.dense_indexer_kl` (operands normalised by the public
    op, as for `pallas_kernels.dense_indexer_kl.xla.dense_indexer_kl`) -> float32 [B, S]; tiles
    of config.block."""
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
