"""The contract every kernel implementation is held to, for `tests/test_kernel_contract.py` (every
registered implementation with its default config) and the kernel files' config tests.

* `impl_params(op)`: one pytest parameter per entry of `pallas_kernels.REGISTRY[op]`, so a new
  implementation is tested by adding its registry entry. Pallas implementations run in
  interpret mode off their own backend; one that cannot run here (cuDNN off a GPU) is skipped.
* float64 numpy oracles written from the contracts (`np_*`), independent of every
  implementation, the reference included: forward values and analytic gradients.
* `check_*`: call an op with (impl, config) on given inputs and assert its contract.

Indexer inputs are small integers, so every float32 score is exact whatever the summation
order: scores and indices are compared for equality and ties are plentiful.

On a GPU, run these with JAX_DEFAULT_MATMUL_PRECISION=highest (and JAX_PLATFORMS=cuda,cpu, for
the TPU interpreter): the float32 tolerances assume float32 matmuls, which GPUs run in TF32 by
default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

#: The static keyword arguments of each op (jitted once per value).
STATIC = {"indexer_scores": (), "indexer_topk": ("topk",), "sparse_mla": ("sm_scale", "v_dim", "return_target"),
          "causal_attention": ("scale",), "indexer_cross_entropy": (), "paged_indexer_topk": ("topk",),
          "paged_sparse_mla": ("sm_scale", "v_dim"), "dense_indexer_kl": ("sm_scale", "shares")}
_OPS = {op: jax.jit(getattr(pk, op), static_argnames=STATIC[op] + ("impl", "config", "interpret"))
        for op in pk.REGISTRY}


def runs_here(op: str, impl: str) -> bool:
    entry = pk.REGISTRY[op][impl]
    return entry.interpretable or entry.platform == jax.default_backend()


def impl_params(op: str, *, exclude: tuple[str, ...] = ()):
    """pytest parameters: every registered implementation of op (but `exclude`), skipped where
    it cannot run."""
    return [pytest.param(impl, id=impl, marks=() if runs_here(op, impl) else pytest.mark.skip(
        reason=f"{impl} runs only on {pk.REGISTRY[op][impl].platform}"))
        for impl in pk.REGISTRY[op] if impl not in exclude]


def call(op: str, impl: str, *args, config=None, **kwargs):
    """The public op, jitted, with `impl` and `config`; a Pallas impl off its backend interpreted."""
    entry = pk.REGISTRY[op][impl]
    interpret = entry.platform is not None and entry.platform != jax.default_backend()
    return _OPS[op](*args, impl=impl, config=config, interpret=interpret, **kwargs)


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ----------------------------------------------------------------------------- indexer


def int_inputs(rng, B, S, T, H, D, *, lim=3, neg_weights=True, dtype=jnp.float32):
    """Integer-valued q [B, S, H, D], k [B, T, D] in [-lim, lim] and weights f32 [B, S, H]."""
    q = jnp.asarray(rng.integers(-lim, lim + 1, (B, S, H, D)), dtype)
    k = jnp.asarray(rng.integers(-lim, lim + 1, (B, T, D)), dtype)
    w = jnp.asarray(rng.integers(-2 if neg_weights else 1, 4, (B, S, H)), jnp.float32)
    return q, k, w


def float_score_inputs(rng, B=2, S=11, T=19, H=3, D=8):
    """Normal float32 q [2B, S, H, D], k [2B, T, D], weights [2B, S, H], with B sequences of
    queries at an offset then B at random positions -> (q, k, w, q_pos, kv_len)."""
    q = jnp.asarray(rng.normal(size=(2 * B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2 * B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2 * B, S, H)), jnp.float32)
    parts = [positions(rng, B, S, T, mode) for mode in ("offset", "random")]
    q_pos, kv_len = (jnp.concatenate(x) for x in zip(*parts))
    return q, k, w, q_pos, kv_len


def positions(rng, B, S, T, mode):
    """(q_pos int32 [B, S], kv_len int32 [B]) of a serving situation: "prefill" (causal from 0,
    ragged kv_len), "offset" (chunked prefill / decode at an offset into the cache) or "random"
    (random positions; queries that see nothing (-1) or one key, ragged kv_len)."""
    if mode == "prefill":
        q_pos = np.tile(np.arange(S), (B, 1))
        kv_len = rng.integers(0, T + 1, B)
        kv_len[0] = T
    elif mode == "offset":
        off = rng.integers(0, max(T - S, 0) + 1, B)
        q_pos = off[:, None] + np.arange(S)[None]
        kv_len = np.minimum(off + S, T)
    else:
        q_pos = rng.integers(-1, T + 2, (B, S))
        q_pos[:, 0] = -1
        q_pos[:, -1] = 0
        kv_len = rng.integers(0, T + 1, B)
    return jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_len, jnp.int32)


def doc_starts(rng, q_pos):
    """Packed documents: each query's first valid key, somewhere at or before it."""
    pos = np.asarray(q_pos)
    return jnp.asarray(np.where(rng.random(pos.shape) < 0.3, 0, rng.integers(0, np.maximum(pos, 0) + 1)),
                       jnp.int32)


