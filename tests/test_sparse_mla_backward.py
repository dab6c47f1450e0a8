"""The deterministic GPU sparse MLA backwards (`sparse_mla.gpu_backward`: "sorted" and "by_key",
`sparse_mla.transpose`) against the reference, in Pallas interpret mode on the CPU, plus their
Triton lowering for an H200. They run through `sparse_mla.gpu.sparse_mla`, tuned by the `bwd_`
fields of `SparseMLAGpuConfig`.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernel_contract import backward_inputs, check_bf16_grads_repeatable, vjp_grads
import pallas_kernels as pk
from pallas_kernels.sparse_mla import gpu as pallas_gpu
from pallas_kernels.sparse_mla import gpu_backward as gb
from pallas_kernels.sparse_mla import reference
from pallas_kernels.sparse_mla import transpose as tr

H, DK, DV, T = 4, 80, 64, 50
SCALE = 0.125


def _inputs(seed, B, S, K, dtype=jnp.float32):
    q, kv, idx, dout = backward_inputs(seed, B, S, T, K, H, DK, DV, dtype)
    return q, kv, idx, dout.astype(jnp.float32)


_vjp = vjp_grads


def _jitted_pair(fn, idx, dout):
    """One compiled program (q [B, S, H, DK], kv [B, T, DK]) -> (fn's gradients (dq, dkv), the
    reference's), called once per layer of one shape; eagerly, the interpreted kernels would
    dispatch op by op on each call."""
    return jax.jit(lambda q, kv: (_vjp(fn, q, kv, idx, dout), _vjp(_ref, q, kv, idx, dout)))


def _ref(q, kv, idx):
    return reference.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV)


def _gpu_op(mode, fwd_block_k, **knobs):
    """`gpu.sparse_mla` with dkv_mode `mode`, one forward program per query of `fwd_block_k` rows
    per step, and the backward's knobs (config fields `bwd_...`)."""
    cfg = pallas_gpu.SparseMLAGpuConfig(dkv_mode=mode, block_k=fwd_block_k, num_splits=1, **knobs)
    return lambda q, kv, idx: pallas_gpu.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, config=cfg,
                                                    interpret=True)


def _new(**knobs):
    return _gpu_op("sorted", 64, **knobs)


CASES = [  # (B, S, K, settings): K not a multiple of the block, several blocks and chunks
    (2, 3, 40, dict(bwd_block_k=16)),                                                 # fused dq, one chunk
    (1, 5, 37, dict(bwd_block_k=16, bwd_fuse_dq=False, bwd_budget=2 * 37 * DK * 4)),  # ds^T + dq kernel, 3 chunks
    (2, 2, 16, dict(bwd_block_k=16, bwd_col_block=16, bwd_reduce_block=4)),           # one block, small tiles
]


