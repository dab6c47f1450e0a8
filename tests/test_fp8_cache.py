"""The FP8 cache layout (`pallas_kernels.fp8`, `glm_jax.cache.fp8`): the quantizer against a
float64 reference and its error bound, per-token scales, zeros, writes into a paged store, the
byte accounting at GLM-5.2's shapes, and the paged ops' refusals of bad FP8 stores. The ops'
contract over FP8 stores is in test_kernel_contract.py (`test_paged_*_fp8`, checks in
fp8_contract.py).

Bound (module docstring of pallas_kernels.fp8): e4m3 keeps 3 mantissa bits, so with
scale = max|x| / 448 over a group, each element errs by at most max(2^-4 |x|, 2^-10 scale),
hence by at most 2^-4 of the group's max |x|.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from conftest import ROOT
from fp8_contract import check_paged_sparse_mla_fp8, check_paged_topk_fp8, fp8_exact_keys
from kernel_contract import int_inputs, positions, sparse_inputs
from glm_jax.cache import fp8 as cache_fp8, page_bytes
from glm_jax.cache.store import cache_bytes_per_token
from glm_jax.config import load_config
from pallas_kernels import fp8, paging


def _rows(seed, shape):
    """Normal rows whose 128-value groups span 12 orders of magnitude (one scale each), with
    tiny values next to large ones inside a group (subnormal e4m3 after scaling)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape)
    n = shape[-1]
    x *= (10.0 ** rng.uniform(-6, 6, shape[:-1] + (-(-n // 128),)))[..., np.arange(n) // 128]
    x[..., 5] *= 1e-4
    return x.astype(np.float32)


def _np_quantize(x, group):
    """float64 reference: scale = max|x| / 448, values = e4m3(x / scale) (ml_dtypes rounding)."""
    g = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, group)
    scale = np.abs(g).max(-1) / 448.0
    y = g / np.where(scale > 0, scale, 1.0)[..., None]
    values = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (values * scale[..., None]).reshape(x.shape), scale


def test_latent_round_trip_within_the_e4m3_bound():
    x = _rows(0, (3, 7, 512 + 64))
    q = fp8.quantize_latent(jnp.asarray(x), 512)
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == (3, 7, 512)
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (3, 7, 4)
    assert q.rope.dtype == jnp.bfloat16 and q.rope.shape == (3, 7, 64)
    back = np.asarray(fp8.dequantize(q), np.float64)
    assert back.shape == x.shape
    lat, ref_scale = x[..., :512].astype(np.float64), _np_quantize(x[..., :512], 128)[1]
    err = np.abs(back[..., :512] - lat)
    group_max = np.abs(lat).reshape(3, 7, 4, 128).max(-1).repeat(128, -1).reshape(lat.shape)
    bound = np.maximum(2.0 ** -4 * np.abs(lat), 2.0 ** -10 * group_max / 448)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    assert (err <= 2.0 ** -4 * group_max * (1 + 1e-5)).all()
    assert (err / group_max).max() > 2.0 ** -6                  # it does round: not an exact store
    np.testing.assert_allclose(np.asarray(q.scales), ref_scale, rtol=1e-6)
    np.testing.assert_allclose(back[..., :512], _np_quantize(x[..., :512], 128)[0], rtol=1e-5,
                               atol=1e-6 * group_max.max())
    np.testing.assert_array_equal(back[..., 512:], x[..., 512:].astype(ml_dtypes.bfloat16).astype(np.float64))


def test_each_group_max_round_trips_and_scales_are_the_tokens_own():
    """A token's scales depend on its values only: quantized alone, in a batch, or next to a
    token 1000x larger, the same bytes; the largest |x| of each group maps to +-448."""
    x = _rows(1, (4, 256 + 16))
    alone = [fp8.quantize_latent(jnp.asarray(x[i:i + 1]), 256) for i in range(4)]
    x_big = x.copy()
    x_big[0] *= 1000
    for batch in (fp8.quantize_latent(jnp.asarray(x), 256), fp8.quantize_latent(jnp.asarray(x_big), 256)):
        for i in range(1, 4):
            for a, b in zip(alone[i], batch):
                np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[i], np.float32))
    q = fp8.quantize_latent(jnp.asarray(x), 256)
    vals = np.abs(np.asarray(q.values, np.float32)).reshape(4, 2, 128)
    assert (vals.max(-1) == 448).all()


def test_zero_rows_and_groups_give_zeros_not_nan():
    x = _rows(2, (3, 384 + 8))
    x[0] = 0.0                      # a whole row
    x[1, 128:256] = 0.0             # one group of a row
    q = fp8.quantize_latent(jnp.asarray(x), 384)
    back = np.asarray(fp8.dequantize(q))
    assert np.isfinite(back).all() and np.isfinite(np.asarray(q.values, np.float32)).all()
    assert (np.asarray(q.scales)[0] == 0).all() and np.asarray(q.scales)[1, 1] == 0
    assert (back[0] == 0).all() and (back[1, 128:256] == 0).all()
    keys = fp8.quantize_keys(jnp.zeros((2, 5, 128)))
    assert (np.asarray(fp8.dequantize(keys)) == 0).all() and (np.asarray(keys.scales) == 0).all()


def test_keys_one_scale_each_within_the_bound():
    x = _rows(3, (2, 9, 128))
    k = fp8.quantize_keys(jnp.asarray(x))
    assert k.values.shape == (2, 9, 128) and k.scales.shape == (2, 9) and k.scales.dtype == jnp.float32
    back = np.asarray(fp8.dequantize(k), np.float64)
    kmax = np.abs(x).max(-1, keepdims=True).astype(np.float64)
    assert (np.abs(back - x) <= 2.0 ** -4 * kmax * (1 + 1e-5)).all()
    np.testing.assert_allclose(back, _np_quantize(x, 128)[0], rtol=1e-5, atol=1e-6 * kmax.max())


def test_write_rows_then_read_pages():
    """Rows written into an FP8 paged store (quantized per row on write) read back through a
    page table as the dequantized rows; a bf16 store keeps the rows cast."""
    rows = _rows(4, (6, 128 + 16))
    store = fp8.empty_latent_pages((2, 4, 4), 128, 16)
    pages, offsets = jnp.asarray([3, 3, 0, 0, 2, 2]), jnp.asarray([0, 1, 0, 1, 2, 3])
    store = fp8.write_rows(store, 1, pages, offsets, jnp.asarray(rows))
    table = jnp.asarray([[3, 0, 2]], jnp.int32)
    got = np.asarray(paging.read_pages(store, 1, table))[0]            # 12 logical rows
    want = np.asarray(fp8.dequantize(fp8.quantize_latent(jnp.asarray(rows), 128)))
    np.testing.assert_array_equal(got[[0, 1, 4, 5, 10, 11]], want)
    assert (got[[2, 3, 6, 7, 8, 9]] == 0).all()
    bf = fp8.write_rows(jnp.zeros((2, 4, 4, 144), jnp.bfloat16), 1, pages, offsets, jnp.asarray(rows))
    assert bf.dtype == jnp.bfloat16 and fp8.row_bytes(bf) == 288 and fp8.row_bytes(store) == 128 + 4 + 32


def test_bytes_at_glm_5_2():
    cfg = load_config(ROOT / "configs" / "glm-5.2.yaml")
    assert fp8.latent_row_bytes(512, 64) == 656 and fp8.key_row_bytes(128) == 132
    assert cache_fp8.latent_row_bytes(cfg, "fp8") == 656 and cache_fp8.latent_row_bytes(cfg) == 1152
    assert cache_fp8.key_row_bytes(cfg, "fp8") == 132 and cache_fp8.key_row_bytes(cfg) == 256
    assert cache_fp8.bytes_per_token(cfg, "fp8") == 53_940 == cache_bytes_per_token(cfg, layout="fp8")
    assert cache_fp8.bytes_per_token(cfg) == 95_232 == cache_bytes_per_token(cfg)
    assert cache_fp8.bytes_per_token(cfg, "fp8", index_share=False) == 61_464
    assert cache_fp8.page_bytes(cfg, 64, "fp8") == 64 * 53_940 == page_bytes(cfg, 64, layout="fp8")
    assert page_bytes(cfg, 64, jnp.bfloat16) == page_bytes(cfg, 64, layout="bf16") == 64 * 95_232
    assert cache_fp8.pages_that_fit(cfg, 10 * 64 * 53_940 + 5, 64, "fp8") == 10
    assert cache_fp8.pages_that_fit(cfg, 100, 64, "fp8") == 0
    latent, keys = cache_fp8.empty_stores(cfg, 2, 1, 3, 4)
    assert fp8.row_bytes(latent) == 656 and fp8.row_bytes(keys) == 132
    assert latent.values.shape == (2, 3, 4, 512) and keys.scales.shape == (1, 3, 4)
    with pytest.raises(ValueError, match="layout must be one of 'bf16', 'fp8'"):
        cache_fp8.bytes_per_token(cfg, "fp4")


# ----------------------------------------------------------------------------- refusals


def test_quantizer_refuses_widths_off_the_group():
    with pytest.raises(ValueError, match=r"quantized width 100 must be a multiple of the group 128"):
        fp8.quantize_latent(jnp.zeros((2, 116)), 100)
    with pytest.raises(ValueError, match=r"kv_lora=200 must be in \[1, 144\]"):
        fp8.quantize_latent(jnp.zeros((2, 144)), 200)


def _mla_args(store):
    q, table, idx = jnp.zeros((1, 1, 2, 144)), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1, 2), jnp.int32)
    return (q, store, table, idx), dict(sm_scale=1.0, v_dim=128)


