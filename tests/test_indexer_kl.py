"""The GPU indexer cross-entropy kernels (`indexer_cross_entropy.gpu`) beyond the contract: several query
chunks and slot blocks, bf16, bitwise-repeatable gradients (in Pallas interpret mode on the
CPU), and their Triton lowering for an H200 beside the sparse MLA forward that writes the target;
the TPU sparse MLA forward's target (interpret mode, and compiled ahead of time for a v5p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from conftest import tpu_compile_mesh
from kernel_contract import (check_indexer_cross_entropy, check_sparse_mla_target, cross_entropy_inputs,
                             np_indexer_cross_entropy, sparse_inputs)
from pallas_kernels.sparse_mla import gpu as attention_gpu, tpu as attention_tpu
from pallas_kernels.indexer_cross_entropy import gpu

#: Slots per block and a budget of 2 queries' pair gradients (float32, K = 37, D = 12): 3 chunks.
SMALL = pk.IndexerKLGpuConfig(block_k=16, budget=2 * 37 * 16 * 4, reduce_block=4)


def _loss(q, k, w, idx, target, *, config):
    return jnp.sum(pk.indexer_cross_entropy(q, k, w, idx, target, impl="pallas_gpu", config=config,
                                            interpret=True) ** 2)


_grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)), static_argnames="config")


def test_chunks_and_blocks_match_the_oracle_and_repeat_bitwise():
    """3 query chunks of the backward's pair gradients, 3 slot blocks with a padded tail: the
    contract's checks, and the same gradient bits on a second run."""
    inputs = cross_entropy_inputs(23, B=1, S=5, T=30, K=37, H=3, D=12)
    check_indexer_cross_entropy("pallas_gpu", *inputs, config=SMALL)
    first, second = _grads(*inputs, config=SMALL), _grads(*inputs, config=SMALL)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_inputs():
    q, k, w, idx, target = cross_entropy_inputs(5, B=2, S=3, T=40, K=20, H=3, D=16, dtype=jnp.bfloat16)
    got = pk.indexer_cross_entropy(q, k, w, idx, target, impl="pallas_gpu", config=SMALL, interpret=True)
    want = np_indexer_cross_entropy(q, k, w, idx, target)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-2, atol=2e-2)
    dq, dk, dw = _grads(q, k, w, idx, target, config=SMALL)
    assert dq.dtype == dk.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


def test_lowers_to_triton_for_h200():
    """At GLM shapes (16 and 32 indexer heads of 128, top-2048): the forward kernel, the
    backward's pairs and reduce kernels; and the sparse MLA forward writing the target."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    s = jax.ShapeDtypeStruct
    ce = lambda q, k, w, i, t: gpu.indexer_cross_entropy(q, k, w, i, t)
    grad = jax.grad(lambda *a: jnp.sum(ce(*a)), argnums=(0, 1, 2))
    attend = lambda q, kv, i: attention_gpu.sparse_mla(q, kv, i, sm_scale=0.04, v_dim=512, return_target=True)
    with jax.sharding.use_abstract_mesh(mesh):
        for heads in (16, 32):
            args = (s((1, 8, heads, 128), jnp.bfloat16), s((1, 4096, 128), jnp.bfloat16),
                    s((1, 8, heads), jnp.float32), s((1, 8, 2048), jnp.int32), s((1, 8, 2048), jnp.float32))
            for fn, kernels in ((ce, 1), (grad, 3)):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("xla.gpu.triton") == kernels
        args = (s((1, 8, 16, 576), jnp.bfloat16), s((1, 4096, 576), jnp.bfloat16), s((1, 8, 2048), jnp.int32))
        text = jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1


def test_tpu_forward_writes_the_target():
    """The TPU forward's target from the logits it keeps in VMEM (2 blocks of 16 slots), in
    interpret mode; and the kernel compiled ahead of time for a v5p at GLM shapes."""
    q, kv, idx = sparse_inputs(31, B=2, S=2, T=40, K=20, H=3, Dk=48)
    check_sparse_mla_target("pallas_tpu", q, kv, idx, sm_scale=0.2, v_dim=32, config=pk.SparseMLATpuConfig(block_k=16))
    mesh = tpu_compile_mesh("v5p:2x2x1")
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=spec) for shape, dtype in
            (((1, 16, 16, 576), jnp.bfloat16), ((1, 4096, 576), jnp.bfloat16), ((1, 16, 2048), jnp.int32))]
    attend = lambda q, kv, i: attention_tpu.sparse_mla(q, kv, i, sm_scale=0.04, v_dim=512, return_target=True)
    wrapped = jax.shard_map(attend, mesh=mesh, in_specs=(spec.spec,) * 3, out_specs=spec.spec, check_vma=False)
    assert "sparse_mla" in jax.jit(wrapped).lower(*args).compile().as_text()
