"""The deterministic TPU sparse MLA backward (`sparse_mla.tpu_backward`, behind `impl="pallas_tpu"`)
in Pallas interpret mode (pltpu.InterpretParams: DMAs and semaphores simulated) on the CPU:
bf16 against the float32 reference, bitwise repeatability, the prebuilt transposed index.
Float32 exactness against the contract's oracle (-1 holes, an empty row, out-of-range and
duplicated indices, K > T and not a multiple of the block, several query chunks) is checked
with the default config in test_kernel_contract.py and with small tiles in
test_sparse_mla_pallas.py, which also compiles it for v5p, v6e and tpu7x.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernel_contract import backward_inputs, check_bf16_grads_repeatable, vjp_grads
from pallas_kernels.sparse_mla import reference, tpu, tpu_backward
from pallas_kernels.sparse_mla import transpose as tr

H, DK, DV, T = 4, 80, 64, 50
SCALE = 0.125
#: Small blocks: several row blocks per query, several key-row blocks and windows per reduce.
SMALL = dict(block_k=16, bwd_block_k=16, reduce_rows=8, reduce_window=16)


def _inputs(seed, B, S, K, dtype=jnp.float32):
    q, kv, idx, dout = backward_inputs(seed, B, S, T, K, H, DK, DV, dtype)
    return q, kv, idx, dout.astype(dtype)


_vjp = vjp_grads


def _ref(q, kv, idx):
    return reference.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV)


def _tpu(tindex=None, **cfg):
    config = tpu.SparseMLATpuConfig(**cfg)
    return lambda q, kv, idx: tpu.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, config=config,
                                             interpret=True, tindex=tindex)


def _budget(chunk_rows, K):
    """bwd_budget that makes query chunks of chunk_rows."""
    return chunk_rows * K * tpu_backward.pair_row_bytes(DK)


def test_bf16_and_repeatable():
    """bf16 gradients near the float32 reference's; the same inputs twice give the same bits."""
    q, kv, idx, dout = _inputs(7, 2, 3, 24, jnp.bfloat16)
    grad = jax.jit(lambda q, kv: _vjp(_tpu(**SMALL, bwd_budget=_budget(4, 24)), q, kv, idx, dout))
    f32 = lambda x: x.astype(jnp.float32)
    check_bf16_grads_repeatable(lambda: grad(q, kv), _vjp(_ref, f32(q), f32(kv), idx, f32(dout)))


def test_prebuilt_index_equals_the_built_one():
    """One transposed index (an IndexShare group's) serves two layers, with the bits of the
    index built inside; one built for other indices is refused."""
    B, S, K = 1, 4, 20
    q, kv, idx, dout = _inputs(11, B, S, K)
    chunk = tpu_backward.default_chunk_rows(B * S, K, DK, _budget(2, K))
    ti = tr.transpose_index(idx, T, chunk_rows=chunk)
    cfg = dict(SMALL, bwd_budget=_budget(2, K))
    both = jax.jit(lambda q, kv, ti: [_vjp(_tpu(tindex=ti, **cfg), q, kv, idx, dout),
                                       _vjp(_tpu(**cfg), q, kv, idx, dout)])
    for layer in range(2):                             # one compiled program, two layers' inputs
        prebuilt, built = both(q * (1 + layer), kv - layer, ti)
        for got, want in zip(prebuilt, built):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="built for"):
        tpu_backward.backward(q, kv, idx[..., :10], dout, jnp.zeros((B, S, H)), jnp.zeros((B, S, H)),
                              sm_scale=SCALE, v_dim=DV, tindex=ti, interpret=True)


@pytest.mark.parametrize("field", ["reduce_rows", "reduce_window"])
def test_config_is_checked(field):
    with pytest.raises(ValueError, match=f"{field} must be a multiple of 8"):
        tpu.SparseMLATpuConfig(**{field: 12})
    with pytest.raises(ValueError, match=field):
        tpu.SparseMLATpuConfig(**{field: 0})
