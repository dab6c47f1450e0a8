"""Every registered kernel implementation (`pallas_kernels.REGISTRY`), with its default config,
against the contracts of the package docstring: float64 numpy oracles for forward values and
gradients, -1 padding, empty rows, out-of-range indices, ragged lengths, packed documents and
top-k beyond the number of keys (helpers in kernel_contract.py). Registering an implementation
adds it here; the kernel files test their configs' knobs with the same checks.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import fp8
from fp8_contract import check_paged_sparse_mla_fp8, check_paged_topk_fp8, fp8_exact_keys, fp8_impl_params
from kernel_contract import (call, float_score_inputs, check_causal_attention, check_dense_indexer_kl,
                             check_indexer_cross_entropy, dense_indexer_kl_inputs,
                             check_paged_sparse_mla, check_paged_topk, check_scores, check_sparse_mla,
                             check_sparse_mla_target, check_topk, cross_entropy_inputs, doc_starts,
                             f64, impl_params, int_inputs, np_scores, np_scores_grads, np_topk, packed_documents,
                             paged_store, positions, sparse_inputs)

OPS = list(pk.REGISTRY)


# ----------------------------------------------------------------------------- registry


def _tiny_args(op):
    """(args, kwargs) of a small valid call of op."""
    q, k, w = jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 3, 4)), jnp.ones((1, 2, 2))
    pos, kv_len = jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 3, jnp.int32)
    x = jnp.zeros((1, 2, 2, 8))
    store, table = jnp.zeros((2, 2, 4)), jnp.zeros((1, 1), jnp.int32)
    return {
        "paged_indexer_topk": ((q, store, table, w), dict(topk=2, q_pos=pos, kv_len=kv_len)),
        "paged_sparse_mla": ((q, store, table, jnp.zeros((1, 2, 2), jnp.int32)), dict(sm_scale=1.0, v_dim=2)),
        "indexer_scores": ((q, k, w), dict(q_pos=pos, kv_len=kv_len)),
        "indexer_topk": ((q, k, w), dict(topk=2, q_pos=pos, kv_len=kv_len)),
        "sparse_mla": ((q, k, jnp.zeros((1, 2, 2), jnp.int32)), dict(sm_scale=1.0, v_dim=2)),
        "causal_attention": ((x, x, x), dict(scale=1.0)),
        "indexer_cross_entropy": ((q, k, w, jnp.zeros((1, 2, 2), jnp.int32), jnp.ones((1, 2, 2))), {}),
        "dense_indexer_kl": (([q], [jnp.zeros((1, 2, 4))], q, jnp.zeros((1, 2, 4)), w),
                             dict(sm_scale=1.0, kv_len=kv_len)),
    }[op]


@pytest.mark.parametrize("op", OPS)
def test_registry_entries(op):
    """Each op is a public function with a reference and an xla entry; impl_choices lists "auto"
    and the entries; every entry takes config and interpret, and its config type is a frozen,
    hashable dataclass constructible from its defaults."""
    entries = pk.REGISTRY[op]
    assert callable(getattr(pk, op)) and {"reference", "xla"} <= set(entries)
    assert pk.impl_choices(op) == ("auto",) + tuple(entries)
    for impl, entry in entries.items():
        assert {"config", "interpret"} <= set(inspect.signature(entry.fn).parameters), impl
        config = entry.config()
        assert dataclasses.is_dataclass(config) and hash(config) == hash(entry.config()), impl
        for field in dataclasses.fields(config):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(config, field.name, getattr(config, field.name))


@pytest.mark.parametrize("op", OPS)
def test_impl_names(op):
    args, kwargs = _tiny_args(op)
    fn = getattr(pk, op)
    with pytest.raises(ValueError, match=r"unknown impl 'triton'.*'reference'.*'xla'"):
        fn(*args, impl="triton", **kwargs)
    if jax.default_backend() == "cpu":
        assert pk.resolve_impl(op, "auto") == "xla"
    fn(*args, impl="auto", **kwargs)


@pytest.mark.parametrize("op", OPS)
def test_config_of_another_impl_is_refused(op):
    """A config whose type is not the named implementation's is a ValueError naming the right
    type; so is interpret=True for an implementation that has no interpret mode."""
    args, kwargs = _tiny_args(op)
    fn = getattr(pk, op)
    types = {entry.config for entries in pk.REGISTRY.values() for entry in entries.values()}
    for impl, entry in pk.REGISTRY[op].items():
        other = next(t for t in types if t is not entry.config)
        with pytest.raises(ValueError, match=rf"impl='{impl}' takes config={entry.config.__name__}"):
            fn(*args, impl=impl, config=other(), **kwargs)
        if not entry.interpretable:
            with pytest.raises(ValueError, match="no interpret mode"):
                fn(*args, impl=impl, interpret=True, **kwargs)


def test_config_fields_are_validated():
    with pytest.raises(ValueError, match="XlaConfig.q_chunk must be a positive int"):
        pk.XlaConfig(q_chunk=0)
    with pytest.raises(ValueError, match="block_k"):
        pk.SparseMLATpuConfig(block_k=-8)
    with pytest.raises(ValueError, match="dkv_mode must be one of"):
        pk.SparseMLAGpuConfig(dkv_mode="sum")
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        pk.IndexerKLGpuConfig(block_k=24)


@pytest.mark.parametrize("op", ["paged_indexer_topk", "paged_sparse_mla"])
def test_paged_store_and_page_table_shapes_are_checked(op):
    (q, store, table, last), kwargs = _tiny_args(op)
    fn = getattr(pk, op)
    with pytest.raises(ValueError, match=r"the paged store \w+ must be \[pages, P, D"):
        fn(q, store[None, None], table, last, **kwargs)
    with pytest.raises(ValueError, match=r"page_table has shape \(2, 1\) for \[B, n\], so B=2, but q has B=1"):
        fn(q, store, jnp.zeros((2, 1), jnp.int32), last, **kwargs)


@pytest.mark.parametrize("op", ["indexer_scores", "indexer_topk"])
def test_kv_start_of_another_shape_is_refused(op):
    args, kwargs = _tiny_args(op)
    for impl in pk.REGISTRY[op]:
        with pytest.raises(ValueError, match=r"kv_start has shape \(1, 1\) for \[B, S\], so S=1, but q has S=2"):
            getattr(pk, op)(*args, impl=impl, kv_start=jnp.zeros((1, 1), jnp.int32), **kwargs)


# ----------------------------------------------------------------------------- indexer top-k


def _ties(rng, S, T, H, D):
    """Three sequences of hand-made ties -> (q, k, w [3, S, ...]): 0, positive queries and keys
    t = 2, 7 tied best, t = 4, 8 tied second; 1, every key the same (every score ties);
    2, negative queries (relu makes every score 0)."""
    q = np.asarray(rng.integers(1, 3, (1, S, H, D)), np.float32)
    base = np.asarray(rng.integers(0, 3, (T, D)), np.float32)
    base[7] = base[2] = 5.0
    base[4] = base[8] = 4.0
    k = np.stack([base, np.ones((T, D), np.float32), base])
    return jnp.asarray(np.concatenate([q, q, -q])), jnp.asarray(k), jnp.ones((3, S, H), jnp.float32)


@pytest.mark.parametrize("impl", impl_params("indexer_topk"))
def test_indexer_topk_brute_force(impl):
    """Prefill (ragged kv_len, one sequence empty or short), queries at an offset into the
    cache, random positions (queries that see nothing) and hand-made ties, for top-k 1, 4 and
    12 > T; on ties the lower t wins."""
    rng = np.random.default_rng(0)
    B, S, T, H, D = 2, 6, 10, 2, 4
    q, k, w = int_inputs(rng, 3 * B, S, T, H, D)
    tq, tk, tw = _ties(rng, S, T, H, D)
    q, k, w = jnp.concatenate([q, tq]), jnp.concatenate([k, tk]), jnp.concatenate([w, tw])
    parts = [positions(rng, B, S, T, mode) for mode in ("prefill", "offset", "random")]
    parts.append((jnp.asarray([[9, 9, 7, 9, 9, 5]] * 3, jnp.int32), jnp.asarray([T, 6, T], jnp.int32)))
    q_pos, kv_len = (jnp.concatenate(x) for x in zip(*parts))
    ties = slice(3 * B, None)
    for topk in (1, 4, 12):
        out = check_topk(impl, q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len)[ties]
        if topk == 1:
            np.testing.assert_array_equal(out[0, :, 0], [2, 2, 2, 2, 2, 2])
        if topk == 4:
            np.testing.assert_array_equal(out[0, 0], [2, 7, 4, 8])
            np.testing.assert_array_equal(out[0, 2, :3], [2, 7, 4])
            np.testing.assert_array_equal(out[1, :5], [[0, 1, 2, 3]] * 5)      # the lowest t's, ascending
        if topk == 12:                      # all scores 0: still the lowest valid t's, then -1
            np.testing.assert_array_equal(out[2, 2], list(range(8)) + [-1] * 4)
            np.testing.assert_array_equal(out[1, 0], list(range(6)) + [-1] * 6)


KERNEL_CASES = {  # B, S, T, H, D, topk, lim (integers in [-lim, lim]), dtype
    "decode": (2, 1, 300, 4, 8, 16, 3, jnp.float32),        # one query per sequence
    "ties": (1, 3, 200, 2, 4, 7, 1, jnp.float32),           # few distinct scores: ties everywhere
    "blocks": (2, 11, 700, 4, 16, 20, 3, jnp.float32),      # several query blocks, the last padded
}


def kernel_case(name):
    """Integer inputs of a KERNEL_CASES entry: random q_pos (some -1), ragged kv_len and, for more
    than one query per sequence, packed documents (kv_start) -> (q, k, w, args, topk)."""
    B, S, T, H, D, topk, lim, dtype = KERNEL_CASES[name]
    rng = np.random.default_rng(B * 1000 + S * 10 + T)
    q, k, w = int_inputs(rng, B, S, T, H, D, lim=lim, dtype=dtype)
    q_pos = jnp.asarray(rng.integers(-1, T + 2, (B, S)), jnp.int32)
    kv_len = jnp.asarray(rng.integers(0, T + 1, (B,)), jnp.int32)
    kv_start = doc_starts(rng, q_pos) if S > 1 else None
    return q, k, w, dict(q_pos=q_pos, kv_len=kv_len, kv_start=kv_start), topk


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("impl", impl_params("indexer_topk"))
def test_indexer_topk_kernel_cases(impl, case):
    q, k, w, args, topk = kernel_case(case)
    check_topk(impl, q, k, w, topk=topk, **args)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("impl", impl_params("indexer_scores"))
def test_indexer_scores_kernel_cases(impl, case):
    q, k, w, args, _ = kernel_case(case)
    check_scores(impl, q, k, w, **args)


@pytest.mark.parametrize("impl", impl_params("indexer_topk"))
def test_indexer_topk_float_inputs_in_a_differentiated_function(impl):
    """Random bf16 inputs: the selected keys' scores are the largest ones, in order. A loss that
    selects with the indexer and uses its inputs elsewhere differentiates, the indices counting
    as constants."""
    rng = np.random.default_rng(3)
    B, S, T, H, D, topk = 2, 12, 30, 4, 16, 6
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (B, S, H)), jnp.float32)
    q_pos, kv_len = positions(rng, B, S, T, "random")
    select = lambda q, k, w: call("indexer_topk", impl, q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len)
    got = np.asarray(select(q, k, w))
    scores = np_scores(q, k, w, q_pos, kv_len)
    want = np_topk(scores, topk)
    np.testing.assert_array_equal(got < 0, want < 0)
    sel = lambda idx: np.where(idx >= 0, np.take_along_axis(scores, np.maximum(idx, 0), -1), 0.0)
    np.testing.assert_allclose(sel(got), sel(want), rtol=1e-5, atol=1e-5)

    def loss(select, q, k, w):
        idx = select(q, k, w)
        rows = jnp.take_along_axis(k[:, None], jnp.maximum(idx, 0)[..., None], axis=2)   # [B, S, topk, D]
        picked = jnp.where(idx[..., None] >= 0, rows, 0).astype(jnp.float32)
        return jnp.sum(picked * jnp.sum(q, axis=2, dtype=jnp.float32)[:, :, None]) + jnp.sum(w)

    grads = jax.grad(lambda *a: loss(select, *a), argnums=(0, 1, 2))(q, k, w)
    fixed = jax.grad(lambda *a: loss(lambda *_: jnp.asarray(got), *a), argnums=(0, 1, 2))(q, k, w)
    for a, b in zip(grads, fixed):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- indexer scores


@pytest.mark.parametrize("impl", impl_params("indexer_scores"))
def test_indexer_scores_float_inputs(impl):
    """Normal float32 inputs, queries at an offset and at random positions, packed documents."""
    rng = np.random.default_rng(7)
    q, k, w, q_pos, kv_len = float_score_inputs(rng)
    check_scores(impl, q, k, w, q_pos=q_pos, kv_len=kv_len, kv_start=doc_starts(rng, q_pos), exact=False)


@pytest.mark.parametrize("impl", impl_params("indexer_scores"))
def test_indexer_scores_gradients(impl):
    rng = np.random.default_rng(11)
    q, k, w = (x + jnp.asarray(rng.normal(size=x.shape), jnp.float32) * 0.1
               for x in int_inputs(rng, 1, 3, 50, 2, 8))
    q_pos, kv_len = jnp.asarray([[49, 30, -1]], jnp.int32), jnp.asarray([45], jnp.int32)
    kv_start = jnp.asarray([[3, 0, 0]], jnp.int32)
    args = dict(q_pos=q_pos, kv_len=kv_len, kv_start=kv_start)

    def loss(q, k, w):
        s = call("indexer_scores", impl, q, k, w, **args)
        return jnp.sum(jnp.where(jnp.isfinite(s), jnp.sin(s), 0.0))

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, w)
    g = np.cos(np.where(np.isfinite(s := np_scores(q, k, w, **args)), s, 0.0))
    for a, b in zip(got, np_scores_grads(q, k, w, q_pos, kv_len, kv_start, g)):
        np.testing.assert_allclose(f64(a), b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- sparse MLA


@pytest.mark.parametrize("impl", impl_params("sparse_mla"))
def test_sparse_mla_forward_and_gradients(impl):
    """-1 holes, an empty row, trailing -1, out-of-range and duplicated indices, K not a multiple
    of a block."""
    q, kv, idx = sparse_inputs(240, B=2, S=2, T=50, K=40, H=4, Dk=80)
    check_sparse_mla(impl, q, kv, idx, sm_scale=0.125, v_dim=64)


@pytest.mark.parametrize("impl", impl_params("sparse_mla", exclude=("pallas_tpu",)))
def test_sparse_mla_target(impl):
    """return_target: the head-mean probabilities at each slot, beside unchanged out and lse;
    -1 holes, an empty row, out-of-range and duplicated indices. (The TPU kernel, slow to
    interpret with its default 128-slot blocks, is checked with 16-slot blocks in
    test_indexer_kl.py.)"""
    q, kv, idx = sparse_inputs(31, B=2, S=2, T=40, K=20, H=3, Dk=48)
    check_sparse_mla_target(impl, q, kv, idx, sm_scale=0.2, v_dim=32)


@pytest.mark.parametrize("impl", impl_params("sparse_mla"))
def test_sparse_mla_bf16(impl):
    q, kv, idx = sparse_inputs(7, B=2, S=2, T=50, K=24, H=4, Dk=80, dtype=jnp.bfloat16)
    check_sparse_mla(impl, q, kv, idx, sm_scale=0.125, v_dim=64, gradients=False, tol=2e-2)


def _np_dense_causal(q, kv, sm_scale, v_dim, q_pos):
    q, kv = f64(q), f64(kv)
    B, S, H, _ = q.shape
    out, lse = np.zeros((B, S, H, v_dim)), np.full((B, S, H), -np.inf)
    for b in range(B):
        for s in range(S):
            n = q_pos[b, s] + 1
            if n <= 0:
                continue
            logits = sm_scale * q[b, s] @ kv[b, :n].T                          # [H, n]
            m = logits.max(-1, keepdims=True)
            p = np.exp(logits - m)
            out[b, s] = (p @ kv[b, :n, :v_dim]) / p.sum(-1, keepdims=True)
            lse[b, s] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
    return out, lse


@pytest.mark.parametrize("impl", impl_params("sparse_mla"))
def test_sparse_mla_equals_dense_causal(impl):
    """Selecting every causal position (K = T, in random order, -1 and out-of-range entries
    after them) is dense causal attention; sequence 1's first queries see nothing."""
    rng = np.random.default_rng(11)
    B, S, T, H, Dk, v_dim, sm_scale = 2, 4, 7, 3, 32, 16, 0.4
    q = jnp.asarray(rng.normal(size=(B, S, H, Dk)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, Dk)), jnp.float32)
    q_pos = np.array([np.arange(S) + 3, np.arange(S) - 2])
    idx = rng.choice([-1, T, T + 5], size=(B, S, T))
    for b in range(B):
        for s in range(S):
            n = max(q_pos[b, s] + 1, 0)
            idx[b, s, :n] = rng.permutation(n)
            idx[b, s] = rng.permutation(idx[b, s])
    want_out, want_lse = _np_dense_causal(q, kv, sm_scale, v_dim, q_pos)
    out, lse = call("sparse_mla", impl, q, kv, jnp.asarray(idx, jnp.int32), sm_scale=sm_scale, v_dim=v_dim)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