@pytest.mark.parametrize("bad,error,message", [
    (lambda s: s._replace(values=s.values.astype(jnp.bfloat16)), TypeError,
     r"kv_pages.values must have float8_e4m3fn, got bfloat16"),
    (lambda s: s._replace(scales=s.scales[..., :0]), ValueError, r"kv_pages.scales must hold one scale per 128"),
    (lambda s: s._replace(rope=s.rope.astype(jnp.float32)), TypeError, r"kv_pages.rope must have bfloat16"),
    (lambda s: s._replace(rope=s.rope[..., :8]), ValueError, r"rows of 128 \+ 8 = 136 values, but q has Dk=144"),
    (lambda s: s._replace(rope=s.rope[:1]), ValueError, r"kv_pages.rope has shape .* they must agree"),
    (lambda s: s._replace(rope=s.rope[0]), ValueError, r"fields of the FP8 store kv_pages must all be"),
    (lambda s: fp8.Fp8Keys(s.values, s.scales), TypeError, r"kv_pages is a pallas_kernels.fp8.Fp8Keys, but this "
                                                            r"op reads a Fp8Latent"),
    (lambda s: tuple(s), TypeError, r"kv_pages must be an array or a pallas_kernels.fp8.Fp8Latent"),
])
def test_paged_sparse_mla_refuses_bad_fp8_stores(bad, error, message):
    store = fp8.empty_latent_pages((2, 3, 4), 128, 16)
    args, kw = _mla_args(bad(store))
    with pytest.raises(error, match=message) as info:
        pk.paged_sparse_mla(*args, **kw, impl="xla")
    assert "\n" not in str(info.value) and str(info.value).startswith("pallas_kernels.paged_sparse_mla: ")


