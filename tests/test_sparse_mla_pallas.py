"""Pallas sparse MLA (TPU Mosaic and GPU Triton kernels) against the reference.

The kernels run in interpret mode on the CPU (the TPU one with pltpu.InterpretParams, which
also simulates the DMAs and their semaphores). The TPU kernels are also compiled ahead of
time for v5p and v6e (needs libtpu; skipped without it) and the GPU kernels lowered to Triton
for an H200 (no GPU needed), which catches layout and block-size errors that interpret mode
does not.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from conftest import tpu_compile_mesh
from pallas_kernels.attention import gpu, reference, tpu

H, DK, DV, T = 4, 80, 64, 50
SCALE = 0.125


def _inputs(seed, B, S, K, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, DK)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, T, DK)), dtype)
    idx = np.stack([np.stack([rng.permutation(T)[:K] for _ in range(S)]) for _ in range(B)])
    idx = idx.astype(np.int32)
    idx[rng.random(idx.shape) < 0.25] = -1                   # scattered padding
    idx[0, 0, :] = -1                                        # a row with no valid index
    if S > 1:
        idx[-1, 1, K // 2:] = -1                             # trailing padding
        idx[-1, 1, 0] = T + 3                                # out of range counts as skip
    return q, kv, jnp.asarray(idx)


def _call(kind, **cfg):
    if kind == "tpu":
        return lambda q, kv, i: tpu.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, interpret=True, **cfg)
    return lambda q, kv, i: gpu.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, interpret=True, **cfg)


def _ref(q, kv, i):
    return reference.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV)


def _loss(fn, idx, dout):
    def loss(q, kv):
        out, lse = fn(q, kv, idx)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jnp.arange(1, H + 1) / H)
        return jnp.sum(out.astype(jnp.float32) * dout) + lse_term
    return loss


def _assert_lse(lse, ref):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    np.testing.assert_allclose(np.where(np.isfinite(ref), lse, 0), np.where(np.isfinite(ref), ref, 0),
                               rtol=1e-5, atol=1e-5)


CASES = [  # (kind, B, S, K, kernel config): K not a multiple of the block, several blocks
    ("tpu", 2, 3, 40, dict(block_k=16)),
    ("tpu", 1, 2, 16, dict()),
    ("gpu", 2, 3, 40, dict(block_k=16, num_splits=1, bwd_head_group=2, dkv_mode="atomic")),
    ("gpu", 1, 2, 37, dict(block_k=16, num_splits=2)),                   # auto: atomic
    ("gpu", 2, 3, 40, dict(block_k=16, bwd_head_group=2)),               # auto: scatter
]


@pytest.mark.parametrize("kind,B,S,K,cfg", CASES)
def test_forward_and_gradients_match_reference(kind, B, S, K, cfg):
    q, kv, idx = _inputs(B * 100 + K, B, S, K)
    fn = _call(kind, **cfg)
    out, lse = jax.jit(fn)(q, kv, idx)
    rout, rlse = _ref(q, kv, idx)
    assert out.shape == (B, S, H, DV) and out.dtype == q.dtype and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, rout, rtol=1e-5, atol=1e-5)
    _assert_lse(lse, rlse)
    np.testing.assert_array_equal(out[0, 0], 0.0)            # empty row: out 0, lse -inf
    assert np.all(np.isneginf(lse[0, 0]))

    dout = jnp.asarray(np.random.default_rng(K).normal(size=(B, S, H, DV)), jnp.float32)
    g = jax.jit(jax.grad(_loss(fn, idx, dout), argnums=(0, 1)))(q, kv)
    rg = jax.grad(_loss(_ref, idx, dout), argnums=(0, 1))(q, kv)
    for got, want in zip(g, rg):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(g[0][0, 0], 0.0)           # no gradient through an empty row


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_public_entry_point_bf16(impl):
    q, kv, idx = _inputs(7, 2, 2, 24, jnp.bfloat16)
    out, lse = jax.jit(functools.partial(pk.sparse_mla, sm_scale=SCALE, v_dim=DV, impl=impl,
                                         interpret=True))(q, kv, idx)
    rout, rlse = _ref(q.astype(jnp.float32), kv.astype(jnp.float32), idx)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), rout, rtol=2e-2, atol=2e-2)
    _assert_lse(lse, rlse)


def test_auto_resolves_by_backend():
    q, kv, idx = _inputs(8, 1, 2, 16)
    out, _ = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl="auto")   # CPU: the xla impl
    np.testing.assert_allclose(out, _ref(q, kv, idx)[0], rtol=1e-5, atol=1e-5)


def test_gpu_column_chunks():
    assert gpu.pow2_chunks(0, 512) + gpu.pow2_chunks(512, 576) == [(0, 512), (512, 64)]
    assert gpu.pow2_chunks(0, 80) == [(0, 64), (64, 16)]
    assert gpu.default_splits(64, 2048, 64) == 4 and gpu.default_splits(8192, 2048, 64) == 1


# ----------------------------------------------------------------------------- compilation

DECODE = (2, 1, 64, 576, 512, 8192, 2048)     # B, S, H, Dk, v, T, K
PREFILL = (1, 256, 64, 576, 512, 4096, 2048)


def _shapes(shape, sharding=None):
    B, S, Hh, Dk, _, Tt, K = shape
    kw = {} if sharding is None else {"sharding": sharding}
    return (jax.ShapeDtypeStruct((B, S, Hh, Dk), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, Tt, Dk), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, S, K), jnp.int32, **kw))


def _fwd_and_grad(module, v_dim):
    def fwd(q, kv, idx):
        return module.sparse_mla(q, kv, idx, sm_scale=0.04, v_dim=v_dim)

    def grad(q, kv, idx):
        loss = lambda q, kv: fwd(q, kv, idx)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(q, kv)

    return fwd, grad


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("shape", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_tpu_kernels_compile_ahead_of_time(topology, shape):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = tpu_compile_mesh(topology)
    args = _shapes(shape, NamedSharding(mesh, P()))
    for fn in _fwd_and_grad(tpu, shape[4]):
        wrapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                                check_vma=False)
        compiled = jax.jit(wrapped).lower(*args).compile()
        text = compiled.as_text()
        assert "sparse_mla" in text
        assert compiled.memory_analysis() is not None


def test_gpu_kernels_lower_to_triton_for_h200():
    from jax._src.mesh import AbstractDevice  # the abstract target device for lowering

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    args = _shapes(DECODE)
    with jax.sharding.use_abstract_mesh(mesh):
        for fn, calls in zip(_fwd_and_grad(gpu, DECODE[4]), (1, 2)):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == calls
