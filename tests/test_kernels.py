"""pallas_kernels: reference vs xla agreement, brute-force oracles, edge cases and gradients.

Most indexer tests use small integer-valued inputs, so every score is computed exactly in
float32 whatever the summation order; ties are then exact and plentiful, and index outputs
can be compared for equality.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels._common import CHUNK_BUDGET_BYTES, choose_q_chunk

IMPLS = ("reference", "xla")

# Whole ops jitted once per shape: much faster on CPU than op-by-op dispatch.
_STATIC = ("impl", "interpret", "q_chunk")
topk_op = jax.jit(pk.indexer_topk, static_argnames=_STATIC + ("topk",))
scores_op = jax.jit(pk.indexer_scores, static_argnames=_STATIC)
mla_op = jax.jit(pk.sparse_mla, static_argnames=_STATIC + ("sm_scale", "v_dim"))


# ----------------------------------------------------------------------------- helpers


def _int_inputs(rng, B, S, T, H, D, dtype=jnp.float32, neg_weights=False):
    q = rng.integers(-3, 4, (B, S, H, D))
    k = rng.integers(-3, 4, (B, T, D))
    w = rng.integers(-2 if neg_weights else 1, 4, (B, S, H))
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(w, jnp.float32)


def _positions(rng, B, S, T, mode):
    """(q_pos [B, S], kv_len [B]) for several serving situations."""
    if mode == "prefill":  # causal, queries at the start, ragged kv_len
        q_pos = np.tile(np.arange(S), (B, 1))
        kv_len = rng.integers(0, T + 1, B)
        kv_len[0] = T
    elif mode == "offset":  # chunked prefill / decode: queries at an offset into the cache
        off = rng.integers(0, max(T - S, 0) + 1, B)
        q_pos = off[:, None] + np.arange(S)[None]
        kv_len = np.minimum(off + S, T)
    else:  # random positions, some queries see nothing (-1) or only a few keys
        q_pos = rng.integers(-1, T + 2, (B, S))
        q_pos[:, 0] = -1
        q_pos[:, -1] = 0
        kv_len = rng.integers(1, T + 1, B)
    return jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_len, jnp.int32)


def _np_scores(q, k, w, q_pos, kv_len):
    q, k, w = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, w))
    q_pos, kv_len = np.asarray(q_pos), np.asarray(kv_len)
    B, S, _, _ = q.shape
    T = k.shape[1]
    out = np.full((B, S, T), -np.inf)
    for b in range(B):
        for s in range(S):
            for t in range(T):
                if t <= q_pos[b, s] and t < kv_len[b]:
                    out[b, s, t] = np.sum(w[b, s] * np.maximum(q[b, s] @ k[b, t], 0.0))
    return out


def _np_topk(q, k, w, q_pos, kv_len, topk):
    """Brute force: sort the valid (-score, t) pairs of each row."""
    scores = _np_scores(q, k, w, q_pos, kv_len)
    B, S, T = scores.shape
    out = np.full((B, S, topk), -1, np.int32)
    for b in range(B):
        for s in range(S):
            cand = sorted((-scores[b, s, t], t) for t in range(T) if np.isfinite(scores[b, s, t]))
            sel = [t for _, t in cand[:topk]]
            out[b, s, :len(sel)] = sel
    return out


def _np_dense_causal(q, kv, sm_scale, v_dim, q_pos):
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    B, S, H, _ = q.shape
    out = np.zeros((B, S, H, v_dim))
    lse = np.full((B, S, H), -np.inf)
    for b in range(B):
        for s in range(S):
            n = q_pos[b, s] + 1
            if n <= 0:
                continue
            logits = sm_scale * q[b, s] @ kv[b, :n].T           # [H, n]
            m = logits.max(-1, keepdims=True)
            p = np.exp(logits - m)
            out[b, s] = (p @ kv[b, :n, :v_dim]) / p.sum(-1, keepdims=True)
            lse[b, s] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
    return out, lse


def _random_indices(rng, B, S, T, K, frac_invalid=0.3):
    """Distinct indices per row (like the indexer's), with -1 holes and a few empty rows."""
    idx = np.stack([np.stack([rng.permutation(T)[:K] if K <= T else
                              np.concatenate([rng.permutation(T), -np.ones(K - T, int)])
                              for _ in range(S)]) for _ in range(B)])
    idx = np.where(rng.random(idx.shape) < frac_invalid, -1, idx)
    idx[0, 0] = -1                       # a row with no valid index
    if S > 2:
        idx[-1, S // 2] = -1
    return jnp.asarray(idx, jnp.int32)


def _assert_sorted_rows(idx, scores):
    """Valid entries first; ordered by descending score, equal scores by ascending t."""
    idx, scores = np.asarray(idx), np.asarray(scores)
    for row, sc in zip(idx.reshape(-1, idx.shape[-1]), scores.reshape(-1, scores.shape[-1])):
        n = int((row >= 0).sum())
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
        vals = sc[row[:n]]
        for a in range(n - 1):
            assert vals[a] > vals[a + 1] or (vals[a] == vals[a + 1] and row[a] < row[a + 1])


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("op", ["indexer_topk", "indexer_scores", "sparse_mla"])
def test_impl_names(op):
    q = jnp.zeros((1, 2, 2, 4))
    k = jnp.zeros((1, 3, 4))
    w = jnp.ones((1, 2, 2))
    pos, kvl = jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 3, jnp.int32)
    call = {
        "indexer_topk": lambda impl: pk.indexer_topk(q, k, w, topk=2, q_pos=pos, kv_len=kvl, impl=impl),
        "indexer_scores": lambda impl: pk.indexer_scores(q, k, w, q_pos=pos, kv_len=kvl, impl=impl),
        "sparse_mla": lambda impl: pk.sparse_mla(q, k, jnp.zeros((1, 2, 2), jnp.int32), sm_scale=1.0,
                                                 v_dim=2, impl=impl),
    }[op]
    with pytest.raises(ValueError, match=r"unknown impl 'cuda'.*'reference'.*'xla'"):
        call("cuda")
    assert pk.resolve_impl(op, "auto") == "xla"
    call("auto")


def test_choose_q_chunk():
    assert choose_q_chunk(10, 1, 4) == 4
    assert choose_q_chunk(10, 1, 64) == 10
    assert choose_q_chunk(1000, 1) == 256
    big = 131072 * (4 * 64 + 16)             # one query of a 128K-key, 64-head indexer
    c = choose_q_chunk(131072, big)
    assert c >= 1 and c * big <= CHUNK_BUDGET_BYTES and c & (c - 1) == 0
    with pytest.raises(ValueError):
        choose_q_chunk(10, 1, 0)


# ----------------------------------------------------------------------------- indexer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["prefill", "offset", "random"])
def test_indexer_topk_brute_force(impl, mode):
    rng = np.random.default_rng(hash(mode) % 2**32)
    B, S, T, H, D = 2, 6, 9, 2, 3
    q, k, w = _int_inputs(rng, B, S, T, H, D, neg_weights=(mode == "random"))
    q_pos, kv_len = _positions(rng, B, S, T, mode)
    for topk in (1, 4, 12):
        want = _np_topk(q, k, w, q_pos, kv_len, topk)
        got = topk_op(q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, impl=impl, q_chunk=4)
        assert got.dtype == jnp.int32 and got.shape == (B, S, topk)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("B,S,T,H,D,topk,q_chunk", [
    (2, 13, 17, 4, 8, 5, 4),
    (1, 9, 9, 2, 4, 16, 2),        # topk > T
    (3, 10, 32, 3, 8, 8, 3),
    (2, 5, 40, 2, 4, 7, None),
    (2, 16, 16, 4, 8, 4, 5),
])
@pytest.mark.parametrize("mode", ["prefill", "offset", "random"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_indexer_topk_reference_vs_xla(B, S, T, H, D, topk, q_chunk, mode, dtype):
    rng = np.random.default_rng(B * 1000 + S * 100 + T)
    q, k, w = _int_inputs(rng, B, S, T, H, D, dtype, neg_weights=(mode == "random"))
    q_pos, kv_len = _positions(rng, B, S, T, mode)
    ref = topk_op(q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, impl="reference")
    xla = topk_op(q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, impl="xla", q_chunk=q_chunk)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(xla))
    scores = scores_op(q, k, w, q_pos=q_pos, kv_len=kv_len, impl="reference")
    _assert_sorted_rows(xla, scores)
    # masked keys are never selected; the number selected is min(topk, #valid)
    valid = np.isfinite(np.asarray(scores))
    got = np.asarray(xla)
    np.testing.assert_array_equal((got >= 0).sum(-1), np.minimum(topk, valid.sum(-1)))
    b, s, _ = np.nonzero(got >= 0)
    assert valid[b, s, got[got >= 0]].all()


@pytest.mark.parametrize("impl", IMPLS)
def test_indexer_topk_ties_lower_t_wins(impl):
    B, S, T, H, D = 1, 3, 10, 2, 4
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(1, 3, (B, S, H, D)), jnp.float32)     # positive queries
    base = np.asarray(rng.integers(0, 3, (T, D)), np.float32)
    base[7] = base[2] = 5.0                                            # tied best: t = 2, 7
    base[4] = base[8] = 4.0                                            # tied second: t = 4, 8
    k = jnp.asarray(base[None])
    w = jnp.ones((B, S, H), jnp.float32)
    q_pos = jnp.asarray([[9, 9, 7]], jnp.int32)
    kv_len = jnp.asarray([T], jnp.int32)
    for q_chunk in (1, 2, None):
        out = np.asarray(topk_op(q, k, w, topk=3, q_pos=q_pos, kv_len=kv_len, impl=impl,
                                         q_chunk=q_chunk))
        np.testing.assert_array_equal(out[0, 0], [2, 7, 4])
        np.testing.assert_array_equal(out[0, 2], [2, 7, 4])
        out1 = np.asarray(topk_op(q, k, w, topk=1, q_pos=q_pos, kv_len=kv_len, impl=impl))
        np.testing.assert_array_equal(out1[0, :, 0], [2, 2, 2])

    # all keys identical: every score ties, the lowest t's are chosen in ascending order
    k_same = jnp.ones((B, T, D), jnp.float32)
    out = np.asarray(topk_op(q, k_same, w, topk=4, q_pos=q_pos, kv_len=jnp.asarray([6]),
                                     impl=impl))
    np.testing.assert_array_equal(out[0], [[0, 1, 2, 3]] * 3)
    # all scores zero (relu kills every dot product): still the lowest valid t's, then -1
    out = np.asarray(topk_op(-q, k_same, w, topk=12, q_pos=q_pos, kv_len=kv_len, impl=impl))
    np.testing.assert_array_equal(out[0, 2], list(range(8)) + [-1] * 4)


@pytest.mark.parametrize("q_chunk", [1, 3, 7, None])
@pytest.mark.parametrize("mode", ["offset", "random"])
def test_indexer_scores(q_chunk, mode):
    rng = np.random.default_rng(7)
    B, S, T, H, D = 2, 11, 19, 3, 8
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, S, H)), jnp.float32)
    q_pos, kv_len = _positions(rng, B, S, T, mode)
    want = _np_scores(q, k, w, q_pos, kv_len)
    for impl in IMPLS:
        got = scores_op(q, k, w, q_pos=q_pos, kv_len=kv_len, impl=impl, q_chunk=q_chunk)
        assert got.dtype == jnp.float32 and got.shape == (B, S, T)
        np.testing.assert_array_equal(np.isinf(np.asarray(got)), np.isinf(want))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_indexer_topk_float_inputs():
    """Random float (bf16) inputs: the selected scores match the reference's, in order."""
    rng = np.random.default_rng(3)
    B, S, T, H, D, topk = 2, 12, 30, 4, 16, 6
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (B, S, H)), jnp.float32)
    q_pos, kv_len = _positions(rng, B, S, T, "random")
    scores = np.asarray(scores_op(q, k, w, q_pos=q_pos, kv_len=kv_len, impl="reference"))
    ref = np.asarray(topk_op(q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, impl="reference"))
    xla = np.asarray(topk_op(q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, impl="xla", q_chunk=5))
    np.testing.assert_array_equal(ref < 0, xla < 0)
    sel = lambda idx: np.where(idx >= 0, np.take_along_axis(scores, np.maximum(idx, 0), -1), 0.0)
    np.testing.assert_allclose(sel(xla), sel(ref), rtol=1e-5, atol=1e-5)