def np_key_mask(q_pos, kv_len, T, kv_start=None) -> np.ndarray:
    t = np.arange(T)[None, None, :]
    valid = (t <= np.asarray(q_pos)[..., None]) & (t < np.asarray(kv_len)[:, None, None])
    if kv_start is not None:
        valid &= t >= np.asarray(kv_start)[..., None]
    return valid


def np_scores(q, k, w, q_pos, kv_len, kv_start=None) -> np.ndarray:
    """float64 [B, S, T]: sum_h w * relu(q . k) where kv_start <= t <= q_pos, t < kv_len; -inf else."""
    logits = np.einsum("bshd,btd->bsht", f64(q), f64(k))
    score = np.sum(np.maximum(logits, 0.0) * f64(w)[..., None], axis=2)
    return np.where(np_key_mask(q_pos, kv_len, k.shape[1], kv_start), score, -np.inf)


def np_topk(scores: np.ndarray, topk: int) -> np.ndarray:
    """int32 [..., topk]: each row's valid t by descending score, then ascending t; -1 after."""
    rows = scores.reshape(-1, scores.shape[-1])
    out = np.full((rows.shape[0], topk), -1, np.int32)
    for r, row in enumerate(rows):
        valid = np.flatnonzero(np.isfinite(row))
        order = valid[np.lexsort((valid, -row[valid]))][:topk]
        out[r, :order.size] = order
    return out.reshape(scores.shape[:-1] + (topk,))


def np_scores_grads(q, k, w, q_pos, kv_len, kv_start, g):
    """(dq, dk, dw) of sum(g * scores) over the valid scores (g float64 [B, S, T])."""
    q, k, w = f64(q), f64(k), f64(w)
    g = np.where(np_key_mask(q_pos, kv_len, k.shape[1], kv_start), g, 0.0)
    logits = np.einsum("bshd,btd->bsht", q, k)
    active = (logits > 0) * w[..., None] * g[:, :, None, :]              # [B, S, H, T]
    dq = np.einsum("bsht,btd->bshd", active, k)
    dk = np.einsum("bsht,bshd->btd", active, q)
    dw = np.einsum("bst,bsht->bsh", g, np.maximum(logits, 0.0))
    return dq, dk, dw


def check_topk(impl, q, k, w, *, topk, q_pos, kv_len, kv_start=None, config=None) -> np.ndarray:
    """indexer_topk equals the brute force on integer inputs (dtype, shape, every slot); -> it."""
    got = call("indexer_topk", impl, q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start,
               config=config)
    assert got.dtype == jnp.int32 and got.shape == q.shape[:2] + (topk,)
    want = np_topk(np_scores(q, k, w, q_pos, kv_len, kv_start), topk)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{impl} top-{topk}")
    return want


def check_scores(impl, q, k, w, *, q_pos, kv_len, kv_start=None, config=None, exact=True):
    """indexer_scores: float32 [B, S, T], -inf exactly where masked, the values of the oracle
    (exactly on integer inputs)."""
    got = call("indexer_scores", impl, q, k, w, q_pos=q_pos, kv_len=kv_len, kv_start=kv_start, config=config)
    assert got.dtype == jnp.float32 and got.shape == q.shape[:2] + k.shape[1:2]
    want = np_scores(q, k, w, q_pos, kv_len, kv_start)
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- sparse MLA