def test_sparse_mla_v_dim_is_checked():
    q, kv, idx = sparse_inputs(1, B=1, S=1, T=4, K=2, H=2, Dk=8)
    with pytest.raises(ValueError, match=r"v_dim=9 must be in \[1, 8\]"):
        pk.sparse_mla(q, kv, idx, sm_scale=1.0, v_dim=9)


# ----------------------------------------------------------------------------- indexer cross-entropy


@pytest.mark.parametrize("impl", impl_params("indexer_cross_entropy"))
def test_indexer_cross_entropy(impl):
    """-1 holes, an empty row, trailing -1, out-of-range and duplicated indices, target mass at
    invalid slots (ignored), K not a multiple of a block; value and gradients."""
    check_indexer_cross_entropy(impl, *cross_entropy_inputs(17, B=2, S=3, T=40, K=20, H=3, D=12))


def test_indexer_cross_entropy_shapes_are_checked():
    q, k, w, idx, target = cross_entropy_inputs(1, B=1, S=2, T=8, K=4, H=2, D=4)
    with pytest.raises(ValueError, match=r"target has shape \(1, 2, 3\) for \[B, S, K\], so K=3, but indices has K=4"):
        pk.indexer_cross_entropy(q, k, w, idx, target[..., :3])


# ----------------------------------------------------------------------------- paged decode forms