@pytest.mark.parametrize("B,S,K,cfg", CASES)
def test_gradients_match_reference(B, S, K, cfg):
    q, kv, idx, dout = _inputs(B * 100 + K, B, S, K)
    dq, dkv = jax.jit(lambda q, kv: _vjp(_new(**cfg), q, kv, idx, dout))(q, kv)
    rdq, rdkv = _vjp(_ref, q, kv, idx, dout)
    assert dq.shape == q.shape and dkv.shape == kv.shape
    np.testing.assert_allclose(dq, rdq, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dkv, rdkv, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(dq[0, 0], 0.0)             # empty row: no gradient


def test_bf16_and_repeatable():
    """bf16 through the op; the same inputs twice give the same bits."""
    q, kv, idx, dout = _inputs(7, 2, 3, 24, jnp.bfloat16)
    grad = jax.jit(lambda q, kv: _vjp(_new(bwd_block_k=16, bwd_budget=2 * 24 * DK * 2), q, kv, idx, dout))
    check_bf16_grads_repeatable(lambda: grad(q, kv),
                                _vjp(_ref, q.astype(jnp.float32), kv.astype(jnp.float32), idx, dout))


def test_transposed_index_lists_every_pair_in_order():
    _, _, idx, _ = _inputs(3, 2, 3, 12)
    ti = tr.transpose_index(idx, T, chunk_rows=4)                    # rows 0-3, 4-5 (+2 padding)
    assert ti.num_chunks == 2 and ti.offsets.shape == (2, 2 * T + 1)
    flat = np.asarray(idx).reshape(6, 12)
    position, offsets = np.asarray(ti.position), np.asarray(ti.offsets)
    for c in range(2):
        assert sorted(position[c]) == list(range(48))                # a permutation of places
        local_at = np.argsort(position[c])                             # place -> local pair id
        for b in range(2):
            for t in range(T):
                r = b * T + t
                got = local_at[offsets[c, r]:offsets[c, r + 1]]
                want = [(row - 4 * c) * 12 + j for row in range(4 * c, min(4 * c + 4, 6))
                        for j in range(12) if row // 3 == b and flat[row, j] == t]
                assert list(got) == want


def test_prebuilt_index_serves_several_layers():
    """One transposed index (an IndexShare group's), built through the public API, reused for
    two layers' backward; refused by an implementation that takes none."""
    q, kv, idx, dout = _inputs(11, 1, 4, 20)
    cfg = pk.SparseMLAGpuConfig(block_k=16)
    ti = pk.sparse_mla_backward_index(idx, T, dk=q.shape[-1], dtype=kv.dtype, impl="pallas_gpu", config=cfg,
                                      interpret=True)
    assert pk.sparse_mla_backward_index(idx, T, dk=q.shape[-1], dtype=kv.dtype, impl="xla") is None
    with pytest.raises(ValueError, match="takes no tindex"):
        pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl="xla", tindex=ti)
    fn = lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu", config=cfg,
                                        interpret=True, tindex=ti)[:2]
    got_and_want = _jitted_pair(fn, idx, dout)
    for layer in range(2):
        got, want = got_and_want(q * (1 + layer), kv - layer)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="built for"):
        gb.backward(q, kv, idx[..., :10], dout, jnp.zeros((1, 4, H)), jnp.zeros((1, 4, H)),
                    sm_scale=SCALE, v_dim=DV, tindex=ti, interpret=True)


