"""The Mosaic GPU sparse MLA kernel (`lab/mosaic_sparse_mla.py`, outside the package), run by
test_paged_mosaic_gpu.py in a process of its own: in GPU interpret mode on a CPU against the
reference and a per-slot numpy oracle (which counts a duplicated index once per occurrence, as
the kernel does), paged and contiguous; its lowering to a Mosaic GPU kernel for an H100 (no GPU
needed) and its config checks. Skipped where this jax has no GPU interpret mode (jax < 0.12).
On an H100 `benchmarks/sparse_mla.py --paged-only` and `--mosaic-prefill` compare it with the
Triton kernel (docs/kernels-sparse-mla.md)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_mla import reference
from lab import mosaic_sparse_mla as gm

pytestmark = pytest.mark.skipif(not gm.interpret_available(),
                                reason="this jax has no Mosaic GPU interpret mode (jax >= 0.12 has it)")


def _inputs(seed, *, B, S, H, Dk, K, P=16, n=8, slots=3, spare=3):
    """bf16 q [B, S, H, Dk] and a store [slots, B n + spare, P, Dk] with shuffled pages, a page
    table [B, n] and indices [B, S, K] of logical rows with -1 holes, out-of-range rows (n P,
    n P + 5), a duplicated row (query (0, 0): rows 1, 1, 2 twice each ...) and an empty
    query (the last)."""
    rng = np.random.default_rng(seed)
    pages = B * n + spare
    store = jnp.asarray(rng.normal(size=(slots, pages, P, Dk)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(pages)[:B * n].reshape(B, n), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.bfloat16)
    idx = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            row = rng.permutation(n * P)[:K]
            idx[b, s, :row.size] = row
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[0, 0, :4] = [1, 1, 2, n * P]                 # a duplicate and an out-of-range row
    idx[0, 0, -1] = n * P + 5
    idx[-1, -1, :] = -1                              # no valid row
    return q, store, table, jnp.asarray(idx)


def _oracle(q, store, table, idx, *, slot, sm_scale, v_dim):
    """float64 (out [B, S, H, v], lse [B, S, H]) of the softmax over the query's index slots
    (a duplicated row counted at each of its slots); empty queries: out 0, lse -inf."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    store = np.asarray(store.astype(jnp.float32), np.float64)
    table, idx = np.asarray(table), np.asarray(idx)
    P = store.shape[2]
    B, S, H, _ = q.shape
    out = np.zeros((B, S, H, v_dim))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        for s in range(S):
            t = idx[b, s]
            t = t[(t >= 0) & (t < table.shape[1] * P)]
            if t.size == 0:
                continue
            rows = store[slot, table[b, t // P], t % P]                  # [k, Dk]
            logits = sm_scale * q[b, s] @ rows.T                           # [H, k]
            m = logits.max(axis=1, keepdims=True)
            p = np.exp(logits - m)
            out[b, s] = p @ rows[:, :v_dim] / p.sum(axis=1, keepdims=True)
            lse[b, s] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


def _check(q, store, table, idx, *, v_dim, config, sm_scale=0.08, slot=1):
    fn = jax.jit(functools.partial(gm.paged_sparse_mla, sm_scale=sm_scale, v_dim=v_dim, config=config,
                                   interpret=True))
    out, lse = fn(q, store, table, idx, slot=jnp.int32(slot))
    assert out.shape == q.shape[:3] + (v_dim,) and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    out64, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse)
    want_out, want_lse = _oracle(q, store, table, idx, slot=slot, sm_scale=sm_scale, v_dim=v_dim)
    np.testing.assert_allclose(out64, want_out, rtol=2e-2, atol=2e-2)          # bf16 out, bf16 P
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)
    empty = np.isneginf(want_lse[..., 0])
    assert empty.any() and (out64[empty] == 0).all() and np.isneginf(lse[empty]).all()
    # the reference (duplicates counted once) on the queries without a duplicate
    ref_out, ref_lse = reference.paged_sparse_mla(q, store, table, idx, slot=slot, sm_scale=sm_scale, v_dim=v_dim)
    idx_np = np.asarray(idx)
    dup = np.array([[len(set(r[(r >= 0) & (r < table.shape[1] * store.shape[2])].tolist()))
                     != int(((r >= 0) & (r < table.shape[1] * store.shape[2])).sum()) for r in row] for row in idx_np])
    assert dup.any() and (~dup).any()
    np.testing.assert_allclose(out64[~dup], np.asarray(ref_out.astype(jnp.float32))[~dup], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse[~dup], np.asarray(ref_lse)[~dup], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("H,config", [
    (8, gm.SparseMLAMosaicConfig(num_splits=1)),                               # 8 heads padded to 64, 2 blocks
    (64, gm.SparseMLAMosaicConfig(num_splits=2, stages=3, buffers=2)),         # f32 partials merged in XLA
], ids=["h8-one-split", "h64-two-splits"])
def test_paged_sparse_mla_small(H, config):
    q, store, table, idx = _inputs(1, B=2, S=1, H=H, Dk=192, K=128)
    _check(q, store, table, idx, v_dim=128, config=config)


def test_paged_sparse_mla_glm_widths_and_head_groups():
    """Dk = 576, v = 512 (9 TMA chunks a row, 256 value columns a compute warpgroup), 72 heads
    (two groups of 64, the second mostly padding), two queries a sequence, a K that is not a
    multiple of block_k (padded with -1); the default config."""
    q, store, table, idx = _inputs(2, B=2, S=2, H=72, Dk=576, K=100)
    _check(q, store, table, idx, v_dim=512, config=gm.SparseMLAMosaicConfig())


def test_contiguous_forward_equals_the_reference():
    """`gm.sparse_mla` (contiguous rows, one page a sequence) against `reference.sparse_mla`,
    with -1 holes and distinct rows."""
    rng = np.random.default_rng(4)
    B, S, H, T, K, Dk, v = 2, 2, 8, 96, 64, 192, 128
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), jnp.bfloat16)
    idx = np.stack([[rng.permutation(T)[:K] for _ in range(S)] for _ in range(B)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    got = gm.sparse_mla(q, kv, jnp.asarray(idx), sm_scale=0.1, v_dim=v, interpret=True)
    want = reference.sparse_mla(q.astype(jnp.float32), kv.astype(jnp.float32), jnp.asarray(idx), sm_scale=0.1,
                                v_dim=v)
    np.testing.assert_allclose(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0]), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-4)


