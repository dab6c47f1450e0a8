"""Pallas lightning-indexer kernels (GPU Triton, TPU Mosaic): the threshold selection, their
configs' knobs, and compilation for real chips. Their contract (interpret mode on the CPU,
with the default configs) is tested with every implementation's in test_kernel_contract.py.

The threshold selection is checked on its own (plain-jnp passes) on adversarial rows: heavy
ties, monotone rows, -0.0/+0.0 mixes, tiny magnitudes and a candidate capacity of exactly k;
then through each backend's kernels on given scores. The TPU kernels are compiled ahead of
time for v5p and v6e (needs libtpu) and the GPU kernels lowered to Triton for an H200 (no GPU
needed).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from conftest import tpu_compile_mesh
from kernel_contract import check_topk, int_inputs
from pallas_kernels.indexer_topk import gpu, gpu_config, gpu_fused, gpu_scores, reference, threshold, tpu

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


#: The plain-jnp threshold selection, jitted once per shape, k and cap (shared by every kind).
_select_xla = jax.jit(functools.partial(threshold.select_topk, compact_fn=threshold.compact_xla,
                                        count_fn=functools.partial(threshold.count_xla, chunk=16)),
                      static_argnames=("topk", "cap"))


@pytest.mark.parametrize("kind", ["normal", "ties", "monotone", "tiny", "signed_zeros", "spread"])
def test_threshold_selection_equals_sort(kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    for R, T, k in [(3, 200, 7), (2, 97, 40), (1, 5, 9), (4, 300, 1), (2, 256, 64)]:
        x = _rows(rng, kind, R, T)
        for cap in (None, k):                       # cap = k: ties must resolve in the last pass
            got = _select_xla(jnp.asarray(x), topk=k, cap=cap)
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


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_pallas_indexer_bf16_and_query_chunks(impl):
    """A prefill cut into chunks of 4 queries (`q_chunk`) selects what the brute force does."""
    rng = np.random.default_rng(7)
    q, k, w = int_inputs(rng, 1, 10, 260, 4, 16, dtype=jnp.bfloat16)
    q_pos = jnp.asarray(rng.integers(-1, 262, (1, 10)), jnp.int32)
    config = pk.REGISTRY["indexer_topk"][impl].config(q_chunk=4)
    check_topk(impl, q, k, w, topk=12, q_pos=q_pos, kv_len=jnp.asarray([200], jnp.int32), config=config)


def test_gpu_config_sets_the_score_tiling():
    """Fields left None take `score_tiling`'s choice for the shapes; set ones win."""
    assert pk.IndexerGpuConfig().tiling(1, 32) == gpu_config.score_tiling(1, 32)
    assert pk.IndexerGpuConfig().tiling(512, 32) == gpu_config.score_tiling(512, 32)
    tiling = pk.IndexerGpuConfig(block_t=32, keys_major=False).tiling(512, 32)
    assert tiling == gpu_config.ScoreTiling(gpu_config.score_tiling(512, 32).block_q, 32, 8, False)


def _abstract_args(B, S, T, sharding=None, H=32, D=128):
    spec = [((B, S, H, D), jnp.bfloat16), ((B, T, D), jnp.bfloat16), ((B, S, H), jnp.float32),
            ((B, S), jnp.int32), ((B,), jnp.int32)]
    return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in spec]


def _topk_fn(module):
    return lambda q, k, w, p, n: module.indexer_topk(q, k, w, topk=2048, q_pos=p, kv_len=n)


@pytest.mark.parametrize("topology,B,S,T", [("v5p:2x2x1", 4, 1, 131072), ("v6e:2x2", 1, 64, 8192)],
                         ids=["decode-v5p", "prefill-v6e"])