def test_lowers_to_triton_for_h200():
    """The three kernels at GLM shapes (16 heads fused dq; 64 heads with the dq kernel)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    for heads, kernels in ((16, 2), (64, 3)):
        s = jax.ShapeDtypeStruct
        args = (s((1, 8, heads, 576), jnp.bfloat16), s((1, 4096, 576), jnp.bfloat16),
                s((1, 8, 2048), jnp.int32), s((1, 8, heads, 512), jnp.bfloat16),
                s((1, 8, heads), jnp.float32), s((1, 8, heads), jnp.float32))
        fn = lambda q, kv, i, d, l, de: gb.backward(q, kv, i, d, l, de, sm_scale=0.04, v_dim=512)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == kernels


# ----------------------------------------------------------------------------- "by_key"

BY_KEY_CASES = [  # (B, S, T, K, H, settings): the keys kernel's tiles and edges
    (2, 40, 48, 20, 8, dict(bwd_block_rows=16, bwd_tile_cols=64)),   # 8 heads: tiles of 8 queries, S % 8 != 0
    (1, 70, 50, 24, 3, dict(bwd_block_rows=8, bwd_tile_cols=32)),    # 3 heads in 4 slots, T % 8 != 0, 3 words
    (2, 32, 32, 40, 8, dict(bwd_block_rows=16)),                     # contiguous query tiles (16 x 8), K > T
    (1, 36, 64, 16, 4, dict(bwd_block_rows=32, bwd_tile_cols=16, bwd_fuse_dq=False)),   # ds^T + dq kernel
]


def _by_key(**knobs):
    return _gpu_op("by_key", 16, bwd_block_k=16, **knobs)


@pytest.mark.parametrize("B,S,T_,K,H_,cfg", BY_KEY_CASES)
def test_by_key_gradients_match_reference(B, S, T_, K, H_, cfg):
    q, kv, idx, dout = backward_inputs(B * 100 + S, B, S, T_, K, H_, DK, DV)
    dout = dout.astype(jnp.float32)
    dq, dkv = jax.jit(lambda q, kv: _vjp(_by_key(**cfg), q, kv, idx, dout))(q, kv)
    rdq, rdkv = _vjp(_ref, q, kv, idx, dout)
    np.testing.assert_allclose(dq, rdq, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dkv, rdkv, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(dq[0, 0], 0.0)             # empty row: no gradient


def test_by_key_bf16_and_repeatable():
    q, kv, idx, dout = _inputs(8, 2, 20, 24, jnp.bfloat16)
    grad = jax.jit(lambda q, kv: _vjp(_by_key(bwd_block_rows=16), q, kv, idx, dout))
    check_bf16_grads_repeatable(lambda: grad(q, kv),
                                _vjp(_ref, q.astype(jnp.float32), kv.astype(jnp.float32), idx, dout))


def test_key_bitmap_lists_every_selecting_query():
    """bits: exactly the (query, row) pairs selected (-1 and out of range none; a row listed
    twice by one query, whose count is unspecified, changes that row's bits only); spans: the
    words of each block's selecting queries."""
    B, S, T_, K = 2, 70, 20, 12
    _, _, idx, _ = backward_inputs(4, B, S, T_, K, 2, 8, 4)
    idx = np.array(idx)
    idx[0, 3, :3] = [5, 5, T_ + 1]                                  # a duplicate, out of range
    km = tr.key_bitmap(jnp.asarray(idx), T_, block_rows=8)
    bits = np.asarray(km.bits).view(np.uint32)
    assert bits.shape == (B * T_, 3) and km.spans.shape == (B * 3, 2)
    want = np.zeros(bits.shape, np.uint64)
    for b, s, t in zip(*np.nonzero((idx >= 0) & (idx < T_))[:2], idx[(idx >= 0) & (idx < T_)]):
        want[b * T_ + t, s // 32] |= np.uint64(1) << np.uint64(s % 32)
    other = np.arange(B * T_) != 5
    np.testing.assert_array_equal(bits[other], want.astype(np.uint32)[other])
    want[5] = bits[5]
    for p, (lo, hi) in enumerate(np.asarray(km.spans)):
        b, blk = divmod(p, 3)
        used = np.nonzero(want[b * T_ + 8 * blk:b * T_ + min(8 * blk + 8, T_)].any(axis=0))[0]
        assert (lo, hi) == ((used[0], used[-1] + 1) if used.size else (0, 0))


def test_by_key_prebuilt_bitmap_serves_several_layers():
    """One bitmap through the public API (dkv_mode "by_key") serves two layers; an index of the
    other kind is refused by an explicit mode."""
    q, kv, idx, dout = _inputs(12, 1, 9, 20)
    cfg = pk.SparseMLAGpuConfig(block_k=16, dkv_mode="by_key")
    km = pk.sparse_mla_backward_index(idx, T, dk=DK, dtype=kv.dtype, impl="pallas_gpu", config=cfg, interpret=True)
    assert isinstance(km, tr.KeyBitmap)
    fn = lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu", config=cfg,
                                        interpret=True, tindex=km)
    got_and_want = _jitted_pair(fn, idx, dout)
    for layer in range(2):
        got, want = got_and_want(q * (1 + layer), kv - layer)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    sorted_index = gb.backward_index(idx, T, dk=DK, dtype=kv.dtype)
    with pytest.raises(ValueError, match="takes a KeyBitmap"):
        pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu", config=cfg, interpret=True,
                      tindex=sorted_index)