def test_runs_it_and_falls_back_where_unsupported():
    """The kernel for bf16 at widths of 64, the `xla` implementation for f32 or a Dk of 80
    (`supports` says why)."""
    q, store, table, idx = _inputs(3, B=2, S=1, H=4, Dk=128, K=64)
    got = gm.paged_sparse_mla(q, store, table, idx, sm_scale=0.1, v_dim=128, slot=1, interpret=True)
    want = _oracle(q, store, table, idx, slot=1, sm_scale=0.1, v_dim=128)
    np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-4, atol=1e-4)
    assert gm.supports(q.shape, store.shape, 128, jnp.bfloat16) is None
    assert "dtype float32" in gm.supports(q.shape, store.shape, 128, jnp.float32)
    assert "Dk=80" in gm.supports((1, 1, 4, 80), (1, 1, 16, 80), 64, jnp.bfloat16)
    assert "v_dim=64" in gm.supports(q.shape, store.shape, 64, jnp.bfloat16)
    q32, store32 = q[..., :80].astype(jnp.float32), store[..., :80].astype(jnp.float32)
    got = gm.paged_sparse_mla(q32, store32, table, idx, sm_scale=0.1, v_dim=64, slot=1, interpret=True)
    want = _oracle(q32, store32, table, idx, slot=1, sm_scale=0.1, v_dim=64)
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-4, atol=1e-4)


def test_config_is_checked():
    with pytest.raises(ValueError, match="multiple of 64"):
        gm.SparseMLAMosaicConfig(block_k=32)
    with pytest.raises(ValueError, match="positive int"):
        gm.SparseMLAMosaicConfig(stages=0)
    q, store, table, idx = _inputs(4, B=1, S=1, H=64, Dk=576, K=64)
    with pytest.raises(ValueError, match="shared memory"):
        gm.paged_sparse_mla(q, store, table, idx, slot=1, sm_scale=0.1, v_dim=512,
                            config=gm.SparseMLAMosaicConfig(stages=4, buffers=2), interpret=True)
    # the defaults fit Hopper's shared memory: one split of 2048 rows does not, two do
    assert gm.smem_bytes(576, 64, 2, 1, 2048) > gm.SMEM_LIMIT >= gm.smem_bytes(576, 64, 2, 1, 1024)


def test_lowers_to_one_mosaic_gpu_kernel_for_h100():
    """GLM-5.2's decode shape (64 heads, 576 / 512, top-2048, pages of 64, batch 128) lowered for
    an sm_90 device without a GPU: the Pallas-to-Mosaic-GPU lowering (TMA slices, register
    layouts, wgmma shapes, shared memory under 227 KiB) accepts the kernel."""
    B, H, Dk, V, K, P, n = 128, 64, 576, 512, 2048, 64, 64
    args = (jax.ShapeDtypeStruct((B, 1, H, Dk), jnp.bfloat16), jax.ShapeDtypeStruct((2, B * n, P, Dk), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, n), jnp.int32), jax.ShapeDtypeStruct((B, 1, K), jnp.int32))
    fn = functools.partial(gm.paged_sparse_mla, slot=1, sm_scale=0.1, v_dim=V)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