def sparse_inputs(seed, B, S, T, K, H, Dk, dtype=jnp.float32):
    """q [B, S, H, Dk], kv [B, T, Dk] normal; indices int32 [B, S, K], distinct per row, with
    scattered -1, a row with no valid index (0, 0), and when S > 1 a row with trailing -1 and
    out-of-range entries T + 3, T + 5 (B - 1, 1), and a row holding only 1, 1, 2 (a duplicated
    index) at (0, 1) when B > 1, else at (0, 2) when S > 2; K > T pads with -1."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), dtype)
    idx = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            row = rng.permutation(T)[:K]
            idx[b, s, :row.size] = row
    idx[rng.random(idx.shape) < 0.25] = -1
    idx[0, 0, :] = -1
    if S > 1:
        idx[-1, 1, K // 2:] = -1
        idx[-1, 1, 0] = T + 3
        idx[-1, 1, -1] = T + 5
    dup = (0, 1) if B > 1 else (0, 2)
    if S > dup[1] and K >= 3:
        idx[dup] = -1
        idx[dup][:3] = [1, 1, 2]
    return q, kv, jnp.asarray(idx)


def backward_inputs(seed, B, S, T, K, H, Dk, v_dim, dtype=jnp.float32):
    """`sparse_inputs` without its duplicated index (how a duplicate counts is unspecified: a
    repeated index becomes -1), and a cotangent dout [B, S, H, v_dim] of the output in dtype."""
    q, kv, idx = sparse_inputs(seed, B=B, S=S, T=T, K=K, H=H, Dk=Dk, dtype=dtype)
    idx = np.array(idx)
    for row in idx.reshape(-1, K):
        seen = set()
        for j, t in enumerate(row):
            if 0 <= t < T and t in seen:
                row[j] = -1
            seen.add(int(t))
    dout = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(B, S, H, v_dim)), dtype)
    return q, kv, jnp.asarray(idx), dout


def vjp_grads(fn, q, kv, idx, dout):
    """(dq, dkv) of fn(q, kv, idx) -> (out, lse) for the cotangents (dout, a per-head dlse)."""
    (out, lse), pull = jax.vjp(lambda q, kv: fn(q, kv, idx), q, kv)
    heads = lse.shape[-1]
    dlse = jnp.where(jnp.isfinite(lse), jnp.arange(1, heads + 1, dtype=jnp.float32) / heads, 0.0)
    return pull((dout.astype(out.dtype), dlse))


def check_bf16_grads_repeatable(grad, want) -> None:
    """grad() -> (dq, dkv) in bfloat16, each within 1% (in norm) of want = the float32 reference's
    (dq, dkv), and a second call gives the same bits."""
    dq, dkv = grad()
    assert dq.dtype == jnp.bfloat16 and dkv.dtype == jnp.bfloat16
    for got, ref in zip((dq, dkv), want, strict=True):
        got = np.asarray(got, np.float32)
        assert np.linalg.norm(got - ref) <= 1e-2 * np.linalg.norm(ref)
    for first, second in zip((dq, dkv), grad(), strict=True):
        np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))


def duplicated_rows(indices, num_keys) -> np.ndarray:
    """bool [B, S]: rows that list a valid index twice (how duplicates count is unspecified)."""
    idx = np.sort(np.where((np.asarray(indices) >= 0) & (np.asarray(indices) < num_keys), indices, -1), axis=-1)
    return np.any((idx[..., 1:] == idx[..., :-1]) & (idx[..., 1:] >= 0), axis=-1)


def np_sparse_mla(q, kv, indices, sm_scale, v_dim, cot=None, c_lse=None):
    """float64 (out [B, S, H, v_dim], lse [B, S, H]) over the valid selected rows (duplicates once);
    with cot [B, S, H, v_dim] and c_lse [B, S, H] also (dq, dkv) of
    sum(out * cot) + sum(lse * c_lse) over the rows with a valid index."""
    q, kv, idx = f64(q), f64(kv), np.asarray(indices)
    B, S, _, _ = q.shape
    T = kv.shape[1]
    sel = np.zeros((B, S, T), bool)
    b, s, j = np.nonzero((idx >= 0) & (idx < T))
    sel[b, s, idx[b, s, j]] = True
    logits = np.where(sel[:, :, None], np.einsum("bshd,btd->bsht", q, kv) * sm_scale, -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    denom = e.sum(-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1.0)
    out = np.einsum("bsht,btd->bshd", p, kv[..., :v_dim])
    lse = np.where(denom[..., 0] > 0, m[..., 0] + np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1.0)), -np.inf)
    if cot is None:
        return out, lse
    cot, c_lse = f64(cot), np.where(np.isfinite(lse), f64(c_lse), 0.0)
    dp = np.einsum("bshd,btd->bsht", cot, kv[..., :v_dim])
    dlogits = p * (dp - np.sum(cot * out, -1, keepdims=True) + c_lse[..., None]) * sm_scale
    dq = np.einsum("bsht,btd->bshd", dlogits, kv)
    dkv = np.einsum("bsht,bshd->btd", dlogits, q)
    dkv[..., :v_dim] += np.einsum("bsht,bshd->btd", p, cot)
    return out, lse, dq, dkv


def assert_lse(lse, want):
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(np.where(fin, lse, 0), np.where(fin, want, 0), rtol=1e-5, atol=1e-5)


def assert_sparse_mla_forward(out, lse, q, kv, idx, *, sm_scale, v_dim, tol):
    """out [B, S, H, v_dim] in q.dtype and lse f32 [B, S, H] equal the oracle over kv [B, T, Dk];
    rows with no valid index give out 0 and lse -inf; rows with a duplicated index are only
    finite. -> (out as float64, the duplicated rows, the empty rows: bool [B, S])."""
    assert out.shape == q.shape[:3] + (v_dim,) and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    out, lse = f64(out), np.asarray(lse)
    dup = duplicated_rows(idx, kv.shape[1])
    assert np.isfinite(out).all() and np.isfinite(lse[dup]).all()
    want_out, want_lse = np_sparse_mla(q, kv, idx, sm_scale, v_dim)
    np.testing.assert_allclose(out[~dup], want_out[~dup], rtol=tol, atol=tol)
    assert_lse(lse[~dup], want_lse[~dup])
    empty = ~np.any((np.asarray(idx) >= 0) & (np.asarray(idx) < kv.shape[1]), axis=-1)   # [B, S]
    assert empty.any()
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    return out, dup, empty


def check_sparse_mla(impl, q, kv, idx, *, sm_scale, v_dim, config=None, gradients=True, tol=1e-5):
    """sparse_mla: out [B, S, H, v_dim] in q.dtype and lse f32 [B, S, H] equal the oracle; rows
    with no valid index give out 0 and lse -inf; rows with a duplicated index are only finite.
    With `gradients`, dq and dkv of a loss of out and lse are finite and equal the oracle's but
    where duplicates make them unspecified (their rows' dq, the kv rows they select), and dq
    is exactly 0 on the rows with no valid index."""
    out, lse = call("sparse_mla", impl, q, kv, idx, sm_scale=sm_scale, v_dim=v_dim, config=config)
    out, dup, empty = assert_sparse_mla_forward(out, lse, q, kv, idx, sm_scale=sm_scale, v_dim=v_dim, tol=tol)
    if not gradients:
        return
    rng = np.random.default_rng(q.shape[1] * 7 + idx.shape[-1])
    cot = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    c_lse = jnp.asarray(rng.normal(size=lse.shape), jnp.float32)

    def loss(q, kv):
        out, lse = call("sparse_mla", impl, q, kv, idx, sm_scale=sm_scale, v_dim=v_dim, config=config)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * c_lse, 0.0))

    dq, dkv = (f64(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv))
    assert np.isfinite(dq).all() and np.isfinite(dkv).all()
    _, _, want_dq, want_dkv = np_sparse_mla(q, kv, idx, sm_scale, v_dim, cot, c_lse)
    # the rows with duplicates send unspecified amounts to the kv rows they select
    touched = np.zeros(kv.shape[:2], bool)
    b, s, j = np.nonzero(dup[..., None] & (np.asarray(idx) >= 0) & (np.asarray(idx) < kv.shape[1]))
    touched[b, np.asarray(idx)[b, s, j]] = True
    np.testing.assert_allclose(dq[~dup], want_dq[~dup], rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(dkv[~touched], want_dkv[~touched], rtol=4 * tol, atol=4 * tol)
    assert (dq[empty] == 0).all()


def np_sparse_target(q, kv, indices, sm_scale) -> np.ndarray:
    """float64 [B, S, K]: mean over heads of exp(sm_scale q . kv[idx] - lse) at each valid slot, else 0."""
    q, kv, idx = f64(q), f64(kv), np.asarray(indices)
    _, lse = np_sparse_mla(q, kv, idx, sm_scale, 1)
    valid = (idx >= 0) & (idx < kv.shape[1])
    rows = np.take_along_axis(kv[:, None], np.where(valid, idx, 0)[..., None], axis=2)   # [B, S, K, Dk]
    logits = np.einsum("bshd,bskd->bshk", q, rows) * sm_scale
    p = np.exp(logits - np.where(np.isfinite(lse), lse, np.inf)[..., None])
    return np.where(valid, p.mean(axis=2), 0.0)


def check_sparse_mla_target(impl, q, kv, idx, *, sm_scale, v_dim, config=None, tol=1e-5):
    """sparse_mla with return_target: out and lse those of the contract; target float32 [B, S, K]
    equal to the oracle (0 at invalid slots, all 0 in a row with no valid index; rows with a
    duplicated index only finite); a cotangent of the target alone gives zero gradients."""
    kw = dict(sm_scale=sm_scale, v_dim=v_dim, return_target=True, config=config)
    (out, lse, target), pull = jax.vjp(lambda q, kv: call("sparse_mla", impl, q, kv, idx, **kw), q, kv)
    dup = duplicated_rows(idx, kv.shape[1])
    want_out, want_lse = np_sparse_mla(q, kv, idx, sm_scale, v_dim)
    np.testing.assert_allclose(f64(out)[~dup], want_out[~dup], rtol=tol, atol=tol)
    assert_lse(np.asarray(lse)[~dup], want_lse[~dup])
    assert target.shape == idx.shape and target.dtype == jnp.float32
    target = np.asarray(target)
    assert np.isfinite(target).all()
    np.testing.assert_allclose(target[~dup], np_sparse_target(q, kv, idx, sm_scale)[~dup], rtol=tol, atol=tol)
    valid = (np.asarray(idx) >= 0) & (np.asarray(idx) < kv.shape[1])
    assert (target[~valid] == 0).all() and (~valid.any(-1)).any()
    np.testing.assert_allclose(target.sum(-1)[valid.any(-1) & ~dup], 1.0, rtol=tol)
    weight = jnp.asarray(np.random.default_rng(1).normal(size=target.shape), jnp.float32)
    for g in pull((jnp.zeros_like(out), jnp.zeros_like(lse), weight)):
        assert not np.asarray(g).any()


# ----------------------------------------------------------------------------- indexer cross-entropy


def np_indexer_cross_entropy(q, k, w, indices, target, g=None):
    """float64 ce [B, S] = -sum over valid slots of target * log softmax (over the valid slots) of
    z = sum_h w relu(q . k[idx]); with g [B, S] also (dq, dk, dw) of sum(g * ce)."""
    q, k, w, t, idx = f64(q), f64(k), f64(w), f64(target), np.asarray(indices)
    valid = (idx >= 0) & (idx < k.shape[1])
    rows = np.take_along_axis(k[:, None], np.where(valid, idx, 0)[..., None], axis=2)   # [B, S, K, D]
    s = np.einsum("bshd,bskd->bshk", q, rows)
    z = np.where(valid, np.sum(np.maximum(s, 0.0) * w[..., None], axis=2), -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    denom = np.exp(z - m).sum(-1, keepdims=True)
    denom = np.where(denom > 0, denom, 1.0)
    t = np.where(valid, t, 0.0)
    ce = -np.sum(t * np.where(valid, z - m - np.log(denom), 0.0), axis=-1)
    if g is None:
        return ce
    dz = f64(g)[..., None] * (np.exp(z - m) / denom * t.sum(-1, keepdims=True) - t)    # [B, S, K]
    ds = dz[:, :, None, :] * w[..., None] * (s > 0)                                     # [B, S, H, K]
    dq = np.einsum("bshk,bskd->bshd", ds, rows)
    dw = np.einsum("bsk,bshk->bsh", dz, np.maximum(s, 0.0))
    dk = np.zeros_like(k)
    b, srow, j = np.nonzero(valid)
    np.add.at(dk, (b, idx[b, srow, j]), np.einsum("bshk,bshd->bskd", ds, q)[b, srow, j])
    return ce, dq, dk, dw


def cross_entropy_inputs(seed, B, S, T, K, H, D, dtype=jnp.float32):
    """`sparse_inputs` as indexer queries, keys and indices, plus weights float32 [B, S, H] of both
    signs and a non-negative target float32 [B, S, K], with mass at invalid slots too."""
    q, k, idx = sparse_inputs(seed, B=B, S=S, T=T, K=K, H=H, Dk=D, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    w = jnp.asarray(rng.normal(size=(B, S, H)), jnp.float32)
    target = jnp.asarray(rng.random((B, S, K)), jnp.float32)
    return q, k, w, idx, target


def check_indexer_cross_entropy(impl, q, k, w, idx, target, *, config=None, tol=1e-5):
    """indexer_cross_entropy: float32 [B, S] equal to the oracle, 0 on rows with no valid slot,
    only finite on rows with a duplicated index; gradients finite and equal to the oracle's
    but where duplicates make them unspecified (their rows' dq and dw, the keys they select),
    dq and dw exactly 0 on the rows with no valid slot, and none into the target."""
    fn = lambda q, k, w, target: call("indexer_cross_entropy", impl, q, k, w, idx, target, config=config)
    ce, pull = jax.vjp(fn, q, k, w, target)
    assert ce.shape == idx.shape[:2] and ce.dtype == jnp.float32
    ce = np.asarray(ce)
    dup = duplicated_rows(idx, k.shape[1])
    empty = ~np.any((np.asarray(idx) >= 0) & (np.asarray(idx) < k.shape[1]), axis=-1)
    assert np.isfinite(ce).all() and empty.any() and (ce[empty] == 0).all()
    np.testing.assert_allclose(ce[~dup], np_indexer_cross_entropy(q, k, w, idx, target)[~dup], rtol=tol, atol=tol)
    g = jnp.asarray(np.random.default_rng(3).normal(size=ce.shape), jnp.float32)
    dq, dk, dw, dt = (f64(x) for x in pull(g))
    _, want_dq, want_dk, want_dw = np_indexer_cross_entropy(q, k, w, idx, target, g)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dw).all() and not dt.any()
    touched = np.zeros(k.shape[:2], bool)
    b, s, j = np.nonzero(dup[..., None] & (np.asarray(idx) >= 0) & (np.asarray(idx) < k.shape[1]))
    touched[b, np.asarray(idx)[b, s, j]] = True
    np.testing.assert_allclose(dq[~dup], want_dq[~dup], rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(dw[~dup], want_dw[~dup], rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(dk[~touched], want_dk[~touched], rtol=4 * tol, atol=4 * tol)
    assert (dq[empty] == 0).all() and (dw[empty] == 0).all()


# ----------------------------------------------------------------------------- paged stores


def paged_store(seed, rows, page_size, *, slots=3, slot=1, spare_pages=3):
    """rows [B, T, D] laid out in a paged store the way a pool leaves them: pages shuffled over
    the store (not in sequence order, interleaved between sequences), the last page of each
    sequence partly filled, every other row of the store (other slots, spare pages, the rest of
    the last pages) integer junk in [-4, 4].
    -> (store [slots, pages, P, D] in rows.dtype, page_table int32 [B, n], the logical rows
       [B, n * P, D] the table addresses: rows, then the junk of the last pages)."""
    rng = np.random.default_rng(seed)
    rows_np = np.asarray(jnp.asarray(rows, jnp.float32))
    B, T, D = rows_np.shape
    n = -(-T // page_size)
    table = rng.permutation(B * n + spare_pages)[:B * n].reshape(B, n).astype(np.int32)
    store = rng.integers(-4, 5, (slots, B * n + spare_pages, page_size, D)).astype(np.float32)
    logical = np.pad(rows_np, ((0, 0), (0, n * page_size - T), (0, 0)))
    for b in range(B):
        for j in range(n):
            filled = min(page_size, T - j * page_size)
            store[slot, table[b, j], :filled] = rows_np[b, j * page_size:j * page_size + filled]
            logical[b, j * page_size + filled:(j + 1) * page_size] = store[slot, table[b, j], filled:]
    return jnp.asarray(store, rows.dtype), jnp.asarray(table), jnp.asarray(logical, rows.dtype)


def check_paged_sparse_mla(impl, q, kv, idx, *, page_size, sm_scale, v_dim, config=None, tol=1e-5):
    """paged_sparse_mla over kv [B, T, Dk] laid out by `paged_store` (slot 1 of 3) equals the
    oracle over the logical rows (the junk past T included: indices up to n * P are valid)."""
    store, table, logical = paged_store(idx.shape[-1] + page_size, kv, page_size)
    out, lse = call("paged_sparse_mla", impl, q, store, table, idx, slot=jnp.int32(1), sm_scale=sm_scale,
                    v_dim=v_dim, config=config)
    assert_sparse_mla_forward(out, lse, q, logical, idx, sm_scale=sm_scale, v_dim=v_dim, tol=tol)


def check_paged_topk(impl, q, k, w, *, page_size, topk, q_pos, kv_len, config=None):
    """paged_indexer_topk over keys k [B, T, D] laid out by `paged_store` (slot 1 of 3) equals
    the brute force over the logical keys."""
    store, table, logical = paged_store(topk + page_size, k, page_size)
    got = call("paged_indexer_topk", impl, q, store, table, w, slot=jnp.int32(1), topk=topk, q_pos=q_pos,
               kv_len=kv_len, config=config)
    assert got.dtype == jnp.int32 and got.shape == q.shape[:2] + (topk,)
    want = np_topk(np_scores(q, logical, w, q_pos, kv_len), topk)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{impl} paged top-{topk}")


# ----------------------------------------------------------------------------- causal attention


def packed_documents(rng, B, S):
    """Documents packed into each row: (segment ids int32 [B, S], mask bool [B, S, S] of
    same-document pairs, segments (offsets int32 [B, M + 1], lengths int32 [B, M]))."""
    ids = np.zeros((B, S), np.int32)
    offsets, lengths = [], []
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(1, 4), replace=False))
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [S]])
        for m, (a, e) in enumerate(zip(starts, ends)):
            ids[b, a:e] = m
        offsets.append(starts)
        lengths.append(ends - starts)
    M = max(len(x) for x in offsets) + 1
    off = np.full((B, M + 1), -1, np.int32)
    lens = np.full((B, M), -1, np.int32)
    for b in range(B):
        off[b, :len(offsets[b])] = offsets[b]
        lens[b, :len(lengths[b])] = lengths[b]
    mask = ids[:, :, None] == ids[:, None, :]
    return jnp.asarray(mask), (jnp.asarray(off), jnp.asarray(lens))


def np_causal(q, k, v, scale, visible, cot=None):
    """float64 out [B, S, N, d] of causal attention over `visible` [B, S, S] (rows with no
    visible key: 0); with cot also (dq, dk, dv) of sum(out * cot)."""
    q, k, v = f64(q), f64(k), f64(v)
    logits = np.where(visible[:, None], np.einsum("bsnd,btnd->bnst", q, k) * scale, -np.inf)
    m = np.max(logits, -1, keepdims=True)
    e = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bnst,btnd->bsnd", p, v)
    if cot is None:
        return out
    cot = f64(cot)
    dp = np.einsum("bsnd,btnd->bnst", cot, v)
    dlogits = p * (dp - np.einsum("bsnd,bsnd->bns", cot, out)[..., None]) * scale
    dq = np.einsum("bnst,btnd->bsnd", dlogits, k)
    dk = np.einsum("bnst,bsnd->btnd", dlogits, q)
    dv = np.einsum("bnst,bsnd->btnd", p, cot)
    return out, dq, dk, dv


def np_visible(S, kv_len, mask) -> np.ndarray:
    t = np.arange(S)
    visible = np.broadcast_to(t[None, None, :] <= t[None, :, None], (len(kv_len), S, S))
    visible = visible & (t[None, None, :] < np.asarray(kv_len)[:, None, None])
    return visible if mask is None else visible & np.asarray(mask)


def check_causal_attention(impl, q, k, v, *, scale, kv_len, mask, segments, documents, config=None,
                           gradients=True, tol=2e-2):
    """causal_attention: [B, S, N, d] in q.dtype equal to the oracle on every row s < kv_len
    (`documents`: the mask that mask / segments stand for, or None); with `gradients`, dq, dk, dv
    of sum(out * cot) over those rows equal the oracle's. `tol` relative to the largest value."""
    B, S = q.shape[:2]
    rows = np.arange(S)[None, :] < np.asarray(kv_len)[:, None]                   # [B, S]
    visible = np_visible(S, kv_len, documents)
    kw = dict(scale=scale, kv_len=kv_len, mask=mask, segments=segments, config=config)
    out = call("causal_attention", impl, q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = np_causal(q, k, v, scale, visible)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.abs(b).max(), 1e-6))
    close(np.where(rows[..., None, None], f64(out), 0), np.where(rows[..., None, None], want, 0))
    if not gradients:
        return
    cot = jnp.asarray(np.random.default_rng(S).normal(size=q.shape) * rows[..., None, None], jnp.float32)
    loss = lambda q, k, v: jnp.sum(call("causal_attention", impl, q, k, v, **kw).astype(jnp.float32) * cot)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, np_causal(q, k, v, scale, visible, cot)[1:]):
        close(f64(got), want)