@pytest.mark.parametrize("impl", impl_params("paged_sparse_mla"))
def test_paged_sparse_mla(impl):
    """Rows in shuffled pages of 16 rows in slot 1 of a 3-slot store, the last page partly
    filled; -1 holes, an empty row, out-of-range and duplicated indices."""
    q, kv, idx = sparse_inputs(240, B=2, S=2, T=50, K=24, H=4, Dk=80)
    check_paged_sparse_mla(impl, q, kv, idx, page_size=16, sm_scale=0.125, v_dim=64)


@pytest.mark.parametrize("impl", impl_params("paged_indexer_topk"))
def test_paged_indexer_topk(impl):
    """Decode (one query per sequence at the end of its ragged length) and a chunk of three
    queries at random positions (some see nothing), keys in shuffled pages of 64 rows (tiles
    gathered row by row on a GPU) and of 256 (tiles inside one page); the last page partly
    filled; ties everywhere (integer inputs)."""
    rng = np.random.default_rng(4)
    B, T, H, D, topk = 3, 200, 4, 16, 16
    for S, mode, page_size in ((1, "offset", 64), (3, "random", 256)):
        q, k, w = int_inputs(rng, B, S, T, H, D)
        q_pos, kv_len = positions(rng, B, S, T, mode)
        check_paged_topk(impl, q, k, w, page_size=page_size, topk=topk, q_pos=q_pos, kv_len=kv_len)


