"""The row-sharing sparse MLA forward (`pallas_kernels.attention.gpu_shared`): its union of
rows per query block, and its output against the reference in interpret mode."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernel_contract import sparse_inputs
from pallas_kernels.attention import gpu_shared, reference


def _sets(idx: np.ndarray, num_keys: int) -> list[list[set]]:
    return [[{int(t) for t in row if 0 <= t < num_keys} for row in seq] for seq in idx]


@pytest.mark.parametrize("block_q", [1, 3, 4])
def test_shared_rows_hold_each_querys_selection(block_q):
    """Every block's sorted distinct rows, and a query's bit on exactly the rows it listed
    (-1 holes, out-of-range and duplicated entries, S not a multiple of block_q, 2 sequences)."""
    _, _, idx = sparse_inputs(7, B=2, S=7, T=50, K=12, H=1, Dk=16)
    sr = gpu_shared.shared_rows(idx, 50, block_q=block_q)
    rows, bits, count = map(np.asarray, (sr.rows, sr.bits, sr.count))
    want = _sets(np.asarray(idx), 50)
    blocks = -(-7 // block_q)
    assert rows.shape == bits.shape == (2 * blocks, rows.shape[1]) and rows.shape[1] % 64 == 0
    for b in range(2):
        for blk in range(blocks):
            n = b * blocks + blk
            queries = range(blk * block_q, min(7, (blk + 1) * block_q))
            union = sorted(set().union(*(want[b][s] for s in queries)))
            assert count[n] == len(union) and list(rows[n, :count[n]]) == union
            assert (rows[n, count[n]:] == -1).all() and (bits[n, count[n]:] == 0).all()
            for i, s in enumerate(queries):
                chosen = {int(t) for t, w in zip(rows[n, :count[n]], bits[n, :count[n]]) if w >> i & 1}
                assert chosen == want[b][s]


@pytest.mark.parametrize("heads,block_q", [(16, 4), (8, 8), (3, 4)])
def test_forward_matches_the_reference(heads, block_q):
    """Tiles of 64 (16 heads x 4 queries, 8 x 8) and 16 rows (3 heads in 4 slots x 4 queries),
    with the empty, out-of-range and duplicated selections of `sparse_inputs`."""
    q, kv, idx = sparse_inputs(heads + block_q, B=2, S=7, T=50, K=24, H=heads, Dk=80)
    want_out, want_lse = reference.sparse_mla(q, kv, idx, sm_scale=0.125, v_dim=64)
    sr = gpu_shared.shared_rows(idx, 50, block_q=block_q)
    out, lse = gpu_shared.forward(q, kv, sr, sm_scale=0.125, v_dim=64, block_k=16, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-5, rtol=2e-5)


def test_forward_refuses_mismatched_shapes():
    q, kv, idx = sparse_inputs(1, B=1, S=4, T=50, K=8, H=16, Dk=80)
    with pytest.raises(ValueError, match="tile rows"):
        gpu_shared.forward(q, kv, gpu_shared.shared_rows(idx, 50, block_q=8), sm_scale=1.0, v_dim=64)
    with pytest.raises(ValueError, match="built for"):
        gpu_shared.forward(q, kv, gpu_shared.shared_rows(idx, 40, block_q=4), sm_scale=1.0, v_dim=64)
    with pytest.raises(ValueError, match="block_q"):
        gpu_shared.shared_rows(idx, 50, block_q=32)


def test_sparse_mla_with_shared_forward_meets_the_contract():
    """`SparseMLAGpuConfig(fwd_block_q=4)`: the registry's GPU sparse MLA with the row-sharing
    forward, forward and gradients (the backward is the per-query "sorted" one); with the
    indexer target the op keeps the per-query forward."""
    import pallas_kernels as pk
    from kernel_contract import check_sparse_mla, check_sparse_mla_target

    q, kv, idx = sparse_inputs(3, B=2, S=6, T=50, K=24, H=16, Dk=80)
    config = pk.SparseMLAGpuConfig(block_k=16, fwd_block_q=4, dkv_mode="sorted")
    check_sparse_mla("pallas_gpu", q, kv, idx, sm_scale=0.125, v_dim=64, config=config)
    check_sparse_mla_target("pallas_gpu", q, kv, idx, sm_scale=0.125, v_dim=64, config=config)


def test_shared_backward_meets_the_contract():
    """dkv_mode "shared": the row-sharing forward and backward (pair gradients per (block, union
    row), summed by latent row) in 4 chunks of 2 blocks, with a prebuilt `shared_index` that the
    forward uses too (both over blocks of 2 queries: 16 heads x 2 = a 32-row tile)."""
    import pallas_kernels as pk
    from kernel_contract import check_sparse_mla

    q, kv, idx = sparse_inputs(5, B=2, S=7, T=50, K=24, H=16, Dk=80)
    config = pk.SparseMLAGpuConfig(block_k=16, fwd_block_q=2, bwd_block_q=2, dkv_mode="shared",
                                   bwd_budget=2 * 64 * 80 * 4)
    check_sparse_mla("pallas_gpu", q, kv, idx, sm_scale=0.125, v_dim=64, config=config)
    index = gpu_shared.shared_index(idx, 50, block_q=2, dk=80, dtype=jnp.float32, budget=2 * 64 * 80 * 4)
    assert index.transposed.num_chunks == 4
    out, _ = pk.sparse_mla(q, kv, idx, sm_scale=0.125, v_dim=64, impl="pallas_gpu", config=config,
                           tindex=index, interpret=True)
    want, _ = reference.sparse_mla(q, kv, idx, sm_scale=0.125, v_dim=64)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
