"""The paged decode kernels (`paged_indexer_topk`, `paged_sparse_mla`): their configs' knobs in
interpret mode, and compilation for real chips. Their contract with the default configs is
tested with every implementation's in test_kernel_contract.py.

Knobs: TPU key tiles smaller than a page, with a partial last tile in each page; GPU key tiles
inside one page (a scalar page id per tile); GPU sparse MLA with head groups and K splits. The
TPU sparse MLA over stores of packed words (bf16, fp8: the selected row taken out of its word)
and over a page size that splits a word (the XLA fallback). The TPU kernels are compiled ahead
of time for v5p, v6e and tpu7x (needs libtpu) and read the store in place (no copy of it in the
compiled program), and the GPU kernels lowered to Triton for an H200 (no GPU needed), at
GLM-5.2's decode shapes over a paged store.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from conftest import tpu_compile_mesh
from kernel_contract import check_paged_sparse_mla, check_paged_topk, int_inputs, positions, sparse_inputs
from pallas_kernels.sparse_mla import gpu as mla_gpu, tpu as mla_tpu
from pallas_kernels.indexer_topk import gpu as indexer_gpu, tpu as indexer_tpu

TOPK_CASES = [  # (impl, page size, config)
    ("pallas_tpu", 192, pk.IndexerTpuConfig(block_t=128)),                       # 2 tiles a page, the 2nd partial
    ("pallas_gpu", 128, pk.IndexerGpuConfig(block_t=64, tiles_per_program=3)),   # tiles inside pages
]


@pytest.mark.parametrize("impl,page_size,config", TOPK_CASES)
def test_paged_topk_configs(impl, page_size, config):
    rng = np.random.default_rng(page_size)
    q, k, w = int_inputs(rng, 2, 2, 500, 4, 16)
    q_pos, kv_len = positions(rng, 2, 2, 500, "offset")
    check_paged_topk(impl, q, k, w, page_size=page_size, topk=24, q_pos=q_pos, kv_len=kv_len, config=config)


def test_paged_sparse_mla_gpu_head_groups_and_splits():
    q, kv, idx = sparse_inputs(9, B=2, S=1, T=60, K=40, H=20, Dk=80)       # 20 heads: 32 padded, 2 groups
    check_paged_sparse_mla("pallas_gpu", q, kv, idx, page_size=8, sm_scale=0.125, v_dim=64,
                           config=pk.SparseMLAGpuConfig(block_k=16, num_splits=2, head_group=16))
    assert mla_gpu.default_head_group(64, 64) == 16 and mla_gpu.default_head_group(128, 64) == 32
    assert mla_gpu.default_head_group(4096, 64) == 64 and mla_gpu.default_head_group(1, 8) == 16


@pytest.mark.parametrize("dtype,page_size", [(jnp.bfloat16, 16), (jnp.float8_e4m3fn, 16), (jnp.bfloat16, 15)])
def test_tpu_paged_sparse_mla_packed_stores(dtype, page_size):
    """Rows 2 (bf16) or 4 (fp8) to a 32-bit word: each selected row is cut out of the word its
    DMA copied, at every place in the word; float32 queries, so the rows are compared exactly
    as stored. A page of 15 bf16 rows splits a word: the XLA fallback, same answer."""
    q, kv, idx = sparse_inputs(31, B=2, S=2, T=50, K=24, H=4, Dk=80)
    check_paged_sparse_mla("pallas_tpu", q, kv.astype(dtype), idx, page_size=page_size, sm_scale=0.125, v_dim=64)
    assert {int(t) % 4 for t in np.asarray(idx).ravel() if t >= 0} == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- compilation

B, H, DK, V, K, PAGE, PAGES = 4, 64, 576, 512, 2048, 64, 128        # 8K rows a sequence
POOL = 8 * B * PAGES + 1      # a pool's pages (room for 8x these sequences): stores of 906 and 134 MB


def _mla_args(sharding=None):
    kw = {} if sharding is None else {"sharding": sharding}
    return (jax.ShapeDtypeStruct((B, 1, H, DK), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((3, POOL, PAGE, DK), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, PAGES), jnp.int32, **kw),
            jax.ShapeDtypeStruct((B, 1, K), jnp.int32, **kw),
            jax.ShapeDtypeStruct((), jnp.int32, **kw))


def _topk_args(sharding=None):
    kw = {} if sharding is None else {"sharding": sharding}
    return (jax.ShapeDtypeStruct((B, 1, 32, 128), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((2, POOL, PAGE, 128), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, PAGES), jnp.int32, **kw),
            jax.ShapeDtypeStruct((B, 1, 32), jnp.float32, **kw),
            jax.ShapeDtypeStruct((B, 1), jnp.int32, **kw),
            jax.ShapeDtypeStruct((B,), jnp.int32, **kw),
            jax.ShapeDtypeStruct((), jnp.int32, **kw))


def _mla_fn(module):
    return lambda q, store, table, idx, slot: module.paged_sparse_mla(q, store, table, idx, slot=slot,
                                                                      sm_scale=0.04, v_dim=V)


def _topk_fn(module):
    return lambda q, store, table, w, p, n, slot: module.paged_indexer_topk(q, store, table, w, topk=K, q_pos=p,
                                                                            kv_len=n, slot=slot)


def _scores_fn(module):
    return lambda q, store, table, w, p, n, slot: module.paged_scores(q, store, table, slot, w, q_pos=p, kv_len=n)


_INSTRUCTION = re.compile(r"=\s*(.*?)\s(copy|copy-start|transpose)\(")
_ARRAY = re.compile(r"\[([\d,]+)\]")


def _store_sized_copies(hlo_text: str, elements: int) -> list[str]:
    """The copy / transpose instructions of a compiled module whose result holds an array of at
    least `elements` elements (a relayout of the store)."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m and any(np.prod([int(d) for d in a.split(",")]) >= elements for a in _ARRAY.findall(m.group(1))):
            found.append(line.strip()[:200])
    return found


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_tpu_paged_kernels_read_the_store_in_place(topology):
    """The paged kernels compiled ahead of time in a plain jit, as `glm_jax.aot` compiles the
    decode step (the selection after the scores is compiled in test_indexer_pallas.py), read
    the store, pinned row-major as the decode step keeps the cache, in that layout: no copy or
    transpose of it in the compiled program and temporaries under 10% of its bytes (a [.., P,
    1, Dk] view of the latent store used to cost a relayout copy, temporaries 2.2x the store)."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = tpu_compile_mesh(topology)
    replicated = NamedSharding(mesh, P())
    for fn, args, name in ((_mla_fn(mla_tpu), _mla_args, "paged_sparse_mla_fwd"),
                           (_scores_fn(indexer_tpu), _topk_args, "paged_indexer_scores")):
        specs = list(args(replicated))
        store = specs[1]
        specs[1] = jax.ShapeDtypeStruct(store.shape, store.dtype,
                                        sharding=Format(Layout(major_to_minor=(0, 1, 2, 3)), replicated))
        compiled = jax.jit(fn).lower(*specs).compile()
        text = compiled.as_text()
        assert name in text
        assert not _store_sized_copies(text, store.size), _store_sized_copies(text, store.size)
        assert compiled.memory_analysis().temp_size_in_bytes < 0.1 * store.size * store.dtype.itemsize


def test_gpu_paged_kernels_lower_to_triton_for_h200():
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        # sparse MLA: one kernel; the indexer: scores, two counting passes, the compaction
        for fn, args, calls in ((_mla_fn(mla_gpu), _mla_args(), 1), (_topk_fn(indexer_gpu), _topk_args(), 4)):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == calls
