"""Sparse MLA forward + backward (`impl="pallas_tpu"`, the deterministic `tpu_backward`) compiled
ahead of time for TPU topologies, beside the XLA impl compiled the same way: XLA's memory plan
and cost analysis per chip, without a TPU (needs libtpu).

    PYTHONPATH=. python3 benchmarks/sparse_mla_tpu_aot.py                  # v5p, v6e, tpu7x
    PYTHONPATH=. python3 benchmarks/sparse_mla_tpu_aot.py --seq-len 256 --topology v5p:2x2x1
    PYTHONPATH=. python3 benchmarks/sparse_mla_tpu_aot.py --paged          # the paged decode kernels

Shape: B=1, S queries, 16 heads, Dk 576, v 512, T = 8192 keys, top-2048, bf16; the gradient of
sum(out) in q and kv, with the transposed index prebuilt (an input, as an IndexShare group
shares it; its sort is compiled apart). Prints per topology: compile seconds, arguments,
outputs and temporaries (bytes), XLA's flops and bytes accessed, and this design's own count.
XLA's cost analysis counts the body of a loop once: the backward's query chunks run in a
lax.scan, so its figures cover one chunk of the backward. Speed is not measured (no TPU).

--paged: the paged decode forward (`paged_sparse_mla`) and the paged indexer's top-k
(`paged_indexer_topk`) at decode (one query per sequence, 64 heads, top-2048) over a store of
several layer slots of 64-row pages, pinned row-major as the decode step keeps the cache
(`glm_jax.aot`), beside the store's own bytes: temporaries near the store's size are a copy of
it made before the kernel; the XLA impls compiled the same way are the baseline.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.sparse_mla import tpu, tpu_backward
from pallas_kernels.sparse_mla import transpose as tr

TOPOLOGIES = ("v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
HEADS, DK, DV, KEYS, TOPK = 16, 576, 512, 8192, 2048
SCALE = 192 ** -0.5


def abstract_inputs(mesh, batch, seq_len, heads, dk, num_keys, topk, *, budget):
    """ShapeDtypeStructs on the mesh: q [B, S, H, Dk] and kv [B, T, Dk] bf16, indices int32
    [B, S, K], and the transposed index for query chunks of `budget` bytes."""
    sh = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    idx = spec((batch, seq_len, topk), jnp.int32)
    chunk = tpu_backward.default_chunk_rows(batch * seq_len, topk, dk, budget)
    tindex = jax.eval_shape(lambda i: tr.transpose_index(i, num_keys, chunk_rows=chunk), idx)
    tindex = jax.tree.map(lambda x: spec(x.shape, x.dtype), tindex)
    return (spec((batch, seq_len, heads, dk), jnp.bfloat16), spec((batch, num_keys, dk), jnp.bfloat16),
            idx, tindex)


def compile_gradient(mesh, args, *, v_dim, impl="pallas_tpu", config=None):
    """The compiled gradient in (q, kv) of sum(out) of sparse_mla(impl) on a one-device mesh
    (`args` from abstract_inputs; the tindex reaches only pallas_tpu)."""

    def grad(q, kv, idx, tindex):
        def loss(q, kv):
            if impl == "pallas_tpu":
                out, _ = tpu.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=v_dim, tindex=tindex,
                                        config=config or pk.SparseMLATpuConfig())
            else:
                out, _ = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=v_dim, impl=impl, config=config)
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(q, kv)

    wrapped = jax.shard_map(grad, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P(),
                            check_vma=False)
    return jax.jit(wrapped).lower(*args).compile()


def design_count(seq_len, heads, dk, v_dim, topk, num_keys, budget):
    """(flops, HBM bytes) of forward + backward by this design's own count (tpu_backward)."""
    pairs = seq_len * topk
    chunks = -(-seq_len // tpu_backward.default_chunk_rows(seq_len, topk, dk, budget))
    row = tpu_backward.pair_row_bytes(dk)
    flops = 2 * pairs * heads * (dk + v_dim) + 2 * pairs * heads * (3 * dk + 2 * v_dim) \
        + 2 * pairs * tpu_backward.DEFAULT_REDUCE_ROWS * dk
    nbytes = pairs * (2 * dk * 2 + 2 * row) + chunks * 2 * num_keys * dk * 4
    return flops, nbytes


def _cost(compiled):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost.get("flops", float("nan")), cost.get("bytes accessed", float("nan"))


def report(topology, seq_len, budget):
    from glm_jax.aot import topology_devices

    mesh = Mesh(np.array(topology_devices(topology))[:1], ("x",))
    args = abstract_inputs(mesh, 1, seq_len, HEADS, DK, KEYS, TOPK, budget=budget)
    config = pk.SparseMLATpuConfig(bwd_budget=budget)
    for impl in ("pallas_tpu", "xla"):
        start = time.perf_counter()
        compiled = compile_gradient(mesh, args, v_dim=DV, impl=impl,
                                    config=config if impl == "pallas_tpu" else None)
        seconds = time.perf_counter() - start
        m = compiled.memory_analysis()
        flops, nbytes = _cost(compiled)
        print(f"| {topology} | {impl} | {seconds:.0f} | {m.argument_size_in_bytes / 2**20:.0f} | "
              f"{m.output_size_in_bytes / 2**20:.0f} | {m.temp_size_in_bytes / 2**20:.0f} | "
              f"{flops / 1e9:.0f} | {nbytes / 2**30:.2f} |")


PAGED = dict(batch=8, heads=64, pages_per_sequence=512, page_size=64, slots=4, index_heads=32, index_dim=128)


def paged_inputs(mesh, *, batch, heads, pages_per_sequence, page_size, slots, index_heads, index_dim):
    """ShapeDtypeStructs on the mesh: (sparse MLA args, indexer args) of one decode step over
    stores [slots, batch * pages_per_sequence + 1, page_size, D] bf16 (a scratch page added),
    pinned row-major."""
    sh = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    pages = batch * pages_per_sequence + 1
    store = lambda width: jax.ShapeDtypeStruct((slots, pages, page_size, width), jnp.bfloat16,
                                               sharding=Format(Layout(major_to_minor=(0, 1, 2, 3)), sh))
    table = spec((batch, pages_per_sequence), jnp.int32)
    mla = (spec((batch, 1, heads, DK), jnp.bfloat16), store(DK), table,
           spec((batch, 1, TOPK), jnp.int32), spec((), jnp.int32))
    indexer = (spec((batch, 1, index_heads, index_dim), jnp.bfloat16),
               store(index_dim), table,
               spec((batch, 1, index_heads), jnp.float32), spec((batch, 1), jnp.int32), spec((batch,), jnp.int32),
               spec((), jnp.int32))
    return mla, indexer


def compile_paged(mesh, op, args, impl):
    """paged_sparse_mla (args: q, store, table, indices, slot) or paged_indexer_topk (args: q,
    store, table, weights, q_pos, kv_len, slot) of `impl`, compiled on a one-device mesh."""
    if op == "paged_sparse_mla":
        fn = lambda q, store, table, idx, slot: pk.paged_sparse_mla(
            q, store, table, idx, slot=slot, sm_scale=SCALE, v_dim=DV, impl=impl)
    else:
        fn = lambda q, store, table, w, pos, n, slot: pk.paged_indexer_topk(
            q, store, table, w, topk=TOPK, q_pos=pos, kv_len=n, slot=slot, impl=impl)
    wrapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)
    return jax.jit(wrapped).lower(*args).compile()


