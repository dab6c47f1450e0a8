"""The deterministic GPU sparse MLA backward (`attention.gpu_backward`, `attention.transpose`)
against the reference, in Pallas interpret mode on the CPU, plus its Triton lowering for an H200.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernel_contract import backward_inputs, check_bf16_grads_repeatable, vjp_grads
import pallas_kernels as pk
from pallas_kernels.attention import gpu_backward as gb
from pallas_kernels.attention import reference
from pallas_kernels.attention import transpose as tr

H, DK, DV, T = 4, 80, 64, 50
SCALE = 0.125


def _inputs(seed, B, S, K, dtype=jnp.float32):
    q, kv, idx, dout = backward_inputs(seed, B, S, T, K, H, DK, DV, dtype)
    return q, kv, idx, dout.astype(jnp.float32)


_vjp = vjp_grads


def _ref(q, kv, idx):
    return reference.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV)


def _new(**cfg):
    return lambda q, kv, idx: gb.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, interpret=True, **cfg)


CASES = [  # (B, S, K, settings): K not a multiple of the block, several blocks and chunks
    (2, 3, 40, dict(block_k=16)),                                     # fused dq, one chunk
    (1, 5, 37, dict(block_k=16, fuse_dq=False, budget=2 * 37 * DK * 4)),   # ds^T + dq kernel, 3 chunks
    (2, 2, 16, dict(block_k=16, col_block=16, reduce_block=4)),      # one block, small tiles
]


@pytest.mark.parametrize("B,S,K,cfg", CASES)
def test_gradients_match_reference(B, S, K, cfg):
    q, kv, idx, dout = _inputs(B * 100 + K, B, S, K)
    dq, dkv = jax.jit(lambda q, kv: _vjp(_new(**cfg), q, kv, idx, dout))(q, kv)
    rdq, rdkv = _vjp(_ref, q, kv, idx, dout)
    assert dq.shape == q.shape and dkv.shape == kv.shape
    np.testing.assert_allclose(dq, rdq, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dkv, rdkv, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(dq[0, 0], 0.0)             # empty row: no gradient


def test_bf16_and_repeatable():
    """bf16 through the op; the same inputs twice give the same bits."""
    q, kv, idx, dout = _inputs(7, 2, 3, 24, jnp.bfloat16)
    grad = jax.jit(lambda q, kv: _vjp(_new(block_k=16, budget=2 * 24 * DK * 2), q, kv, idx, dout))
    check_bf16_grads_repeatable(lambda: grad(q, kv),
                                _vjp(_ref, q.astype(jnp.float32), kv.astype(jnp.float32), idx, dout))


def test_transposed_index_lists_every_pair_in_order():
    _, _, idx, _ = _inputs(3, 2, 3, 12)
    ti = tr.transpose_index(idx, T, chunk_rows=4)                    # rows 0-3, 4-5 (+2 padding)
    assert ti.num_chunks == 2 and ti.offsets.shape == (2, 2 * T + 1)
    flat = np.asarray(idx).reshape(6, 12)
    position, offsets = np.asarray(ti.position), np.asarray(ti.offsets)
    for c in range(2):
        assert sorted(position[c]) == list(range(48))                # a permutation of places
        local_at = np.argsort(position[c])                             # place -> local pair id
        for b in range(2):
            for t in range(T):
                r = b * T + t
                got = local_at[offsets[c, r]:offsets[c, r + 1]]
                want = [(row - 4 * c) * 12 + j for row in range(4 * c, min(4 * c + 4, 6))
                        for j in range(12) if row // 3 == b and flat[row, j] == t]
                assert list(got) == want


def test_prebuilt_index_serves_several_layers():
    """One transposed index (an IndexShare group's), built through the public API, reused for
    two layers' backward; refused by an implementation that takes none."""
    q, kv, idx, dout = _inputs(11, 1, 4, 20)
    cfg = pk.SparseMLAGpuConfig(block_k=16)
    ti = pk.sparse_mla_backward_index(idx, T, dk=q.shape[-1], dtype=kv.dtype, impl="pallas_gpu", config=cfg,
                                      interpret=True)
    assert pk.sparse_mla_backward_index(idx, T, dk=q.shape[-1], dtype=kv.dtype, impl="xla") is None
    with pytest.raises(ValueError, match="takes no tindex"):
        pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl="xla", tindex=ti)
    fn = lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu", config=cfg,
                                        interpret=True, tindex=ti)[:2]
    for layer in range(2):
        qq, kk = q * (1 + layer), kv - layer
        got = _vjp(fn, qq, kk, idx, dout)
        want = _vjp(_ref, qq, kk, idx, dout)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="built for"):
        gb.backward(q, kv, idx[..., :10], dout, jnp.zeros((1, 4, H)), jnp.zeros((1, 4, H)),
                    sm_scale=SCALE, v_dim=DV, tindex=ti, interpret=True)


def test_lowers_to_triton_for_h200():
    """The three kernels at GLM shapes (16 heads fused dq; 64 heads with the dq kernel)."""
    from jax._src.mesh import AbstractDevice  # the abstract target device for lowering

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    for heads, kernels in ((16, 2), (64, 3)):
        s = jax.ShapeDtypeStruct
        args = (s((1, 8, heads, 576), jnp.bfloat16), s((1, 4096, 576), jnp.bfloat16),
                s((1, 8, 2048), jnp.int32), s((1, 8, heads, 512), jnp.bfloat16),
                s((1, 8, heads), jnp.float32), s((1, 8, heads), jnp.float32))
        fn = lambda q, kv, i, d, l, de: gb.backward(q, kv, i, d, l, de, sm_scale=0.04, v_dim=512)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == kernels
