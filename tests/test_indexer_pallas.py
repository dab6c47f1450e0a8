"""Pallas lightning-indexer kernels (GPU Triton, TPU Mosaic) and the threshold selection.

The kernels run in interpret mode on the CPU against the reference on integer-valued inputs,
whose float32 scores are exact whatever the summation order, so index outputs must be
identical and ties are plentiful. The threshold selection is checked on its own (plain-jnp
passes) on adversarial rows: heavy ties, monotone rows, -0.0/+0.0 mixes, tiny magnitudes and a
candidate capacity of exactly k. The TPU kernels are compiled ahead of time for v5p and v6e
(needs libtpu) and the GPU kernels lowered to Triton for an H200 (no GPU needed).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from conftest import tpu_compile_mesh
from pallas_kernels.indexer import gpu, reference, threshold, tpu

BACKENDS = {"pallas_gpu": gpu, "pallas_tpu": tpu}


def _select_ref(scores: np.ndarray, topk: int) -> np.ndarray:
    s = jnp.asarray(scores, jnp.float32)
    return np.asarray(reference.topk_from_scores(s, s > -jnp.inf, topk))


def _rows(rng, kind: str, R: int, T: int) -> np.ndarray:
    x = {
        "normal": lambda: rng.normal(size=(R, T)),
        "ties": lambda: rng.integers(0, 4, size=(R, T)).astype(float),
        "monotone": lambda: np.tile(np.arange(T, dtype=float), (R, 1)),
        "tiny": lambda: rng.normal(size=(R, T)) * 1e-38,
        "signed_zeros": lambda: rng.choice([0.0, -0.0, 1.0, -1.0], size=(R, T)),
        "spread": lambda: np.exp(rng.normal(size=(R, T)) * 8.0),
    }[kind]()
    return np.where(rng.random((R, T)) < 0.3, -np.inf, x).astype(np.float32)


@pytest.mark.parametrize("kind", ["normal", "ties", "monotone", "tiny", "signed_zeros", "spread"])
def test_threshold_selection_equals_sort(kind):
    rng = np.random.default_rng(hash(kind) % 2**32)
    count = functools.partial(threshold.count_xla, chunk=16)
    for R, T, k in [(3, 200, 7), (2, 97, 40), (1, 5, 9), (4, 300, 1), (2, 256, 64)]:
        x = _rows(rng, kind, R, T)
        for cap in (None, k):                       # cap = k: ties must resolve in the last pass
            got = threshold.select_topk(jnp.asarray(x), k, count_fn=count,
                                        compact_fn=threshold.compact_xla, cap=cap)
            np.testing.assert_array_equal(np.asarray(got), _select_ref(x, k), err_msg=f"{R, T, k, cap}")


def test_key_map_is_order_preserving():
    x = jnp.asarray([-jnp.inf, -3.0, -1e-38, -0.0, 0.0, 1e-38, 2.0, jnp.inf], jnp.float32)
    keys = np.asarray(threshold.float_to_key(x), np.uint64)
    assert np.all(np.diff(keys) > 0)
    np.testing.assert_array_equal(np.asarray(threshold.key_to_float(threshold.float_to_key(x))), x)


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_pallas_selection_over_given_scores(impl):
    rng = np.random.default_rng(3)
    for kind, (R, T, k) in [("ties", (3, 777, 20)), ("normal", (9, 300, 64)), ("monotone", (2, 130, 200))]:
        x = _rows(rng, kind, R, T)
        got = BACKENDS[impl].select_topk(jnp.asarray(x), k, interpret=True)
        np.testing.assert_array_equal(np.asarray(got)[:, :min(k, T)], _select_ref(x, min(k, T)))


def _int_inputs(rng, B, S, T, H, D, lim=3):
    q = jnp.asarray(rng.integers(-lim, lim + 1, (B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.integers(-lim, lim + 1, (B, T, D)), jnp.float32)
    w = jnp.asarray(rng.integers(-2, 4, (B, S, H)), jnp.float32)
    q_pos = jnp.asarray(rng.integers(-1, T + 2, (B, S)), jnp.int32)
    kv_len = jnp.asarray(rng.integers(0, T + 1, (B,)), jnp.int32)
    return q, k, w, q_pos, kv_len


def _doc_starts(rng, q_pos, T):
    """Packed documents: each query's first valid key, somewhere at or before it."""
    pos = np.asarray(q_pos)
    return jnp.asarray(np.where(rng.random(pos.shape) < 0.3, 0,
                                rng.integers(0, np.maximum(pos, 0) + 1)), jnp.int32)


