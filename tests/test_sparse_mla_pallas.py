"""Pallas sparse MLA (TPU Mosaic and GPU Triton kernels): their configs' knobs, and compilation
for real chips. Their contract (interpret mode on the CPU, with the default configs) is tested
with every implementation's in test_kernel_contract.py.

Interpret mode runs the TPU kernels with pltpu.InterpretParams, which also simulates the DMAs
and their semaphores. The TPU kernels are also compiled ahead of time for v5p, v6e and tpu7x (needs
libtpu; skipped without it) and the GPU kernels lowered to Triton for an H200 (no GPU needed),
which catches layout and block-size errors that interpret mode does not.
"""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks import sparse_mla_tpu_aot as aot
from conftest import tpu_compile_mesh
from kernel_contract import check_sparse_mla, sparse_inputs
from pallas_kernels.sparse_mla import gpu, tpu

CASES = [  # (impl, B, S, K, config): K not a multiple of the block, several blocks (and chunks)
    ("pallas_tpu", 2, 2, 56, pk.SparseMLATpuConfig(   # K > T = 50; backward in 2 query chunks
        block_k=16, bwd_block_k=16, reduce_rows=8, reduce_window=16, bwd_budget=2 * 56 * 512)),
    ("pallas_gpu", 1, 2, 37, pk.SparseMLAGpuConfig(block_k=16, num_splits=2)),        # 2 K splits
]


@pytest.mark.parametrize("impl,B,S,K,config", CASES)
def test_configs_match_the_contract(impl, B, S, K, config):
    q, kv, idx = sparse_inputs(B * 100 + K, B=B, S=S, T=50, K=K, H=4, Dk=80)
    check_sparse_mla(impl, q, kv, idx, sm_scale=0.125, v_dim=64, config=config)


@pytest.mark.parametrize("heads", [8, 3])
@pytest.mark.parametrize("dkv_mode", gpu.DKV_MODES)
def test_gpu_unpadded_heads_match_the_contract(dkv_mode, heads):
    """Head counts under the kernels' 16-row tiles, a power of two (the default model's 8) and
    not (3), read and written unpadded, through every dkv mode: forward and gradients with -1
    holes, an empty row, out-of-range and duplicated indices, 3 queries (several words and
    query tiles of the by_key kernel at 3 heads: 4 slots x 32 queries)."""
    q, kv, idx = sparse_inputs(heads * 10 + len(dkv_mode), B=2, S=3, T=50, K=40, H=heads, Dk=80)
    check_sparse_mla("pallas_gpu", q, kv, idx, sm_scale=0.125, v_dim=64,
                     config=pk.SparseMLAGpuConfig(block_k=16, dkv_mode=dkv_mode))


def test_gpu_column_chunks():
    assert gpu.pow2_chunks(0, 512) + gpu.pow2_chunks(512, 576) == [(0, 512), (512, 64)]
    assert gpu.pow2_chunks(0, 80) == [(0, 64), (64, 16)]
    assert gpu.default_splits(64, 2048, 64) == 4 and gpu.default_splits(8192, 2048, 64) == 1


# ----------------------------------------------------------------------------- compilation

DECODE = (2, 1, 64, 576, 512, 8192, 2048)     # B, S, H, Dk, v, T, K
PREFILL = (1, 256, 64, 576, 512, 4096, 2048)
TRAIN = (1, 4096, 16, 576, 512, 8192, 2048)
#: Bytes of pair gradients per backward query chunk in the compile tests: 32 queries, since
#: XLA's compile time grows with the chunk (the default chunk's is in sparse_mla_tpu_aot.py).
CHUNK_BUDGET = 32 * 2048 * 2560


def _shapes(shape, sharding=None):
    B, S, Hh, Dk, _, Tt, K = shape
    kw = {} if sharding is None else {"sharding": sharding}
    return (jax.ShapeDtypeStruct((B, S, Hh, Dk), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, Tt, Dk), jnp.bfloat16, **kw),
            jax.ShapeDtypeStruct((B, S, K), jnp.int32, **kw))


def _fwd_and_grad(module, v_dim):
    def fwd(q, kv, idx):
        return module.sparse_mla(q, kv, idx, sm_scale=0.04, v_dim=v_dim)

    def grad(q, kv, idx):
        loss = lambda q, kv: fwd(q, kv, idx)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(q, kv)

    return fwd, grad


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
@pytest.mark.parametrize("shape", [DECODE, PREFILL, TRAIN], ids=["decode", "prefill", "train"])
def test_tpu_kernels_compile_ahead_of_time(topology, shape):
    """Decode: the forward; prefill (64 heads) and train (16 heads, 4096 queries): forward +
    deterministic backward (pairs and reduce kernels) with a prebuilt transposed index."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = tpu_compile_mesh(topology)
    if shape is DECODE:
        fwd = jax.shard_map(_fwd_and_grad(tpu, shape[4])[0], mesh=mesh, in_specs=(P(), P(), P()),
                            out_specs=P(), check_vma=False)
        compiled = jax.jit(fwd).lower(*_shapes(shape, NamedSharding(mesh, P()))).compile()
        kernels = ["sparse_mla_fwd"]
    else:
        args = aot.abstract_inputs(mesh, *shape[:4], *shape[5:], budget=CHUNK_BUDGET)
        compiled = aot.compile_gradient(mesh, args, v_dim=shape[4],
                                        config=pk.SparseMLATpuConfig(bwd_budget=CHUNK_BUDGET))
        kernels = ["sparse_mla_fwd", "sparse_mla_bwd_pairs", "sparse_mla_bwd_reduce"]
    text = compiled.as_text()
    assert all(name in text for name in kernels)
    assert compiled.memory_analysis() is not None


def test_gpu_kernels_lower_to_triton_for_h200():
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    args = _shapes(DECODE)
    with jax.sharding.use_abstract_mesh(mesh):
        # the gradient: the forward, then the sorted backward's pairs, dq and per-row reduce kernels
        for fn, calls in zip(_fwd_and_grad(gpu, DECODE[4]), (1, 4)):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == calls