def test_indexer_jit():
    rng = np.random.default_rng(1)
    B, S, T, H, D = 2, 10, 12, 2, 4
    q, k, w = _int_inputs(rng, B, S, T, H, D)
    q_pos, kv_len = _positions(rng, B, S, T, "offset")
    topk_fn = jax.jit(pk.indexer_topk, static_argnames=("topk", "impl", "interpret", "q_chunk"))
    scores_fn = jax.jit(pk.indexer_scores, static_argnames=("impl", "interpret", "q_chunk"))
    got = topk_fn(q, k, w, topk=5, q_pos=q_pos, kv_len=kv_len, impl="auto", q_chunk=3)
    np.testing.assert_array_equal(np.asarray(got), _np_topk(q, k, w, q_pos, kv_len, 5))
    np.testing.assert_allclose(np.asarray(scores_fn(q, k, w, q_pos=q_pos, kv_len=kv_len, q_chunk=4)),
                               _np_scores(q, k, w, q_pos, kv_len))


# ----------------------------------------------------------------------------- sparse MLA


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_chunk", [3, None])
def test_sparse_mla_equals_dense_causal(impl, q_chunk):
    rng = np.random.default_rng(11)
    B, S, T, H, Dk, v_dim, sm_scale = 2, 7, 10, 3, 8, 5, 0.4
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), jnp.float32)
    q_pos = np.array([np.arange(S) + 3, np.arange(S) - 2])             # batch 1: first rows empty
    # every causal position of each query, in a random order, -1 elsewhere
    idx = np.full((B, S, T), -1)
    for b in range(B):
        for s in range(S):
            n = max(q_pos[b, s] + 1, 0)
            idx[b, s, :n] = rng.permutation(n)
            idx[b, s] = rng.permutation(idx[b, s])
    want_out, want_lse = _np_dense_causal(q, kv, sm_scale, v_dim, q_pos)
    out, lse = mla_op(q, kv, jnp.asarray(idx, jnp.int32), sm_scale=sm_scale, v_dim=v_dim,
                             impl=impl, q_chunk=q_chunk)
    assert out.shape == (B, S, H, v_dim) and out.dtype == q.dtype
    assert lse.shape == (B, S, H) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,S,T,H,Dk,v_dim,K,q_chunk", [
    (2, 9, 16, 4, 12, 8, 5, 4),
    (1, 13, 8, 2, 6, 6, 11, 5),     # K > T: -1 padding
    (3, 6, 20, 3, 8, 4, 7, None),
    (2, 10, 10, 1, 4, 2, 3, 3),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_mla_reference_vs_xla(B, S, T, H, Dk, v_dim, K, q_chunk, dtype):
    rng = np.random.default_rng(S * 31 + T)
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), dtype)
    idx = _random_indices(rng, B, S, T, K)
    kw = dict(sm_scale=Dk ** -0.5, v_dim=v_dim)
    o_ref, l_ref = mla_op(q, kv, idx, impl="reference", **kw)
    o_xla, l_xla = mla_op(q, kv, idx, impl="xla", q_chunk=q_chunk, **kw)
    assert o_xla.dtype == dtype and l_xla.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(o_xla, np.float32), np.asarray(o_ref, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(np.asarray(l_xla)), np.isneginf(np.asarray(l_ref)))
    np.testing.assert_allclose(np.asarray(l_xla), np.asarray(l_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_sparse_mla_empty_rows(impl):
    rng = np.random.default_rng(5)
    B, S, T, H, Dk, K = 2, 5, 6, 2, 4, 3
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), jnp.float32)
    idx = np.array(_random_indices(rng, B, S, T, K, frac_invalid=0.0))
    idx[1] = -1                                    # every row of batch 1 empty
    idx[0, 2] = [-1, T, T + 5]                     # out-of-range entries are skipped too
    out, lse = mla_op(q, kv, jnp.asarray(idx), sm_scale=0.5, v_dim=3, impl=impl, q_chunk=2)
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    assert (out[0, 2] == 0).all() and np.isneginf(lse[0, 2]).all()
    assert (out[0, 0] == 0).all() and np.isneginf(lse[0, 0]).all()    # emptied by _random_indices
    assert np.isfinite(out).all() and np.isfinite(lse[0, [1, 3, 4]]).all()