@pytest.mark.parametrize("store,error,message", [
    (fp8.Fp8Keys(jnp.zeros((1, 3, 4, 16), jnp.float8_e4m3fn), jnp.zeros((1, 3, 4, 1))), ValueError,
     r"k_pages must be values \[\(slots,\) pages, P, D\] and scales \[\(slots,\) pages, P\], got shapes"),
    (fp8.Fp8Keys(jnp.zeros((1, 3, 4, 16), jnp.float8_e4m3fn), jnp.zeros((1, 3, 5))), ValueError,
     r"k_pages.scales has shape \(1, 3, 5\) .* but k_pages.values has P=4"),
    (fp8.Fp8Keys(jnp.zeros((1, 3, 4, 8), jnp.float8_e4m3fn), jnp.zeros((1, 3, 4))), ValueError,
     r"k_pages.values has shape \(1, 3, 4, 8\) .* so D=8, but q has D=16"),
    (fp8.empty_latent_pages((1, 3, 4), 128, 16), TypeError, r"k_pages is a pallas_kernels.fp8.Fp8Latent, but this op "
                                                           r"reads a Fp8Keys"),
])
def test_paged_indexer_refuses_bad_fp8_stores(store, error, message):
    args = (jnp.zeros((1, 1, 2, 16)), store, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 2)))
    with pytest.raises(error, match=message) as info:
        pk.paged_indexer_topk(*args, topk=2, q_pos=jnp.zeros((1, 1), jnp.int32), kv_len=jnp.ones((1,), jnp.int32),
                              impl="xla")
    assert "\n" not in str(info.value) and str(info.value).startswith("pallas_kernels.paged_indexer_topk: ")