def test_tpu_indexer_compiles_ahead_of_time(topology, B, S, T):
    """The TPU kernels compile ahead of time for a TPU slice: the decode shape on v5p, the
    prefill shape on v6e (each TPU generation and each shape once: the Mosaic compile of one
    pair takes seconds)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = tpu_compile_mesh(topology)
    wrapped = jax.shard_map(_topk_fn(tpu), mesh=mesh, in_specs=(P(),) * 5, out_specs=P(),
                            check_vma=False)
    compiled = jax.jit(wrapped).lower(*_abstract_args(B, S, T, NamedSharding(mesh, P()))).compile()
    text = compiled.as_text()
    assert "indexer_scores" in text and "indexer_select_count" in text
    assert compiled.memory_analysis() is not None


def test_gpu_indexer_lowers_to_triton_for_h200():
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(_topk_fn(gpu)).trace(*_abstract_args(4, 1, 131072)).lower(
            lowering_platforms=("cuda",)).as_text()
    # scores, the first counting pass, the counting pass in the loop, the compaction
    assert text.count("xla.gpu.triton") == 4


@pytest.mark.parametrize("mode", ["prefill", "offset", "random"])
def test_gpu_fused_topk_without_a_scores_array(mode):
    """The prefill top-k with `IndexerGpuConfig(fused=True)` (count and compaction kernels that
    compute their own scores) equals the brute force on integer inputs (many exact ties, decided
    by position), for causal, offset and random query positions, packed segments (kv_start), a
    top-k above the visible keys and query chunks."""
    from kernel_contract import positions

    rng = np.random.default_rng(zlib.crc32(mode.encode()))
    B, S, T, H, D = 2, 24, 200, 4, 16
    q, k, w = int_inputs(rng, B, S, T, H, D, dtype=jnp.bfloat16)
    q_pos, kv_len = positions(rng, B, S, T, mode)
    starts = jnp.asarray(np.where(rng.random((B, S)) < 0.5, 0, rng.integers(0, 40, (B, S))), jnp.int32)
    for topk, config in [(12, pk.IndexerGpuConfig(fused=True)),
                         (300, pk.IndexerGpuConfig(fused=True, q_chunk=8, tiles_per_program=2))]:
        check_topk("pallas_gpu", q, k, w, topk=topk, q_pos=q_pos, kv_len=kv_len, kv_start=starts, config=config)


def test_fused_rows_passes_equal_the_scores_arrays():
    """Each pass of `gpu_fused.FusedRows` equals the same pass over the scores kernel's array."""
    rng = np.random.default_rng(11)
    q, k, w = int_inputs(rng, 1, 16, 150, 4, 16, dtype=jnp.bfloat16)
    q_pos = jnp.asarray(np.arange(16)[None] * 9, jnp.int32)
    kv_len = jnp.asarray([140], jnp.int32)
    config = gpu._whole_tiling(pk.IndexerGpuConfig(tiles_per_program=1), q.shape)
    src = gpu_fused.FusedRows.of(q, k, w, q_pos=q_pos, kv_len=kv_len, kv_start=None, config=config, interpret=True)
    scores = gpu_scores.scores(q, k, w, q_pos=q_pos, kv_len=kv_len, config=config, interpret=True).reshape(16, 150)
    plain = threshold.ScoreRows(scores, functools.partial(threshold.count_xla, chunk=config.block_t),
                                threshold.compact_xla)
    assert src.rows == 16 and src.num_keys == 150
    np.testing.assert_array_equal(np.asarray(src.sample(32, 2)), np.asarray(plain.sample(32, 2)))
    edges = jnp.asarray(np.sort(rng.integers(-5, 60, (16, 8)), axis=1), jnp.float32)
    counts = src.count(edges, jnp.ones((16,), bool))
    np.testing.assert_array_equal(np.asarray(counts)[:, :3], np.asarray(plain.count(edges, jnp.ones((16,), bool))))
    lo, hi = edges[:, 2], edges[:, 5]
    per_chunk = lambda e: np.asarray(src.count(e[:, None], jnp.ones((16,), bool)))[..., 0]  # noqa: E731
    n_hi, n_lo = per_chunk(hi), per_chunk(lo)
    above = np.cumsum(n_hi, axis=1) - n_hi
    between = n_hi.sum(1, keepdims=True) + np.cumsum(n_lo - n_hi, axis=1) - (n_lo - n_hi)
    got = src.compact(lo, hi, jnp.asarray(above), jnp.asarray(between), 40)
    want = plain.compact(lo, hi, jnp.asarray(above), jnp.asarray(between), 40)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    filled = np.asarray(got[0]) >= 0
    np.testing.assert_array_equal(np.asarray(got[1])[filled], np.asarray(want[1])[filled])


def test_gpu_fused_topk_lowers_to_triton_for_h200():
    """The fused prefill top-k's kernels lower to Triton for an H200 (no GPU needed): the first
    counting pass, the counting pass in the refinement loop and the compaction, and no scores
    kernel."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    fn = lambda q, k, w, p, n: gpu.indexer_topk(q, k, w, topk=2048, q_pos=p, kv_len=n,  # noqa: E731
                                                config=pk.IndexerGpuConfig(fused=True))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*_abstract_args(1, 1024, 8192)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
    assert "indexer_fused_count" in text and "indexer_fused_compact" in text and "indexer_scores" not in text