@pytest.mark.parametrize("impl", fp8_impl_params("paged_sparse_mla"))
def test_paged_sparse_mla_fp8(impl):
    """The FP8 layout (`pallas_kernels.fp8`): 2 scale groups of 128 values + 16 bf16 rope
    columns, in the shuffled pages of `test_paged_sparse_mla`: the op over the dequantized rows
    (float32 queries: no further rounding), and within the quantization error of the op over
    the unquantized rows."""
    q, kv, idx = sparse_inputs(241, B=2, S=2, T=50, K=24, H=4, Dk=272)
    out, lse = check_paged_sparse_mla_fp8(impl, q, kv, idx, page_size=16, sm_scale=0.0625, v_dim=256)
    exact, exact_lse = call("paged_sparse_mla", impl, q, *paged_store_of(kv, idx, 16), idx, slot=jnp.int32(1),
                            sm_scale=0.0625, v_dim=256)
    fin = np.isfinite(np.asarray(exact_lse))
    assert np.max(np.abs(f64(out) - f64(exact))) < 0.25 * np.max(np.abs(f64(kv)))   # values err <= 2^-4 max
    assert np.max(np.abs(np.asarray(lse)[fin] - np.asarray(exact_lse)[fin])) < 0.25


def paged_store_of(rows, idx, page_size):
    """(store, page table) of `paged_store` with the seed the FP8 checks use for these indices."""
    store, table, _ = paged_store(idx.shape[-1] + page_size, rows, page_size)
    return store, table