def test_impls_without_fp8_refuse_and_auto_falls_back(monkeypatch):
    store = fp8.empty_latent_pages((2, 3, 4), 128, 16)
    args, kw = _mla_args(store)
    with pytest.raises(ValueError, match=r"impl='pallas_tpu' does not read FP8 pages; the implementations that do: "
                                         r"reference, xla, pallas_gpu"):
        pk.paged_sparse_mla(*args, **kw, impl="pallas_tpu", interpret=True)
    with pytest.raises(ValueError, match=r"impl='pallas_gpu' reads FP8 pages with v_dim = the FP8 values' width "
                                         r"\(128\), got v_dim=120"):
        pk.paged_sparse_mla(*args, **{**kw, "v_dim": 120}, impl="pallas_gpu", interpret=True)
    # on a TPU "auto" picks pallas_tpu, which does not read FP8: the op runs the xla form instead
    monkeypatch.setattr(pk.registry.jax, "default_backend", lambda: "tpu")
    assert pk.resolve_impl("paged_sparse_mla", "auto") == "pallas_tpu"
    assert pk._store_impl("paged_sparse_mla", store, "auto") == "xla"
    assert pk._store_impl("paged_sparse_mla", store._replace(), "reference") == "reference"
    assert pk._store_impl("paged_indexer_topk", jnp.zeros((1, 3, 4, 16)), "auto") == "auto"


def test_benchmark_smoke(tmp_path, capsys):
    """benchmarks/fp8_decode.py --smoke: every row measured in both layouts, the FP8 MLA output
    near the bf16 one and the FP8 top-k mostly the bf16 one; an implementation that refuses FP8
    pages (pallas_tpu's sparse MLA) is a row with its exception; the JSON holds the rows and the
    table is printed."""
    from benchmarks import fp8_decode

    rows = fp8_decode.main(["--smoke", "--json", str(tmp_path / "out.json"), "--impls", "pallas_gpu", "xla",
                            "pallas_tpu"])
    mla = [r for r in rows if r["op"] == "paged_sparse_mla"]
    assert all("ms" in r for r in mla if r["impl"] != "pallas_tpu")
    assert {r["row_bytes"] for r in mla} == {640, 256 + 8 + 128}
    assert all(r["vs_bf16"] < 0.2 for r in mla if r["layout"] == "fp8" and "ms" in r)
    refused = [r for r in rows if "failed" in r]
    assert [(r["impl"], r["layout"]) for r in refused] == [("pallas_tpu", "fp8")]
    assert "does not read FP8 pages" in refused[0]["failed"]
    topk = [r for r in rows if r["op"] == "paged_indexer_topk"]
    assert len(topk) == 4 and all(r["vs_bf16"] > 0.8 for r in topk if r["layout"] == "fp8")
    import json
    assert len(json.loads((tmp_path / "out.json").read_text())["rows"]) == len(rows) == 10
    assert "| op | layout | impl |" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the GPU kernel