# ----------------------------------------------------------------------------- dense indexer KL


def dense_indexer_kl_inputs(seed, B=3, S=40, L=2, H=3, Dk=24, Hi=2, Di=16):
    """L layers' normal queries [B, S, H, Dk] and latent rows [B, S, Dk], the indexer's queries
    [B, S, Hi, Di], keys [B, S, Di] and positive weights [B, S, Hi], kv_len int32 [B] (row 0
    whole, row 1 ragged, row 2 empty: kv_len 0) and packed documents kv_start int32 [B, S]
    -> (qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    qs = [normal(B, S, H, Dk) for _ in range(L)]
    latents = [normal(B, S, Dk) for _ in range(L)]
    idx_w = jnp.asarray(rng.uniform(0.1, 1.0, (B, S, Hi)), jnp.float32)
    kv_len = jnp.asarray([S, S - 9] + [0] * (B - 2), jnp.int32)
    kv_start = doc_starts(rng, np.tile(np.arange(S), (B, 1)))
    return qs, latents, normal(B, S, Hi, Di), normal(B, S, Di), idx_w, kv_len, kv_start


def np_dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, *, sm_scale, kv_len, kv_start, shares, g=None):
    """float64 [B, S]: per query sum_j share_j sum_t t_j log t_j - sum_t tbar s_t + LSE_s over the
    visible keys (kv_start <= t <= s, t < kv_len; LSE_s 0 where none), t_j the head mean of layer
    j's softmax and tbar = sum_j share_j t_j; with g [B, S] also (dq, dk, dw) of sum(g * rows),
    d rows / d s_t = softmax(s)_t - tbar_t."""
    B, S = idx_q.shape[:2]
    q_pos = np.tile(np.arange(S), (B, 1))
    visible = np_key_mask(q_pos, kv_len, S, kv_start)                          # [B, S, T]

    def softmax(z):                     # over the last axis, 0 where nothing is visible
        m = np.max(z, -1, keepdims=True)
        e = np.exp(z - np.where(np.isfinite(m), m, 0.0))
        total = e.sum(-1, keepdims=True)
        return e / np.where(total > 0, total, 1.0), np.where(np.isfinite(m), m, 0.0) + np.log(np.maximum(total, 1e-300))

    tbar, neg_entropy = np.zeros(visible.shape), np.zeros((B, S))
    for q, latent, share in zip(qs, latents, shares):
        logits = sm_scale * np.einsum("bshd,btd->bsht", f64(q), f64(latent))
        t = softmax(np.where(visible[:, :, None], logits, -np.inf))[0].mean(axis=2)
        tbar += share * t
        neg_entropy += share * np.sum(np.where(t > 0, t * np.log(np.where(t > 0, t, 1.0)), 0.0), axis=-1)
    scores = np_scores(idx_q, idx_keys, idx_w, q_pos, kv_len, kv_start)
    p, lse = softmax(scores)
    lse = np.where(visible.any(-1), lse[..., 0], 0.0)
    rows = neg_entropy - np.sum(np.where(visible, tbar * np.where(visible, scores, 0.0), 0.0), -1) + lse
    if g is None:
        return rows
    return (rows,) + np_scores_grads(idx_q, idx_keys, idx_w, q_pos, kv_len, kv_start, f64(g)[..., None] * (p - tbar))


def check_dense_indexer_kl(impl, qs, latents, idx_q, idx_keys, idx_w, *, sm_scale, kv_len, kv_start, shares,
                           config=None, tol=1e-5):
    """dense_indexer_kl: float32 [B, S] equal to the oracle, 0 on rows that see no key; gradients
    into the indexer's queries, keys and weights equal to the oracle's (0 on those rows), none
    into the layers' queries and latent rows. `tol` relative to the largest value."""
    kw = dict(sm_scale=sm_scale, kv_len=kv_len, kv_start=kv_start, shares=shares, config=config)
    rows, pull = jax.vjp(lambda *a: call("dense_indexer_kl", impl, *a, **kw), qs, latents, idx_q, idx_keys, idx_w)
    assert rows.shape == idx_q.shape[:2] and rows.dtype == jnp.float32
    g = jnp.asarray(np.random.default_rng(5).normal(size=rows.shape), jnp.float32)
    want = np_dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale=sm_scale, kv_len=kv_len,
                               kv_start=kv_start, shares=shares, g=g)
    empty = np.asarray(kv_len) == 0
    assert empty.any() and (np.asarray(rows)[empty] == 0).all()
    dqs, dlatents, *grads = pull(g)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves((dqs, dlatents)))
    for got, w in zip([rows] + grads, want):
        np.testing.assert_allclose(f64(got), w, rtol=tol, atol=tol * np.abs(w).max())
    assert not np.asarray(grads[0])[empty].any() and not np.asarray(grads[2])[empty].any()