@pytest.mark.parametrize("impl", fp8_impl_params("paged_indexer_topk"))
def test_paged_indexer_topk_fp8(impl):
    """FP8 keys (one scale per key) that quantize exactly (`fp8_exact_keys`): the top-k equals
    the exact one of the unquantized keys, ties everywhere; pages of 64 rows, decode and a
    chunk of 3."""
    rng = np.random.default_rng(41)
    B, T, H, D, topk = 3, 200, 4, 16, 16
    for S, mode, page_size in ((1, "offset", 64), (3, "random", 256)):
        q, _, w = int_inputs(rng, B, S, T, H, D)
        k = fp8_exact_keys(rng, B, T, D)
        np.testing.assert_array_equal(np.asarray(fp8.dequantize(fp8.quantize_keys(k))), np.asarray(k))
        q_pos, kv_len = positions(rng, B, S, T, mode)
        got = check_paged_topk_fp8(impl, q, k, w, page_size=page_size, topk=topk, q_pos=q_pos, kv_len=kv_len)
        np.testing.assert_array_equal(np.asarray(got), np_topk(np_scores(q, k, w, q_pos, kv_len), topk))


@pytest.mark.parametrize("impl", fp8_impl_params("paged_indexer_topk"))
def test_paged_indexer_topk_fp8_well_separated(impl):
    """Normal keys whose top 16 scores stand well apart from the rest (a margin far above the
    quantization error of e4m3 with one scale per key): FP8 keys select the same set as bf16."""
    rng = np.random.default_rng(42)
    B, T, H, D, topk = 2, 300, 4, 32, 16
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    level = np.where(rng.permutation(T)[None, :] < topk, rng.uniform(4, 6, (B, T)), rng.uniform(0, 1.5, (B, T)))
    k = level[..., None] * u + 0.05 * rng.normal(size=(B, T, D))
    q = jnp.asarray(np.broadcast_to(u, (B, 1, H, D)) * (1 + 0.1 * rng.random((B, 1, H, 1))), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (B, 1, H)), jnp.float32)
    q_pos, kv_len = jnp.full((B, 1), T - 1, jnp.int32), jnp.full((B,), T, jnp.int32)
    k = jnp.asarray(k, jnp.float32)
    got = check_paged_topk_fp8(impl, q, k, w, page_size=64, topk=topk, q_pos=q_pos, kv_len=kv_len)
    store, table = paged_store_of(k.astype(jnp.bfloat16), jnp.zeros((1, 1, topk)), 64)
    bf16 = call("paged_indexer_topk", impl, q, store, table, w, slot=jnp.int32(1), topk=topk, q_pos=q_pos,
                kv_len=kv_len)
    assert (np.sort(np.asarray(got), -1) == np.sort(np.asarray(bf16), -1)).all()
    for b in range(B):
        assert set(np.asarray(got)[b, 0].tolist()) == set(np.flatnonzero(level[b] > 2).tolist())