def test_gpu_paged_sparse_mla_fp8_head_groups_and_splits():
    """pallas_gpu over FP8 pages with 20 heads in 2 groups of 16 and K split in 2 (interpret
    mode): the op over the dequantized rows."""
    q, kv, idx = sparse_inputs(19, B=2, S=1, T=60, K=40, H=20, Dk=256 + 16)
    check_paged_sparse_mla_fp8("pallas_gpu", q, kv, idx, page_size=8, sm_scale=0.0625, v_dim=256,
                               config=pk.SparseMLAGpuConfig(block_k=16, num_splits=2, head_group=16))


def test_gpu_paged_indexer_fp8_key_tiles_inside_pages():
    """pallas_gpu's paged top-k over FP8 keys with tiles of 64 inside pages of 128, 3 tiles a
    program (interpret mode): the top-k of the keys (`fp8_exact_keys`: quantized exactly, so
    ties stay ties whatever the summation order)."""
    rng = np.random.default_rng(128)
    q, _, w = int_inputs(rng, 2, 2, 500, 4, 16)
    k = fp8_exact_keys(rng, 2, 500, 16)
    q_pos, kv_len = positions(rng, 2, 2, 500, "offset")
    check_paged_topk_fp8("pallas_gpu", q, k, w, page_size=128, topk=24, q_pos=q_pos, kv_len=kv_len,
                         config=pk.IndexerGpuConfig(block_t=64, tiles_per_program=3))


def _h100():
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


@pytest.mark.parametrize("page", [64, 256])
def test_gpu_paged_indexer_fp8_lowers_to_triton_for_h100(page):
    """The paged top-k over FP8 keys (32 heads x 128, top-k 2048) lowered to Triton for an H100:
    the scores kernel, two counting passes, the compaction; pages of 64 (key tiles gathered row
    by row) and of 256 (tiles inside one page)."""
    s = jax.ShapeDtypeStruct
    B, pages, lead = 4, 8192 // page, (2, 4 * 8192 // page + 1, page)
    store = fp8.Fp8Keys(s(lead + (128,), jnp.float8_e4m3fn), s(lead, jnp.float32))
    args = (s((B, 1, 32, 128), jnp.bfloat16), store, s((B, pages), jnp.int32), s((B, 1, 32), jnp.float32),
            s((B, 1), jnp.int32), s((B,), jnp.int32), s((), jnp.int32))

    def fn(q, st, table, w, p, n, slot):
        return pk.paged_indexer_topk(q, st, table, w, topk=2048, q_pos=p, kv_len=n, slot=slot, impl="pallas_gpu")

    with jax.sharding.use_abstract_mesh(_h100()):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 4


def test_gpu_paged_sparse_mla_fp8_lowers_to_triton_for_h100():
    """The FP8 paged decode kernel at GLM-5.2's shapes (64 heads, 512 e4m3 + 4 scales + 64 bf16
    rope, top-k 2048, pages of 64) lowered to Triton for an H100 (no GPU needed): one kernel."""
    s = jax.ShapeDtypeStruct
    B, pages, lead = 4, 128, (3, 4 * 128 + 1, 64)
    store = fp8.Fp8Latent(s(lead + (512,), jnp.float8_e4m3fn), s(lead + (4,), jnp.float32),
                          s(lead + (64,), jnp.bfloat16))
    args = (s((B, 1, 64, 576), jnp.bfloat16), store, s((B, pages), jnp.int32), s((B, 1, 2048), jnp.int32),
            s((), jnp.int32))

    def fn(q, st, table, idx, slot):
        return pk.paged_sparse_mla(q, st, table, idx, slot=slot, sm_scale=0.04, v_dim=512, impl="pallas_gpu")

    with jax.sharding.use_abstract_mesh(_h100()):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