def report_paged(topology):
    from glm_jax.aot import topology_devices

    mesh = Mesh(np.array(topology_devices(topology))[:1], ("x",))
    for op, args in zip(("paged_sparse_mla", "paged_indexer_topk"), paged_inputs(mesh, **PAGED)):
        store = args[1].size * args[1].dtype.itemsize
        for impl in ("pallas_tpu", "xla"):
            m = compile_paged(mesh, op, args, impl).memory_analysis()
            print(f"| {topology} | {op} | {impl} | {store / 2**20:.0f} | {m.temp_size_in_bytes / 2**20:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--topology", nargs="*", default=list(TOPOLOGIES))
    parser.add_argument("--budget", type=int, default=tpu_backward.DEFAULT_BUDGET,
                        help="bytes of one query chunk's pair gradients (SparseMLATpuConfig.bwd_budget)")
    parser.add_argument("--paged", action="store_true", help="the paged decode kernels instead (module docstring)")
    a = parser.parse_args()
    if a.paged:
        print(f"decode: {PAGED}, Dk={DK} v={DV} K={TOPK} bf16")
        print("| topology | op | impl | store MiB | temporaries MiB |")
        print("|---|---|---|---|---|")
        for topology in a.topology:
            report_paged(topology)
        return
    chunk = tpu_backward.default_chunk_rows(a.seq_len, TOPK, DK, a.budget)
    flops, nbytes = design_count(a.seq_len, HEADS, DK, DV, TOPK, KEYS, a.budget)
    print(f"B=1 S={a.seq_len} H={HEADS} Dk={DK} v={DV} T={KEYS} K={TOPK} bf16; query chunk {chunk}; "
          f"this design's count for forward + backward: {flops / 1e9:.0f} GFLOP, {nbytes / 2**30:.2f} GiB")
    print("| topology | impl | compile s | arguments MiB | outputs MiB | temporaries MiB | "
          "XLA GFLOP | XLA GiB accessed |")
    print("|---|---|---|---|---|---|---|---|")
    for topology in a.topology:
        report(topology, a.seq_len, a.budget)


if __name__ == "__main__":
    main()