# ----------------------------------------------------------------------------- causal attention


@pytest.mark.parametrize("layout", ["ragged", "mask", "segments"])
@pytest.mark.parametrize("impl", impl_params("causal_attention"))
def test_causal_attention(impl, layout):
    """Causal attention over whole rows of ragged kv_len (one row complete); packed documents
    given as a mask or as segments (the packed layout); output and gradients."""
    rng = np.random.default_rng(5)
    B, S, N, d = 2, 12, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, N, d)), jnp.bfloat16) for _ in range(3))
    mask, segments = packed_documents(rng, B, S)
    kv_len = jnp.asarray([S, 7], jnp.int32)
    check_causal_attention(impl, q, k, v, scale=d ** -0.5, kv_len=kv_len, mask=mask if layout == "mask" else None,
                           segments=segments if layout == "segments" else None,
                           documents=None if layout == "ragged" else mask)


# ----------------------------------------------------------------------------- dense indexer KL


@pytest.mark.parametrize("impl", impl_params("dense_indexer_kl"))
def test_dense_indexer_kl(impl):
    """Two layers of unequal shares, packed documents, a ragged row and a row that sees no key
    (kv_len 0); S = 40, not a multiple of the Pallas tile; value and gradients."""
    *arrays, kv_len, kv_start = dense_indexer_kl_inputs(9)
    check_dense_indexer_kl(impl, *arrays, sm_scale=0.2, kv_len=kv_len, kv_start=kv_start, shares=(0.25, 0.75))


def test_dense_indexer_kl_shapes_are_checked():
    qs, latents, idx_q, idx_keys, idx_w, kv_len, _ = dense_indexer_kl_inputs(1, B=2, S=4, H=2, Dk=8, Hi=2, Di=4)
    with pytest.raises(ValueError, match="one latent array per layer"):
        pk.dense_indexer_kl(qs, latents[:1], idx_q, idx_keys, idx_w, sm_scale=1.0, kv_len=kv_len)
    with pytest.raises(ValueError, match="indexer keys must be"):
        pk.dense_indexer_kl(qs, latents, idx_q, idx_keys[:, :3], idx_w, sm_scale=1.0, kv_len=kv_len)
    with pytest.raises(ValueError, match="3 shares for 2 layers"):
        pk.dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale=1.0, kv_len=kv_len, shares=(1, 1, 1))