@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("B,S,T,H,D,topk,lim", [
    (2, 1, 300, 4, 8, 16, 3),      # decode: one query per sequence
    (1, 3, 200, 2, 4, 7, 1),       # few distinct scores: ties everywhere
    (2, 11, 700, 4, 16, 20, 3),    # several query blocks, the last one padded
    (1, 2, 40, 3, 8, 64, 3),       # topk > T: -1 padding
])
def test_pallas_indexer_equals_reference(impl, B, S, T, H, D, topk, lim):
    rng = np.random.default_rng(B * 1000 + S * 10 + T)
    q, k, w, q_pos, kv_len = _int_inputs(rng, B, S, T, H, D, lim)
    args = dict(q_pos=q_pos, kv_len=kv_len, kv_start=_doc_starts(rng, q_pos, T) if S > 1 else None)
    want_scores = reference.indexer_scores(q, k, w, **args)
    got_scores = pk.indexer_scores(q, k, w, impl=impl, interpret=True, **args)
    np.testing.assert_array_equal(np.asarray(got_scores), np.asarray(want_scores))
    want = reference.indexer_topk(q, k, w, topk=topk, **args)
    got = pk.indexer_topk(q, k, w, topk=topk, impl=impl, interpret=True, **args)
    assert got.dtype == jnp.int32 and got.shape == (B, S, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_pallas_indexer_bf16_and_query_chunks(impl):
    rng = np.random.default_rng(7)
    q, k, w, q_pos, kv_len = _int_inputs(rng, 1, 10, 260, 4, 16)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    args = dict(topk=12, q_pos=q_pos, kv_len=kv_len)
    want = reference.indexer_topk(q, k, w, **args)
    got = pk.indexer_topk(q, k, w, impl=impl, interpret=True, q_chunk=4, **args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _abstract_args(B, S, T, sharding=None, H=32, D=128):
    spec = [((B, S, H, D), jnp.bfloat16), ((B, T, D), jnp.bfloat16), ((B, S, H), jnp.float32),
            ((B, S), jnp.int32), ((B,), jnp.int32)]
    return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in spec]


def _topk_fn(module):
    return lambda q, k, w, p, n: module.indexer_topk(q, k, w, topk=2048, q_pos=p, kv_len=n)


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("B,S,T", [(4, 1, 131072), (1, 64, 8192)], ids=["decode", "prefill"])
def test_tpu_indexer_compiles_ahead_of_time(topology, B, S, T):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = tpu_compile_mesh(topology)
    wrapped = jax.shard_map(_topk_fn(tpu), mesh=mesh, in_specs=(P(),) * 5, out_specs=P(),
                            check_vma=False)
    compiled = jax.jit(wrapped).lower(*_abstract_args(B, S, T, NamedSharding(mesh, P()))).compile()
    text = compiled.as_text()
    assert "indexer_scores" in text and "indexer_select_count" in text
    assert compiled.memory_analysis() is not None


def test_gpu_indexer_lowers_to_triton_for_h200():
    from jax._src.mesh import AbstractDevice  # the abstract target device for lowering

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(_topk_fn(gpu)).trace(*_abstract_args(4, 1, 131072)).lower(
            lowering_platforms=("cuda",)).as_text()
    # scores, the first counting pass, the counting pass in the loop, the compaction
    assert text.count("xla.gpu.triton") == 4


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_pallas_scores_gradients_equal_xla(impl):
    rng = np.random.default_rng(11)
    q, k, w, q_pos, kv_len = _int_inputs(rng, 1, 3, 50, 2, 8)
    q, k, w = (x + jnp.asarray(rng.normal(size=x.shape), jnp.float32) * 0.1 for x in (q, k, w))

    def loss(impl, q, k, w):
        s = pk.indexer_scores(q, k, w, q_pos=q_pos, kv_len=kv_len, impl=impl, interpret=True)
        return jnp.sum(jnp.where(jnp.isfinite(s), jnp.sin(s), 0.0))

    want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, w)
    got = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(q, k, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_topk_inside_a_differentiated_function(impl):
    """A loss that selects with the indexer and uses its inputs elsewhere differentiates (the
    indices are constants): same gradients as with the xla top-k."""
    rng = np.random.default_rng(12)
    q, k, w, q_pos, kv_len = _int_inputs(rng, 1, 3, 40, 2, 8)

    def loss(impl, q, k, w):
        idx = pk.indexer_topk(q, k, w, topk=4, q_pos=q_pos, kv_len=kv_len, impl=impl, interpret=True)
        rows = jnp.take_along_axis(k[:, None], jnp.maximum(idx, 0)[..., None], axis=2)   # [B, S, 4, D]
        return jnp.sum(jnp.where(idx[..., None] >= 0, rows, 0.0) * jnp.sum(q, axis=2)[:, :, None]) + jnp.sum(w)

    want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, w)
    got = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(q, k, w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kv_start_in_every_impl():
    """kv_start (packed documents) bounds the keys from below: reference against a direct
    brute force, and xla against the reference; a wrong shape is refused."""
    rng = np.random.default_rng(5)
    q, k, w, q_pos, kv_len = _int_inputs(rng, 2, 6, 40, 2, 8)
    start = _doc_starts(rng, q_pos, 40)
    scores = np.asarray(reference.indexer_scores(q, k, w, q_pos=q_pos, kv_len=kv_len, kv_start=start))
    t = np.arange(40)
    below = t[None, None, :] < np.asarray(start)[..., None]
    assert np.all(np.isneginf(scores[below]))
    free = np.asarray(reference.indexer_scores(q, k, w, q_pos=q_pos, kv_len=kv_len))
    np.testing.assert_array_equal(scores[~below], free[~below])
    args = dict(topk=9, q_pos=q_pos, kv_len=kv_len, kv_start=start)
    np.testing.assert_array_equal(np.asarray(pk.indexer_topk(q, k, w, impl="xla", q_chunk=4, **args)),
                                  np.asarray(pk.indexer_topk(q, k, w, impl="reference", **args)))
    with pytest.raises(ValueError, match="kv_start must have the shape of q_pos"):
        pk.indexer_topk(q, k, w, topk=3, q_pos=q_pos, kv_len=kv_len, kv_start=start[:, :2])
