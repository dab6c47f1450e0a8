"""Bad arguments to the public ops (`pallas_kernels`, `glm_jax.ops`) get one clear error, raised by
`pallas_kernels.checks` before a kernel is traced: the op, the argument, its shape or dtype and
what was expected. Good arguments are the contract tests' (tests/test_kernel_contract.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from glm_jax import ops

B, S, H, D, T, K = 2, 3, 2, 8, 5, 4
ON_CPU = jax.default_backend() == "cpu"


def _indexer():
    """Valid (q, k, weights) and keyword arguments of indexer_topk."""
    q, k, w = jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.ones((B, S, H))
    return (q, k, w), dict(topk=2, q_pos=jnp.zeros((B, S), jnp.int32), kv_len=jnp.full((B,), T, jnp.int32))


def _sparse():
    """Valid (q, kv, indices) and keyword arguments of sparse_mla."""
    return (jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.zeros((B, S, K), jnp.int32)), dict(sm_scale=0.5, v_dim=4)


def _replace(args, kwargs, **changes):
    """(args, kwargs) with the named arguments (q, k, weights / q, kv, indices, or a keyword) changed."""
    names = ("q", "k", "weights") if "topk" in kwargs else ("q", "kv", "indices")
    args = tuple(changes.pop(n, a) for n, a in zip(names, args))
    return args, {**kwargs, **changes}


INDEXER_CASES = {
    "q of rank 3": (dict(q=jnp.ones((B, S, D))), ValueError, r"q must be \[B, S, H, D\] \(rank 4\), got shape \(2, 3, 8\)"),
    "key width": (dict(k=jnp.ones((B, T, D + 1))), ValueError,
                  r"k has shape \(2, 5, 9\) for \[B, T, D\], so D=9, but q has D=8"),
    "weights [B, S]": (dict(weights=jnp.ones((B, S))), ValueError, r"weights must be \[B, S, H\] \(rank 3\)"),
    "scalar kv_len": (dict(kv_len=jnp.int32(T)), ValueError, r"kv_len must be \[B\] \(rank 1\), got shape \(\)"),
    "float q_pos": (dict(q_pos=jnp.zeros((B, S))), TypeError, r"q_pos must have an integer dtype.*got float32"),
    "bf16 weights": (dict(weights=jnp.ones((B, S, H), jnp.bfloat16)), TypeError,
                     r"weights must have float32, got bfloat16"),
    "kv_start shape": (dict(kv_start=jnp.zeros((B, 1), jnp.int32)), ValueError,
                       r"kv_start has shape \(2, 1\) for \[B, S\], so S=1, but q has S=3"),
    "int q": (dict(q=jnp.ones((B, S, H, D), jnp.int32)), TypeError, r"q must have float32 or bfloat16, got int32"),
    "topk 0": (dict(topk=0), ValueError, r"topk=0 must be >= 1"),
    "float topk": (dict(topk=2.0), TypeError, r"topk must be a Python int, got 2.0"),
}

SPARSE_CASES = {
    "4-D kv": (dict(kv=jnp.ones((B, T, 1, D))), ValueError, r"kv must be \[B, T, Dk\] \(rank 3\), got shape \(2, 5, 1, 8\)"),
    "kv batch 1": (dict(kv=jnp.ones((1, T, D))), ValueError, r"kv has shape \(1, 5, 8\).*B=1, but q has B=2"),
    "float indices": (dict(indices=jnp.zeros((B, S, K)) + 0.7), TypeError,
                      r"indices must have an integer dtype.*got float32"),
    "indices of other queries": (dict(indices=jnp.zeros((B, S + 1, K), jnp.int32)), ValueError,
                                 r"indices has shape \(2, 4, 4\).*S=4, but q has S=3"),
    "v_dim": (dict(v_dim=9), ValueError, r"v_dim=9 must be in \[1, 8\]"),
    "sm_scale": (dict(sm_scale="0.5"), TypeError, r"sm_scale must be a Python float"),
    "return_target": (dict(return_target=None), TypeError, r"return_target must be True or False"),
}


@pytest.mark.parametrize("case", list(INDEXER_CASES))
@pytest.mark.parametrize("op", ["indexer_topk", "indexer_scores"])
def test_indexer_arguments(op, case):
    changes, error, message = INDEXER_CASES[case]
    args, kwargs = _replace(*_indexer(), **changes)
    if op == "indexer_scores":
        if "topk" in changes:
            pytest.skip("indexer_scores takes no topk")
        kwargs.pop("topk")
    with pytest.raises(error, match=rf"^pallas_kernels\.{op}: {message}"):
        getattr(pk, op)(*args, **kwargs)


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_mla_arguments(case):
    changes, error, message = SPARSE_CASES[case]
    args, kwargs = _replace(*_sparse(), **changes)
    with pytest.raises(error, match=rf"^pallas_kernels\.sparse_mla: {message}"):
        pk.sparse_mla(*args, **kwargs)


def test_the_model_ops_check_the_same_way():
    """`glm_jax.ops` wraps the same ops: the same errors, also before any query split."""
    args, kwargs = _replace(*_indexer(), q=jnp.ones((B, S, D)))
    with pytest.raises(ValueError, match=r"pallas_kernels\.indexer_topk: q must be \[B, S, H, D\]"):
        ops.indexer_topk(*args, **kwargs)
    args, kwargs = _replace(*_sparse(), indices=jnp.zeros((B, S, K)))
    with pytest.raises(TypeError, match=r"pallas_kernels\.sparse_mla: indices must have an integer dtype"):
        ops.sparse_mla(*args, **kwargs)


def test_a_traced_topk_must_be_static():
    args, kwargs = _indexer()
    kwargs.pop("topk")
    with pytest.raises(TypeError, match=r"topk must be static .*static_argnames=\('topk',\)"):
        jax.jit(lambda topk: pk.indexer_topk(*args, topk=topk, **kwargs))(2)
    # the fix the message names
    out = jax.jit(lambda topk: pk.indexer_topk(*args, topk=topk, **kwargs), static_argnames="topk")(2)
    assert out.shape == (B, S, 2)


@pytest.mark.skipif(not ON_CPU, reason="the CPU's message")
def test_an_accelerator_impl_on_the_cpu_says_how_to_run():
    args, kwargs = _indexer()
    for impl in ("pallas_gpu", "pallas_tpu"):
        with pytest.raises(ValueError, match=rf"impl='{impl}' compiles for .* pass interpret=True .* impl='xla'"):
            pk.indexer_topk(*args, impl=impl, **kwargs)
    x = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"impl='cudnn' compiles for gpu, but this runs on the CPU .*: pick impl='xla'"):
        jax.jit(lambda x: pk.causal_attention(x, x, x, scale=1.0, impl="cudnn"))(x)


def test_paged_ops_arguments():
    q, w = jnp.ones((B, 1, H, D)), jnp.ones((B, 1, H))
    store, table = jnp.ones((3, 4, D)), jnp.zeros((B, 2), jnp.int32)
    pos, lens = jnp.zeros((B, 1), jnp.int32), jnp.full((B,), 8, jnp.int32)
    with pytest.raises(TypeError, match=r"paged_indexer_topk: page_table must have an integer dtype"):
        pk.paged_indexer_topk(q, store, table.astype(jnp.float32), w, topk=2, q_pos=pos, kv_len=lens)
    with pytest.raises(ValueError, match=r"paged_indexer_topk: k_pages has shape \(3, 4, 9\).*D=9, but q has D=8"):
        pk.paged_indexer_topk(q, jnp.ones((3, 4, D + 1)), table, w, topk=2, q_pos=pos, kv_len=lens)
    with pytest.raises(ValueError, match=r"paged_sparse_mla: slot must be \[\] \(rank 0\), got shape \(2,\)"):
        pk.paged_sparse_mla(q, store, table, jnp.zeros((B, 1, K), jnp.int32), sm_scale=1.0, v_dim=4,
                            slot=jnp.zeros((2,), jnp.int32))


def test_cross_entropy_backward_index_and_causal_attention_arguments():
    q, k, w = jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.ones((B, S, H))
    idx = jnp.zeros((B, S, K), jnp.int32)
    with pytest.raises(TypeError, match=r"indexer_cross_entropy: target must have float32, got bfloat16"):
        pk.indexer_cross_entropy(q, k, w, idx, jnp.ones((B, S, K), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"sparse_mla_backward_index: num_keys=0 must be >= 1"):
        pk.sparse_mla_backward_index(idx, 0, dk=D, dtype=jnp.float32)
    x = jnp.ones((B, S, H, D))
    with pytest.raises(ValueError, match=r"causal_attention: v has shape \(2, 3, 2, 4\).*d=4, but q has d=8"):
        pk.causal_attention(x, x, x[..., :4], scale=1.0)
    with pytest.raises(TypeError, match=r"causal_attention: mask must have bool, got int32"):
        pk.causal_attention(x, x, x, scale=1.0, mask=jnp.ones((B, S, S), jnp.int32))
    with pytest.raises(ValueError, match=r"causal_attention: segments' offsets must be \[B, M \+ 1\]"):
        pk.causal_attention(x, x, x, scale=1.0, segments=(jnp.zeros((B, 2), jnp.int32), jnp.zeros((B, 2), jnp.int32)))