def _loss(impl, idx, cot, c_lse, q_chunk):
    def f(q, kv):
        out, lse = mla_op(q, kv, idx, sm_scale=0.3, v_dim=5, impl=impl, q_chunk=q_chunk)
        lse_term = jnp.where(jnp.isfinite(lse), lse * c_lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(lse_term)
    return f


@pytest.mark.parametrize("q_chunk", [2, None])
def test_sparse_mla_gradients(q_chunk):
    rng = np.random.default_rng(9)
    B, S, T, H, Dk, K = 2, 7, 9, 3, 8, 4
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), jnp.float32)
    idx = np.array(_random_indices(rng, B, S, T, K))
    idx[1, 3:] = -1                                # several empty rows
    idx = jnp.asarray(idx)
    cot = jnp.asarray(rng.normal(size=(B, S, H, 5)), jnp.float32)
    c_lse = jnp.asarray(rng.normal(size=(B, S, H)), jnp.float32)
    grads = {}
    for impl in IMPLS:
        fn = jax.jit(jax.grad(_loss(impl, idx, cot, c_lse, q_chunk), argnums=(0, 1)))
        grads[impl] = fn(q, kv)
        for g in grads[impl]:
            assert np.isfinite(np.asarray(g)).all()
    for g_ref, g_xla in zip(grads["reference"], grads["xla"]):
        np.testing.assert_allclose(np.asarray(g_xla), np.asarray(g_ref), rtol=1e-4, atol=1e-5)
    # the query gradient of an empty row is exactly zero
    assert (np.asarray(grads["xla"][0])[1, 3:] == 0).all()

    # and both match finite differences in a random direction
    f = _loss("xla", idx, cot, c_lse, q_chunk)
    dq = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    dkv = jnp.asarray(rng.normal(size=kv.shape), jnp.float32)
    eps = 1e-2
    fd = (f(q + eps * dq, kv + eps * dkv) - f(q - eps * dq, kv - eps * dkv)) / (2 * eps)
    an = jnp.sum(grads["xla"][0] * dq) + jnp.sum(grads["xla"][1] * dkv)
    np.testing.assert_allclose(float(fd), float(an), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_sparse_mla_duplicates_do_not_fail(impl):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 4, 2, 4)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(1, 5, 4)), jnp.float32)
    idx = jnp.asarray([[[0, 0, 1], [2, 2, 2], [-1, 3, 3], [4, -1, 4]]], jnp.int32)
    out, lse = mla_op(q, kv, idx, sm_scale=1.0, v_dim=4, impl=impl)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    g = jax.grad(lambda q, kv: mla_op(q, kv, idx, sm_scale=1.0, v_dim=4, impl=impl)[1].sum(),
                 argnums=(0, 1))(q, kv)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


