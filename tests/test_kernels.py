"""pallas_kernels: the `xla` implementations' query chunking (every `XlaConfig.q_chunk` computes
the same function) and memory, and `impl="auto"` with a config under jit. The contract of every
implementation is tested in test_kernel_contract.py.

Indexer inputs are small integers, so every score is computed exactly in float32 whatever the
summation order; ties are then exact and plentiful, and index outputs can be compared for
equality with the brute force.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from kernel_contract import (call, float_score_inputs, check_scores, check_sparse_mla, check_topk, int_inputs, np_scores, np_topk,
                             positions, sparse_inputs)
from pallas_kernels.chunking import CHUNK_BUDGET_BYTES, choose_q_chunk


def test_choose_q_chunk():
    assert choose_q_chunk(10, 1, 4) == 4
    assert choose_q_chunk(10, 1, 64) == 10
    assert choose_q_chunk(1000, 1) == 256
    big = 131072 * (4 * 64 + 16)             # one query of a 128K-key, 64-head indexer
    c = choose_q_chunk(131072, big)
    assert c >= 1 and c * big <= CHUNK_BUDGET_BYTES and c & (c - 1) == 0
    with pytest.raises(ValueError):
        choose_q_chunk(10, 1, 0)


@pytest.mark.parametrize("B,S,T,H,D,topk,q_chunk", [
    (2, 13, 17, 4, 8, 5, 4),
    (1, 9, 9, 2, 4, 16, 2),        # topk > T
    (3, 10, 32, 3, 8, 8, 3),
    (2, 5, 40, 2, 4, 7, None),
    (2, 16, 16, 4, 8, 4, 5),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_topk_query_chunks(B, S, T, H, D, topk, q_chunk, dtype):
    """B sequences each of prefill, offset and random positions (`positions`)."""
    rng = np.random.default_rng(B * 1000 + S * 100 + T)
    q, k, w = int_inputs(rng, 3 * B, S, T, H, D, dtype=dtype)
    parts = [positions(rng, B, S, T, mode) for mode in ("prefill", "offset", "random")]
    q_pos, kv_len = (jnp.concatenate(x) for x in zip(*parts))
    check_topk("xla", q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, config=pk.XlaConfig(q_chunk))


@pytest.mark.parametrize("q_chunk", [1, 3, 7])
def test_xla_scores_query_chunks(q_chunk):
    """Two sequences each of offset and random positions."""
    rng = np.random.default_rng(7)
    q, k, w, q_pos, kv_len = float_score_inputs(rng)
    check_scores("xla", q, k, w, q_pos=q_pos, kv_len=kv_len, config=pk.XlaConfig(q_chunk), exact=False)


@pytest.mark.parametrize("B,S,T,H,Dk,v_dim,K,q_chunk", [
    (2, 9, 16, 4, 12, 8, 5, 4),
    (1, 13, 8, 2, 6, 6, 11, 5),     # K > T: -1 padding
    (3, 6, 20, 3, 8, 4, 7, None),
    (2, 10, 10, 1, 4, 2, 3, 3),
    (2, 7, 9, 3, 8, 5, 4, 2),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_sparse_mla_query_chunks(B, S, T, H, Dk, v_dim, K, q_chunk, dtype):
    """Forward (and, in float32, gradients) of every query chunking."""
    q, kv, idx = sparse_inputs(S * 31 + T, B, S, T, K, H, Dk, dtype)
    check_sparse_mla("xla", q, kv, idx, sm_scale=Dk ** -0.5, v_dim=v_dim, config=pk.XlaConfig(q_chunk),
                     gradients=dtype == jnp.float32, tol=1e-5 if dtype == jnp.float32 else 1e-2)


def test_auto_with_a_config_under_jit():
    """impl="auto" (xla on the CPU) with the config of what it resolves to, both static
    arguments of a jitted call."""
    rng = np.random.default_rng(1)
    B, S, T, H, D = 2, 10, 12, 2, 4
    q, k, w = int_inputs(rng, B, S, T, H, D)
    q_pos, kv_len = positions(rng, B, S, T, "offset")
    config = pk.REGISTRY["indexer_topk"][pk.resolve_impl("indexer_topk", "auto")].config
    topk_fn = jax.jit(pk.indexer_topk, static_argnames=("topk", "impl", "config", "interpret"))
    scores_fn = jax.jit(pk.indexer_scores, static_argnames=("impl", "config", "interpret"))
    scores = np_scores(q, k, w, q_pos, kv_len)
    got = topk_fn(q, k, w, topk=5, q_pos=q_pos, kv_len=kv_len, impl="auto", config=config(q_chunk=3))
    np.testing.assert_array_equal(np.asarray(got), np_topk(scores, 5))
    got = scores_fn(q, k, w, q_pos=q_pos, kv_len=kv_len, impl="auto", config=config(q_chunk=4))
    np.testing.assert_allclose(np.asarray(got), scores)


def test_xla_long_prefill_memory_is_chunked():
    """A 64K-token prefill compiles with temporaries far below one [S, T] float32 matrix."""
    S = T = 65536
    f32 = jnp.float32
    sd = jax.ShapeDtypeStruct
    dense_bytes = S * T * 4                              # 16 GiB

    topk = jax.jit(lambda q, k, w, p, n: call("indexer_topk", "xla", q, k, w, topk=64, q_pos=p, kv_len=n))
    args = (sd((1, S, 2, 16), jnp.bfloat16), sd((1, T, 16), jnp.bfloat16), sd((1, S, 2), f32),
            sd((1, S), jnp.int32), sd((1,), jnp.int32))
    mem = topk.lower(*args).compile().memory_analysis()
    if mem is None:
        pytest.skip("memory analysis unavailable on this backend")
    assert mem.temp_size_in_bytes < dense_bytes / 16

    def loss(q, kv, idx):
        out, lse = call("sparse_mla", "xla", q, kv, idx, sm_scale=0.1, v_dim=16)
        return out.astype(f32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (sd((1, S, 2, 32), jnp.bfloat16), sd((1, T, 32), jnp.bfloat16), sd((1, S, 64), jnp.int32))
    mem = grad.lower(*args).compile().memory_analysis()
    # every query's gathered rows, stored for the backward pass, would be S * 64 * 32 * 2 bytes
    assert mem.temp_size_in_bytes < S * 64 * 32 * 2 / 2