def test_cache_pages_write_and_read_fp8_stores():
    """glm_jax.cache.pages over an FP8 latent store: rows written at positions through a page
    table (quantized on write; a position past the table dropped; mine=False keeps the old
    rows) read back dequantized by gather_rows and read_sequence, as a bf16 store of the same
    rows dequantized would."""
    from glm_jax.cache import pages as cache_pages

    rows = jnp.asarray(_rows(5, (2, 3, 128 + 16)))
    table = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    positions = jnp.asarray([[0, 5, 9], [2, 3, 7]], jnp.int32)          # 9: past 2 pages of 4, dropped
    store = cache_pages.write_rows(fp8.empty_latent_pages((2, 4, 4), 128, 16), 1, table, positions, rows)
    want = fp8.dequantize(fp8.quantize_latent(rows, 128))
    got = cache_pages.gather_rows(store, 1, table, positions)
    np.testing.assert_array_equal(np.asarray(got)[0, :2], np.asarray(want)[0, :2])
    np.testing.assert_array_equal(np.asarray(got)[1], np.asarray(want)[1])
    seq = np.asarray(cache_pages.read_sequence(store, 1, table))           # [2, 8, 144]
    np.testing.assert_array_equal(seq[1, [2, 3, 7]], np.asarray(want)[1])
    assert (seq[0, [1, 2, 3, 4, 6, 7]] == 0).all() and (np.asarray(fp8.dequantize(store))[0] == 0).all()
    kept = cache_pages.write_rows(store, 1, table, positions, 2 * rows, jnp.bool_(False))
    for a, b in zip(kept, store):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ----------------------------------------------------------------------------- the TPU kernel


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_tpu_paged_indexer_fp8_compiles(topology):
    """pallas_tpu's paged scores over FP8 keys (32 heads x 128, pages of 64, each e4m3 tile
    fetched with its scales through the scalar-prefetched page table) compiled ahead of time
    over stores pinned row-major (as the decode step keeps the cache): the values are read in
    place, and the temporaries (the scales' [slots, pages, 1, P] copy) stay under 10% of their
    bytes; the arguments hold the scales at most 2x padded (lane-dense [.., P])."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import NamedSharding, PartitionSpec as P
    from conftest import tpu_compile_mesh
    from pallas_kernels.indexer_topk import tpu as indexer_tpu

    rep = NamedSharding(tpu_compile_mesh(topology), P())
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)   # noqa: E731
    pinned = lambda shape, dtype: jax.ShapeDtypeStruct(                         # noqa: E731
        shape, dtype, sharding=Format(Layout(major_to_minor=tuple(range(len(shape)))), rep))
    B, pages, lead = 4, 128, (2, 8 * 4 * 128 + 1, 64)
    store = fp8.Fp8Keys(pinned(lead + (128,), jnp.float8_e4m3fn), pinned(lead, jnp.float32))
    args = (s((B, 1, 32, 128), jnp.bfloat16), store, s((B, pages), jnp.int32), s((B, 1, 32), jnp.float32),
            s((B, 1), jnp.int32), s((B,), jnp.int32), s((), jnp.int32))

    def fn(q, st, table, w, p, n, slot):
        return indexer_tpu.paged_scores(q, st, table, slot, w, q_pos=p, kv_len=n)

    compiled = jax.jit(fn).lower(*args).compile()
    assert "paged_indexer_scores" in compiled.as_text()
    values_bytes = store.values.size
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < 0.1 * values_bytes
    assert memory.argument_size_in_bytes < values_bytes + 2.1 * 4 * store.scales.size + 2 ** 20