def test_sparse_mla_jit_static_args():
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(size=(1, 9, 8)), jnp.bfloat16)
    idx = _random_indices(rng, 1, 6, 9, 4)
    fn = jax.jit(pk.sparse_mla, static_argnames=("sm_scale", "v_dim", "impl", "interpret", "q_chunk"))
    out, lse = fn(q, kv, idx, sm_scale=0.35, v_dim=6, impl="xla", q_chunk=4)
    o_ref, l_ref = mla_op(q, kv, idx, sm_scale=0.35, v_dim=6, impl="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(o_ref, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(l_ref), atol=1e-5)


# ----------------------------------------------------------------------------- memory


def test_xla_long_prefill_memory_is_chunked():
    """A 64K-token prefill compiles with temporaries far below one [S, T] float32 matrix."""
    S = T = 65536
    f32 = jnp.float32
    sd = jax.ShapeDtypeStruct
    dense_bytes = S * T * 4                              # 16 GiB

    topk = jax.jit(lambda q, k, w, p, n: topk_op(q, k, w, topk=64, q_pos=p, kv_len=n, impl="xla"))
    args = (sd((1, S, 2, 16), jnp.bfloat16), sd((1, T, 16), jnp.bfloat16), sd((1, S, 2), f32),
            sd((1, S), jnp.int32), sd((1,), jnp.int32))
    mem = topk.lower(*args).compile().memory_analysis()
    if mem is None:
        pytest.skip("memory analysis unavailable on this backend")
    assert mem.temp_size_in_bytes < dense_bytes / 16

    def loss(q, kv, idx):
        out, lse = mla_op(q, kv, idx, sm_scale=0.1, v_dim=16, impl="xla")
        return out.astype(f32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (sd((1, S, 2, 32), jnp.bfloat16), sd((1, T, 32), jnp.bfloat16), sd((1, S, 64), jnp.int32))
    mem = grad.lower(*args).compile().memory_analysis()
    # every query's gathered rows, stored for the backward pass, would be S * 64 * 32 * 2 bytes
    assert mem.temp_size_in_bytes < S * 64 * 32 * 2 / 2