def test_auto_takes_by_key_at_the_default_model_shape():
    """`by_key_is_cheaper`: the default training recipe's attention (8 heads, Dk 160, v 128,
    top-256 of 4096) takes "by_key", small-128k's and GLM-5.2's "sorted"; with the heads,
    `backward_index` builds the bitmap, without them the sorted index, which "auto" then leaves
    aside for a bitmap of its own (same gradients)."""
    cheaper = pallas_gpu.by_key_is_cheaper
    assert cheaper(seq_len=4096, num_keys=4096, heads=8, dk=160, v_dim=128, topk=256, itemsize=2)
    assert not cheaper(seq_len=65536, num_keys=65536, heads=16, dk=576, v_dim=512, topk=2048, itemsize=2)
    assert not cheaper(seq_len=8192, num_keys=131072, heads=64, dk=576, v_dim=512, topk=2048, itemsize=2)
    q, kv, idx, dout = _inputs(13, 1, 6, 40)                          # 4 heads, top-40 of 50: by_key
    auto = pk.SparseMLAGpuConfig(block_k=16)
    assert isinstance(pallas_gpu.backward_index(idx, T, dk=DK, dtype=kv.dtype, config=auto, heads=H, v_dim=DV),
                      tr.KeyBitmap)
    sorted_index = pallas_gpu.backward_index(idx, T, dk=DK, dtype=kv.dtype, config=auto)
    assert isinstance(sorted_index, tr.TransposedIndex)
    fn = lambda q, kv, i: pallas_gpu.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, config=auto, interpret=True,
                                                tindex=sorted_index)
    jaxpr = str(jax.make_jaxpr(lambda q, kv: _vjp(fn, q, kv, idx, dout))(q, kv))
    assert "sparse_mla_bwd_keys" in jaxpr and "sparse_mla_bwd_pairs" not in jaxpr
    for g, w in zip(*_jitted_pair(fn, idx, dout)(q, kv)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_config_knobs_are_the_backwards_settings():
    """Every keyword setting `name` of `backward` / `backward_by_key` is the config field
    `bwd_<name>` with the same default (INDEXED_KNOBS lists them all)."""
    fields = {f.name: f.default for f in dataclasses.fields(pallas_gpu.SparseMLAGpuConfig)}
    for mode, fn in (("sorted", gb.backward), ("by_key", gb.backward_by_key)):
        params = inspect.signature(fn).parameters
        knobs = [n for n, p in params.items()
                 if p.kind is p.KEYWORD_ONLY and n not in ("sm_scale", "v_dim", "tindex", "interpret")]
        assert sorted(knobs) == sorted(pallas_gpu.INDEXED_KNOBS[mode])
        for name in knobs:
            assert fields["bwd_" + name] == params[name].default, name


@pytest.mark.parametrize("knobs,match", [
    (dict(bwd_tile_cols=48), "bwd_tile_cols must be a power of two"),
    (dict(bwd_block_k=24), "bwd_block_k must be a power of two"),
    (dict(bwd_reduce_block=512), "bwd_reduce_block must be <= transpose.SPARE_ROWS"),
    (dict(bwd_budget=0), "bwd_budget must be a positive int, got 0"),
    (dict(bwd_dq_warps=None), "bwd_dq_warps must be a positive int, got None"),
    (dict(bwd_num_warps=0), "bwd_num_warps must be a positive int or None"),
    (dict(bwd_fuse_dq=1), "bwd_fuse_dq must be True, False or None"),
    (dict(bwd_keys_paired=None), "bwd_keys_paired must be True or False"),
])
def test_config_refuses_bad_backward_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        pallas_gpu.SparseMLAGpuConfig(**knobs)


def test_config_knobs_reach_the_kernels():
    """The knobs choose the kernels that run: bwd_fuse_dq=False adds the dq kernel, bwd_budget
    cuts the sorted index into chunks, bwd_block_rows sets the bitmap's blocks."""
    q, kv, idx, dout = _inputs(14, 1, 5, 37)
    kernels = lambda fn: str(jax.make_jaxpr(lambda q, kv: _vjp(fn, q, kv, idx, dout))(q, kv))
    assert "sparse_mla_bwd_dq" not in kernels(_new(bwd_block_k=16))
    jaxpr = kernels(_new(bwd_block_k=16, bwd_fuse_dq=False, bwd_budget=2 * 37 * DK * 4))
    assert "sparse_mla_bwd_dq" in jaxpr and "grid=(2,)" in jaxpr          # chunks of 2 queries
    assert "sparse_mla_bwd_dq" in kernels(_by_key(bwd_fuse_dq=False))
    cfg = pallas_gpu.SparseMLAGpuConfig(dkv_mode="by_key", bwd_block_rows=16)
    assert pallas_gpu.backward_index(idx, T, dk=DK, dtype=kv.dtype, config=cfg).block_rows == 16
    cfg = pallas_gpu.SparseMLAGpuConfig(dkv_mode="sorted", bwd_budget=2 * 37 * DK * 4)
    assert pallas_gpu.backward_index(idx, T, dk=DK, dtype=kv.dtype, config=cfg).num_chunks == 3


@pytest.mark.parametrize("heads", [8, 3])
def test_by_key_lowers_to_triton_for_h200(heads):
    """The default model's shape (Dk 160, v 128, top-256): forward, dq and keys kernels, the
    queries unpadded (no pad of q or dout in the program)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    s = jax.ShapeDtypeStruct
    args = (s((2, 256, heads, 160), jnp.bfloat16), s((2, 256, 160), jnp.bfloat16), s((2, 256, 256), jnp.int32))
    cfg = pk.SparseMLAGpuConfig(dkv_mode="by_key")

    def grad(q, kv, idx):
        loss = lambda q, kv: pallas_gpu.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=128, config=cfg)[0].sum()
        return jax.grad(loss, argnums=(0, 1))(q, kv)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
    assert "x16x160xbf16" not in text and "x16x128xbf16" not in text           # no 16-head copy
